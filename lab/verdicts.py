"""
Every earlier loss verdict restated with one set of statistics: paired t over seeds, Holm's correction within each
family, TOST at the margin of lab/cost.py (0.02 nats), and one vocabulary (lower / higher / equivalent within
+-0.02 / not resolved). Read-only: from the run logs committed under figures/ and, where a table's runs were
never committed, from that table's committed paired.csv (its mean, standard error and degrees of freedom).

    python -m lab.verdicts --fig_dir=figures/verdicts

Families: each is one question asked of several comparisons at once, so Holm's correction runs over it:
  atlas_gpt2      rmsnorm - raw at depth K, per design (16), the gpt2-init atlas, 3 seeds
  past_K          (loss at 2K - loss at K) under rmsnorm minus the same under raw, per design (16), same runs
  gate            gated - per-loop supervision at depth K, per readout and gate (3), 3 seeds
  gate_norm       ||h_K|| of gated - per-loop, the same pairs (3); in norm units, so no equivalence margin
  claim4          each condition - rmsnorm at every depth 1..2K, laptop_long, 8 seeds (paired.csv)
  laptop_deep     raw - rmsnorm at every depth 1..2K, 4 layers at lr 1e-3, 5 seeds (paired.csv)
  matched_*       each rule's difference at matched mean depth (matched_depth.csv)
"""

import math
import os
from collections import defaultdict

from lab.cost import ALPHA, MARGIN, last
from lab.grid import LogError, load_runs
from lab.report import check_destination, fail, markdown, run_main, tool_parser, write_text
from lab.stats import family_verdicts, fmt_number, holm, paired_test, summary_p

PROG = 'python -m lab.verdicts'
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def figures(*parts):
    return os.path.join(ROOT, 'figures', *parts)


def readout_pairs(runs, value):
    """{design: (seeds, [value(rmsnorm run) - value(raw run)])}, a run's design being its folder's name with its
    readout and seed taken out ('per_loop-add'), paired by seed."""
    by = defaultdict(dict)
    for run in runs:
        readout = run['config']['model']['readout']
        name = os.path.basename(os.path.normpath(run['folder'])).rsplit('-seed', 1)[0]
        by[name.replace(f'-{readout}', '', 1)][readout, run['config']['seed']] = run
    out = {}
    for design, found in by.items():
        seeds = sorted(s for r, s in found if r == 'rmsnorm' and ('raw', s) in found)
        out[design] = seeds, [value(found['rmsnorm', s]) - value(found['raw', s]) for s in seeds]
    return out


def from_log_pairs(pairs, margin=MARGIN):
    rows = []
    for label, (seeds, diffs) in pairs.items():
        test = paired_test(diffs, margin if margin else 0.0)
        rows.append({'label': label, 'seeds': ' '.join(map(str, seeds)), **test})
    return rows


def from_csv(path, label_of, margin=MARGIN):
    """Rows of a committed paired.csv or matched_depth.csv: mean, SE and df give p and TOST's p."""
    import csv
    with open(path, newline='') as f:
        rows = []
        for r in csv.DictReader(f):
            mean = float(r.get('mean_diff') or r['diff'])
            se, df = float(r['se']), int(r['df'])
            p, p_tost = summary_p(mean, se, df, margin)
            rows.append({'label': label_of(r), 'seeds': r['pairs'], 'mean': mean, 'sd': se * math.sqrt(df + 1),
                         'lo': float(r['lo']), 'hi': float(r['hi']), 'p': p, 'p_tost': p_tost, 'n': df + 1})
    return rows


def table(rows, what, margin=MARGIN):
    """Holm over the family (TOST only with a margin), then its markdown table."""
    if margin:
        family_verdicts(rows, margin, ALPHA)
    else:  # norms: no margin in their units, so only lower / higher / not resolved
        for row, p in zip(rows, holm([r['p'] for r in rows])):
            row['p_holm'], row['p_tost_holm'] = p, math.nan
            row['verdict'] = ('lower' if row['mean'] < 0 else 'higher') if p < ALPHA else 'not resolved'
    header = ['comparison', 'pairs', f'{what}: mean', 'SD (ddof 1)', '95% t interval', 'p (Holm)',
              'TOST p (Holm)', 'verdict']
    return markdown(header, [[r['label'], r['seeds'], fmt_number(r['mean']), fmt_number(r['sd'], '.3f'),
                              f"[{fmt_number(r['lo'])}, {fmt_number(r['hi'])}]", fmt_number(r['p_holm'], '.4f'),
                              fmt_number(r['p_tost_holm'], '.4f'), r['verdict']] for r in rows])


def families():
    """[(family, its question, its table)] in the page's order."""
    out = []
    atlas = load_runs([figures('atlas_gpt2', 'runs', '*')])
    K = lambda run: last(run)['val_loss'][run['K'] - 1]
    past = lambda run: last(run)['val_loss'][-1] - K(run)
    out.append(('atlas_gpt2', 'Does rmsnorm cost loss against raw, design by design? (gpt2 init, 1,000 steps)',
                table(from_log_pairs(readout_pairs(atlas, K)), 'rmsnorm - raw at K')))
    out.append(('past_K', 'Does rmsnorm extrapolate past K worse than raw? (the same runs)',
                table(from_log_pairs(readout_pairs(atlas, past)), '(L_2K - L_K), rmsnorm - raw')))
    gate = load_runs([figures('gate', 'runs', '*')])
    by = {(os.path.basename(r['folder']).rsplit('-seed', 1)[0], r['config']['seed']): r for r in gate}
    pairs_loss, pairs_norm = {}, {}
    for gated, plain in (('gated-rmsnorm', 'per_loop-rmsnorm'), ('gated-raw', 'per_loop-raw'),
                         ('gated-rmsnorm-gate_readout', 'per_loop-rmsnorm')):
        seeds = sorted(s for n, s in by if n == gated and (plain, s) in by)
        pairs_loss[f"{gated} - {plain}"] = seeds, [K(by[gated, s]) - K(by[plain, s]) for s in seeds]
        norm = lambda run: last(run)['hidden_norm'][run['K'] - 1]
        pairs_norm[f"{gated} - {plain}"] = seeds, [norm(by[gated, s]) - norm(by[plain, s]) for s in seeds]
    out.append(('gate', 'Does gated supervision change the loss at K? (gpt2 init)',
                table(from_log_pairs(pairs_loss), 'gated - per-loop at K')))
    out.append(('gate_norm', 'Does it change ||h_K||? (no margin: norm units)',
                table(from_log_pairs(pairs_norm, margin=0), 'gated - per-loop ||h_K||', margin=0)))
    depth = lambda r: (f"{r['condition']} - {r['reference']} at depth {r['depth']}"
                       + (' (K)' if r['is_K'] == 'True' else ''))
    out.append(('claim4', 'Claim 4: does scale control win with longer training? (laptop_long, 2,000 steps)',
                table(from_csv(figures('laptop_long_paired', 'paired.csv'), depth), 'condition - rmsnorm')))
    out.append(('laptop_deep', 'A deeper stack at a lower rate (4 layers, lr 1e-3, 1,500 steps)',
                table(from_csv(figures('laptop_deep', 'paired.csv'), depth), 'raw - rmsnorm')))
    matched = lambda r: f"{r['configuration']}: {r['condition']}, {r['score']} at mean depth {r['depth']}"
    for name in ('matched_depth', 'atlas/exit', 'gate/exit_against', 'gate/exit_rmsnorm', 'gate/exit_raw'):
        out.append((f"matched: {name}", f'At matched mean depth ({name}/matched_depth.csv)',
                    table(from_csv(figures(*name.split('/'), 'matched_depth.csv'), matched), 'difference')))
    return out


def get_parser():
    p = tool_parser(PROG, __doc__)
    p.add_argument('--fig_dir', default=os.path.join('out', 'verdicts'),
                   help='where verdicts.md goes (the committed figures/verdicts changes only when named here)')
    return p


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    check_destination(p, os.path.join(args.fig_dir, 'verdicts.md'), '--fig_dir')
    try:
        parts = families()
    except (LogError, OSError, KeyError, ValueError) as e:
        fail(PROG, e)
    text = (f"# Every loss verdict, restated\n\nPaired t over seeds; Holm's correction within each family at "
            f"{ALPHA:g}; TOST at +-{MARGIN:g} nats; SD is the sample SD (ddof 1) of the paired differences "
            "(from a paired.csv: SE x sqrt(n)). Verdicts: equivalent within the margin where TOST passes, else "
            "lower or higher where the two-sided test passes, else not resolved (no difference shown, which is "
            "not no difference).\n\n"
            + '\n\n'.join(f"## {name}: {question}\n\n{body}" for name, question, body in parts) + '\n')
    write_text(os.path.join(args.fig_dir, 'verdicts.md'), text)
    print(text + f"wrote {os.path.join(args.fig_dir, 'verdicts.md')}")


if __name__ == '__main__':
    run_main(main, PROG)
