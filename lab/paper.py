"""
The paper's tables and the measurements over seeds, on top of plot_norms.py's figures: the same runs (run folders,
quoted globs, or --run to train the grid first), plot_norms.py's figures 1, 2, 3 and 5, and

    python -m lab.paper 'out/paper/laptop/*' --fig_dir=out/paper/figures --exit_windows=0
    python -m lab.paper --run --config=laptop_long --seeds=8 --exit_windows=0   # train, draw, tabulate
    python -m lab.paper --run --grid=gate --seeds=3 --train_args='--init=gpt2'   # any of the lab's grids

table.md and table.csv (per condition, mean +- sample SD (ddof 1) over seeds; table.md's second table and
paired.csv: the differences to --reference paired by seed, with t intervals), fig6_crossover (claim 4: loss at
depth K against step, and the paired gap to --reference), and from each run's checkpoint the timed early-exit
benchmark (exit_table.md, fig4_pareto; time it on an otherwise idle machine).

Not here: reading the logs and drawing the figures of single conditions (plot_norms.py, through lab/grid.py), which
runs are pairs and their t intervals (lab/stats.py), the early-exit measurement (lab/diagnose.py: exit_results,
exit_summary, plot_pareto).
"""

import os

import numpy as np

import plot_norms
from lab import diagnose
from lab.grid import GRIDS, LogError, grid_of, group_runs, load_runs, run_grid, slug
from lab.report import (at_least, check_destination, fail, markdown, pyplot, run_main, runs_flags,
                        save_figure, split_flags, tool_parser, write_csv, write_text)
from lab.stats import (LEVEL, REFERENCE, default_reference, pair_up, paired_diffs, paired_rows,
                       paired_stats, progress, sample_sd)

plt = pyplot()  # on Agg: files only, no display needed
PROG = 'python -m lab.paper'


def paired_gaps(middle, right, entry, style, name, nudge):
    """One condition's paired gap to the reference, with t intervals: at depth K against step, up to
    the comparison step (middle), and against depth at that step (right)."""
    color, ls, marker = style
    K = entry['K']
    logs = [x['records'] for _, run, ref in entry['pairs'] for x in (run, ref)]
    steps = sorted(set.intersection(*[{r['step'] for r in records} for records in logs]))
    steps = [s for s in steps if s <= entry['step']]
    gap = np.stack([paired_diffs(entry, s)[:, K - 1] for s in steps], axis=1)  # (pairs, steps)
    stats = paired_stats(gap)
    middle.plot(steps, stats['mean'], color=color, ls=ls, marker=marker, ms=3, label=name)
    if stats['n'] > 1:
        middle.fill_between(steps, stats['lo'], stats['hi'], color=color, alpha=0.15)
    stats = paired_stats(paired_diffs(entry))
    depths = np.arange(1, 2 * K + 1) + nudge  # nudged sideways: the conditions' bars do not overlap
    yerr = None if stats['n'] < 2 else [stats['mean'] - stats['lo'], stats['hi'] - stats['mean']]
    pairs = f"{stats['n']} pair{'s' * (stats['n'] != 1)}"
    right.errorbar(depths, stats['mean'], yerr=yerr, color=color, ls=ls, marker=marker, ms=4,
                   capsize=2, label=f"{name} ({pairs}, step {entry['step']})")


def plot_crossover(groups, style, paired, reference, title, fig_dir):
    """fig6, claim 4: does a scale-controlled variant overtake the scale-invariant readout in
    training (left: loss at depth K), by more than chance given the paired seeds (middle, right)?"""
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(20, 5.5))
    for name, runs in groups.items():
        steps, loss = plot_norms.series(runs, 'val_loss', runs[0]['K'] - 1)
        plot_norms.line_with_band(left, steps, loss, style[name], name, ms=3)
    finals = [plot_norms.series(runs, 'val_loss', runs[0]['K'] - 1)[1][:, -1].mean()
              for runs in groups.values()]
    left.set_ylim(min(finals) - 0.15, max(finals) + 0.6)  # frame the end, not the first evals
    Ks = '/'.join(map(str, sorted({runs[0]['K'] for runs in groups.values()})))
    left.set(xlabel='training step', ylabel=f'validation loss at depth K={Ks}',
             title='validation loss at the trained depth\n(mean over seeds; band: +- 1 sample SD)')
    shown = {name: entry for name, entry in paired.items() if entry['pairs']}
    for i, (name, entry) in enumerate(shown.items()):
        paired_gaps(middle, right, entry, style[name], name, 0.06 * (i - (len(shown) - 1) / 2))
    for ax in (middle, right):
        ax.axhline(0, color=style[reference][0] if reference in style else 'grey', lw=1.2,
                   label=f"{reference} (the zero line)")
    paired_Ks = sorted({entry['K'] for entry in shown.values()})
    for K in paired_Ks:
        right.axvline(K, color='grey', lw=0.8, ls=':')
    if paired_Ks:
        right.set_xticks(range(1, 2 * max(paired_Ks) + 1))
    middle.set_ylim(-0.3, 0.5)
    gap_label = f'loss minus {reference} (below 0: better)'
    middle.set(xlabel='training step', ylabel=gap_label,
               title=f'gap to {reference} at depth K, paired by seed\n'
                     f'(mean; band: {LEVEL:.0%} t interval over seeds, n-1 df)')
    right.set(xlabel='exit depth (dotted: trained K)', ylabel=gap_label,
              title=f'paired gap by depth at the comparison step (legend)\n'
                    f'(mean; bars: {LEVEL:.0%} t interval over seeds, n-1 df)')
    for ax in (left, middle, right):
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=7, loc='upper right')
    if shown:
        right.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1))
    else:
        for ax in (middle, right):
            ax.text(0.5, 0.5, f'no {reference} run to pair with', ha='center',
                    transform=ax.transAxes)
    # the title's first line only: each panel names its own band (std over seeds, or a t interval)
    fig.suptitle("Claim 4: does scale control win at matched depth with longer training?\n"
                 + title.splitlines()[0], fontsize=10)
    return save_figure(fig, os.path.join(fig_dir, 'fig6_crossover.png'))


def loop_means(records, key, n, f):
    """'0.100 0.200 ...': records' per-loop entry key, loops 1..n, mean over the seeds."""
    return ' '.join(f"{v:{f}}" for v in np.mean([r[key] for r in records], axis=0)[:n])


def table(groups, fig_dir, paired, reference=REFERENCE, behind=()):
    """Per condition: perplexity and ||h_K|| at depth K (mean +- sample SD over seeds), ppl at
    depths 1..K and 2K, the alpha readout's final alpha, a gated run's mean exit probability and
    |gate logit| per loop (means over seeds); then the paired differences. Returns table.md's
    text."""
    # runs of different K share one table: a column per depth any of them reports, blank where none
    depths = sorted({d for runs in groups.values() for d in plot_norms.exit_depths(runs[0]['K'])})
    # gated runs: the gate's exit probability per loop, its |logit| (the last gate's has no effect)
    gated = any('exit_prob' in r['records'][-1] for runs in groups.values() for r in runs)
    header = (['condition', 'seeds', 'step', 'K', 'val ppl (depth K)', '‖h_K‖']
              + [f"ppl@{d}" for d in depths] + ['alpha']
              + (['exit p_k, k = 1..K', 'gate logit (abs), k = 1..K-1'] if gated else []))
    pm = lambda v, f: f"{v.mean():{f}}" + (f" +- {sample_sd(v):{f}}" if len(v) > 1 else '')
    rows = []
    for name, runs in groups.items():
        K, last = runs[0]['K'], [run['records'][-1] for run in runs]
        ppl = {d: np.exp([r['val_loss'][d - 1] for r in last]) for d in plot_norms.exit_depths(K)}
        h = np.array([r['hidden_norm'][K - 1] for r in last])
        alpha = pm(np.array([r['alpha'] for r in last]), '.3f') if 'alpha' in last[0] else ''
        step = min(r['step'] for r in last)
        gate = [] if not gated else ['', ''] if 'exit_prob' not in last[0] else [
            loop_means(last, 'exit_prob', K, '.3f'), loop_means(last, 'gate_logit', K - 1, '.1f')]
        rows.append([name, str(len(runs)), str(step), str(K), pm(ppl[K], '.3f'), pm(h, '.1f')]
                    + [pm(ppl[d], '.2f') if d in ppl else '' for d in depths] + [alpha] + gate)
    write_csv(os.path.join(fig_dir, 'table.csv'), [header] + rows)
    md = markdown(header, rows)
    unfinished = [progress(run) for runs in groups.values() for run in runs
                  if run['records'][-1]['step'] < (run['config'].get('max_iters') or 0)]
    if behind:
        md += ('\n\nLeft out of this table and the figures, behind the other seeds of their '
               'condition (still training, or stopped early): ' + '; '.join(map(progress, behind)))
    if unfinished:
        md += ('\n\nNot finished (still training, or stopped early; the table shows their last '
               'evaluation): ' + '; '.join(unfinished))
    md += '\n\n' + paired_table(paired, reference, fig_dir)
    write_text(os.path.join(fig_dir, 'table.md'), md + '\n')
    return md


def paired_table(paired, reference, fig_dir):
    """The paired differences to the reference as markdown (returned) and paired.csv: at depth K
    with the verdict, and at every depth 1..2K (stats.paired_rows)."""
    lines = [f"Paired differences to {reference}: validation loss (nats) minus {reference}'s, "
             "seed by seed (runs paired by the seed in their log header, with the same settings, "
             "compared at one step), then the mean, its standard error (sample std / sqrt(n)) "
             f"and a {LEVEL:.0%} t interval over seeds with n-1 degrees of freedom. An interval "
             "that contains 0: no difference shown."]
    csv_path = os.path.join(fig_dir, 'paired.csv')
    if not paired:
        if os.path.exists(csv_path):  # an earlier plot's: it does not describe these runs
            os.remove(csv_path)
        return (lines[0] + f"\n\nNo paired differences: these runs hold no {reference} run, "
                "or no other condition.")
    header, rows, csv_rows, notes = paired_rows(paired, reference)
    csv_header = ['condition', 'reference', 'depth', 'is_K', 'pairs', 'seeds', 'step', 'mean_diff',
                  'se', 'lo', 'hi', 'df', 't', 'verdict']
    write_csv(csv_path, [csv_header] + csv_rows)
    lines.append(markdown(header, rows))
    if notes:
        lines.append('\n'.join(f"- {note}" for note in notes))
    return '\n\n'.join(lines)


def get_parser():
    p = tool_parser(PROG, __doc__)
    runs_flags(p, 'the grid of conditions', 'laptop', os.path.join('out', 'grid'),
               '--max_iters=100')
    p.add_argument('--seeds', type=int, default=1,
                   help='seeds per condition for --run (seeds 1..N)')
    p.add_argument('--grid', default=None, choices=list(GRIDS),
                   help="--run: which named grid of conditions to train (default: claim4 for "
                        "laptop_long, readouts for laptop_deep, else paper, the paper's ten); "
                        "atlas: the field's looped designs, each under rmsnorm and raw")
    p.add_argument('--conditions', default=None,
                   help='--run: comma-separated conditions of the grid to train (default: all of '
                        'them), by folder name, e.g. ' + ', '.join(map(slug, GRIDS['paper'])))
    p.add_argument('--fig_dir', default=None,
                   help='where figures and tables go (default: out/figures/<config> with --run, '
                        'else out/figures; the committed figures/ change only when named here)')
    p.add_argument('--exit_windows', type=int, default=200,
                   help='validation windows for the timed early-exit benchmark, half to calibrate '
                        'and half to measure (0: none); needs each run\'s ckpt.pt')
    p.add_argument('--reference', default=None,
                   help=f"the condition every other is paired with, seed by seed, by folder name "
                        f"or condition name (default: {slug(REFERENCE)}, under the runs' init "
                        "if not the paper's, when there are such runs)")
    return p


def check_flags(p, args):
    """Every flag error, before any work: the extra train.py flags, the conditions, the destination.
    Returns (train_args, condition names or None for the whole grid, fig_dir)."""
    at_least(p, '--seeds', args.seeds, 1)
    if not args.run and not args.runs:
        p.error("name run folders to plot, or pass --run to train the grid")
    train_args = split_flags(p, args.train_args)
    # untracked by default: the committed reference figures change only when --fig_dir names them
    fig_dir = args.fig_dir or os.path.join('out', 'figures', *([args.config] if args.run else []))
    check_destination(p, os.path.join(fig_dir, 'table.md'), '--fig_dir')  # before any training
    names = None
    if args.conditions is not None:
        by_slug = {slug(n): n for n in grid_of(args.config, args.grid)}
        unknown = [c for c in args.conditions.split(',') if c not in by_slug]
        if unknown:
            p.error(f"--conditions: {', '.join(unknown)} not in the grid; "
                    f"choose from {', '.join(by_slug)}")
        names = [by_slug[c] for c in args.conditions.split(',')]
    return train_args, names, fig_dir


def read_runs(args, folders):
    """Every run named on the command line after the grid's own folders (lab.grid.load_runs: plot_norms.py's
    reader under the lab's names), read before anything is drawn: one bad folder is one line."""
    try:
        return load_runs(args.runs, folders)
    except LogError as e:
        fail(PROG, e)


def pick_reference(p, args, runs):
    """The condition the others pair with: --reference (folder or condition name), else REFERENCE,
    under the runs' own init where they name one ('per_loop + rmsnorm (gpt2 init)')."""
    known = {run['name'] for run in runs}
    if args.reference is None:
        return default_reference(known)
    reference = next((n for n in known if args.reference in (n, slug(n))), None)
    if reference is None:
        p.error(f"--reference={args.reference}: no such condition among the runs; they hold "
                + ', '.join(sorted(map(slug, known))))
    return reference


def exit_benchmark(groups, runs, max_windows):
    """diagnose.exit_results on every run's checkpoint, or None (no windows asked for, or a run
    without ckpt.pt). Run before any figure: a bad checkpoint stops everything, in one line."""
    if max_windows <= 0:
        return None
    if not all(os.path.exists(os.path.join(run['folder'], 'ckpt.pt')) for run in runs):
        print("no early-exit benchmark: some runs have no ckpt.pt")
        return None
    print(f"early-exit benchmark on {len(runs)} checkpoints "
          "(timed: keep the machine otherwise idle)", flush=True)
    try:
        return diagnose.exit_results(groups, max_windows)
    except (ValueError, OSError) as e:  # an unreadable checkpoint or dataset: one line, naming it
        fail(PROG, f"no early-exit benchmark: {e}")


def main(argv=None):
    """Check the flags, train the grid if asked, read every log, then draw (plot_norms.py's figures and
    the crossover), tabulate and run the early-exit benchmark."""
    p = get_parser()
    args = p.parse_args(argv)
    train_args, names, fig_dir = check_flags(p, args)
    folders = []
    if args.run:  # the grid's run folders, trained first (finished runs are reused)
        seeds = range(1, args.seeds + 1)
        folders = run_grid(args.config, seeds, args.out_root, train_args, names, args.grid, prog=PROG)
    runs = read_runs(args, folders)
    groups = group_runs(runs)
    reference = pick_reference(p, args, runs)
    paired = pair_up(groups, reference)  # from every run: pair_up picks its own step per condition
    groups, behind = plot_norms.caught_up(groups)
    if behind:
        print("left out of the figures and the first table, behind the other seeds of their "
              "condition: " + '; '.join(map(progress, behind)))
    exits = exit_benchmark(groups, runs, args.exit_windows)
    style = dict(zip(groups, plot_norms.styles(len(groups))))
    for path in plot_norms.plot(groups, fig_dir) + [
            plot_crossover(groups, style, paired, reference, plot_norms.title(groups), fig_dir)]:
        print(f"wrote {path}")
    print(table(groups, fig_dir, paired, reference, behind))
    print(f"wrote {os.path.join(fig_dir, 'table.md')}, table.csv"
          + (' and paired.csv' if paired else ''))
    if exits is not None:
        md = markdown(*diagnose.exit_summary(exits))
        write_text(os.path.join(fig_dir, 'exit_table.md'), md + '\n')
        print(md)
        pareto = diagnose.plot_pareto(exits, os.path.join(fig_dir, 'fig4_pareto.png'),
                                      plot_norms.describe(runs), plot_norms.styles(len(exits)))
        print(f"wrote {os.path.join(fig_dir, 'exit_table.md')} and {pareto}")


if __name__ == '__main__':
    run_main(main, PROG)
