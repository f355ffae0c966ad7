"""train.py, sample.py and the prepare scripts end to end, on tiny runs in temporary folders."""

import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from lab import atlas
from lab import bench
from lab import diagnose
import faults
from lab import matched_depth
from lab import norm_course
from lab import converge
import plot_norms
from plumbing.run import CONFIGS
import sample
import train
from lab import configs
from lab.engine import generate as engine_generate
from conftest import ROOT, char_prepare

TINY = ['--n_layer=1', '--n_embd=32', '--n_head=2', '--n_loop=2', '--block_size=16', '--batch_size=4',
        '--eval_iters=2', '--log_interval=2']


def run_train(data, out_dir, *flags):
    train.main(['--dataset', data, '--out_dir', str(out_dir), *TINY, *flags])


def read_log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def digest(path):
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope='module')
def finished_run(small_data, tmp_path_factory):
    out = tmp_path_factory.mktemp('run')
    run_train(small_data, out, '--max_iters=6', '--eval_interval=3')
    return small_data, out


def test_smoke_run_writes_log_and_checkpoint(finished_run):
    _, out = finished_run
    log = read_log(out)
    assert log[0]['config']['model']['n_loop'] == 2 and log[0]['config']['readout'] == 'rmsnorm'
    assert [r['step'] for r in log[1:]] == [0, 3, 6]
    for r in log[1:]:
        # one scheme for every per-depth list: depths 1..2K
        assert isinstance(r['train_loss'], float) and len(r['val_loss']) == 4 and len(r['hidden_norm']) == 4
        assert all(np.isfinite(r['val_loss'])) and all(h > 0 for h in r['hidden_norm']) and r['elapsed_s'] >= 0
    ckpt = torch.load(os.path.join(out, 'ckpt.pt'), weights_only=True)
    assert ckpt['step'] == 6 and ckpt['config']['n_loop'] == 2 and ckpt['meta']['vocab_size'] > 0
    assert ckpt['best_val_loss'] == min(r['val_loss'][1] for r in log[2:])
    assert not any(k.startswith('_orig_mod') for k in ckpt['model'])  # the uncompiled module's names


def test_resume_continues_the_same_curve(small_data, tmp_path):
    """12 steps in one go == 6 steps, stop, resume to 12: same log records and bit-identical weights."""
    run_train(small_data, tmp_path / 'straight', '--max_iters=12', '--eval_interval=6', '--dropout=0.1')
    run_train(small_data, tmp_path / 'resumed', '--max_iters=6', '--eval_interval=6', '--dropout=0.1')
    run_train(small_data, tmp_path / 'resumed', '--max_iters=12', '--eval_interval=6', '--dropout=0.1', '--resume')
    a, b = read_log(tmp_path / 'straight'), read_log(tmp_path / 'resumed')
    strip = lambda log: [{k: v for k, v in r.items() if k != 'elapsed_s'} for r in log[1:]]
    assert strip(a) == strip(b) and [r['step'] for r in b[1:]] == [0, 6, 12]
    wa = torch.load(tmp_path / 'straight' / 'ckpt.pt', weights_only=True)['model']
    wb = torch.load(tmp_path / 'resumed' / 'ckpt.pt', weights_only=True)['model']
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_nan_loss_stops_and_keeps_last_checkpoint(small_data, tmp_path, monkeypatch):
    original, calls = train.LoopedGPT.forward, []

    def poisoned(self, idx, targets=None, n_loop=None):
        logits, loss, stats = original(self, idx, targets, n_loop)
        if self.training:
            calls.append(1)
            if len(calls) == 5:
                loss = loss * float('nan')
        return logits, loss, stats
    monkeypatch.setattr(train.LoopedGPT, 'forward', poisoned)
    with pytest.raises(SystemExit) as e:
        run_train(small_data, tmp_path, '--max_iters=20', '--eval_interval=2')
    assert 'nan at step 5' in str(e.value.code) and '\n' not in str(e.value.code)
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['step'] == 4
    assert [r['step'] for r in read_log(tmp_path)[1:]] == [0, 2, 4]


def test_refuses_to_overwrite_a_run(finished_run):
    data, out = finished_run
    before = digest(out / 'ckpt.pt'), digest(out / 'log.jsonl')
    with pytest.raises(SystemExit, match='already holds a run'):
        run_train(data, out, '--max_iters=2')
    assert (digest(out / 'ckpt.pt'), digest(out / 'log.jsonl')) == before


@pytest.mark.parametrize('flags, message', [
    (['--readout=foo'], "invalid choice: 'foo'"),
    (['--norm_penalty=-1'], 'norm_penalty=-1.0 must be'),
    (['--n_loop=0'], 'n_loop=0 must be at least 1'),
    (['--n_embd=33'], 'not divisible'),
    (['--tie_weights=maybe'], 'expected True/False/1/0'),
    (['--dataset=no/such/folder'], 'unknown dataset'),
    (['--resume', '--out_dir={empty}'], 'no checkpoint at'),
    (['--resume', '--out_dir={truncated}'], 'unreadable'),
    (['--device=bogus'], 'unknown device'),
    (['--readout=raw', '--alpha=0.5'], 'only used by'),
    (['--grad_accum=0'], 'grad_accum=0 must be at least 1'),
])
def test_bad_input_is_one_line_and_harmless(finished_run, tmp_path, flags, message):
    data, out = finished_run
    truncated = tmp_path / 'truncated'
    truncated.mkdir()
    raw = (out / 'ckpt.pt').read_bytes()
    (truncated / 'ckpt.pt').write_bytes(raw[:len(raw) // 2])
    (truncated / 'log.jsonl').write_text('{"config": {}}\n')
    flags = [f.format(empty=tmp_path / 'empty', truncated=truncated) for f in flags]
    if not any(f.startswith('--out_dir') for f in flags):
        flags.append(f'--out_dir={out}')  # point every bad command at a real run: it must survive
    before = {p: digest(p)
              for p in (out / 'ckpt.pt', out / 'log.jsonl', truncated / 'ckpt.pt', truncated / 'log.jsonl')}
    with pytest.raises(SystemExit) as e:
        train.main(['--dataset', data, *TINY, *flags])
    assert e.value.code not in (0, None) and message in str(e.value.code) and '\n' not in str(e.value.code)
    assert {p: digest(p) for p in before} == before
    assert not (tmp_path / 'empty').exists()


def test_cli_error_is_a_single_stderr_line():
    r = subprocess.run([sys.executable, 'train.py', '--readout=foo'], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and r.stdout == ''
    assert r.stderr.strip().count('\n') == 0 and 'invalid choice' in r.stderr


def test_default_dataset_is_prepared_on_first_use_from_the_shipped_text(tmp_path, monkeypatch, capsys):
    """No prepared dataset: the first run prepares it from data/shakespeare_char/input.txt, offline. With that
    text deleted and no source reachable, one line says how to get it back, and nothing is trained."""
    from data import loader as data
    (tmp_path / 'data' / 'shakespeare_char').mkdir(parents=True)
    monkeypatch.setattr(data, 'HERE', str(tmp_path / 'data'))                       # no prepared dataset here
    train.main([*TINY, '--max_iters=2', '--out_dir', str(tmp_path / 'out')])
    assert 'preparing it now' in capsys.readouterr().out
    assert len(np.fromfile(tmp_path / 'data' / 'shakespeare_char' / 'val.bin', np.uint16)) == 111_540
    (tmp_path / 'data' / 'shakespeare_char' / 'train.bin').unlink()
    monkeypatch.setattr(char_prepare, 'TEXT', str(tmp_path / 'deleted.txt'))         # the shipped text deleted
    monkeypatch.setattr(char_prepare, 'URLS', ['http://127.0.0.1:9/input.txt'])      # and nothing to download from
    with pytest.raises(SystemExit) as e:
        train.main([*TINY, '--max_iters=2', '--out_dir', str(tmp_path / 'out2')])
    assert 'no source worked' in str(e.value.code) and 'git checkout' in str(e.value.code)
    assert '\n' not in str(e.value.code) and not (tmp_path / 'out2').exists()


def test_ctrl_c_saves_and_resumes(small_data, tmp_path):
    cmd = [sys.executable, '-u', 'train.py', '--dataset', small_data, '--out_dir', str(tmp_path), *TINY,
           '--max_iters=100000', '--eval_interval=100000']
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # wait until training is under way
        if line.startswith('step '):
            break
    proc.send_signal(signal.SIGINT)
    try:  # a save takes about a second: 30 s is a margin for a loaded machine, not a wait for a run that ignores it
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    step = torch.load(tmp_path / 'ckpt.pt', weights_only=True)['step']
    assert step >= 2 and f'at step {step}' in out
    run_train(small_data, tmp_path, f'--max_iters={step + 2}', '--eval_interval=100000', '--resume')
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['step'] == step + 2


def test_sample_prints_text_at_other_loop_counts(finished_run, capsys):
    """sample.py --n_loop=4 on a K=2 model prints what generate() gives at 4 loops with the same seed, and
    reports the 4 loops per token that generate() says it ran."""
    _, out = finished_run
    from lab.runs import load_model
    model, ckpt = load_model(str(out))
    encode, decode = sample.get_codec(ckpt['meta'])
    expected = {}
    for n_loop in (2, 4):
        torch.manual_seed(1337)
        ids, loops = engine_generate(model, torch.tensor([encode('ROMEO:')]), 20, temperature=0.8, top_k=200,
                                     n_loop=n_loop)
        expected[n_loop] = decode(ids[0].tolist())
        assert loops.tolist() == [[n_loop] * 20]
    sample.main(['--out_dir', str(out), '--n_loop=4', '--max_new_tokens=20', '--start=ROMEO:', '--num_samples=1'])
    text = capsys.readouterr().out
    assert expected[4] in text and 'mean loops per token: 4.00 of 4' in text
    with pytest.raises(SystemExit, match='outside'):
        sample.main(['--out_dir', str(out), '--start=\u00e9'])
    with pytest.raises(SystemExit, match='n_loop=0'):
        sample.main(['--out_dir', str(out), '--n_loop=0'])


def test_show_depth_marks_every_generated_token(finished_run, capsys, monkeypatch):
    """Without a terminal: a line of loop digits under each line of text, one digit per generated character,
    and the digits are the loops generate() reports; in a terminal: one colour per loop, with a legend."""
    _, out = finished_run
    reported, generate = [], sample.generate  # lab.engine's, as sample.py imports it

    def spy(model, *a, **k):
        idx, used = generate(model, *a, **k)
        reported.append((idx[0, -used.size(1):].tolist(), used[0].tolist()))
        return idx, used
    monkeypatch.setattr(sample, 'generate', spy)
    argv = ['--out_dir', str(out), '--max_new_tokens=40', '--start=ROMEO:', '--num_samples=1', '--n_loop=3',
            '--exit=kl', '--exit_threshold=1e-3', '--show_depth']
    sample.main(argv)
    text = capsys.readouterr().out
    assert '\033[' not in text and 'the loop (1..3) at which' in text
    body = text.split('exited (blank: the prompt)\n')[1].split('---------------')[0].rstrip('\n').split('\n')
    lines, marks = body[0::2], body[1::2]
    assert lines[0].startswith('ROMEO:') and marks[0].startswith(' ' * 6)  # the prompt is not marked
    codec = sample.get_codec(torch.load(out / 'ckpt.pt', weights_only=True)['meta'])
    ids, used = reported[0]
    expected = ''.join(str(d) for i, d in zip(ids, used) if codec[1]([i]) != '\n')  # newlines take no column
    assert ''.join(m.strip() for m in marks) == expected and set(expected) <= {'2', '3'}  # kl never exits at loop 1
    # the same command, seen by a terminal: run it under a pseudo-terminal
    import pty
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, 'sample.py', *argv], cwd=ROOT, stdout=follower, stderr=subprocess.STDOUT)
    os.close(follower)
    seen = b''
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(timeout=60) == 0
    seen = seen.decode()
    paint = {d: f'\033[38;5;{sample.PALETTE[d - 1]}m' for d in (1, 2, 3)}
    assert 'colour = loop at which the token exited' in seen and all(paint[d] in seen for d in set(used))
    assert sample.show_depth('a', ['b', 'c'], [1, 2], 2, ansi=True).endswith(f"a{paint[1]}b\033[0m{paint[2]}c\033[0m")


def test_sample_gives_the_same_text_with_and_without_the_cache_and_each_samples_own_depths(finished_run, capsys,
                                                                                           monkeypatch):
    """sample.py with its KV cache and with --recompute prints the same samples at a fixed seed and depth, past
    block_size; with an exit rule and --show_depth each sample of the batch is marked with its own depths."""
    _, out = finished_run
    argv = ['--out_dir', str(out), '--max_new_tokens=150', '--start=ROMEO:', '--num_samples=2']
    texts = []
    for extra in ([], ['--recompute']):
        sample.main(argv + extra)
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].count('---------------') == 2
    reported, generate = [], sample.generate

    def spy(model, *a, **k):
        idx, depth = generate(model, *a, **k)
        reported.append((idx, depth))
        return idx, depth
    monkeypatch.setattr(sample, 'generate', spy)
    sample.main(['--out_dir', str(out), '--max_new_tokens=60', '--start=ROMEO:', '--num_samples=3', '--n_loop=3',
                 '--exit=latent', '--exit_threshold=0.3', '--show_depth'])
    text = capsys.readouterr().out
    (idx, depth), = reported
    assert depth.shape == (3, 60) and len(set(depth.flatten().tolist())) == 3  # every loop is some token's exit
    decode = sample.get_codec(torch.load(out / 'ckpt.pt', weights_only=True)['meta'])[1]
    blocks = text.split('exited (blank: the prompt)\n')[1:]
    assert len(blocks) == 3
    for block, ids, row in zip(blocks, idx[:, -60:].tolist(), depth.tolist()):
        marks = block.split('---------------')[0].rstrip('\n').split('\n')[1::2]
        expected = ''.join(str(d) for i, d in zip(ids, row) if decode([i]) != '\n')  # newlines take no column
        assert ''.join(m.strip() for m in marks) == expected


def test_prepare_char_on_a_local_file(tmp_path):
    text = 'hello world\nthe quick brown fox jumps over the lazy dog\n' * 20
    src = tmp_path / 'in.txt'
    src.write_text(text)
    char_prepare.main(['--input', str(src), '--out_dir', str(tmp_path)])
    with open(tmp_path / 'meta.json') as f:
        meta = json.load(f)
    train_ids, val_ids = np.fromfile(tmp_path / 'train.bin', np.uint16), np.fromfile(tmp_path / 'val.bin', np.uint16)
    assert meta['vocab_size'] == len(set(text)) and len(train_ids) == int(0.9 * len(text))
    assert ''.join(meta['itos'][i] for i in np.concatenate([train_ids, val_ids])) == text
    with pytest.raises(SystemExit, match='does not exist'):
        char_prepare.main(['--input', str(tmp_path / 'missing.txt'), '--out_dir', str(tmp_path)])


def test_prepare_bpe_on_a_local_file(tmp_path):
    from test_wikitext import gpt2_or_skip
    enc = gpt2_or_skip()
    text = 'First Citizen:\nBefore we proceed any further, hear me speak.\n' * 10
    (tmp_path / 'in.txt').write_text(text)
    r = subprocess.run([sys.executable, '-m', 'data.shakespeare.prepare', '--input', str(tmp_path / 'in.txt'),
                        '--out_dir', str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ids = np.concatenate([np.fromfile(tmp_path / f'{s}.bin', np.uint16) for s in ('train', 'val')])
    assert enc.decode(ids.tolist()) == text


def readme():
    """The front page and every page under docs/, as one text: the command and flag tests cover them all."""
    import glob
    text = ''
    for path in [os.path.join(ROOT, 'README.md')] + sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md'))):
        with open(path) as f:
            text += f.read() + '\n'
    return text


def readme_commands():
    """(script, rest of the line) for every python/torchrun command line in the README, docs/ and the course
    handout."""
    with open(os.path.join(ROOT, 'assignments', 'README.md')) as f:
        text = readme() + f.read()
    pattern = r'^\s*(?:\$ )?(?:python3?|torchrun(?: --\S+)*) ((?:-m )?[\w./]+?)(?:\.py)?(?= |$)(.*)$'
    cmds = re.findall(pattern, text, flags=re.M)
    assert len(cmds) >= 5, 'the README should show its train/sample commands'
    return cmds


def test_every_readme_command_parses():
    """Every command the README shows parses with its script's own parser (a renamed or removed flag fails)."""
    import importlib.util
    sys.path.insert(0, os.path.join(ROOT, 'assignments'))
    seen = set()
    for script, rest in readme_commands():
        argv = shlex.split(re.split(r'\s#', rest)[0].split(' && ')[0].split('; ')[0])
        argv = [a for a in argv if '$' not in a]  # shell variables (a loop's $seed) cannot be checked here
        if script == '-m pytest':
            continue
        elif script == '-m lab.bench':  # its own flags, then train.py's
            bench.parse(argv)
        elif script == '-m lab.train':  # train.py's flags and the designs'
            importlib.import_module('lab.train').parse_args(argv)
        elif script.startswith('-m '):  # a lab tool (python -m lab.atlas) or a data/<name>/prepare.py
            importlib.import_module(script[3:]).get_parser().parse_args(argv)
        elif script == 'train':
            train.get_parser().parse(argv)[0]
        elif '/' in script:  # a script in a folder (assignments/..., tests/faults, tests/mutations): load it by path
            spec = importlib.util.spec_from_file_location(script.replace('/', '_'), os.path.join(ROOT, script + '.py'))
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.get_parser().parse_args(argv)
        else:
            assert script in ('sample', 'plot_norms'), \
                f"python {script}.py: the lab's tools run as python -m lab.<tool>"
            {'sample': sample, 'plot_norms': plot_norms}[script].get_parser().parse_args(argv)
        seen.add(script)
    assert {'train', 'sample', 'plot_norms', '-m lab.diagnose', '-m lab.bench',
            '-m data.shakespeare_char.prepare'} <= seen, seen


def test_readme_flags_exist_and_the_concept_table_matches_the_defaults():
    """Every --flag the README names belongs to one of the scripts, and the defaults its flags table states are
    train.py's."""
    import importlib
    import importlib.util
    sys.path.insert(0, os.path.join(ROOT, 'assignments'))
    parsers = [train.get_parser(), importlib.import_module('lab.train').get_parser(), sample.get_parser(),
               diagnose.get_parser(), plot_norms.get_parser(), bench.own_parser(), faults.get_parser(),
               matched_depth.get_parser(), atlas.get_parser(), norm_course.get_parser(), converge.get_parser()]
    parsers += [importlib.import_module(m).get_parser() for m in (
                'lab.compare', 'lab.sample', 'lab.paper', 'data.shakespeare_char.prepare', 'data.shakespeare.prepare',
                'data.wikitext103.prepare', 'make_student', 'check_answers', 'mutations',
                'test_pinned_math')]
    spec = importlib.util.spec_from_file_location('key_mutations',
                                                  os.path.join(ROOT, 'assignments', 'key', 'mutations.py'))
    key = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(key)  # the kit's mutation list, whose --stubs the docs name
    parsers.append(key.get_parser())
    known = {opt for parser in parsers for action in parser._actions for opt in action.option_strings}
    known |= {'--standalone', '--nproc_per_node'}                         # torchrun's (not this repository's)
    known |= {'--' + name for name in configs.NANOGPT_HABITS}  # nanoGPT's, which docs/usage.md maps to these
    known |= {'--loop_scale'}  # the example design that docs/usage.md's "Adding a design" adds
    named = set(re.findall(r'(?<![\w-])(--[a-z][a-z0-9_]*)', readme()))
    assert named - known == set(), named - known
    table = re.findall(r'^\| `(--\w+)` \| `([^`]*)` \|', readme(), flags=re.M)
    assert len(table) >= 5, table
    parser = importlib.import_module('lab.train').get_parser()  # the paper's flags and the designs'
    parser.set_defaults(**CONFIGS['laptop'])
    for flag, default in table:
        assert str(parser.get_default(flag[2:])) == default, (flag, default, parser.get_default(flag[2:]))


def test_sample_needs_only_the_handout(finished_run, tmp_path):
    """sample.py runs from a folder that holds sample.py, looped.py and plumbing/ (its checkpoint reader) with
    data/common.py (the one error type) and data/loader.py (the data check plumbing imports): no lab, no dataset, no
    train.py."""
    import shutil
    _, out = finished_run
    for name in ('sample.py', 'looped.py'):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    shutil.copytree(os.path.join(ROOT, 'plumbing'), tmp_path / 'plumbing',
                    ignore=shutil.ignore_patterns('__pycache__'))
    os.makedirs(tmp_path / 'data')
    for name in ('__init__.py', 'common.py', 'loader.py'):
        shutil.copy(os.path.join(ROOT, 'data', name), tmp_path / 'data' / name)
    r = subprocess.run([sys.executable, 'sample.py', '--out_dir', str(out), '--max_new_tokens=10', '--num_samples=1'],
                       cwd=tmp_path, capture_output=True, text=True, env={**os.environ, 'PYTHONPATH': ''})
    assert r.returncode == 0 and 'mean loops per token' in r.stdout, r.stderr


def test_the_repository_speaks_of_itself_alone():
    """No tracked file but .ci/run names the folders and notes that only this project's developers have."""
    files = subprocess.run(['git', 'ls-files'], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip('not a git checkout')
    needles = ('../' + 'shared', 'REFERENCE' + '.md')  # spelled in two parts so that this file passes its own test
    for name in files:
        if name == '.ci/run' or not os.path.isfile(os.path.join(ROOT, name)):
            continue
        with open(os.path.join(ROOT, name), 'rb') as f:
            text = f.read().decode('utf-8', errors='ignore')
        assert not any(n in text for n in needles), name


def test_overwrite_removes_the_old_checkpoint_before_training(finished_run, tmp_path, monkeypatch):
    """--overwrite, then a crash before the first save, must not leave the old model to be resumed."""
    import shutil
    data, out = finished_run
    copy = tmp_path / 'run'
    shutil.copytree(out, copy)

    def crash(self, *a, **k):  # the first training step dies, before anything is saved
        raise RuntimeError('simulated crash')
    monkeypatch.setattr(train.LoopedGPT, 'forward', crash)
    with pytest.raises(RuntimeError, match='simulated'):
        run_train(data, copy, '--overwrite', '--readout=raw', '--max_iters=4', '--eval_interval=100')
    assert not (copy / 'ckpt.pt').exists() and read_log(copy)[0]['config']['readout'] == 'raw'


def test_prepare_refuses_a_too_large_vocabulary_before_writing(tmp_path):
    char_prepare.prepare('abcdefgh' * 20, str(tmp_path))
    before = {n: digest(tmp_path / n) for n in ('train.bin', 'val.bin', 'meta.json')}
    huge = ''.join(chr(i) for i in range(0x4E00, 0x4E00 + 70000) if not 0xD800 <= i < 0xE000)
    with pytest.raises(char_prepare.PrepareError, match='distinct characters'):
        char_prepare.prepare(huge, str(tmp_path))
    assert {n: digest(tmp_path / n) for n in before} == before


def lab_train_run(data, out_dir, *flags):  # the lab's entry, which locks its folder (its grids' workers)
    from lab import train as lab_train
    lab_train.main(['--dataset', data, '--out_dir', str(out_dir), *TINY, *flags])


def test_a_lock_held_by_a_live_process_refuses_the_run_and_names_its_pid(small_data, tmp_path):
    """The lock itself, without any race: another process holds out_dir/run.lock, so python -m lab.train must
    stop at once with one line naming that process."""
    holder = subprocess.Popen([sys.executable, '-c', 'import fcntl, os, sys, time\n'
                               'f = open(sys.argv[1], "a+"); fcntl.flock(f, fcntl.LOCK_EX)\n'
                               'f.write(f"{os.getpid()}\\n"); f.flush(); print("locked", flush=True); time.sleep(60)',
                               str(tmp_path / 'run.lock')], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'locked'
        with pytest.raises(SystemExit) as e:
            lab_train_run(small_data, tmp_path, '--max_iters=2')
        assert f'in use by another train.py (pid {holder.pid})' in str(e.value.code) and '\n' not in str(e.value.code)
        assert not (tmp_path / 'ckpt.pt').exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_second_run_in_a_busy_out_dir_is_refused(small_data, tmp_path):
    """While one python -m lab.train runs in out_dir, a second one (here: --resume, and --overwrite) is refused
    in one line that names the first one's pid, and the first run's files are untouched by it."""
    cmd = [sys.executable, '-u', '-m', 'lab.train', '--dataset', small_data, '--out_dir', str(tmp_path), *TINY,
           '--max_iters=100000', '--eval_interval=2']
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # wait until it has saved a checkpoint
            if line.startswith('eval 2:'):
                break
        for flag in ('--resume', '--overwrite'):
            with pytest.raises(SystemExit) as e:  # a short run: without the lock it would end at once, not hang
                lab_train_run(small_data, tmp_path, '--max_iters=3', flag)
            assert f'in use by another train.py (pid {proc.pid})' in str(e.value.code), e.value.code
        assert read_log(tmp_path)[0]['config']['max_iters'] == 100000  # the first run's log, not replaced
    finally:
        proc.kill()
        proc.wait()
    run_train(small_data, tmp_path, '--max_iters=2', '--overwrite')  # the OS freed the lock with the process
