"""lab/matched_depth.py: the exit curve, its reading at matched depths, and the pairing over seeds, on synthetic cases
whose answers are worked out by hand."""

import math

import numpy as np
import pytest

from lab import matched_depth as md
from lab.stats import paired_stats


def test_exit_curve_sweeps_every_threshold_in_order():
    # three windows, K = 3; window scores at loops 1, 2 (loop 3 always exits)
    score = np.array([[0.9, 0.95, 0], [0.2, 0.8, 0], [0.1, 0.3, 0]])
    ce = np.array([[1.0, 0.5, 0.4], [3.0, 2.0, 1.0], [4.0, 3.0, 2.0]])
    depths, losses = md.exit_curve(ce, score, 3)
    # thresholds 0.1, 0.2, 0.3, 0.8, 0.9, 0.95, inf: exits (1,1,1) (1,1,2) (1,2,2) (1,2,3) (1,3,3) (2,3,3) (3,3,3)
    np.testing.assert_allclose(depths, [1, 4 / 3, 5 / 3, 2, 7 / 3, 8 / 3, 3])
    np.testing.assert_allclose(losses, [8 / 3, 7 / 3, 6 / 3, 5 / 3, 4 / 3, 3.5 / 3, 3.4 / 3])


def test_read_at_interpolates_between_neighbouring_thresholds_and_never_extrapolates():
    depths, losses = np.array([1, 4 / 3, 5 / 3, 2, 2, 8 / 3, 3]), np.array([8, 7, 6, 5, 5, 3.5, 3.4]) / 3
    got = md.read_at(depths, losses, np.array([1, 1.5, 2, 2.5, 3]))
    # 1.5 is halfway between 4/3 and 5/3: the mixture of those two thresholds, loss halfway between 7/3 and 6/3
    np.testing.assert_allclose(got, [8 / 3, 6.5 / 3, 5 / 3, (5 + 0.75 * (3.5 - 5)) / 3, 3.4 / 3])
    part = md.read_at(np.array([1.4, 2.2]), np.array([2.0, 1.0]), np.array([1, 1.5, 2, 2.5]))
    assert math.isnan(part[0]) and math.isnan(part[3]) and part[1] == pytest.approx(1.875)


def fake_run(folder, condition, seed, readout, config='laptop_long', learning_rate=3e-3):
    cfg = {'seed': seed, 'config': config, 'dataset': 'shakespeare_char', 'learning_rate': learning_rate,
           'model': {'readout': readout, 'supervision': 'per_loop', 'n_loop': 3, 'norm_penalty': 0.0,
                     'recurrence': 'residual', 'init': 'paper', 'alpha': None, 'n_embd': 64}}
    cfg.update({k: cfg['model'][k] for k in ('readout', 'supervision', 'norm_penalty', 'recurrence', 'init', 'alpha')})
    return {'folder': folder, 'name': condition, 'config': cfg, 'K': 3,
            'records': [{'step': 100, 'val_loss': [0.0] * 6}]}


def test_pairs_are_compared_seed_by_seed_at_each_depth():
    from lab.grid import group_runs
    from lab.stats import pair_up
    runs = [fake_run(f"r{s}", 'per_loop + rmsnorm', s, 'rmsnorm') for s in (1, 2, 3)]
    runs += [fake_run(f"x{s}", 'per_loop + raw', s, 'raw') for s in (3, 1, 2)]  # another order: pairing is by seed
    gap = {1: 0.19, 2: 0.22, 3: 0.20}
    curves = {}
    for s in (1, 2, 3):
        base = np.array([3.0, 2.5, 2.2, 2.1, 2.0]) + s  # the seed moves both conditions alike: pairing removes it
        curves[f"r{s}"] = {score: base for score in md.diagnose.SCORES}
        raw = base + gap[s]
        raw[-1] = np.nan if s == 2 else raw[-1]  # one pair's raw curve does not reach depth 3
        curves[f"x{s}"] = {score: raw for score in md.diagnose.SCORES}
    rows = md.matched_rows(pair_up(group_runs(runs), 'per_loop + rmsnorm'), curves, 'per_loop + rmsnorm')
    assert [r['score'] for r in rows] == list(md.diagnose.SCORES) and all(r['pairs'] == 3 for r in rows)
    want = paired_stats([0.19, 0.22, 0.20])
    for s in rows[0]['stats'][:4]:
        assert s["mean"] == pytest.approx(0.61 / 3) and s['se'] == pytest.approx(want['se'])
        assert s['lo'] == pytest.approx(want['lo']) and s['hi'] == pytest.approx(want['hi'])
    assert rows[0]['stats'][4] is None  # not reached by every pair: no value, and the table says so
    assert md.cell(rows[0]['stats'][4], 'per_loop + rmsnorm') == 'not reached'
    assert md.cell(rows[0]['stats'][0], 'per_loop + rmsnorm').endswith(' higher')


def test_each_configuration_names_its_conditions_plainly():
    from lab.grid import group_runs
    from lab.stats import pair_up
    runs = [fake_run(f"{c}/{r}{s}", f"per_loop + {r}", s, r, config=c, learning_rate=lr)
            for c, lr in (('laptop_long', 3e-3), ('laptop_deep', 1e-3)) for r in ('rmsnorm', 'raw') for s in (1, 2)]
    curves = {run['folder']: {score: np.zeros(5) for score in md.diagnose.SCORES} for run in runs}
    rows = md.matched_rows(pair_up(group_runs(runs), 'per_loop + rmsnorm'), curves, 'per_loop + rmsnorm')
    # the configuration column tells the two raw rows apart; no folder name is glued to the condition
    assert sorted({(r['config'], r['condition']) for r in rows}) == [('laptop_deep', 'per_loop + raw'),
                                                                     ('laptop_long', 'per_loop + raw')]
    assert all(r['pairs'] == 2 and r['seeds'] == [1, 2] for r in rows)


def test_the_command_writes_table_and_figure_from_run_folders(small_data, tmp_path, capsys):
    import train
    tiny = ['--dataset', small_data, '--n_layer=1', '--n_embd=32', '--n_head=2', '--n_loop=2', '--block_size=16',
            '--batch_size=4', '--eval_iters=2', '--max_iters=2', '--eval_interval=2', '--device=cpu', '--compile=False']
    for seed in (1, 2):
        for readout in ('rmsnorm', 'raw'):
            train.main(tiny + [f'--readout={readout}', f'--seed={seed}', f'--out_dir={tmp_path}/runs/{readout}-{seed}'])
    out = tmp_path / 'new' / 'figs'  # folders that do not exist yet
    md.main([str(tmp_path / 'runs' / '*'), f'--fig_dir={out}', '--max_windows=8', '--device=cpu'])
    table = (out / 'matched_depth.md').read_text()
    rows = [line for line in table.splitlines() if line.startswith('| ') and 'per_loop + raw' in line]
    n = len(md.diagnose.SCORES) + 1  # and kl, which matched depth reads beside the timed scores
    assert len(rows) == n and all('| 2 | 1 2 |' in r for r in rows)  # a row per score, two pairs, seeds 1 and 2
    assert len(rows[0].split('|')) - 2 == 5 + 3  # depths 1, 1.5, 2 for K = 2
    csv = (out / 'matched_depth.csv').read_text().splitlines()
    assert len(csv) == 1 + n * 3 and csv[1].startswith('laptop,per_loop + raw,max_prob,2,1,')
    assert (out / 'fig7_matched_depth.png').stat().st_size > 10_000
    with pytest.raises(SystemExit, match='no such condition'):
        md.main([str(tmp_path / 'runs' / 'raw-*'), f'--fig_dir={out}'])
    with pytest.raises(SystemExit, match=r'nothing-\*: matches no folder$'):
        md.main([str(tmp_path / 'runs' / '*'), str(tmp_path / 'nothing-*'), f'--fig_dir={out}'])


def test_against_pairs_each_score_with_another_within_every_run(tmp_path):
    """--against: per condition, every other score minus the against score in the same run, over its seeds."""
    runs = [{'folder': f'f{s}', 'K': 2, 'name': 'per_loop + raw', 'config': {'seed': s, 'config': 'laptop'}}
            for s in (1, 2, 3)]
    grid = md.depth_grid(2)
    curves = {f"f{s}": {score: np.full(len(grid), 1.0) for score in md.diagnose.SCORES} for s in (1, 2, 3)}
    for s, gap in zip((1, 2, 3), (0.19, 0.2, 0.21)):
        curves[f"f{s}"]['latent'] = curves[f"f{s}"]['max_prob'] + gap  # latent worse by about 0.2 nats
    rows = md.score_rows({'per_loop + raw': runs}, curves, 'max_prob')
    assert [r['score'] for r in rows] == [f"{s} - max_prob" for s in md.diagnose.SCORES if s != 'max_prob']
    latent = next(r for r in rows if r['score'] == 'latent - max_prob')
    assert latent['pairs'] == 3 and latent['seeds'] == [1, 2, 3]
    assert all(s['mean'] == pytest.approx(0.2) and s['lo'] > 0 for s in latent['stats'])
    margin = next(r for r in rows if r['score'] == 'margin - max_prob')
    assert all(s['mean'] == 0 for s in margin['stats'])
