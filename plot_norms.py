"""
The paper's figures from training logs (each run folder's log.jsonl, written by train.py); with
--run, it first trains the paper's conditions, one train.py per condition and seed.

    python plot_norms.py out/laptop out/laptop-readout_raw 'out/grid/laptop/*'   # runs you have
    python plot_norms.py out/laptop --fig_dir=figures/mine  # default: out/figures (untracked)
    python plot_norms.py --run                              # train the grid (laptop, 1 seed), draw
    python plot_norms.py --run --config=gpu_char --seeds=3  # on a GPU; rerun to go on after Ctrl-C

Writes to --fig_dir, each a PNG and an SVG: fig1_norm_explosion (||h_K|| against step),
fig2_norm_by_loop (||h_k|| against loop k, to 2K), fig3_loss_by_depth (loss at exit depths 1..K and
2K), fig5_alpha (the alpha readout's exponent). Seeds of a condition are averaged (band: +- 1 sample
SD), each run read at its own K. python -m lab.paper adds the paired tables over seeds, the
crossover figure and the timed early-exit benchmark.
"""

import argparse
import json
import os
import shlex
import sys

import matplotlib
import numpy as np

from data.common import check_writable, write_atomically
from plumbing.logs import LogError, read_log, run_folders, train_runs

matplotlib.use('Agg')  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)

PROG = 'plot_norms.py'
TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py')  # run by --run
# The paper's grid plus the two variants its abstract names: {condition: train.py flags}.
SUP, RMS, PEN = '--supervision=', '--readout=rmsnorm', '--norm_penalty=0.01'
CONDITIONS = {
    'terminal + rmsnorm': [SUP + 'terminal', RMS],
    'terminal + raw': [SUP + 'terminal', '--readout=raw'],
    'per_loop + rmsnorm': [SUP + 'per_loop', RMS],
    'per_loop + raw': [SUP + 'per_loop', '--readout=raw'],
    'per_loop + final_norm': [SUP + 'per_loop', '--readout=final_norm'],
    'terminal + rmsnorm + penalty': [SUP + 'terminal', RMS, PEN],
    'per_loop + rmsnorm + penalty': [SUP + 'per_loop', RMS, PEN],
    'per_loop + layernorm': [SUP + 'per_loop', '--readout=layernorm'],
    'per_loop + rmsnorm + normed': [SUP + 'per_loop', RMS, '--recurrence=normed'],
    'per_loop + alpha': [SUP + 'per_loop', '--readout=alpha'],
}
# grid runs are shorter than single runs: on 'laptop' all ten take about 15 minutes on 2 CPU cores
GRID_FLAGS = {'laptop': ['--max_iters=200', '--eval_interval=40', '--eval_iters=4'],
              'gpu_char': ['--max_iters=1000', '--eval_interval=100']}
# Okabe-Ito colours (colour-blind safe; yellow swapped for wine), with line styles and markers
COLORS = ['#000000', '#E69F00', '#56B4E9', '#009E73', '#882255', '#0072B2', '#D55E00', '#CC79A7',
          '#999999', '#44AA99']
STYLES = [(c, ['-', '--', '-.', ':'][i % 4], 'os^DvPX*hp'[i]) for i, c in enumerate(COLORS)]


def condition_name(model):
    """'per_loop + rmsnorm + penalty': a run's condition from looped.py's fields in its config."""
    name = f"{model['supervision']} + {model['readout']}"
    if model.get('alpha') is not None:  # a fixed alpha (unset: learned)
        name += f" {model['alpha']:g}"
    if model.get('norm_penalty'):  # the paper's 0.01 is '+ penalty' alone, as the grid has it
        penalty = model['norm_penalty']
        name += ' + penalty' + ('' if penalty == 0.01 else f" {penalty:g}")
    if model.get('recurrence', 'residual') != 'residual':
        name += f" + {model['recurrence']}"
    return name


def group_runs(runs, order=CONDITIONS):
    """{condition: its runs}, in `order`: runs whose flags differ only in seed, folder, length or
    tie_weights (the model's value counts) are one condition's seeds ([folder] marks a clash)."""
    skip = ('seed', 'out_dir', 'resume', 'overwrite', 'max_iters', 'tie_weights')
    by_setting = {}
    for run in runs:
        setting = {k: v for k, v in run['config'].items() if k not in skip}
        by_setting.setdefault(json.dumps(setting, sort_keys=True), []).append(run)
    groups = {}
    for members in by_setting.values():
        name = members[0]['name']
        if name in groups:
            name += f" [{os.path.basename(os.path.normpath(members[0]['folder']))}]"
        groups[name] = members
    known = [name for name in order if name in groups]
    return {name: groups[name] for name in known + sorted(set(groups) - set(known))}


def caught_up(groups):
    """Each condition's runs at its furthest evaluation, and the runs behind (not averaged in)."""
    kept, behind = {}, []
    for name, runs in groups.items():
        last = max(run['records'][-1]['step'] for run in runs)
        kept[name] = [run for run in runs if run['records'][-1]['step'] == last]
        behind += [run for run in runs if run['records'][-1]['step'] < last]
    return kept, behind


def series(runs, key, index=None):
    """steps and a (seeds, evals) array of r[key] or r[key][index], to the last step all share."""
    n = min(len(run['records']) for run in runs)
    steps = [r['step'] for r in runs[0]['records'][:n]]
    pick = (lambda r: r[key]) if index is None else (lambda r: r[key][index])
    return steps, np.array([[pick(r) for r in run['records'][:n]] for run in runs])


def exit_depths(K):
    """The depths every figure and table reports: 1..K and 2K (beyond the trained depth)."""
    return list(range(1, K + 1)) + [2 * K]


def styles(n):
    """n (colour, line, marker) styles: STYLES, repeated past its ten."""
    return [STYLES[i % len(STYLES)] for i in range(n)]


def describe(runs):
    """'0.55M-parameter looped LM (2 layers x K=4, d=128) on shakespeare_char' (K=2/3 if mixed)."""
    c, m = runs[0]['config'], runs[0]['config']['model']
    size = f"{c['num_params'] / 1e6:.2f}M-parameter " if c.get('num_params') else ''
    Ks = '/'.join(map(str, sorted({run['K'] for run in runs})))
    return (f"{size}looped LM ({m['n_layer']} layers x K={Ks}, d={m['n_embd']}) on "
            + os.path.basename(c['dataset']))


def title(groups):
    """describe(), the seeds per condition and, with more than one, what lines and bands are."""
    seeds = sorted({len(runs) for runs in groups.values()})
    text = describe([run for runs in groups.values() for run in runs])
    text += f", {'/'.join(map(str, seeds))} seed{'s' * (seeds != [1])} per condition"
    return text + ('\n(mean over seeds; band: +- 1 sample SD)' if seeds != [1] else '')


def save_figure(fig, path, ax):
    """A PNG and an SVG, each written atomically, with no date and fixed SVG ids (same bytes)."""
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1))  # outside: lines need room
    fig.tight_layout()
    write_atomically(path, lambda f: fig.savefig(f, format='png', dpi=130))
    with plt.rc_context({'svg.hashsalt': 'looped'}):
        write_atomically(os.path.splitext(path)[0] + '.svg',
                         lambda f: fig.savefig(f, format='svg', metadata={'Date': None}))
    plt.close(fig)
    return path


def line_with_band(ax, steps, values, style, name, ms=4, floor=None):
    """The mean of values (seeds, evals) against step, a +- 1 SD band above floor (log scales)."""
    color, ls, marker = style
    mean = values.mean(0)
    ax.plot(steps, mean, color=color, ls=ls, marker=marker, ms=ms, label=name)
    if len(values) > 1:
        std = values.std(0, ddof=1)
        low = mean - std if floor is None else np.maximum(mean - std, floor)
        ax.fill_between(steps, low, mean + std, color=color, alpha=0.15)


def final_curves(ax, groups, key, depths_of):
    """A line per condition through the last evaluation's r[key] at depths depths_of(its K)."""
    for (name, runs), (color, ls, marker) in zip(groups.items(), styles(len(groups))):
        depths = depths_of(runs[0]['K'])
        values = np.array([[run['records'][-1][key][d - 1] for d in depths] for run in runs])
        yerr = values.std(0, ddof=1) if len(runs) > 1 else None
        ax.errorbar(depths, values.mean(0), yerr=yerr, color=color, ls=ls, marker=marker, ms=5,
                    label=name)


def plot(groups, fig_dir):
    """Figures 1, 2, 3 and (with an alpha readout) 5 in fig_dir, each run read at its own K."""
    head, path = title(groups), lambda name: os.path.join(fig_dir, name)
    # fig1: the final-loop norm ||h_K|| against training step (the paper's figure 1)
    fig, ax = plt.subplots(figsize=(10, 5))
    for (name, runs), style in zip(groups.items(), styles(len(groups))):
        line_with_band(ax, *series(runs, 'hidden_norm', runs[0]['K'] - 1), style, name, floor=1e-3)
    ax.set(yscale='log', xlabel='training step', title=f"Norm explosion\n{head}",
           ylabel=r'final-loop norm $\|h_K\|$ (mean over tokens)')
    paths = [save_figure(fig, path('fig1_norm_explosion.png'), ax)]
    # fig2: ||h_k|| against loop k = 1..2K after training, a grey line at each trained K
    fig, ax = plt.subplots(figsize=(10, 5))
    final_curves(ax, groups, 'hidden_norm', lambda K: list(range(1, 2 * K + 1)))
    Ks = sorted({runs[0]['K'] for runs in groups.values()})
    for K in Ks:
        ax.axvline(K, color='grey', lw=0.8)
        ax.text(K, 0.02, f" trained K={K}" if len(Ks) > 1 else ' trained K', color='grey',
                va='bottom', fontsize=8, transform=ax.get_xaxis_transform())
    ax.set(yscale='log', xlabel='loop k (beyond K: extrapolation)',
           ylabel=r'$\|h_k\|$ at the end of training',
           title=f"Norm by loop at the end of training\n{head}")
    paths.append(save_figure(fig, path('fig2_norm_by_loop.png'), ax))
    # fig3: loss against exit depth 1..K and 2K; untrained exits (tens of nats) are off the frame
    fig, ax = plt.subplots(figsize=(10, 5))
    final_curves(ax, groups, 'val_loss', exit_depths)
    at_K = [np.mean([run['records'][-1]['val_loss'][run['K'] - 1] for run in runs])
            for runs in groups.values()]
    low = min(min(run['records'][-1]['val_loss'][d - 1] for d in exit_depths(run['K']))
              for runs in groups.values() for run in runs)
    ax.set_ylim(low - 0.05, max(at_K) + 0.5 * (max(at_K) - low) + 0.1)
    ax.set(xlabel='exit depth (loops run before reading out)',
           ylabel='validation loss (nats per token)',
           xticks=sorted({d for runs in groups.values() for d in exit_depths(runs[0]['K'])}),
           title="Validation loss by exit depth (points above the frame are off the scale)\n"
                 + head)
    paths.append(save_figure(fig, path('fig3_loss_by_depth.png'), ax))
    # fig5: the alpha readout's learned exponent: which alpha does cross-entropy choose?
    with_alpha = {n: runs for n, runs in groups.items() if 'alpha' in runs[0]['records'][-1]}
    if with_alpha:
        fig, ax = plt.subplots(figsize=(10, 5))
        for (name, runs), style in zip(with_alpha.items(), styles(len(with_alpha))):
            line_with_band(ax, *series(runs, 'alpha'), style, name)
        ax.set(ylim=(0, 1), xlabel='training step',
               ylabel=r'$\alpha$ (0: scale-invariant, 1: raw)',
               title=f"The alpha readout's learned exponent\n{head}")
        paths.append(save_figure(fig, path('fig5_alpha.png'), ax))
    return paths


def grid_jobs(config, conditions, seeds, out_root, extra):
    """(label, folder, train.py command) of each run, seed by seed: a stopped grid holds pairs."""
    jobs = []
    for seed in seeds:
        for name, flags in conditions.items():
            folder = os.path.join(out_root, config, name.replace(' + ', '-') + f"-seed{seed}")
            cmd = [sys.executable, TRAIN, f'--config={config}', *GRID_FLAGS.get(config, []),
                   *flags, f'--seed={seed}', f'--out_dir={folder}', *extra]
            jobs.append((f"{name} (seed {seed})", folder, cmd))
    return jobs


class Parser(argparse.ArgumentParser):
    """argparse with its errors in one line ('plot_norms.py: error: ...'), not the usage block."""
    def error(self, message):
        sys.exit(f"{self.prog}: error: {message}")


def get_parser():
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('runs', nargs='*', help='run folders or quoted globs (with --run: the grid too)')
    p.add_argument('--run', action='store_true', help='train the grid first (reuses finished runs)')
    p.add_argument('--config', default='laptop', help='train.py configuration of the runs')
    p.add_argument('--out_root', default=os.path.join('out', 'grid'), help='where the runs go')
    p.add_argument('--train_args', default='', help="extra train.py flags, e.g. '--max_iters=100'")
    p.add_argument('--seeds', type=int, default=1, help='--run: seeds 1..N of each condition')
    p.add_argument('--conditions', default=None, help='--run: only these of the ten, by folder '
                   'name, comma-separated (per_loop-rmsnorm,per_loop-raw)')
    p.add_argument('--fig_dir', default=None, help='where the figures go (default: out/figures, '
                   'with --run out/figures/<config>)')
    return p


def check_flags(p, args):
    """Every flag error, before any training: (the runs to train, fig_dir)."""
    if args.seeds < 1:
        p.error(f"--seeds={args.seeds} must be at least 1")
    if not args.run and not args.runs:
        p.error("name run folders to plot, or pass --run to train the grid")
    try:
        extra = shlex.split(args.train_args)
    except ValueError as e:
        p.error(f"--train_args={args.train_args!r}: {e}")
    fig_dir = args.fig_dir or os.path.join('out', 'figures', *([args.config] if args.run else []))
    try:  # a destination that cannot be written stops us before hours of training, not after
        check_writable(os.path.join(fig_dir, 'fig1_norm_explosion.png'))
    except ValueError as e:
        p.error(f"--fig_dir: {e}")
    by_slug = {name.replace(' + ', '-'): name for name in CONDITIONS}
    chosen = by_slug if args.conditions is None else args.conditions.split(',')
    unknown = [c for c in chosen if c not in by_slug]
    if unknown:
        p.error(f"--conditions: {', '.join(unknown)} not in the grid; "
                f"choose from {', '.join(by_slug)}")
    conditions = {by_slug[c]: CONDITIONS[by_slug[c]] for c in chosen}
    jobs = grid_jobs(args.config, conditions, range(1, args.seeds + 1), args.out_root, extra)
    return jobs if args.run else [], fig_dir


def main(argv=None):
    """Check the flags, train the grid if asked, read every log, then draw."""
    p = get_parser()
    args = p.parse_args(argv)
    jobs, fig_dir = check_flags(p, args)
    folders = train_runs(jobs, PROG) if args.run else []  # the grid first, one folder per run
    try:  # every log before any figure: one bad folder stops the command in one line
        logs = [(folder, *read_log(folder)) for folder in run_folders(args.runs, folders)]
    except LogError as e:
        sys.exit(f"{PROG}: error: {e}")
    runs = [{'folder': folder, 'name': condition_name(config['model']), 'config': config,
             'records': records, 'K': K} for folder, config, records, K in logs]
    groups, behind = caught_up(group_runs(runs))
    if behind:
        print("left out, behind the other seeds of their condition: " + '; '.join(
            f"{run['folder']} at step {run['records'][-1]['step']}" for run in behind))
    for path in plot(groups, fig_dir):
        print(f"wrote {path}")


if __name__ == '__main__':
    try:
        main()
    except KeyboardInterrupt:  # outside a training run (reading, drawing): nothing to save
        sys.exit(f"{PROG}: interrupted")
