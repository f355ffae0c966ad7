"""Behaviours of a training run seen from outside train.py (its command line, what it prints, the folders it
touches), so that they hold whatever train.py's insides are called: what each process of a torchrun trains on,
a step that leaves a parameter without a gradient under torchrun, what the progress line's loss and ms/step mean,
and the one-line refusal of an impossible dropout or gate_beta.

The losses are compared on runs whose learning rate is 1e-9: the weights do not move at 4 decimals, so every
step's loss is the initial model's on that step's batches, and two runs that draw the same batches print losses
that must agree."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from lab import train  # train.py with the designs: python -m lab.train
from conftest import ROOT

MODEL = ['--n_layer=1', '--n_embd=32', '--n_head=2', '--block_size=16', '--batch_size=4', '--device=cpu',
         '--eval_iters=1', '--log_interval=1']
# one loop under damped recurrence: the damping, read only between two passes, gets no gradient in any step
STILL = [*MODEL, '--n_loop=1', '--recurrence=damped', '--learning_rate=1e-9', '--max_iters=4', '--eval_interval=4']


def progress(out, column):
    """{step: value} of one column ('loss', or 'ms/step') of the progress lines in printed text."""
    pattern = (r'^step (\d+)/\d+ \| loss ([\d.]+) \|' if column == 'loss' else
               r'^step (\d+)/\d+ \|.*?\| (\d+) ms/step')
    return {int(m[1]): float(m[2]) for m in re.finditer(pattern, out, re.MULTILINE)}


def train_main(capsys, data, out_dir, *flags):
    """train.py's main() in this process with these flags; returns what it printed."""
    capsys.readouterr()
    train.main(['--dataset', data, '--out_dir', str(out_dir), *flags])
    return capsys.readouterr().out


@pytest.fixture(scope='module')
def one_process(small_data, tmp_path_factory):
    """One process, one micro-step a step: step k prints the loss of the k-th batch drawn with the seed."""
    printed = io.StringIO()  # (pytest's capsys is for one test, not a module)
    with contextlib.redirect_stdout(printed):
        train.main(['--dataset', small_data, '--out_dir', str(tmp_path_factory.mktemp('one')), *STILL])
    return printed.getvalue()


def torchrun(script, data, out, *flags):
    """script (train.py, or tests/ddp_worker.py) under torchrun with 2 CPU processes (gloo); not checked here."""
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', script,
           '--dataset', data, '--out_dir', str(out), *flags]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, 'WEIGHTS_DIR': str(out)})


def failure(r):
    """What a failed torchrun said: its output's end, and the error lines of its processes."""
    errors = [line for line in r.stderr.splitlines() if 'Error' in line and 'ChildFailedError' not in line]
    return r.stdout[-1000:] + '\n' + '\n'.join(errors[-6:])


@pytest.fixture(scope='module')
def two_processes(small_data, tmp_path_factory):
    """The same run under torchrun, 2 CPU processes with gloo and one micro-step each (--grad_accum=2), through
    tests/ddp_worker.py, which saves each process's first training batches. Not checked here: each test reads
    what it needs, and only the test of unused parameters fails for a run that stopped after its first step."""
    out = tmp_path_factory.mktemp('two')
    return torchrun('tests/ddp_worker.py', small_data, out, *STILL, '--grad_accum=2'), out


def test_under_torchrun_a_step_that_leaves_a_parameter_without_a_gradient_trains(two_processes):
    """DDP must be told that a step may leave a parameter unused (here the damping, with one loop), or the next
    step stops with a RuntimeError."""
    r, _ = two_processes
    assert r.returncode == 0 and 'done: 4 steps' in r.stdout, failure(r)
    assert 'weights identical on all 2 processes: True' in r.stdout


def test_under_torchrun_one_normed_loop_leaves_the_inter_loop_norm_without_a_gradient_and_trains(small_data,
                                                                                               tmp_path):
    """The paper's normed recurrence with one loop: the norm between loops is never read, so DDP must expect a
    parameter without a gradient here too (train.py itself, not the worker)."""
    r = torchrun('train.py', small_data, tmp_path, *MODEL, '--n_loop=1', '--recurrence=normed', '--max_iters=2',
                 '--eval_interval=2')
    assert r.returncode == 0 and 'done: 2 steps' in r.stdout, failure(r)


def test_under_torchrun_each_process_trains_on_its_own_batches(two_processes):
    """Each process draws its batches with a seed of its own: two processes on the same batches would train a
    global batch of half the size it claims, twice."""
    r, out = two_processes
    drawn = []
    for rank in (0, 1):
        path = os.path.join(out, f'rank{rank}-batches.pt')
        assert os.path.exists(path), failure(r)
        drawn.append(torch.load(path, weights_only=True))
    assert len(drawn[0]) == len(drawn[1]) >= 1 and drawn[0][0].shape == (4, 16)
    same = [i for i, (a, b) in enumerate(zip(*drawn)) if torch.equal(a, b)]
    assert not same, f"processes 0 and 1 trained on the same tokens at steps {[i + 1 for i in same]}"


def test_under_torchrun_the_progress_loss_is_the_mean_over_processes_not_the_sum(one_process, two_processes):
    """Process 0 draws the single process's batches, process 1 others of the same kind: their mean lies near
    the single process's loss, their sum near twice it."""
    r, _ = two_processes
    alone, both = progress(one_process, 'loss'), progress(r.stdout, 'loss')
    assert sorted(alone) == [1, 2, 3, 4] and both, failure(r)
    steps = sorted(both)
    ratio = sum(both[s] for s in steps) / sum(alone[s] for s in steps)
    assert 0.75 < ratio < 1.33, (ratio, alone, both)


def test_under_grad_accum_the_progress_loss_is_the_mean_over_micro_steps_not_the_sum(one_process, small_data,
                                                                                      tmp_path, capsys):
    """--grad_accum=2 draws the single-step run's batches two a step: its step 1 is the mean of that run's steps
    1 and 2, its step 2 of steps 3 and 4 (the weights do not move at 4 decimals)."""
    out = train_main(capsys, small_data, tmp_path, *STILL, '--max_iters=2', '--eval_interval=2', '--grad_accum=2')
    alone, accum = progress(one_process, 'loss'), progress(out, 'loss')
    assert sorted(accum) == [1, 2], out
    for step, pair in ((1, (1, 2)), (2, (3, 4))):
        mean = (alone[pair[0]] + alone[pair[1]]) / 2
        assert abs(accum[step] - mean) < 2e-4, (step, accum[step], [alone[s] for s in pair])


def test_progress_ms_per_step_leaves_the_evaluation_out(small_data, tmp_path, capsys):
    """An evaluation before every step, several times a step's cost (10 batches of each split at depths 1 and 2
    against one forward and backward): the log's elapsed_s says how long each step and the evaluation after it
    took together, and the progress line's ms/step must not carry the evaluation's part (medians of 3 steps)."""
    out = train_main(capsys, small_data, tmp_path, *MODEL, '--n_loop=1', '--max_iters=3', '--eval_interval=1',
                        '--eval_iters=10')
    with open(tmp_path / 'log.jsonl') as f:
        elapsed = [json.loads(line)['elapsed_s'] for line in list(f)[1:]]  # evaluations at steps 0, 1, 2, 3
    ms = progress(out, 'ms/step')
    assert sorted(ms) == [1, 2, 3] and len(elapsed) == 4, out
    with_eval = sorted((elapsed[s] - elapsed[s - 1]) * 1000 for s in ms)  # step s, then evaluation s
    assert sorted(ms.values())[1] < with_eval[1] / 2, f"ms/step {ms} against {with_eval} ms with an evaluation"


def test_an_impossible_dropout_or_gate_beta_is_refused_in_one_line_and_harms_no_run(small_data, tmp_path, capsys):
    """Dropout must be in [0, 1) (at 1 every activation is zeroed) and gate_beta at least 0 (a negative beta
    rewards a certain exit): each refused with a one-line error and a failing exit status, before the run folder
    is touched, even under --overwrite. (A value wrongly accepted trains one tiny step, and replaces the folder.)"""
    files = {'log.jsonl': b'{"config": {}}\n', 'ckpt.pt': b"an earlier run's weights"}
    cases = {'dropout': ['--dropout=1.0'], 'gate_beta': ['--supervision=gated', '--gate_beta=-0.1']}
    for field, flags in cases.items():
        run = tmp_path / field
        run.mkdir()
        for name, content in files.items():
            (run / name).write_bytes(content)
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            train.main(['--dataset', small_data, f'--out_dir={run}', '--overwrite', *MODEL, '--max_iters=1', *flags])
        code, printed = stop.value.code, capsys.readouterr()
        # the error `python train.py` shows: its stderr, and sys.exit's message (printed to stderr, status 1)
        error = (printed.err + (code if isinstance(code, str) else '')).strip().splitlines()
        assert code not in (0, None) and len(error) == 1 and field in error[0], (flags, code, printed)
        assert 'Traceback' not in printed.out + printed.err, flags
        assert {p.name: p.read_bytes() for p in run.iterdir()} == files, flags
