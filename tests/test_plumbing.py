"""What plumbing/ does for train.py, each behaviour pinned where a one-line slip would pass unnoticed: the flags
as typed (--tie_weights=False unties, a negative --seed is refused, 'no' is False), the run's name keeps every
variant flag, the MFU peak of an H100, a run one step short of its goal is not finished, and a log whose last
line was cut by a crash reads back up to its last whole line."""

from dataclasses import asdict
import json
import os

import pytest
import torch

import train
from plumbing import logs, run


def test_tie_weights_false_typed_unties_the_head():
    args = train.get_parser().parse(['--tie_weights=False', '--out_dir=unused'])[0]
    Model, config = train.model_config(args)
    model = Model(config)
    assert config.tie_weights is False and model.lm_head.weight is not model.wte.weight
    Model, config = train.model_config(train.get_parser().parse(['--out_dir=unused'])[0])  # unset: tied
    model = Model(config)
    assert config.tie_weights is True and model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize('seed', ['-1', str(2 ** 63)])
def test_a_seed_outside_its_range_is_one_line(seed, capsys):
    with pytest.raises(SystemExit) as e:
        train.get_parser().parse([f'--seed={seed}'])[0]
    assert '--seed=' in str(e.value.code) and 'between 0 and 2**63 - 1' in str(e.value.code)


@pytest.mark.parametrize('text, value', [('no', False), ('No', False), ('0', False), ('false', False),
                                         ('yes', True), ('1', True), ('True', True)])
def test_the_boolean_flag_reads_each_spelling(text, value):
    assert run.boolean(text) is value
    assert train.get_parser().parse([f'--decay_lr={text}', '--out_dir=unused'])[0].decay_lr is value


def test_the_run_name_keeps_every_variant_flag():
    args = train.get_parser().parse(['--readout=raw', '--norm_penalty=0.01', '--recurrence=normed',
                             '--supervision=terminal'])[0]
    assert args.out_dir == 'out/laptop-supervision_terminal-readout_raw-pen0.01-recurrence_normed'


def test_the_mfu_peak_of_an_h100_and_none_for_an_unknown_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device: 'NVIDIA H100 80GB HBM3')
    assert run.peak_flops('cuda:0') == 989e12
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device: 'Some Other GPU')
    assert run.peak_flops('cuda:0') is None and run.peak_flops('cpu') is None


def write_log(folder, steps, max_iters, cut=False):
    folder.mkdir()
    header = {'config': {'max_iters': max_iters, 'model': {'n_loop': 1}}}
    records = [{'step': s, 'train_loss': 1.0, 'val_loss': [1.0, 1.1], 'hidden_norm': [2.0, 3.0],
                'elapsed_s': 0.1} for s in steps]
    text = ''.join(json.dumps(r) + '\n' for r in [header, *records])
    if cut:  # a crash in the middle of the next record
        text += json.dumps(records[-1])[:20]
    (folder / 'log.jsonl').write_text(text)
    return folder


def test_a_run_one_step_short_of_its_goal_is_not_finished(tmp_path):
    short = write_log(tmp_path / 'short', [0, 50, 99], max_iters=100)
    done = write_log(tmp_path / 'done', [0, 50, 100], max_iters=100)
    assert not logs.finished(short) and logs.finished(done)
    assert not logs.finished(done, max_iters=101) and logs.finished(short, max_iters=99)
    from lab import grid  # a grid reuses a finished run: the same goal, read from the command it would run
    assert not grid.finished(str(short), ['--max_iters=100']) and grid.finished(str(done), ['--max_iters=100'])


def test_a_log_with_a_cut_last_line_reads_back_to_its_last_whole_line(tmp_path):
    folder = write_log(tmp_path / 'cut', [0, 10, 20], max_iters=20, cut=True)
    config, records, K = logs.read_log(folder)
    assert [r['step'] for r in records] == [0, 10, 20] and K == 1 and config['max_iters'] == 20


def test_a_checkpoint_saved_when_w3_was_named_c_gate_still_loads(tmp_path):
    """SwiGLU's W3 was c_gate before it was c_up: load_checkpoint reads an older checkpoint's weights under the new
    name, in their order (the optimizer state goes by order), and they load into today's model."""
    from looped import LoopedConfig, LoopedGPT
    torch.manual_seed(0)
    model = LoopedGPT(LoopedConfig(vocab_size=11, block_size=8, n_embd=16, n_head=2, n_layer=1, n_loop=2))
    old = {k.replace('.mlp.c_up.', '.mlp.c_gate.'): v for k, v in model.state_dict().items()}
    assert any('c_gate' in k for k in old)
    torch.save({'model': old, 'config': asdict(model.config), 'step': 1}, tmp_path / 'ckpt.pt')
    ckpt = run.load_checkpoint(str(tmp_path / 'ckpt.pt'))
    assert list(ckpt['model']) == list(model.state_dict())
    fresh = LoopedGPT(model.config)
    run.load_weights(fresh, ckpt['model'], 'the old checkpoint')
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_open_log_refusing_a_folder_that_holds_a_run_lets_its_lock_go(tmp_path):
    """A run found in out_dir under the lock (one that ended there since the early check) is refused in one
    line, and the refused process lets the lock go: a later run in the same process is not told the folder is in
    use by itself."""
    (tmp_path / 'ckpt.pt').write_bytes(b'an earlier run')
    with pytest.raises(run.InputError, match='already holds a run'):
        run.open_log(str(tmp_path), False, False, None, {})
    lock = run.lock_folder(str(tmp_path))
    assert lock is not None
    os.close(lock)
    assert (tmp_path / 'ckpt.pt').read_bytes() == b'an earlier run'
