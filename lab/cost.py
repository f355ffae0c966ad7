"""
Where the blind spot costs: the cost grid (lab/grid.py COST), its predictions, its margin and its families.

    python -m lab.cost --run                          # train the grid (43 runs, about 5 hours on 2 cores)
    python -m lab.cost 'figures/cost/runs/*' --fig_dir=figures/cost    # the tables, from the committed logs

The grid: under the paper's init, K = 4, 1,000 steps evaluated every 100, paired by seed, a factorial of the
stack (2 or 4 layers x 128 wide), the learning rate (3e-3 or 1e-3) and the readout (rmsnorm or raw), 3 seeds a
cell and 5 in the 4-layer 1e-3 cell; a norm-penalty dose-response in that cell (rmsnorm + lambda 0.001, 0.01,
0.1: the scale moves, the readout does not); and one-loop baselines there (K = 1, the same unique layers).
Every run logs, at every evaluation, the loss and ||h_k|| at depths 1..2K and the turn of the state at every
loop (the angle between h_{k-1} and h_k); when it finishes, the grid measures its checkpoint's precision hazard
(lab/diagnose.py precision_losses: the loss at K and 2K in float32, with a bf16 state and under bf16 autocast)
into precision.json beside its log, since checkpoints are not committed.

The predictions below were written and committed before any run of the grid; the tables set each beside its
measurement.
"""

import json
import os

from lab.grid import COST, COST_SEEDS, LogError, load_run, run_grid
from lab.report import fail, run_main, runs_flags, split_flags, tool_parser, write_text

PROG = 'python -m lab.cost'

# The equivalence margin, in nats of validation cross-entropy: a difference inside +-0.02 is 2% of perplexity,
# smaller than the spread between seeds of one condition here (0.01-0.03 in the atlas), so it is a difference
# no single run could show and no reader would act on.
MARGIN = 0.02
ALPHA = 0.05  # the family-wise error rate Holm's correction holds each family to
# The families Holm's correction runs over: each is one question asked of several comparisons at once.
FAMILIES = {
    'cost': 'rmsnorm - raw at depth K, final step, in each of the 4 cells of the factorial (4 comparisons)',
    'interactions': 'the change of that cost with the stack (4 layers - 2), with the rate (1e-3 - 3e-3), and '
                    'their interaction, each a difference of paired cell means (3 comparisons)',
    'penalty': 'rmsnorm + lambda - rmsnorm at depth K in the 4-layer 1e-3 cell, lambda 0.001, 0.01, 0.1 '
               '(3 comparisons)',
    'one loop': 'K = 4 at depth 4 - K = 1, per readout, in the 4-layer 1e-3 cell (2 comparisons)',
    'precision': 'bf16 - float32 at depths K and 2K, per readout and per bf16 mode, over the K = 4 checkpoints '
                 'of the factorial (8 comparisons)',
}

# What the design rule predicts, written before the grid ran. The rule: a scale-invariant readout hides ||h||
# from the loss, so under residual recurrence the state grows, and a large state is turned little by each
# later pass (the turn shrinks like 1/||h||); so the blind spot costs where the later loops are needed and
# rmsnorm's cannot do their work, which should be the deeper stack (more layers a pass: more growth a pass)
# and the lower rate (raw's loops have time to be useful before rmsnorm's are shut out). The cost is
# rmsnorm - raw at depth K: positive means the blind spot costs.
PREDICTIONS = {
    'cost L2-lr3e-3': 'lower: rmsnorm below raw by about 0.05 (the demo and the atlas, where rmsnorm wins)',
    'cost L2-lr1e-3': 'no cost beyond the margin: rmsnorm - raw < +0.02',
    'cost L4-lr3e-3': 'higher: a cost of about +0.05',
    'cost L4-lr1e-3': 'higher: a cost of about +0.10 (the 1,500-step deep runs: +0.127)',
    'interaction depth': 'the cost grows with the stack: (L4 - L2) > 0, by about 0.1',
    'interaction rate': 'the cost grows at the lower rate: (1e-3 - 3e-3) > 0, less than the stack does',
    'interaction depth x rate': 'not resolved (3 seeds cannot bound a second-order effect)',
    'penalty norm': '||h_K|| falls with lambda, every step of the dose: above 100 at 0.001, below 60 at 0.1',
    'penalty loss': 'the loss at K falls with lambda; at 0.1 rmsnorm + penalty is lower than rmsnorm and closes '
                    'at least half of the gap to raw',
    'one loop raw': 'lower: raw K = 4 beats raw K = 1 by more than 0.1 (its loops do work)',
    'one loop rmsnorm': 'not lower beyond the margin: rmsnorm K = 4 - K = 1 > -0.02 (its loops do little)',
    'useful loops': 'in the 4-layer cells rmsnorm has at most 1 of its 3 later loops gaining more than the '
                    'margin, raw at least 2',
    'turn': 'at loops 2..K the state turns less than 5 degrees under rmsnorm and more than 5 under raw',
    'norm': '||h_K|| above 100 under rmsnorm and below 30 under raw, in every K = 4 cell',
    'precision': 'equivalent within the margin: a bf16 state and bf16 autocast change the loss at K by less '
                 'than 0.02 under both readouts; at 2K rmsnorm moves more than raw, still within the margin',
}

PRECISION_WINDOWS = 64  # validation windows of block_size tokens each precision.json is measured on


def measure_precision(folder):
    """precision.json beside a finished run's log: precision_losses on its checkpoint, once (a run folder that
    already has it is left alone). The checkpoint is read as every tool reads one: weights only, with the data
    it was trained on, checked."""
    path = os.path.join(folder, 'precision.json')
    if os.path.exists(path):
        return
    from lab.diagnose import precision_losses, val_tokens, windows  # the grid alone needs them
    from lab.runs import load_model
    model, ckpt = load_model(os.path.join(folder, 'ckpt.pt'))
    x, y = windows(val_tokens(ckpt, name=folder), model.config.block_size, PRECISION_WINDOWS)
    losses = precision_losses(model, x, y, model.config.n_loop)
    record = {'step': ckpt['step'], 'windows': len(x), 'depths': [model.config.n_loop, 2 * model.config.n_loop],
              **losses}
    write_text(path, json.dumps(record) + '\n')
    print(f"{path}: " + ', '.join(f"{mode} {v[0]:.4f} / {v[1]:.4f}" for mode, v in losses.items()), flush=True)


def get_parser():
    p = tool_parser(PROG, __doc__)
    runs_flags(p, 'the cost grid', 'laptop', os.path.join('out', 'cost'), '--device=cpu')
    p.add_argument('--seeds', type=int, default=5,
                   help='--run: seeds 1..N of each cell, each cell capped at its own count (3, or 5)')
    return p


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    extra = split_flags(p, args.train_args)
    if not args.run and not args.runs:
        p.error("name run folders to read, or pass --run to train the grid")
    if args.run:
        run_grid(args.config, range(1, args.seeds + 1), args.out_root, extra, grid=COST, prog=PROG,
                 max_seed=COST_SEEDS, after=measure_precision)
    try:
        for folder in args.runs:
            load_run(folder)
    except LogError as e:
        fail(PROG, e)


if __name__ == '__main__':
    run_main(main, PROG)
