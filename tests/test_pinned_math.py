"""The math of every design, pinned: for each configuration below, at a fixed seed, the loss, the per-loop
cross-entropies and norms, the loss past K, and every parameter's value and gradient (as sums), against the
values written in tests/data/pinned_math.json. Moving code (the model file apart from the designs, a design
into the lab) must leave all of them as they were; a change to the math must rewrite the file on purpose:

    python tests/test_pinned_math.py --write    # only after a change that is meant to change the numbers
"""

import argparse
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lab.designs import DesignConfig as LoopedConfig, DesignedGPT as LoopedGPT, sampled_depth  # noqa: E402

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'pinned_math.json')
SHAPE = dict(vocab_size=13, block_size=12, n_embd=16, n_head=2, n_layer=2, n_loop=3)
CASES = {
    'paper': {}, 'layernorm': {'readout': 'layernorm'}, 'raw': {'readout': 'raw'},
    'final_norm': {'readout': 'final_norm'}, 'alpha': {'readout': 'alpha'},
    'alpha fixed': {'readout': 'alpha', 'alpha': 0.3}, 'terminal': {'supervision': 'terminal'},
    'normed': {'recurrence': 'normed'}, 'penalty': {'norm_penalty': 0.01}, 'dropout': {'dropout': 0.1},
    'gpt2': {'init': 'gpt2'}, 'small embed': {'init': 'paper_small_embed'}, 'untied': {'tie_weights': False},
    'gelu': {'mlp': 'gelu'}, 'manual': {'attention': 'manual'}, 'eps': {'norm_eps': 1e-3},
    'damped': {'recurrence': 'damped'}, 'gated': {'supervision': 'gated'},
    'gated readout': {'supervision': 'gated', 'gate_input': 'readout', 'gate_beta': 0.3},
    'add': {'injection': 'add'}, 'concat': {'injection': 'concat'}, 'diagonal': {'injection': 'diagonal'},
    'prelude coda': {'n_prelude': 1, 'n_coda': 1}, 'sandwich': {'block': 'sandwich'},
    'deepnorm': {'block': 'deepnorm'}, 'update / K': {'residual_scale': 'inverse_k'}, 'bptt': {'bptt': 1},
    'jacobian': {'jacobian_penalty': 0.1}, 'sampled depth': {'depth_sampling': 'poisson_lognormal'},
    'nanochat': {'n_prelude': 1, 'n_coda': 1, 'injection': 'concat', 'block': 'sandwich',
                 'recurrence': 'normed', 'init': 'gpt2'},
    'parcae': {'n_prelude': 1, 'n_coda': 1, 'injection': 'diagonal', 'readout': 'raw'},
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


def write():
    os.makedirs(os.path.dirname(PATH), exist_ok=True)
    with open(PATH, 'w') as f:
        json.dump({name: measure(fields) for name, fields in CASES.items()}, f, indent=1, sort_keys=True)
        f.write('\n')


@pytest.mark.parametrize('name', list(CASES))
def test_a_design_computes_what_it_computed_when_pinned(name):
    with open(PATH) as f:
        pinned = json.load(f)[name]
    now = measure(CASES[name])
    assert sorted(now) == sorted(pinned), f"{name}: the parameters or the stats differ from the pinned ones"
    for key, value in pinned.items():
        if value is None:
            assert now[key] is None, f"{name}: {key} has a gradient now"
        else:
            assert now[key] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{name}: {key} changed"


def get_parser():
    p = argparse.ArgumentParser(description='Rewrite the pinned values, only after a change meant to change the math.')
    p.add_argument('--write', action='store_true', required=True, help=f'write {os.path.relpath(PATH)} afresh')
    return p


if __name__ == '__main__':
    get_parser().parse_args()
    write()
    print(f"wrote {PATH}")
