"""lab/atlas.py: the designs' table (each prediction beside its measurement) and figure, from run folders."""

import os

import pytest

from lab import atlas
from lab import grid
import train

TINY = ['--n_layer=1', '--n_embd=16', '--n_head=2', '--n_loop=2', '--block_size=16', '--batch_size=2',
        '--eval_iters=1', '--log_interval=4', '--max_iters=4', '--eval_interval=2']


def summary(norm, ratio):
    return {'norm': (norm, 0.0), 'ratio': (ratio, 0.0), 'loss': [2.0, 1.9, 2.1], 'K': 2, 'seeds': 1, 'step': 200}


def test_a_measurement_against_the_prediction_says_yes_or_no():
    # residual is predicted carried, large under rmsnorm, small under raw
    assert [ok for _, ok in atlas.verdicts('residual', {'rmsnorm': summary(900, 2.0), 'raw': summary(8, 1.2)})] == \
        [True, True, True]
    words = atlas.verdicts('residual', {'rmsnorm': summary(50, 1.1), 'raw': summary(300, 3.0)})
    assert words == [('removed', False), ('small', False), ('large', False)]
    text, rows = atlas.tables({'residual': {'rmsnorm': summary(50, 1.1)}})
    assert '| residual | carried | 1.10 ± 0.00 | removed | **no** | large | 50.0 ± 0.0 | small | **no** |' in text
    assert 'not run' in text and len(rows) == 2  # the raw run is missing, and said to be


def test_every_design_has_a_prediction_and_both_readouts():
    assert set(grid.PREDICTIONS) == set(grid.DESIGNS)
    assert sorted(grid.ATLAS_DESIGN.values()) == sorted((d, r) for d in grid.DESIGNS for r in grid.ATLAS_READOUTS)


def test_the_command_writes_table_and_figure_from_run_folders(small_data, tmp_path, capsys):
    for flags in (['--readout=rmsnorm'], ['--readout=raw'], ['--readout=raw', '--block=sandwich'],
                  ['--readout=raw', '--supervision=terminal']):  # the last is no atlas condition: left out
        train.main(['--dataset', small_data, '--out_dir', str(tmp_path / 'runs' / '-'.join(flags)), *TINY, *flags])
    figs = tmp_path / 'new' / 'figs'
    atlas.main([str(tmp_path / 'runs' / '*'), '--fig_dir', str(figs)])
    text = (figs / 'atlas.md').read_text()
    assert '| residual | carried |' in text and '| sandwich | removed |' in text and 'terminal' not in text
    assert os.path.getsize(figs / 'fig8_atlas.png') > 10_000 and os.path.getsize(figs / 'fig8_atlas.svg') > 1000
    assert len((figs / 'atlas.csv').read_text().splitlines()) == 1 + 3
    with pytest.raises(SystemExit) as e:
        atlas.main([str(tmp_path / 'runs' / '*terminal*'), '--fig_dir', str(figs)])
    assert 'none of the runs is an atlas condition' in str(e.value.code)
