"""
Paired statistics for python -m lab.paper: which runs are pairs, and what their seed-by-seed differences show.

Runs of one seed share their initialization and batches, so a condition is compared with the reference seed by
seed (the seed in each log header, the same settings otherwise, all pairs at one step), and the spread of those
differences over seeds (not the two conditions' own spreads) is what an interval must come from: the mean
difference gets its standard error and a 95% t interval with n-1 degrees of freedom, and the verdict words
("lower than", "higher than", "no difference shown" when the interval contains 0) are generated from it.

Here too: the paired table's rows and paired.csv's (paired_rows), since every cell is one of these numbers or
words. Not here: reading logs (grid.load_run builds the runs these functions take), writing the files and
drawing the gaps (lab/paper.py: table, plot_crossover). Only numpy and looped.py's config (which fields make a
condition): no scipy.
"""

import json
import math
import re

import numpy as np

from lab.configs import variant_fields

REFERENCE = 'per_loop + rmsnorm'  # the scale-invariant readout that claim 4's variants are measured against
LEVEL = 0.95
# the flags that make a condition; two runs that agree on everything else and share a seed are a pair
CONDITION_KEYS = tuple(f.name for f in variant_fields())


def t_cdf(x, df):
    """P(T <= x) for Student's t with df degrees of freedom, for t_quantile: Simpson's rule on the density over
    [0, |x|] (smooth and short, so 20,000 panels are exact far below the digits printed)."""
    grid = np.linspace(0.0, abs(x), 20001)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = np.exp(log_c - (df + 1) / 2 * np.log1p(grid ** 2 / df))
    area = (grid[1] - grid[0]) / 3 * (density[0] + density[-1] + 4 * density[1:-1:2].sum() + 2 * density[2:-1:2].sum())
    return 0.5 + math.copysign(area, x)


def t_quantile(p, df):
    """The p-quantile of Student's t with df degrees of freedom, by bisection on t_cdf: scipy is not a dependency
    and torch's StudentT has no icdf."""
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:  # bracket the quantile first: for df = 1 it is 12.7 at p = 0.975
        lo, hi = hi, 2 * hi
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def paired_stats(diffs, level=LEVEL):
    """Mean, standard error and two-sided t interval (n - 1 degrees of freedom) of seed-by-seed differences
    (pairs along axis 0, any depths along axis 1). SE and interval are nan below two pairs: one pair has no spread."""
    d = np.asarray(diffs, dtype=float)
    n, mean = len(d), d.mean(axis=0)
    if n < 2:
        nan = np.full_like(mean, np.nan)
        return {'n': n, 'df': 0, 'mean': mean, 'se': nan, 'lo': nan, 'hi': nan, 't': math.nan}
    se = d.std(axis=0, ddof=1) / math.sqrt(n)  # ddof 1: the sample std that the t distribution is built for
    t = t_quantile(0.5 + level / 2, n - 1)
    return {'n': n, 'df': n - 1, 'mean': mean, 'se': se, 'lo': mean - t * se, 'hi': mean + t * se, 't': t}


def sample_sd(values, axis=0):
    """The sample standard deviation over seeds (ddof 1), which every table's +- shows; 0 for a single seed,
    which has no spread."""
    values = np.asarray(values, dtype=float)
    return values.std(axis=axis, ddof=1) if values.shape[axis] > 1 else np.zeros_like(values.mean(axis=axis))


def fmt_number(v, f='+.3f'):
    """A table's number, rounded once to the format's digits ('n/a' for nan); a value that rounds to zero is
    printed without a minus sign."""
    if not math.isfinite(v):
        return 'n/a'
    text = format(v, f)
    return format(0.0, f) if float(text) == 0 else text


def p_value(t, df):
    """Two-sided p-value of a t statistic with df degrees of freedom."""
    return 2 * (1 - t_cdf(abs(t), df)) if math.isfinite(t) else math.nan


def holm(p_values):
    """Holm's step-down adjustment of a family's p-values, in their order: the k-th smallest of m is multiplied
    by m - k + 1, and each adjusted value is at least the one before it (so the family's chance of any false
    'lower' or 'higher' stays below the level). nan (no test yet: fewer than two pairs) stays nan but counts in
    m: the family is the comparisons declared, not those measured so far."""
    p = np.asarray(p_values, dtype=float)
    tested = np.flatnonzero(np.isfinite(p))
    adjusted, running, m = np.full(len(p), np.nan), 0.0, len(p)
    for rank, i in enumerate(tested[np.argsort(p[tested], kind='stable')]):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()


def paired_test(diffs, margin):
    """Paired tests of one comparison's seed-by-seed differences (1-D): the mean, the sample SD (ddof 1), the
    95% t interval, the two-sided p of 'the mean is 0', and TOST's p of 'the mean lies outside +-margin' (the
    larger of the two one-sided p-values: below 0.05 means equivalent within the margin at that level)."""
    d = np.asarray(diffs, dtype=float)
    stats = paired_stats(d[:, None])
    n, mean = stats['n'], float(stats['mean'][0])
    out = {'n': n, 'mean': mean, 'sd': float(d.std(ddof=1)) if n > 1 else math.nan,
           'lo': float(stats['lo'][0]), 'hi': float(stats['hi'][0]), 'p': math.nan, 'p_tost': math.nan}
    if n > 1:
        out['p'], out['p_tost'] = summary_p(mean, float(stats['se'][0]), n - 1, margin)
    return out


def summary_p(mean, se, df, margin):
    """(two-sided p of 'the mean is 0', TOST's p of 'the mean lies outside +-margin') from a mean difference, its
    standard error and degrees of freedom (as a committed paired.csv holds them). TOST's p is the larger of the
    two one-sided p-values: below 0.05 means equivalent within the margin at that level."""
    if not (se > 0 and df >= 1):
        return math.nan, math.nan
    below = 1 - t_cdf((mean + margin) / se, df)  # H0: mean <= -margin
    above = t_cdf((mean - margin) / se, df)      # H0: mean >= +margin
    return p_value(mean / se, df), max(below, above)


VERDICTS = ('lower', 'higher', 'equivalent within +-{m}', 'not resolved')  # the one vocabulary


def family_verdicts(tests, margin, alpha=0.05):
    """Verdicts for one family of paired_test results (a list), Holm-adjusted over the family: each test gets
    'p_holm' and 'p_tost_holm' and a 'verdict': 'equivalent within +-margin' where the adjusted TOST p is
    below alpha (a difference too small to matter, whatever its sign), else 'lower' or 'higher' where the
    adjusted p is, else 'not resolved' (the interval allows a difference of either sign or beyond the margin:
    no difference shown, which is not no cost)."""
    p_holm, tost_holm = holm([t['p'] for t in tests]), holm([t['p_tost'] for t in tests])
    for test, p, p_tost in zip(tests, p_holm, tost_holm):
        test['p_holm'], test['p_tost_holm'] = p, p_tost
        if p_tost < alpha:
            test['verdict'] = f"equivalent within +-{margin:g}"
        elif p < alpha:
            test['verdict'] = 'lower' if test['mean'] < 0 else 'higher'
        else:
            test['verdict'] = 'not resolved'
    return tests


def verdict(lo, hi, reference):
    """The words for one interval of (condition minus reference) loss; the README quotes these, so no verdict is
    ever written by hand."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return 'no interval (fewer than 2 pairs)'
    if hi < 0:
        return f"lower than {reference}"
    if lo > 0:
        return f"higher than {reference}"
    return 'no difference shown'


def default_reference(names):
    """The condition the others pair with when none is named: REFERENCE, or where the runs hold it under one
    other init only, that one ('per_loop + rmsnorm (gpt2 init)'); REFERENCE when neither is there."""
    under_init = [n for n in names if re.fullmatch(re.escape(REFERENCE) + r' \(\w+ init\)', n)]
    return under_init[0] if REFERENCE not in names and len(under_init) == 1 else REFERENCE


def setting(run):
    """A run's configuration without its condition, seed and folder: a condition's run and the reference's run of
    one seed are a pair only where these agree (model size, data, learning rate, evaluations...)."""
    # tie_weights: the flag (unset under the lab, True in train.py) is compared as the model's resolved value
    skip = {'seed', 'out_dir', 'resume', 'overwrite', 'max_iters', 'num_params', 'model', 'tie_weights',
            *CONDITION_KEYS}
    c = {k: v for k, v in run['config'].items() if k not in skip}
    c['model'] = {k: v for k, v in run['config']['model'].items() if k not in CONDITION_KEYS}
    return json.dumps(c, sort_keys=True)


def at_step(run, step):
    """The run's evaluation record at step, or None."""
    return next((r for r in run['records'] if r['step'] == step), None)


def progress(run):
    """'folder at step 800 of 2000': where a run's log ends, for notes on runs left out or still training."""
    return f"{run['folder']} at step {run['records'][-1]['step']} of {run['config'].get('max_iters')}"


def pair_up(groups, reference):
    """Every other condition's runs matched with the reference's by seed (the seed in each log header) and setting,
    compared at one step per condition: {condition: {'step', 'K', 'pairs': [(seed, run, reference run)],
    'left_out': [reason, ...]}}."""
    refs = {(setting(run), run['config']['seed']): run for runs in groups.values() for run in runs
            if run['name'] == reference}
    paired = {}
    for name, runs in groups.items():
        if not refs:  # nothing to compare with (plots of other conditions only): no paired table, and no noise
            break
        if runs[0]['name'] == reference:
            continue
        candidates, left_out = [], []
        for run in runs:
            seed = run['config']['seed']
            ref = refs.get((setting(run), seed))
            if seed in [c[0] for c in candidates]:  # a copy of a run must not count its seed twice
                left_out.append(f"seed {seed}: {run['folder']} is a second run of this seed")
            elif ref is None:
                left_out.append(f"seed {seed}: no {reference} run of seed {seed} with the same settings as "
                                f"{run['folder']}")
            else:  # the last step both have evaluated: a finished run against one still training meets it there
                candidates.append((seed, run, ref, min(run['records'][-1]['step'], ref['records'][-1]['step'])))
        if not candidates:
            paired[name] = {'step': None, 'K': runs[0]['K'], 'pairs': [], 'left_out': left_out}
            continue
        # one step per condition, the one most pairs reach (ties: the later): a mean over pairs compared at different
        # steps would mix training lengths, so a seed that has not got there yet is left out, not cut short
        steps = [c[3] for c in candidates]
        step = max(set(steps), key=lambda s: (steps.count(s), s))
        pairs = []
        for seed, run, ref, s in sorted(candidates, key=lambda c: c[0]):
            if s == step and at_step(run, step) and at_step(ref, step):
                pairs.append((seed, run, ref))
            else:
                left_out.append(f"seed {seed}: {progress(run)}, {progress(ref)} (the other pairs are compared at "
                                f"step {step})")
        paired[name] = {'step': step, 'K': runs[0]['K'], 'pairs': pairs, 'left_out': left_out}
    return paired


def paired_diffs(entry, step=None):
    """(pairs, 2K) array: each pair's validation loss at depths 1..2K minus the reference's, at step (default: the
    condition's comparison step)."""
    step = entry['step'] if step is None else step
    return np.array([np.subtract(at_step(run, step)['val_loss'], at_step(ref, step)['val_loss'])
                     for _, run, ref in entry['pairs']])


def paired_rows(paired, reference):
    """The paired table's header and rows (per condition: at depth K with the verdict, then at every depth
    1..2K), paired.csv's rows (one per condition and depth) and a note for every run left out."""
    fmt = lambda v: f"{round(v, 4) + 0.0:+.4f}"  # + 0.0: no '-0.0000' for a difference that rounds to zero
    max_K = max(entry['K'] for entry in paired.values())
    header = ['condition', 'pairs', 'seeds', 'step', 'diff at depth K', 'SE', f'{LEVEL:.0%} t interval', 'df',
              'verdict at depth K'] + [f"depth {d}" for d in range(1, 2 * max_K + 1)]
    if len({entry['K'] for entry in paired.values()}) == 1:  # one K: mark its columns
        header[8 + max_K] += ' (K)'
        header[8 + 2 * max_K] += ' (2K)'
    rows, csv_rows, notes = [], [], []
    for name, entry in paired.items():
        notes += [f"{name}, left out: {reason}" for reason in entry['left_out']]
        if not entry['pairs']:
            rows.append([name, '0', '', '', '', '', '', '', f"no pairs with {reference}"] + [''] * (2 * max_K))
            continue
        K, stats = entry['K'], paired_stats(paired_diffs(entry))
        seeds = ' '.join(str(seed) for seed, _, _ in entry['pairs'])
        total = entry['pairs'][0][1]['config'].get('max_iters')
        step = f"{entry['step']}" + (f" of {total}" if total and entry['step'] < total else '')
        interval = lambda i: f"[{fmt(stats['lo'][i])}, {fmt(stats['hi'][i])}]" if stats['n'] > 1 else 'n/a'
        cells = []
        for i in range(2 * K):  # every depth: the mean, its interval, and the verdict's first word where it is one
            words = verdict(stats['lo'][i], stats['hi'][i], reference)
            mark = {'lower': ' lower', 'higher': ' higher'}.get(words.split()[0], '')
            cells.append(fmt(stats['mean'][i]) + (f" {interval(i)}{mark}" if stats['n'] > 1 else ''))
            csv_rows.append([name, reference, i + 1, i + 1 == K, stats['n'], seeds, entry['step'], stats['mean'][i],
                             stats['se'][i], stats['lo'][i], stats['hi'][i], stats['df'], stats['t'], words])
        rows.append([name, str(stats['n']), seeds, step, fmt(stats['mean'][K - 1]),
                     f"{stats['se'][K - 1]:.4f}" if stats['n'] > 1 else 'n/a', interval(K - 1),
                     str(stats['df']) if stats['n'] > 1 else 'n/a',
                     verdict(stats['lo'][K - 1], stats['hi'][K - 1], reference)]
                    + cells + [''] * (2 * (max_K - K)))
    return header, rows, csv_rows, notes
