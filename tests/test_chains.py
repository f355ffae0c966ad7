"""The chained-assignment dataset (data/chains/prepare.py) and the answer metrics (lab/answers.py): every answer of
every query of a prepared set (both --queries formats, both --lengths) re-solved by a resolver written here (not
prepare.py's), with its hop count; the hop knob, determinism, the knob checks; answer_metrics' numbers, overall and
per hop count, on hand-made models whose right answers are known; and the command line on a two-step run of
train.py."""

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.chains import prepare as chains
from data.common import PrepareError
from data.loader import read_dataset
from lab import answers
from tests.conftest import ROOT


def lookup(body, letter):
    """This test's own resolver: (answer, hops) of letter in the assignments 'a=b;...;c=4', by repeated
    substitution over the pairs."""
    pairs = [tuple(a.split('=')) for a in body.split(';')]
    assert all(len(p) == 2 and len(p[0]) == 1 and len(p[1]) == 1 for p in pairs), body
    lefts = [p[0] for p in pairs]
    assert len(set(lefts)) == len(lefts), f"a letter assigned twice: {body}"
    current, hops = letter, 0
    while not current.isdigit():
        (current,) = [right for left, right in pairs if left == current]  # exactly one assignment
        hops += 1
        assert hops <= len(pairs), f"a loop: {body}"
    return current, hops


def resolve(line):
    """(answer, hops) of a single-query line 'a=b;...;c=4?a=' (the question alone)."""
    body, query = line.split('?')
    return lookup(body, query[0])


def examples(folder, split):
    """(meta, [lines without the newline]) of a prepared split, decoded through meta.json's own vocabulary."""
    meta, splits, _ = read_dataset(folder)
    text = ''.join(meta['itos'][i] for i in splits[split])
    L = meta['example_len']
    assert len(text) % L == 0
    lines = [text[i:i + L] for i in range(0, len(text), L)]
    assert all(line.endswith('\n') and line.count('\n') == 1 for line in lines)
    return meta, [line[:-1] for line in lines]


@pytest.fixture(scope='module')
def small(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp('chains'))
    chains.prepare(folder, hops=3, chains=3, n_train=300, n_val=60, seed=5, queries='one')
    return folder


@pytest.fixture(scope='module')
def small_all(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp('chains_all'))
    chains.prepare(folder, hops=3, chains=3, n_train=300, n_val=60, seed=5)  # --queries=all, the default
    return folder


def test_every_answer_of_every_query_is_what_the_chain_gives(small_all):
    n = 3 * 3
    for split, count in (('train', 300), ('val', 60)):
        meta, lines = examples(small_all, split)
        assert len(lines) == count and meta['queries'] == 'all'
        offsets = meta['answer_offsets']
        assert offsets == [4 * n + 1 + 3 * i for i in range(n)] and meta['example_len'] == 7 * n
        hops_by_answer = answers.hop_counts(np.array([chains.STOI[c] for c in '\n'.join(lines) + '\n']), meta)
        assert len(hops_by_answer) == count * n
        for j, line in enumerate(lines):
            body = line[:4 * n - 1]  # the assignments alone: the answers are resolved without the queries
            assert line[4 * n - 1] == '?' and len(body.split(';')) == n
            queried = [line[o - 1] for o in offsets]
            assert sorted(queried) == sorted(a[0] for a in body.split(';'))  # every letter once
            assert all(line[o - 2] == '?' for o in offsets)
            found = [lookup(body, letter) for letter in queried]
            assert [line[o] for o in offsets] == [a for a, _ in found]
            assert sorted(h for _, h in found) == [h for h in (1, 2, 3) for _ in range(3)]  # each hop per chain
            assert chains.solve(line) == found  # prepare.py's resolver, which lab/answers.py uses, agrees
            assert hops_by_answer[j * n:(j + 1) * n].tolist() == [h for _, h in found]
            assert len(set(c for c in body if c.isdigit())) == 3
        # the order of the queries is drawn per example: the hop count at an offset varies
        assert len({line[offsets[0] - 1] == line[:4 * n - 1][-3] for line in lines}) == 2
        assert len(set(hops_by_answer[::n].tolist())) == 3


def test_every_answer_is_what_the_chain_gives(small):
    for split, n in (('train', 300), ('val', 60)):
        meta, lines = examples(small, split)
        assert len(lines) == n
        offset = meta['answer_offset']
        for line in lines:
            answer, hops = resolve(line[:offset])  # the question alone, up to '?v='
            assert line[offset] == answer and line[offset - 1] == '=' and line[offset - 3] == '?'
            assert hops == 3
            assert len(line[:offset - 3].split(';')) == 3 * 3  # chains x hops assignments
            assert len(set(c for c in line if c.isdigit())) == 3  # each chain its own digit


def test_meta_records_layout_and_knobs(small):
    meta = json.load(open(os.path.join(small, 'meta.json')))
    assert (meta['example_len'], meta['answer_offset'], meta['answer_offsets']) == (4 * 9 + 4, 4 * 9 + 2, [38])
    assert {k: meta[k] for k in ('hops', 'min_hops', 'chains', 'seed', 'n_train', 'n_val', 'tokenizer', 'task',
                                 'queries')} == \
        {'hops': 3, 'min_hops': 3, 'chains': 3, 'seed': 5, 'n_train': 300, 'n_val': 60, 'tokenizer': 'char',
         'task': 'chains', 'queries': 'one'}
    assert meta['vocab_size'] == len(meta['itos']) == 40


def test_meta_records_all_queries_layout(small_all):
    meta = json.load(open(os.path.join(small_all, 'meta.json')))
    assert meta['queries'] == 'all' and meta['example_len'] == 63 and 'answer_offset' not in meta
    assert meta['answer_offsets'] == list(range(37, 63, 3)) and answers.layout(meta) == (63, meta['answer_offsets'])


@pytest.mark.parametrize('hops', [1, 2, 5])
def test_the_knob_sets_the_hops(tmp_path, hops):
    chains.prepare(str(tmp_path / 'one'), hops=hops, chains=2, n_train=50, n_val=10, seed=1, queries='one')
    meta, lines = examples(str(tmp_path / 'one'), 'val')
    assert meta['example_len'] == 4 * 2 * hops + 4
    assert {resolve(line[:meta['answer_offset']])[1] for line in lines} == {hops}
    assert all(line[meta['answer_offset']] == resolve(line[:meta['answer_offset']])[0] for line in lines)
    chains.prepare(str(tmp_path / 'all'), hops=hops, chains=2, n_train=50, n_val=10, seed=1)
    meta, lines = examples(str(tmp_path / 'all'), 'val')
    n = 2 * hops
    assert meta['example_len'] == 7 * n
    for line in lines:
        found = [lookup(line[:4 * n - 1], line[o - 1]) for o in meta['answer_offsets']]
        assert sorted(h for _, h in found) == sorted(list(range(1, hops + 1)) * 2)
        assert [line[o] for o in meta['answer_offsets']] == [a for a, _ in found]


def test_random_lengths_query_every_letter_of_chains_of_any_length(tmp_path):
    chains.prepare(str(tmp_path), hops=3, chains=2, n_train=5, n_val=200, seed=6, lengths='random')
    meta, lines = examples(str(tmp_path), 'val')
    n, offsets = 6, meta['answer_offsets']
    assert meta['lengths'] == 'random' and meta['example_len'] == 42 and offsets == list(range(25, 42, 3))
    sizes = set()
    for line in lines:
        body = line[:4 * n - 1]
        queried = [line[o - 1] for o in offsets]
        assert sorted(queried) == sorted(a[0] for a in body.split(';'))
        found = [lookup(body, letter) for letter in queried]
        assert [line[o] for o in offsets] == [a for a, _ in found] and chains.solve(line) == found
        by_digit = {}
        for a, h in found:
            by_digit.setdefault(a, []).append(h)
        assert len(by_digit) == 2 and all(sorted(hs) == list(range(1, len(hs) + 1)) for hs in by_digit.values())
        sizes.add(tuple(sorted(len(hs) for hs in by_digit.values())))
    assert {(3, 3), (2, 4), (1, 5)} <= sizes  # the chains' lengths vary, the example's does not


def test_min_hops_mixes_lengths_in_one_layout(tmp_path):
    chains.prepare(str(tmp_path), hops=4, chains=3, min_hops=2, n_train=400, n_val=10, seed=3, queries='one')
    meta, lines = examples(str(tmp_path), 'train')
    found = [resolve(line[:meta['answer_offset']]) for line in lines]
    assert {h for _, h in found} == {2, 3, 4}
    assert all(line[meta['answer_offset']] == a for line, (a, _) in zip(lines, found))
    assert meta['example_len'] == 52
    # prepare.py's own solver (lab/answers.py's per-hop breakdown uses it) agrees with this one
    assert all(chains.solve(line) == [resolve(line[:meta['answer_offset']])] for line in lines)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    def blob(folder, seed):
        chains.prepare(folder, hops=2, chains=3, n_train=100, n_val=20, seed=seed)
        return [open(os.path.join(folder, f), 'rb').read() for f in ('train.bin', 'val.bin', 'meta.json')]
    a, b, c = blob(str(tmp_path / 'a'), 7), blob(str(tmp_path / 'b'), 7), blob(str(tmp_path / 'c'), 8)
    assert a == b
    assert a[0] != c[0] and a[1] != c[1]
    assert blob(str(tmp_path / 'a'), 7) == a  # run again in place: the same files


@pytest.mark.parametrize('knobs, words', [({'hops': 0}, '--hops=0'), ({'hops': 9, 'chains': 3}, '27 letters'),
                                          ({'chains': 1}, '--chains=1'), ({'chains': 11, 'hops': 2}, '--chains=11'),
                                          ({'min_hops': 5}, '--min_hops=5'), ({'n_val': 0}, '--n_val=0'),
                                          ({'queries': 'some'}, '--queries=some'),
                                          ({'hops': 3, 'min_hops': 1}, 'applies to --queries=one'),
                                          ({'lengths': 'random', 'queries': 'one'}, 'applies to --queries=all'),
                                          ({'lengths': 'long'}, '--lengths=long')])
def test_bad_knobs_fail_in_one_line(tmp_path, knobs, words):
    with pytest.raises(PrepareError, match=words):
        chains.prepare(str(tmp_path), **{'n_train': 5, 'n_val': 5, **knobs})
    assert not os.listdir(tmp_path)


# ---- lab/answers.py

class Table(torch.nn.Module):
    """A stand-in model: its state is the input ids; at depth k the head puts probability q on choice[k - 1] after
    every '=' (after='?': on every token that follows a '?', the queried letter of --queries=all) and is uniform over
    the vocabulary elsewhere (choice[k - 1] None: uniform there too)."""

    def __init__(self, choice, q=0.9, block_size=24, after='='):
        super().__init__()
        self.config = SimpleNamespace(n_loop=len(choice), block_size=block_size)
        self.choice, self.q, self.V, self.after = choice, q, len(chains.ITOS), after
        self.dummy = torch.nn.Parameter(torch.zeros(1))  # the device is read from the parameters

    def embed(self, x):
        return x

    def loops(self, e, n_loop):
        for k in range(1, n_loop + 1):
            yield k, e

    def exit_input(self, h, k):
        return h, k

    def head_loss(self, hk, targets=None):
        return self.lm_head(hk), None  # as LoopedGPT.head_loss without targets

    def lm_head(self, hk):
        h, k = hk
        p = torch.full((*h.shape, self.V), 1 / self.V)
        c = self.choice[min(k, len(self.choice)) - 1]
        if c is not None:
            at = h == chains.STOI['=']
            if self.after == '?':
                at = torch.zeros_like(at)
                at[..., 1:] = h[..., :-1] == chains.STOI['?']
            p[at] = (1 - self.q) / (self.V - 1)
            p[at, chains.STOI[c]] = self.q
        return p.log()


def hand_made(answers_digits):
    """Token ids of examples (hops 1, chains 2) whose answers are the given digits, and their meta."""
    lines = []
    for i, d in enumerate(answers_digits):
        other = '9' if d != '9' else '8'
        lines.append(f"a={d};b={other}?a={d}\n" if i % 2 else f"b={other};a={d}?a={d}\n")
    L, (offset,) = chains.layout(1, 2, 'one')
    assert all(len(line) == L and line[offset] == d for line, d in zip(lines, answers_digits))
    ids = np.array([chains.STOI[c] for c in ''.join(lines)], dtype=np.uint16)
    return ids, {'example_len': L, 'answer_offset': offset, 'task': 'chains', 'hops': 1, 'min_hops': 1}


def test_answer_accuracy_and_loss_are_exact():
    ids, meta = hand_made(['7', '7', '7', '3', '7', '5', '7', '7'])  # 6 of 8 are '7', one '3'
    q, V = 0.9, len(chains.ITOS)
    m = answers.answer_metrics(Table(['7', '3', '7', None], q), ids, meta, n_loop=4, batch_size=3)
    assert m['n_answers'] == 8 and m['depths'] == [1, 2, 3, 4]
    np.testing.assert_allclose(m['answer_acc'], [6 / 8, 1 / 8, 6 / 8, 0.0])  # uniform: argmax is id 0, '\n'
    right, wrong = -math.log(q), -math.log((1 - q) / (V - 1))
    np.testing.assert_allclose(m['answer_ce'], [(6 * right + 2 * wrong) / 8, (right + 7 * wrong) / 8,
                                                (6 * right + 2 * wrong) / 8, math.log(V)], rtol=1e-5)
    assert m['n_tokens'] == len(ids) - 1  # every token but the first is a target, the last one's target unknown
    assert m['token_ce'][3] == pytest.approx(math.log(V), rel=1e-6)
    assert m['correct'].shape == (8, 4) and m['correct'][:, 0].tolist() == [True] * 3 + [False, True, False, True, True]


def test_all_right_and_all_wrong():
    ids, meta = hand_made(['4'] * 10)
    m = answers.answer_metrics(Table(['4', '5'], q=1 - 1e-6, block_size=128), ids, meta)
    assert m['depths'] == [1, 2, 3, 4]  # 2K by default, the last choice held past K
    assert m['answer_acc'].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert m['answer_ce'][0] < 1e-5 and m['answer_ce'][1] > 10


def test_windows_start_at_examples_and_hold_whole_ones():
    ids, meta = hand_made([str(i % 10) for i in range(23)])
    L, offset = meta['example_len'], meta['answer_offset']
    x, y, mask = answers.answer_windows(ids, L, offset, block_size=40, max_examples=None)
    assert x.shape == (23 // 3, 3 * L)  # 3 whole examples of 12 in 40 tokens; the 2 left over are dropped
    assert ((x[:, ::L] == chains.STOI['b']) | (x[:, ::L] == chains.STOI['a'])).all()
    assert (x[mask] == chains.STOI['=']).all() and mask.sum() == 21
    assert [chains.ITOS[i] for i in y[mask].tolist()] == [str(i % 10) for i in range(21)]
    with pytest.raises(ValueError, match='longer than'):
        answers.answer_windows(ids, L, offset, block_size=L - 1)
    with pytest.raises(ValueError, match='no example_len'):
        answers.layout({'vocab_size': 40})


def test_accuracy_per_hop_count(tmp_path):
    chains.prepare(str(tmp_path), hops=3, chains=2, min_hops=1, n_train=5, n_val=90, seed=2, queries='one')
    meta, splits, _ = read_dataset(str(tmp_path))
    hops = answers.hop_counts(splits['val'], meta)
    assert len(hops) == 90 and set(hops.tolist()) == {1, 2, 3}
    m = answers.answer_metrics(Table([None], block_size=128), splits['val'], meta, by_hops=hops)
    assert sum(n for n, _ in m['by_hops'].values()) == m['n_answers'] == 90 - 90 % (128 // meta['example_len'])


def test_every_answer_counted_per_hop_with_all_queries(tmp_path):
    """--queries=all: every answer of every example is scored, and the per-hop accuracies are exact, against what
    this test's resolver says of each line."""
    chains.prepare(str(tmp_path), hops=3, chains=2, n_train=5, n_val=50, seed=4)
    meta, splits, _ = read_dataset(str(tmp_path))
    _, lines = examples(str(tmp_path), 'val')
    n, offsets = 6, meta['answer_offsets']
    hops = answers.hop_counts(splits['val'], meta)
    m = answers.answer_metrics(Table(['7', None], q=0.9, block_size=128, after='?'), splits['val'], meta,
                               by_hops=hops, batch_size=4)
    used = 50 - 50 % (128 // 42)  # 3 examples a window: 48 of 50
    assert m['n_answers'] == used * n and m['correct'].shape == (used * n, 4)
    truth = [lookup(line[:4 * n - 1], line[o - 1]) for line in lines[:used] for o in offsets]
    is7 = np.array([a == '7' for a, _ in truth])
    h = np.array([k for _, k in truth])
    assert hops[:used * n].tolist() == h.tolist()
    assert m['correct'][:, 0].tolist() == is7.tolist() and not m['correct'][:, 1:].any()
    assert m['answer_acc'][0] == pytest.approx(is7.mean())
    assert 0 < is7.mean() < 1
    V = len(chains.ITOS)
    assert m['answer_ce'][0] == pytest.approx(is7.mean() * -math.log(0.9) + (1 - is7.mean()) * -math.log(0.1 / (V - 1)),
                                              rel=1e-5)
    assert m['answer_ce'][1] == pytest.approx(math.log(V), rel=1e-5)
    assert sorted(m['by_hops']) == [1, 2, 3]
    for k, (count, acc) in m['by_hops'].items():
        assert count == (h == k).sum() == used * 2
        assert acc[0] == pytest.approx(is7[h == k].mean()) and acc[1] == 0


def test_command_line_on_a_trained_run(tmp_path):
    data, run, out = str(tmp_path / 'data'), str(tmp_path / 'run'), str(tmp_path / 'out')
    chains.prepare(data, hops=2, chains=2, n_train=200, n_val=40, seed=1)  # --queries=all: 4 answers of 28
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    train = subprocess.run([sys.executable, 'train.py', f'--dataset={data}', '--max_iters=2', '--eval_interval=2',
                            '--eval_iters=1', '--n_layer=1', '--n_embd=16', '--n_head=2', '--n_loop=2',
                            '--block_size=64', '--batch_size=4', '--device=cpu', f'--out_dir={run}'],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert train.returncode == 0, train.stderr
    r = subprocess.run([sys.executable, '-m', 'lab.answers', run, f'--out={out}', '--max_examples=21'],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert '80 answers' in r.stdout and 'acc 2 hops' in r.stdout  # 2 examples of 28 in 64: 10 windows, 20 examples
    rows = open(os.path.join(out, 'answers.csv')).read().splitlines()
    assert rows[0] == 'run,K,depth,answer_ce,answer_acc,token_ce,acc 1 hops,acc 2 hops' and len(rows) == 1 + 4
    bad = subprocess.run([sys.executable, '-m', 'lab.answers', str(tmp_path / 'nothing')],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and bad.stderr.count('\n') == 1 and 'lab.answers: error' in bad.stderr
