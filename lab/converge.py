"""
Cost or delay: the cost grid's resolved costs (lab/cost.py) asked again at convergence and at each readout's
own best learning rate, with two controls and a test of the mechanism that can fail.

    python -m lab.converge --run                      # train the runs (about 75,000 steps: 6-9 hours, 2 cores)
    python -m lab.converge --run --part=2/2           # a second worker beside the first (--part=1/2)
    python -m lab.converge 'out/converge/laptop/*'    # the tables and figures, from the runs' logs

Why: the cost grid resolved a cost of rmsnorm against raw (+0.148 at 4 layers and lr 1e-3) only at the rate
that is worse for both readouts, after 1,000 steps at a constant rate, on curves still falling. A cost that
vanishes once both models are trained is a delay, not a cost. The runs here:

- the convergence check: 4 layers x 128, K = 4, paper init, lr 1e-3 and 3e-3, a 100-step linear warmup then
  nanoGPT's cosine decay to lr / 10 at step 3,000, evaluated every 100 steps, 3 seeds, both readouts;
- the rate sweep: the same recipe at lr 5e-4, 2e-3 and 5e-3, seed 1; each readout's best rate is the one of the
  five whose seed-1 run ends lowest at depth K; it gets seeds 2 and 3 where it is not 1e-3 or 3e-3, and the
  one-loop baseline (K = 1, the same 4 unique layers and recipe), 3 seeds;
- two controls in the cost grid's 4-layer 1e-3 cell (1,000 steps, constant rate, paired with its committed
  rmsnorm and raw runs of seeds 1-3): raw + penalty 0.1 (what the penalty costs a state that is already small)
  and rmsnorm with normed recurrence (the carried scale removed; the readout and the objective unchanged).

Every run logs, at every evaluation, the validation loss and ||h_k|| at depths 1..2K, the turn of the state at
every loop, and the training loss at depth K (on fixed training windows). The predictions below were written and
committed before any of these runs; the tables set each beside its measurement.
"""

import os

from lab.grid import COST_FLAGS, LogError, load_runs, run_grid
from lab.report import check_destination, fail, run_main, runs_flags, split_flags, tool_parser

PROG = 'python -m lab.converge'

MARGIN = 0.02  # nats of validation loss, as in the cost grid (lab/cost.py MARGIN)
ALPHA = 0.05   # the family-wise error rate of Holm's correction within each family

# ---- the runs

RATES = ('5e-4', '1e-3', '2e-3', '3e-3', '5e-3')  # the sweep; the convergence check is 1e-3 and 3e-3
CHECKED = ('1e-3', '3e-3')                      # the cost grid's rates, run with 3 seeds from the start
READOUTS = ('rmsnorm', 'raw')
STEPS = 3000
# the convergence recipe: 4 layers, K = 4 (the default), warmup then cosine to lr / 10 (train.py's default min_lr)
RECIPE = ['--n_layer=4', f'--max_iters={STEPS}', '--eval_interval=100', '--eval_iters=8', '--log_interval=100',
          '--warmup_iters=100', '--decay_lr=True']


def cell(lr, readout, n_loop=4):
    """A convergence cell's name: 'L4-cos-lr1e-3-K4 + rmsnorm' (cos: the warmup and cosine recipe)."""
    return f"L4-cos-lr{lr}-K{n_loop} + {readout}"


CONTROLS = {  # the cost grid's 4-layer 1e-3 cell, its recipe (1,000 steps at a constant rate)
    'L4-lr1e-3-K4 + raw + pen0.1': ['--n_layer=4', '--learning_rate=1e-3', '--readout=raw',
                                    '--norm_penalty=0.1'],
    'L4-lr1e-3-K4 + rmsnorm + normed': ['--n_layer=4', '--learning_rate=1e-3', '--readout=rmsnorm',
                                        '--recurrence=normed'],
}


def converge_grid():
    """{cell name: train.py flags} of every run this tool may train."""
    grid = {}
    for lr in RATES:
        for n_loop in (4, 1):
            for readout in READOUTS:
                grid[cell(lr, readout, n_loop)] = [f'--learning_rate={lr}', f'--readout={readout}',
                                                   f'--n_loop={n_loop}', *RECIPE]
    for name, flags in CONTROLS.items():
        grid[name] = flags + COST_FLAGS
    return grid


GRID = converge_grid()


def best_rates(runs):
    """{readout: its best rate}: the rate whose seed-1 K = 4 run ends lowest at depth K, among runs that reached
    the last step; None until every rate's seed-1 run of both readouts has."""
    final = {}
    for run in runs:
        c, m = run['config'], run['config']['model']
        if c['seed'] == 1 and c.get('decay_lr') and m['n_loop'] == 4 and run['records'][-1]['step'] >= STEPS:
            lr = f"{c['learning_rate']:.0e}".replace('e-0', 'e-')
            final[m['readout'], lr] = run['records'][-1]['val_loss'][3]
    if len(final) < len(RATES) * len(READOUTS):
        return None
    return {ro: min(RATES, key=lambda lr: final[ro, lr]) for ro in READOUTS}


def jobs(best=None):
    """[(cell, seed)] in the order they are trained: the convergence check, seed by seed (each pair of
    readouts side by side, so two workers finish a pair together); the controls; the sweep's seed 1; then,
    once the sweep has named each readout's best rate (best), its seeds 2-3 and the one-loop baselines."""
    order = [(cell(lr, ro), s) for s in (1, 2, 3) for lr in CHECKED for ro in READOUTS]
    order += [(name, s) for s in (1, 2, 3) for name in CONTROLS]
    order += [(cell(lr, ro), 1) for lr in RATES if lr not in CHECKED for ro in READOUTS]
    if best:
        order += [(cell(best[ro], ro), s) for s in (2, 3) for ro in READOUTS if best[ro] not in CHECKED]
        order += [(cell(best[ro], ro, 1), s) for s in (1, 2, 3) for ro in READOUTS]
    return order


# ---- the predictions, written and committed before any run

FAMILIES = {
    'converged cost': 'rmsnorm - raw at depth K at step 3,000, at lr 1e-3 and at 3e-3 (2 comparisons)',
    'best rate': "rmsnorm at its best rate - raw at its best rate, at depth K at step 3,000; and, per readout, "
                 "K = 4 at depth 4 - K = 1, at that readout's best rate (3 comparisons)",
    'controls': 'in the cost grid 4-layer 1e-3 cell at step 1,000: raw + penalty 0.1 - raw; rmsnorm + normed '
                '- rmsnorm; rmsnorm + normed - raw (3 comparisons)',
}

# The two accounts of the cost, each a prediction that can fail. For a pair of runs (rmsnorm and raw, the same
# rate and seed) at one evaluation, the cost at depth K splits exactly in two:
#     cost = L^rms_K - L^raw_K = (L^rms_1 - L^raw_1) + (G^raw - G^rms),   G = L_1 - L_K,
# the first-exit gap plus the later loops' gain deficit. Over every pair of the new K = 4 runs (every rate and
# seed) at every evaluation from step 100, the share of the cost's variance that moves with each term,
# cov(term, cost) / var(cost), sums to 1. An account holds where its term's share is at least 0.7 and its
# Pearson correlation with the cost is at least 0.7; neither holds where neither passes both. The points share
# runs and are not independent: these are pre-declared thresholds on a description, not tests with a p-value.
ACCOUNT_SHARE = 0.7
ACCOUNT_R = 0.7
ACCOUNTS = {
    'wasted loops': "the cost is rmsnorm's later loops doing less work than raw's (a large state that each later "
                    'pass turns little): the gain deficit carries the cost (share >= 0.7, r >= 0.7); and the '
                    "state's turn at loop 2 predicts that loop's gain, Spearman >= 0.5 across every run's "
                    'evaluations from step 500',
    'first exit': "the cost is the shared weights trained through K loops serving the first exit worse under "
                  'rmsnorm: the first-exit gap carries the cost (share >= 0.7, r >= 0.7)',
}

PREDICTIONS = {
    # the convergence check: decisive. "delay" if the converged cost at 1e-3 is equivalent within the margin or
    # lower; "cost" if it is still higher; otherwise not resolved
    'converged cost lr 1e-3': 'higher, but smaller than at 1,000 steps: between +0.02 and +0.148 (about +0.07); '
                              'a cost that shrinks, not a pure delay',
    'converged cost lr 3e-3': 'equivalent within +-0.02',
    'best rates': "rmsnorm's best rate is at least raw's (the scale-invariant readout divides the gradient "
                  'into the stack by ||h||, so it wants a larger step); raw best at 2e-3 or 3e-3',
    'best against best': 'equivalent within +-0.02 (each readout at its best rate)',
    'one loop raw at best': 'lower: K = 4 beats K = 1 by more than 0.05',
    'one loop rmsnorm at best': 'lower: K = 4 beats K = 1, by less than raw does',
    'control raw + penalty 0.1': 'higher than raw, by +0.03 to +0.10: most of rmsnorm + penalty 0.1 gap to '
                                 'raw (+0.074) is what the penalty costs any state',
    'control rmsnorm + normed': 'lower than rmsnorm, by more than 0.02 (the carried scale removed, the later '
                                'loops work)',
    'control normed against raw': 'not resolved',
    'accounts': 'the first-exit account holds; the wasted-loops account does not (its share below 0.7, and the '
                'turn does not predict the gain: Spearman below 0.5)',
    'course': 'at both rates rmsnorm - raw is below 0 at step 100 (rmsnorm learns first) and crosses 0 before '
              'step 1,000',
}


# ---- the command

def get_parser():
    p = tool_parser(PROG, __doc__)
    runs_flags(p, 'the convergence runs', 'laptop', os.path.join('out', 'converge'), '--device=cpu')
    p.add_argument('--part', default='1/1', help="--run: 'i/n' trains jobs i, i + n, ... of the list only, so n "
                                                 'workers (one thread each) share the runs')
    p.add_argument('--committed', default=os.path.join('figures', 'converge', 'runs'),
                   help="--run: where the finished runs' logs are committed; a run finished there is not trained "
                        'again')
    p.add_argument('--fig_dir', default=os.path.join('out', 'converge_figures'),
                   help='where table.md and the figures go (a committed table changes only when its folder is '
                        'named here)')
    return p


def parse_part(p, text):
    try:
        i, n = map(int, text.split('/'))
    except ValueError:
        p.error(f"--part={text}: give i/n, e.g. 1/2")
    if not 1 <= i <= n:
        p.error(f"--part={text}: i must be between 1 and n")
    return i, n


def known_runs(out_root, config, committed):
    """The runs already finished or under way, in out_root and in the committed folder, for best_rates."""
    folders = [os.path.join(d, f) for d in (os.path.join(out_root, config), committed) if os.path.isdir(d)
               for f in sorted(os.listdir(d))]
    runs = []
    for folder in folders:
        try:
            runs += load_runs([folder])
        except LogError:
            pass  # not started, or died before its first evaluation
    return runs


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    extra = split_flags(p, args.train_args)
    part = parse_part(p, args.part)
    if not args.run and not args.runs:
        p.error("name run folders to read, or pass --run to train the runs")
    check_destination(p, os.path.join(args.fig_dir, 'table.md'), '--fig_dir')  # before hours of training
    folders = []
    if args.run:
        best = best_rates(known_runs(args.out_root, args.config, args.committed))
        folders = run_grid(args.config, None, args.out_root, extra, grid=GRID, prog=PROG,
                           finished_in=args.committed, jobs=jobs(best), part=part)
        if best is None:
            print(f"{PROG}: the sweep has not named each readout's best rate yet; rerun --run once every "
                  "worker is done, to train the best rates' seeds and the one-loop baselines")
    try:
        load_runs(args.runs, folders)
    except LogError as e:
        fail(PROG, e)


if __name__ == '__main__':
    run_main(main, PROG)
