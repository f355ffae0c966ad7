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
condition's gap to per_loop + rmsnorm: claim 4), table.md / table.csv, and from each run's checkpoint the
timed per-sequence early-exit benchmark (diagnose.exit_benchmark): exit_table.md and fig4_pareto.png
(perplexity against measured tokens/s; time it on an otherwise idle machine).
"""

import argparse
import csv
import glob
import json
import os
import shlex
import subprocess
import sys
import time

import numpy as np

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
GRID_CONDITIONS = {'laptop_long': CLAIM4}  # configurations not named here train every condition
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
            lines = [json.loads(line) for line in f if line.strip()]
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
    return {'folder': folder, 'name': condition_name(cfg), 'config': head['config'], 'records': records}


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


def series(runs, key, index=None):
    """steps and a (seeds, evals) array of r[key] (or r[key][index]), over the evaluations all seeds have."""
    n = min(len(run['records']) for run in runs)  # a seed still training must not cut the others' curves short
    steps = [r['step'] for r in runs[0]['records'][:n]]
    pick = (lambda r: r[key]) if index is None else (lambda r: r[key][index])
    return steps, np.array([[pick(r) for r in run['records'][:n]] for run in runs])


def mean_std(values):
    # std over seeds (population, ddof 0): with 3 seeds it describes the spread seen, it is no confidence interval
    values = np.asarray(values, dtype=float)
    return values.mean(axis=0), values.std(axis=0)


def describe(runs):
    """'0.55M-parameter looped LM (2 layers x K=4, d=128) on shakespeare_char' for figure titles."""
    c = runs[0]['config']
    m = c['model']
    n = c.get('num_params')
    size = f"{n / 1e6:.2f}M-parameter " if n else ''
    return f"{size}looped LM ({m['n_layer']} layers x K={m['n_loop']}, d={m['n_embd']}) on {os.path.basename(c['dataset'])}"


def finish(fig, ax, path):
    """Grid, legend outside the axes (the lines need the room), PNG plus an SVG copy for papers and slides."""
    import matplotlib.pyplot as plt
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    fig.savefig(path[:-4] + '.svg')
    plt.close(fig)
    return path


def final_curves(ax, groups, key, depths):
    """One line per condition through the last evaluation's r[key] at the given depths (1-indexed); seeds give
    error bars."""
    for (name, runs), (color, ls, marker) in zip(groups.items(), STYLES * 2):
        mean, std = mean_std([[run['records'][-1][key][d - 1] for d in depths] for run in runs])
        ax.errorbar(depths, mean, yerr=std if len(runs) > 1 else None, color=color, ls=ls, marker=marker, ms=5, label=name)


def plot(groups, fig_dir):
    """The three figures; returns their paths."""
    import matplotlib
    matplotlib.use('Agg')  # files only; no display needed
    import matplotlib.pyplot as plt

    os.makedirs(fig_dir, exist_ok=True)
    first = next(iter(groups.values()))
    seeds = sorted({len(runs) for runs in groups.values()})
    title = describe(first) + f", {'/'.join(map(str, seeds))} seed{'s' * (seeds != [1])} per condition"
    title += '\n(mean over seeds; band: +- 1 std)' if seeds != [1] else ''
    K = first[0]['config']['model']['n_loop']
    paths = []

    fig, ax = plt.subplots(figsize=(10, 5))
    for (name, runs), (color, ls, marker) in zip(groups.items(), STYLES * 2):
        steps, h = series(runs, 'hidden_norm', K - 1)
        mean, std = mean_std(h)
        ax.plot(steps, mean, color=color, ls=ls, marker=marker, ms=4, label=name)
        if len(runs) > 1:
            ax.fill_between(steps, np.maximum(mean - std, 1e-3), mean + std, color=color, alpha=0.15)
    ax.set(yscale='log', xlabel='training step', ylabel=r'final-loop norm $\|h_K\|$ (mean over tokens)',
           title=f"Norm explosion\n{title}")
    paths.append(finish(fig, ax, os.path.join(fig_dir, 'fig1_norm_explosion.png')))

    fig, ax = plt.subplots(figsize=(10, 5))
    final_curves(ax, groups, 'hidden_norm', list(range(1, 2 * K + 1)))
    ax.axvline(K, color='grey', lw=0.8)
    ax.text(K, 0.02, ' trained K', color='grey', va='bottom', fontsize=8, transform=ax.get_xaxis_transform())
    ax.set(yscale='log', xlabel='loop k (beyond K: extrapolation)', ylabel=r'$\|h_k\|$ at the end of training',
           title=f"Norm by loop at the end of training\n{title}")
    paths.append(finish(fig, ax, os.path.join(fig_dir, 'fig2_norm_by_loop.png')))

    fig, ax = plt.subplots(figsize=(10, 5))
    depths = list(range(1, K + 1)) + [2 * K]
    final_curves(ax, groups, 'val_loss', depths)
    # untrained exits (terminal supervision, early loops) can sit at tens of nats: keep the frame on the rest
    at_K = [np.mean([run['records'][-1]['val_loss'][K - 1] for run in runs]) for runs in groups.values()]
    low = min(min(run['records'][-1]['val_loss'][d - 1] for d in depths) for runs in groups.values() for run in runs)
    ax.set_ylim(low - 0.05, max(at_K) + 0.5 * (max(at_K) - low) + 0.1)
    ax.set(xlabel='exit depth (loops run before reading out)', ylabel='validation loss (nats per token)',
           xticks=depths, title=f"Validation loss by exit depth (points above the frame are off the scale)\n{title}")
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

    # claim 4: does a scale-controlled variant overtake the scale-invariant readout as training goes on?
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    base = groups.get('per_loop + rmsnorm')
    for (name, runs), (color, ls, marker) in zip(groups.items(), STYLES * 2):
        steps, loss = series(runs, 'val_loss', K - 1)
        mean, std = mean_std(loss)
        left.plot(steps, mean, color=color, ls=ls, marker=marker, ms=3, label=name)
        if len(runs) > 1:
            left.fill_between(steps, mean - std, mean + std, color=color, alpha=0.15)
        if base is not None and runs is not base:  # the gap, seed by seed (seed i against the baseline's seed i)
            b_steps, b_loss = series(base, 'val_loss', K - 1)
            n = min(len(steps), len(b_steps)) if steps[:len(b_steps)] == b_steps[:len(steps)] else 0
            m = min(len(loss), len(b_loss))
            if n:
                gap = loss[:m, :n] - b_loss[:m, :n]
                g_mean, g_std = mean_std(gap)
                right.plot(steps[:n], g_mean, color=color, ls=ls, marker=marker, ms=3, label=name)
                if m > 1:
                    right.fill_between(steps[:n], g_mean - g_std, g_mean + g_std, color=color, alpha=0.15)
    finals = [series(runs, 'val_loss', K - 1)[1][:, -1].mean() for runs in groups.values()]
    left.set_ylim(min(finals) - 0.15, max(finals) + 0.6)  # the first evaluations sit far above: keep the end in view
    left.set(xlabel='training step', ylabel=f'validation loss at depth K={K}', title='validation loss at the trained depth')
    if base is not None:
        right.axhline(0, color=STYLES[list(groups).index('per_loop + rmsnorm') % len(STYLES)][0], lw=1.2,
                      label='per_loop + rmsnorm (the zero line)')
    right.set_ylim(-0.3, 0.5)
    right.set(xlabel='training step', ylabel='loss minus per_loop + rmsnorm (below 0: better)',
              title='gap to the scale-invariant readout (per seed, then mean)')
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    if right.lines:
        right.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1))
    else:
        right.text(0.5, 0.5, 'no per_loop + rmsnorm run to compare with', ha='center', transform=right.transAxes)
    fig.suptitle(f"Claim 4: does scale control win at matched depth with longer training?\n{title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(fig_dir, 'fig6_crossover.png'), dpi=130)
    plt.close(fig)
    paths.append(os.path.join(fig_dir, 'fig6_crossover.png'))
    return paths


def table(groups, fig_dir):
    """Per condition: final-depth perplexity and ||h_K|| (mean +- std over seeds), perplexity at depths 1..K
    and 2K, and the alpha readout's final alpha where there is one."""
    K = next(iter(groups.values()))[0]['config']['model']['n_loop']
    depths = list(range(1, K + 1)) + [2 * K]
    header = ['condition', 'seeds', 'step', 'val ppl (depth K)', '‖h_K‖'] + [f"ppl@{d}" for d in depths] + ['alpha']
    pm = lambda v, f: f"{v.mean():{f}}" + (f" +- {v.std():{f}}" if len(v) > 1 else '')
    rows = []
    for name, runs in groups.items():
        last = [run['records'][-1] for run in runs]
        ppl = np.exp(np.array([[r['val_loss'][d - 1] for d in depths] for r in last]))  # (seeds, K + 1)
        h = np.array([r['hidden_norm'][K - 1] for r in last])
        alpha = pm(np.array([r['alpha'] for r in last]), '.3f') if 'alpha' in last[0] else ''
        rows.append([name, str(len(runs)), str(min(r['step'] for r in last)), pm(ppl[:, K - 1], '.3f'), pm(h, '.1f')]
                    + [pm(ppl[:, i], '.2f') for i in range(K + 1)] + [alpha])
    with open(os.path.join(fig_dir, 'table.csv'), 'w', newline='') as f:
        csv.writer(f).writerows([header] + rows)
    return write_markdown(os.path.join(fig_dir, 'table.md'), header, rows)


def write_markdown(path, header, rows):
    """A markdown table to path; returns its text."""
    md = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)] + ['| ' + ' | '.join(r) + ' |' for r in rows]
    with open(path, 'w') as f:
        f.write('\n'.join(md) + '\n')
    return '\n'.join(md)


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
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def run_grid(config, seeds, out_root, extra):
    """Train every condition for every seed, one after another; reuse finished runs, resume interrupted ones."""
    folders, t0 = [], time.time()
    names = GRID_CONDITIONS.get(config, list(CONDITIONS))
    jobs = [(name, CONDITIONS[name], seed) for seed in seeds for name in names]
    for i, (name, flags, seed) in enumerate(jobs):
        folder = os.path.join(out_root, config, name.replace(' + ', '-') + f"-seed{seed}")
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
        eta = '' if i == 0 else f", ETA {(time.time() - t0) / i * (len(jobs) - i) / 60:.0f} min"
        print(f"[{i + 1}/{len(jobs)}] {folder}: training ({state}{eta})", flush=True)
        # one process per run: each starts from a clean torch state, and a crash names its condition
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if os.path.isdir(folder):  # keep train.py's own output beside its log
            with open(os.path.join(folder, 'train.out'), 'a') as f:
                f.write(result.stdout)
        if result.returncode != 0:
            last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else 'no output'
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
    p.add_argument('--out_root', default='out/grid', help='where --run puts its run folders')
    p.add_argument('--fig_dir', default=None, help='where figures and tables go (default: figures/<config> with '
                                                   '--run, else figures)')
    p.add_argument('--exit_windows', type=int, default=200,
                   help='validation windows for the timed early-exit benchmark, half to calibrate and half to '
                        'measure (0: none); needs each run\'s ckpt.pt')
    p.add_argument('--train_args', default='', help="extra train.py flags for --run, e.g. '--max_iters=100'")
    return p


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds={args.seeds} must be at least 1")
    if not args.run and not args.runs:
        p.error("name run folders to plot, or pass --run to train the grid")

    folders = []
    if args.run:
        folders = run_grid(args.config, range(1, args.seeds + 1), args.out_root, shlex.split(args.train_args))
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
    fig_dir = args.fig_dir or (os.path.join('figures', args.config) if args.run else 'figures')
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
    for path in plot(groups, fig_dir):
        print(f"wrote {path}")
    print(table(groups, fig_dir))
    print(f"wrote {os.path.join(fig_dir, 'table.md')} and table.csv")
    if exits is not None:
        print(exit_table(exits, fig_dir))
        print(f"wrote {os.path.join(fig_dir, 'exit_table.md')} and {plot_pareto(exits, fig_dir, describe(next(iter(groups.values()))))}")


if __name__ == '__main__':
    main()
