"""Trust nothing that is loaded, follow no planted link, mix no datasets: crafted pickles run nothing, links
planted in a run or data folder are never written through, a checkpoint is only used with the data it was
trained on, and every bad input is one line."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from lab import diagnose
import sample
import train
from lab import train as lab_train
from conftest import ROOT, char_prepare
from data import common
from plumbing import run as run_folder
from test_train import TINY, digest, finished_run as finished_run, run_train  # noqa: F401 (a fixture)


class Payload:
    """Unpickling this creates the file named by its argument: the way a malicious pickle runs code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, 'w'))


def one_line(e):
    text = str(e.value.code if isinstance(e.value, SystemExit) else e.value)
    assert '\n' not in text.strip(), text
    return text


# ---- nothing loaded runs code

def test_a_crafted_checkpoint_runs_nothing_anywhere(finished_run, tmp_path):
    _, out = finished_run
    run = tmp_path / 'run'
    shutil.copytree(out, run)
    victim = tmp_path / 'pwned'
    ckpt = torch.load(run / 'ckpt.pt', weights_only=True)
    ckpt['record'] = Payload(str(victim))
    torch.save(ckpt, run / 'ckpt.pt')
    for call in (lambda: sample.main(['--out_dir', str(run), '--max_new_tokens=2']),
                 lambda: diagnose.main(['--out_dir', str(run), '--only=depth']),
                 lambda: run_train(finished_run[0], run, '--max_iters=8', '--resume')):
        with pytest.raises(SystemExit) as e:
            call()
        assert 'refused, since loading it could run code' in one_line(e)
        assert not victim.exists()


def test_a_crafted_meta_pkl_runs_nothing(small_data, tmp_path):
    data = tmp_path / 'data'
    shutil.copytree(small_data, data)
    os.remove(data / 'meta.json')
    victim = tmp_path / 'pwned'
    with open(data / 'meta.pkl', 'wb') as f:
        pickle.dump({'vocab_size': 40, 'x': Payload(str(victim))}, f)
    with pytest.raises(SystemExit) as e:
        run_train(str(data), tmp_path / 'run', '--max_iters=2')
    assert 'not plain data' in one_line(e) and not victim.exists() and not (tmp_path / 'run').exists()


def test_a_foreign_meta_pkl_of_plain_data_is_read(small_data, tmp_path):
    """nanoGPT's meta.pkl ({'vocab_size', 'itos': {id: char}, 'stoi'}) still works, read as plain data."""
    data = tmp_path / 'data'
    shutil.copytree(small_data, data)
    with open(data / 'meta.json') as f:
        meta = json.load(f)
    os.remove(data / 'meta.json')
    with open(data / 'meta.pkl', 'wb') as f:
        pickle.dump({'vocab_size': meta['vocab_size'], 'itos': dict(enumerate(meta['itos'])),
                     'stoi': {c: i for i, c in enumerate(meta['itos'])}}, f)
    run_train(str(data), tmp_path / 'run', '--max_iters=2')
    sample.main(['--out_dir', str(tmp_path / 'run'), '--max_new_tokens=3', '--start=ROMEO'])


# ---- no writer follows a planted link

@pytest.fixture
def victim(tmp_path):
    path = tmp_path / 'victim.txt'
    path.write_text('precious\n')
    return path


@pytest.mark.parametrize('name, flags', [('run.lock', ('--overwrite',)), ('log.jsonl', ('--overwrite',)),
                                         ('ckpt.pt.tmp', ('--resume',)), ('log.jsonl.tmp', ('--resume',))])
def test_a_link_planted_in_a_run_folder_is_refused_and_its_target_untouched(finished_run, tmp_path, victim, name,
                                                                           flags):
    data, out = finished_run
    run = tmp_path / 'run'
    shutil.copytree(out, run)
    if os.path.lexists(run / name):
        os.remove(run / name)
    os.symlink(victim, run / name)
    main = lab_train.main if name == 'run.lock' else train.main  # the lock is the lab's (its grids)
    with pytest.raises(SystemExit) as e:
        main(['--dataset', data, '--out_dir', str(run), *TINY, '--max_iters=8', *flags])
    assert 'is a symbolic link' in one_line(e)
    assert victim.read_text() == 'precious\n'


def test_the_run_files_are_never_written_through_a_link(small_data, tmp_path, victim):
    """Below the refusal: the writers themselves create fresh files, so a link that appears after the check
    is replaced, not followed."""
    out = tmp_path / 'run'
    out.mkdir()
    run_folder.start_log(str(out), False, None, {'config': {}})
    os.symlink(victim, out / 'ckpt.pt.tmp')
    run_folder.save_checkpoint(str(out / 'ckpt.pt'), {'model': {}}, step=1)
    os.symlink(victim, out / 'log.jsonl.tmp')
    run_folder.write_lines(str(out / 'log.jsonl'), [{}])
    assert victim.read_text() == 'precious\n' and not os.path.islink(out / 'ckpt.pt')


def test_prepare_and_figures_never_write_through_a_link(small_data, tmp_path, victim, finished_run):
    out = tmp_path / 'data'
    out.mkdir()
    os.symlink(victim, out / 'train.bin.tmp')
    char_prepare.prepare('hello world, ' * 20, str(out))
    assert victim.read_text() == 'precious\n' and sorted(os.listdir(out)) == ['meta.json', 'train.bin', 'val.bin']
    fig = tmp_path / 'lemma.png'
    os.symlink(victim, fig)
    diagnose.main(['--out_dir', str(finished_run[1]), '--only=lemma', '--lemma_loops=3', f'--fig={fig}'])
    assert victim.read_text() == 'precious\n' and not os.path.islink(fig) and fig.stat().st_size > 1000


# ---- a checkpoint is only ever used with its own data

def reversed_text(folder):
    """A dataset's text backwards: the same characters, so the same vocabulary, but other token ids."""
    with open(folder / 'meta.json') as f:
        itos = json.load(f)['itos']
    ids = np.concatenate([np.fromfile(folder / f'{s}.bin', dtype=np.uint16) for s in ('train', 'val')])
    return ''.join(itos[i] for i in ids[::-1])


def test_resume_stays_on_the_runs_dataset_and_refuses_another(small_data, tmp_path):
    data, other = tmp_path / 'data', tmp_path / 'other'
    shutil.copytree(small_data, data)
    run_train(str(data), tmp_path / 'run', '--max_iters=2')
    # without --dataset the run continues on its own data, not on the default one
    train.main([*TINY, '--out_dir', str(tmp_path / 'run'), '--max_iters=4', '--resume'])
    assert torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)['step'] == 4
    # the same vocabulary with other ids (a re-prepared text): refused, and the checkpoint untouched
    char_prepare.prepare(reversed_text(data), str(other))
    before = digest(tmp_path / 'run' / 'ckpt.pt')
    with pytest.raises(SystemExit) as e:
        train.main([*TINY, '--dataset', str(other), '--out_dir', str(tmp_path / 'run'), '--max_iters=6', '--resume'])
    assert 'is not that data' in one_line(e) and str(data) in one_line(e)
    assert digest(tmp_path / 'run' / 'ckpt.pt') == before


def test_diagnose_refuses_a_re_prepared_dataset_and_finds_its_own_from_anywhere(small_data, tmp_path, monkeypatch,
                                                                                 capsys):
    data = tmp_path / 'data'
    shutil.copytree(small_data, data)
    run_train(str(data), tmp_path / 'run', '--max_iters=2')
    monkeypatch.chdir(tmp_path / 'run')  # the recorded path is absolute: it works from any folder
    diagnose.main(['--out_dir', '.', '--only=depth', '--max_windows=4'])
    assert 'perplexity by exit depth' in capsys.readouterr().out
    char_prepare.prepare(reversed_text(data), str(data))  # re-prepared: the same vocabulary, other ids
    with pytest.raises(SystemExit) as e:
        diagnose.main(['--out_dir', '.', '--only=depth'])
    assert 'is not that data' in one_line(e)


def test_a_kill_between_the_renames_of_a_prepare_is_refused_not_trained_on(small_data, tmp_path, monkeypatch):
    data = tmp_path / 'data'
    shutil.copytree(small_data, data)
    real = os.replace
    calls = []

    def killed_after_the_first(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as if the process died here
        return real(src, dst)
    monkeypatch.setattr(os, 'replace', killed_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        char_prepare.prepare('a different text altogether. ' * 50, str(data))
    monkeypatch.setattr(os, 'replace', real)
    assert not [n for n in os.listdir(data) if n.endswith('.tmp')]  # nothing half-written left behind
    with pytest.raises(SystemExit) as e:
        run_train(str(data), tmp_path / 'run', '--max_iters=2')
    assert 'does not match' in one_line(e) and 'interrupted' in one_line(e)


# ---- every bad dataset is one line

def bad_dataset(small_data, tmp_path, how):
    data = tmp_path / 'bad'
    shutil.copytree(small_data, data)
    with open(data / 'meta.json') as f:
        meta = json.load(f)
    if how == 'id past the vocabulary':
        meta['vocab_size'] = 5
        meta.pop('files')
    elif how == 'no vocab_size':
        meta.pop('vocab_size')
    elif how == 'a string vocab_size':
        meta['vocab_size'] = '65'
    elif how == 'vocab too large for uint16':
        meta['vocab_size'] = 200_000
    elif how == 'a folder named train.bin':
        os.remove(data / 'train.bin')
        os.mkdir(data / 'train.bin')
    elif how == 'odd byte count':
        with open(data / 'val.bin', 'ab') as f:
            f.write(b'x')
    elif how == 'empty val.bin':
        open(data / 'val.bin', 'wb').close()
    with open(data / 'meta.json', 'w') as f:
        json.dump(meta, f)
    return data


@pytest.mark.parametrize('how, message', [
    ('id past the vocabulary', 'outside the vocabulary of 5'), ('no vocab_size', 'needs an integer vocab_size'),
    ('a string vocab_size', "it has '65'"), ('vocab too large for uint16', 'between 1 and 65,536'),
    ('a folder named train.bin', 'train.bin is not a file'), ('odd byte count', 'val.bin has'),
    ('empty val.bin', 'val.bin has 0 bytes')])
def test_a_bad_dataset_is_one_line_and_leaves_no_run_behind(small_data, tmp_path, how, message):
    data = bad_dataset(small_data, tmp_path, how)
    with pytest.raises(SystemExit) as e:
        run_train(str(data), tmp_path / 'run', '--max_iters=2')
    assert message in one_line(e) and not (tmp_path / 'run').exists()


# ---- every bad flag is one line

@pytest.mark.parametrize('flags, message', [
    (['--epochs=inf'], 'finite and > 0'), (['--epochs=1', '--block_size=1'], '>= 2 with --epochs'),
    (['--grad_clip=nan'], '--grad_clip=nan must be'), (['--grad_clip=-1'], '--grad_clip=-1.0 must be'),
    (['--weight_decay=-5'], '--weight_decay=-5.0 must be'), (['--weight_decay=nan'], '--weight_decay=nan must be'),
    (['--learning_rate=inf'], '--learning_rate=inf must be'), (['--seed=100000000000000000000000'], '2**63'),
    (['--resume', '--overwrite'], 'give one of them')])
def test_train_flags_that_would_change_what_is_trained_are_refused(flags, message):
    with pytest.raises(SystemExit) as e:
        train.get_parser().parse(flags)[0]
    assert message in one_line(e)


@pytest.mark.parametrize('flags, message', [
    (['--max_windows=0'], '--max_windows=0 must be at least 2'), (['--max_windows=1'], 'at least 2'),
    (['--max_windows=-1'], 'at least 2'), (['--lemma_loops=0'], '--lemma_loops=0 must be'),
    (['--diag_windows=0'], '--diag_windows=0 must be')])
def test_diagnose_flags_are_checked_before_any_work(finished_run, flags, message):
    with pytest.raises(SystemExit) as e:
        diagnose.main(['--out_dir', str(finished_run[1]), *flags])
    assert message in one_line(e)


def test_a_figure_destination_that_cannot_be_written_is_found_before_the_work(finished_run, tmp_path):
    folder = tmp_path / 'a_folder'
    folder.mkdir()
    with pytest.raises(SystemExit) as e:
        diagnose.main(['--out_dir', str(finished_run[1]), '--only=lemma', f'--fig={folder}'])
    assert 'is a folder' in one_line(e) and not os.path.exists(f'{folder}.png')
    (tmp_path / 'file.txt').write_text('')  # a path under a file: unwritable, even for root
    with pytest.raises(SystemExit) as e:
        diagnose.main(['--out_dir', str(finished_run[1]), '--only=lemma', f'--fig={tmp_path}/file.txt/x.png'])
    assert 'cannot write' in one_line(e)
    r = subprocess.run([sys.executable, '-m', 'lab.bench', '--suite', f'--json={folder}'], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip() == f"python -m lab.bench: error: {folder} is a folder; give a file " \
        f"name (for example {folder}/out.png)" and r.stdout == ''
    r = subprocess.run([sys.executable, '-m', 'lab.bench', '--grad_clip=nan'], cwd=ROOT, capture_output=True, text=True)
    assert r.stderr.startswith('python -m lab.bench: error: --grad_clip=nan')


def test_a_checkpoint_whose_weights_do_not_fit_its_config_is_one_line(finished_run, tmp_path):
    run = tmp_path / 'run'
    shutil.copytree(finished_run[1], run)
    ckpt = torch.load(run / 'ckpt.pt', weights_only=True)
    ckpt['config']['n_embd'] = 64
    torch.save(ckpt, run / 'ckpt.pt')
    with pytest.raises(SystemExit) as e:
        sample.main(['--out_dir', str(run)])
    assert 'does not fit this model' in one_line(e)


def test_sigterm_does_not_offer_a_second_ctrl_c(capsys):
    said = []
    before = signal.getsignal(signal.SIGTERM)
    with train.catch_signals(1, lambda *a, **k: said.append(a[0])) as caught:
        assert signal.getsignal(signal.SIGTERM) is not before  # else the kill below ends the whole suite
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs between bytecodes, once the signal arrives
    assert caught == [signal.SIGTERM] and 'SIGTERM' in said[0] and 'Ctrl-C' not in said[0]
    assert signal.getsignal(signal.SIGTERM) is before  # the earlier handler is back


@pytest.mark.skipif(not os.path.exists('/dev/full'), reason='needs /dev/full, a device that is always full')
def test_a_real_full_disk_names_its_cause(tmp_path, monkeypatch):
    """Writes that land on /dev/full (every write fails with ENOSPC, as on a full disk) through torch's real save
    and numpy's real bytes: the lines say 'No space left on device', not torch's inline_container message."""
    full = lambda path: open('/dev/full', 'wb')
    (tmp_path / 'run').mkdir()
    monkeypatch.setattr(common, 'open_new', full)
    with pytest.raises(ValueError, match=r'\(No space left on device\); no checkpoint was saved before'):
        run_folder.save_checkpoint(str(tmp_path / 'run' / 'ckpt.pt'), {'model': {'w': torch.zeros(100_000)}}, 1)
    with pytest.raises(common.PrepareError, match=r'\(No space left on device\); nothing there was changed'):
        char_prepare.prepare('abcdefgh' * 20, str(tmp_path / 'data'))
    assert os.listdir(tmp_path / 'data') == []


def test_a_bpe_checkpoint_without_tiktoken_files_is_a_hint(monkeypatch):
    import tiktoken

    def offline(name):
        raise ConnectionError('no network')
    monkeypatch.setattr(tiktoken, 'get_encoding', offline)
    with pytest.raises(ValueError, match='set TIKTOKEN_CACHE_DIR'):
        sample.get_codec({'tokenizer': 'gpt2', 'vocab_size': 50257})


def test_file_hashes_see_a_shift_of_ids(tmp_path):
    a = np.arange(1000, dtype=np.uint16)
    assert common.file_hash(a.view(np.uint8)) != common.file_hash((a + 1).view(np.uint8))
