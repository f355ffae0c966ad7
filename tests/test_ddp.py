"""Data-parallel training: 2 CPU processes under torchrun with gloo, then a resume."""

import json
import os
import subprocess
import sys

import torch

from conftest import ROOT
from test_train import TINY


def torchrun(data, out, *flags):
    """train.py under torchrun with 2 CPU processes (through tests/ddp_worker.py, which then saves each process's
    final weights to out/weights/rank<R>.pt)."""
    weights = os.path.join(out, 'weights')
    os.makedirs(weights, exist_ok=True)
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'tests/ddp_worker.py',
           '--dataset', data, '--out_dir', str(out), '--device=cpu', *TINY, '--grad_accum=2', '--eval_interval=2',
           *flags]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, 'WEIGHTS_DIR': weights})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def assert_same_weights(out):
    """Every parameter and buffer tensor of process 1 equals process 0's, bit for bit."""
    ranks = [torch.load(os.path.join(out, 'weights', f'rank{r}.pt'), weights_only=True) for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys() and len(ranks[0]) > 5
    differ = [name for name in ranks[0] if not torch.equal(ranks[0][name], ranks[1][name])]
    assert not differ, differ


def test_two_processes_stay_in_sync_and_resume_under_gated_supervision(small_data, tmp_path):
    """Gated supervision, whose last gate has no effect on the loss (p_K is the mass left): data parallel must
    still train it, in step, and resume it (plain per-loop supervision: the default-flags test below)."""
    out = torchrun(small_data, tmp_path, '--max_iters=4', '--supervision=gated')
    assert 'exit p ' in out
    assert 'data parallel: 2 processes (gloo)' in out
    assert 'weights identical on all 2 processes: True' in out
    assert_same_weights(tmp_path)
    assert out.count('eval 4:') == 1  # only rank 0 prints (and logs, and saves)
    with open(tmp_path / 'log.jsonl') as f:
        log = [json.loads(line) for line in f]
    assert 'config' in log[0] and [r['step'] for r in log[1:]] == [0, 2, 4]
    assert log[0]['config']['grad_accum'] == 2
    out = torchrun(small_data, tmp_path, '--max_iters=6', '--resume')
    assert 'resuming' in out and 'weights identical on all 2 processes: True' in out
    # the checkpoint holds rank 0's batch order; the resumed rank 1 must draw batches of its own, not rank 0's
    first = [torch.load(tmp_path / 'weights' / f'rank{r}-batches.pt', weights_only=True)[0] for r in (0, 1)]
    assert not torch.equal(first[0], first[1])
    assert_same_weights(tmp_path)
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['step'] == 6
    assert not os.path.exists(tmp_path / 'ckpt.pt.tmp')


def test_torchrun_with_default_flags(tmp_path):
    """What a user types first: no --grad_accum, so each process takes one micro-step and the global batch is
    batch_size x processes, on the default dataset (prepared here from the shipped text if it is not yet, as a
    user's first run would, so that the two processes do not both prepare it). One batch per evaluation: the
    default 8 made evaluation three quarters of this test's time."""
    from data.loader import find_dataset
    find_dataset('shakespeare_char')
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py',
           '--device=cpu', '--max_iters=4', '--eval_interval=2', '--eval_iters=1', f'--out_dir={tmp_path}']
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert 'global batch 32 = 16 x 1 micro-steps x 2 processes' in r.stdout
    with open(tmp_path / 'log.jsonl') as f:
        log = [json.loads(line) for line in f]
    assert [r['step'] for r in log[1:]] == [0, 2, 4] and log[0]['config']['grad_accum'] is None
