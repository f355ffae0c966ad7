"""
Why rmsnorm costs with one pass: the head's initialization, the stack's own scale, the endpoint or the rate.

    python -m lab.one_pass --run --part=1/2                # one worker (one thread); a second: --part=2/2
    python -m lab.one_pass --fig_dir=figures/one_pass      # the table, from the committed logs
    python -m lab.one_pass 'out/one_pass/laptop/*'         # or from the run folders named

Why: with one pass (K = 1, the convergence recipe: 4 layers x 128, paper init, warmup 100 then cosine to
lr / 10, lr 3e-3, 3,000 steps) rmsnorm - raw at depth 1 is +0.098 [+0.071, +0.125] over 6 seeds, and ||h_1||
ends at about 660 under rmsnorm against about 11 under raw. A loop cannot explain a cost that is there without
one. Four causes are not ruled out, and each has runs that separate it (3 seeds each, the recipe above unless
named; the tied 3,000-step runs at lr 3e-3 are the interaction grid's, committed):

- the head: the tied N(0, 1) head makes the first logits tens of nats; untied (--tie_weights=False) the head
  starts from PyTorch's small default draws. The gap gone untied (equivalent within the margin) but not tied
  points at the head's initialization;
- the stack's own scale: the gap kept untied and closed by the norm penalty (0.01, at K = 1) points at a scale
  written inside one pass that the scale-invariant readout does not see: a blind spot without a loop;
- the endpoint: 6,000 steps (tied and untied) instead of 3,000: the gap moving with the length;
- the rate: both tied readouts at lr 5e-3: the gap moving with the rate.

The predictions, families and margin below were written and committed before any of these runs.
"""

import glob
import os

import numpy as np

from lab import converge
from lab.converge import RECIPE, at_k, cell, last
from lab.cost import comparison_row, family_table, mean_sd, paired
from lab.grid import ROOT
from lab.interaction import train_and_read
from lab.report import grid_parser, markdown, run_main, write_outputs
from lab.stats import fmt_number

PROG = 'python -m lab.one_pass'

MARGIN = 0.02  # nats of validation loss, as in every grid of the lab
ALPHA = 0.05   # the family-wise error rate of Holm's correction within each family
LR = '3e-3'
FAST = '5e-3'
LONG = 6000
PENALTY = 0.01
SEEDS = (1, 2, 3)

# ---- the runs


def name(readout, lr=LR, untied=False, steps=3000, penalty=0.0):
    """A cell's name: the convergence grid's ('L4-cos-lr3e-3-K1 + rmsnorm'), then + pen0.01, + untied, + 6k."""
    return (cell(lr, readout, 1) + (f" + pen{penalty:g}" if penalty else '') + (' + untied' if untied else '')
            + (f" + {steps // 1000}k" if steps != 3000 else ''))


def flags(readout, lr=LR, untied=False, steps=3000, penalty=0.0):
    """train.py's flags of a cell (the recipe's --max_iters=3000 is overridden by a later one)."""
    out = [f'--learning_rate={lr}', f'--readout={readout}', '--n_loop=1', *RECIPE]
    out += ['--tie_weights=False'] if untied else []
    out += [f'--max_iters={steps}'] if steps != 3000 else []
    return out + ([f'--norm_penalty={penalty:g}'] if penalty else [])


TIED_RMS, TIED_RAW = name('rmsnorm'), name('raw')          # committed: the interaction grid's seeds 1-6
UNTIED_RMS, UNTIED_RAW = name('rmsnorm', untied=True), name('raw', untied=True)
LONG_RMS, LONG_RAW = name('rmsnorm', steps=LONG), name('raw', steps=LONG)
LONG_UNTIED_RMS, LONG_UNTIED_RAW = (name('rmsnorm', untied=True, steps=LONG),
                                    name('raw', untied=True, steps=LONG))
PENALIZED = name('rmsnorm', penalty=PENALTY)
FAST_RMS, FAST_RAW = name('rmsnorm', FAST), name('raw', FAST)

SPECS = {UNTIED_RMS: ('rmsnorm', LR, True, 3000, 0.0), UNTIED_RAW: ('raw', LR, True, 3000, 0.0),
         PENALIZED: ('rmsnorm', LR, False, 3000, PENALTY),
         FAST_RMS: ('rmsnorm', FAST, False, 3000, 0.0), FAST_RAW: ('raw', FAST, False, 3000, 0.0),
         LONG_RMS: ('rmsnorm', LR, False, LONG, 0.0), LONG_RAW: ('raw', LR, False, LONG, 0.0),
         LONG_UNTIED_RMS: ('rmsnorm', LR, True, LONG, 0.0), LONG_UNTIED_RAW: ('raw', LR, True, LONG, 0.0)}
GRID = {cell_name: flags(*spec) for cell_name, spec in SPECS.items()}

# The order the runs are trained in (two workers take alternate places): the primary statistic's runs first,
# the untied pairs seed by seed; then the penalty's three seeds; then the rate's pairs; then the 6,000-step
# runs seed by seed. A run takes about as long as another of its length, so whatever the session's time
# allows is the most telling part. (Reordered after the first two runs had started: no prediction changed.)
SHORT = (UNTIED_RMS, UNTIED_RAW, PENALIZED, FAST_RMS, FAST_RAW)
LONGER = (LONG_RMS, LONG_RAW, LONG_UNTIED_RMS, LONG_UNTIED_RAW)
JOBS = ([(c, s) for s in SEEDS for c in (UNTIED_RMS, UNTIED_RAW)] + [(PENALIZED, s) for s in SEEDS]
        + [(c, s) for s in SEEDS for c in (FAST_RMS, FAST_RAW)] + [(c, s) for s in SEEDS for c in LONGER])

# ---- the predictions, written and committed before any run

FAMILIES = {
    'the gap': 'rmsnorm - raw at K = 1, depth 1, at the last step, seeds 1-3: untied (3,000 steps); tied at '
               '6,000 steps; untied at 6,000 steps; tied at lr 5e-3; and rmsnorm + penalty 0.01 - raw, '
               'rmsnorm + penalty 0.01 - rmsnorm (tied, 3,000 steps) (6 comparisons)',
    'what moves it': "seed s's gap (rmsnorm - raw at K = 1) under one change minus the same seed's gap in the "
                     'committed tied 3,000-step lr 3e-3 runs: untied; 6,000 steps; lr 5e-3 (3 comparisons)',
}

# The verdict on the cause rests on one statistic, named before the runs: rmsnorm - raw at K = 1 untied
# (3,000 steps, lr 3e-3), with its TOST at +-MARGIN. Equivalent: the head's initialization. Higher: not the
# head (alone); then the penalty rows say whether the stack's scale carries it.
PREDICTIONS = {
    'untied': 'higher: rmsnorm - raw at K = 1 untied between +0.02 and +0.10 (smaller than tied, not gone): '
              'the head is not the cause alone',
    'long tied': 'higher: rmsnorm - raw at K = 1 tied at 6,000 steps between +0.04 and +0.15',
    'long untied': 'higher: rmsnorm - raw at K = 1 untied at 6,000 steps between +0.01 and +0.10',
    'fast': 'higher: rmsnorm - raw at K = 1 tied at lr 5e-3 between +0.04 and +0.15',
    'penalty against raw': 'not resolved: rmsnorm + penalty 0.01 - raw at K = 1 with its mean between -0.04 '
                           'and +0.04 (the penalty closes most of the gap, as at K = 4)',
    'penalty against rmsnorm': 'lower: rmsnorm + penalty 0.01 - rmsnorm at K = 1 below -0.04',
    'moves untied': 'not resolved: untying moves the gap by less than the 3 seeds resolve',
    'moves long': 'not resolved: doubling the length moves the gap by less than the 3 seeds resolve',
    'moves fast': 'not resolved: lr 5e-3 moves the gap by less than the 3 seeds resolve',
    'norms': "||h_1|| at the last evaluation, mean over seeds: untied rmsnorm 100-700, untied raw 5-20; tied "
             "6,000 steps rmsnorm 500-1,200, raw 7-15; untied 6,000 steps rmsnorm 100-900, raw 5-20; "
             "rmsnorm + penalty 0.01 5-60; lr 5e-3 rmsnorm 500-1,500, raw 7-20",
}

NORM_RANGES = {UNTIED_RMS: (100, 700), UNTIED_RAW: (5, 20), LONG_RMS: (500, 1200), LONG_RAW: (7, 15),
               LONG_UNTIED_RMS: (100, 900), LONG_UNTIED_RAW: (5, 20), PENALIZED: (5, 60),
               FAST_RMS: (500, 1500), FAST_RAW: (7, 20)}

# ---- reading the runs back


def cell_of(run):
    """A run's cell: the convergence grid's name, then + untied and + 6k where the run is so."""
    m, steps = run['config']['model'], run['config']['max_iters']
    return (converge.cell_of(run) + (' + untied' if m['tie_weights'] is False else '')
            + (f" + {steps // 1000}k" if steps != 3000 else ''))


def by_cell(runs):
    """{cell: {seed: run}} of the runs that reached their last step (this tool's cells); the others in a note."""
    return converge.by_cell(runs, cell_of)


def only(cells, seeds=SEEDS):
    """The cells with the planned seeds alone (the committed tied cells hold seeds 1-6)."""
    return {c: {s: r for s, r in runs.items() if s in seeds} for c, runs in cells.items()}


def gap_rows(cells):
    """The family 'the gap'."""
    c = only(cells)
    return [comparison_row('rmsnorm - raw, untied', *paired(c, UNTIED_RMS, UNTIED_RAW, at_k),
                           PREDICTIONS['untied']),
            comparison_row(f'rmsnorm - raw, tied, {LONG:,} steps', *paired(c, LONG_RMS, LONG_RAW, at_k),
                           PREDICTIONS['long tied']),
            comparison_row(f'rmsnorm - raw, untied, {LONG:,} steps',
                           *paired(c, LONG_UNTIED_RMS, LONG_UNTIED_RAW, at_k), PREDICTIONS['long untied']),
            comparison_row(f'rmsnorm - raw, tied, lr {FAST}', *paired(c, FAST_RMS, FAST_RAW, at_k),
                           PREDICTIONS['fast']),
            comparison_row(f'rmsnorm + penalty {PENALTY:g} - raw', *paired(c, PENALIZED, TIED_RAW, at_k),
                           PREDICTIONS['penalty against raw']),
            comparison_row(f'rmsnorm + penalty {PENALTY:g} - rmsnorm', *paired(c, PENALIZED, TIED_RMS, at_k),
                           PREDICTIONS['penalty against rmsnorm'])]


def gap_change(cells, rms, raw):
    """([seeds], [(rms - raw) - (tied rms - tied raw at 3,000 steps, lr 3e-3)]) of the seeds with all four."""
    c = only(cells)
    four = [c.get(x, {}) for x in (rms, raw, TIED_RMS, TIED_RAW)]
    seeds = sorted(set.intersection(*[set(x) for x in four]))
    return seeds, [at_k(four[0][s]) - at_k(four[1][s]) - (at_k(four[2][s]) - at_k(four[3][s])) for s in seeds]


def move_rows(cells):
    """The family 'what moves it'."""
    return [comparison_row('untied - tied', *gap_change(cells, UNTIED_RMS, UNTIED_RAW), PREDICTIONS['moves untied']),
            comparison_row(f'{LONG:,} - 3,000 steps', *gap_change(cells, LONG_RMS, LONG_RAW),
                           PREDICTIONS['moves long']),
            comparison_row(f'lr {FAST} - lr {LR}', *gap_change(cells, FAST_RMS, FAST_RAW), PREDICTIONS['moves fast'])]


def norm_of(run):
    """||h_1|| at the last evaluation."""
    return last(run)['hidden_norm'][0]


def norm_table(cells):
    """Each cell's ||h_1|| (mean ± SD over seeds 1-3) and its loss at depth 1, beside the predicted norm range."""
    header = ['cell', 'seeds', 'loss at depth 1: mean ± SD', '||h_1||: mean ± SD', 'predicted', 'mean inside']
    rows = []
    for c in (TIED_RMS, TIED_RAW, *SPECS):
        runs = [r for _, r in sorted(only(cells).get(c, {}).items())]
        v = [norm_of(r) for r in runs]
        lo, hi = NORM_RANGES.get(c, (None, None))
        inside = '-' if lo is None or not v else ('yes' if lo <= np.mean(v) <= hi else 'no')
        rows.append([c, len(v), mean_sd([at_k(r) for r in runs], '.3f') if v else '-',
                     mean_sd(v, '.1f') if v else '-', f"{lo:,g}-{hi:,g}" if lo is not None else 'committed',
                     inside])
    return markdown(header, rows)


def checks(gaps, moves, cells):
    """[(key, 'met' | 'missed' | 'not measured yet', measured)] of every prediction; a row with fewer than the 3
    planned seeds is provisional."""
    def check(row, ok):
        if row['n'] < 2:
            return 'not measured yet', ''
        text = f"{row['verdict']}, {fmt_number(row['mean'])} [{fmt_number(row['lo'])}, {fmt_number(row['hi'])}]"
        text += f" (provisional: {row['n']} of {len(SEEDS)} seeds)" if row['n'] < len(SEEDS) else ''
        return ('met' if ok(row) else 'missed'), text
    higher = lambda lo, hi: lambda r: r['verdict'] == 'higher' and lo <= r['mean'] <= hi
    unresolved = lambda lo, hi: lambda r: r['verdict'] == 'not resolved' and lo <= r['mean'] <= hi
    out = dict(zip(('untied', 'long tied', 'long untied', 'fast'),
                   [check(r, higher(*b)) for r, b in zip(gaps, ((0.02, 0.10), (0.04, 0.15), (0.01, 0.10),
                                                                (0.04, 0.15)))]))
    out['penalty against raw'] = check(gaps[4], unresolved(-0.04, 0.04))
    out['penalty against rmsnorm'] = check(gaps[5], lambda r: r['verdict'] == 'lower' and r['mean'] < -0.04)
    for key, row in zip(('moves untied', 'moves long', 'moves fast'), moves):
        out[key] = check(row, lambda r: r['verdict'] == 'not resolved')
    values = {c: [norm_of(r) for r in only(cells).get(c, {}).values()] for c in NORM_RANGES}
    if any(len(v) < 2 for v in values.values()):
        out['norms'] = ('not measured yet', '')
    else:
        out['norms'] = ('met' if all(NORM_RANGES[c][0] <= np.mean(v) <= NORM_RANGES[c][1]
                                     for c, v in values.items()) else 'missed',
                        '; '.join(f"{c} {np.mean(v):,.1f}" for c, v in values.items()))
    return [(key, *out[key]) for key in PREDICTIONS]


def tables(runs):
    """table.md's text: the two families, the norms and losses, every prediction checked, the runs left out."""
    cells, notes = by_cell(runs)
    gaps, moves = gap_rows(cells), move_rows(cells)
    parts = ["# Why rmsnorm costs with one pass: the tables",
             "The predictions, committed before any run (lab/one_pass.py PREDICTIONS):\n\n"
             + '\n'.join(f"- {k}: {v}" for k, v in PREDICTIONS.items()),
             f"Every run K = 1, 4 layers x 128, paper init, warmup 100 then cosine to lr / 10, lr {LR} unless "
             f"named, 3,000 steps unless named, at depth 1 at its last step, seeds 1-3. Margin +-{MARGIN:g} nats; "
             f"Holm within each family at {ALPHA:g}. Verdicts: equivalent within the margin where TOST passes, "
             "else lower or higher where the two-sided test passes, else not resolved (no difference shown, "
             "which is not no difference).",
             f"## The gap ({FAMILIES['the gap']})\n\n" + family_table(gaps, 'difference'),
             f"## What moves it ({FAMILIES['what moves it']})\n\n" + family_table(moves, 'change of the gap'),
             "## ||h_1|| and the loss at the last step\n\n" + norm_table(cells)]
    found = checks(gaps, moves, cells)
    lines = [f"- {k}: {w}." + (f" Measured: {m}" if m else '') for k, w, m in found]
    count = lambda word: sum(w == word for _, w, _ in found)
    lines += ['', f"Met: {count('met')}; missed: {count('missed')}; not measured yet: "
                  f"{count('not measured yet')} (of {len(found)} predictions)."]
    parts.append("## Every prediction, checked\n\n" + '\n'.join(lines))
    if notes:
        parts.append('Not finished (left out): ' + '; '.join(notes))
    return '\n\n'.join(parts) + '\n'


# ---- the command

def get_parser():
    return grid_parser(PROG, __doc__, 'the one-pass runs', 'one_pass', part=True)


def default_folders():
    """The committed tied K = 1 runs at lr 3e-3 (seeds 1-3 in the convergence grid's folder, 4-6 in the
    interaction grid's) and this grid's committed runs."""
    pattern = os.path.join(ROOT, 'figures', '{}', 'runs', '{}')
    return sorted(glob.glob(pattern.format('converge', f'L4-cos-lr{LR}-K1-*'))
                  + glob.glob(pattern.format('interaction', f'L4-cos-lr{LR}-K1-*'))
                  + glob.glob(pattern.format('one_pass', '*')))


def main(argv=None):
    args, runs = train_and_read(get_parser(), argv, GRID, JOBS, PROG, default_folders)
    write_outputs(args.fig_dir, tables(runs), {})


if __name__ == '__main__':
    run_main(main, PROG)
