"""plot_norms.py, lab/paper.py and lab/grid.py: figures and tables from real (tiny) runs, the grid runner, and its
one-line errors; plot_norms.py stands alone. The paired statistics are tested in test_stats.py."""

from dataclasses import asdict
import ast

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import matplotlib.figure
import pytest
import torch

from lab import grid, paper
import plot_norms
import train
from lab import train as lab_train
from conftest import ROOT
from test_train import TINY


@pytest.fixture(scope='module')
def two_runs(small_data, tmp_path_factory):
    root = tmp_path_factory.mktemp('runs')
    for name, flags in [('rms', []), ('raw', ['--readout=raw'])]:
        train.main(['--dataset', small_data, '--out_dir', str(root / name), *TINY, '--max_iters=4', '--eval_interval=2',
                    *flags])
    return root


def test_figures_and_table_from_two_runs(two_runs, tmp_path, capsys):
    paper.main([str(two_runs / '*'), '--fig_dir', str(tmp_path)])
    for name in ('fig1_norm_explosion.png', 'fig2_norm_by_loop.png', 'fig3_loss_by_depth.png', 'table.csv', 'table.md',
                 'fig1_norm_explosion.svg', 'exit_table.md', 'fig4_pareto.png', 'fig6_crossover.png',
                 'fig4_pareto.svg', 'fig6_crossover.svg'):  # every figure as a PNG and an SVG
        assert (tmp_path / name).stat().st_size > 0, name
    rows = (tmp_path / 'table.csv').read_text().splitlines()
    assert rows[0].startswith('condition,seeds,step') and len(rows) == 3
    assert {r.split(',')[0] for r in rows[1:]} == {'per_loop + rmsnorm', 'per_loop + raw'}
    log = [json.loads(line) for line in open(two_runs / 'raw' / 'log.jsonl')]
    raw_row = next(r for r in rows if r.startswith('per_loop + raw')).split(',')
    assert float(raw_row[5]) == pytest.approx(log[-1]['hidden_norm'][1], abs=0.06)  # ||h_K|| (K = 2) from the log
    exits = (tmp_path / 'exit_table.md').read_text().splitlines()
    assert len(exits) == 4 and 'max_prob loops' in exits[0] and 'entropy tok/s' in exits[0]
    # the raw run's row, recomputed from its checkpoint: the plain depth-K perplexity on the measuring half of the
    # windows, and the loops and perplexity of max_prob's threshold calibrated on the other half
    from lab import diagnose
    from lab.runs import load_model
    model, ckpt = load_model(str(two_runs / 'raw'))
    x, y = diagnose.windows(diagnose.val_tokens(ckpt), model.config.block_size, 200)
    (xa, ya), (xb, yb) = diagnose.split_halves(x, y)
    K = model.config.n_loop
    with torch.no_grad():
        plain = math.exp(model(xb, yb)[2]['ce'][K - 1].item())
    ce_a, scores_a = diagnose.sequence_depth_stats(model, xa, ya, K)
    ce_b, scores_b = diagnose.sequence_depth_stats(model, xb, yb, K)
    loops, ppl = diagnose.sequence_exit(ce_b, scores_b['max_prob'],
                                        diagnose.calibrate_sequence_exit(ce_a, scores_a['max_prob'], K), K)
    cells = next(r for r in exits if r.startswith('| per_loop + raw')).split('|')
    assert float(cells[2]) == pytest.approx(plain, rel=1e-4)  # an untrained model: perplexities far above 1
    assert float(cells[4]) == pytest.approx(loops, abs=6e-3) and float(cells[5]) == pytest.approx(ppl, rel=1e-4)
    assert float(cells[3].replace(',', '')) > 0  # a measured speed


def test_a_corrupt_checkpoint_stops_lab_paper_before_any_figure(two_runs, tmp_path):
    import shutil
    bad = tmp_path / 'bad'
    shutil.copytree(two_runs / 'raw', bad)
    (bad / 'ckpt.pt').write_bytes(b'not a checkpoint')
    with pytest.raises(SystemExit) as e:
        paper.main([str(two_runs / 'rms'), str(bad), '--fig_dir', str(tmp_path / 'figs')])
    assert 'unreadable' in str(e.value.code) and '\n' not in str(e.value.code)
    assert not (tmp_path / 'figs').exists()


def test_every_condition_is_named_back_from_its_flags():
    for conditions in grid.GRIDS.values():
        for name, flags in conditions.items():
            config = lab_train.model_config(lab_train.parse_args(flags))[1]  # designs too: the lab's
            assert grid.condition_name(asdict(config)) == name


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


def test_a_pattern_that_matches_no_folder_is_a_one_line_error(two_runs, tmp_path):
    nothing = str(tmp_path / 'nothing-*')
    with pytest.raises(SystemExit) as e:
        plot_norms.main([str(two_runs / 'rms'), nothing, '--fig_dir', str(tmp_path / 'figs')])
    assert e.value.code == f"plot_norms.py: error: {nothing}: matches no folder"
    assert not (tmp_path / 'figs').exists()


def test_grid_runs_then_reuses(small_data, tmp_path, monkeypatch, capsys):
    two = {'per_loop + raw': ['--readout=raw'], 'terminal + rmsnorm': ['--supervision=terminal']}
    monkeypatch.setattr(plot_norms, 'CONDITIONS', two)
    monkeypatch.setitem(grid.GRIDS, 'paper', two)
    extra = ' '.join(['--dataset', small_data, *TINY, '--max_iters=2', '--eval_interval=2'])
    argv = ['--run', '--out_root', str(tmp_path / 'grid'), '--fig_dir', str(tmp_path / 'figs'), '--train_args', extra]
    plot_norms.main(argv)
    lines = [line for line in capsys.readouterr().out.splitlines() if 'training (' in line]
    # the first run has no ETA (nothing trained yet), the second one from the first's time
    assert len(lines) == 2 and lines[0].endswith('per_loop-raw-seed1: training (new)'), lines
    assert re.search(r'terminal-rmsnorm-seed1: training \(new, ETA \d+ min\)$', lines[1]), lines
    assert (tmp_path / 'figs' / 'fig1_norm_explosion.png').stat().st_size > 0
    # the reuse is what the rest checks: the figures are drawn but no longer rendered (seconds each)
    monkeypatch.setattr(matplotlib.figure.Figure, 'savefig', lambda self, *a, **k: None)
    plot_norms.main(argv)
    out = capsys.readouterr().out
    assert out.count('finished earlier, reused') == 2 and 'training (' not in out
    assert sorted(os.listdir(tmp_path / 'grid' / 'laptop')) == ['per_loop-raw-seed1', 'terminal-rmsnorm-seed1']
    # the lab's grid runner finds the same runs finished, and tabulates them
    paper.main(argv + ['--exit_windows=0'])
    out = capsys.readouterr().out
    assert out.count('finished earlier, reused') == 2 and 'training (' not in out and 'terminal + rmsnorm' in out
    # a second seed after a reused run: still no ETA (a reused run took no time and would make it 0)
    plot_norms.main(argv + ['--seeds=2', '--conditions=per_loop-raw'])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if 'training (' in line]
    assert out.count('finished earlier, reused') == 1, out
    assert len(lines) == 1 and lines[0].endswith('per_loop-raw-seed2: training (new)'), lines
    # asking for more steps resumes a finished run
    plot_norms.main(argv + ['--conditions=per_loop-raw', "--train_args=" + extra + ' --max_iters=4'])
    assert capsys.readouterr().out.count('per_loop-raw-seed1: training (resumed)') == 1


def test_plot_norms_stands_alone_and_names_the_paper_grid_as_the_lab_does():
    """plot_norms.py is a handout: it imports nothing from the lab (the lab builds on it, never the reverse), and its
    own reader names every condition of its grid as the lab's reader does."""
    with open(os.path.join(ROOT, 'plot_norms.py')) as f:
        tree = ast.parse(f.read())
    imported = [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    imported += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert imported and not [m for m in imported if m == 'lab' or m.startswith('lab.')], imported
    for name, flags in plot_norms.CONDITIONS.items():
        model = asdict(train.model_config(train.get_parser().parse(flags)[0])[1])
        assert plot_norms.condition_name(model) == grid.condition_name(model) == name
    assert grid.GRIDS['paper'] is plot_norms.CONDITIONS and grid.GRID_FLAGS is plot_norms.GRID_FLAGS


# ---------------------------------------------------------------------------------------------------------------------
# each run at its own K; Ctrl-C on the grid

def test_every_run_is_read_at_its_own_K(two_runs, small_data, tmp_path):
    """K = 3 runs beside the K = 2 ones, in both orders (a K = 3 condition first in CONDITIONS order, and one after):
    every row reports depth K, ||h_K|| and 2K from its own run."""
    for name, flags in [('k3_terminal', ['--supervision=terminal']), ('k3_raw', ['--readout=raw'])]:
        train.main(['--dataset', small_data, '--out_dir', str(tmp_path / name), *TINY, '--n_loop=3', '--max_iters=2',
                    '--eval_interval=2', *flags])
    figs = tmp_path / 'figs'
    folders = [tmp_path / 'k3_terminal', two_runs / 'rms', two_runs / 'raw', tmp_path / 'k3_raw']
    paper.main([*map(str, folders), '--fig_dir', str(figs), '--exit_windows=0'])
    rows = list(csv.reader(open(figs / 'table.csv')))
    header, rows = rows[0], rows[1:]
    assert [r[0] for r in rows] == ['terminal + rmsnorm', 'per_loop + rmsnorm', 'per_loop + raw',
                                    'per_loop + raw [k3_raw]']
    assert header[6:-1] == ['ppl@1', 'ppl@2', 'ppl@3', 'ppl@4', 'ppl@6']  # 1..K and 2K of either depth
    for row, folder in zip(rows, folders):
        last = json.loads((folder / 'log.jsonl').read_text().splitlines()[-1])
        K = len(last['val_loss']) // 2
        assert row[3] == str(K)
        assert float(row[4]) == pytest.approx(math.exp(last['val_loss'][K - 1]), abs=6e-4)
        assert float(row[5]) == pytest.approx(last['hidden_norm'][K - 1], abs=0.06)
        cells = dict(zip(header[6:-1], row[6:-1]))
        assert float(cells[f'ppl@{2 * K}']) == pytest.approx(math.exp(last['val_loss'][-1]), abs=6e-3)
        assert (cells['ppl@3'] == '') == (K == 2) and (cells['ppl@6'] == '') == (K == 2)
    for name in ('fig1_norm_explosion.png', 'fig2_norm_by_loop.png', 'fig3_loss_by_depth.png', 'fig6_crossover.png'):
        assert (figs / name).stat().st_size > 0, name
    # runs of other depths are no pairs: the K = 3 raw run is not compared with the K = 2 rmsnorm run
    assert 'no per_loop + rmsnorm run of seed' in (figs / 'table.md').read_text()


def test_ctrl_c_on_the_grid_lets_the_running_child_save(small_data, tmp_path):
    """Ctrl-C as a terminal sends it (to the whole foreground process group) while a grid run trains: the child saves
    a checkpoint once, plot_norms waits for it and exits 130 with one line. Started with SIGINT ignored, as a shell
    script's background job is (where Python installs no Ctrl-C handler of its own): the grid still passes it on."""
    extra = ' '.join(['--dataset', small_data, *TINY, '--max_iters=100000', '--eval_interval=100000'])
    cmd = [sys.executable, '-u', 'plot_norms.py', '--run', '--conditions=per_loop-raw', '--out_root', str(tmp_path),
           '--fig_dir', str(tmp_path / 'figs'), '--train_args', extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # a process group of its own, like a shell's foreground job
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    run = tmp_path / 'laptop' / 'per_loop-raw-seed1'
    try:
        deadline = time.time() + 180  # about 5 s on an idle core; generous for a busy machine
        # the step-0 evaluation is logged inside the training loop, after train.py has set up its Ctrl-C handling
        while not ((run / 'log.jsonl').exists() and len((run / 'log.jsonl').read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.time() < deadline, 'the grid run did not start training'
            time.sleep(0.1)
        time.sleep(0.5)  # a few training steps
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:  # a failed test leaves no training behind: SIGTERM is passed on to the child as well
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert len(err.strip().splitlines()) == 1 and 'Traceback' not in err, err
    assert err.startswith('plot_norms.py: interrupted during per_loop + raw (seed 1): saved')
    # the way out that works for a grid is the same command again; plot_norms has no --resume of its own
    assert 'rerun the same command' in err and '--resume' not in err
    step = torch.load(run / 'ckpt.pt', weights_only=True)['step']
    assert step >= 1 and f'at step {step}' in err  # saved by the interrupt: no evaluation is due before step 100000
    assert 'continue with the same flags plus --resume' in (run / 'train.out').read_text()
    assert not (tmp_path / 'figs').exists()


def test_ctrl_c_reaches_a_child_that_prints_without_pause():
    """The grid passes a Ctrl-C on at once even while its child writes output without a pause (a tiny model's
    progress lines): reading that output through a pipe ran no signal handler until the child ended (CI failure)."""
    child = [sys.executable, '-c', """if True:
        import signal, sys, time
        got, start, i = [], time.time(), 0
        signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
        while not got and time.time() - start < 30:
            print('x' * 100, i, flush=True)
            i += 1
        print('saved' if got else 'never interrupted')
        sys.exit(130 if got else 0)"""]
    for _ in range(3):  # through the old pipe the first one already waited for the child's end
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        started = time.time()
        try:
            returncode, output, signals = grid.run_child(child)
        finally:
            timer.cancel()
        assert output.strip().splitlines()[-1] == 'saved' and returncode == 130 and signals == [signal.SIGINT]
        assert time.time() - started < 20


def test_figures_never_go_through_a_planted_link_and_bad_destinations_stop_first(two_runs, tmp_path):
    """A link planted as a figure or table is replaced, its target untouched; a --fig_dir that cannot be written
    and a --train_args that does not parse are one line each, before any work."""
    victim = tmp_path / 'victim.txt'
    victim.write_text('precious\n')
    figs = tmp_path / 'figs'
    figs.mkdir()
    for name in ('fig1_norm_explosion.png', 'table.md', 'paired.csv'):
        os.symlink(victim, figs / name)
    paper.main([str(two_runs / '*'), f'--fig_dir={figs}', '--exit_windows=0'])
    plot_norms.main([str(two_runs / '*'), f'--fig_dir={figs}'])
    assert victim.read_text() == 'precious\n'
    assert not any(os.path.islink(figs / n) for n in ('fig1_norm_explosion.png', 'table.md'))
    (tmp_path / 'file').write_text('')
    with pytest.raises(SystemExit) as e:
        plot_norms.main([str(two_runs / '*'), f'--fig_dir={tmp_path}/file/figs'])
    assert (str(e.value.code).startswith('plot_norms.py: error: --fig_dir: cannot write')
            and '\n' not in str(e.value.code))
    with pytest.raises(SystemExit) as e:
        paper.main([str(two_runs / '*'), f'--fig_dir={tmp_path}/file/figs'])
    assert str(e.value.code).startswith('python -m lab.paper: error: --fig_dir: cannot write')
    with pytest.raises(SystemExit) as e:
        plot_norms.main(['--run', "--train_args='x", f'--fig_dir={figs}'])
    assert 'No closing quotation' in str(e.value.code) and '\n' not in str(e.value.code)


def test_the_default_reference_is_per_loop_rmsnorm_under_the_runs_own_init():
    import argparse
    runs = lambda *names: [{'name': n} for n in names]
    pick = lambda *names: paper.pick_reference(None, argparse.Namespace(reference=None), runs(*names))
    assert pick('per_loop + rmsnorm', 'per_loop + raw') == 'per_loop + rmsnorm'
    assert pick('gated + rmsnorm (gpt2 init)', 'per_loop + rmsnorm (gpt2 init)') == 'per_loop + rmsnorm (gpt2 init)'
    assert pick('per_loop + raw') == 'per_loop + rmsnorm'  # none: the table then says it has no reference
    # a design under that init is not the reference, nor is one of two inits
    assert pick('per_loop + rmsnorm (gpt2 init) + diagonal', 'per_loop + raw (gpt2 init)') == 'per_loop + rmsnorm'
    assert pick('per_loop + rmsnorm (gpt2 init)', 'per_loop + rmsnorm (paper_small_embed init)') == 'per_loop + rmsnorm'
