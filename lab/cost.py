"""
Where the blind spot costs: the cost grid (lab/grid.py COST), its predictions, its margin and its families.

    python -m lab.cost --run                          # train the grid (43 runs, about 5 hours on 2 cores)
    python -m lab.cost 'out/cost/laptop/*'            # the tables and fig_cost.png, from the runs' logs

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
import math
import os

import numpy as np

from lab.grid import COST, COST_SEEDS, LogError, load_runs, run_grid
from lab.report import (at_least, check_destination, fail, grid_parser, markdown, pyplot, run_main, save_figure,
                        split_flags, write_outputs, write_text)
from lab.stats import family_verdicts, fmt_number, paired_test

PROG = 'python -m lab.cost'

# The equivalence margin, in nats of validation cross-entropy: a difference inside +-0.02 is 2% of perplexity,
# smaller than the spread between seeds of one condition here (a sample SD of 0.02-0.06 for most designs of the
# gpt2 atlas), a difference no single run could show and no reader would act on.
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

# The same predictions, cut to the words each table's row is checked against
SHORT = {'cost L2-lr3e-3': 'lower (about -0.05)', 'cost L2-lr1e-3': 'below +0.02',
         'cost L4-lr3e-3': 'higher (about +0.05)', 'cost L4-lr1e-3': 'higher (about +0.10)',
         'interaction depth': 'above 0 (about +0.1)', 'interaction rate': 'above 0, below the stack\'s',
         'interaction depth x rate': 'not resolved', 'penalty 0.001': 'lower or not resolved',
         'penalty 0.01': 'lower', 'penalty 0.1': 'lower, half the gap to raw closed',
         'one loop raw': 'lower, by more than 0.1', 'one loop rmsnorm': 'above -0.02',
         'precision': 'equivalent within +-0.02'}

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


# ---- reading the grid back: cells, pairs, tests

def cell_of(run):
    """The grid's cell name of a run, from its log's config: 'L4-lr1e-3-K4 + rmsnorm + pen0.01'."""
    m = run['config']['model']
    lr = f"{run['config']['learning_rate']:.0e}".replace('e-0', 'e-')  # 0.001 -> '1e-3'
    name = f"L{m['n_layer']}-lr{lr}-K{m['n_loop']} + {m['readout']}"
    return name + (f" + pen{m['norm_penalty']:g}" if m['norm_penalty'] else '')


def last(run):
    return run['records'][-1]


def by_cell(runs):
    """{cell: {seed: run}} of the grid's runs that reached the grid's last step; a run still short of it is left
    out (returned as a note), so no mean mixes training lengths."""
    cells, notes = {}, []
    for run in runs:
        want = run['config']['max_iters']
        if last(run)['step'] < want:
            notes.append(f"{run['folder']} at step {last(run)['step']} of {want}: left out")
            continue
        cells.setdefault(cell_of(run), {})[run['config']['seed']] = run
    return cells, notes


def loss_at(run, depth):
    """Validation loss at exit depth 1..2K at the last evaluation."""
    return last(run)['val_loss'][depth - 1]


def paired(cells, a, b, value_a, value_b=None):
    """Seed-by-seed differences value_a(run of a) - value_b(run of b), over the seeds both cells have."""
    value_b = value_b or value_a
    seeds = sorted(set(cells.get(a, {})) & set(cells.get(b, {})))
    return seeds, [value_a(cells[a][s]) - value_b(cells[b][s]) for s in seeds]


def comparison_row(label, seeds, diffs, prediction):
    """One comparison of a family: its paired test (no test below two pairs), its seeds and its prediction."""
    mean = diffs[0] if len(diffs) == 1 else math.nan  # one pair: its difference, with no interval and no test
    test = paired_test(diffs, MARGIN) if len(diffs) > 1 else {'n': len(diffs), 'mean': mean, 'sd': math.nan,
                                                              'lo': math.nan, 'hi': math.nan, 'p': math.nan,
                                                              'p_tost': math.nan}
    return {'label': label, 'seeds': seeds, 'prediction': prediction, **test}


def family_table(rows, what, f='+.3f'):
    """Holm over the family as declared (a comparison not yet measured still counts in m), then one markdown
    table: the comparison, its pairs, the mean difference with its sample SD (ddof 1) and 95% t interval, the
    adjusted p and TOST p, the verdict and the prediction; f: the differences' format (the precision family's
    shifts need four decimals)."""
    family_verdicts(rows, MARGIN, ALPHA)
    for r in rows:
        if r['n'] < 2:  # no test: no verdict, whatever family_verdicts wrote
            r['verdict'] = 'no verdict: one pair' if r['n'] == 1 else 'no pairs'
        elif r['verdict'].startswith('equivalent') and r['p_holm'] < ALPHA:  # both are true: say both
            r['verdict'] += f", and {'lower' if r['mean'] < 0 else 'higher'} than 0"
    header = ['comparison', 'seeds', f'{what}: mean', 'SD (ddof 1)', '95% t interval', 'p (Holm)',
              f'TOST p at +-{MARGIN:g} (Holm)', 'verdict', 'predicted']
    body = [[r['label'], ' '.join(map(str, r['seeds'])), fmt_number(r['mean'], f), fmt_number(r['sd'], f[1:]),
             f"[{fmt_number(r['lo'], f)}, {fmt_number(r['hi'], f)}]", fmt_number(r.get('p_holm', math.nan), '.4f'),
             fmt_number(r.get('p_tost_holm', math.nan), '.4f'), r['verdict'], r['prediction']]
            for r in rows]
    return markdown(header, body)


FACTORIAL = [(L, lr) for L in (2, 4) for lr in ('3e-3', '1e-3')]


def cost_rows(cells):
    rows = []
    for L, lr in FACTORIAL:
        a, b = f"L{L}-lr{lr}-K4 + rmsnorm", f"L{L}-lr{lr}-K4 + raw"
        seeds, d = paired(cells, a, b, lambda r: loss_at(r, 4))
        rows.append(comparison_row(f"{L} layers, lr {lr}: rmsnorm - raw at depth 4", seeds, d,
                             SHORT[f"cost L{L}-lr{lr}"]))
    return rows


def interaction_rows(cells):
    """Per seed, the cost (rmsnorm - raw at depth 4) of each factorial cell, combined into the change with the
    stack, with the rate and their interaction; the seeds every cell has."""
    costs = {}
    for L, lr in FACTORIAL:
        seeds, d = paired(cells, f"L{L}-lr{lr}-K4 + rmsnorm", f"L{L}-lr{lr}-K4 + raw", lambda r: loss_at(r, 4))
        costs[L, lr] = dict(zip(seeds, d))
    seeds = sorted(set.intersection(*(set(c) for c in costs.values())))
    c = lambda L, lr, s: costs[L, lr][s]
    depth = [(c(4, '3e-3', s) + c(4, '1e-3', s) - c(2, '3e-3', s) - c(2, '1e-3', s)) / 2 for s in seeds]
    rate = [(c(2, '1e-3', s) + c(4, '1e-3', s) - c(2, '3e-3', s) - c(4, '3e-3', s)) / 2 for s in seeds]
    both = [(c(4, '1e-3', s) - c(2, '1e-3', s)) - (c(4, '3e-3', s) - c(2, '3e-3', s)) for s in seeds]
    return [comparison_row('the cost, 4 layers - 2 (mean over the rates)', seeds, depth, SHORT['interaction depth']),
            comparison_row('the cost, lr 1e-3 - 3e-3 (mean over the stacks)', seeds, rate, SHORT['interaction rate']),
            comparison_row('stack x rate: (4 - 2 layers at 1e-3) - (4 - 2 at 3e-3)', seeds, both,
                     SHORT['interaction depth x rate'])]


def penalty_rows(cells):
    base = 'L4-lr1e-3-K4 + rmsnorm'
    rows = []
    for lam in ('0.001', '0.01', '0.1'):
        seeds, d = paired(cells, f"{base} + pen{lam}", base, lambda r: loss_at(r, 4))
        rows.append(comparison_row(f"rmsnorm + penalty {lam} - rmsnorm at depth 4", seeds, d, SHORT[f'penalty {lam}']))
    return rows


def one_loop_rows(cells):
    rows = []
    for readout in ('raw', 'rmsnorm'):
        seeds, d = paired(cells, f"L4-lr1e-3-K4 + {readout}", f"L4-lr1e-3-K1 + {readout}",
                          lambda r: loss_at(r, 4), lambda r: loss_at(r, 1))
        rows.append(comparison_row(f"{readout}: K = 4 at depth 4 - K = 1", seeds, d, SHORT[f'one loop {readout}']))
    return rows


def course_table(cells):
    """Per factorial cell at steps 100, 400, 700 and 1,000: the mean over seeds of rmsnorm's and raw's loss at
    depth 4, the cost (rmsnorm - raw) and the same gap in training loss: is the cost still moving at the end?"""
    header = ['cell', 'step', 'pairs', 'rmsnorm loss at K', 'raw loss at K', 'cost (val)', 'train-loss gap']
    rows = []
    for L, lr in FACTORIAL:
        a, b = cells.get(f"L{L}-lr{lr}-K4 + rmsnorm", {}), cells.get(f"L{L}-lr{lr}-K4 + raw", {})
        seeds = sorted(set(a) & set(b))
        for step in (100, 400, 700, 1000):
            at = lambda run: next((r for r in run['records'] if r['step'] == step), None)
            recs = [(at(a[s]), at(b[s])) for s in seeds if at(a[s]) and at(b[s])]
            if not recs:
                continue
            rms, raw = (np.mean([pair[i]['val_loss'][3] for pair in recs]) for i in (0, 1))
            gap = np.mean([x['train_loss'] - y['train_loss'] for x, y in recs])
            rows.append([f"{L} layers, lr {lr}", step, len(recs), f"{rms:.3f}", f"{raw:.3f}",
                         fmt_number(rms - raw), fmt_number(gap)])
    return markdown(header, rows)


def mean_sd(values, f='.3f'):
    v = np.asarray(values, dtype=float)
    return format(v.mean(), f) + (f" ± {v.std(ddof=1):{f}}" if len(v) > 1 else '')


def mechanism_table(cells):
    """Per cell: ||h_K||, the loss at K and at every depth 1..K, the per-loop gain L_{k-1} - L_k at loops 2..K,
    the turn of the state at loops 1..K (degrees), and the useful loops (of loops 2..K, those whose gain exceeds
    the margin), each the mean over seeds (± the sample SD where given)."""
    header = ['cell', 'seeds', '‖h_K‖', 'loss at K', 'loss at depths 1..K', 'gain at loops 2..K',
              'turn at loops 1..K (deg)', f'useful loops (gain > {MARGIN:g})']
    rows = []
    for name in [n for n in COST if n in cells]:
        runs = [cells[name][s] for s in sorted(cells[name])]
        K = runs[0]['K']
        loss = np.array([last(r)['val_loss'][:K] for r in runs])      # (seeds, K)
        gains = loss[:, :-1] - loss[:, 1:]                               # (seeds, K - 1)
        turns = np.array([last(r)['turn'][:K] for r in runs])
        useful = (gains > MARGIN).sum(axis=1)
        rows.append([name, len(runs), mean_sd([last(r)['hidden_norm'][K - 1] for r in runs], '.1f'),
                     mean_sd(loss[:, -1]), ' '.join(f"{v:.3f}" for v in loss.mean(0)),
                     ' '.join(f"{g:+.3f}" for g in gains.mean(0)) or '-',
                     ' '.join(f"{t:.1f}" for t in turns.mean(0)), mean_sd(useful, '.1f') if K > 1 else '-'])
    return markdown(header, rows)


def check_line(key, results, unit='runs'):
    """One prediction checked run by run (or seed by seed, or pair by pair): results [(which, value text, met)]
    -> 'met in a of b runs', the misses named with their values."""
    if not results:
        return f"- {key}: no {unit} yet"
    misses = [f"{run} ({value})" for run, value, met in results if not met]
    return (f"- {key}: met in {len(results) - len(misses)} of {len(results)} {unit}"
            + (f"; missed by {'; '.join(misses)}" if misses else ''))


def each_run(cells, names):
    """(name, seed, run) for every run of the named cells, in the grid's order."""
    return [(n, s, cells[n][s]) for n in names if n in cells for s in sorted(cells[n])]


def penalty_and_loop_checks(cells):
    """Per seed of the 4-layer 1e-3 cell: the penalty's dose (||h_K|| and the loss at K at lambda 0, 0.001,
    0.01, 0.1, and the share of the gap to raw closed at 0.1), and raw's K = 4 - K = 1."""
    base, dose, raw = 'L4-lr1e-3-K4 + rmsnorm', ('0.001', '0.01', '0.1'), 'L4-lr1e-3-K4 + raw'
    pen_norm, pen_loss = [], []
    for seed in sorted(set.intersection(*(set(cells.get(n, {})) for n in
                                          [base, raw] + [f"{base} + pen{lam}" for lam in dose]))):
        runs = [cells[base][seed]] + [cells[f"{base} + pen{lam}"][seed] for lam in dose]
        h = [last(r)['hidden_norm'][3] for r in runs]
        pen_norm.append((f"seed {seed}", ' > '.join(f"{v:.1f}" for v in h),
                         all(a > b for a, b in zip(h, h[1:])) and h[1] > 100 and h[3] < 60))
        L = [loss_at(r, 4) for r in runs]
        closed = (L[0] - L[3]) / (L[0] - loss_at(cells[raw][seed], 4))
        pen_loss.append((f"seed {seed}", ' > '.join(f"{v:.3f}" for v in L) + f", {closed:.0%} of the gap",
                         all(a > b for a, b in zip(L, L[1:])) and closed >= 0.5))
    seeds, d = paired(cells, raw, 'L4-lr1e-3-K1 + raw', lambda r: loss_at(r, 4), lambda r: loss_at(r, 1))
    loops = [(f"seed {s}", f"{v:+.3f}", v < -0.1) for s, v in zip(seeds, d)]
    return pen_norm, pen_loss, loops


def precision_order(cells, K4):
    """Per seed of each factorial cell with both readouts measured: does rmsnorm's loss at 2K move more than
    raw's under a bf16 state and under bf16 autocast?"""
    shift = {}
    for name, seed, run in each_run(cells, K4):
        path = os.path.join(run['folder'], 'precision.json')
        if os.path.exists(path):
            with open(path) as f:
                rec = json.load(f)
            shift[name, seed] = [abs(rec[m][1] - rec['float32'][1]) for m in ('bf16_state', 'bf16_autocast')]
    return [(f"{rms} seed {s}", ', '.join(f"{a:.4f} vs {b:.4f}" for a, b in zip(shift[rms, s], shift[ra, s])),
             all(a > b for a, b in zip(shift[rms, s], shift[ra, s])))
            for rms, ra in zip(K4[::2], K4[1::2]) for s in sorted(cells.get(rms, {}))
            if (rms, s) in shift and (ra, s) in shift]


def mechanism_checks(cells):
    """The predictions about single runs (useful loops, turn, norm, the penalty's dose, raw's loops, the 2K
    precision ordering), each checked in every run it speaks of: the readings behind the prose, not verdicts."""
    K4 = [f"L{L}-lr{lr}-K4 + {ro}" for L, lr in FACTORIAL for ro in ('rmsnorm', 'raw')]
    useful, turn, norm = [], [], []
    for name, seed, run in each_run(cells, K4):
        loss, rms = last(run)['val_loss'][:4], 'rmsnorm' in name
        label = f"{name} seed {seed}"
        if name.startswith('L4'):
            n = sum(loss[k - 1] - loss[k] > MARGIN for k in range(1, 4))
            useful.append((label, n, n <= 1 if rms else n >= 2))
        later = last(run)['turn'][1:4]
        worst = max(later) if rms else min(later)
        turn.append((label, f"{worst:.1f} deg", worst < 5 if rms else worst > 5))
        h = last(run)['hidden_norm'][3]
        norm.append((label, f"{h:.1f}", h > 100 if rms else h < 30))
    pen_norm, pen_loss, loops = penalty_and_loop_checks(cells)
    order = precision_order(cells, K4)
    return '\n'.join([
        check_line('useful loops (rmsnorm <= 1, raw >= 2; 4-layer cells)', useful),
        check_line('turn (the extreme turn at loops 2..K: rmsnorm largest < 5, raw smallest > 5)', turn),
        check_line('norm (||h_K||: rmsnorm > 100, raw < 30)', norm),
        check_line('penalty norm (||h_K|| at lambda 0, 0.001, 0.01, 0.1 falls; > 100 at 0.001, < 60 at 0.1)',
                   pen_norm, 'seeds'),
        check_line('penalty loss (the loss at K falls with lambda; 0.1 closes >= 50% of the gap to raw)',
                   pen_loss, 'seeds'),
        check_line('one loop raw (raw K = 4 - K = 1 below -0.1)', loops, 'seeds'),
        check_line('precision at 2K (rmsnorm moves more than raw: |bf16_state shift|, |bf16_autocast shift|, '
                   'rmsnorm vs raw)', order, 'pairs')])


def precision_rows(runs):
    """bf16 - float32 over the factorial's K = 4 checkpoints, per readout, bf16 mode and depth (K, 2K)."""
    records = {}
    for run in runs:
        path = os.path.join(run['folder'], 'precision.json')
        m = run['config']['model']
        if os.path.exists(path) and m['n_loop'] == 4 and not m['norm_penalty']:
            with open(path) as f:
                records.setdefault(m['readout'], []).append((os.path.basename(run['folder']), json.load(f)))
    rows = []
    for readout in ('rmsnorm', 'raw'):
        found = sorted(records.get(readout, []))
        for mode in ('bf16_state', 'bf16_autocast'):
            for i, depth in enumerate(('K', '2K')):
                d = [rec[mode][i] - rec['float32'][i] for _, rec in found]
                rows.append(comparison_row(f"{readout}, {mode} - float32 at depth {depth}", [len(found)], d,
                                     SHORT['precision']))
    return rows


def tables(runs):
    """The cost grid's tables as one markdown text, each family under its question."""
    cells, notes = by_cell(runs)
    predictions = '\n'.join(f"- {name}: {text}" for name, text in PREDICTIONS.items())
    parts = [f"# Where the blind spot costs: the cost grid's tables\n\nThe predictions, committed before any "
             f"run (lab/cost.py PREDICTIONS):\n\n{predictions}\n\nMargin +-{MARGIN:g} nats; Holm's correction "
             f"within each family at {ALPHA:g}; SD is the sample SD (ddof 1) of the seed-by-seed differences; "
             "'seeds' lists the pairs. Verdicts: equivalent within the margin where TOST passes, else lower or "
             "higher where the two-sided test passes, else not resolved."]
    sections = [('Does the blind spot cost? (family: cost)', cost_rows(cells), 'rmsnorm - raw'),
                ('What turns it on? (family: interactions)', interaction_rows(cells), 'change of the cost'),
                ('The scale alone: the penalty dose-response (family: penalty)', penalty_rows(cells),
                 'penalty - none'),
                ('Does looping help at all? (family: one loop)', one_loop_rows(cells), 'K = 4 - K = 1'),
                ('The precision hazard (family: precision; seeds: the number of checkpoints)',
                 precision_rows([r for s in cells.values() for r in s.values()]), 'bf16 - float32')]
    for title, rows, what in sections:
        f = '+.4f' if what == 'bf16 - float32' else '+.3f'
        parts.append(f"## {title}\n\n{family_table(rows, what, f)}")
    parts.append("## The cost's course over training (means over the pairs)\n\n" + course_table(cells))
    parts.append("## The mechanism: each loop's gain and turn\n\n" + mechanism_table(cells))
    parts.append("## The predictions about single runs, checked in each\n\n" + mechanism_checks(cells))
    if notes:
        parts.append('Left out: ' + '; '.join(notes))
    return '\n\n'.join(parts) + '\n'


def figure(runs, path):
    """fig_cost.png (and .svg): left, the cost (rmsnorm - raw at depth K) of each factorial cell, seed by seed,
    its mean and 95% t interval, the margin as a band; right, the loss at exit depths 1..K of each factorial
    cell (mean over seeds; rmsnorm solid, raw dashed) and the one-loop models' loss: the mechanism in a glance."""
    plt = pyplot()
    cells, _ = by_cell(runs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
    left.axhspan(-MARGIN, MARGIN, color='grey', alpha=0.2, label=f'the margin, +-{MARGIN:g}')
    left.axhline(0, color='grey', lw=0.8)
    for i, ((L, lr), row) in enumerate(zip(FACTORIAL, cost_rows(cells))):
        _, diffs = paired(cells, f"L{L}-lr{lr}-K4 + rmsnorm", f"L{L}-lr{lr}-K4 + raw", lambda r: loss_at(r, 4))
        left.plot([i] * len(diffs), diffs, 'o', color=colors[i], alpha=0.5, ms=5)
        if row['n'] > 1:
            left.errorbar(i + 0.15, row['mean'], yerr=[[row['mean'] - row['lo']], [row['hi'] - row['mean']]],
                          fmt='s', color=colors[i], capsize=4)
    left.set_xticks(range(len(FACTORIAL)), [f"{L} layers\nlr {lr}" for L, lr in FACTORIAL])
    left.set_ylabel('rmsnorm - raw at depth K (nats)')
    left.set_title('The cost: seeds (dots), mean and 95% t interval (not Holm-adjusted)', fontsize=10)
    left.legend(fontsize=8)
    for i, (L, lr) in enumerate(FACTORIAL):
        for readout, style in (('rmsnorm', '-'), ('raw', '--')):
            name = f"L{L}-lr{lr}-K4 + {readout}"
            if name in cells:
                loss = np.mean([last(r)['val_loss'][:4] for r in cells[name].values()], axis=0)
                right.plot(range(1, 5), loss, style, marker='o', ms=3, color=colors[i],
                           label=f"{L} layers, lr {lr}, {readout} ({len(cells[name])} seeds)")
    for readout, marker in (('rmsnorm', '*'), ('raw', 'x')):
        name = f"L4-lr1e-3-K1 + {readout}"
        if name in cells:
            right.plot([1], [np.mean([loss_at(r, 1) for r in cells[name].values()])], marker, ms=10,
                       color=colors[3], label=f"4 layers, lr 1e-3, K = 1, {readout}")
    right.set(xlabel='exit depth (loops)', ylabel='validation loss (nats)', xticks=range(1, 5))
    right.set_title('Loss at each exit, mean over seeds: rmsnorm solid, raw dashed', fontsize=10)
    right.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1))
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    return save_figure(fig, path)


def get_parser():
    p = grid_parser(PROG, __doc__, 'the cost grid', 'cost')
    p.add_argument('--seeds', type=int, default=5,
                   help='--run: seeds 1..N of each cell, each cell capped at its own count (3, or 5)')
    return p


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    extra = split_flags(p, args.train_args)
    at_least(p, '--seeds', args.seeds, 1)
    if not args.run and not args.runs:
        p.error("name run folders to read, or pass --run to train the grid")
    check_destination(p, os.path.join(args.fig_dir, 'table.md'), '--fig_dir')  # before hours of training
    folders = []
    if args.run:
        folders = run_grid(args.config, range(1, args.seeds + 1), args.out_root, extra, grid=COST, prog=PROG,
                           max_seed=COST_SEEDS, after=measure_precision, finished_in=args.committed)
    try:
        runs = load_runs(args.runs, folders)
    except LogError as e:
        fail(PROG, e)
    write_outputs(args.fig_dir, tables(runs), {'fig_cost.png': lambda path: figure(runs, path)})


if __name__ == '__main__':
    run_main(main, PROG)
