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
