"""
The norm's course over long training: ||h_K|| against step on log-log axes, the transient told apart from the
growth, and a power law fitted to what comes after the transient, extrapolated to the paper's token count.

    python -m lab.norm_course --run                                 # train the long runs (hours), then fit
    python -m lab.norm_course --run --fig_dir=figures/laptop_10k    # the committed table and figure
    python -m lab.norm_course 'out/course/laptop_10k/*-seed*[0-9]' --after=2000   # fit runs you have, from a later step

--run trains COURSE (laptop_10k: rmsnorm and raw at the demo's 3e-3 and the paper's 3e-4; two ablations of the
first steps at 3e-3, a 500-step warmup under rmsnorm and GPT-2's small initialization (untied head), --init=gpt2, under
both readouts) through grid.run_grid, one run at a time: finished runs are reused, interrupted ones resumed (Ctrl-C
saves; the same command continues, across sessions too), so the runs can be trained in pieces. The committed runs were
trained two at a time instead, each single-threaded, with the train.py line the grid gives each (its COURSE flags,
--seed=1, its folder under out/course/laptop_10k/): about an hour a run on 2 cores.

The fit, per run: log ||h_K|| = a + b log(step) by least squares over the evaluations at step >= --after, with
the 95% t interval of the power b (n - 2 degrees of freedom), and the fitted law read at the paper's token count
(its 44M recipe: 4 epochs of about 100M WikiText-103 tokens in windows of 256 at stride 128, batch 64: about
48,800 steps of 16,384 tokens, 800M tokens), converted to this run's steps by tokens per step. The RMS
(||h_K|| / sqrt(d)), not the L2 norm, is what can be compared across widths: the paper's headline 39,000 at
d = 512 is an RMS of about 1,720. An extrapolation from a small model over 1.5 to 2 decades of steps, nothing
more; runs continued further (--max_iters) that leave the interval falsify it.

Writes to --fig_dir: course.md (the fits and their extrapolations), course.csv, fig9_norm_course.png and .svg.
Not here: the runs' training (train.py through lab/grid.py), the paired statistics of other tables (lab/stats.py).
"""

import math
import os

import numpy as np

from lab.grid import LogError, load_runs, run_grid
from lab.report import (at_least, check_destination, markdown, pyplot, run_main, runs_flags, save_figure, split_flags,
                        tool_parser, write_csv, write_text)
from lab.stats import family_verdicts, paired_test, t_quantile

PROG = 'python -m lab.norm_course'

# the long runs: folder label -> train.py flags (on --config=laptop_10k); their names are not model conditions,
# since the learning rate and the warmup are training flags, so the grid gets them as its own dict
COURSE = {
    'rmsnorm-lr3e-3': ['--readout=rmsnorm', '--learning_rate=3e-3'],
    'raw-lr3e-3': ['--readout=raw', '--learning_rate=3e-3'],
    'rmsnorm-lr3e-4': ['--readout=rmsnorm', '--learning_rate=3e-4'],
    'raw-lr3e-4': ['--readout=raw', '--learning_rate=3e-4'],
    # the ablations of the first steps: a gentler rate (it did not remove the jump), then a smaller initialization
    'rmsnorm-lr3e-3-warmup500': ['--readout=rmsnorm', '--learning_rate=3e-3', '--warmup_iters=500'],
    'rmsnorm-lr3e-3-gpt2init': ['--readout=rmsnorm', '--learning_rate=3e-3', '--init=gpt2'],
    'raw-lr3e-3-gpt2init': ['--readout=raw', '--learning_rate=3e-3', '--init=gpt2'],
    # the embedding's scale alone: the paper's init with both embeddings (and the tied head) at gpt2's N(0, 0.02)
    'rmsnorm-lr3e-3-smallembed': ['--readout=rmsnorm', '--learning_rate=3e-3', '--init=paper_small_embed',
                                  '--max_iters=2000'],
}
# more seeds of the two rmsnorm runs at 3e-3, 5,000 steps each: how far the power spreads across seeds
SEEDS = {'rmsnorm-lr3e-3': [2, 3], 'rmsnorm-lr3e-3-gpt2init': [2, 3]}
SEED_STEPS = 5000
PAPER_TOKENS = 4 * (100_000_000 // 128) // 64 * 64 * 256  # 4 epochs of windows at stride 128, batch 64 x 256
PAPER_RMS = 39_000 / math.sqrt(512)  # the paper's headline ||h_K|| at d = 512, as an RMS


def fit(steps, norms, after, until=math.inf):
    """Least squares of log norm on log step over after <= step <= until: {'n', 'b', 'lo', 'hi', 'a', 'predict'}, with
    predict(step) -> (value, low, high) of the fitted law and its 95% interval (of the line, not of a new run);
    None with fewer than 3 points."""
    steps, norms = np.asarray(steps, dtype=float), np.asarray(norms, dtype=float)
    keep = (steps >= max(after, 1)) & (steps <= until) & (norms > 0)
    x, y = np.log(steps[keep]), np.log(norms[keep])
    n = len(x)
    if n < 3:
        return None
    xbar, sxx = x.mean(), ((x - x.mean()) ** 2).sum()
    b = ((x - xbar) * (y - y.mean())).sum() / sxx
    a = y.mean() - b * xbar
    s = math.sqrt(((y - a - b * x) ** 2).sum() / (n - 2))  # residual standard deviation
    t = t_quantile(0.975, n - 2)
    se_b = s / math.sqrt(sxx)

    def predict(step):
        x0 = math.log(step)
        se = s * math.sqrt(1 / n + (x0 - xbar) ** 2 / sxx)
        mid = a + b * x0
        return math.exp(mid), math.exp(mid - t * se), math.exp(mid + t * se)
    return {'n': n, 'b': b, 'lo': b - t * se_b, 'hi': b + t * se_b, 'a': a, 'predict': predict,
            'first': int(steps[keep][0]), 'last': int(steps[keep][-1])}


def course(run):
    """(steps, ||h_K|| at each evaluation) of one run."""
    K = run['K']
    return [r['step'] for r in run['records']], [r['hidden_norm'][K - 1] for r in run['records']]


def label(run):
    return os.path.basename(os.path.normpath(run['folder']))


def rows_of(runs, after):
    """One row per run: the transient's peak, the last norm, the fit after --after and its extrapolation."""
    rows = []
    for run in runs:
        steps, norms = course(run)
        c, m = run['config'], run['config']['model']
        tokens_per_step = c['batch_size'] * (c.get('grad_accum') or 1) * m['block_size']
        paper_step = PAPER_TOKENS / tokens_per_step
        f = fit(steps, norms, after)
        early = [v for s, v in zip(steps, norms) if 0 < s <= 500]
        row = {'run': label(run), 'lr': c['learning_rate'], 'warmup': c.get('warmup_iters', 0), 'init': m['init'],
               'd': m['n_embd'], 'steps': steps, 'norms': norms, 'last_step': steps[-1], 'last': norms[-1],
               'loss': run['records'][-1]['val_loss'][run['K'] - 1],  # at depth K, the depth it was trained for
               'peak_early': max(early) if early else math.nan,
               'fit': f, 'paper_step': paper_step}
        if f is not None:
            v, lo, hi = f['predict'](paper_step)
            row['paper_rms'] = (v / math.sqrt(m['n_embd']), lo / math.sqrt(m['n_embd']), hi / math.sqrt(m['n_embd']))
        rows.append(row)
    return rows


def short(v):
    """A number for the table: whole above 10, two significant digits below (a raw run's RMS is under 1)."""
    return f"{v:.0f}" if v >= 10 else f"{v:.2g}"


def table(rows, after):
    """course.md's text and course.csv's rows."""
    head = ['run', 'lr', 'warmup', 'init', 'steps', 'val loss at K', 'peak ‖h_K‖ in steps 1-500', 'last ‖h_K‖',
            f'fit from step {after}: points', 'power b [95% t]', "at the paper's tokens: ‖h_K‖ RMS [95%]",
            'paper RMS']
    cells, out = [], [['run', 'lr', 'warmup', 'init', 'last_step', 'val_loss', 'peak_early', 'last', 'n', 'b', 'b_lo',
                       'b_hi', 'paper_step', 'rms', 'rms_lo', 'rms_hi']]
    for r in rows:
        f = r['fit']
        fitted = ['too few points', '', ''] if f is None else [
            f"{f['n']} ({f['first']}-{f['last']})", f"{f['b']:+.3f} [{f['lo']:+.3f}, {f['hi']:+.3f}]",
            "{} [{}, {}]".format(*map(short, r['paper_rms']))]
        cells.append([r['run'], f"{r['lr']:g}", str(r['warmup']), r['init'], str(r['last_step']), f"{r['loss']:.3f}",
                      f"{r['peak_early']:.1f}", f"{r['last']:.1f}", *fitted, f"{PAPER_RMS:.0f}"])
        out.append([r['run'], r['lr'], r['warmup'], r['init'], r['last_step'], f"{r['loss']:.4f}",
                    f"{r['peak_early']:.2f}", f"{r['last']:.2f}"]
                   + ([''] * 4 if f is None else [f['n'], f"{f['b']:.4f}", f"{f['lo']:.4f}", f"{f['hi']:.4f}"])
                   + [f"{r['paper_step']:.0f}"] + ([''] * 3 if f is None else [f"{v:.1f}" for v in r['paper_rms']]))
    text = (f"Power law log ‖h_K‖ = a + b log(step) fitted from step {after} on (least squares, 95% t interval "
            f"of b), and the fitted line read at the paper's token count ({PAPER_TOKENS / 1e6:.0f}M tokens: "
            f"{rows[0]['paper_step']:,.0f} steps of these runs), as an RMS (‖h_K‖ / sqrt(d)). An extrapolation "
            f"from a small model, not a measurement.\n\n" + markdown(head, cells) + '\n')
    spread = seed_spread(rows, after)
    if spread:
        text += ("\nAcross seeds: the power b of each run with more than one seed, each seed fitted over the steps "
                 f"they all reached (from step {after} to the shortest seed's last evaluation); a t over the "
                 "seeds' powers (SD: the sample SD, ddof 1), Holm-adjusted over the runs of this table; 'higher' "
                 "than 0: the norm grows.\n\n" + markdown(
                     ['run', 'seeds', 'mean b', 'lowest', 'highest', 'SD (ddof 1)', '95% t interval', 'p (Holm)',
                      'b against 0', 'fitted steps'],
                     [[lab, str(n), f"{m:+.3f}", f"{lo:+.3f}", f"{hi:+.3f}", f"{t['sd']:.3f}",
                       f"[{t['lo']:+.3f}, {t['hi']:+.3f}]", f"{t['p_holm']:.4f}", t['verdict'], rng]
                      for lab, n, m, lo, hi, rng, t in spread])
                 + '\n')
    return text, out


def seed_spread(rows, after):
    """Table 2 of course.md: the power across the seeds of each run that has more than one, as (label, seeds,
    mean b, lowest b, highest b, the fits' step ranges, the test of b against 0). Each seed is refitted over the
    steps its run's seeds all reached (after to the shortest seed's last evaluation): a seed trained twice as long
    bends further, and that is not a spread across seeds. The test: a t over the seeds' powers (sample SD, 95% t
    interval), Holm-adjusted over the runs of this table; 'higher' means the norm grows."""
    groups = {}
    for r in rows:
        groups.setdefault(r['run'].rsplit('-seed', 1)[0], []).append(r)
    out = []
    for label, members in groups.items():
        until = min(m['last_step'] for m in members)
        fits = [f for f in (fit(m['steps'], m['norms'], after, until) for m in members) if f is not None]
        if len(fits) > 1:
            b = np.array([f['b'] for f in fits])
            ranges = sorted({f"{f['first']}-{f['last']}" for f in fits})
            out.append((label, len(fits), b.mean(), b.min(), b.max(), ', '.join(ranges), paired_test(b, 0.0)))
    family_verdicts([row[-1] for row in out], 0.0)  # no margin: a power is never called equivalent to 0
    return out


def plot(runs, rows, after, path):
    """fig9_norm_course.png and .svg: ||h_K|| against step, log-log (step 0 at 1), one line per run, each fit
    dashed over its range."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.2))
    colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
    for i, (run, row) in enumerate(zip(runs, rows)):
        steps, norms = (np.array(v, dtype=float) for v in course(run))
        color = colors[i % len(colors)]
        # step 0 (the initialization) as a lone cross at step 1, the log axis's left edge: the jump from it shows,
        # and no line suggests a path between it and the first evaluation that nobody measured
        ax.plot(steps[steps > 0], norms[steps > 0], 'o-', ms=2.5, color=color, label=row['run'])
        ax.plot(np.ones((steps == 0).sum()), norms[steps == 0], 'x', ms=7, color=color)
        f = row['fit']
        if f is not None:
            xs = np.geomspace(f['first'], f['last'], 20)
            ax.plot(xs, [f['predict'](x)[0] for x in xs], '--', color=color, lw=1.2,
                    label=f"  fit from {after}: b = {f['b']:+.2f} [{f['lo']:+.2f}, {f['hi']:+.2f}]")
    ax.axvline(after, color='grey', lw=0.8, ls=':')
    ax.set(xscale='log', yscale='log', xlabel='training step (x at the left edge: step 0, the initialization)',
           ylabel='‖h_K‖ (validation, mean over tokens)',
           title='‖h_K‖ over long training: the jump in the first steps, then the course after it\n'
                 f'(dashed: the power law fitted from step {after}, dotted line)')
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1))
    return save_figure(fig, path)


def get_parser():
    p = tool_parser(PROG, __doc__)
    runs_flags(p, 'the COURSE runs', 'laptop_10k', os.path.join('out', 'course'), '--max_iters=20000')
    p.add_argument('--after', type=int, default=1000, help='fit the evaluations from this step on (after the jump)')
    p.add_argument('--fig_dir', default=os.path.join('out', 'figures', 'course'), help='where the table and figure go')
    return p


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    if not args.run and not args.runs:
        p.error("name run folders to fit, or pass --run to train the long runs")
    at_least(p, '--after', args.after, 1)
    extra = split_flags(p, args.train_args)
    check_destination(p, os.path.join(args.fig_dir, 'course.md'), '--fig_dir')  # before the runs, not after them
    folders = []
    if args.run:  # seed 1 of every run, then the extra seeds (extra comes last: a --train_args --max_iters wins)
        folders = run_grid(args.config, [1], args.out_root, extra, grid=COURSE, prog=PROG)
        for label, seeds in SEEDS.items():
            folders += run_grid(args.config, seeds, args.out_root, extra, prog=PROG,
                                grid={label: COURSE[label] + [f'--max_iters={SEED_STEPS}']})
    try:
        runs = load_runs(args.runs, folders)
    except LogError as e:
        p.error(str(e))
    rows = rows_of(runs, args.after)
    text, out = table(rows, args.after)
    write_text(os.path.join(args.fig_dir, 'course.md'), text)
    write_csv(os.path.join(args.fig_dir, 'course.csv'), out)
    path = plot(runs, rows, args.after, os.path.join(args.fig_dir, 'fig9_norm_course.png'))
    print(text)
    print(f"wrote {os.path.join(args.fig_dir, 'course.md')}, course.csv, {path} and its .svg")


if __name__ == '__main__':
    run_main(main, PROG)
