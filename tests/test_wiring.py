"""The training step and the model's wiring, each checked directly: a test here fails within seconds of the
behaviour breaking, and its name says which behaviour it was. (The end-to-end tests elsewhere would notice
some of these too, minutes later and under another name.)"""

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train
from data.common import write_dataset
from lab.stats import paired_stats
from lab.designs import CHOICES, DesignConfig, DesignedGPT
from looped import Readout

READOUTS = CHOICES['readout']
TINY = ['--n_layer=1', '--n_embd=32', '--n_head=2', '--n_loop=2', '--block_size=16', '--eval_iters=2',
        '--log_interval=1', '--device=cpu', '--compile=False']


def tiny(**kw):
    cfg = dict(vocab_size=65, block_size=16, n_embd=32, n_head=2, n_layer=1, n_loop=2)
    return DesignedGPT(DesignConfig(**{**cfg, **kw}))


@pytest.fixture
def optimizer_steps(monkeypatch):
    """Every AdamW step train.py takes, as (parameter values, gradients) seen just before the update, in the
    optimizer's own parameter order."""
    seen, real = [], torch.optim.AdamW.step

    def spy(self, *a, **k):
        params = [p for g in self.param_groups for p in g['params']]
        seen.append(([p.detach().clone() for p in params], [p.grad.detach().clone() for p in params]))
        return real(self, *a, **k)
    monkeypatch.setattr(torch.optim.AdamW, 'step', spy)
    return seen


@pytest.fixture
def train_batches(monkeypatch):
    """Every training batch train.py draws, in order."""
    seen, real = [], train.get_batch  # train.py's loop calls it for training windows only

    def spy(*args):
        x, y = real(*args)
        seen.append((x.clone(), y.clone()))
        return x, y
    monkeypatch.setattr(train, 'get_batch', spy)
    return seen


def one_step(data, tmp_path, *flags):
    train.main(['--dataset', data, '--out_dir', str(tmp_path / 'run'), *TINY, '--max_iters=1', '--eval_interval=1',
                *flags])


def reference_gradients(params, x, y, **cfg):
    """The gradient of the mean per-loop loss over the whole batch (x, y), at the given parameter values."""
    model = tiny(vocab_size=params[0].shape[0], **cfg)  # wte comes first: its rows are the vocabulary
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
    _, loss, _ = model(x, y)
    loss.backward()
    return [p.grad for p in model.parameters()]


# ---- batches and evaluation data ------------------------------------------------------------------------------

def test_batch_targets_are_the_next_tokens_of_the_inputs(small_data):
    _, splits, _ = train.load_data(small_data, 16)
    tokens = torch.from_numpy(splits['train'].astype(np.int64))
    starts = torch.randint(len(tokens) - 17, (4,), generator=torch.Generator().manual_seed(0))
    for x, y in [train.get_batch(splits['train'], starts, 16, 'cpu'),
                 *train.eval_batches(splits, 2, 4, 16, 'cpu')['train']]:
        assert x.shape == y.shape == (len(x), 16)
        assert torch.equal(y[:, :-1], x[:, 1:])
        for row_x, row_y in zip(x, y):  # each window is a contiguous stretch of the split, its target one further
            starts = [s for s in range(len(tokens) - 16) if torch.equal(tokens[s:s + 16], row_x)]
            assert any(torch.equal(tokens[s + 1:s + 17], row_y) for s in starts)


def test_evaluation_reads_the_validation_split(tmp_path, monkeypatch):
    """train.py's validation loss is computed on val.bin's windows (and its train loss on train.bin's): on
    splits that differ at any start, so that reading the wrong one at the right places shows."""
    data = str(tmp_path / 'data')
    os.makedirs(data)
    write_dataset(data, np.arange(400) % 5, (2 * np.arange(200) + 1) % 5,
                  {'vocab_size': 5, 'itos': {i: chr(97 + i) for i in range(5)}})
    calls, real = [], train.evaluate

    def spy(model, batches, n_loop, ctx):
        calls.append(batches)
        return real(model, batches, n_loop, ctx)
    monkeypatch.setattr(train, 'evaluate', spy)
    one_step(data, tmp_path, '--batch_size=4')
    _, splits, _ = train.load_data(data, 16)

    def windows(split, n):  # n windows of 16 spread evenly over the split, computed here by hand
        starts = np.linspace(0, len(splits[split]) - 17, n).astype(np.int64)
        return torch.from_numpy(splits[split][starts[:, None] + np.arange(16)].astype(np.int64))
    val, trn = (torch.cat([x for x, _ in batches]) for batches in calls[:2])
    assert not torch.equal(windows('val', len(val)), windows('train', len(val)))  # the splits can be told apart
    assert torch.equal(val, windows('val', len(val))), 'the validation loss did not read the val split'
    assert torch.equal(trn, windows('train', len(trn))), 'the train loss did not read the train split'


def test_evaluate_turns_dropout_off_and_back_on(small_data):
    model = tiny(dropout=0.5).train()
    batches = train.eval_batches(train.load_data(small_data, 16)[1], 2, 4, 16, 'cpu')['val']
    ce1, _ = train.evaluate(model, batches, 2, torch.no_grad())
    assert model.training, 'evaluate() left the model in eval mode: training would continue without dropout'
    ce2, _ = train.evaluate(model, batches, 2, torch.no_grad())
    assert ce1 == ce2, 'two evaluations of the same weights differ: dropout was on during evaluation'
    model.eval()
    with torch.no_grad():
        expected = sum(len(x) * model(x, y, n_loop=2)[2]['ce'] for x, y in batches) / sum(len(x) for x, _ in batches)
    assert np.allclose(ce1, expected.tolist(), rtol=1e-5)


# ---- one optimizer step ---------------------------------------------------------------------------------------

def test_gradient_accumulation_gives_the_gradient_of_one_large_batch(small_data, tmp_path, optimizer_steps,
                                                                     train_batches):
    one_step(small_data, tmp_path, '--batch_size=4', '--grad_accum=2', '--grad_clip=0')
    assert len(train_batches) == 2 and len(optimizer_steps) == 1  # two micro-steps, one update
    x, y = (torch.cat(t) for t in zip(*train_batches))
    params, grads = optimizer_steps[0]
    for got, want in zip(grads, reference_gradients(params, x, y)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('clip', [0.05, 0.0])
def test_gradient_clipping_clips_to_the_flag(small_data, tmp_path, optimizer_steps, train_batches, clip):
    one_step(small_data, tmp_path, '--batch_size=4', f'--grad_clip={clip}')
    params, grads = optimizer_steps[0]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    unclipped = reference_gradients(params, *train_batches[0])
    raw = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in unclipped])).item()
    assert raw > 0.5, raw  # the untouched gradient is far above 0.05, so clipping at 0.05 must act
    if clip:
        assert total == pytest.approx(clip, rel=1e-3), f'clipped norm {total:.5f}, --grad_clip={clip}'
    else:
        assert total == pytest.approx(raw, rel=1e-4), f'--grad_clip=0 (off) changed the norm {raw:.5f} to {total:.5f}'


@pytest.mark.parametrize('init', ['paper', 'gpt2'])
def test_optimizer_parameter_groups_under_each_init(init):
    model = tiny(init=init)
    groups = model.configure_optimizers(0.1, 1e-3, 'cpu').param_groups
    params = list(model.parameters())
    assert sorted(id(p) for g in groups for p in g['params']) == sorted(id(p) for p in params)  # each once
    decayed = {id(p) for g in groups if g['weight_decay'] == 0.1 for p in g['params']}
    if init == 'paper':  # the authors decay everything: embeddings, matrices and norm gains
        assert decayed == {id(p) for p in params}
    else:  # nanoGPT decays the matrices only
        assert decayed == {id(p) for p in params if p.dim() >= 2}
        assert ({id(p) for g in groups if g['weight_decay'] == 0.0 for p in g['params']}
                == {id(p) for p in params if p.dim() < 2})


# ---- the model's wiring ---------------------------------------------------------------------------------------

def test_embedding_is_token_plus_position():
    model = tiny().eval()
    idx = torch.randint(65, (3, 10))
    with torch.no_grad():
        want = model.wte.weight[idx] + model.wpe.weight[:10]
        torch.testing.assert_close(model.embed(idx), want)


@pytest.mark.parametrize('init,tie,tied', [('paper', None, True), ('gpt2', None, False), ('gpt2', True, True),
                                           ('paper', False, False)])
def test_weight_tying_under_each_init(init, tie, tied):
    model = tiny(init=init, tie_weights=tie)
    assert (model.lm_head.weight is model.wte.weight) == tied
    assert model.config.tie_weights == tied
    unique = sum(p.numel() for p in model.parameters())
    assert unique == sum(p.numel() for n, p in model.named_parameters()) and (
        (model.lm_head.weight.numel() if not tied else 0) + model.wte.weight.numel()
        == sum(p.numel() for n, p in model.named_parameters() if n in ('wte.weight', 'lm_head.weight')))


def test_each_readout_kind_is_told_apart_from_every_other():
    """Each readout's output on the same states, at an early loop and at the trained depth, against its formula;
    no two kinds give the same output."""
    torch.manual_seed(0)
    h = torch.randn(2, 5, 32) * torch.tensor([0.5, 40.0]).view(2, 1, 1) + 0.3  # two scales, non-zero mean
    rms = h / h.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    ln = (h - h.mean(-1, keepdim=True)) / (h.var(-1, unbiased=False, keepdim=True) + 1e-6).sqrt()
    s = h.pow(2).mean(-1, keepdim=True).sqrt()
    formula = {'rmsnorm': (rms, rms), 'layernorm': (ln, ln), 'raw': (h, h), 'final_norm': (h, rms),
               'alpha': (h / s.sqrt(), h / s.sqrt())}  # alpha 0.5 and s_ref 1 at the start: s^0.5 * h / s
    assert set(formula) == set(READOUTS)
    outs = {}
    for kind in READOUTS:
        r = Readout(DesignConfig(n_embd=32, n_head=2, n_loop=2, readout=kind))
        with torch.no_grad():
            outs[kind] = (r(h, 1), r(h, 2))
        for got, want, k in zip(outs[kind], formula[kind], (1, 2)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f'{kind} readout at loop {k}')
    for a in READOUTS:
        for b in READOUTS:
            if a < b:
                assert not all(torch.allclose(x, y, rtol=1e-3) for x, y in zip(outs[a], outs[b])), f'{a} == {b}'


@pytest.mark.parametrize('mlp', ['swiglu', 'gelu'])
def test_mlp_activation_under_each_choice(mlp):
    block = tiny(mlp=mlp).blocks[0].mlp
    x = torch.randn(2, 4, 32) * 3
    u = block.c_fc(x)
    want = block.c_proj(F.silu(u) * block.c_up(x) if mlp == 'swiglu' else F.gelu(u))
    assert hasattr(block, 'c_up') == (mlp == 'swiglu')
    torch.testing.assert_close(block(x), want)
    others = ([F.relu(u), F.gelu(u, approximate='tanh'), F.silu(u)] if mlp == 'gelu'
              else [F.gelu(u) * block.c_up(x), F.silu(u)])
    for other in others:  # the inputs are large enough that the activations differ visibly
        assert not torch.allclose(block(x), block.c_proj(other), atol=1e-4)


# ---- the paired statistics ------------------------------------------------------------------------------------

def test_paired_standard_error_is_the_sample_std_over_root_n():
    d = np.array([[0.1, 1.0], [0.3, 1.0], [0.2, 4.0], [0.6, 2.0]])
    got = paired_stats(d)
    sd = np.sqrt(((d - d.mean(0)) ** 2).sum(0) / 3)  # n - 1 in the denominator
    np.testing.assert_allclose(got['se'], sd / 2, rtol=1e-12)
    np.testing.assert_allclose(got['mean'], d.mean(0))
    assert got['df'] == 3 and got['t'] == pytest.approx(3.182446, abs=1e-5)  # the printed t table, 97.5%, df 3
    np.testing.assert_allclose(got['hi'] - got['lo'], 2 * got['t'] * sd / 2)
    assert math.isnan(paired_stats(d[:1])['se'][0])
