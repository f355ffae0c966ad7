"""plot_norms.py: figures and table from real (tiny) runs, the grid runner, and its one-line errors."""

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import plot_norms
import train
from conftest import ROOT
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
    assert float(raw_row[5]) == pytest.approx(log[-1]['hidden_norm'][1], abs=0.06)  # ||h_K|| (K = 2) from the log
    exits = (tmp_path / 'exit_table.md').read_text().splitlines()
    assert len(exits) == 4 and 'max_prob loops' in exits[0] and 'entropy tok/s' in exits[0]
    # the raw run's row, recomputed from its checkpoint: the plain depth-K perplexity on the measuring half of the
    # windows, and the loops and perplexity of max_prob's threshold calibrated on the other half
    import diagnose
    from looped import LoopedGPT
    model, ckpt = LoopedGPT.from_checkpoint(str(two_runs / 'raw'))
    x, y = diagnose.windows(diagnose.val_tokens(ckpt), model.config.block_size, 200)
    (xa, ya), (xb, yb) = diagnose.split_halves(x, y)
    K = model.config.n_loop
    with torch.no_grad():
        plain = math.exp(model(xb, yb)[2]['ce'][K - 1].item())
    ce_a, scores_a = diagnose.sequence_depth_stats(model, xa, ya, K)
    ce_b, scores_b = diagnose.sequence_depth_stats(model, xb, yb, K)
    loops, ppl = diagnose.sequence_exit(ce_b, scores_b['max_prob'], diagnose.calibrate_sequence_exit(ce_a, scores_a['max_prob'], K), K)
    cells = next(r for r in exits if r.startswith('| per_loop + raw')).split('|')
    assert float(cells[2]) == pytest.approx(plain, rel=1e-4)  # an untrained model: perplexities far above 1
    assert float(cells[4]) == pytest.approx(loops, abs=6e-3) and float(cells[5]) == pytest.approx(ppl, rel=1e-4)
    assert float(cells[3].replace(',', '')) > 0  # a measured speed


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
    # a second seed after two reused runs: no ETA before anything was trained (reused runs took no time), then one
    plot_norms.main(argv + ['--seeds=2'])
    lines = [line for line in capsys.readouterr().out.splitlines() if 'training (' in line]
    assert len(lines) == 2 and lines[0].endswith('per_loop-raw-seed2: training (new)'), lines
    assert re.search(r'terminal-rmsnorm-seed2: training \(new, ETA \d+ min\)$', lines[1]), lines


# ---------------------------------------------------------------------------------------------------------------------
# paired statistics (issue 22): hand-built logs with known seed-by-seed differences

def fake_run(root, folder, seed, losses, readout='rmsnorm', n_embd=64, steps=(100, 200), max_iters=200):
    """A run folder whose log holds given validation losses (one list over depths 1..2K per step), so the paired
    statistics have an answer computed by hand."""
    model = {'n_loop': len(losses[0]) // 2, 'n_layer': 2, 'n_embd': n_embd, 'supervision': 'per_loop',
             'readout': readout, 'alpha': None, 'norm_penalty': 0.0, 'recurrence': 'residual', 'init': 'paper'}
    config = {'seed': seed, 'max_iters': max_iters, 'dataset': 'shakespeare_char', 'out_dir': folder,
              'n_embd': n_embd, 'model': model, **{k: model[k] for k in plot_norms.CONDITION_KEYS}}
    path = root / folder
    path.mkdir()
    records = [{'step': s, 'train_loss': loss[0], 'val_loss': loss, 'hidden_norm': [10.0] * len(loss),
                'elapsed_s': 1.0} for s, loss in zip(steps, losses)]
    (path / 'log.jsonl').write_text('\n'.join(json.dumps(line) for line in [{'config': config}, *records]) + '\n')
    return str(path)


def test_t_quantiles_match_the_printed_table():
    # two-sided 95% values of Student's t, as printed in every statistics table
    for df, t in [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042), (10_000, 1.960)]:
        assert plot_norms.t_quantile(0.975, df) == pytest.approx(t, abs=5e-4), df
    assert plot_norms.t_quantile(0.025, 4) == pytest.approx(-2.7764, abs=1e-4)


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
    plot_norms.main([str(root / '*'), '--fig_dir', str(figs), '--exit_windows=0', '--reference=per_loop-rmsnorm'])
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
    stats = plot_norms.paired_stats([[0.3, -0.1]])
    assert list(stats['mean']) == [0.3, -0.1] and all(map(math.isnan, stats['lo']))
    assert plot_norms.verdict(stats['lo'][0], stats['hi'][0], 'x') == 'no interval (fewer than 2 pairs)'
    assert plot_norms.verdict(0.1, 0.2, 'x') == 'higher than x'
    assert plot_norms.verdict(-0.1, 0.2, 'x') == 'no difference shown'


# ---------------------------------------------------------------------------------------------------------------------
# issue 18: each run at its own K; Ctrl-C on the grid

def test_every_run_is_read_at_its_own_K(two_runs, small_data, tmp_path):
    """K = 3 runs beside the K = 2 ones, in both orders (a K = 3 condition first in CONDITIONS order, and one after):
    every row reports depth K, ||h_K|| and 2K from its own run."""
    for name, flags in [('k3_terminal', ['--supervision=terminal']), ('k3_raw', ['--readout=raw'])]:
        train.main(['--dataset', small_data, '--out_dir', str(tmp_path / name), *TINY, '--n_loop=3', '--max_iters=2',
                    '--eval_interval=2', *flags])
    figs = tmp_path / 'figs'
    folders = [tmp_path / 'k3_terminal', two_runs / 'rms', two_runs / 'raw', tmp_path / 'k3_raw']
    plot_norms.main([*map(str, folders), '--fig_dir', str(figs), '--exit_windows=0'])
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
    a checkpoint once, plot_norms waits for it and exits 130 with one line."""
    extra = ' '.join(['--dataset', small_data, *TINY, '--max_iters=100000', '--eval_interval=100000'])
    cmd = [sys.executable, '-u', 'plot_norms.py', '--run', '--conditions=per_loop-raw', '--out_root', str(tmp_path),
           '--fig_dir', str(tmp_path / 'figs'), '--train_args', extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # a process group of its own, like a shell's foreground job
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
    step = torch.load(run / 'ckpt.pt', weights_only=False)['step']
    assert step >= 1 and f'at step {step}' in err  # saved by the interrupt: no evaluation is due before step 100000
    assert 'continue with the same flags plus --resume' in (run / 'train.out').read_text()
    assert not (tmp_path / 'figs').exists()


def test_figures_never_go_through_a_planted_link_and_bad_destinations_stop_first(two_runs, tmp_path):
    """A link planted as a figure or table is replaced, its target untouched; a --fig_dir that cannot be written
    and a --train_args that does not parse are one line each, before any work."""
    victim = tmp_path / 'victim.txt'
    victim.write_text('precious\n')
    figs = tmp_path / 'figs'
    figs.mkdir()
    for name in ('fig1_norm_explosion.png', 'table.md', 'paired.csv'):
        os.symlink(victim, figs / name)
    plot_norms.main([str(two_runs / '*'), f'--fig_dir={figs}', '--exit_windows=0'])
    assert victim.read_text() == 'precious\n'
    assert not any(os.path.islink(figs / n) for n in ('fig1_norm_explosion.png', 'table.md'))
    (tmp_path / 'file').write_text('')
    with pytest.raises(SystemExit) as e:
        plot_norms.main([str(two_runs / '*'), f'--fig_dir={tmp_path}/file/figs'])
    assert str(e.value.code).startswith('plot_norms.py: error: --fig_dir: cannot write') and '\n' not in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        plot_norms.main(['--run', "--train_args='x", f'--fig_dir={figs}'])
    assert 'No closing quotation' in str(e.value.code) and '\n' not in str(e.value.code)
