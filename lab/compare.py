"""
Is this checkout's model slower than another's? Times the training step and cached generation of
this checkout's looped.py against the looped.py of another checkout (an older commit, say), in one
process, with the same weights, in alternating rounds, so that the machine's drift hits both alike.

    git worktree add /tmp/before <commit>
    python -m lab.compare --against=/tmp/before                 # the laptop model, random weights
    python -m lab.compare --against=/tmp/before --ckpt=out/laptop --rounds=30 --gen_rounds=16

A round is 5 training steps (forward, backward, AdamW on one batch of 16 x block_size) of each
model, the order flipped every round; the table gives the median of the paired ratios and the ratio
of the fastest rounds. Generation is 256 greedy tokens (--tokens) through a KV cache, batches of 1
and 8, after a check that both give the same tokens (the other checkout's own cached generate, or
this checkout's engine on its model when its looped.py has only the plain one). --against=. measures
the noise.
"""

from dataclasses import asdict
import argparse
import dataclasses
import importlib.util
import inspect
import os
import statistics
import time

import torch

from lab import engine
from lab.designs import DesignConfig, DesignedGPT
from lab.report import fail, one_line_errors
from lab.runs import load_checkpoint

PROG = 'python -m lab.compare'


def load_other(root):
    """The other checkout's looped.py as a module of its own name (both are 'looped' on disk)."""
    path = os.path.join(root, 'looped.py')
    if not os.path.isfile(path):
        fail(PROG, f"--against={root}: no looped.py there")
    spec = importlib.util.spec_from_file_location('looped_against', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def twins(other, ckpt):
    """(theirs, ours): the same weights in both, from ckpt or the laptop config's random init."""
    if ckpt:
        path = os.path.join(ckpt, 'ckpt.pt') if os.path.isdir(ckpt) else ckpt
        try:
            state = load_checkpoint(path, 'cpu')
        except ValueError as e:
            fail(PROG, e)
        config, weights = state['config'], state['model']
    else:
        torch.manual_seed(0)
        config = asdict(DesignConfig())
        weights = DesignedGPT(DesignConfig(**config)).state_dict()
    # the other checkout's looped.py alone: the paper's model, or (before the designs moved to lab/) every design
    known, defaults = {f.name for f in dataclasses.fields(other.LoopedConfig)}, asdict(DesignConfig())
    missing = [name for name, value in config.items() if name not in known and value != defaults[name]]
    if missing:
        fail(PROG, f"the other checkout's looped.py has no {', '.join(missing)}: compare a model of the paper's "
                   "fields alone")
    theirs = other.LoopedGPT(other.LoopedConfig(**{n: v for n, v in config.items() if n in known}))
    models = [theirs, DesignedGPT(DesignConfig(**config))]
    for model in models:
        model.load_state_dict(weights)
    return models


def cached(model, prompt, n):
    """n greedy tokens through the KV cache: the model's own generate in a checkout from before generation moved
    into lab/engine.py, this checkout's engine after (with a plain generate, the model has no cache)."""
    if 'cache' in inspect.signature(model.generate).parameters:
        return model.generate(prompt, n, top_k=1, cache=True)
    return engine.generate(model, prompt, n, top_k=1)


def alternate(work, rounds):
    """work = {name: fn}; every round times each fn once, the order flipped every other round.
    Returns {name: [seconds per round]}."""
    times = {name: [] for name in work}
    for r in range(rounds):
        for name in (list(work) if r % 2 == 0 else list(work)[::-1]):
            t0 = time.perf_counter()
            work[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def ratio_row(what, times, per):
    """A table row: each one's fastest round per unit; after / before, paired median and fastest."""
    before, after = times['before'], times['after']
    paired = statistics.median(a / b for a, b in zip(after, before))
    return (f"| {what} | {min(before) * per:.1f} | {min(after) * per:.1f} | {paired:.3f} | "
            f"{min(after) / min(before):.3f} |")


def get_parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split('\n\n')[0].strip())
    one_line_errors(p, PROG)  # a bad flag is one line, as in every other tool
    p.add_argument('--against', required=True, help='the root of the other checkout')
    p.add_argument('--ckpt', default=None, help='a run folder or ckpt.pt (default: random weights)')
    p.add_argument('--rounds', type=int, default=10, help='training rounds of 5 steps each')
    p.add_argument('--gen_rounds', type=int, default=8, help='generation rounds per batch size')
    p.add_argument('--tokens', type=int, default=256, help='tokens generated in a round')
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    if min(args.rounds, args.gen_rounds, args.tokens) < 1:
        fail(PROG, "need --rounds, --gen_rounds and --tokens of at least 1")
    theirs, ours = twins(load_other(args.against), args.ckpt)
    V, T = ours.config.vocab_size, ours.config.block_size
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, {ours.num_params():,} params")
    print('| measure | before | after | after / before, paired median | after / before, fastest |')
    print('|---|---|---|---|---|')
    g = torch.Generator().manual_seed(0)
    for model in (theirs, ours):
        model.eval()
    for B in (1, 8):
        prompt = torch.randint(V, (B, T // 2), generator=g)
        same = cached(theirs, prompt, args.tokens)[0]
        if not torch.equal(same, engine.generate(ours, prompt, args.tokens, top_k=1)[0]):
            fail(PROG, "the two checkouts generate different tokens: not the same model")
        work = {'before': lambda: cached(theirs, prompt, args.tokens),
                'after': lambda: engine.generate(ours, prompt, args.tokens, top_k=1)}
        print(ratio_row(f"cached generation, batch {B} (ms a token)",
                        alternate(work, args.gen_rounds), 1000 / args.tokens))
    x = torch.randint(V, (16, T), generator=g)
    y = torch.roll(x, -1, dims=1)
    steps = {}
    for name, model in (('before', theirs), ('after', ours)):
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def five_steps(model=model, optimizer=optimizer):
            for _ in range(5):
                model(x, y)[1].backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        five_steps()  # warm-up: the first steps allocate
        steps[name] = five_steps
    print(ratio_row('training step (ms)', alternate(steps, args.rounds), 1000 / 5))


if __name__ == '__main__':
    main()
