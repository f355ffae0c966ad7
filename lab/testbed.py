"""
A testbed where the loops could earn their keep: chained variable assignment (data/chains), whose answers
take a known number of sequential lookups. Shown first, before any blind-spot question is asked there: do the
loops help? The same stack with the raw readout at K = 4 against K = 1, on the answers.

    python -m lab.testbed --run                         # prepares the task, trains the 6 runs (one thread)
    python -m lab.testbed --fig_dir=figures/testbed     # the table and figure, from the committed logs

The task (python -m data.chains.prepare --hops=3 --chains=2 --queries=all --lengths=random, seed 1, written
to out/testbed/data by --run): each example assigns 6 letters to 2 chains of random lengths, each ending in a
digit, and then queries every letter once; an answer takes 1 to 5 lookups, and a reader that cannot follow a
chain is right half the time (2 digits). The recipe: 2 layers x 64, 4 heads, raw readout, paper init, lr 3e-3,
warmup 100 then cosine to lr / 10, 3,000 steps, batch 16 x 128, seeds 1-3. After each run its checkpoint's
answers are measured on the validation split at every exit depth 1..2K (lab/answers.py) into answers.json
beside its log; both are committed, and the table is rebuilt from them.

Why this size: the budget. A pilot (one seed each, not evidence) found no setting in a few minutes of CPU where
either K followed a chain: 1 layer x 64 for 3,000-4,000 steps and 2 layers x 64 for 3,000 steps sat at chance
on the answers, K = 4 ahead of K = 1 on the all-token loss only. The issue's rule: if no setting within the
budget shows the loops helping on the answers, say so with the runs that show it, and stop there. These are
those runs, with predictions written first; the blind-spot grid on this task is left for a setting that passes.

The predictions, families and margins below were written and committed before any of these runs.
"""

import glob
import json
import os
import subprocess
import sys

import numpy as np

from lab.cost import comparison_row, family_table, mean_sd, paired
from lab.grid import ROOT, LogError, load_runs, run_grid
from lab.report import (check_destination, fail, grid_parser, markdown, pyplot, run_main, save_figure,
                        split_flags, write_outputs, write_text)
from lab.stats import fmt_number

PROG = 'python -m lab.testbed'

MARGIN = 0.02  # nats of answer loss, and 0.02 of answer accuracy, for TOST (the lab's margin)
ALPHA = 0.05   # Holm within the family
SEEDS = (1, 2, 3)
DATA = ['--hops=3', '--chains=2', '--queries=all', '--lengths=random', '--seed=1']
RECIPE = ['--n_layer=2', '--n_embd=64', '--n_head=4', '--readout=raw', '--learning_rate=3e-3', '--warmup_iters=100',
          '--decay_lr=True', '--max_iters=3000', '--eval_interval=500', '--eval_iters=8', '--log_interval=250']


def cell(k):
    return f"chains-L2-d64-K{k} + raw"


GRID = {cell(k): [f'--n_loop={k}', *RECIPE] for k in (4, 1)}
JOBS = [(cell(k), s) for s in SEEDS for k in (4, 1)]

# ---- the predictions, written and committed before any run

FAMILIES = {'loops help': 'K = 4 - K = 1, each at its own depth K, on the validation answers, paired by seed over '
                          'seeds 1-3: the answer cross-entropy; the answer accuracy (2 comparisons)'}

# The verdict "the loops help here" rests on the answer accuracy at depth K, K = 4 - K = 1: higher (resolved),
# with K = 4's accuracy rising from depth 1 to depth K. Anything else: they do not, at this size and budget.
PREDICTIONS = {
    'answer accuracy': 'no gain: K = 4 - K = 1 between -0.03 and +0.03, not higher (neither K follows a chain in '
                       '3,000 steps)',
    'answer loss': 'lower, between -0.40 and 0: K = 4 spreads its mass over the 2 digits present better than K = 1, '
                   'without following a chain (the pilot: 0.76 against 1.13 nats at 1 layer, one query)',
    'chance': 'the answer accuracy at depth K of every run between 0.45 and 0.56 (chance is 0.50)',
    'all-token loss': 'a reading, not a test: K = 4 below K = 1 on the all-token validation loss at depth K in '
                      'every seed (the pilot saw 1.28 against 1.48 at 1 layer)',
}

# ---- the answers of a finished run, measured once and committed beside its log


def measure(folder):
    """answers.json in a finished run's folder: the answer loss and accuracy and the all-token loss at every exit
    depth 1..2K on the validation split, and the accuracy by hop count (lab/answers.py's answer_metrics)."""
    from lab import answers, diagnose
    from lab.runs import load_model
    model, ckpt = load_model(folder)
    tokens = diagnose.val_tokens(ckpt, None, os.path.join(folder, 'ckpt.pt'))
    meta = ckpt['meta']
    m = answers.answer_metrics(model, tokens, meta, by_hops=answers.hop_counts(tokens, meta))
    out = {'step': ckpt['step'], 'depths': m['depths'], 'answer_ce': m['answer_ce'].tolist(),
           'answer_acc': m['answer_acc'].tolist(), 'token_ce': m['token_ce'].tolist(),
           'n_answers': m['n_answers'], 'by_hops': {str(h): [n, acc.tolist()] for h, (n, acc) in m['by_hops'].items()}}
    write_text(os.path.join(folder, 'answers.json'), json.dumps(out, indent=1) + '\n')


def read_answers(run):
    """A run's answers.json, or LogError in one line."""
    path = os.path.join(run['folder'], 'answers.json')
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise LogError(f"{run['folder']}: no readable answers.json ({type(e).__name__}); measure it with "
                       f"{PROG} --run") from None


def by_cell(runs):
    """{cell: {seed: run}} of the finished runs, each with its answers; the others named in a note."""
    cells, notes = {}, []
    for run in runs:
        if run['records'][-1]['step'] < run['config']['max_iters']:
            notes.append(f"{os.path.basename(os.path.normpath(run['folder']))} at step {run['records'][-1]['step']}")
            continue
        run['answers'] = read_answers(run)
        cells.setdefault(cell(run['K']), {})[run['config']['seed']] = run
    return cells, notes


def at_k(key):
    """A run's value of answers.json's key at its own depth K."""
    return lambda run: run['answers'][key][run['K'] - 1]


def family(cells):
    """The family 'loops help': the answer loss, then the answer accuracy (the verdict's statistic)."""
    return [comparison_row('answer loss at depth K: K = 4 - K = 1', *paired(cells, cell(4), cell(1), at_k('answer_ce')),
                           PREDICTIONS['answer loss']),
            comparison_row('answer accuracy at depth K: K = 4 - K = 1',
                           *paired(cells, cell(4), cell(1), at_k('answer_acc')), PREDICTIONS['answer accuracy'])]


def checks(rows, cells):
    """[(prediction, 'met' | 'missed' | 'not measured yet', measured)]."""
    loss, acc = rows
    out = []
    for key, row, ok in (('answer accuracy', acc, lambda r: r['verdict'] != 'higher' and -0.03 <= r['mean'] <= 0.03),
                         ('answer loss', loss, lambda r: r['verdict'] == 'lower' and -0.40 <= r['mean'] <= 0)):
        if row['n'] < 2:
            out.append((key, 'not measured yet', ''))
            continue
        out.append((key, 'met' if ok(row) else 'missed', f"{row['verdict']}, {fmt_number(row['mean'])} "
                                                         f"[{fmt_number(row['lo'])}, {fmt_number(row['hi'])}]"))
    accs = [at_k('answer_acc')(r) for c in cells.values() for r in c.values()]
    out.append(('chance', ('met' if all(0.45 <= a <= 0.56 for a in accs) else 'missed') if accs else
                'not measured yet', ', '.join(f"{a:.3f}" for a in accs)))
    seeds, diffs = paired(cells, cell(4), cell(1), at_k('token_ce'))
    out.append(('all-token loss', 'a reading', ', '.join(f"seed {s}: {d:+.3f}" for s, d in zip(seeds, diffs))))
    return out


def depth_table(cells):
    """Each cell's answer accuracy, answer loss and all-token loss at every exit depth: mean ± SD over seeds."""
    header = ['cell', 'seeds', 'depth', 'answer accuracy', 'answer loss', 'all-token loss']
    rows = []
    for name, runs in sorted(cells.items()):
        for d in range(2 * next(iter(runs.values()))['K']):
            values = {key: [r['answers'][key][d] for r in runs.values()] for key in
                      ('answer_acc', 'answer_ce', 'token_ce')}
            rows.append([name, len(runs), d + 1, mean_sd(values['answer_acc'], '.3f'),
                         mean_sd(values['answer_ce'], '.3f'), mean_sd(values['token_ce'], '.3f')])
    return markdown(header, rows)


def hop_table(cells):
    """Each cell's answer accuracy at depth K by hop count (the lookups an answer takes): mean over seeds."""
    hops = sorted({int(h) for runs in cells.values() for r in runs.values() for h in r['answers']['by_hops']})
    header = ['cell', *[f"{h} hop{'s' * (h > 1)}" for h in hops]]
    rows = [[name, *[f"{np.mean([r['answers']['by_hops'][str(h)][1][r['K'] - 1] for r in runs.values()]):.3f}"
                     for h in hops]] for name, runs in sorted(cells.items())]
    return markdown(header, rows)


def tables(runs):
    cells, notes = by_cell(runs)
    rows = family(cells)
    table = family_table(rows, 'difference')  # Holm over the family, and each row's verdict
    found = checks(rows, cells)
    parts = ["# The testbed: do the loops help on chained assignments?",
             "The predictions, committed before any run (lab/testbed.py PREDICTIONS):\n\n"
             + '\n'.join(f"- {k}: {v}" for k, v in PREDICTIONS.items()),
             f"Margin +-{MARGIN:g} (nats of answer loss, or of accuracy); Holm within the family at {ALPHA:g}. "
             "Verdicts: equivalent within the margin where TOST passes, else lower or higher where the two-sided "
             "test passes, else not resolved (no difference shown, which is not no difference).",
             f"## Loops help? ({FAMILIES['loops help']})\n\n" + table,
             "## By exit depth (validation; mean ± SD over seeds)\n\n" + depth_table(cells),
             "## Answer accuracy at depth K by hop count\n\n" + hop_table(cells),
             "## Every prediction, checked\n\n" + '\n'.join(f"- {k}: {w}." + (f" Measured: {m}" if m else '')
                                                            for k, w, m in found),
             "![answer accuracy by exit depth](fig_answers.png)"]
    if notes:
        parts.append('Not finished (left out): ' + '; '.join(notes))
    return '\n\n'.join(parts) + '\n'


def figure(cells, path):
    """fig_answers.png: answer accuracy against exit depth, each cell's mean over seeds with each seed faint."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, runs) in enumerate(sorted(cells.items())):
        curves = np.array([r['answers']['answer_acc'] for r in runs.values()])
        depths = np.arange(1, curves.shape[1] + 1)
        for c in curves:
            ax.plot(depths, c, color=f"C{i}", alpha=0.25)
        ax.plot(depths, curves.mean(0), 'o-', color=f"C{i}", label=f"{name} ({len(curves)} seeds)")
    ax.axhline(0.5, color='grey', ls='--', lw=0.8, label='chance (2 digits)')
    ax.set(xlabel='exit depth (loops run)', ylabel='answer accuracy (validation)', ylim=(0, 1))
    ax.set_title('Chained assignment, 3 hops x 2 chains, random lengths: answers by exit depth', fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def norm_figure(cells, path):
    """fig_norms.png: ||h_k|| against exit depth k = 1..2K at the last evaluation, each cell's mean over seeds."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, runs) in enumerate(sorted(cells.items())):
        norms = np.array([r['records'][-1]['hidden_norm'] for r in runs.values()])
        ax.plot(np.arange(1, norms.shape[1] + 1), norms.mean(0), 'o-', color=f"C{i}",
                label=f"{name} ({len(norms)} seeds)")
    ax.set(xlabel='loop k (past K: extrapolated)', ylabel='||h_k|| at the last evaluation (validation)')
    ax.set_title('Chained assignment: the state\'s norm by loop', fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


# ---- the command

def get_parser():
    return grid_parser(PROG, __doc__, 'the testbed runs', 'testbed')


def prepare(folder):
    """The task's dataset in folder, written by data/chains/prepare.py (seconds; the same bytes every time)."""
    if not os.path.exists(os.path.join(folder, 'meta.json')):
        subprocess.run([sys.executable, '-m', 'data.chains.prepare', *DATA, f'--out_dir={folder}'], cwd=ROOT,
                       check=True)


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    extra = split_flags(p, args.train_args)
    check_destination(p, os.path.join(args.fig_dir, 'table.md'), '--fig_dir')
    trained = []
    if args.run:
        data = os.path.abspath(os.path.join(args.out_root, 'data'))
        prepare(data)
        trained = run_grid(args.config, None, args.out_root, [f'--dataset={data}', *extra], grid=GRID, prog=PROG,
                           finished_in=args.committed, jobs=JOBS,
                           after=lambda f: os.path.exists(os.path.join(f, 'answers.json')) or measure(f))
    try:
        runs = load_runs(args.runs or [], trained if args.runs or trained else
                         sorted(glob.glob(os.path.join(ROOT, 'figures', 'testbed', 'runs', '*'))))
        cells = by_cell(runs)[0]
    except LogError as e:
        fail(PROG, e)
    write_outputs(args.fig_dir, tables(runs), {'fig_answers.png': lambda path: figure(cells, path),
                                               'fig_norms.png': lambda path: norm_figure(cells, path)})


if __name__ == '__main__':
    run_main(main, PROG)
