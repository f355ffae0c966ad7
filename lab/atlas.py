"""
The atlas: does each of the field's looped designs carry the state's scale from loop to loop, and does the loss
see it? Every design (grid.DESIGNS: residual, normed, sandwich, injection, prelude/coda, sampled depth, bptt,
looped_nanochat's defaults) under a scale-invariant (rmsnorm) and a scale-visible (raw) readout, a few seeds each.

    python -m lab.atlas                                  # train what is missing (laptop, 3 seeds), then the table
    python -m lab.atlas --fig_dir=figures/atlas          # the committed table and figure
    python -m lab.atlas --seeds=1 --train_args='--max_iters=40'    # a quick look (about 10 minutes on 2 cores)
    python -m lab.atlas 'out/grid/laptop/*'              # only read runs that exist (no training), e.g. while it trains

The runs are the grid's (grid.run_grid with grid='atlas', folders under --out_root/laptop): finished ones are
reused, interrupted ones resumed, Ctrl-C saves the running one and the same command continues. Writes to
--fig_dir: atlas.md (table 1: the prediction written before the runs, grid.PREDICTIONS, next to each
measurement and whether they agree; table 2: validation loss at depths 1..K and 2K), atlas.csv, and
fig8_atlas.png and .svg (||h_K|| against training step, one panel per design, both readouts).

Not here: the designs themselves (looped.py), their predictions and flags (lab/grid.py: DESIGNS, PREDICTIONS), the
exit rules at matched depth (lab/matched_depth.py --against).
"""

import os

import numpy as np

from lab.grid import ATLAS_DESIGN, ATLAS_READOUTS as READOUTS, PREDICTIONS, LogError, group_runs, load_runs, run_grid
from lab.report import (at_least, check_destination, markdown, pyplot, run_main, save_figure, split_flags, tool_parser,
                        train_flags, write_csv, write_text)

PROG = 'python -m lab.atlas'

CARRIED = 1.5  # ||h_K|| / ||h_1|| above this: the scale is carried from loop to loop (below: removed)
LARGE = 100.0  # ||h_K|| above this: large (the scale grew where nothing holds it), below: small


def summarize(runs):
    """Over a condition's seeds, at the last evaluation: ||h_K|| and ||h_K|| / ||h_1|| (mean, std), the validation
    loss at depths 1..K and 2K (mean), the seeds and the step."""
    K = runs[0]['K']
    last = [run['records'][-1] for run in runs]
    norm = np.array([r['hidden_norm'][K - 1] for r in last])
    ratio = np.array([r['hidden_norm'][K - 1] / r['hidden_norm'][0] for r in last])
    loss = np.mean([[r['val_loss'][d - 1] for d in (*range(1, K + 1), 2 * K)] for r in last], axis=0)
    return {'norm': (norm.mean(), norm.std()), 'ratio': (ratio.mean(), ratio.std()), 'loss': loss, 'K': K,
            'seeds': len(runs), 'step': last[0]['step']}


def verdicts(design, got):
    """(measured words, agrees?) for the three predictions of one design: carried, level under rmsnorm and raw."""
    carried, *levels, _ = PREDICTIONS[design]
    out = []
    if 'rmsnorm' in got:
        ratio = got['rmsnorm']['ratio'][0]
        out.append(('carried' if ratio > CARRIED else 'removed', (ratio > CARRIED) == carried))
    else:
        out.append(('not run', None))
    for readout, want in zip(READOUTS, levels):
        if readout in got:
            level = 'large' if got[readout]['norm'][0] > LARGE else 'small'
            out.append((level, level == want))
        else:
            out.append(('not run', None))
    return out


def fmt(mean_std, digits=1):
    mean, std = mean_std
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def tables(results):
    """atlas.md's text and atlas.csv's rows from {design: {readout: summarize(...)}}."""
    agree = lambda ok: '' if ok is None else 'yes' if ok else '**no**'
    head1 = ['design', 'predicted: scale', 'rmsnorm ‖h_K‖/‖h_1‖', 'measured', 'agrees',
             'predicted: rmsnorm ‖h_K‖', 'rmsnorm ‖h_K‖', 'measured', 'agrees',
             'predicted: raw ‖h_K‖', 'raw ‖h_K‖', 'measured', 'agrees']
    head2 = ['design', 'readout', 'seeds', 'step', 'val loss at depth 1..K', 'at 2K']
    rows1, rows2, csv_rows = [], [], [['design', 'readout', 'seeds', 'step', 'norm_mean', 'norm_std', 'ratio_mean',
                                       'ratio_std', 'val_loss_1..K,2K', 'prediction', 'measured', 'agrees']]
    for design, got in results.items():
        carried, want_rms, want_raw, why = PREDICTIONS[design]
        (scale, ok_s), (lvl_rms, ok_rms), (lvl_raw, ok_raw) = verdicts(design, got)
        cell = lambda r, key, d=1: fmt(got[r][key], d) if r in got else ''
        rows1.append([design, 'carried' if carried else 'removed', cell('rmsnorm', 'ratio', 2), scale, agree(ok_s),
                      want_rms, cell('rmsnorm', 'norm'), lvl_rms, agree(ok_rms),
                      want_raw, cell('raw', 'norm'), lvl_raw, agree(ok_raw)])
        for r, want, level, ok in (('rmsnorm', want_rms, lvl_rms, ok_rms), ('raw', want_raw, lvl_raw, ok_raw)):
            if r not in got:
                continue
            s = got[r]
            rows2.append([design, r, str(s['seeds']), str(s['step']), ' '.join(f"{v:.3f}" for v in s['loss'][:-1]),
                          f"{s['loss'][-1]:.3f}"])
            csv_rows.append([design, r, s['seeds'], s['step'], f"{s['norm'][0]:.2f}", f"{s['norm'][1]:.2f}",
                             f"{s['ratio'][0]:.3f}", f"{s['ratio'][1]:.3f}", ' '.join(f"{v:.4f}" for v in s['loss']),
                             want, level, agree(ok).strip('*')])
    text = (f"Table 1. The state's scale per design, at the last evaluation, mean ± std over seeds. Predictions "
            f"(grid.PREDICTIONS, written before the runs): 'carried' means ‖h_K‖/‖h_1‖ > {CARRIED:g} (nothing "
            f"renormalizes the state between loops), 'large' means ‖h_K‖ > {LARGE:g}.\n\n" + markdown(head1, rows1)
            + "\n\nWhy each prediction was made:\n\n" + '\n'.join(f"- {d}: {PREDICTIONS[d][3]}" for d in results)
            + "\n\nTable 2. Validation loss (nats) at exit depths 1..K and 2K, mean over seeds.\n\n"
            + markdown(head2, rows2) + '\n')
    return text, csv_rows


def plot(groups, names, path, title):
    """fig8_atlas.png and .svg: ||h_K|| against training step (log norm axis, from step 0: the initialization), one
    panel per design, both readouts (mean over seeds, a band from the lowest to the highest seed)."""
    plt = pyplot()
    designs = list(dict.fromkeys(d for d, _ in names.values()))
    cols = 4
    rows = -(-len(designs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 2.8 * rows), sharex=True, sharey=True, squeeze=False)
    styles = {'rmsnorm': ('#D55E00', '-'), 'raw': ('#0072B2', '--')}
    for ax, design in zip(axes.flat, designs):
        for name, (d, readout) in names.items():
            if d != design or name not in groups:
                continue
            runs = groups[name]
            n = min(len(run['records']) for run in runs)
            steps = np.array([r['step'] for r in runs[0]['records'][:n]])
            K = runs[0]['K']
            norms = np.array([[r['hidden_norm'][K - 1] for r in run['records'][:n]] for run in runs])
            color, ls = styles[readout]
            ax.plot(steps, norms.mean(0), color=color, ls=ls, marker='o', ms=2.5, label=f"{readout} ({len(runs)} seeds)")
            ax.fill_between(steps, norms.min(0), norms.max(0), color=color, alpha=0.15)
        ax.set(title=design, yscale='log')
        ax.grid(True, which='both', alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    for ax in axes.flat[len(designs):]:
        ax.axis('off')
    for ax in axes[-1]:
        ax.set_xlabel('training step')
    for ax in axes[:, 0]:
        ax.set_ylabel('‖h_K‖ (validation)')
    fig.suptitle(f"The atlas: final-loop norm against training step per design, rmsnorm and raw readouts\n{title}",
                 fontsize=10)
    return save_figure(fig, path, dpi=120)


def get_parser():
    p = tool_parser(PROG, __doc__)
    p.add_argument('runs', nargs='*', help='run folders or quoted globs to read instead of training the atlas; '
                                           'runs of other conditions are left out')
    p.add_argument('--seeds', type=int, default=3, help='seeds per condition (seeds 1..N)')
    train_flags(p, 'laptop', os.path.join('out', 'grid'), '--max_iters=40')
    p.add_argument('--fig_dir', default=os.path.join('out', 'figures', 'atlas'),
                   help='where the table and figure go (the committed figures/atlas changes only when named here)')
    return p


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    at_least(p, '--seeds', args.seeds, 1)
    extra = split_flags(p, args.train_args)
    check_destination(p, os.path.join(args.fig_dir, 'atlas.md'), '--fig_dir')  # before the runs, not after them
    folders = [] if args.runs else run_grid(args.config, range(1, args.seeds + 1), args.out_root, extra, grid='atlas',
                                            prog=PROG)
    try:
        groups = group_runs(load_runs(args.runs, folders))
    except LogError as e:
        p.error(str(e))
    groups = {name: runs for name, runs in groups.items() if name in ATLAS_DESIGN}
    if not groups:
        p.error(f"none of the runs is an atlas condition (grid.ATLAS); train them with {PROG}")
    results = {}
    for name, (design, readout) in ATLAS_DESIGN.items():
        if name in groups:  # seeds at the condition's furthest evaluation only: means never mix steps
            last = max(run['records'][-1]['step'] for run in groups[name])
            behind = [run['folder'] for run in groups[name] if run['records'][-1]['step'] < last]
            if behind:
                print(f"left out, behind the other seeds of {name}: {', '.join(behind)}")
            groups[name] = [run for run in groups[name] if run['records'][-1]['step'] == last]
            results.setdefault(design, {})[readout] = summarize(groups[name])
    text, rows = tables(results)
    write_text(os.path.join(args.fig_dir, 'atlas.md'), text)
    write_csv(os.path.join(args.fig_dir, 'atlas.csv'), rows)
    first = next(iter(groups.values()))[0]
    m = first['config']['model']
    title = (f"{args.config}: {m['n_layer']} layers x K={m['n_loop']}, d={m['n_embd']}, "
             f"{first['config']['max_iters']} steps, per-loop supervision")
    path = plot(groups, ATLAS_DESIGN, os.path.join(args.fig_dir, 'fig8_atlas.png'), title)
    print(text)
    print(f"wrote {os.path.join(args.fig_dir, 'atlas.md')}, atlas.csv, {path} and its .svg")


if __name__ == '__main__':
    run_main(main, PROG)
