"""
Whose cost: the loop's or the readout's? The readout x loops interaction at the end of the convergence recipe.

    python -m lab.interaction --run --part=1/2            # one worker (one thread); a second: --part=2/2
    python -m lab.interaction --fig_dir=figures/interaction   # the tables and figure, from the committed logs
    python -m lab.interaction 'out/interaction/laptop/*'   # or from the run folders named

Why: at the end of the convergence recipe (lab/converge.py: 4 layers x 128, paper init, warmup 100 then cosine
to lr / 10 at step 3,000), rmsnorm - raw at depth K was +0.108 with K = 4 but already about +0.09 with K = 1
(3 seeds, unadjusted). The blind spot is a story about a state carried through loops; a cost that is there with
one pass is the readout's (or its head's), not the loops'. The question is the interaction

    I = (rmsnorm - raw at K = 4) - (rmsnorm - raw at K = 1),   each at its own depth K, at step 3,000,

measured paired by seed: seed s gives one I from the four runs of seed s. The runs added here (lr 3e-3, the
convergence recipe): seeds 4-6 of K = 4 rmsnorm, K = 4 raw and K = 1 rmsnorm; K = 1 raw seeds 1-6; and K = 4
rmsnorm + norm penalty 0.01 seeds 1-3 (a loss on the state's scale, which rmsnorm's readout cannot see;
its gradient still reaches every weight that writes the state, so it changes more than the scale). Seeds 1-3
of the other three cells are the convergence grid's committed runs
(committed under figures/, in the convergence grid's folder); the new logs are committed in a folder of
their own beside it (--committed).

The predictions, families and margin below were written and committed before any of these runs.
"""

import glob
import os

import numpy as np

from lab import converge
from lab.converge import RECIPE, STEPS, at_k, by_cell, cell, last
from lab.cost import comparison_row, family_table, mean_sd, paired
from lab.grid import ROOT, LogError, load_runs, run_grid
from lab.report import (check_destination, fail, grid_parser, markdown, parse_part, pyplot, run_main,
                        save_figure, split_flags, write_outputs)
from lab.stats import fmt_number, paired_test

PROG = 'python -m lab.interaction'

MARGIN = 0.02  # nats of validation loss, as in the cost and convergence grids
ALPHA = 0.05   # the family-wise error rate of Holm's correction within each family
LR = '3e-3'    # one rate for all four cells: chosen before any K = 1 raw run, not on seed 1's outcome
PENALTY = 0.01

# ---- the runs

PENALIZED = f"L4-cos-lr{LR}-K4 + rmsnorm + pen{PENALTY:g}"


def interaction_grid():
    """{cell name: train.py flags} of every run this tool may train (cell names as lab/converge.py's)."""
    grid = {cell(LR, ro, k): [f'--learning_rate={LR}', f'--readout={ro}', f'--n_loop={k}', *RECIPE]
            for k in (4, 1) for ro in ('rmsnorm', 'raw')}
    grid[PENALIZED] = [f'--learning_rate={LR}', '--readout=rmsnorm', '--n_loop=4', f'--norm_penalty={PENALTY}',
                       *RECIPE]
    return grid


GRID = interaction_grid()

K4_RMS, K4_RAW, K1_RMS, K1_RAW = (cell(LR, 'rmsnorm'), cell(LR, 'raw'), cell(LR, 'rmsnorm', 1),
                                  cell(LR, 'raw', 1))

# The order the runs are trained in, chosen so that two workers (--part=1/2 takes the odd places, 2/2 the
# even) complete whole seeds early: K = 1 raw seeds 1-3 first (the three seeds the other cells already have),
# then seed 4's four runs, then seed 5's, then seed 6's, then the penalty runs. A K = 4 run takes about four
# times a K = 1 run, so the places balance the two workers' hours.
JOBS = [(K1_RAW, 1), (K4_RMS, 4), (K1_RAW, 2), (K4_RAW, 4), (K1_RAW, 3), (K1_RMS, 4), (K1_RAW, 4),
        (K1_RAW, 5), (K4_RMS, 5), (K1_RMS, 5), (K4_RAW, 5), (K4_RMS, 6), (K1_RAW, 6), (K4_RAW, 6),
        (K1_RMS, 6), (PENALIZED, 2), (PENALIZED, 1), (PENALIZED, 3)]

# ---- the predictions, written and committed before any run

FAMILIES = {
    'interaction': f"I = (rmsnorm - raw at K = 4) - (rmsnorm - raw at K = 1) at lr {LR} for all four cells, "
                   f"each at depth K at step {STEPS:,}, paired by seed over seeds 1-6 (1 comparison: the "
                   "primary test)",
    'readout and scale': f"at lr {LR}, at depth K at step {STEPS:,}: rmsnorm - raw at K = 1 (seeds 1-6); "
                         "rmsnorm - raw at K = 4 (seeds 1-6); rmsnorm + penalty 0.01 - rmsnorm at K = 4 "
                         "(seeds 1-3) (3 comparisons)",
    'interaction at best rates': "secondary: I with each readout at its best rate of the convergence sweep "
                                 "(rmsnorm 3e-3, raw 2e-3), seeds 1-3 (1 comparison; the best rates were "
                                 "chosen on seed 1, so this is not the primary test)",
}

PREDICTIONS = {
    'interaction': 'not resolved, with the mean between 0 and +0.06: most of the cost at K = 4 (+0.12) is '
                   'already there at K = 1 (about +0.09), and 6 seeds resolve neither a blind-spot share nor '
                   'equivalence within +-0.02',
    'interaction at best rates': 'not resolved (3 seeds), the mean between -0.03 and +0.06',
    'readout at K = 1': 'higher: rmsnorm - raw at K = 1 between +0.05 and +0.15',
    'readout at K = 4': 'higher: rmsnorm - raw at K = 4 between +0.08 and +0.16',
    'penalty 0.01': 'lower than rmsnorm, by more than 0.02 (as at 1,000 steps and lr 1e-3, where it was '
                    '-0.058): a smaller state helps the scale-invariant readout',
    'norms': "||h_K|| at the last evaluation, mean over seeds: K = 4 rmsnorm 850-1,150; K = 4 raw 8-15; "
             "K = 1 rmsnorm 600-720; K = 1 raw 7-15; K = 4 rmsnorm + penalty 0.01 10-60",
}

# Named before the one-pass runs (lab/one_pass.py) were started: the interaction's verdict rests on one
# statistic, I on the validation loss at step 3,000 over seeds 1-6 (the primary row). I at every evaluation and
# I on the logged training loss are readings of logs committed before they were asked for: postdictions, never
# counted as met.

# the ranges of the norms prediction, for its check: {cell: (low, high)}
NORM_RANGES = {K4_RMS: (850, 1150), K4_RAW: (8, 15), K1_RMS: (600, 720), K1_RAW: (7, 15), PENALIZED: (10, 60)}


# ---- reading the runs back: the interaction seed by seed, the families, the norms

SEEDS = range(1, 7)  # the seeds the interaction and the readout's two gaps are planned over
BEST_RATES = {'rmsnorm': '3e-3', 'raw': '2e-3'}  # each readout's best rate in the convergence sweep (FAMILIES)
PLANNED = {'interaction': 6, 'interaction at best rates': 3, 'readout at K = 1': 6, 'readout at K = 4': 6,
           'penalty 0.01': 3}  # the seeds each comparison is planned over, for a provisional reading


def quartet(rates=None):
    """An interaction's four cells, (K = 4 rmsnorm, K = 4 raw, K = 1 rmsnorm, K = 1 raw), each readout at its
    rate ({readout: rate}; LR for both by default)."""
    rates = rates or {'rmsnorm': LR, 'raw': LR}
    return tuple(cell(rates[ro], ro, k) for k in (4, 1) for ro in ('rmsnorm', 'raw'))


def readout_gaps(cells, rates=None, seeds=SEEDS):
    """Seed by seed, the two gaps an interaction is made of: ({seed: (rmsnorm - raw at K = 4, rmsnorm - raw at
    K = 1)} over the seeds whose four runs all finished, each run at its own depth K; {seed: [the cells it
    lacks]} of the seeds that have some of the four but not all. An I needs all four runs of its seed, so a
    seed short of one is left out whole, never paired across seeds."""
    four = quartet(rates)
    have = [cells.get(c, {}) for c in four]
    present = sorted(s for s in set().union(*have) if s in seeds)
    full = [s for s in present if all(s in h for h in have)]
    gaps = {s: (at_k(have[0][s]) - at_k(have[1][s]), at_k(have[2][s]) - at_k(have[3][s])) for s in full}
    return gaps, {s: [c for c, h in zip(four, have) if s not in h] for s in present if s not in gaps}


def interaction(cells, rates=None, seeds=SEEDS):
    """([seeds], [I_s]) with I_s = (rmsnorm - raw at K = 4) - (rmsnorm - raw at K = 1) of seed s."""
    gaps, _ = readout_gaps(cells, rates, seeds)
    return sorted(gaps), [gaps[s][0] - gaps[s][1] for s in sorted(gaps)]


def interaction_rows(cells):
    """The primary family: the interaction at LR, one comparison."""
    return [comparison_row(f"I at lr {LR}: (rmsnorm - raw at K = 4) - (rmsnorm - raw at K = 1)",
                           *interaction(cells), PREDICTIONS['interaction'])]


def readout_rows(cells):
    """The family 'readout and scale': the readout's gap at each depth, and what a smaller state does to it."""
    return [comparison_row(f"lr {LR}: rmsnorm - raw at K = 1, depth 1", *paired(cells, K1_RMS, K1_RAW, at_k),
                           PREDICTIONS['readout at K = 1']),
            comparison_row(f"lr {LR}: rmsnorm - raw at K = 4, depth 4", *paired(cells, K4_RMS, K4_RAW, at_k),
                           PREDICTIONS['readout at K = 4']),
            comparison_row(f"lr {LR}: rmsnorm + penalty {PENALTY:g} - rmsnorm at K = 4, depth 4",
                           *paired(cells, PENALIZED, K4_RMS, at_k), PREDICTIONS['penalty 0.01'])]


def best_rate_rows(cells):
    """The secondary family: the interaction with each readout at its own best rate, seeds 1-3."""
    rms, raw = BEST_RATES['rmsnorm'], BEST_RATES['raw']
    return [comparison_row(f"I with rmsnorm at lr {rms}, raw at lr {raw}",
                           *interaction(cells, BEST_RATES, (1, 2, 3)), PREDICTIONS['interaction at best rates'])]


def seed_table(cells):
    """The interaction seed by seed (every number the primary test is made of), and the seeds left out."""
    gaps, missing = readout_gaps(cells)
    header = ['seed', 'rmsnorm - raw at K = 4', 'rmsnorm - raw at K = 1', 'I']
    rows = [[s, fmt_number(d4), fmt_number(d1), fmt_number(d4 - d1)] for s, (d4, d1) in sorted(gaps.items())]
    text = markdown(header, rows) if rows else 'No seed has all four runs yet.'
    if missing:
        text += '\n\nLeft out of the interaction (a seed needs all four runs): ' + '; '.join(
            f"seed {s}, without {', '.join(lacks)}" for s, lacks in sorted(missing.items()))
    return text


def norm_of(run):
    """||h_K||: the state's norm at the trained depth at the last evaluation."""
    return last(run)['hidden_norm'][run['K'] - 1]


def norms(cells):
    """{cell: [||h_K|| of each finished seed]} of the cells NORM_RANGES names."""
    return {c: [norm_of(r) for _, r in sorted(cells.get(c, {}).items())] for c in NORM_RANGES}


def norm_table(cells):
    """Each cell's ||h_K|| (mean ± SD over its seeds) beside the range predicted for it."""
    header = ['cell', 'seeds', '||h_K||: mean ± SD', 'predicted', 'mean inside']
    rows = []
    for c, v in norms(cells).items():
        lo, hi = NORM_RANGES[c]
        inside = ('yes' if lo <= np.mean(v) <= hi else 'no') if v else '-'
        rows.append([c, len(v), mean_sd(v, '.1f') if v else '-', f"{lo:,g}-{hi:,g}", inside])
    return markdown(header, rows)


# ---- every prediction, checked

def row_check(row, ok, planned):
    """(measured text, met or not) of one family's row; (text, None) while it has fewer than 2 seeds. Fewer
    seeds than planned: the check is marked provisional, as the verdict may still change."""
    if row['n'] < 2:
        return 'not measured yet', None
    seeds = ' '.join(map(str, row['seeds']))
    text = f"{row['verdict']}, {fmt_number(row['mean'])} [{fmt_number(row['lo'])}, {fmt_number(row['hi'])}], " \
           f"seeds {seeds}" + (f" (provisional: {row['n']} of the {planned} seeds planned)" if row['n'] < planned
                               else '')
    return text, ok(row)


def norm_check(cells):
    """The norms prediction: every cell's mean ||h_K|| inside its range; not measured until every cell has 2
    seeds."""
    values = norms(cells)
    if any(len(v) < 2 for v in values.values()):
        return 'not measured yet', None
    text = '; '.join(f"{c} {np.mean(v):,.1f} ({len(v)} seeds)" for c, v in values.items())
    return text, all(NORM_RANGES[c][0] <= np.mean(v) <= NORM_RANGES[c][1] for c, v in values.items())


def prediction_checks(cells, families):
    """Each prediction of PREDICTIONS against what was measured: [(key, 'met' | 'missed' | 'not measured yet',
    the measurement)]. families: the rows of interaction_rows, readout_rows and best_rate_rows."""
    (inter,), (k1, k4, pen), (best,) = [converge.verdict_rows(rows) for rows in families]
    resolved = lambda lo, hi: lambda r: r['verdict'] == 'not resolved' and lo < r['mean'] < hi
    higher = lambda lo, hi: lambda r: r['verdict'] == 'higher' and lo <= r['mean'] <= hi
    checks = {
        'interaction': row_check(inter, resolved(0, 0.06), PLANNED['interaction']),
        'interaction at best rates': row_check(best, resolved(-0.03, 0.06), PLANNED['interaction at best rates']),
        'readout at K = 1': row_check(k1, higher(0.05, 0.15), PLANNED['readout at K = 1']),
        'readout at K = 4': row_check(k4, higher(0.08, 0.16), PLANNED['readout at K = 4']),
        'penalty 0.01': row_check(pen, lambda r: r['verdict'] == 'lower' and r['mean'] < -0.02,
                                  PLANNED['penalty 0.01']),
        'norms': norm_check(cells),
    }
    out = []
    for key in PREDICTIONS:
        found, met = checks[key]
        out.append((key, 'not measured yet' if met is None else ('met' if met else 'missed'), found))
    return out


def checks_text(checks):
    """The checks as a list, each with its prediction, then the counts."""
    lines = []
    for key, word, found in checks:
        measured = '' if word == 'not measured yet' else f" Measured: {found}"
        lines.append(f"- {key}: {word}. Predicted: {PREDICTIONS[key]}.{measured}")
    count = lambda word: sum(w == word for _, w, _ in checks)
    lines += ['', f"Met: {count('met')}; missed: {count('missed')}; not measured yet: {count('not measured yet')} "
                  f"(of {len(checks)} predictions)."]
    return '\n'.join(lines)


# ---- readings of the convergence grid's runs, not tests

READING_STEPS = (100, 500, 1000, 1500)


def convergence_cells(cells):
    """The cells with the convergence grid's own runs alone (its jobs), so that its accounts are recomputed on
    the runs they were declared over, and not on the seeds this grid adds to two of its cells."""
    jobs = set(converge.jobs(converge.best_from_cells(cells)))
    return {c: {s: r for s, r in runs.items() if (c, s) in jobs} for c, runs in cells.items()}


def accounts_table(cells):
    """lab.converge.accounts from each of READING_STEPS: each term's share of the cost's variance and its
    Pearson r with the cost, to see how much of the first-exit account is the warmup's first steps."""
    header = ['from step', 'points', 'pairs', 'first exit: share', 'first exit: r', 'wasted loops: share',
              'wasted loops: r']
    rows = []
    for step in READING_STEPS:
        acc = converge.accounts(cells, first_step=step)
        if acc is not None:
            rows.append([step, acc['points'], acc['pairs']] + [f"{acc[name][i]:{f}}" for name in
                                                               ('first exit', 'wasted loops')
                                                               for i, f in ((0, '.2f'), (1, '+.2f'))])
    return markdown(header, rows) if rows else 'No pair of convergence runs has finished yet.'


def turn_gain(cells, readout):
    """Loop 2's turn and its gain L_1 - L_2 at every evaluation from step 500 of one readout's K = 4 convergence
    runs: converge.accounts's points, one readout alone."""
    turn, gain = [], []
    for lr in converge.RATES:
        for run in cells.get(cell(lr, readout), {}).values():
            for rec in run['records']:
                if rec['step'] >= 500:
                    turn.append(rec['turn'][1])
                    gain.append(rec['val_loss'][0] - rec['val_loss'][1])
    return turn, gain


def turn_text(cells):
    """The turn's Spearman with the gain within each readout: pooled, a readout's larger turns and gains may
    alone make the correlation; within one readout they cannot."""
    lines = []
    for ro in converge.READOUTS:
        turn, gain = turn_gain(cells, ro)
        lines.append(f"- {ro} runs alone: Spearman {converge.spearman(turn, gain):+.2f} over {len(turn)} "
                     'evaluations' if len(turn) >= 3 else f"- {ro} runs alone: fewer than 3 evaluations")
    acc = converge.accounts(cells)
    if acc is not None:
        lines.append(f"- both readouts pooled (as converge's accounts): Spearman {acc['turn']:+.2f} over "
                     f"{acc['turn points']} evaluations")
    return '\n'.join(lines)


def readings_text(cells):
    """The readings' section: the accounts from later first steps, and the turn within each readout."""
    own = convergence_cells(cells)
    return ("Readings, not tests: no prediction was written for them, and their points share runs (no p-value). "
            "Over the convergence grid's own runs (every finished rmsnorm/raw pair of its K = 4 cells), "
            "cost = first-exit gap + gain deficit at every evaluation from the step named; lab.converge "
            "declared its accounts from step 100.\n\n" + accounts_table(own)
            + "\n\nLoop 2's turn against its gain L_1 - L_2, Spearman, every evaluation from step 500 of the "
              "convergence grid's K = 4 runs:\n\n" + turn_text(own))


# ---- the interaction over training and on the training loss: readings of committed logs (postdictions)

COURSE_STEPS = (500, 1000, 1500, 2000, 2500, 3000)  # the table's rows; the figure has every evaluation


def at_step(run, step, key='val_loss'):
    """A run's loss at depth K at evaluation `step` (key: 'val_loss', or 'train_loss', logged at depth K)."""
    record = next(r for r in run['records'] if r['step'] == step)
    return record[key] if key == 'train_loss' else record[key][run['K'] - 1]


def gaps_at(cells, step, key='val_loss', seeds=SEEDS):
    """Seed by seed at evaluation `step`: (seeds, [rmsnorm - raw at K = 4], [rmsnorm - raw at K = 1], [I]) over
    the seeds whose four runs all finished (readout_gaps' seeds)."""
    full = sorted(readout_gaps(cells, seeds=seeds)[0])
    four = quartet()
    d4 = [at_step(cells[four[0]][s], step, key) - at_step(cells[four[1]][s], step, key) for s in full]
    d1 = [at_step(cells[four[2]][s], step, key) - at_step(cells[four[3]][s], step, key) for s in full]
    return full, d4, d1, [a - b for a, b in zip(d4, d1)]


def interval(values):
    """'+0.013 [-0.028, +0.055]': the mean and its 95% t interval (unadjusted), or n/a below two values."""
    if len(values) < 2:
        return 'n/a'
    t = paired_test(values, MARGIN)
    return f"{fmt_number(t['mean'])} [{fmt_number(t['lo'])}, {fmt_number(t['hi'])}]"


def common_steps(cells):
    """The evaluation steps every run of the interaction's seeds logged."""
    full = readout_gaps(cells)[0]
    runs = [cells[c][s] for c in quartet() for s in full]
    return sorted(set.intersection(*[{r['step'] for r in run['records']} for run in runs])) if runs else []


def course_table(cells):
    """I and both readout gaps at the steps of COURSE_STEPS (validation, depth K), then I on the logged training
    loss at the last step, and I over seeds 1-3 (the convergence grid's code) and 4-6 (this grid's)."""
    header = ['step', 'loss', 'seeds', 'rmsnorm - raw at K = 4', 'rmsnorm - raw at K = 1', 'I']
    rows, logged = [], common_steps(cells)
    if STEPS not in logged:
        return 'No seed has all four runs at their last step yet.'
    for step, key in [(s, 'val_loss') for s in COURSE_STEPS if s in logged] + [(STEPS, 'train_loss')]:
        seeds, d4, d1, values = gaps_at(cells, step, key)
        rows.append([f"{step:,}", 'validation' if key == 'val_loss' else 'training (fixed batches)',
                     ' '.join(map(str, seeds)), interval(d4), interval(d1), interval(values)])
    for part in ((1, 2, 3), (4, 5, 6)):
        seeds, d4, d1, values = gaps_at(cells, STEPS, seeds=part)
        rows.append([f"{STEPS:,}", 'validation', ' '.join(map(str, seeds)), interval(d4), interval(d1),
                     interval(values)])
    return markdown(header, rows)


def penalty_reading(cells):
    """Readings at K = 4, depth 4 (no prediction was written for them): rmsnorm + penalty 0.01 - raw, how much of
    the readout's K = 4 gap the penalty closes; and each readout's K = 4 - K = 1, what the loops buy it here."""
    lines = []
    for label, a, b in ((f"rmsnorm + penalty {PENALTY:g} - raw at K = 4", PENALIZED, K4_RAW),
                        ('raw: K = 4 - K = 1', K4_RAW, K1_RAW), ('rmsnorm: K = 4 - K = 1', K4_RMS, K1_RMS)):
        seeds, diffs = paired(cells, a, b, at_k)
        lines.append(f"- {label}, each at its depth K, at step {STEPS:,}: {interval(diffs)}, seeds "
                     f"{' '.join(map(str, seeds))}")
    return 'Readings (no prediction was written for them):\n\n' + '\n'.join(lines)


def course_figure(cells, path):
    """fig_interaction_course.png: I and the two readout gaps at every evaluation from step 200 (validation,
    depth K), each the mean over the seeds with all four runs and its 95% t interval (unadjusted)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.4))
    steps = [s for s in common_steps(cells) if s >= 200]
    for index, (label, colour) in enumerate((('rmsnorm - raw at K = 4', 'C0'), ('rmsnorm - raw at K = 1', 'C1'),
                                             ('I = (at K = 4) - (at K = 1)', 'k'))):
        tests = [paired_test(gaps_at(cells, s)[1 + index], MARGIN) for s in steps]
        ax.plot(steps, [t['mean'] for t in tests], color=colour, label=label)
        ax.fill_between(steps, [t['lo'] for t in tests], [t['hi'] for t in tests], color=colour, alpha=0.15)
    ax.axhline(0, color='grey', lw=0.8)
    ax.axhspan(-MARGIN, MARGIN, color='grey', alpha=0.15, label=f"+-{MARGIN:g} margin")
    ax.set(xlabel='training step', ylabel=f'validation loss difference at depth K, lr {LR} (nats)')
    ax.set_title(f"The interaction over training: mean over {len(readout_gaps(cells)[0])} seeds, 95% t "
                 'intervals (unadjusted)', fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


# ---- the table and the figure

def intro():
    """The table's head: the predictions as committed, and how to read a verdict."""
    predictions = '\n'.join(f"- {name}: {text}" for name, text in PREDICTIONS.items())
    return (f"# Whose cost: the readout x loops interaction's tables\n\nThe predictions, committed before any run "
            f"(lab/interaction.py PREDICTIONS):\n\n{predictions}\n\nEvery run at lr {LR} unless named, at depth "
            f"K at step {STEPS:,}. Margin +-{MARGIN:g} nats; Holm's correction within each family at {ALPHA:g}; "
            "SD is the sample SD (ddof 1) of the seed-by-seed differences; 'seeds' lists them. Verdicts: "
            "equivalent within the margin where TOST passes, else lower or higher where the two-sided test "
            "passes, else not resolved (no difference shown, which is not no difference).")


def tables(runs):
    """table.md's text from the runs: the three families, the interaction seed by seed, the norms, every
    prediction checked, the readings, and the runs not finished (left out)."""
    cells, notes = by_cell(runs)
    families = [interaction_rows(cells), readout_rows(cells), best_rate_rows(cells)]
    titles = [(f"The interaction ({FAMILIES['interaction']})", 'I'),
              (f"Readout and scale ({FAMILIES['readout and scale']})", 'difference'),
              (f"The interaction at the best rates ({FAMILIES['interaction at best rates']})", 'I')]
    parts = [intro()]
    for (title, what), rows in zip(titles, families):
        parts.append(f"## {title}\n\n{family_table(rows, what)}")
    parts.append(f"## The interaction seed by seed (lr {LR}, each run at its own depth K)\n\n" + seed_table(cells))
    parts.append(f"## ||h_K|| at step {STEPS:,} (the state's norm at depth K, the last evaluation)\n\n"
                 + norm_table(cells))
    parts.append("## Every prediction, checked\n\n" + checks_text(prediction_checks(cells, families)))
    parts.append("## The interaction over training and on the training loss (readings, not tests)\n\n"
                 "Postdictions: these logs were committed before the question was asked, so nothing here counts as "
                 "a prediction met. The verdict rests on the primary row above (I on validation at step "
                 f"{STEPS:,}). Each cell: the mean over the seeds named and its 95% t interval, unadjusted. Seeds "
                 "1-3 of three cells are the convergence grid's runs (the code of that day); seeds 4-6 and K = 1 "
                 "raw are this grid's; the last two rows split I so.\n\n" + course_table(cells)
                 + "\n\n" + penalty_reading(cells)
                 + "\n\n![the interaction over training](fig_interaction_course.png)")
    parts.append("## Readings of the convergence grid's runs (not tests)\n\n" + readings_text(cells))
    if notes:
        parts.append('Not finished (left out): ' + '; '.join(notes))
    return '\n\n'.join(parts) + '\n'


def figure(cells, path):
    """fig_interaction.png: left, each seed's rmsnorm - raw at K = 1 and at K = 4 joined by a line (the
    interaction is the line's rise); right, each seed's I, with the mean and its 95% t interval."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.4), gridspec_kw={'width_ratios': [3, 2]})
    gaps, _ = readout_gaps(cells)
    for s, (d4, d1) in sorted(gaps.items()):
        left.plot([1, 4], [d1, d4], 'o-', alpha=0.7, label=f"seed {s}")
    left.set(xticks=[1, 4], xticklabels=['K = 1', 'K = 4'], xlim=(0.5, 4.5),
             ylabel=f"rmsnorm - raw at depth K, step {STEPS:,} (nats)")
    left.set_title(f"The readout's cost at each depth, lr {LR} (seeds with all four runs)", fontsize=10)
    values = [gaps[s][0] - gaps[s][1] for s in sorted(gaps)]
    right.plot([0] * len(values), values, 'o', alpha=0.6, label='seeds')
    if len(values) > 1:
        t = paired_test(values, MARGIN)
        right.errorbar([0.3], [t['mean']], yerr=[[t['mean'] - t['lo']], [t['hi'] - t['mean']]], fmt='s',
                       color='k', capsize=5, label='mean, 95% t interval')
    right.axhspan(-MARGIN, MARGIN, color='grey', alpha=0.2, label=f"+-{MARGIN:g} margin")
    right.set(xticks=[], xlim=(-0.5, 0.8), ylabel='I (nats)')
    right.set_title(f"I = (rmsnorm - raw at K = 4) - (at K = 1), {len(values)} seeds", fontsize=10)
    for ax in (left, right):
        ax.axhline(0, color='grey', lw=0.8)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return save_figure(fig, path)


# ---- the command

def get_parser():
    return grid_parser(PROG, __doc__, 'the interaction runs', 'interaction', part=True)


def default_folders():
    """The run folders read when none are named: the convergence grid's committed runs (seeds 1-3 of three of
    the four cells, and the best-rate cells) and this grid's committed runs."""
    return sorted(glob.glob(os.path.join(ROOT, 'figures', 'converge', 'runs', '*'))
                  + glob.glob(os.path.join(ROOT, 'figures', 'interaction', 'runs', '*')))


def read_runs(named, trained, defaults=None):
    """The runs named (folders or quoted globs) and those just trained; with none named, the default folders
    (defaults(), this tool's default_folders unless given) beside the trained ones (a trained run reused from its
    committed folder is read once)."""
    if named:
        return load_runs(named, trained)
    seen = {os.path.realpath(f) for f in trained}
    folders = [f for f in (defaults or default_folders)() if os.path.realpath(f) not in seen]
    return load_runs([], list(trained) + folders)


def train_and_read(p, argv, grid, jobs, prog, defaults=None):
    """A grid tool's command line (p: its grid_parser): with --run, train this worker's part of jobs first; then
    read the runs (read_runs). Returns (args, runs); a log that cannot be read is one line."""
    args = p.parse_args(argv)
    extra = split_flags(p, args.train_args)
    part = parse_part(p, args.part)
    check_destination(p, os.path.join(args.fig_dir, 'table.md'), '--fig_dir')  # before hours of training
    trained = []
    if args.run:
        trained = run_grid(args.config, None, args.out_root, extra, grid=grid, prog=prog,
                           finished_in=args.committed, jobs=jobs, part=part)
    try:
        return args, read_runs(args.runs, trained, defaults)
    except LogError as e:
        fail(prog, e)


def main(argv=None):
    args, runs = train_and_read(get_parser(), argv, GRID, JOBS, PROG)
    write_outputs(args.fig_dir, tables(runs),
                  {'fig_interaction.png': lambda path: figure(by_cell(runs)[0], path),
                   'fig_interaction_course.png': lambda path: course_figure(by_cell(runs)[0], path)})


if __name__ == '__main__':
    run_main(main, PROG)
