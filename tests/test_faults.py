"""Fault injection: crashes, interrupts, full disks, unwritable folders and mixed runs never lose or mix work,
and every bad input is one true line. The long loops behind the README's numbers: python tests/faults.py."""

import errno
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

import faults
import train
from conftest import ROOT, char_prepare
from test_train import TINY, digest, finished_run as finished_run, read_log, run_train  # noqa: F401 (a fixture)

from data import common as data_pkg


def test_kill_9_at_random_moments_then_resume_gives_the_uninterrupted_log(tmp_path):
    data = faults.make_dataset(str(tmp_path / 'data'))
    r = faults.kill_loop(3, data, str(tmp_path), max_iters=40, rng=random.Random(1))
    assert r == {'kills': 3, 'lost': 0, 'duplicated': 0, 'mixed': 0, 'identical': True}


def test_torchrun_saves_on_ctrl_c_and_on_sigterm_every_time(tmp_path):
    """Ctrl-C reaches the workers twice under torchrun (from the terminal, then forwarded by torchrun), and SIGTERM
    reaches them only through torchrun: both must end in one save at one step (a stop slower than torchrun's 30 s
    kill would show as a missing save, so no clock is asserted here)."""
    data = faults.make_dataset(str(tmp_path / 'data'))
    r = faults.interrupt_loop(2, data, str(tmp_path), rng=random.Random(2), say=lambda *a: None)
    assert r['saved'] == 2, r


def resumable(small_data, tmp_path, steps=4):
    """A finished tiny run with an evaluation at every step, and a copy of it trained further (the reference)."""
    out, ref = tmp_path / 'run', tmp_path / 'ref'
    run_train(small_data, out, f'--max_iters={steps}', '--eval_interval=1')
    run_train(small_data, ref, f'--max_iters={steps + 2}', '--eval_interval=1')
    return out, ref


def test_resume_repairs_a_cut_line_and_restores_a_lost_record(small_data, tmp_path):
    """A crash between the checkpoint save and the log write loses the record; one mid-write cuts a line."""
    out, ref = resumable(small_data, tmp_path)
    lines = (out / 'log.jsonl').read_text().splitlines(keepends=True)
    assert json.loads(lines[-1])['step'] == 4
    (out / 'log.jsonl').write_text(''.join(lines[:-1]) + lines[-1][:30])  # step 4's record lost, a cut line left
    run_train(small_data, out, '--max_iters=6', '--eval_interval=1', '--resume')
    assert faults.comparable(read_log(out))[1] == faults.comparable(read_log(ref))[1]  # every record, once


def test_resume_drops_records_past_the_checkpoint(small_data, tmp_path):
    out, ref = resumable(small_data, tmp_path)
    last = read_log(out)[-1]
    with open(out / 'log.jsonl', 'a') as f:  # as if a later evaluation were logged, but its save never landed
        f.write(json.dumps({**last, 'step': 5}) + '\n')
    run_train(small_data, out, '--max_iters=6', '--eval_interval=1', '--resume')
    assert faults.comparable(read_log(out))[1] == faults.comparable(read_log(ref))[1]  # every record, once


def test_resume_refuses_a_folder_that_mixes_two_runs(small_data, tmp_path):
    out, other = tmp_path / 'a', tmp_path / 'b'
    run_train(small_data, out, '--max_iters=2', '--eval_interval=1')
    run_train(small_data, other, '--max_iters=2', '--eval_interval=1', '--readout=raw')
    shutil.copy(other / 'ckpt.pt', out / 'ckpt.pt')  # e.g. the old code's --overwrite, then a crash
    before = digest(out / 'ckpt.pt'), digest(out / 'log.jsonl')
    with pytest.raises(SystemExit) as e:
        run_train(small_data, out, '--max_iters=4', '--resume')
    assert 'mixes two runs' in str(e.value.code) and '\n' not in str(e.value.code)
    assert (digest(out / 'ckpt.pt'), digest(out / 'log.jsonl')) == before


def test_a_full_disk_at_a_save_is_one_line_and_keeps_the_previous_checkpoint(small_data, tmp_path, monkeypatch):
    saves, real_save = [], torch.save

    def save_then_fill_the_disk(obj, f, *a, **k):
        saves.append(f)
        if len(saves) == 2:  # the second save writes part of the file, then the disk is full
            f.write(b'partial')
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *a, **k)
    monkeypatch.setattr(torch, 'save', save_then_fill_the_disk)
    with pytest.raises(SystemExit) as e:
        run_train(small_data, tmp_path, '--max_iters=4', '--eval_interval=1')
    msg = str(e.value.code)
    assert 'No space left on device' in msg and 'previous checkpoint is kept' in msg and '\n' not in msg
    assert not (tmp_path / 'ckpt.pt.tmp').exists()
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['step'] == 1
    assert [r['step'] for r in read_log(tmp_path)[1:]] == [0, 1]  # the unsaved evaluation is not logged


def test_an_out_dir_that_cannot_be_written_is_found_before_training(small_data, tmp_path):
    (tmp_path / 'file').write_text('not a folder')
    with pytest.raises(SystemExit) as e:  # (a path under a file: unwritable even for root)
        run_train(small_data, tmp_path / 'file' / 'run', '--max_iters=2')
    assert 'cannot write to' in str(e.value.code) and 'nothing was trained' in str(e.value.code)


def test_model_flags_on_resume_must_match_the_checkpoint(small_data, tmp_path):
    run_train(small_data, tmp_path, '--max_iters=2')
    before = digest(tmp_path / 'ckpt.pt')
    with pytest.raises(SystemExit) as e:
        run_train(small_data, tmp_path, '--max_iters=4', '--resume', '--n_embd=64')
    assert "--n_embd=64 differs from the checkpoint's 32" in str(e.value.code)
    assert digest(tmp_path / 'ckpt.pt') == before
    run_train(small_data, tmp_path, '--max_iters=4', '--resume', '--n_embd=32')  # the same value is fine
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    assert ckpt['step'] == 4 and ckpt['args']['n_embd'] == 32


def test_a_bad_device_on_resume_does_not_call_the_checkpoint_unreadable(small_data, tmp_path):
    run_train(small_data, tmp_path, '--max_iters=2')
    for device in ('bogus', 'cuda:7', 'mps'):
        with pytest.raises(SystemExit) as e:
            run_train(small_data, tmp_path, '--max_iters=4', '--resume', f'--device={device}')
        assert 'unreadable' not in str(e.value.code) and 'device' in str(e.value.code), e.value.code


def test_a_nan_before_any_save_does_not_claim_a_checkpoint(small_data, tmp_path, monkeypatch):
    real = train.LoopedGPT.forward

    def nan_loss(self, *a, **k):
        logits, loss, stats = real(self, *a, **k)
        return logits, (loss * float('nan') if self.training else loss), stats
    monkeypatch.setattr(train.LoopedGPT, 'forward', nan_loss)
    with pytest.raises(SystemExit) as e:
        run_train(small_data, tmp_path, '--max_iters=4', '--eval_interval=100')
    assert 'no checkpoint was saved yet' in str(e.value.code) and 'kept' not in str(e.value.code)


def test_an_unprepared_custom_dataset_gets_a_true_hint(tmp_path):
    with pytest.raises(SystemExit) as e:
        train.main([*TINY, f'--dataset={tmp_path}', f'--out_dir={tmp_path / "out"}'])
    msg = str(e.value.code)
    assert 'lacks train.bin' in msg and 'see data/common.py write_dataset' in msg
    from data import common
    assert hasattr(common, 'write_dataset')


@pytest.mark.parametrize('module', ['shakespeare_char', 'shakespeare'])
def test_prepare_on_bad_input_is_one_line_and_keeps_the_old_dataset(module, tmp_path):
    if module == 'shakespeare':  # the BPE script needs tiktoken's GPT-2 files before it can get to the writing
        from test_wikitext import gpt2_or_skip
        gpt2_or_skip()
    good = tmp_path / 'good.txt'
    good.write_text('To be, or not to be, that is the question. ' * 10)
    binary = tmp_path / 'binary.bin'
    binary.write_bytes(bytes(range(256)) * 4)
    (tmp_path / 'file').write_text('x')
    out = tmp_path / 'data'
    char_prepare.main([f'--input={good}', f'--out_dir={out}'])
    before = {n: digest(out / n) for n in data_pkg.FILES}
    env = {**os.environ, 'PYTHONPATH': ROOT}
    for args, message in (([f'--input={binary}', f'--out_dir={out}'], 'not UTF-8 text'),
                          ([f'--input={good}', f'--out_dir={tmp_path / "file" / "sub"}'], 'cannot write to')):
        r = subprocess.run([sys.executable, '-m', f'data.{module}.prepare', *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and message in r.stderr and r.stderr.strip().count('\n') == 0, r.stderr
    assert {n: digest(out / n) for n in before} == before


def test_prepare_that_fails_midway_leaves_the_old_dataset_byte_identical(tmp_path, monkeypatch):
    char_prepare.prepare('abcdefgh' * 20, str(tmp_path))
    before = {n: digest(tmp_path / n) for n in data_pkg.FILES}
    real = data_pkg.open_new

    def full_at_meta(path):  # train.bin and val.bin are written; then the disk is full
        if path.endswith('meta.json.tmp'):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path)
    monkeypatch.setattr(data_pkg, 'open_new', full_at_meta)
    with pytest.raises(data_pkg.PrepareError, match='nothing there was changed'):
        char_prepare.prepare('zyxwvuts' * 20, str(tmp_path))
    assert {n: digest(tmp_path / n) for n in before} == before
    assert sorted(os.listdir(tmp_path)) == sorted(data_pkg.FILES)  # no .tmp left behind


def test_resume_of_a_finished_run_restores_its_last_record(small_data, tmp_path):
    """A kill after the final save but before the final log write: --resume finds nothing to train, says so,
    exits 0, and the log gets its last record back from the checkpoint."""
    run_train(small_data, tmp_path, '--max_iters=3', '--eval_interval=1')
    full = (tmp_path / 'log.jsonl').read_text()
    (tmp_path / 'log.jsonl').write_text(''.join(full.splitlines(keepends=True)[:-1]))
    run_train(small_data, tmp_path, '--max_iters=3', '--eval_interval=1', '--resume')
    assert (tmp_path / 'log.jsonl').read_text() == full


@pytest.mark.parametrize('script, flags, message', [
    ('sample', ['--temperature=nan'], 'need --temperature > 0'),
    ('sample', ['--device=bogus'], 'unknown device'),
    ('diagnose', ['--device=mps'], 'MPS (Apple GPU) is not available'),
    ('diagnose', ['--device=cuda:3'], 'no CUDA GPU'),
])
def test_other_scripts_bad_input_is_one_line(finished_run, script, flags, message):
    from lab import diagnose
    import sample
    _, out = finished_run
    with pytest.raises(SystemExit) as e:
        {'sample': sample, 'diagnose': diagnose}[script].main(['--out_dir', str(out), *flags])
    assert message in str(e.value.code) and '\n' not in str(e.value.code), e.value.code


def test_write_dataset_refuses_ids_outside_the_vocabulary(tmp_path):
    """An id >= vocab_size would index past the embedding table at training time; it is refused before writing."""
    for ids in ([0, 1, 65], [-1, 2], []):
        with pytest.raises(data_pkg.PrepareError, match='token ids must be in 0..64'):
            data_pkg.write_dataset(str(tmp_path), ids, [0, 1], {'vocab_size': 65})
    assert os.listdir(tmp_path) == []
