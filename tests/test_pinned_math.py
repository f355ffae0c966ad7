"""The math of every design, pinned: for each configuration below, at a fixed seed, the loss, the per-loop
cross-entropies and norms, the loss past K, and every parameter's value and gradient (as sums), against the
values written in tests/data/pinned_math.json. Moving code (the model file apart from the designs, a design
into the lab) must leave all of them as they were; a change to the math must rewrite the file on purpose. Each
design's cases come from its entry in lab/designs.py's DESIGNS; a new design's case fails until it is pinned:

    python tests/test_pinned_math.py --missing          # only the cases not pinned yet (a new design's)
    python tests/test_pinned_math.py --case='update / K'  # one case afresh (repeatable)
    python tests/test_pinned_math.py --write            # every case: only after a change meant to change them all
"""

import argparse
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lab.designs import DesignConfig as LoopedConfig, DesignedGPT as LoopedGPT, pinned_cases, sampled_depth  # noqa: E402

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'pinned_math.json')
SHAPE = dict(vocab_size=13, block_size=12, n_embd=16, n_head=2, n_layer=2, n_loop=3)
# the paper's model's cases here; each design's from its entry in lab/designs.py's DESIGNS (pinned_cases)
CASES = {
    'paper': {}, 'layernorm': {'readout': 'layernorm'}, 'raw': {'readout': 'raw'},
    'final_norm': {'readout': 'final_norm'}, 'alpha': {'readout': 'alpha'},
    'alpha fixed': {'readout': 'alpha', 'alpha': 0.3}, 'terminal': {'supervision': 'terminal'},
    'normed': {'recurrence': 'normed'}, 'penalty': {'norm_penalty': 0.01}, 'dropout': {'dropout': 0.1},
    'untied': {'tie_weights': False}, 'eps': {'norm_eps': 1e-3}, **pinned_cases(),
}


def measure(fields):
    """Everything pinned for one configuration, as plain floats."""
    config = LoopedConfig(**SHAPE, **fields)
    torch.manual_seed(0)
    model = LoopedGPT(config)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(config.vocab_size, (2, config.block_size), generator=g)
    y = torch.randint(config.vocab_size, (2, config.block_size), generator=g)
    torch.manual_seed(2)  # dropout and the Jacobian penalty's random direction
    _, loss, stats = model(x, y)
    loss.backward()
    model.eval()
    with torch.no_grad():
        past_k = model(x, y, n_loop=2 * config.n_loop)[2]
        last = model(x)[0]
    out = {'loss': loss.item(), 'ce': stats['ce'].tolist(), 'hidden_norm': stats['hidden_norm'].tolist(),
           'ce_2K': past_k['ce'].tolist(), 'next_logits': last.sum().item(),
           'depths': [sampled_depth(config, 5, step) for step in range(8)]}
    for key in ('exit_prob', 'gate_logit', 'jacobian'):
        if key in stats:
            out[key] = stats[key].flatten().tolist()
    for name, p in model.named_parameters():
        out[f'param {name}'] = p.detach().double().sum().item()
        out[f'grad {name}'] = None if p.grad is None else p.grad.double().abs().sum().item()
    return out


def read():
    if not os.path.exists(PATH):
        return {}
    with open(PATH) as f:
        return json.load(f)


def write(names=None):
    """Measure the cases named (None: every case) and write them beside the others pinned already."""
    pinned = read()
    pinned.update({name: measure(CASES[name]) for name in (CASES if names is None else names)})
    os.makedirs(os.path.dirname(PATH), exist_ok=True)
    with open(PATH, 'w') as f:
        json.dump(pinned, f, indent=1, sort_keys=True)
        f.write('\n')


@pytest.mark.parametrize('name', list(CASES))
def test_a_design_computes_what_it_computed_when_pinned(name):
    pinned = read().get(name)
    assert pinned is not None, (f"{name}: not pinned yet; pin it alone with python tests/test_pinned_math.py "
                                f"--case='{name}' (or every case not pinned yet with --missing)")
    now = measure(CASES[name])
    assert sorted(now) == sorted(pinned), f"{name}: the parameters or the stats differ from the pinned ones"
    for key, value in pinned.items():
        if value is None:
            assert now[key] is None, f"{name}: {key} has a gradient now"
        else:
            assert now[key] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{name}: {key} changed"


def get_parser():
    p = argparse.ArgumentParser(description='Pin the math: write the values of some cases, or of every one, to '
                                            f'{os.path.relpath(PATH)}; rewrite a case pinned already only after a '
                                            'change meant to change its numbers.')
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument('--write', action='store_true', help='write every case afresh')
    what.add_argument('--case', action='append', choices=list(CASES), metavar='NAME',
                      help=f"write this case alone (repeatable): {', '.join(CASES)}")
    what.add_argument('--missing', action='store_true', help='write only the cases not pinned yet (a new design\'s)')
    return p


if __name__ == '__main__':
    args = get_parser().parse_args()
    names = None if args.write else args.case or [name for name in CASES if name not in read()]
    if names != []:
        write(names)
    print(f"wrote {'every case' if names is None else ', '.join(names) or 'nothing (every case is pinned)'} "
          f"to {PATH}")
