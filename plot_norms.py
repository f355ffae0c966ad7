"""
The paper's figures from training logs (each run folder's log.jsonl, written by train.py); with
--run, it first trains the paper's conditions, one train.py per condition and seed.

    python plot_norms.py out/laptop out/laptop-readout_raw 'out/grid/laptop/*'   # runs you have
    python plot_norms.py out/laptop --fig_dir=figures/mine  # default: out/figures (untracked)
    python plot_norms.py --run                              # train the grid (laptop, 1 seed), draw
    python plot_norms.py --run --config=gpu_char --seeds=3  # on a GPU; rerun to go on after Ctrl-C

Writes to --fig_dir, each a PNG and an SVG: fig1_norm_explosion (||h_K|| against step),
fig2_norm_by_loop (||h_k|| against loop k, to 2K), fig3_loss_by_depth (loss at exit depths 1..K
and 2K), fig5_alpha (the alpha readout's exponent). Seeds of a condition are averaged (band: +- 1
sample SD); every run is read at its own K. python -m lab.paper adds the paired tables over seeds,
the crossover figure and the timed early-exit benchmark.
"""

import argparse
import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import matplotlib
import numpy as np

from data.common import check_writable, write_atomically

matplotlib.use('Agg')  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)

PROG = 'plot_norms.py'
ROOT = os.path.dirname(os.path.abspath(__file__))  # where train.py is
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
# Claim 4 (scale control wins at matched depth once training is long) compares per-loop runs.
CLAIM4 = ['per_loop + rmsnorm', 'per_loop + raw', 'per_loop + rmsnorm + penalty',
          'per_loop + final_norm', 'per_loop + rmsnorm + normed', 'per_loop + alpha']
GRIDS = {'paper': CONDITIONS, 'claim4': {n: CONDITIONS[n] for n in CLAIM4},
         'readouts': {n: CONDITIONS[n] for n in ('per_loop + rmsnorm', 'per_loop + raw')}}
# a configuration's grid unless --grid names one (laptop_deep: do the two readouts swap places in
# a deeper stack?); any other configuration: the paper's ten
DEFAULT_GRID = {'laptop_long': 'claim4', 'laptop_deep': 'readouts'}
# grid runs are shorter than single runs: on 'laptop' all ten take about 15 minutes on 2 CPU cores
GRID_FLAGS = {'laptop': ['--max_iters=200', '--eval_interval=40', '--eval_iters=4'],
              'gpu_char': ['--max_iters=1000', '--eval_interval=100']}
# Okabe-Ito colours (colour-blind safe; its yellow swapped for a darker wine, which reads on white)
# with line styles and markers, so the figures also read in grey.
STYLES = [('#000000', '-', 'o'), ('#E69F00', '--', 's'), ('#56B4E9', '-.', '^'),
          ('#009E73', ':', 'D'), ('#882255', '-', 'v'), ('#0072B2', '--', 'P'),
          ('#D55E00', '-.', 'X'), ('#CC79A7', ':', '*'), ('#999999', '-', 'h'),
          ('#44AA99', '--', 'p')]


class LogError(ValueError):
    """A run folder that cannot be read; the message names the folder."""


def read_log(folder):
    """(header config, evaluation records, K) of folder/log.jsonl, else LogError in one line: a bad
    folder stops the command before anything is drawn."""
    path = os.path.join(folder, 'log.jsonl')
    if not os.path.isfile(path):
        raise LogError(f"{folder}: no log.jsonl (not a train.py run folder?)")
    try:
        with open(path) as f:
            text = f.read()
        # a run still training may be halfway through a line: read up to its last whole one
        lines = [json.loads(s) for s in text[:text.rfind('\n') + 1].splitlines() if s.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LogError(f"{folder}: log.jsonl is not valid JSON lines ({e})") from None
    if not lines:
        raise LogError(f"{folder}: log.jsonl is empty")
    config, records = lines[0].get('config', {}), lines[1:]
    K = config.get('model', {}).get('n_loop')
    need = {'step', 'train_loss', 'val_loss', 'hidden_norm', 'elapsed_s'}
    if K is None or not all(need <= set(r) and len(r['val_loss']) == len(r['hidden_norm']) == 2 * K
                            for r in records):  # every record holds depths 1..2K
        raise LogError(f"{folder}: log.jsonl is in an older or unknown format; "
                       "rerun it with this train.py")
    if not records:
        raise LogError(f"{folder}: log.jsonl has no evaluation yet")
    return config, records, K


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


def run_folders(patterns, folders=()):
    """folders, then the folders the patterns name (quoted globs are expanded here, the same on
    every shell), each once; LogError for a pattern that matches nothing."""
    folders = list(folders)
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise LogError(f"{pattern}: matches no folder")
        folders += [m for m in matches if m not in folders]
    return folders


def read_runs(patterns, folders=()):
    """Every run of run_folders, each once: [{'folder', 'name', 'config', 'records', 'K'}]."""
    folders = run_folders(patterns, folders)
    logs = [(folder, *read_log(folder)) for folder in folders]  # every log, before any figure
    return [{'folder': folder, 'name': condition_name(config['model']), 'config': config,
             'records': records, 'K': K} for folder, config, records, K in logs]


def group_runs(runs, order=CONDITIONS):
    """{condition: its runs}, in the order of `order`, then by name: runs whose configs differ only
    in seed, folder or length are seeds of one condition. A name two settings share (a width, a
    rate, a field looped.py does not have) gets the second one's folder in brackets."""
    skip = ('seed', 'out_dir', 'resume', 'overwrite', 'max_iters')
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
    """Each condition's runs that reached its furthest evaluation, and the runs behind (still
    training, or stopped early): a mean over seeds at different steps mixes training lengths."""
    kept, behind = {}, []
    for name, runs in groups.items():
        last = max(run['records'][-1]['step'] for run in runs)
        kept[name] = [run for run in runs if run['records'][-1]['step'] == last]
        behind += [run for run in runs if run['records'][-1]['step'] < last]
    return kept, behind


def series(runs, key, index=None):
    """steps and a (seeds, evals) array of r[key] (or r[key][index]), over the evaluations all seeds
    have: a seed with fewer must not make the array ragged."""
    n = min(len(run['records']) for run in runs)
    steps = [r['step'] for r in runs[0]['records'][:n]]
    pick = (lambda r: r[key]) if index is None else (lambda r: r[key][index])
    return steps, np.array([[pick(r) for r in run['records'][:n]] for run in runs])


def mean_std(values):
    """Mean and sample SD (ddof 1; 0 for one seed) over seeds: the lines and their bands."""
    values = np.asarray(values, dtype=float)
    return values.mean(0), values.std(0, ddof=1) if len(values) > 1 else np.zeros_like(values[0])


def exit_depths(K):
    """The depths every figure and table reports: 1..K and 2K (beyond the trained depth)."""
    return list(range(1, K + 1)) + [2 * K]


def styles(n):
    """n (colour, line, marker) styles: STYLES, repeated past its ten (a grid can hold more)."""
    return [STYLES[i % len(STYLES)] for i in range(n)]


def describe(runs):
    """'0.55M-parameter looped LM (2 layers x K=4, d=128) on shakespeare_char' (K=2/3 when the
    runs differ in depth): what every figure shows, for its title."""
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


def save_figure(fig, path, ax=None):
    """A PNG and an SVG copy, each through a temporary file renamed over its destination (a planted
    link is replaced, never followed); no date and fixed SVG ids, so the same logs give the same
    bytes. ax: a grid and a legend outside the axes first (the lines need the room)."""
    if ax is not None:
        ax.grid(True, which='both', alpha=0.3)
        ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    write_atomically(path, lambda f: fig.savefig(f, format='png', dpi=130))
    with plt.rc_context({'svg.hashsalt': 'looped'}):
        write_atomically(os.path.splitext(path)[0] + '.svg',
                         lambda f: fig.savefig(f, format='svg', metadata={'Date': None}))
    plt.close(fig)
    return path


def line_with_band(ax, steps, values, style, name, ms=4, floor=None):
    """The mean over seeds (values: (seeds, evals)) against step, with a +- 1 SD band for more than
    one seed; floor keeps the band above 0 on a log scale."""
    color, ls, marker = style
    mean, std = mean_std(values)
    ax.plot(steps, mean, color=color, ls=ls, marker=marker, ms=ms, label=name)
    if len(values) > 1:
        low = mean - std if floor is None else np.maximum(mean - std, floor)
        ax.fill_between(steps, low, mean + std, color=color, alpha=0.15)


def final_curves(ax, groups, key, depths_of):
    """A line per condition through the last evaluation's r[key] at depths depths_of(its K)."""
    for (name, runs), (color, ls, marker) in zip(groups.items(), styles(len(groups))):
        depths = depths_of(runs[0]['K'])
        mean, std = mean_std([[run['records'][-1][key][d - 1] for d in depths] for run in runs])
        yerr = std if len(runs) > 1 else None
        ax.errorbar(depths, mean, yerr=yerr, color=color, ls=ls, marker=marker, ms=5, label=name)


def plot(groups, fig_dir):
    """The paper's figures 1, 2, 3 and (with an alpha readout) 5 in fig_dir; returns their paths.
    Every run is read at its own K: its last loop k = K, its depths 1..K and 2K."""
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
    # fig3: validation loss against exit depth 1..K and 2K at the end of training; untrained exits
    # (early loops under terminal supervision) can be tens of nats: the frame leaves them out
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


def finished(folder, cmd):
    """Whether folder's run reached the step cmd asks for (its last --max_iters, as train.py reads
    it), else its own max_iters: asking for more steps resumes a finished run."""
    wanted = [int(a.split('=')[1]) for a in cmd if a.startswith('--max_iters=')]
    try:
        config, records, _ = read_log(folder)
    except LogError:  # no log yet
        return False
    goal = wanted[-1] if wanted else config.get('max_iters')
    return goal is not None and records[-1]['step'] >= goal


def train_one(cmd, out_path):
    """Run one train.py, its output appended to out_path: (exit code, Ctrl-C came, its last line).
    In a process group of its own, a terminal's Ctrl-C reaches only us; we pass it (or SIGTERM) on
    once, train.py saves and exits, and we wait for the save. Output to a file, not a pipe: reading
    a busy pipe runs no signal handler until the child ends."""
    start, interrupted = os.path.getsize(out_path) if os.path.exists(out_path) else 0, False
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM: as Ctrl-C
    try:
        with open(out_path, 'a') as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, process_group=0)
            while proc.poll() is None:
                try:  # a short sleep, not a blocking wait: a Ctrl-C is handled within 0.1 s
                    time.sleep(0.1)
                except KeyboardInterrupt:  # a second one is passed on too: train.py's "abort now"
                    interrupted = True
                    proc.send_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
    with open(out_path) as f:
        lines = f.read()[start:].strip().splitlines() or ['no output']
    # train.py's advice (--resume) is for one run; the grid goes on by its own command
    return proc.returncode, interrupted, lines[-1].split('; continue with')[0]


def run_grid(config, conditions, seeds, out_root, extra):
    """Train each condition {name: flags} for each seed, seed by seed (a grid stopped early holds
    whole pairs), in out_root/config/<condition>-seed<s>; a finished run (its log at max_iters) is
    reused, an interrupted one resumed, so rerunning the command goes on. Returns the folders."""
    jobs = [(name, seed) for seed in seeds for name in conditions]
    folders, trained, train_s, t0 = [], 0, 0.0, time.time()
    for i, (name, seed) in enumerate(jobs):
        folder = os.path.join(out_root, config, name.replace(' + ', '-') + f"-seed{seed}")
        folders.append(folder)
        cmd = [sys.executable, os.path.join(ROOT, 'train.py'), f'--config={config}',
               *GRID_FLAGS.get(config, []), *conditions[name], f'--seed={seed}',
               f'--out_dir={folder}', *extra]
        if finished(folder, cmd):
            print(f"[{i + 1}/{len(jobs)}] {folder}: finished earlier, reused")
            continue
        resume = os.path.exists(os.path.join(folder, 'ckpt.pt'))
        if resume or os.path.exists(os.path.join(folder, 'log.jsonl')):  # a log, no checkpoint:
            cmd.append('--resume' if resume else '--overwrite')  # stopped before its first save
        # the ETA from runs trained here (a reused one took no time and would make it 0)
        eta = f", ETA {train_s / trained * (len(jobs) - i) / 60:.0f} min" if trained else ''
        print(f"[{i + 1}/{len(jobs)}] {folder}: training ({'resumed' if resume else 'new'}{eta})",
              flush=True)
        os.makedirs(folder, exist_ok=True)
        started = time.time()
        code, interrupted, last = train_one(cmd, os.path.join(folder, 'train.out'))
        trained, train_s = trained + 1, train_s + time.time() - started
        if interrupted:
            print(f"{PROG}: interrupted during {name} (seed {seed}): {last}; rerun the same "
                  "command to continue the grid", file=sys.stderr)
            sys.exit(130)
        if code != 0:
            sys.exit(f"{PROG}: error: the run for {name} (seed {seed}) failed: {last}")
    print(f"grid done in {(time.time() - t0) / 60:.1f} min")
    return folders


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
    p.add_argument('--grid', default=None, choices=list(GRIDS), help="--run: the conditions "
                   "(default: claim4 for laptop_long, readouts for laptop_deep, else paper)")
    p.add_argument('--conditions', default=None, help='--run: only these of the grid, by folder '
                   'name, comma-separated (per_loop-rmsnorm,per_loop-raw)')
    p.add_argument('--fig_dir', default=None, help='where the figures go (default: out/figures, '
                   'with --run out/figures/<config>)')
    return p


def check_flags(p, args):
    """Every flag error, before any training: (the conditions to train, extra flags, fig_dir)."""
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
    grid = GRIDS[args.grid or DEFAULT_GRID.get(args.config, 'paper')]
    by_slug = {name.replace(' + ', '-'): name for name in grid}
    chosen = by_slug if args.conditions is None else args.conditions.split(',')
    unknown = [c for c in chosen if c not in by_slug]
    if unknown:
        p.error(f"--conditions: {', '.join(unknown)} not in the grid; "
                f"choose from {', '.join(by_slug)}")
    return {by_slug[c]: grid[by_slug[c]] for c in chosen}, extra, fig_dir


def main(argv=None):
    """Check the flags, train the grid if asked, read every log, then draw."""
    p = get_parser()
    args = p.parse_args(argv)
    conditions, extra, fig_dir = check_flags(p, args)
    seeds = range(1, args.seeds + 1)
    folders = run_grid(args.config, conditions, seeds, args.out_root, extra) if args.run else []
    try:
        runs = read_runs(args.runs, folders)
    except LogError as e:
        sys.exit(f"{PROG}: error: {e}")
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
