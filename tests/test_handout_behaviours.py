"""Behaviours of train.py that a breakage once left untested: the head under --init=gpt2, a typed
--min_lr as the cosine's floor, a split one token too short, evaluation windows on a tiny split, a
non-finite validation loss past K, gradient accumulation under torchrun, and float16's skipped steps."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import train
from conftest import ROOT
from data.common import write_dataset
from lab import train as lab_train

TINY = ['--n_layer=1', '--n_embd=16', '--n_head=2', '--n_loop=2', '--block_size=16', '--batch_size=2',
        '--eval_iters=1', '--log_interval=1', '--device=cpu']


def run(data, out, *flags, main=train.main):
    main(['--dataset', data, '--out_dir', str(out), *TINY, *flags])


def test_init_gpt2_without_tie_weights_unties_the_head():
    for argv, tied in ([], True), (['--init=gpt2'], False), (['--init=gpt2', '--tie_weights'], True):
        GPT, config = lab_train.model_config(lab_train.parse_args(argv + TINY[:5]))
        model = GPT(config)
        assert config.tie_weights is tied, argv
        assert (model.lm_head.weight is model.wte.weight) is tied, argv


def test_a_typed_min_lr_is_the_cosines_floor(small_data, tmp_path, monkeypatch):
    rates, real = [], train.get_lr
    monkeypatch.setattr(train, 'get_lr', lambda args, step: rates.append(real(args, step)) or rates[-1])
    run(small_data, tmp_path / 'r', '--max_iters=5', '--eval_interval=5', '--decay_lr',
        '--lr_decay_iters=2', '--min_lr=2e-4', '--learning_rate=1e-3')
    assert rates[0] == pytest.approx(1e-3) and rates[2:] == [2e-4] * 3  # past step 2: the typed floor
    run(small_data, tmp_path / 'd', '--max_iters=3', '--eval_interval=3', '--decay_lr',
        '--lr_decay_iters=1', '--learning_rate=1e-3')
    assert rates[-1] == pytest.approx(1e-4)  # unset: learning_rate / 10


def tiny_dataset(folder, n_train, n_val, vocab=5):
    os.makedirs(folder)
    write_dataset(str(folder), np.arange(n_train) % vocab, np.arange(n_val) % vocab,
                  {'vocab_size': vocab, 'itos': {i: chr(97 + i) for i in range(vocab)}})
    return str(folder)


def test_a_split_of_exactly_block_size_plus_one_tokens_is_refused_in_one_line(tmp_path):
    data = tiny_dataset(tmp_path / 'data', 200, 17)  # block_size 16: one window, no room to draw
    with pytest.raises(SystemExit) as e:
        run(data, tmp_path / 'r', '--max_iters=1')
    message = str(e.value.code)
    assert 'val.bin has 17 tokens, too few for block_size=16' in message and '\n' not in message
    assert not os.path.exists(tmp_path / 'r')


def test_evaluation_windows_on_a_tiny_split_do_not_overlap(tmp_path):
    _, splits, _ = train.load_data(tiny_dataset(tmp_path / 'data', 200, 50), 16)
    batches = train.eval_batches(splits, 8, 4, 16, 'cpu')['val']  # 8 of 4 asked: 3 windows of 16 fit in 50
    x = torch.cat([b[0] for b in batches])
    assert len(x) == 3
    starts = np.linspace(0, 50 - 16 - 1, 3).astype(int)
    assert all(b - a >= 16 for a, b in zip(starts, starts[1:]))
    assert torch.equal(x[1], torch.arange(starts[1], starts[1] + 16) % 5)


@pytest.mark.parametrize('depth', [2, 4])  # K = 2: at K, and at 2K past it
def test_a_non_finite_validation_loss_at_any_depth_stops_the_run(small_data, tmp_path, monkeypatch, depth):
    real = train.evaluate

    def evaluate(model, batches, n_loop, ctx):
        ce, norm = real(model, batches, n_loop, ctx)
        if n_loop == 4:  # the validation pass, depths 1..2K
            ce[depth - 1] = math.nan
        return ce, norm
    monkeypatch.setattr(train, 'evaluate', evaluate)
    with pytest.raises(SystemExit) as e:
        run(small_data, tmp_path / 'r', '--max_iters=2', '--eval_interval=1')
    assert f'validation loss is nan at depth {depth} at step 0' in str(e.value.code)
    with open(tmp_path / 'r' / 'log.jsonl') as f:
        assert len(f.readlines()) == 1  # the header alone: no record holds a nan


def test_under_torchrun_grad_accum_syncs_after_the_last_micro_step(small_data, tmp_path):
    """2 processes x 2 micro-steps: a sync after the first micro-step alone would leave the second's
    gradients local, and the weights of the two processes would drift apart."""
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
           'train.py', '--dataset', small_data, '--out_dir', str(tmp_path / 'r'), *TINY,
           '--grad_accum=4', '--max_iters=3', '--eval_interval=3']
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'global batch 8 = 2 x 2 micro-steps x 2 processes' in r.stdout
    assert 'weights identical on all 2 processes: True' in r.stdout


def test_only_a_step_the_scaler_skipped_counts_as_skipped(small_data, tmp_path, monkeypatch, capsys):
    """The scaler lowers its scale only after an overflow: that step is counted and left out of the
    line's means; a step whose scale grew is neither."""
    real, scales = torch.amp.GradScaler, iter([8.0, 16.0, 4.0, 8.0])  # the scale after steps 1..4

    class Scaler(real):  # enabled on this CPU; its scale after each update is scripted
        def __init__(self, device_type, enabled=True):
            super().__init__('cpu', enabled=enabled)
            self.now = 8.0

        def get_scale(self):
            return self.now

        def update(self, new_scale=None):
            self.now = next(scales)

        def scale(self, loss):
            return loss

        def unscale_(self, optimizer):
            pass

        def step(self, optimizer):
            optimizer.step()
    monkeypatch.setattr(torch.amp, 'GradScaler', lambda device, enabled=True: Scaler(device))
    run(small_data, tmp_path / 'r', '--max_iters=4', '--eval_interval=4')
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith('step ')]
    assert 'loss skipped' in lines[2] and 'float16 steps skipped 1' in lines[2]  # 16 -> 4
    assert all('loss skipped' not in lines[i] for i in (0, 1, 3))  # 8 -> 8, 8 -> 16, 4 -> 8
    assert 'float16 steps skipped 1' in lines[3] and 'skipped' not in lines[1]


def test_tok_s_counts_every_micro_step_and_process(small_data, tmp_path, monkeypatch):
    """The progress line's tokens per step are the global batch's: batch x micro-steps x processes
    x block_size (here 2 x 3 x 1 x 16), not one micro-step's."""
    made, real = [], train.Progress
    monkeypatch.setattr(train, 'Progress', lambda step, tokens, *a: made.append(tokens) or real(
        step, tokens, *a))
    run(small_data, tmp_path / 'r', '--max_iters=1', '--eval_interval=1', '--grad_accum=3')
    assert made == [2 * 3 * 16]
