"""plot_norms.py: figures and table from real (tiny) runs, the grid runner, and its one-line errors."""

import json
import os

import pytest

import plot_norms
import train
from test_train import TINY


@pytest.fixture(scope='module')
def two_runs(small_data, tmp_path_factory):
    root = tmp_path_factory.mktemp('runs')
    for name, flags in [('rms', []), ('raw', ['--readout=raw'])]:
        train.main(['--dataset', small_data, '--out_dir', str(root / name), *TINY, '--max_iters=4', '--eval_interval=2', *flags])
    return root


def test_figures_and_table_from_two_runs(two_runs, tmp_path, capsys):
    plot_norms.main([str(two_runs / '*'), '--fig_dir', str(tmp_path)])
    for name in ('fig1_norm_explosion.png', 'fig2_norm_by_loop.png', 'fig3_loss_by_depth.png', 'table.csv', 'table.md',
                 'fig1_norm_explosion.svg', 'exit_table.md', 'fig4_pareto.png', 'fig6_crossover.png'):
        assert (tmp_path / name).stat().st_size > 0, name
    rows = (tmp_path / 'table.csv').read_text().splitlines()
    assert rows[0].startswith('condition,seeds,step') and len(rows) == 3
    assert {r.split(',')[0] for r in rows[1:]} == {'per_loop + rmsnorm', 'per_loop + raw'}
    log = [json.loads(line) for line in open(two_runs / 'raw' / 'log.jsonl')]
    raw_row = next(r for r in rows if r.startswith('per_loop + raw')).split(',')
    assert float(raw_row[4]) == pytest.approx(log[-1]['hidden_norm'][1], abs=0.06)  # ||h_K|| (K = 2) from the log
    exits = (tmp_path / 'exit_table.md').read_text().splitlines()
    assert len(exits) == 4 and 'max_prob loops' in exits[0] and 'entropy tok/s' in exits[0]
    cells = exits[2].split('|')
    assert 1 <= float(cells[4]) <= 2 and float(cells[3].replace(',', '')) > 0  # K = 2 in these runs; a measured speed


def test_a_corrupt_checkpoint_stops_plot_norms_before_any_figure(two_runs, tmp_path):
    import shutil
    bad = tmp_path / 'bad'
    shutil.copytree(two_runs / 'raw', bad)
    (bad / 'ckpt.pt').write_bytes(b'not a checkpoint')
    with pytest.raises(SystemExit) as e:
        plot_norms.main([str(two_runs / 'rms'), str(bad), '--fig_dir', str(tmp_path / 'figs')])
    assert 'unreadable' in str(e.value.code) and '\n' not in str(e.value.code)
    assert not (tmp_path / 'figs').exists()


def test_every_condition_is_named_back_from_its_flags():
    for name, flags in plot_norms.CONDITIONS.items():
        args = train.parse_args(flags)
        cfg = {k: getattr(args, k) for k in ('supervision', 'readout', 'alpha', 'norm_penalty', 'recurrence', 'init')}
        assert plot_norms.condition_name(cfg) == name


@pytest.mark.parametrize('content, message', [
    (None, 'no log.jsonl'), ('', 'is empty'), ('{"config": {"n_loop": 4}}\n{"iter": 0}\n', 'older or unknown format'),
    ('not json\n', 'not valid JSON'),
])
def test_unreadable_run_folder_is_a_one_line_error(two_runs, tmp_path, content, message):
    bad = tmp_path / 'bad_run'
    bad.mkdir()
    if content is not None:
        (bad / 'log.jsonl').write_text(content)
    with pytest.raises(SystemExit) as e:
        plot_norms.main([str(two_runs / 'rms'), str(bad), '--fig_dir', str(tmp_path / 'figs')])
    assert message in str(e.value.code) and str(bad) in str(e.value.code) and '\n' not in str(e.value.code)


def test_grid_runs_then_reuses(small_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plot_norms, 'CONDITIONS', {'per_loop + raw': ['--readout=raw'],
                                                   'terminal + rmsnorm': ['--supervision=terminal']})
    extra = ' '.join(['--dataset', small_data, *TINY, '--max_iters=2', '--eval_interval=2'])
    argv = ['--run', '--out_root', str(tmp_path / 'grid'), '--fig_dir', str(tmp_path / 'figs'), '--train_args', extra]
    plot_norms.main(argv)
    assert 'training (new)' in capsys.readouterr().out
    plot_norms.main(argv)
    out = capsys.readouterr().out
    assert out.count('finished earlier, reused') == 2 and 'terminal + rmsnorm' in out
    assert sorted(os.listdir(tmp_path / 'grid' / 'laptop')) == ['per_loop-raw-seed1', 'terminal-rmsnorm-seed1']
