"""Every output path works when its folders do not exist yet, an up-front check leaves nothing behind, a run
folder never becomes a dead end, and a refusal says what differs. (The class of bug: tests that only ever wrote
into folders that already existed.)"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lab import diagnose
import train
from conftest import ROOT, char_prepare
from data.common import check_writable, write_atomically

TINY = ['--n_layer=1', '--n_embd=32', '--n_head=2', '--n_loop=2', '--block_size=16', '--batch_size=4',
        '--eval_iters=2', '--log_interval=2', '--device=cpu', '--compile=False']


def test_write_atomically_creates_missing_folders(tmp_path):
    path = tmp_path / 'a' / 'b' / 'c.json'
    write_atomically(str(path), lambda f: f.write(b'{}'))
    assert path.read_bytes() == b'{}' and os.listdir(path.parent) == ['c.json']  # no .tmp left


def test_a_failed_check_leaves_no_folder_behind(tmp_path):
    (tmp_path / 'file').write_text('x')
    with pytest.raises(ValueError, match='cannot write'):
        check_writable(str(tmp_path / 'file' / 'a' / 'b.png'))  # under a file: fails even for root
    assert sorted(os.listdir(tmp_path)) == ['file']
    check_writable(str(tmp_path / 'new' / 'deeper' / 'x.png'))  # a check that passes leaves nothing either
    assert sorted(os.listdir(tmp_path)) == ['file']


def test_two_checks_at_once_neither_fails_and_the_other_workers_folder_stays(tmp_path, monkeypatch):
    """Two workers started together check the same new folder: one's probe may sit in the folder the other
    made, or the other may remove that folder between this one's makedirs and its probe."""
    from data import common
    target = tmp_path / 'figs' / 'table.md'
    real = common.open_new
    calls = []

    def racing(path):
        calls.append(path)
        if len(calls) == 1:  # the other worker's check has just removed the empty folder
            os.rmdir(target.parent)
        elif len(calls) == 2:  # and now it writes its own probe there while this one runs
            (target.parent / 'table.md.probe999').write_text('')
        return real(path)
    monkeypatch.setattr(common, 'open_new', racing)
    check_writable(str(target))
    assert len(calls) == 2 and os.listdir(target.parent) == ['table.md.probe999']


@pytest.fixture(scope='module')
def run_dir(tmp_path_factory):
    data = tmp_path_factory.mktemp('data')
    char_prepare.prepare('To be, or not to be, that is the question.\n' * 60, str(data))
    out = tmp_path_factory.mktemp('run') / 'run'
    train.main(['--dataset', str(data), '--out_dir', str(out), *TINY, '--max_iters=2', '--eval_interval=2'])
    return out


def test_diagnose_writes_its_figure_into_folders_it_creates(run_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the relative path as a user types it
    diagnose.main(['--out_dir', str(run_dir), '--only=lemma', '--diag_windows=2', '--lemma_loops=3',
                   '--fig=A/B/lemma.png'])
    assert (tmp_path / 'A' / 'B' / 'lemma.png').stat().st_size > 0


def test_diagnose_takes_the_checkpoint_file_as_out_dir(run_dir, capsys):
    diagnose.main(['--out_dir', str(run_dir / 'ckpt.pt'), '--only=lemma', '--diag_windows=2', '--lemma_loops=3'])
    assert (run_dir / 'lemma.png').stat().st_size > 0  # beside the checkpoint, as for the folder
    assert f"wrote {run_dir / 'lemma.png'}" in capsys.readouterr().out


def test_train_and_prepare_create_their_folders(tmp_path):
    text = tmp_path / 'in.txt'
    text.write_text('Thou art more lovely and more temperate.\n' * 50)
    data = tmp_path / 'new' / 'data'
    r = subprocess.run([sys.executable, '-m', 'data.shakespeare_char.prepare', '--input', str(text),
                        '--out_dir', str(data)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    train.main(['--dataset', str(data), '--out_dir', str(tmp_path / 'x' / 'y' / 'run'), *TINY, '--max_iters=1'])
    assert (tmp_path / 'x' / 'y' / 'run' / 'ckpt.pt').exists()


def header_only_run(folder):
    """What a run killed before its first checkpoint leaves: a log with its header and a lock, no ckpt.pt."""
    folder.mkdir(parents=True)
    (folder / 'log.jsonl').write_text(json.dumps({'run_id': 'killed', 'config': {}}) + '\n')
    (folder / 'run.lock').write_text('12345\n')


def test_a_run_killed_before_its_first_save_is_no_dead_end(small_data, tmp_path, capsys):
    run = tmp_path / 'run'
    header_only_run(run)
    with pytest.raises(SystemExit) as e:  # --resume: nothing to resume, and the message says what works
        train.main(['--dataset', small_data, '--out_dir', str(run), *TINY, '--max_iters=1', '--resume'])
    msg = str(e.value.code)
    assert 'stopped before its first save' in msg and 'without --resume' in msg and '\n' not in msg
    train.main(['--dataset', small_data, '--out_dir', str(run), *TINY, '--max_iters=1'])  # the same command works
    assert 'stopped before its first save was replaced' in capsys.readouterr().out
    head = json.loads((run / 'log.jsonl').read_text().splitlines()[0])
    assert head['run_id'] != 'killed' and (run / 'ckpt.pt').exists()


def test_a_log_with_records_but_no_checkpoint_is_not_replaced_silently(small_data, tmp_path):
    run = tmp_path / 'run'
    header_only_run(run)
    with open(run / 'log.jsonl', 'a') as f:
        f.write(json.dumps({'step': 0, 'val_loss': [1.0]}) + '\n')
    with pytest.raises(SystemExit, match='already holds a run'):
        train.main(['--dataset', small_data, '--out_dir', str(run), *TINY, '--max_iters=1'])
    assert 'killed' in (run / 'log.jsonl').read_text()


def test_resume_on_other_data_says_what_differs(tmp_path):
    text = 'Now is the winter of our discontent.\n' * 80
    a, b = tmp_path / 'a', tmp_path / 'b'
    char_prepare.prepare(text, str(a))
    char_prepare.prepare(text, str(b))
    run = tmp_path / 'run'
    train.main(['--dataset', str(a), '--out_dir', str(run), *TINY, '--max_iters=1'])
    train_ids = np.fromfile(b / 'train.bin', np.uint16)
    train_ids[[0, 1]] = train_ids[[1, 0]]  # same size and vocabulary, other content
    meta = json.loads((b / 'meta.json').read_text())
    from data.common import file_hash
    meta['files']['train.bin'] = file_hash(train_ids.view(np.uint8))
    train_ids.tofile(b / 'train.bin')
    (b / 'meta.json').write_text(json.dumps(meta))
    with pytest.raises(SystemExit) as e:
        train.main(['--dataset', str(b), '--out_dir', str(run), *TINY, '--max_iters=2', '--resume'])
    msg = str(e.value.code)
    assert 'train.bin differs in content' in msg and 'same' in msg and '\n' not in msg, msg
    with open(b / 'val.bin', 'ab') as f:  # and a size change is named as one
        f.write(b'\x00\x00')
    meta['files']['val.bin'] = file_hash(np.fromfile(b / 'val.bin', np.uint8))
    (b / 'meta.json').write_text(json.dumps(meta))
    with pytest.raises(SystemExit, match='val.bin differs in size|train.bin differs in content'):
        train.main(['--dataset', str(b), '--out_dir', str(run), *TINY, '--max_iters=2', '--resume'])
