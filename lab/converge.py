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

import glob
import math
import os

import numpy as np

from lab.cost import comparison_row, family_table, mean_sd, paired
from lab.grid import COST_FLAGS, ROOT, LogError, load_runs, run_grid
from lab.report import (check_destination, fail, grid_parser, markdown, parse_part, pyplot, run_main, save_figure,
                        split_flags, write_outputs)
from lab.stats import fmt_number, paired_test

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


def rate(run):
    """A run's learning rate as the grid writes it: 0.001 -> '1e-3'."""
    return f"{run['config']['learning_rate']:.0e}".replace('e-0', 'e-')


def best_rates(runs):
    """{readout: its best rate}: the rate whose seed-1 K = 4 run ends lowest at depth K, among runs that reached
    the last step; None until every rate's seed-1 run of both readouts has."""
    final = {}
    for run in runs:
        c, m = run['config'], run['config']['model']
        if c['seed'] == 1 and c.get('decay_lr') and m['n_loop'] == 4 and run['records'][-1]['step'] >= STEPS:
            final[m['readout'], rate(run)] = run['records'][-1]['val_loss'][3]
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


# ---- reading the runs back: cells, pairs, families

def cell_of(run):
    """The cell a run belongs to, from its log's config: 'L4-cos-lr1e-3-K4 + rmsnorm' for the convergence
    recipe; the cost grid's names otherwise ('L4-lr1e-3-K4 + raw + pen0.1', '... + rmsnorm + normed')."""
    c, m = run['config'], run['config']['model']
    if c.get('decay_lr'):
        return cell(rate(run), m['readout'], m['n_loop']) + (f" + pen{m['norm_penalty']:g}" if m['norm_penalty']
                                                             else '')
    name = f"L{m['n_layer']}-lr{rate(run)}-K{m['n_loop']} + {m['readout']}"
    name += f" + pen{m['norm_penalty']:g}" if m['norm_penalty'] else ''
    return name + (f" + {m['recurrence']}" if m['recurrence'] != 'residual' else '')


def last(run):
    return run['records'][-1]


def by_cell(runs, cell_of=cell_of):
    """{cell: {seed: run}} of the runs that reached their last step (cell_of(run) names each run's cell); the others
    are named in a note."""
    cells, notes = {}, []
    for run in runs:
        if last(run)['step'] < run['config']['max_iters']:
            notes.append(f"{os.path.basename(os.path.normpath(run['folder']))} at step {last(run)['step']} of "
                         f"{run['config']['max_iters']}")
            continue
        cells.setdefault(cell_of(run), {})[run['config']['seed']] = run
    return cells, notes


def at_k(run):
    """The validation loss at depth K (the trained depth) at the last evaluation."""
    return last(run)['val_loss'][run['K'] - 1]


def verdict_rows(rows):
    """Holm within the family (family_table runs it): the rows, for the checks that read their verdicts."""
    family_table(rows, '')
    return rows


def converged_rows(cells):
    rows = []
    for lr in CHECKED:
        seeds, d = paired(cells, cell(lr, 'rmsnorm'), cell(lr, 'raw'), at_k)
        rows.append(comparison_row(f"lr {lr}: rmsnorm - raw at depth 4, step {STEPS:,}", seeds, d,
                                   PREDICTIONS[f'converged cost lr {lr}']))
    return rows


def sweep(cells):
    """{readout: {rate: [loss at K of each finished seed]}} over the K = 4 convergence cells."""
    return {ro: {lr: [at_k(r) for _, r in sorted(cells.get(cell(lr, ro), {}).items())] for lr in RATES}
            for ro in READOUTS}


def best_from_cells(cells):
    """best_rates of the finished runs, or None while any seed-1 sweep run is missing."""
    return best_rates([r for runs in cells.values() for r in runs.values()])


def best_rows(cells):
    """rmsnorm at its best rate - raw at its best, and K = 4 - K = 1 per readout at its best rate."""
    best = best_from_cells(cells)
    if best is None:
        return [comparison_row(label, [], [], PREDICTIONS[key]) for label, key in (
            ('rmsnorm at its best rate - raw at its best (no best rates yet)', 'best against best'),
            ('raw: K = 4 - K = 1 at its best rate (no best rate yet)', 'one loop raw at best'),
            ('rmsnorm: K = 4 - K = 1 at its best rate (no best rate yet)', 'one loop rmsnorm at best'))]
    rms, raw = best['rmsnorm'], best['raw']
    rows = [comparison_row(f"rmsnorm at lr {rms} - raw at lr {raw}, depth 4", *paired(
        cells, cell(rms, 'rmsnorm'), cell(raw, 'raw'), at_k), PREDICTIONS['best against best'])]
    for ro in ('raw', 'rmsnorm'):
        rows.append(comparison_row(f"{ro} at lr {best[ro]}: K = 4 at depth 4 - K = 1", *paired(
            cells, cell(best[ro], ro), cell(best[ro], ro, 1), at_k), PREDICTIONS[f'one loop {ro} at best']))
    return rows


def control_rows(cells):
    base = 'L4-lr1e-3-K4 + '
    pairs = [('raw + pen0.1', 'raw', 'control raw + penalty 0.1'),
             ('rmsnorm + normed', 'rmsnorm', 'control rmsnorm + normed'),
             ('rmsnorm + normed', 'raw', 'control normed against raw')]
    return [comparison_row(f"{a} - {b} at depth 4, step 1,000", *paired(cells, base + a, base + b, at_k),
                           PREDICTIONS[key]) for a, b, key in pairs]


# ---- the cost's course over training, and the two accounts of it

def course(cells, lr):
    """[(step, seed-by-seed cost at depth K, seed-by-seed training-loss gap at depth K)] of the rmsnorm and raw
    runs of one convergence cell, at every evaluation both runs of a seed have."""
    a, b = cells.get(cell(lr, 'rmsnorm'), {}), cells.get(cell(lr, 'raw'), {})
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return []
    out = []
    for i, rec in enumerate(a[seeds[0]]['records']):
        pairs = [(a[s]['records'][i], b[s]['records'][i]) for s in seeds]
        out.append((rec['step'], [x['val_loss'][3] - y['val_loss'][3] for x, y in pairs],
                    [x['train_loss'] - y['train_loss'] for x, y in pairs]))
    return out


COURSE_STEPS = (100, 200, 300, 400, 500, 700, 1000, 1500, 2000, 2500, 3000)


def course_table(cells):
    """At a few evaluation steps (the figure has every one), in the convergence check's cells and any other of
    2 seeds or more: the cost at depth K and the training-loss gap,
    mean with its 95% t interval over the seeds (unadjusted: a course, not a family)."""
    header = ['cell', 'step', 'seeds', 'cost (val): mean', '95% t interval', 'train-loss gap: mean']
    rows = []
    for lr in RATES:
        for step, cost, gap in course(cells, lr):
            if step in COURSE_STEPS and (lr in CHECKED or len(cost) > 1):  # the sweep's seed 1: the figure
                t = paired_test(cost, MARGIN) if len(cost) > 1 else {'lo': math.nan, 'hi': math.nan}
                rows.append([f"lr {lr}", step, len(cost), fmt_number(float(np.mean(cost))),
                             f"[{fmt_number(t['lo'])}, {fmt_number(t['hi'])}]", fmt_number(float(np.mean(gap)))])
    return markdown(header, rows)


def split(rms, raw):
    """One evaluation of an rmsnorm/raw pair (K = 4): (first-exit gap L^rms_1 - L^raw_1, gain deficit
    G^raw - G^rms with G = L_1 - L_4); the two sum to the cost at depth K exactly."""
    gap = rms['val_loss'][0] - raw['val_loss'][0]
    return gap, rms['val_loss'][3] - raw['val_loss'][3] - gap


def interval_text(values):
    """'+0.214 [+0.194, +0.234]': the mean and its 95% t interval; one value alone is marked so."""
    if len(values) < 2:
        return fmt_number(values[0]) + ' (one pair)'
    t = paired_test(values, MARGIN)
    return f"{fmt_number(t['mean'])} [{fmt_number(t['lo'])}, {fmt_number(t['hi'])}]"


def split_table(cells):
    """At the last step, per convergence cell with a finished pair: the cost at depth K split exactly (split)
    into the first-exit gap and the gain deficit, each the mean over the pairs with its 95% t interval
    (unadjusted: a reading, not a family), and each readout's gain L_1 - L_K."""
    header = ['cell', 'pairs', 'cost at K', 'first-exit gap', 'gain deficit', 'gain L_1 - L_K: rmsnorm, raw']
    rows = []
    for lr in RATES:
        a, b = cells.get(cell(lr, 'rmsnorm'), {}), cells.get(cell(lr, 'raw'), {})
        seeds = sorted(set(a) & set(b))
        if not seeds:
            continue
        gap, deficit = zip(*[split(last(a[s]), last(b[s])) for s in seeds])
        cost = [g + d for g, d in zip(gap, deficit)]
        gain = lambda runs: np.mean([last(runs[s])['val_loss'][0] - at_k(runs[s]) for s in seeds])
        rows.append([f"lr {lr}", len(seeds), interval_text(cost), interval_text(gap), interval_text(deficit),
                     f"{gain(a):+.3f}, {gain(b):+.3f}"])
    return markdown(header, rows)


def spearman(x, y):
    rank = lambda v: np.argsort(np.argsort(v)).astype(float)
    return float(np.corrcoef(rank(x), rank(y))[0, 1])


PLANNED_PAIRS = len(CHECKED) * 3 + len(RATES) - len(CHECKED)  # the check's 3 seeds, the sweep's seed 1


def accounts(cells, first_step=100):
    """The two accounts of the cost, as pre-declared (ACCOUNTS): over every seed's rmsnorm/raw pair of every
    convergence cell at every evaluation from step 100, each term's share of the cost's variance and its
    correlation with the cost; and the Spearman correlation of loop 2's turn with its gain over every K = 4
    convergence run's evaluations from step 500. None where no pair has finished. first_step: 100 is the
    pre-declared test; a later one is an exploratory reading (the warmup's transient left out)."""
    gap, deficit, turn, gain, pairs = [], [], [], [], 0
    for lr in RATES:
        a, b = cells.get(cell(lr, 'rmsnorm'), {}), cells.get(cell(lr, 'raw'), {})
        for s in sorted(set(a) & set(b)):
            pairs += 1
            for x, y in zip(a[s]['records'], b[s]['records']):
                if x['step'] >= first_step:
                    g, d = split(x, y)
                    gap.append(g)
                    deficit.append(d)
        for run in [*a.values(), *b.values()]:
            for rec in run['records']:
                if rec['step'] >= 500:
                    turn.append(rec['turn'][1])
                    gain.append(rec['val_loss'][0] - rec['val_loss'][1])
    if len(gap) < 3:
        return None
    gap, deficit = np.array(gap), np.array(deficit)
    cost = gap + deficit
    share = lambda t: float(np.cov(t, cost)[0, 1] / cost.var(ddof=1))
    r = lambda t: float(np.corrcoef(t, cost)[0, 1])
    out = {'points': len(cost), 'pairs': pairs, 'first exit': (share(gap), r(gap)),
           'wasted loops': (share(deficit), r(deficit)), 'turn': spearman(turn, gain), 'turn points': len(turn)}
    out['holds'] = {name: out[name][0] >= ACCOUNT_SHARE and out[name][1] >= ACCOUNT_R for name in ACCOUNTS}
    out['holds']['wasted loops'] = out['holds']['wasted loops'] and out['turn'] >= 0.5
    return out


def accounts_text(acc, late=None):
    if acc is None:
        return 'No pair of convergence runs has finished yet.'
    lines = []
    if acc['pairs'] < PLANNED_PAIRS:
        lines += [f"Provisional: {acc['pairs']} of the {PLANNED_PAIRS} pairs planned before the best rates "
                  "have finished; the accounts' verdicts below are readings until they all have.", '']
    lines += [f"Over {acc['points']} points (every finished rmsnorm/raw pair of a convergence cell at every "
             f"evaluation from step 100), cost = first-exit gap + gain deficit exactly; each term's share of the "
             f"cost's variance and its Pearson r with the cost (an account holds at share >= {ACCOUNT_SHARE:g} "
             f"and r >= {ACCOUNT_R:g}):", '']
    for name in ACCOUNTS:
        s, r = acc[name]
        lines.append(f"- {name}: share {s:.2f}, r {r:+.2f}")
    lines.append(f"- loop 2's turn against its gain: Spearman {acc['turn']:+.2f} over {acc['turn points']} "
                 "evaluations from step 500 (the wasted-loops account needs >= 0.5)")
    lines.append('')
    lines += [f"- the {name} account: {'holds' if acc['holds'][name] else 'does not hold'}" for name in ACCOUNTS]
    if not any(acc['holds'].values()):
        lines.append('- neither account holds: the data name no mechanism')
    if late is not None:
        lines += ['', f"Exploratory, not pre-declared: the same from step 500, the warmup's transient left out "
                  f"({late['points']} points): " + ', '.join(f"{name} share {late[name][0]:.2f}, r "
                                                              f"{late[name][1]:+.2f}" for name in ACCOUNTS)]
    return '\n'.join(lines)


# ---- every prediction, checked

def prediction_checks(cells, families, acc):
    """Each prediction of PREDICTIONS against what was measured: met, missed, or not measured yet."""
    (conv, best, ctrl), b = [verdict_rows(rows) for rows in families], best_from_cells(cells)
    byrow = lambda rows, i: rows[i] if rows[i]['n'] > 1 else None

    def verdict(row, ok):
        return ('not measured yet', None) if row is None else (
            f"{row['verdict']}, {fmt_number(row['mean'])} [{fmt_number(row['lo'])}, {fmt_number(row['hi'])}]",
            ok(row))
    checks = {
        'converged cost lr 1e-3': verdict(byrow(conv, 0),
                                          lambda r: r['verdict'] == 'higher' and 0.02 < r['mean'] < 0.148),
        'converged cost lr 3e-3': verdict(byrow(conv, 1), lambda r: r['verdict'].startswith('equivalent')),
        'best rates': ('not measured yet', None) if b is None else (
            f"rmsnorm {b['rmsnorm']}, raw {b['raw']}", float(b['rmsnorm']) >= float(b['raw'])
            and b['raw'] in ('2e-3', '3e-3')),
        'best against best': verdict(byrow(best, 0), lambda r: r['verdict'].startswith('equivalent')),
        'one loop raw at best': verdict(byrow(best, 1), lambda r: r['verdict'] == 'lower' and r['mean'] < -0.05),
        'one loop rmsnorm at best': verdict(byrow(best, 2), lambda r: r['verdict'] == 'lower' and best[1]['n'] > 1
                                            and r['mean'] > best[1]['mean']),
        'control raw + penalty 0.1': verdict(byrow(ctrl, 0),
                                             lambda r: r['verdict'] == 'higher' and 0.03 <= r['mean'] <= 0.10),
        'control rmsnorm + normed': verdict(byrow(ctrl, 1), lambda r: r['verdict'] == 'lower' and r['mean'] < -0.02),
        'control normed against raw': verdict(byrow(ctrl, 2), lambda r: r['verdict'] == 'not resolved'),
        'accounts': ('not measured yet', None) if acc is None or acc['pairs'] < PLANNED_PAIRS else (
            ', '.join(f"{n} {'holds' if h else 'does not hold'}" for n, h in acc['holds'].items())
            + f", the turn against the gain: Spearman {acc['turn']:+.2f}",
            acc['holds']['first exit'] and not acc['holds']['wasted loops'] and acc['turn'] < 0.5),
    }
    crossings = []
    for lr in CHECKED:
        points = [(step, float(np.mean(c))) for step, c, _ in course(cells, lr) if step >= 100]  # not init
        if points:
            first = next((step for step, m in points if m > 0), None)
            crossings.append((lr, points[0][1], first))
    if len(crossings) == len(CHECKED):
        checks['course'] = ('; '.join(f"lr {lr}: {m0:+.3f} at step 100, first above 0 at step {first}"
                                      for lr, m0, first in crossings),
                            all(m0 < 0 and first is not None and first < 1000 for _, m0, first in crossings))
    else:
        checks['course'] = ('not measured yet', None)
    lines = []
    for key, text in PREDICTIONS.items():
        found, met = checks[key]
        word = 'not measured yet' if met is None else ('met' if met else 'missed')
        lines.append(f"- {key}: {word}. Predicted: {text}. Measured: {found}")
    return '\n'.join(lines)


def sweep_table(cells):
    header = ['readout'] + [f"lr {lr}" for lr in RATES] + ['best (seed 1)']
    best = best_from_cells(cells)
    rows = [[ro] + [mean_sd(v) + f" ({len(v)})" if v else '-' for v in sweep(cells)[ro].values()]
            + [best[ro] if best else 'not yet'] for ro in READOUTS]
    return markdown(header, rows)


def tables(runs):
    cells, notes = by_cell(runs)
    predictions = '\n'.join(f"- {name}: {text}" for name, text in PREDICTIONS.items())
    families = [converged_rows(cells), best_rows(cells), control_rows(cells)]
    acc = accounts(cells)
    parts = [f"# Cost or delay: the convergence runs' tables\n\nThe predictions, committed before any run "
             f"(lab/converge.py PREDICTIONS):\n\n{predictions}\n\nMargin +-{MARGIN:g} nats; Holm's "
             f"correction within each family at {ALPHA:g}; SD is the sample SD (ddof 1) of the seed-by-seed "
             "differences; 'seeds' lists the pairs. Verdicts: equivalent within the margin where TOST passes, "
             "else lower or higher where the two-sided test passes, else not resolved (no difference shown, "
             "which is not no difference). A difference that is both inside the margin and different from 0 "
             "says both."]
    titles = [(f"Cost or delay: the cost at convergence ({FAMILIES['converged cost']})", 'rmsnorm - raw'),
              (f"Each readout at its best rate ({FAMILIES['best rate']})", 'difference'),
              (f"Controls ({FAMILIES['controls']})", 'difference')]
    for (title, what), rows in zip(titles, families):
        parts.append(f"## {title}\n\n{family_table(rows, what)}")
    parts.append("## The rate sweep: the loss at depth K at step 3,000 (mean ± SD over the seeds run, their "
                 "number in brackets)\n\n" + sweep_table(cells))
    parts.append("## The cost's course over training (fig_course.png has every evaluation)\n\n"
                 + course_table(cells))
    parts.append("## The mechanism: two accounts, pre-declared\n\n"
                 + accounts_text(acc, accounts(cells, first_step=500)))
    parts.append(f"## The cost at step {STEPS:,}, split exactly: cost = first-exit gap + gain deficit (a "
                 "reading: intervals unadjusted, not a family)\n\n" + split_table(cells))
    parts.append("## Every prediction, checked\n\n" + prediction_checks(cells, families, acc))
    if notes:
        parts.append('Not finished (left out): ' + '; '.join(notes))
    return '\n\n'.join(parts) + '\n'


# ---- the figures

ZOOM_FROM = 200  # the course figure's y range fits the steps from here: the first steps' tens of nats hide the rest


def course_figure(cells, path):
    """fig_course.png: rmsnorm - raw at depth K over training, per convergence cell: the mean over seeds and
    its 95% t interval at every evaluation (seeds alone, dashed, where a cell has one); right, the same for the
    training loss. The y range fits the steps from ZOOM_FROM on; the earlier points run off the bottom."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
    later = [-MARGIN, MARGIN]  # every plotted value from ZOOM_FROM on, for the y range
    for i, lr in enumerate(RATES):
        points = course(cells, lr)
        if not points:
            continue
        steps = [p[0] for p in points]
        for ax, which in zip(axes, (1, 2)):
            values = [p[which] for p in points]
            mean = [float(np.mean(v)) for v in values]
            n = len(values[0])
            label = f"lr {lr} ({n} seed{'s' if n > 1 else ''})"
            ax.plot(steps, mean, '-' if n > 1 else '--', color=colors[i], label=label)
            later += [m for step, m in zip(steps, mean) if step >= ZOOM_FROM]
            if n > 1:
                tests = [paired_test(v, MARGIN) for v in values]
                ax.fill_between(steps, [t['lo'] for t in tests], [t['hi'] for t in tests], color=colors[i],
                                alpha=0.2)
                later += [x for step, t in zip(steps, tests) if step >= ZOOM_FROM for x in (t['lo'], t['hi'])]
    for ax, what in zip(axes, ('validation', 'training')):
        ax.axhspan(-MARGIN, MARGIN, color='grey', alpha=0.2)
        ax.axhline(0, color='grey', lw=0.8)
        ax.set(xlabel='step', title=f"rmsnorm - raw, {what} loss at depth K: mean and 95% t interval")
        ax.title.set_fontsize(10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    pad = 0.1 * (max(later) - min(later))
    axes[0].set_ylim(min(later) - pad, max(later) + pad)
    axes[0].set_ylabel(f'nats (grey band: the margin; before step {ZOOM_FROM} off the scale)')
    return save_figure(fig, path)


def rates_figure(cells, path):
    """fig_rates.png: each readout's validation loss at depth K at step 3,000 against the learning rate: every
    seed a dot, the mean a line; the one-loop baselines at their rates as crosses."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    colors = {'rmsnorm': 'C0', 'raw': 'C1'}
    for ro, by_rate in sweep(cells).items():
        xs = [float(lr) for lr in RATES if by_rate[lr]]
        ax.plot(xs, [np.mean(by_rate[lr]) for lr in RATES if by_rate[lr]], '-', color=colors[ro],
                label=f"{ro}, K = 4")
        for lr in RATES:
            ax.plot([float(lr)] * len(by_rate[lr]), by_rate[lr], 'o', color=colors[ro], alpha=0.5, ms=4)
            one = [at_k(r) for r in cells.get(cell(lr, ro, 1), {}).values()]
            if one:
                ax.plot([float(lr)] * len(one), one, 'x', color=colors[ro], ms=7,
                        label=f"{ro}, K = 1, lr {lr}")
    ax.set(xscale='log', xlabel='learning rate (warmup, cosine to lr / 10)',
           ylabel=f'validation loss at depth K, step {STEPS:,}')
    ax.set_title('Each readout against the learning rate', fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


# ---- the command

def get_parser():
    p = grid_parser(PROG, __doc__, 'the convergence runs', 'converge', part=True)
    p.add_argument('--cost_runs', default=os.path.join(ROOT, 'figures', 'cost', 'runs'),
                   help="the cost grid's committed runs, whose 4-layer 1e-3 rmsnorm and raw runs the controls "
                        "pair with ('' for none)")
    return p


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


def cost_grid_runs(folder):
    """The cost grid's runs the controls pair with: its 4-layer 1e-3 K = 4 rmsnorm and raw runs, seeds 1-3."""
    if not folder:
        return []
    return load_runs([f for ro in READOUTS for s in (1, 2, 3)
                      for f in glob.glob(os.path.join(folder, f"L4-lr1e-3-K4-{ro}-seed{s}"))])


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
        runs = load_runs(args.runs, folders) + cost_grid_runs(args.cost_runs)
    except LogError as e:
        fail(PROG, e)
    cells, _ = by_cell(runs)
    write_outputs(args.fig_dir, tables(runs), {'fig_course.png': lambda path: course_figure(cells, path),
                                                'fig_rates.png': lambda path: rates_figure(cells, path)})


if __name__ == '__main__':
    run_main(main, PROG)
