"""
The atlas: does each of the field's looped designs carry the state's scale from loop to loop, and does the loss
see it? Every design (grid.DESIGNS: residual, normed, sandwich, injection, prelude/coda, sampled depth, bptt,
looped_nanochat's loop) under a scale-invariant (rmsnorm) and a scale-visible (raw) readout, a few seeds each.

    python -m lab.atlas                                  # train what is missing (laptop, 3 seeds), then the table
    python -m lab.atlas --fig_dir=figures/atlas          # the committed 200-step table and figure
    python -m lab.atlas --init=gpt2 --seeds=1 --train_args='--max_iters=1000 --eval_interval=50' \
        --out_root=out/atlas_gpt2 --fig_dir=figures/atlas_gpt2     # past the transient, under GPT-2's init
    python -m lab.atlas 'out/grid/laptop/*'              # only read runs that exist (no training), e.g. while it trains
    python -m lab.atlas --design=concat                  # one design's rows alone

The runs are the grid's (grid.run_grid with grid.atlas_grid(--init), folders under --out_root/<config>; under
another --init the default out_root is out/atlas_<init>): finished ones are reused, interrupted ones resumed,
Ctrl-C saves the running one and the same command continues. --design (repeatable) narrows both
the runs trained and the rows read back to the designs named; no other design's runs are needed,
since each design's verdicts compare its two readouts with each other and with the unigram loss.

A design and readout carries verdicts only if it learns: its validation loss at every depth 1..K is at least
LEARNS nats below the unigram loss (the validation split under the training split's character frequencies,
computed from the data and printed with the table). Writes to --fig_dir: atlas.md (table 1: each prediction,
written before the runs, beside its measurement and whether they agree; table 2: validation loss at depths
1..K and 2K; table 3: the learns check, the rmsnorm / raw ratio of ||h_K|| over seeds, the power of ||h_K||
against the step fitted from --after on (norm_course's fit) and whether the norm is still growing, and what the
blind spot costs: rmsnorm minus raw loss at K and 2K, paired by seed, with its t interval), atlas.csv, and
fig8_atlas.png and .svg (||h_K|| against training step, one panel per design, both readouts).

Not here: the designs themselves, their flags and predictions (lab/designs.py: DESIGNS), the exit rules
at matched depth (lab/matched_depth.py --against).
"""

import os

import numpy as np

from data.loader import find_dataset, read_dataset
from lab.grid import ATLAS_READOUTS as READOUTS, DESIGNS, LogError, atlas_grid, group_runs, load_runs, run_grid
from lab.norm_course import fit
from lab.configs import HEAD
from lab.stats import paired_stats, sample_sd
from lab.designs import CHOICES
from lab.report import (at_least, check_destination, markdown, pyplot, run_main, save_figure, split_flags, tool_parser,
                        train_flags, write_csv, write_text)

PROG = 'python -m lab.atlas'

CARRIED = 1.5  # ||h_K|| / ||h_1|| above this: the scale is carried from loop to loop (below: removed)
LARGE = 100.0  # ||h_K|| above this: large (the scale grew where nothing holds it), below: small
LEARNS = 0.3  # nats below the unigram loss that every depth 1..K must reach for a row to carry verdicts


def unigram_loss(train, val, vocab_size):
    """Cross-entropy (nats per token) of the validation tokens under the training split's token frequencies, with
    one count added to every token so that a token unseen in training costs a finite amount."""
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=vocab_size) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(val, dtype=np.int64)].mean())


def learns(summary, unigram):
    """Whether a condition learned: its mean validation loss at every depth 1..K at least LEARNS below unigram."""
    return bool(np.all(np.asarray(summary['loss'][:summary['K']]) <= unigram - LEARNS))


def summarize(runs, after):
    """Over a condition's seeds, at the last evaluation: ||h_K|| and ||h_K|| / ||h_1|| (mean, std), the validation
    loss at depths 1..K and 2K (mean), and per seed ({seed: ...}) ||h_K||, the loss at K and 2K and the fit of
    log ||h_K|| on log step from step `after` on (None with fewer than 3 evaluations there)."""
    K = runs[0]['K']
    last = [run['records'][-1] for run in runs]
    norm = np.array([r['hidden_norm'][K - 1] for r in last])
    ratio = np.array([r['hidden_norm'][K - 1] / r['hidden_norm'][0] for r in last])
    loss = np.mean([[r['val_loss'][d - 1] for d in (*range(1, K + 1), 2 * K)] for r in last], axis=0)
    seeds = {run['config']['seed']: {'norm': r['hidden_norm'][K - 1], 'loss_K': r['val_loss'][K - 1],
                                     'loss_2K': r['val_loss'][-1],
                                     'fit': fit([x['step'] for x in run['records']],
                                                [x['hidden_norm'][K - 1] for x in run['records']], after)}
             for run, r in zip(runs, last)}
    return {'norm': (norm.mean(), sample_sd(norm)), 'ratio': (ratio.mean(), sample_sd(ratio)), 'loss': loss, 'K': K,
            'seeds': len(runs), 'step': last[0]['step'], 'per_seed': seeds}


def verdicts(design, got, unigram=None):
    """(measured words, agrees?) for the three predictions of one design: carried, level under rmsnorm and raw.
    A readout whose runs did not learn (see learns; unigram None: not checked) gets no verdict."""
    entry = DESIGNS[design]
    ok = {r: r in got and (unigram is None or learns(got[r], unigram)) for r in READOUTS}
    word = lambda r: 'not run' if r not in got else 'did not learn'
    out = []
    if ok['rmsnorm']:
        ratio = got['rmsnorm']['ratio'][0]
        out.append(('carried' if ratio > CARRIED else 'removed', (ratio > CARRIED) == entry.carried))
    else:
        out.append((word('rmsnorm'), None))
    for readout, want in zip(READOUTS, (entry.rmsnorm, entry.raw)):
        if ok[readout]:
            level = 'large' if got[readout]['norm'][0] > LARGE else 'small'
            out.append((level, level == want))
        else:
            out.append((word(readout), None))
    return out


def fmt(mean_std, digits=1):
    mean, std = mean_std
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def sharper(got):
    """Table 3's measurements of one design, from its readouts' per-seed results: the ratio rmsnorm / raw of
    ||h_K|| paired by seed (mean, std), per readout the power b of ||h_K|| against the step (mean over seeds, with
    the fit's 95% interval for one seed, the seeds' spread otherwise) and whether the norm is still growing (the
    interval above 0 for every seed), and rmsnorm minus raw loss at K and 2K paired by seed (lab/stats.py)."""
    out = {}
    seeds = sorted(set(got['rmsnorm']['per_seed']) & set(got['raw']['per_seed'])) if len(got) == 2 else []
    if seeds:
        a, b = got['rmsnorm']['per_seed'], got['raw']['per_seed']
        ratio = np.array([a[s]['norm'] / b[s]['norm'] for s in seeds])
        out['ratio'] = (ratio.mean(), sample_sd(ratio))
        out['cost'] = paired_stats([[a[s]['loss_K'] - b[s]['loss_K'], a[s]['loss_2K'] - b[s]['loss_2K']]
                                    for s in seeds])
    for readout, s in got.items():
        fits = [f['fit'] for f in s['per_seed'].values()]
        if fits and all(f is not None for f in fits):
            powers = np.array([f['b'] for f in fits])
            spread = (fits[0]['lo'], fits[0]['hi']) if len(fits) == 1 else (powers.min(), powers.max())
            out[readout] = {'b': powers.mean(), 'spread': spread, 'growing': all(f['lo'] > 0 for f in fits),
                            'seeds': len(fits)}
    return out


def tables(results, unigram, after):
    """atlas.md's text and atlas.csv's rows from {design: {readout: summarize(...)}} and the unigram loss."""
    agree = lambda ok: '' if ok is None else 'yes' if ok else '**no**'
    head1 = ['design', 'predicted: scale', 'rmsnorm ‖h_K‖/‖h_1‖', 'measured', 'agrees',
             'predicted: rmsnorm ‖h_K‖', 'rmsnorm ‖h_K‖', 'measured', 'agrees',
             'predicted: raw ‖h_K‖', 'raw ‖h_K‖', 'measured', 'agrees']
    head2 = ['design', 'readout', 'seeds', 'step', 'val loss at depth 1..K', 'at 2K', 'learns']
    rows1, rows2, csv_rows = [], [], [['design', 'readout', 'seeds', 'step', 'norm_mean', 'norm_std', 'ratio_mean',
                                       'ratio_std', 'val_loss_1..K,2K', 'learns', 'prediction', 'measured', 'agrees',
                                       'power', 'power_lo', 'power_hi', 'growing']]
    for design, got in results.items():
        entry, more = DESIGNS[design], sharper(got)
        (scale, ok_s), (lvl_rms, ok_rms), (lvl_raw, ok_raw) = verdicts(design, got, unigram)
        cell = lambda r, key, d=1: fmt(got[r][key], d) if r in got else ''
        rows1.append([design, 'carried' if entry.carried else 'removed', cell('rmsnorm', 'ratio', 2), scale,
                      agree(ok_s), entry.rmsnorm, cell('rmsnorm', 'norm'), lvl_rms, agree(ok_rms),
                      entry.raw, cell('raw', 'norm'), lvl_raw, agree(ok_raw)])
        for r, want, level, ok in (('rmsnorm', entry.rmsnorm, lvl_rms, ok_rms), ('raw', entry.raw, lvl_raw, ok_raw)):
            if r not in got:
                continue
            s, g = got[r], more.get(r, {})
            rows2.append([design, r, str(s['seeds']), str(s['step']), ' '.join(f"{v:.3f}" for v in s['loss'][:-1]),
                          f"{s['loss'][-1]:.3f}", 'yes' if learns(s, unigram) else '**no**'])
            csv_rows.append([design, r, s['seeds'], s['step'], f"{s['norm'][0]:.2f}", f"{s['norm'][1]:.2f}",
                             f"{s['ratio'][0]:.3f}", f"{s['ratio'][1]:.3f}", ' '.join(f"{v:.4f}" for v in s['loss']),
                             'yes' if learns(s, unigram) else 'no', want, level, agree(ok).strip('*'),
                             *([f"{g['b']:.3f}", f"{g['spread'][0]:.3f}", f"{g['spread'][1]:.3f}",
                                'yes' if g['growing'] else 'no'] if g else ['', '', '', ''])])
    text = (f"Table 1. The state's scale per design, at the last evaluation, mean ± sample SD (ddof 1) over seeds. "
            f"Predictions (grid.DESIGNS, written before the runs): 'carried' means ‖h_K‖/‖h_1‖ > {CARRIED:g} (nothing "
            f"renormalizes the state between loops), 'large' means ‖h_K‖ > {LARGE:g}. A readout whose runs did not "
            f"learn (Table 2) carries no verdict.\n\n" + markdown(head1, rows1)
            + "\n\nWhy each prediction was made:\n\n" + '\n'.join(f"- {d}: {DESIGNS[d].why}" for d in results)
            + f"\n\nTable 2. Validation loss (nats) at exit depths 1..K and 2K, mean over seeds. The unigram loss of "
            f"the validation split (the training split's token frequencies) is {unigram:.3f} nats; a row learns if "
            f"every depth 1..K is at or below {unigram - LEARNS:.3f} (the unigram minus {LEARNS:g}).\n\n"
            + markdown(head2, rows2) + '\n\n' + table3(results, unigram, after) + '\n')
    return text, csv_rows


def table3(results, unigram, after):
    """Table 3: the sharper verdicts (see sharper), one row per design; a readout that did not learn (see learns)
    gets none, and neither do the ratio and the loss cost, which compare it with the other readout."""
    def power(g, taught):
        if not taught:
            return 'did not learn'
        if not g:
            return 'fewer than 3 evaluations'
        kind = '95% t' if g['seeds'] == 1 else f"seeds' range, {g['seeds']} seeds"
        return (f"{g['b']:+.3f} [{g['spread'][0]:+.3f}, {g['spread'][1]:+.3f}] ({kind}); "
                f"{'yes' if g['growing'] else 'no'}")

    def cost(c, i):
        if not c:
            return ''
        if c['n'] < 2:
            return f"{c['mean'][i]:+.3f} (1 seed: no interval)"
        return f"{c['mean'][i]:+.3f} [{c['lo'][i]:+.3f}, {c['hi'][i]:+.3f}]"
    head = ['design', 'rmsnorm / raw ‖h_K‖', 'rmsnorm: power b; still growing', 'raw: power b; still growing',
            'loss cost at K: rmsnorm − raw', 'at 2K']
    rows = []
    for design, got in results.items():
        m, taught = sharper(got), {r: r not in got or learns(got[r], unigram) for r in READOUTS}
        both = '' if all(taught.values()) else f"did not learn ({', '.join(r for r in READOUTS if not taught[r])})"
        ratio = fmt(m['ratio'], 1) if 'ratio' in m else ''
        powers = [power(m.get(r), taught[r]) for r in READOUTS]
        rows.append([design, both or ratio, *powers, both or cost(m.get('cost'), 0), both or cost(m.get('cost'), 1)])
    return (f"Table 3. Sharper verdicts. The ratio of ‖h_K‖ under rmsnorm to raw, seed by seed (mean ± sample SD); the "
            f"power b of ‖h_K‖ against the training step, fitted to the evaluations from step {after} on (still "
            f"growing: the interval above 0 for every seed); the blind spot's cost in validation loss, rmsnorm minus "
            f"raw at depth K and 2K, paired by seed (mean [95% t interval]; negative: rmsnorm is better). A readout "
            f"that did not learn (Table 2) carries none of these.\n\n"
            + markdown(head, rows))


def plot(groups, names, path, title):
    """fig8_atlas.png and .svg: ||h_K|| against training step (log norm axis, from step 0: the initialization), one
    panel per design that has runs, both readouts (mean over seeds, a band from the lowest to the highest seed)."""
    plt = pyplot()
    designs = list(dict.fromkeys(d for name, (d, _) in names.items() if name in groups))
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
            ax.plot(steps, norms.mean(0), color=color, ls=ls, marker='o', ms=2.5,
                    label=f"{readout} ({len(runs)} seed{'s' * (len(runs) != 1)})")
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
    p.add_argument('--init', default='paper', choices=CHOICES['init'],
                   help="the initialization of every run (looped.py's init); the runs read back must have it")
    p.add_argument('--design', action='append', choices=list(DESIGNS), metavar='DESIGN',
                   help="train and tabulate only this design of lab/grid.py's DESIGNS "
                        f"(repeatable; default: all): {', '.join(DESIGNS)}")
    p.add_argument('--after', type=int, default=250, help='fit the power of ||h_K|| from this step on (table 3)')
    train_flags(p, 'laptop', os.path.join('out', 'grid'), '--max_iters=40')
    p.add_argument('--fig_dir', default=os.path.join('out', 'figures', 'atlas'),
                   help='where the table and figure go (the committed figures/atlas changes only when named here)')
    return p


def read_results(p, groups, names, after):
    """{design: {readout: summarize(...)}} from the grouped runs; each condition's seeds at its furthest
    evaluation only, so that means never mix steps."""
    results = {}
    for name, (design, readout) in names.items():
        if name in groups:
            last = max(run['records'][-1]['step'] for run in groups[name])
            behind = [run['folder'] for run in groups[name] if run['records'][-1]['step'] < last]
            if behind:
                print(f"left out, behind the other seeds of {name}: {', '.join(behind)}")
            groups[name] = [run for run in groups[name] if run['records'][-1]['step'] == last]
            results.setdefault(design, {})[readout] = summarize(groups[name], after)
    return results


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    at_least(p, '--seeds', args.seeds, 1)
    if args.init != 'paper' and args.out_root == os.path.join('out', 'grid'):  # never reuse the paper init's folders
        args.out_root = os.path.join('out', f'atlas_{args.init}')
    extra = split_flags(p, args.train_args)
    check_destination(p, os.path.join(args.fig_dir, 'atlas.md'), '--fig_dir')  # before the runs, not after them
    grid, names = atlas_grid(args.init, args.design)
    folders = [] if args.runs else run_grid(args.config, range(1, args.seeds + 1), args.out_root, extra, grid=grid,
                                            prog=PROG)
    try:
        groups = group_runs(load_runs(args.runs, folders))
    except LogError as e:
        p.error(str(e))
    merged = {}  # a head tied or untied against the init is read as its design's rows (the title says which head)
    for name, runs in groups.items():
        for part in HEAD.values():
            name = name.removesuffix(part)
        if name in names:
            merged.setdefault(name, []).extend(runs)
    groups = merged
    if not groups:
        chosen = f" of --design={', --design='.join(args.design)}" if args.design else ''
        p.error(f"none of the runs is an atlas condition{chosen} under --init={args.init} "
                f"(grid.atlas_grid); train them with {PROG}")
    first = next(iter(groups.values()))[0]
    try:
        meta, splits, _ = read_dataset(find_dataset(first['config']['dataset']))
    except ValueError as e:
        p.error(f"the runs' dataset: {e}")
    unigram = unigram_loss(splits['train'], splits['val'], meta['vocab_size'])
    results = read_results(p, groups, names, args.after)
    text, rows = tables(results, unigram, args.after)
    write_text(os.path.join(args.fig_dir, 'atlas.md'), text)
    write_csv(os.path.join(args.fig_dir, 'atlas.csv'), rows)
    m = first['config']['model']
    title = (f"{args.config}: {m['n_layer']} layers x K={m['n_loop']}, d={m['n_embd']}, "
             f"{first['config']['max_iters']} steps, per-loop supervision, {args.init} init")
    if m.get('tie_weights', args.init != 'gpt2') != (args.init != 'gpt2'):  # a head tied or untied against its init
        title += f", head {'tied' if m['tie_weights'] else 'untied'}"
    path = plot(groups, names, os.path.join(args.fig_dir, 'fig8_atlas.png'), title)
    print(text)
    print(f"unigram loss of {first['config']['dataset']}'s validation split: {unigram:.3f} nats")
    print(f"wrote {os.path.join(args.fig_dir, 'atlas.md')}, atlas.csv, {path} and its .svg")


if __name__ == '__main__':
    run_main(main, PROG)
