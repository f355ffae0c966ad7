"""
The paper's figures and table from training logs (out/*/log.jsonl), optionally training the grid first.

Draw from runs that exist (folders or quoted globs):
    python plot_norms.py out/laptop out/laptop-raw out/laptop-pen0.01 out/laptop-normed
    python plot_norms.py 'out/grid/laptop/*' --fig_dir=figures/laptop
Train the paper's conditions (finished runs are reused, interrupted ones resumed), then draw:
    python plot_norms.py --run                                # laptop configuration, 1 seed
    python plot_norms.py --run --config=gpu_char --seeds=3    # on a GPU

Writes to --fig_dir: fig1_norm_explosion.png (final-loop ||h_K|| against step, log scale),
fig2_norm_by_loop.png (||h_k|| against loop k at the end), fig3_loss_by_depth.png (validation loss
against exit depth 1..K and 2K), fig6_crossover.png (validation loss at depth K against step, and each
condition's gap to the reference condition, per_loop + rmsnorm unless --reference says otherwise: claim 4),
table.md / table.csv, and from each run's checkpoint the timed per-sequence early-exit benchmark
(diagnose.exit_benchmark): exit_table.md and fig4_pareto.png (perplexity against measured tokens/s; time it
on an otherwise idle machine). Every run is read at its own K (the n_loop in its log header).

Paired differences (table.md's second table, paired.csv, fig6's middle and right panels): runs of one seed
share their initialization and batches, so each condition is compared with the reference seed by seed (the
seed in each log header, same settings otherwise, all pairs at one step), and the mean difference gets its
standard error and a 95% t interval over seeds (n-1 degrees of freedom). The verdict words ("lower than",
"higher than", "no difference shown" when the interval contains 0) are generated from the intervals.

Ctrl-C during --run passes the interrupt to the running train.py, waits for its checkpoint, and exits 130;
the same command continues the grid.
"""

import argparse
import csv
import glob
import io
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time

import numpy as np

from data.common import check_writable, write_atomically
from looped import LoopedGPT, resolve_device
from train import CONFIGS

HERE = os.path.dirname(os.path.abspath(__file__))

# The paper's main grid plus the two variants its abstract names; each is one train.py run per seed.
CONDITIONS = {
    'terminal + rmsnorm': ['--supervision=terminal', '--readout=rmsnorm'],
    'terminal + raw': ['--supervision=terminal', '--readout=raw'],
    'per_loop + rmsnorm': ['--supervision=per_loop', '--readout=rmsnorm'],
    'per_loop + raw': ['--supervision=per_loop', '--readout=raw'],
    'per_loop + final_norm': ['--supervision=per_loop', '--readout=final_norm'],
    'terminal + rmsnorm + penalty': ['--supervision=terminal', '--readout=rmsnorm', '--norm_penalty=0.01'],
    'per_loop + rmsnorm + penalty': ['--supervision=per_loop', '--readout=rmsnorm', '--norm_penalty=0.01'],
    'per_loop + layernorm': ['--supervision=per_loop', '--readout=layernorm'],
    'per_loop + rmsnorm + normed': ['--supervision=per_loop', '--readout=rmsnorm', '--recurrence=normed'],
    'per_loop + alpha': ['--supervision=per_loop', '--readout=alpha'],
}
# Claim 4 (scale control wins at matched depth once training is long enough) compares per-loop runs only.
CLAIM4 = ['per_loop + rmsnorm', 'per_loop + raw', 'per_loop + rmsnorm + penalty', 'per_loop + final_norm',
          'per_loop + rmsnorm + normed', 'per_loop + alpha']
# laptop_deep asks whether the ranking of the two readouts turns in a deeper stack (13 minutes a run on 2 cores)
GRID_CONDITIONS = {'laptop_long': CLAIM4, 'laptop_deep': ['per_loop + rmsnorm', 'per_loop + raw']}  # others: all ten
# Grid runs are shorter than single runs: on 'laptop' all ten fit in about 15 minutes on a 2-core CPU.
GRID_FLAGS = {'laptop': ['--max_iters=200', '--eval_interval=40', '--eval_iters=4'],
              'gpu_char': ['--max_iters=1000', '--eval_interval=100']}
# Okabe-Ito colours (colour-blind safe; its yellow swapped for a darker wine, which reads on white) with
# line styles and markers, so the figures also read in grey.
STYLES = [('#000000', '-', 'o'), ('#E69F00', '--', 's'), ('#56B4E9', '-.', '^'), ('#009E73', ':', 'D'),
          ('#882255', '-', 'v'), ('#0072B2', '--', 'P'), ('#D55E00', '-.', 'X'), ('#CC79A7', ':', '*'),
          ('#999999', '-', 'h'), ('#44AA99', '--', 'p')]


class LogError(Exception):
    """A run folder that cannot be read; the message names the folder."""


def condition_name(cfg):
    """The CONDITIONS key of a run, from the model config in its log."""
    name = f"{cfg['supervision']} + {cfg['readout']}"
    if cfg.get('alpha') is not None:
        name += f" {cfg['alpha']:g}"
    if cfg['norm_penalty'] > 0:
        name += ' + penalty' if cfg['norm_penalty'] == 0.01 else f" + penalty {cfg['norm_penalty']:g}"
    if cfg['recurrence'] == 'normed':
        name += ' + normed'
    if cfg['init'] != 'paper':
        name += f" ({cfg['init']} init)"
    return name


def load_run(folder):
    """{'name', 'config', 'records'} from folder/log.jsonl; LogError with a one-line reason otherwise."""
    path = os.path.join(folder, 'log.jsonl')
    if not os.path.isfile(path):
        raise LogError(f"{folder}: no log.jsonl (not a train.py run folder?)")
    try:
        with open(path) as f:
            text = f.read()
        # a run still training may be halfway through appending a line: read up to its last complete one
        # (train.py's own log repair drops a cut last line the same way)
        lines = [json.loads(line) for line in text[:text.rfind('\n') + 1].splitlines() if line.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LogError(f"{folder}: log.jsonl is not valid JSON lines ({e})") from None
    if not lines:
        raise LogError(f"{folder}: log.jsonl is empty")
    head, records = lines[0], lines[1:]
    need = {'step', 'train_loss', 'val_loss', 'hidden_norm', 'elapsed_s'}
    K = head.get('config', {}).get('model', {}).get('n_loop')
    # one scheme: val_loss and hidden_norm hold every depth 1..2K
    if K is None or not all(need <= set(r) and len(r['val_loss']) == len(r['hidden_norm']) == 2 * K for r in records):
        raise LogError(f"{folder}: log.jsonl is in an older or unknown format; rerun it with this train.py")
    if not records:
        raise LogError(f"{folder}: log.jsonl has no evaluation yet")
    cfg = head['config']['model']
    # K is each run's own: runs of different depths can share one plot
    return {'folder': folder, 'name': condition_name(cfg), 'config': head['config'], 'records': records, 'K': K}


def group_runs(runs):
    """Runs that differ only in their seed together, in CONDITIONS order, then any others."""
    # two runs are seeds of one condition when every flag but these agrees (max_iters: a resumed, longer run
    # is still the same condition)
    same = lambda run: json.dumps({k: v for k, v in run['config'].items()
                                   if k not in ('seed', 'out_dir', 'resume', 'overwrite', 'max_iters')}, sort_keys=True)
    by_setting = {}
    for run in runs:
        by_setting.setdefault(same(run), []).append(run)
    groups = {}
    for members in by_setting.values():
        name = members[0]['name']
        if name in groups:  # same condition, other settings (width, learning rate...): tell them apart
            name += f" [{os.path.basename(os.path.normpath(members[0]['folder']))}]"
        groups[name] = members
    order = list(CONDITIONS) + sorted(set(groups) - set(CONDITIONS))
    return {name: groups[name] for name in order if name in groups}


def caught_up(groups):
    """Each condition's runs that reached its furthest evaluation, and a note on each one behind (still training,
    or stopped early): curves and means over seeds at different steps would mix training lengths."""
    kept, behind = {}, []
    for name, runs in groups.items():
        last = max(run['records'][-1]['step'] for run in runs)
        kept[name] = [run for run in runs if run['records'][-1]['step'] == last]
        behind += [progress(run) for run in runs if run['records'][-1]['step'] < last]
    return kept, behind


def series(runs, key, index=None):
    """steps and a (seeds, evals) array of r[key] (or r[key][index]), over the evaluations all seeds have."""
    n = min(len(run['records']) for run in runs)  # a seed still training must not cut the others' curves short
    steps = [r['step'] for r in runs[0]['records'][:n]]
    pick = (lambda r: r[key]) if index is None else (lambda r: r[key][index])
    return steps, np.array([[pick(r) for r in run['records'][:n]] for run in runs])


def mean_std(values):
    """Mean and spread over seeds, for the first table and the bands; the paired table is where intervals are."""
    # std over seeds (population, ddof 0): it describes the spread seen, it is no confidence interval
    values = np.asarray(values, dtype=float)
    return values.mean(axis=0), values.std(axis=0)


# ---------------------------------------------------------------------------------------------------------------------
# paired statistics: runs of one seed share their initialization and batches, so a condition is compared with the
# reference seed by seed, and the spread of those differences over seeds (not the two conditions' own spreads) is
# what an interval must come from

REFERENCE = 'per_loop + rmsnorm'  # the scale-invariant readout that claim 4's variants are measured against
LEVEL = 0.95
# the flags that make a condition; two runs that agree on everything else and share a seed are a pair
CONDITION_KEYS = ('supervision', 'readout', 'alpha', 'norm_penalty', 'recurrence', 'init')


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


def setting(run):
    """A run's configuration without its condition, seed and folder: a condition's run and the reference's run of
    one seed are a pair only where these agree (model size, data, learning rate, evaluations...)."""
    skip = {'seed', 'out_dir', 'resume', 'overwrite', 'max_iters', 'num_params', 'model', *CONDITION_KEYS}
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


# ---------------------------------------------------------------------------------------------------------------------
# figures and tables

def describe(runs):
    """'0.55M-parameter looped LM (2 layers x K=4, d=128) on shakespeare_char' for figure titles (K=2/3 when the
    runs differ in depth)."""
    c = runs[0]['config']
    m = c['model']
    n = c.get('num_params')
    size = f"{n / 1e6:.2f}M-parameter " if n else ''
    Ks = '/'.join(map(str, sorted({run['K'] for run in runs})))
    return f"{size}looped LM ({m['n_layer']} layers x K={Ks}, d={m['n_embd']}) on {os.path.basename(c['dataset'])}"


def finish(fig, ax, path):
    """Grid, legend outside the axes (the lines need the room), PNG plus an SVG copy for papers and slides."""
    import matplotlib.pyplot as plt
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    save_figure(fig, path, dpi=130)
    save_figure(fig, path[:-4] + '.svg')
    plt.close(fig)
    return path


def exit_depths(K):
    """The depths every figure and table reports: 1..K and 2K (beyond the trained depth)."""
    return list(range(1, K + 1)) + [2 * K]


def final_curves(ax, groups, key, depths_of):
    """One line per condition through the last evaluation's r[key] at the depths depths_of(K) (1-indexed, K: the
    condition's own); seeds give error bars."""
    for (name, runs), (color, ls, marker) in zip(groups.items(), STYLES * 2):
        depths = depths_of(runs[0]['K'])
        mean, std = mean_std([[run['records'][-1][key][d - 1] for d in depths] for run in runs])
        ax.errorbar(depths, mean, yerr=std if len(runs) > 1 else None, color=color, ls=ls, marker=marker, ms=5, label=name)


def plot(groups, fig_dir, paired, reference=REFERENCE):
    """The figures; returns their paths. Every run is read at its own K."""
    import matplotlib
    matplotlib.use('Agg')  # files only; no display needed
    import matplotlib.pyplot as plt

    os.makedirs(fig_dir, exist_ok=True)
    seeds = sorted({len(runs) for runs in groups.values()})
    title = describe([run for runs in groups.values() for run in runs])
    title += f", {'/'.join(map(str, seeds))} seed{'s' * (seeds != [1])} per condition"
    title += '\n(mean over seeds; band: +- 1 std)' if seeds != [1] else ''
    Ks = sorted({runs[0]['K'] for runs in groups.values()})
    style = dict(zip(groups, STYLES * 2))
    paths = []

    fig, ax = plt.subplots(figsize=(10, 5))
    for name, runs in groups.items():
        color, ls, marker = style[name]
        steps, h = series(runs, 'hidden_norm', runs[0]['K'] - 1)
        mean, std = mean_std(h)
        ax.plot(steps, mean, color=color, ls=ls, marker=marker, ms=4, label=name)
        if len(runs) > 1:
            ax.fill_between(steps, np.maximum(mean - std, 1e-3), mean + std, color=color, alpha=0.15)
    ax.set(yscale='log', xlabel='training step', ylabel=r'final-loop norm $\|h_K\|$ (mean over tokens)',
           title=f"Norm explosion\n{title}")
    paths.append(finish(fig, ax, os.path.join(fig_dir, 'fig1_norm_explosion.png')))

    fig, ax = plt.subplots(figsize=(10, 5))
    final_curves(ax, groups, 'hidden_norm', lambda K: list(range(1, 2 * K + 1)))
    for K in Ks:
        ax.axvline(K, color='grey', lw=0.8)
        ax.text(K, 0.02, f" trained K={K}" if len(Ks) > 1 else ' trained K', color='grey', va='bottom', fontsize=8,
                transform=ax.get_xaxis_transform())
    ax.set(yscale='log', xlabel='loop k (beyond K: extrapolation)', ylabel=r'$\|h_k\|$ at the end of training',
           title=f"Norm by loop at the end of training\n{title}")
    paths.append(finish(fig, ax, os.path.join(fig_dir, 'fig2_norm_by_loop.png')))

    fig, ax = plt.subplots(figsize=(10, 5))
    final_curves(ax, groups, 'val_loss', exit_depths)
    # untrained exits (terminal supervision, early loops) can sit at tens of nats: keep the frame on the rest
    at_K = [np.mean([run['records'][-1]['val_loss'][run['K'] - 1] for run in runs]) for runs in groups.values()]
    low = min(min(run['records'][-1]['val_loss'][d - 1] for d in exit_depths(run['K']))
              for runs in groups.values() for run in runs)
    ax.set_ylim(low - 0.05, max(at_K) + 0.5 * (max(at_K) - low) + 0.1)
    ax.set(xlabel='exit depth (loops run before reading out)', ylabel='validation loss (nats per token)',
           xticks=sorted({d for K in Ks for d in exit_depths(K)}),
           title=f"Validation loss by exit depth (points above the frame are off the scale)\n{title}")
    paths.append(finish(fig, ax, os.path.join(fig_dir, 'fig3_loss_by_depth.png')))

    with_alpha = {name: runs for name, runs in groups.items() if 'alpha' in runs[0]['records'][-1]}
    if with_alpha:  # the alpha readout's learned exponent: which alpha does cross-entropy choose?
        fig, ax = plt.subplots(figsize=(10, 5))
        for (name, runs), (color, ls, marker) in zip(with_alpha.items(), STYLES * 2):
            steps, a = series(runs, 'alpha')
            mean, std = mean_std(a)
            ax.plot(steps, mean, color=color, ls=ls, marker=marker, ms=4, label=name)
            if len(runs) > 1:
                ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.15)
        ax.set(ylim=(0, 1), xlabel='training step', ylabel=r'$\alpha$ (0: scale-invariant, 1: raw)',
               title=f"The alpha readout's learned exponent\n{title}")
        paths.append(finish(fig, ax, os.path.join(fig_dir, 'fig5_alpha.png')))

    # claim 4: does a scale-controlled variant overtake the scale-invariant readout as training goes on, and is the
    # difference at the end larger than the seeds' paired spread allows by chance?
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(20, 5.5))
    for name, runs in groups.items():
        color, ls, marker = style[name]
        steps, loss = series(runs, 'val_loss', runs[0]['K'] - 1)
        mean, std = mean_std(loss)
        left.plot(steps, mean, color=color, ls=ls, marker=marker, ms=3, label=name)
        if len(runs) > 1:
            left.fill_between(steps, mean - std, mean + std, color=color, alpha=0.15)
    finals = [series(runs, 'val_loss', runs[0]['K'] - 1)[1][:, -1].mean() for runs in groups.values()]
    left.set_ylim(min(finals) - 0.15, max(finals) + 0.6)  # the first evaluations sit far above: keep the end in view
    left.set(xlabel='training step', ylabel='validation loss at depth K=' + '/'.join(map(str, Ks)),
             title='validation loss at the trained depth\n(mean over seeds; band: +- 1 std)')
    shown = {name: entry for name, entry in paired.items() if entry['pairs']}
    for name, entry in shown.items():
        color, ls, marker = style[name]
        K = entry['K']
        # the gap against step, pair by pair, over the evaluations every pair has up to the comparison step
        steps = sorted(set.intersection(*[{r['step'] for r in x['records']} for _, run, ref in entry['pairs']
                                          for x in (run, ref)]))
        steps = [s for s in steps if s <= entry['step']]
        gap = np.stack([paired_diffs(entry, s)[:, K - 1] for s in steps], axis=1)  # (pairs, steps)
        stats = paired_stats(gap)
        middle.plot(steps, stats['mean'], color=color, ls=ls, marker=marker, ms=3, label=name)
        if stats['n'] > 1:
            middle.fill_between(steps, stats['lo'], stats['hi'], color=color, alpha=0.15)
        # the gap against depth at the comparison step, with its interval (nudged sideways so the bars do not overlap)
        stats = paired_stats(paired_diffs(entry))
        depths = np.arange(1, 2 * K + 1) + 0.06 * (list(shown).index(name) - (len(shown) - 1) / 2)
        yerr = None if stats['n'] < 2 else [stats['mean'] - stats['lo'], stats['hi'] - stats['mean']]
        right.errorbar(depths, stats['mean'], yerr=yerr, color=color, ls=ls, marker=marker, ms=4, capsize=2,
                       label=f"{name} ({stats['n']} pair{'s' * (stats['n'] != 1)}, step {entry['step']})")
    ref_color = style[reference][0] if reference in style else 'grey'
    for ax in (middle, right):
        ax.axhline(0, color=ref_color, lw=1.2, label=f"{reference} (the zero line)")
    paired_Ks = sorted({entry['K'] for entry in shown.values()})
    for K in paired_Ks:
        right.axvline(K, color='grey', lw=0.8, ls=':')
    if paired_Ks:
        right.set_xticks(range(1, 2 * max(paired_Ks) + 1))
    middle.set_ylim(-0.3, 0.5)
    middle.set(xlabel='training step', ylabel=f'loss minus {reference} (below 0: better)',
               title=f'gap to {reference} at depth K, paired by seed\n'
                     f'(mean; band: {LEVEL:.0%} t interval over seeds, n-1 df)')
    right.set(xlabel='exit depth (dotted: trained K)', ylabel=f'loss minus {reference} (below 0: better)',
              title=f'paired gap by depth at the comparison step (legend)\n'
                    f'(mean; bars: {LEVEL:.0%} t interval over seeds, n-1 df)')
    for ax in (left, middle, right):
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=7, loc='upper right')
    if shown:
        right.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1))
    else:
        for ax in (middle, right):
            ax.text(0.5, 0.5, f'no {reference} run to pair with', ha='center', transform=ax.transAxes)
    # each panel names its own band (std over seeds, or a t interval over pairs): the common title line does not
    fig.suptitle(f"Claim 4: does scale control win at matched depth with longer training?\n{title.splitlines()[0]}",
                 fontsize=10)
    fig.tight_layout()
    save_figure(fig, os.path.join(fig_dir, 'fig6_crossover.png'), dpi=130)
    plt.close(fig)
    paths.append(os.path.join(fig_dir, 'fig6_crossover.png'))
    return paths


def table(groups, fig_dir, paired, reference=REFERENCE, behind=()):
    """Per condition: final-depth perplexity and ||h_K|| (mean +- std over seeds), perplexity at depths 1..K and 2K,
    and the alpha readout's final alpha where there is one; then the paired differences. Returns table.md's text."""
    # runs of different K share the table: a column for every depth any of them reports, blank where a run has none
    depths = sorted({d for runs in groups.values() for d in exit_depths(runs[0]['K'])})
    header = ['condition', 'seeds', 'step', 'K', 'val ppl (depth K)', '‖h_K‖'] + [f"ppl@{d}" for d in depths] + ['alpha']
    pm = lambda v, f: f"{v.mean():{f}}" + (f" +- {v.std():{f}}" if len(v) > 1 else '')
    rows = []
    for name, runs in groups.items():
        K, last = runs[0]['K'], [run['records'][-1] for run in runs]
        ppl = {d: np.exp([r['val_loss'][d - 1] for r in last]) for d in exit_depths(K)}
        h = np.array([r['hidden_norm'][K - 1] for r in last])
        alpha = pm(np.array([r['alpha'] for r in last]), '.3f') if 'alpha' in last[0] else ''
        rows.append([name, str(len(runs)), str(min(r['step'] for r in last)), str(K), pm(ppl[K], '.3f'), pm(h, '.1f')]
                    + [pm(ppl[d], '.2f') if d in ppl else '' for d in depths] + [alpha])
    write_csv(os.path.join(fig_dir, 'table.csv'), [header] + rows)
    md = markdown(header, rows)
    unfinished = [progress(run) for runs in groups.values() for run in runs
                  if run['records'][-1]['step'] < (run['config'].get('max_iters') or 0)]
    if behind:
        md += ('\n\nLeft out of this table and the figures, behind the other seeds of their condition (still '
               'training, or stopped early): ' + '; '.join(behind))
    if unfinished:
        md += ('\n\nNot finished (still training, or stopped early; the table shows their last evaluation): '
               + '; '.join(unfinished))
    md += '\n\n' + paired_table(paired, reference, fig_dir)
    write_text(os.path.join(fig_dir, 'table.md'), md + '\n')
    return md


def paired_table(paired, reference, fig_dir):
    """The paired differences to the reference as markdown (returned) and paired.csv: at depth K with the verdict,
    and at every depth 1..2K."""
    fmt = lambda v: f"{round(v, 4) + 0.0:+.4f}"  # + 0.0: no '-0.0000' for a difference that rounds to zero
    lines = [f"Paired differences to {reference}: validation loss (nats) minus {reference}'s, seed by seed (runs "
             "paired by the seed in their log header, with the same settings, compared at one step), then the mean, "
             f"its standard error (sample std / sqrt(n)) and a {LEVEL:.0%} t interval over seeds with n-1 degrees of "
             "freedom. An interval that contains 0: no difference shown."]
    if not paired:
        if os.path.exists(os.path.join(fig_dir, 'paired.csv')):  # an earlier plot's: it does not describe these runs
            os.remove(os.path.join(fig_dir, 'paired.csv'))
        return lines[0] + f"\n\nNo paired differences: these runs hold no {reference} run, or no other condition."
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
    write_csv(os.path.join(fig_dir, 'paired.csv'), [['condition', 'reference', 'depth', 'is_K', 'pairs', 'seeds', 'step',
                                                     'mean_diff', 'se', 'lo', 'hi', 'df', 't', 'verdict']] + csv_rows)
    lines.append(markdown(header, rows))
    if notes:
        lines.append('\n'.join(f"- {note}" for note in notes))
    return '\n\n'.join(lines)


def write_text(path, text):
    """Write a table through a fresh temporary file (a link planted at path is replaced, never followed)."""
    write_atomically(path, lambda f: f.write(text.encode('utf-8')))


def write_csv(path, rows):
    """A CSV table, written the same way."""
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    write_text(path, buf.getvalue())


def save_figure(fig, path, **kwargs):
    """fig.savefig through a fresh temporary file, in the format the name says (png, svg)."""
    write_atomically(path, lambda f: fig.savefig(f, format=path.rsplit('.', 1)[-1], **kwargs))


def markdown(header, rows):
    """A markdown table's text."""
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)] + ['| ' + ' | '.join(r) + ' |' for r in rows]
    return '\n'.join(lines)


def write_markdown(path, header, rows):
    """A markdown table to path; returns its text."""
    md = markdown(header, rows)
    write_text(path, md + '\n')
    return md


def exit_results(groups, max_windows):
    """diagnose.exit_benchmark for every run, from its ckpt.pt: {condition: [rows of each seed]}. It times real
    batched runs, so the tok/s columns mean something only on an otherwise idle machine."""
    import diagnose
    device = resolve_device().device
    results = {}
    for name, runs in groups.items():
        results[name] = []
        for run in runs:
            model, ckpt = LoopedGPT.from_checkpoint(run['folder'], device)
            x, y = diagnose.windows(diagnose.val_tokens(ckpt), model.config.block_size, max_windows)
            results[name].append(diagnose.exit_benchmark(model, x, y, model.config.n_loop))
    return results


def seed_mean(seeds, score, point, key):
    """One entry of exit_benchmark's rows (score, operating point -> key: loops, ppl or tok_s), averaged over the
    seeds of a condition (seeds: one list of rows per seed)."""
    return float(np.mean([next(r[key] for r in rows if r['score'] == score and r['point'] == point) for rows in seeds]))


def exit_table(results, fig_dir):
    """Per condition (mean over seeds): the plain depth-K model's perplexity and tok/s, and for every score the
    calibrated exit's mean loops, perplexity and tok/s, measured on the held-out half of the windows."""
    import diagnose
    header = ['condition', 'ppl (depth K)', 'tok/s (depth K)'] + [f"{s} {col}" for s in diagnose.SCORES
                                                                  for col in ('loops', 'ppl', 'tok/s')]
    rows = []
    for name, seeds in results.items():
        plain = seeds[0][0]['point']  # 'depth K': the first row, the model without an exit
        row = [name, f"{seed_mean(seeds, 'none', plain, 'ppl'):.3f}", f"{seed_mean(seeds, 'none', plain, 'tok_s'):,.0f}"]
        for s in diagnose.SCORES:
            row += [f"{seed_mean(seeds, s, 'calibrated', 'loops'):.2f}", f"{seed_mean(seeds, s, 'calibrated', 'ppl'):.3f}",
                    f"{seed_mean(seeds, s, 'calibrated', 'tok_s'):,.0f}"]
        rows.append(row)
    return write_markdown(os.path.join(fig_dir, 'exit_table.md'), header, rows)


def plot_pareto(results, fig_dir, title):
    """fig4_pareto.png: perplexity against measured throughput, one panel per exit score and one line per
    condition through its operating points (mean over seeds); the star is the plain depth-K model."""
    import diagnose
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, axes = plt.subplots(1, len(diagnose.SCORES), figsize=(15, 4.8), sharey=True)
    for ax, score in zip(axes, diagnose.SCORES):
        for (name, seeds), (color, ls, marker) in zip(results.items(), STYLES * 2):
            points = [p['point'] for p in seeds[0] if p['score'] == score]
            xy = sorted((seed_mean(seeds, score, p, 'tok_s'), seed_mean(seeds, score, p, 'ppl')) for p in points)
            ax.plot(*zip(*xy), color=color, ls=ls, marker=marker, ms=4, label=name)
            plain = seeds[0][0]['point']
            ax.plot(seed_mean(seeds, 'none', plain, 'tok_s'), seed_mean(seeds, 'none', plain, 'ppl'),
                    marker='*', ms=12, color=color, ls='none')
        ax.set(xlabel='measured throughput (thousand tokens/s)', title=f"score: {score}")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1000:g}"))
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel('validation perplexity (held-out half)')
    axes[-1].legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1))
    fig.suptitle(f"Early exit per sequence: perplexity against measured speed (star: all sequences run K loops)\n{title}",
                 fontsize=10)
    fig.tight_layout()
    path = os.path.join(fig_dir, 'fig4_pareto.png')
    save_figure(fig, path, dpi=130)
    plt.close(fig)
    return path


def slug(name):
    """'per_loop + rmsnorm + penalty' -> 'per_loop-rmsnorm-penalty': a condition's folder name and --conditions value."""
    return name.replace(' + ', '-')


def run_child(cmd):
    """Run one train.py to its end and return (exit code, its output, the signals received meanwhile). Ctrl-C and
    SIGTERM are passed on to the child, which saves a checkpoint and exits; plot_norms waits for that save."""
    received, pending, proc = [], [], None

    def forward(signum, frame):  # the child saves on this signal; plot_norms waits for it instead of dying first
        received.append(signum)
        if proc is None:
            pending.append(signum)
        else:  # a second Ctrl-C is passed on as well: train.py takes it as "abort now"
            proc.send_signal(signum)
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # its own process group: a Ctrl-C in the terminal reaches only plot_norms, which passes it on once (the
        # child would take a second copy of the same keypress as "abort")
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, process_group=0)
        while pending:  # one that landed while the child was being started
            proc.send_signal(pending.pop(0))
        output = proc.stdout.read()  # interrupted reads resume after forward() (PEP 475)
        return proc.wait(), output, received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_grid(config, seeds, out_root, extra, names=None):
    """Train every condition for every seed, one after another; reuse finished runs, resume interrupted ones.
    Seed by seed: whatever is finished when the grid is stopped is a complete set of pairs."""
    folders, t0, trained, train_s = [], time.time(), 0, 0.0
    names = names or GRID_CONDITIONS.get(config, list(CONDITIONS))
    jobs = [(name, CONDITIONS[name], seed) for seed in seeds for name in names]
    for i, (name, flags, seed) in enumerate(jobs):
        folder = os.path.join(out_root, config, slug(name) + f"-seed{seed}")
        folders.append(folder)
        cmd = [sys.executable, os.path.join(HERE, 'train.py'), f'--config={config}', *GRID_FLAGS.get(config, []),
               *flags, f'--seed={seed}', f'--out_dir={folder}', *extra]
        state = 'new'
        # a grid takes a while: rerunning the command must never redo finished work or lose an interrupted run
        if os.path.exists(os.path.join(folder, 'ckpt.pt')):
            try:
                run = load_run(folder)
                done = run['records'][-1]['step'] >= run['config']['max_iters']
            except LogError:
                done = False
            if done:
                print(f"[{i + 1}/{len(jobs)}] {folder}: finished earlier, reused")
                continue
            cmd.append('--resume')
            state = 'resumed'
        elif os.path.exists(os.path.join(folder, 'log.jsonl')):
            cmd.append('--overwrite')  # a log with no checkpoint: the run died before its first save
        # from the runs this command trained (reused ones take no time and would make the ETA 0)
        eta = f", ETA {train_s / trained * (len(jobs) - i) / 60:.0f} min" if trained else ''
        print(f"[{i + 1}/{len(jobs)}] {folder}: training ({state}{eta})", flush=True)
        # one process per run: each starts from a clean torch state, and a crash names its condition
        started = time.time()
        returncode, output, signals = run_child(cmd)
        trained, train_s = trained + 1, train_s + time.time() - started
        if os.path.isdir(folder):  # keep train.py's own output beside its log
            with open(os.path.join(folder, 'train.out'), 'a') as f:
                f.write(output)
        last = output.strip().splitlines()[-1] if output.strip() else 'no output'
        if signals:  # the child has saved (or was aborted by a second Ctrl-C): stop the grid, in one line
            last = last.split('; continue with')[0]  # train.py's own advice (--resume) is the grid's to follow, not the user's
            print(f"plot_norms.py: interrupted during {name} (seed {seed}): {last}; rerun the same command to "
                  "continue the grid", file=sys.stderr)
            sys.exit(128 + signals[0])
        if returncode != 0:
            sys.exit(f"plot_norms.py: error: the run for {name} (seed {seed}) failed: {last}")
    print(f"grid done in {(time.time() - t0) / 60:.1f} min")
    return folders


def get_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda msg: sys.exit(f"plot_norms.py: error: {msg}")
    p.add_argument('runs', nargs='*', help='run folders or quoted globs (default with --run: the grid folders)')
    p.add_argument('--run', action='store_true', help='train the grid of conditions first (reusing finished runs)')
    p.add_argument('--config', default='laptop', choices=list(CONFIGS), help='train.py configuration for --run')
    p.add_argument('--seeds', type=int, default=1, help='seeds per condition for --run (seeds 1..N)')
    p.add_argument('--conditions', default=None,
                   help='--run: comma-separated conditions to train (default: the configuration\'s grid), by folder '
                        'name: ' + ', '.join(map(slug, CONDITIONS)))
    p.add_argument('--out_root', default='out/grid', help='where --run puts its run folders')
    p.add_argument('--fig_dir', default=None, help='where figures and tables go (default: out/figures/<config> with '
                                                   '--run, else out/figures; the committed figures/ change only when '
                                                   'named here)')
    p.add_argument('--exit_windows', type=int, default=200,
                   help='validation windows for the timed early-exit benchmark, half to calibrate and half to '
                        'measure (0: none); needs each run\'s ckpt.pt')
    p.add_argument('--reference', default=None,
                   help=f"the condition every other is paired with, seed by seed, by folder name or condition name "
                        f"(default: {slug(REFERENCE)} when there are such runs)")
    p.add_argument('--train_args', default='', help="extra train.py flags for --run, e.g. '--max_iters=100'")
    return p


def main(argv=None):
    """Check the flags and the destination, train the grid if asked, read every log, then draw and tabulate."""
    p = get_parser()
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds={args.seeds} must be at least 1")
    if not args.run and not args.runs:
        p.error("name run folders to plot, or pass --run to train the grid")
    try:
        train_args = shlex.split(args.train_args)
    except ValueError as e:  # an unclosed quote, say
        p.error(f"--train_args={args.train_args!r}: {e}")
    # untracked by default: the committed reference figures change only when --fig_dir names them
    fig_dir = args.fig_dir or os.path.join('out', 'figures', *([args.config] if args.run else []))
    try:  # before the grid's hours and the benchmark's minutes, not after them
        check_writable(os.path.join(fig_dir, 'table.md'))
    except ValueError as e:
        p.error(f"--fig_dir: {e}")
    names = None
    if args.conditions is not None:
        by_slug = {slug(n): n for n in CONDITIONS}
        unknown = [c for c in args.conditions.split(',') if c not in by_slug]
        if unknown:
            p.error(f"--conditions: unknown {', '.join(unknown)}; choose from {', '.join(by_slug)}")
        names = [by_slug[c] for c in args.conditions.split(',')]

    folders = []
    if args.run:
        folders = run_grid(args.config, range(1, args.seeds + 1), args.out_root, train_args, names)
    for pattern in args.runs:  # quoted globs are expanded here, so they work the same on every shell
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            p.error(f"{pattern}: matches no folder")
        folders += [m for m in matches if m not in folders]
    try:  # read every log before drawing anything: one bad folder is one line, not a half-written figure set
        runs = [load_run(folder) for folder in folders]
    except LogError as e:
        sys.exit(f"plot_norms.py: error: {e}")
    groups = group_runs(runs)
    reference = REFERENCE
    if args.reference is not None:
        known = {run['name'] for run in runs}
        reference = next((n for n in known if args.reference in (n, slug(n))), None)
        if reference is None:
            p.error(f"--reference={args.reference}: no such condition among the runs; they hold "
                    + ', '.join(sorted(map(slug, known))))
    paired = pair_up(groups, reference)  # from every run: pair_up picks its own step per condition
    groups, behind = caught_up(groups)
    if behind:
        print("left out of the figures and the first table, behind the other seeds of their condition: "
              + '; '.join(behind))
    exits = None
    if args.exit_windows > 0:  # before any figure is written: a bad checkpoint stops everything, in one line
        if all(os.path.exists(os.path.join(run['folder'], 'ckpt.pt')) for run in runs):
            print(f"early-exit benchmark on {len(runs)} checkpoints (timed: keep the machine otherwise idle)", flush=True)
            try:
                exits = exit_results(groups, args.exit_windows)
            except (ValueError, OSError) as e:  # an unreadable checkpoint or dataset: say which, in one line
                sys.exit(f"plot_norms.py: error: no early-exit benchmark: {e}")
        else:
            print("no early-exit benchmark: some runs have no ckpt.pt")
    for path in plot(groups, fig_dir, paired, reference):
        print(f"wrote {path}")
    print(table(groups, fig_dir, paired, reference, behind))
    print(f"wrote {os.path.join(fig_dir, 'table.md')}, table.csv" + (' and paired.csv' if paired else ''))
    if exits is not None:
        print(exit_table(exits, fig_dir))
        print(f"wrote {os.path.join(fig_dir, 'exit_table.md')} and {plot_pareto(exits, fig_dir, describe(runs))}")


if __name__ == '__main__':
    try:
        main()
    except KeyboardInterrupt:  # outside a training run (reading logs, drawing): nothing to save, and no traceback
        print("plot_norms.py: interrupted", file=sys.stderr)
        sys.exit(130)
