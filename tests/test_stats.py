"""lab/stats.py: the paired statistics on hand-built logs with known seed-by-seed differences, the t quantiles
against the printed table, and what lab/paper.py writes from them (paired.csv, table.md's second table)."""

from dataclasses import asdict
import csv
import json
import math

import pytest

from lab import paper, stats
from lab.designs import DesignConfig


def fake_run(root, folder, seed, losses, readout='rmsnorm', n_embd=64, steps=(100, 200), max_iters=200):
    """A run folder whose log holds given validation losses (one list over depths 1..2K per step), so the paired
    statistics have an answer computed by hand."""
    model = {**asdict(DesignConfig(n_layer=2, n_embd=n_embd, n_loop=len(losses[0]) // 2, readout=readout))}
    config = {'seed': seed, 'max_iters': max_iters, 'dataset': 'shakespeare_char', 'out_dir': folder,
              'n_embd': n_embd, 'model': model, **{k: model[k] for k in stats.CONDITION_KEYS}}
    path = root / folder
    path.mkdir()
    records = [{'step': s, 'train_loss': loss[0], 'val_loss': loss, 'hidden_norm': [10.0] * len(loss),
                'elapsed_s': 1.0} for s, loss in zip(steps, losses)]
    (path / 'log.jsonl').write_text('\n'.join(json.dumps(line) for line in [{'config': config}, *records]) + '\n')
    return str(path)


def test_t_quantiles_match_the_printed_table():
    # two-sided 95% values of Student's t, as printed in every statistics table
    for df, t in [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042), (10_000, 1.960)]:
        assert stats.t_quantile(0.975, df) == pytest.approx(t, abs=5e-4), df
    assert stats.t_quantile(0.025, 4) == pytest.approx(-2.7764, abs=1e-4)


def test_paired_differences_match_a_hand_computation(tmp_path):
    """Five seeds; 'raw' is the reference plus known differences, listed in another seed order than the reference
    (pairing by position would get another answer), beside a seed still training and a run of another width."""
    root = tmp_path / 'runs'
    root.mkdir()
    base = {1: 2.00, 2: 2.30, 3: 1.90, 4: 2.10, 5: 2.50}  # the reference's loss at depth K = 1, per seed
    diff = {1: -0.10, 2: -0.12, 3: -0.08, 4: -0.11, 5: -0.09}  # raw minus reference at depth K
    far = {1: 0.05, 2: -0.05, 3: 0.02, 4: -0.02, 5: 0.00}  # at depth 2K = 2: mean 0, so no difference shown
    for seed in base:
        fake_run(root, f'rms-seed{seed}', seed, [[3.0, 3.0], [base[seed], 2.0]])
    for seed in (5, 3, 1, 4, 2):
        fake_run(root, f'raw-seed{seed}', seed, [[3.0, 3.0], [base[seed] + diff[seed], 2.0 + far[seed]]], readout='raw')
    fake_run(root, 'raw-seed6', 6, [[3.0, 3.0]], readout='raw', steps=(100,))  # still training: no partner either
    fake_run(root, 'rms-seed6', 6, [[3.0, 3.0], [2.0, 2.0]])
    fake_run(root, 'wide-raw-seed1', 1, [[3.0, 3.0], [1.0, 1.0]], readout='raw', n_embd=128)  # no rms of its width

    figs = tmp_path / 'figs'
    paper.main([str(root / '*'), '--fig_dir', str(figs), '--exit_windows=0', '--reference=per_loop-rmsnorm'])
    mean, sd = -0.10, (sum((d + 0.10) ** 2 for d in diff.values()) / 4) ** 0.5  # sample std, n - 1 = 4
    se = sd / 5 ** 0.5
    lo, hi = mean - 2.7764 * se, mean + 2.7764 * se  # t_{0.975, 4}
    assert se == pytest.approx(0.0070711, abs=1e-7) and hi < 0
    rows = {(r[0], r[2]): r for r in (line.split(',') for line in (figs / 'paired.csv').read_text().splitlines()[1:])}
    k, k2 = rows[('per_loop + raw', '1')], rows[('per_loop + raw', '2')]
    assert int(k[4]) == 5 and k[5] == '1 2 3 4 5' and k[6] == '200' and k[11] == '4'
    for got, want in zip(map(float, k[7:11]), (mean, se, lo, hi)):
        assert got == pytest.approx(want, abs=2e-5)
    assert k[13] == 'lower than per_loop + rmsnorm'
    assert float(k2[7]) == pytest.approx(0, abs=1e-9) and float(k2[9]) < 0 < float(k2[10])
    assert k2[13] == 'no difference shown'

    md = (figs / 'table.md').read_text()
    assert 't interval over seeds with n-1 degrees of freedom' in md
    paired_md = md.split('Paired differences to per_loop + rmsnorm')[1]
    row = next(line for line in paired_md.splitlines() if line.startswith('| per_loop + raw |'))
    assert f"[{lo:+.4f}, {hi:+.4f}]" in row and '| lower than per_loop + rmsnorm |' in row
    # the seed still training and the wider run are left out, and the table says why
    assert 'seed 6:' in md and 'raw-seed6 at step 100 of 200' in md and 'compared at step 200' in md
    assert 'no per_loop + rmsnorm run of seed 1 with the same settings as' in md and 'wide-raw-seed1' in md
    # the first table and the figures average the seeds that got furthest, and say which run is behind
    table = list(csv.reader(open(figs / 'table.csv')))
    assert next(r for r in table if r[0] == 'per_loop + raw')[1:3] == ['5', '200']
    assert 'Left out of this table and the figures' in md.split('Paired differences')[0]
    assert (figs / 'fig6_crossover.png').stat().st_size > 0


def test_paired_stats_below_two_pairs_give_no_interval():
    result = stats.paired_stats([[0.3, -0.1]])
    assert list(result['mean']) == [0.3, -0.1] and all(map(math.isnan, result['lo']))
    assert stats.verdict(result['lo'][0], result['hi'][0], 'x') == 'no interval (fewer than 2 pairs)'
    assert stats.verdict(0.1, 0.2, 'x') == 'higher than x'
    assert stats.verdict(-0.1, 0.2, 'x') == 'no difference shown'


def test_holm_adjusts_a_family_as_computed_by_hand():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> raised to 0.06 (monotone)
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.2, 0.9]) == pytest.approx([0.4, 0.9])  # capped at 1 only above it
    assert stats.holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])
    adjusted = stats.holm([0.01, math.nan, 0.02])  # an untested comparison still counts in m: 3, then 2
    assert adjusted[0] == pytest.approx(0.03) and math.isnan(adjusted[1]) and adjusted[2] == pytest.approx(0.04)


def test_tost_and_the_two_sided_p_match_the_t_distribution_by_hand():
    # df = 2 has a closed form: P(T > t) = (1 - t / sqrt(t^2 + 2)) / 2
    tail = lambda t: (1 - t / math.sqrt(t * t + 2)) / 2
    d = [0.001, -0.003, 0.002]  # mean 0, sd sqrt(7e-6), se sd / sqrt(3)
    se = math.sqrt(7e-6 / 3)
    test = stats.paired_test(d, 0.02)
    assert test['sd'] == pytest.approx(math.sqrt(7e-6)) and test['p'] == pytest.approx(1.0)
    assert test['p_tost'] == pytest.approx(tail(0.02 / se), rel=1e-4)
    d = [0.10, 0.12, 0.11]  # mean 0.11, sd 0.01
    test = stats.paired_test(d, 0.02)
    t = 0.11 / (0.01 / math.sqrt(3))
    assert test['sd'] == pytest.approx(0.01) and test['p'] == pytest.approx(2 * tail(t), rel=1e-4)
    assert test['p_tost'] == pytest.approx(1 - tail((0.11 - 0.02) / (0.01 / math.sqrt(3))), rel=1e-4)
    assert (test['lo'], test['hi']) == pytest.approx((0.11 - 4.303 * 0.01 / math.sqrt(3),
                                                      0.11 + 4.303 * 0.01 / math.sqrt(3)), abs=1e-4)


def test_family_verdicts_use_the_one_vocabulary_after_holm():
    tests = [stats.paired_test(d, 0.02) for d in ([0.10, 0.12, 0.11], [-0.10, -0.12, -0.11],
                                                   [0.001, -0.003, 0.002], [0.05, -0.08, 0.2])]
    verdicts = [t['verdict'] for t in stats.family_verdicts(tests, 0.02)]
    assert verdicts == ['higher', 'lower', 'equivalent within +-0.02', 'not resolved']
    # alone, p = 0.0027 would pass; among 40 such tests Holm multiplies it past 0.05
    family = stats.family_verdicts([stats.paired_test([0.10, 0.12, 0.11], 0.02) for _ in range(40)], 0.02)
    assert {t['verdict'] for t in family} == {'not resolved'}
    assert family[0]['p_holm'] == pytest.approx(min(1, 40 * family[0]['p']))


def test_a_table_number_is_rounded_once():
    # 0.037543 rounded to 4 digits first would be 0.0375 and then print +0.037: once, it is +0.038
    assert stats.fmt_number(0.037543) == '+0.038' and stats.fmt_number(-0.01447) == '-0.014'
    assert stats.fmt_number(-0.0004) == '+0.000' and stats.fmt_number(math.nan) == 'n/a'
    assert stats.fmt_number(0.04271, '.4f') == '0.0427'
