"""The paper-scale path on a tiny WikiText-format folder written here: word-level prepare, GPT-2 prepare,
and two training steps of the paper_44m configuration on the CPU."""

import json
import re
import types

import numpy as np
import pytest

import train
from data.wikitext103 import prepare as wikitext_prepare

ARTICLE = (" = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : <unk> Chronicles "
           "( Japanese : 戦場のヴァルキュリア3 , "
           "lit . Valkyria of the Battlefield 3 ) , commonly referred to as Valkyria Chronicles III outside Japan , "
           "is a tactical role @-@ playing video game developed by Sega and Media.Vision for the PlayStation "
           "Portable . \n \n")


def gpt2_or_skip():
    """tiktoken's GPT-2 encoding, or a skip when it is neither cached nor downloadable (set TIKTOKEN_CACHE_DIR)."""
    import tiktoken
    try:
        return tiktoken.get_encoding('gpt2')
    except Exception:
        pytest.skip('no GPT-2 BPE files for tiktoken here (set TIKTOKEN_CACHE_DIR to a folder that holds them)')


@pytest.fixture(scope='module')
def raw_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp('wikitext-103-raw')
    (folder / 'wiki.train.raw').write_text(ARTICLE * 40, encoding='utf-8')
    (folder / 'wiki.valid.raw').write_text(ARTICLE * 8, encoding='utf-8')
    return folder


@pytest.fixture(scope='module')
def word_data(raw_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp('wikitext_word')
    wikitext_prepare.main(['--input', str(raw_folder), '--out_dir', str(out)])
    return out


def test_word_tokenizer_round_trip(word_data, raw_folder):
    with open(word_data / 'meta.json') as f:
        meta = json.load(f)
    assert meta['tokenizer'] == 'word' and meta['itos'][0] == '<unk>' and meta['vocab_size'] == len(meta['itos'])
    for split, name in (('train', 'wiki.train.raw'), ('val', 'wiki.valid.raw')):
        ids = np.fromfile(word_data / f'{split}.bin', dtype=np.uint16)
        # every token but the file's final whitespace run (' \n \n', seen once) is in the vocabulary
        assert ids[-1] == 0 and (ids[:-1] > 0).all()
        assert ''.join(meta['itos'][i] for i in ids[:-1]) + ' \n \n' == (raw_folder / name).read_text(encoding='utf-8')
    # whitespace runs, word runs and single punctuation marks are the tokens
    assert re.findall(meta['pattern'], ' @-@ role') == [' ', '@', '-', '@', ' ', 'role']
    assert {' \n \n ', 'Valkyria', '(', '3'} <= set(meta['itos'])


def test_words_seen_once_become_unk(tmp_path):
    encode, itos = wikitext_prepare.word_tokenizer('a a b b c')
    assert 'c' not in itos and encode('a c zzz') == [itos.index('a'), itos.index(' '), 0, itos.index(' '), 0]


def test_gpt2_tokenizer_round_trip(raw_folder, tmp_path):
    enc = gpt2_or_skip()
    wikitext_prepare.main(['--input', str(raw_folder), '--out_dir', str(tmp_path), '--tokenizer=gpt2'])
    ids = np.fromfile(tmp_path / 'val.bin', dtype=np.uint16)
    assert enc.decode(ids.tolist()) == (raw_folder / 'wiki.valid.raw').read_text(encoding='utf-8')


def test_paper_44m_trains_end_to_end_on_cpu(word_data, tmp_path, capsys):
    # the paper's model with a short context and batch, so that two steps take seconds on a CPU
    train.main(['--config=paper_44m', '--dataset', str(word_data), '--max_iters=2', '--batch_size=2',
                '--block_size=16', '--eval_interval=2', '--eval_iters=1', '--out_dir', str(tmp_path)])
    with open(tmp_path / 'log.jsonl') as f:
        log = [json.loads(line) for line in f]
    model = log[0]['config']['model']
    assert (model['n_layer'], model['n_embd'], model['n_head'], model['n_loop']) == (8, 512, 8, 4)
    # 8 layers of 16 d^2 (attention 4 d^2, SwiGLU 12 d^2) + tied embedding + positions + norm gains
    d, V = 512, model['vocab_size']
    assert log[0]['config']['num_params'] == 8 * (16 * d * d + 2 * d) + V * d + 16 * d + d
    assert [r['step'] for r in log[1:]] == [0, 2] and all(np.isfinite(log[-1]['val_loss']))
    # and samples with the word-level vocabulary stored in its checkpoint
    import sample
    capsys.readouterr()
    sample.main(['--out_dir', str(tmp_path), '--start', ' = Valkyria', '--max_new_tokens=5', '--num_samples=1'])
    assert ' = Valkyria' in capsys.readouterr().out


def steps_from_epochs(epochs, n_tokens, T, global_batch):
    """(steps, windows per epoch) as train.py's resolve_schedule counts them and says so."""
    args, said = types.SimpleNamespace(epochs=epochs, decay_lr=False), []
    train.resolve_schedule(args, n_tokens, T, global_batch, said.append)
    windows = int(re.search(r'x ([\d,]+) windows', said[0]).group(1).replace(',', ''))
    return args.max_iters, windows


def test_epochs_count_windows_at_half_stride_as_the_authors_do():
    # 1,000 tokens in windows of 256 at stride 128: starts 0, 128, ..., 640 (each window needs 257 tokens with
    # its target), so 6 windows an epoch; 4 epochs at 64 windows a step is one step, at 2 a step twelve
    assert steps_from_epochs(4, 1000, 256, 64) == (1, 6)
    assert steps_from_epochs(4, 1000, 256, 2) == (12, 6)
    # about twice the steps of one pass over the tokens, for a long split
    steps, windows = steps_from_epochs(1, 10_000_000, 256, 64)
    assert windows == pytest.approx(2 * 10_000_000 / 256, rel=1e-3)


def test_paper_config_prints_its_step_count(word_data, tmp_path, capsys):
    # the paper's epochs-to-steps path with a small model: the 44M-parameter one trains in the test above
    train.main(['--config=paper_44m', '--dataset', str(word_data), '--epochs=0.05', '--batch_size=2',
                '--block_size=64', '--n_layer=1', '--n_embd=64', '--n_head=2', '--eval_interval=100', '--eval_iters=1',
                '--out_dir', str(tmp_path)])
    n = len(np.fromfile(word_data / 'train.bin', dtype=np.uint16))
    steps, windows = steps_from_epochs(0.05, n, 64, 2)
    assert (f"0.05 epochs x {windows:,} windows ({n:,} tokens in windows of 64 at stride 32) / 2 per step = "
            f"{steps:,} steps") \
        in capsys.readouterr().out
    with open(tmp_path / 'log.jsonl') as f:
        assert [json.loads(line) for line in f][-1]['step'] == steps
    with pytest.raises(SystemExit, match='not both'):
        train.get_parser().parse(['--config=paper_44m', '--epochs=1', '--max_iters=5'])[0]
