"""
Claim 4 at matched inference depth: per-sequence early exit read at the same mean number of loops for every
condition, and each condition compared with the reference condition seed by seed.

    python -m lab.matched_depth 'out/grid/laptop_long/*' 'out/grid/laptop_deep/*'    # into out/figures/matched_depth
    python -m lab.matched_depth 'out/grid/laptop/*' --against=max_prob    # each exit score against another, per run
    python -m lab.matched_depth 'out/gate/laptop/*-rmsnorm*'    # the gate grid: the gate against per-loop's rules

Why: a calibrated exit threshold lands each condition at whatever mean depth it happens to give (rmsnorm exits
after about one loop where raw keeps going to 3.7), so comparing calibrated points compares different depths.
Here every condition is read at the same mean depths, and the gap gets an interval over seeds.

How, per run (from its ckpt.pt) and per exit score (diagnose.SCORES: max_prob, margin, entropy, latent; kl, the
KL rule's; and gate, the learned gate's cumulative exit probability, in runs trained with --supervision=gated):
1. The validation windows are cut in two as in diagnose.exit_benchmark; everything below uses the second half
   (the reporting half). Each window gets its mean cross-entropy and mean score at every loop 1..K
   (diagnose.sequence_depth_stats).
2. A threshold t exits a window at the first loop k < K whose score reaches t, else at K. Every threshold that
   changes an exit is swept: each score value seen at loops 1..K-1, plus "never exit early". That gives the curve
   of (mean loops, mean cross-entropy), mean loops rising from 1 to K as t rises. Thresholds are chosen from the
   scores alone, never from the targets, so reading the curve on the half it was swept on flatters nothing.
3. The curve is read at mean depths 1, 1.5, ..., K by linear interpolation between the two neighbouring
   thresholds. That point is exactly achievable: send each window to one threshold or the other at random, with
   the probability that gives the wanted mean depth; depth and expected cross-entropy are both linear in that
   probability. A depth outside the curve's range gets no value ('not reached'), never an extrapolated one.
Then per configuration, condition, score and depth: condition minus reference in nats, seed by seed, paired by
stats.pair_up (the fixed-depth table's pairing), with the mean, its standard error, the 95% t interval and the
verdict words (stats.paired_stats, stats.verdict). With --against=SCORE the pairs are the two scores of one run
instead: per condition, every other score minus SCORE, seed by seed (is the latent rule, say, worse than the
max-probability rule at the same mean depth?).

Writes to --fig_dir: matched_depth.md and matched_depth.csv (the paired table) and fig7_matched_depth.png and .svg
(the paired difference against mean depth, a band for each interval, one panel per score). Not here: the timed exit
benchmark (diagnose.exit_benchmark), the fixed-depth tables (plot_norms.py).
"""

import os

import numpy as np
import torch

from lab import diagnose
from lab.grid import LogError, group_runs, load_runs
from lab.report import at_least, check_destination, markdown, pyplot, save_figure, tool_parser, write_csv, write_text
from lab.runs import load_model
from lab.runtime import resolve_device
from lab.stats import REFERENCE, default_reference, pair_up, paired_stats, verdict

PROG = 'python -m lab.matched_depth'
STEP = 0.5  # the depth grid: 1, 1.5, ..., K


def depth_grid(K):
    return np.arange(1.0, K + STEP / 2, STEP)


def exit_curve(ce, score, K):
    """The operating points of one score on these windows: (mean loops, mean cross-entropy), one per threshold that
    changes an exit, in order of rising threshold (so of rising mean loops). ce, score: (N, K) per window and loop."""
    ce, passes = np.asarray(ce, dtype=float), np.asarray(score, dtype=float)[:, :K - 1]
    thresholds = np.append(np.unique(passes), np.inf)  # the lowest exits every window at loop 1; inf: none early
    depths, losses = [], []
    for t in thresholds:
        hit = np.concatenate([passes >= t, np.ones((len(ce), 1), dtype=bool)], axis=1)  # loop K always exits
        d = hit.argmax(axis=1)                                        # (N,) 0-based exit loop
        depths.append(d.mean() + 1)
        losses.append(ce[np.arange(len(ce)), d].mean())
    return np.array(depths), np.array(losses)


def read_at(depths, losses, grid):
    """The curve at each depth of grid, linear between neighbouring thresholds; nan where the curve does not reach.
    A window's exit loop never falls as the threshold rises, so two thresholds with the same mean depth give every
    window the same exit, and the same loss: repeated points are one point."""
    depths, keep = np.unique(depths, return_index=True)
    losses = np.asarray(losses)[keep]
    out = np.interp(grid, depths, losses)
    out[(grid < depths[0] - 1e-9) | (grid > depths[-1] + 1e-9)] = np.nan
    return out


@torch.no_grad()
def run_curves(folder, max_windows, device):
    """{score: cross-entropy at each depth of depth_grid(K)} for one run, on the reporting half of its windows."""
    model, ckpt = load_model(folder, device)
    K = model.config.n_loop
    x, y = diagnose.windows(diagnose.val_tokens(ckpt, name=os.path.join(folder, 'ckpt.pt')), model.config.block_size,
                            max_windows)
    _, (xb, yb) = diagnose.split_halves(x, y)
    ce, scores = diagnose.sequence_depth_stats(model, xb.to(device), yb.to(device), K,
                                               gate=getattr(model, 'exit_gate', None) is not None)
    return {name: read_at(*exit_curve(ce, s, K), depth_grid(K)) for name, s in scores.items()}


def matched_rows(paired, curves, reference):
    """One row per configuration, condition and score: {'config', 'condition', 'score', 'pairs', 'seeds', 'depths',
    'stats': [paired_stats of each depth, or None where a pair's curve does not reach it]}. A score the reference's
    runs lack (a gated run's 'gate') is paired with each of the reference's scores in turn: 'gate vs max_prob'."""
    rows, labels = [], set()
    for name, entry in paired.items():
        if not entry['pairs']:
            continue
        grid, first = depth_grid(entry['K']), entry['pairs'][0][1]
        config = first['config'].get('config', '')
        # the configuration has its own column, so a condition keeps its plain name there; group_runs' bracketed
        # folder name stays only where one configuration holds two groups of that condition
        label = name if (config, first['name']) in labels else first['name']
        labels.add((config, label))
        mine, theirs = curves[first['folder']], curves[entry['pairs'][0][2]['folder']]
        for score, ref_score in [(s, r) for s in mine for r in ([s] if s in theirs else theirs)]:
            diffs = np.array([curves[run['folder']][score][:len(grid)] - curves[ref['folder']][ref_score][:len(grid)]
                              for _, run, ref in entry['pairs']])  # (pairs, depths)
            stats = [paired_stats(diffs[:, j]) if np.isfinite(diffs[:, j]).all() else None for j in range(len(grid))]
            rows.append({'config': config, 'condition': label,
                         'score': score if score == ref_score else f"{score} vs {ref_score}",
                         'pairs': len(entry['pairs']), 'seeds': [s for s, _, _ in entry['pairs']],
                         'depths': grid, 'stats': stats, 'reference': reference})
    return rows


def score_rows(groups, curves, against):
    """--against: one row per condition and score, that score's curve minus the against score's in the same run,
    paired over the condition's seeds (the rows matched_rows makes, with the against score as the reference)."""
    rows = []
    for name, runs in groups.items():
        runs = [run for run in runs if run['folder'] in curves]
        if not runs:
            continue
        grid = depth_grid(runs[0]['K'])
        config = runs[0]['config'].get('config', '')
        for score in (s for s in curves[runs[0]['folder']] if s != against):
            diffs = np.array([curves[run['folder']][score][:len(grid)] - curves[run['folder']][against][:len(grid)]
                              for run in runs])  # (seeds, depths)
            stats = [paired_stats(diffs[:, j]) if np.isfinite(diffs[:, j]).all() else None for j in range(len(grid))]
            rows.append({'config': config, 'condition': name, 'score': f"{score} - {against}", 'pairs': len(runs),
                         'seeds': [run['config']['seed'] for run in runs], 'depths': grid, 'stats': stats,
                         'reference': against})
    return rows


def cell(s, reference):
    if s is None:
        return 'not reached'
    words = verdict(s['lo'], s['hi'], reference)
    tag = {'lower': ' lower', 'highe': ' higher'}.get(words[:5], '')
    return f"{s['mean']:+.4f} [{s['lo']:+.4f}, {s['hi']:+.4f}]{tag}"


def write_table(rows, fig_dir):
    """matched_depth.md (one row per configuration, condition and score, one column per depth) and matched_depth.csv
    (one line per depth). Returns the markdown."""
    grid = max((r['depths'] for r in rows), key=len)
    header = ['configuration', 'condition', 'score', 'pairs', 'seeds'] + [f"depth {d:g}" for d in grid]
    table, csv = [], [['configuration', 'condition', 'score', 'pairs', 'depth', 'diff', 'se', 'lo', 'hi', 'df',
                       'verdict']]
    for r in rows:
        cells = [cell(s, r['reference']) for s in r['stats']] + [''] * (len(grid) - len(r['stats']))
        table.append([r['config'], r['condition'], r['score'], str(r['pairs']), ' '.join(map(str, r['seeds']))] + cells)
        for d, s in zip(r['depths'], r['stats']):
            values = ['', '', '', '', '', 'not reached'] if s is None else [
                f"{s['mean']:.6f}", f"{s['se']:.6f}", f"{s['lo']:.6f}", f"{s['hi']:.6f}", str(s['df']),
                verdict(s['lo'], s['hi'], r['reference'])]
            csv.append([r['config'], r['condition'], r['score'], str(r['pairs']), f"{d:g}"] + values)
    what = ('score minus the same run\'s' if ' - ' in rows[0]['score'] else 'condition minus')
    md = (f"Paired differences in validation cross-entropy (nats) at matched mean exit depth, {what} "
          f"{rows[0]['reference']}, seed by seed: mean [95% t interval], on the reporting half of each run's windows; "
          f"'lower'/'higher' when the interval excludes 0.\n\n" + markdown(header, table) + '\n')
    write_text(os.path.join(fig_dir, 'matched_depth.md'), md)
    write_csv(os.path.join(fig_dir, 'matched_depth.csv'), csv, lineterminator='\n')
    return md


def plot(rows, fig_dir):
    """fig7_matched_depth.png and .svg: the paired difference against mean depth with its interval as a band, one
    panel per score, one line per configuration and condition."""
    plt = pyplot()
    scores = list(dict.fromkeys(r['score'] for r in rows))
    cols = min(len(scores), 5)  # a gated run's comparisons make ten panels: two rows of five
    n_rows = -(-len(scores) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(5 * cols, 4.2 * n_rows), sharey=True, squeeze=False)
    axes = axes.ravel()
    for ax in axes[len(scores):]:
        ax.set_visible(False)
    lines = sorted({(r['config'], r['condition']) for r in rows})
    colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
    for ax, score in zip(axes, scores):
        for r in (r for r in rows if r['score'] == score):
            color = colors[lines.index((r['config'], r['condition'])) % len(colors)]
            ok = [s is not None for s in r['stats']]
            d = r['depths'][ok]
            mean, lo, hi = (np.array([s[k] for s in r['stats'] if s is not None], dtype=float)
                            for k in ('mean', 'lo', 'hi'))
            ax.plot(d, mean, 'o-', ms=3, color=color, label=f"{r['config']}: {r['condition']} ({r['pairs']} pairs)")
            ax.fill_between(d, lo, hi, color=color, alpha=0.15)
        ax.axhline(0, color='grey', lw=0.8)
        ax.set(xlabel='mean exit depth (loops)', title=f"score: {score}")
        ax.grid(True, alpha=0.3)
    for ax in axes[::cols]:
        ax.set_ylabel(f"validation loss minus {rows[0]['reference']} (nats)")
    axes[len(scores) - 1].legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1))
    fig.suptitle('Early exit per sequence at matched mean depth: paired difference to the reference, 95% t band',
                 fontsize=10)
    return save_figure(fig, os.path.join(fig_dir, 'fig7_matched_depth.png'))


def get_parser():
    p = tool_parser(PROG, __doc__)
    p.add_argument('runs', nargs='+', help='run folders or quoted globs, each with log.jsonl and ckpt.pt')
    p.add_argument('--fig_dir', default=os.path.join('out', 'figures', 'matched_depth'),
                   help='where the table and figure go (default: out/figures/matched_depth)')
    p.add_argument('--max_windows', type=int, default=200, help='validation windows per run, half of them reported')
    p.add_argument('--reference', default=None,
                   help=f"the condition the others are paired with (default: {REFERENCE}, or that under the "
                        "runs' one init if they hold no other, e.g. 'per_loop + rmsnorm (gpt2 init)')")
    p.add_argument('--against', default=None, choices=[*diagnose.SCORES, 'kl', 'gate'],
                   help="pair each exit score with this one within every run, instead of conditions with --reference "
                        "(gate: the learned exit gate of runs trained with --supervision=gated)")
    p.add_argument('--device', default='auto', help='auto, cpu, cuda or mps')
    return p


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    at_least(p, '--max_windows', args.max_windows, 4, 'two windows in the reporting half')
    check_destination(p, os.path.join(args.fig_dir, 'matched_depth.md'), '--fig_dir')
    try:
        runs = load_runs(args.runs)
    except LogError as e:
        p.error(str(e))
    groups = group_runs(runs)
    if args.against is not None:
        paired, used = {}, sorted(run['folder'] for run in runs)
    else:
        if args.reference is None:
            args.reference = default_reference({run['name'] for run in runs})
        if args.reference not in {run['name'] for run in runs}:
            p.error(f"--reference={args.reference!r}: no such condition among the runs")
        paired = pair_up(groups, args.reference)
        used = sorted({run['folder'] for entry in paired.values() for pair in entry['pairs'] for run in pair[1:]})
        if not used:
            p.error(f"no run pairs with a {args.reference} run of the same seed and settings")
    device, curves = resolve_device(args.device).device, {}
    for i, folder in enumerate(used, 1):
        try:
            curves[folder] = run_curves(folder, args.max_windows, device)
        except (ValueError, OSError) as e:
            p.error(str(e))
        if args.against is not None and args.against not in curves[folder]:
            p.error(f"--against={args.against}: {folder} has no exit gate (not trained with --supervision=gated)")
        print(f"[{i}/{len(used)}] {folder}", flush=True)
    for entry in paired.values():
        for reason in entry['left_out']:
            print(f"left out: {reason}")
    rows = score_rows(groups, curves, args.against) if args.against else matched_rows(paired, curves, args.reference)
    if not rows:
        p.error("no run has curves to compare")
    print(write_table(rows, args.fig_dir))
    print(f"wrote {os.path.join(args.fig_dir, 'matched_depth.md')}, matched_depth.csv, {plot(rows, args.fig_dir)} "
          "and its .svg")


if __name__ == '__main__':
    main()
