"""lab/norm_course.py: the power-law fit of ||h_K|| against step, and the command on tiny runs."""

import csv
import json
import math
import os

import numpy as np
import pytest

from lab import norm_course
import train

TINY = ['--n_layer=1', '--n_embd=16', '--n_head=2', '--n_loop=2', '--block_size=16', '--batch_size=2',
        '--eval_iters=1', '--log_interval=4']


def test_the_fit_recovers_a_known_power_and_its_extrapolation():
    steps = np.arange(100, 10001, 100)
    rng = np.random.default_rng(0)
    norms = 3.0 * steps ** 0.4 * np.exp(rng.normal(0, 0.01, len(steps)))
    f = norm_course.fit(steps, norms, after=1000)
    assert f['n'] == 91 and f['lo'] < 0.4 < f['hi'] and f['hi'] - f['lo'] < 0.01
    value, lo, hi = f['predict'](1e6)
    assert lo < 3.0 * 1e6 ** 0.4 < hi and lo < value < hi
    # steps before --after are left out: a jump there does not move the fit
    jumped = norms.copy()
    jumped[steps < 1000] *= 50
    assert norm_course.fit(steps, jumped, after=1000)['b'] == pytest.approx(f['b'])
    assert norm_course.fit(steps[:2], norms[:2], after=1) is None


def test_the_paper_token_count_is_four_epochs_of_its_windows():
    assert norm_course.PAPER_TOKENS == pytest.approx(800e6, rel=1e-3)  # 4 epochs x 2 windows per token x 100M
    assert norm_course.PAPER_RMS == pytest.approx(1723.6, abs=0.1)


def test_the_command_fits_and_draws_runs_it_is_given(small_data, tmp_path, capsys):
    for readout in ('rmsnorm', 'raw'):
        train.main(['--dataset', small_data, '--out_dir', str(tmp_path / readout), *TINY, '--max_iters=8',
                    '--eval_interval=2', f'--readout={readout}'])
    figs = tmp_path / 'figs'
    norm_course.main([str(tmp_path / 'rmsnorm'), str(tmp_path / 'raw'), '--after=2', '--fig_dir', str(figs)])
    text = (figs / 'course.md').read_text()
    assert '| rmsnorm |' in text and '| raw |' in text and os.path.getsize(figs / 'fig9_norm_course.png') > 10_000
    rows = list(csv.DictReader(open(figs / 'course.csv')))
    assert [r['run'] for r in rows] == ['rmsnorm', 'raw'] and all(math.isfinite(float(r['b'])) for r in rows)
    # the loss column is the last evaluation's at depth K (2 loops here), not at 2K, from the run's own log
    last = [r for r in map(json.loads, open(tmp_path / 'raw' / 'log.jsonl')) if 'val_loss' in r][-1]
    assert float(rows[1]['val_loss']) == pytest.approx(last['val_loss'][1], abs=1e-4) and rows[1]['init'] == 'paper'
    with pytest.raises(SystemExit) as e:
        norm_course.main([])
    assert 'name run folders to fit' in str(e.value.code)


def fake_run(label, norms, steps, n_embd=512, batch_size=64, block_size=256, seed=1):
    """A run as grid.load_run returns it, with only what norm_course reads."""
    records = [{'step': s, 'hidden_norm': [1.0, v], 'val_loss': [2.0, 1.5, 1.7]} for s, v in zip(steps, norms)]
    return {'folder': f'out/{label}-seed{seed}', 'K': 2, 'records': records,
            'config': {'batch_size': batch_size, 'grad_accum': None, 'learning_rate': 3e-4, 'warmup_iters': 0,
                       'seed': seed,
                       'model': {'n_embd': n_embd, 'block_size': block_size, 'init': 'paper'}}}


def test_the_extrapolated_step_and_rms_at_the_papers_width_by_hand():
    # an exact power law 10 * step^0.5 at the paper's own shape (d = 512, batch 64 x 256 tokens): the paper's step
    # is PAPER_TOKENS / 16,384 and the RMS there is 10 * step^0.5 / sqrt(512)
    steps = [1000, 2000, 4000, 8000]
    row, = norm_course.rows_of([fake_run('x', [10 * s ** 0.5 for s in steps], steps)], after=1000)
    assert row['paper_step'] == pytest.approx(norm_course.PAPER_TOKENS / (64 * 256))
    assert row['fit']['b'] == pytest.approx(0.5)
    assert row['paper_rms'][0] == pytest.approx(10 * row['paper_step'] ** 0.5 / math.sqrt(512), rel=1e-9)
    assert row['peak_early'] != row['peak_early'] and row['last'] == pytest.approx(10 * 8000 ** 0.5)  # no step <= 500
    half, = norm_course.rows_of([fake_run('x', [10 * s ** 0.5 for s in steps], steps, batch_size=32)], after=1000)
    assert half['paper_step'] == pytest.approx(2 * row['paper_step'])  # half the tokens a step: twice the steps


def test_the_power_across_seeds_by_hand():
    steps = [1000, 2000, 4000]
    runs = [fake_run('a', [s ** b for s in steps], steps, seed=seed) for seed, b in ((1, 0.2), (2, 0.4), (3, 0.3))]
    runs.append(fake_run('lone', [s ** 0.1 for s in steps], steps))
    spread = norm_course.seed_spread(norm_course.rows_of(runs, after=1000), after=1000)
    assert len(spread) == 1
    label, n, mean, lo, hi, ranges, test = spread[0]
    assert (label, n, ranges) == ('a', 3, '1000-4000')
    assert (mean, lo, hi) == pytest.approx((0.3, 0.2, 0.4))
    # by hand: SD 0.1, se 0.1 / sqrt(3), t = 5.196 on 2 df: two-sided p 0.0351; t quantile 4.303: +-0.248
    assert test['sd'] == pytest.approx(0.1) and test['p_holm'] == pytest.approx(0.0351, abs=1e-4)
    assert (test['lo'], test['hi']) == pytest.approx((0.0516, 0.5484), abs=1e-4) and test['verdict'] == 'higher'
    text, _ = norm_course.table(norm_course.rows_of(runs, after=1000), 1000)
    assert '| a | 3 | +0.300 | +0.200 | +0.400 | 0.100 | [+0.052, +0.548] | 0.0351 | higher | 1000-4000 |' in text


def test_the_power_across_seeds_is_fitted_over_the_steps_every_seed_reached():
    # seed 1 ran twice as long and bends after step 4,000 (its own fit from 1,000 is not 0.2); seeds 2 and 3 stop
    # at 4,000: the spread compares all three over 1,000-4,000, where seed 1's power is exactly 0.2
    long_steps, steps = [1000, 2000, 4000, 8000, 16000], [1000, 2000, 4000]
    bent = [s ** 0.2 for s in steps] + [4000 ** 0.2, 4000 ** 0.2 / 2]
    runs = [fake_run('a', bent, long_steps, seed=1)]
    runs += [fake_run('a', [s ** b for s in steps], steps, seed=seed) for seed, b in ((2, 0.4), (3, 0.3))]
    rows = norm_course.rows_of(runs, after=1000)
    assert rows[0]['fit']['b'] < 0.1  # its own fit over 1,000-16,000
    (label, n, mean, lo, hi, ranges, _), = norm_course.seed_spread(rows, after=1000)
    assert (label, n, ranges) == ('a', 3, '1000-4000')
    assert (mean, lo, hi) == pytest.approx((0.3, 0.2, 0.4))

