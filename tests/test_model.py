"""The model's math: readout scale invariance, radial gradients, recurrence variants, loss bookkeeping."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lab.engine import exit_passes, generate
from lab.designs import DesignConfig, DesignedGPT
from looped import AlphaNorm, Readout

torch.set_default_dtype(torch.float32)


def tiny(**kw):
    base = dict(vocab_size=11, block_size=16, n_embd=32, n_head=4, n_layer=2, n_loop=3)
    torch.manual_seed(0)
    return DesignedGPT(DesignConfig(**{**base, **kw}))


def batch(B=2, T=16, V=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(V, (B, T), generator=g), torch.randint(V, (B, T), generator=g)


@pytest.mark.parametrize('readout', ['rmsnorm', 'layernorm', 'raw', 'final_norm'])
def test_readout_scale_invariance(readout):
    """rmsnorm/layernorm give the same logits for h and a*h; raw does not; final_norm is raw before loop K."""
    model = tiny(readout=readout)
    h = torch.randn(2, 5, 32) * 3
    K = model.config.n_loop
    for k in range(1, K + 1):
        same = [torch.allclose(model.lm_head(model.readout(a * h, k)), model.lm_head(model.readout(h, k)),
                               rtol=1e-4, atol=1e-4)
                for a in (0.1, 7.0, 1000.0)]
        invariant = readout in ('rmsnorm', 'layernorm') or (readout == 'final_norm' and k == K)
        assert all(same) if invariant else not any(same), (readout, k)


@pytest.mark.parametrize('readout', ['rmsnorm', 'layernorm', 'raw'])
def test_radial_gradient(readout):
    """<dCE/dh, h> is ~0 for scale-invariant readouts (the blind spot) and clearly not for raw."""
    model = tiny(readout=readout).double()
    h = (torch.randn(4, 8, 32, dtype=torch.float64) * 5).requires_grad_()
    targets = torch.randint(11, (4 * 8,))
    logits = model.lm_head(model.readout(h, model.config.n_loop))
    F.cross_entropy(logits.view(-1, 11), targets).backward()
    cos = F.cosine_similarity(h.grad, h.detach(), dim=-1).abs()  # (4, 8): one per token
    if readout == 'raw':
        assert cos.mean() > 1e-2
    else:
        assert cos.max() < 1e-5  # zero but for the norm's epsilon


def capture_states(model):
    """Keep every loop's h_k (the last block's output) with its gradient retained."""
    states = []

    def hook(module, inputs, output):
        output.retain_grad()
        states.append(output)
    model.blocks[-1].register_forward_hook(hook)
    return states


def test_penalty_gradient_is_radial():
    """The penalty's own gradient at h_K is 2 * lambda / (K * B * T * d) * h_K: parallel to h_K."""
    lam, x, y = 0.5, *batch()
    grads = {}
    for penalty in (0.0, lam):
        model = tiny(norm_penalty=penalty, supervision='terminal')
        states = capture_states(model)
        model(x, y)[1].backward()
        grads[penalty] = states[-1].grad
        h_K = states[-1].detach()
    diff = grads[lam] - grads[0.0]
    K, (B, T, d) = 3, h_K.shape
    assert torch.allclose(diff, 2 * lam / (K * B * T * d) * h_K, rtol=1e-4, atol=1e-9)
    # and without the penalty, an rmsnorm readout leaves no radial gradient on the last state
    assert F.cosine_similarity(grads[0.0], h_K, dim=-1).abs().max() < 1e-3


def pass_inputs(model, x, scale):
    """What each pass of model.loops starts from, and the states it yields, when every pass's output is
    multiplied by scale (its loop_pass wrapped on the instance)."""
    inputs, run = [], type(model).loop_pass

    def scaled(h, e, k, n_loop):
        inputs.append(h)
        return scale * run(model, h, e, k, n_loop)
    model.loop_pass = scaled
    try:
        states = [h for _, h in model.loops(model.embed(x), model.config.n_loop)]
    finally:
        del model.loop_pass
    return inputs, states


def test_normed_recurrence_starts_each_pass_at_the_gain():
    """'normed': the next pass's input has RMS equal to the inter-loop norm's gain whatever the scale of the
    previous output; 'residual': the previous output itself, scale and all. No norm before pass 1."""
    x, _ = batch()
    for recurrence in ('normed', 'residual'):
        model = tiny(recurrence=recurrence).eval()
        if recurrence == 'normed':
            model.inter_norm.weight.data.fill_(2.5)
        for a in (0.1, 1.0, 100.0):
            with torch.no_grad():
                inputs, states = pass_inputs(model, x, a)
            assert torch.equal(inputs[0], model.embed(x))
            with torch.no_grad():  # and pass 1 really runs on the embedding itself, not on a normalized copy
                assert torch.allclose(states[0], a * model.loop_pass(model.embed(x), model.embed(x), 1, 1),
                                      rtol=1e-5, atol=1e-6)
            for h_in, h_prev in zip(inputs[1:], states):
                rms = h_in.pow(2).mean(-1).sqrt()
                if recurrence == 'normed':
                    assert torch.allclose(rms, torch.full_like(rms, 2.5), rtol=1e-4)
                else:
                    assert torch.equal(h_in, h_prev)


def test_normed_recurrence_reads_out_and_logs_the_pre_norm_state():
    """The readout, the penalty and hidden_norm see pass k's output before the inter-loop norm, so with a raw
    readout the loss does change with the scale of h even under 'normed' recurrence."""
    x, y = batch()
    model = tiny(readout='raw', recurrence='normed').eval()
    with torch.no_grad():
        losses = [model.loop_loss(pass_inputs(model, x, a)[1][-1], 3, y)[1].item() for a in (1.0, 10.0)]
    assert abs(losses[0] - losses[1]) > 0.1, losses
    model = tiny(recurrence='normed', norm_penalty=0.01)
    states = capture_states(model)
    _, loss, stats = model(x, y)
    assert torch.allclose(stats['hidden_norm'], torch.stack([h.norm(dim=-1).mean() for h in states]), rtol=1e-5)
    assert not torch.allclose(stats['hidden_norm'], torch.full((3,), 32 ** 0.5), rtol=1e-2)  # not normalized
    expected = stats['ce'].mean() + 0.01 * torch.stack([h.pow(2).mean() for h in states]).mean()
    assert torch.allclose(loss, expected, rtol=1e-5)


def test_the_recurrence_is_written_once(monkeypatch):
    """forward, generate and lab/diagnose.py all run the passes through LoopedGPT.loops: change it, and all three
    change."""
    from lab import diagnose
    x, y = batch()
    model = tiny(readout='raw').eval()

    def outputs():
        torch.manual_seed(0)
        _, loss, stats = model(x, y)
        sampled, _ = generate(model, x[:, :4], max_new_tokens=8)
        ce = diagnose.per_token_depth_stats(model, x, y, 3)[0]
        return stats['hidden_norm'], loss, sampled, ce
    before = outputs()
    original = DesignedGPT.loops

    def flipped(self, h, n_loop):  # the same recurrence, every state flipped and tripled
        for k, h_k in original(self, h, n_loop):
            yield k, -3 * h_k
    monkeypatch.setattr(DesignedGPT, 'loops', flipped)
    after = outputs()
    assert torch.allclose(after[0], 3 * before[0], rtol=1e-5)   # forward's statistics
    assert not torch.allclose(after[1], before[1])              # forward's loss
    assert not torch.equal(after[2], before[2])                  # generate
    assert not np.allclose(after[3], before[3])                  # a diagnostic


def test_alpha_one_is_exactly_the_raw_readout():
    h = torch.randn(2, 5, 32) * 40
    raw, alpha = tiny(readout='raw'), tiny(readout='alpha', alpha=1.0)
    alpha.readout.norm.log_s_ref.data.fill_(1.7)  # s_ref is irrelevant at alpha = 1
    alpha.lm_head.weight.data.copy_(raw.lm_head.weight.data)
    assert torch.equal(alpha.lm_head(alpha.exit_input(h, 1)), raw.lm_head(raw.exit_input(h, 1)))


@pytest.mark.parametrize('a', [0.0, 0.3, 0.5, 1.0])
def test_alpha_readout_scales_as_a_power(a):
    """AlphaNorm(c * h) = c^alpha * AlphaNorm(h) with s_ref fixed (alpha = 0: scale-invariant), and the output is
    s_ref^(1 - alpha) * s^alpha * h / s by its definition."""
    norm = AlphaNorm(DesignConfig(readout='alpha', alpha=a, n_embd=32, n_head=4))
    norm.log_s_ref.data.fill_(0.4)
    h = torch.randn(3, 7, 32, dtype=torch.float64) * 3
    s = h.pow(2).mean(-1, keepdim=True).sqrt()
    assert torch.allclose(norm(h), 0.4 ** 0 * torch.exp(torch.tensor(0.4)) ** (1 - a) * s ** a * h / s)
    for c in (0.1, 7.0, 1000.0):
        assert torch.allclose(norm(c * h), c ** a * norm(h), rtol=1e-6)  # alpha is a float32 scalar


def test_alpha_logits_scale_as_a_power_through_the_head():
    """logits(c * h) = c^alpha * logits(h) with s_ref fixed, through the model's own (linear) LM head."""
    model = tiny(readout='alpha', alpha=0.3).double()
    h = torch.randn(2, 5, 32, dtype=torch.float64) * 3
    for c in (0.1, 7.0, 1000.0):
        assert torch.allclose(model.lm_head(model.exit_input(c * h, 3)),
                              c ** 0.3 * model.lm_head(model.exit_input(h, 3)), rtol=1e-6)


def test_learned_alpha_starts_at_half_and_its_gradients_match_finite_differences():
    model = tiny(readout='alpha')
    norm = model.readout.norm
    assert norm.alpha().item() == 0.5 and norm.alpha_logit.requires_grad and norm.log_s_ref.requires_grad
    norm = AlphaNorm(model.config).double()
    h = (torch.randn(2, 3, 32, dtype=torch.float64) * 4).requires_grad_()
    logit = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(-0.2, dtype=torch.float64, requires_grad=True)
    f = lambda h, logit, ref: torch.func.functional_call(norm, {'alpha_logit': logit, 'log_s_ref': ref}, (h,))
    assert torch.autograd.gradcheck(f, (h, logit, ref))
    # and training moves alpha: the readout's parameters get gradients through the loss
    x, y = batch()
    model(x, y)[1].backward()
    assert model.readout.norm.alpha_logit.grad.abs() > 0 and model.readout.norm.log_s_ref.grad.abs() > 0


def test_per_loop_and_terminal_losses():
    x, y = batch()
    per_loop, terminal = tiny(supervision='per_loop'), tiny(supervision='terminal')  # same seed: same weights
    _, loss_p, stats_p = per_loop(x, y)
    _, loss_t, stats_t = terminal(x, y)
    assert torch.allclose(stats_p['ce'], stats_t['ce'])
    assert torch.allclose(loss_p, stats_p['ce'].mean())
    assert torch.allclose(loss_t, stats_t['ce'][-1])
    assert not torch.allclose(loss_p, loss_t)
    # terminal supervision: loops before the last still get gradient, but only through the last readout
    loss_t.backward()
    assert terminal.blocks[0].attn.c_attn.weight.grad.abs().sum() > 0


def test_penalty_adds_mean_square_norm():
    x, y = batch()
    _, loss_0, stats = tiny()(x, y)
    model = tiny(norm_penalty=0.01)
    states = capture_states(model)
    _, loss_1, _ = model(x, y)
    expected = 0.01 * torch.stack([h.pow(2).mean() for h in states]).mean()
    assert torch.allclose(loss_1 - loss_0, expected, rtol=1e-4)
    # hidden_norm is the mean over tokens of ||h_k||, before any normalization
    assert torch.allclose(stats['hidden_norm'], torch.stack([h.norm(dim=-1).mean() for h in states]), rtol=1e-5)


def test_more_loops_than_trained():
    model = tiny().eval()
    x, y = batch()
    _, _, s3 = model(x, y)
    _, _, s8 = model(x, y, n_loop=8)
    assert s8['ce'].shape == (8,) and s8['hidden_norm'].shape == (8,)
    assert torch.allclose(s8['ce'][:3], s3['ce'])  # the first loops do not depend on how many follow
    out, loops = generate(model, x[:, :4], max_new_tokens=5, n_loop=8)
    assert out.shape == (2, 9) and loops.tolist() == [[8] * 5] * 2


def test_early_exit_rules():
    logp = torch.log_softmax(torch.tensor([[4.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), dim=-1)  # confident, uniform
    assert exit_passes('confidence', 0.9, logp, None).tolist() == [True, False]
    assert exit_passes('kl', 1.0, logp, None).tolist() == [False, False]             # loop 1: nothing to compare
    assert exit_passes('kl', 1e-6, logp, logp).tolist() == [True, True]               # KL(p || p) = 0
    assert exit_passes('kl', 1e-3, logp, logp.flip(0)).tolist() == [False, False]
    model = tiny().eval()
    x, _ = batch()
    _, always = generate(model, x[:, :4], max_new_tokens=3, exit_rule='confidence', exit_threshold=0.0)
    _, never = generate(model, x[:, :4], max_new_tokens=3, exit_rule='confidence', exit_threshold=1.1)
    assert always.tolist() == [[1] * 3] * 2 and never.tolist() == [[3] * 3] * 2


def test_looped_generate_refuses_an_unknown_exit_rule_rather_than_running_every_loop():
    from looped import LoopedConfig, LoopedGPT
    torch.manual_seed(0)
    model = LoopedGPT(LoopedConfig(vocab_size=11, block_size=16, n_embd=32, n_head=4, n_layer=1,
                                   n_loop=3)).eval()
    x, _ = batch()
    _, depths = model.generate(x[:, :4], 2, exit_rule='confidence', exit_threshold=0.0, return_depths=True)
    assert depths.tolist() == [[1] * 2] * 2  # a known rule exits early
    with pytest.raises(AssertionError, match="'confidnce'"):  # not run at full depth, silently
        model.generate(x[:, :4], 2, exit_rule='confidnce', exit_threshold=0.0)


def test_sdpa_matches_manual_attention():
    x, y = batch()
    sdpa, manual = tiny(attention='sdpa'), tiny(attention='manual')
    manual.load_state_dict(sdpa.state_dict())
    for mode in ('train', 'eval'):  # dropout is 0, so both modes must agree too
        getattr(sdpa, mode)(), getattr(manual, mode)()
        a, b = sdpa(x, y), manual(x, y)
        assert torch.allclose(a[0], b[0], atol=1e-4) and torch.allclose(a[1], b[1], atol=1e-5)


def test_manual_attention_never_calls_the_fused_kernel(monkeypatch):
    """attention='manual' really spells the math out: it never reaches F.scaled_dot_product_attention, which the
    default calls once per layer and pass (else the comparison above would compare the kernel with itself)."""
    calls, real = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, 'scaled_dot_product_attention', lambda *a, **k: calls.append(1) or real(*a, **k))
    x, y = batch()
    tiny(attention='manual')(x, y)
    assert calls == []
    tiny()(x, y)
    assert len(calls) == 2 * 3  # n_layer * n_loop


def test_param_count_flops_and_tying():
    paper, paper_k8 = tiny(), tiny(n_loop=8)
    assert paper.num_params() == paper_k8.num_params()  # looping adds depth, not parameters
    assert paper.lm_head.weight is paper.wte.weight
    gpt2 = tiny(init='gpt2')
    assert gpt2.lm_head.weight is not gpt2.wte.weight
    assert gpt2.num_params() == paper.num_params() + 11 * 32
    assert abs(gpt2.wte.weight.std().item() - 0.02) < 0.005
    assert abs(paper.wte.weight.std().item() - 1.0) < 0.1  # PyTorch's N(0, 1) embedding
    # per-loop supervision pays for K - 1 more readouts (forward + backward) than terminal
    terminal = tiny(supervision='terminal')
    assert paper.flops_per_token() - terminal.flops_per_token() == 6 * 2 * 11 * 32
    assert paper_k8.flops_per_token() > paper.flops_per_token()


@pytest.mark.parametrize('bad, match', [
    (dict(n_embd=30, n_head=4), 'divisible'), (dict(n_loop=0), 'n_loop'), (dict(norm_penalty=-1.0), 'norm_penalty'),
    (dict(readout='foo'), 'readout'), (dict(recurrence='bar'), 'recurrence'), (dict(dropout=1.5), 'dropout'),
    (dict(readout='alpha', alpha=1.5), 'alpha'), (dict(readout='raw', alpha=0.5), 'only used by'),
])
def test_config_rejects_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        DesignConfig(**bad)


def test_readout_module_final_norm_rule():
    r = Readout(DesignConfig(readout='final_norm', n_loop=4))
    h = torch.randn(3, 128) * 50
    assert torch.equal(r(h, 1), h) and torch.equal(r(h, 3), h)
    assert r(h, 4).pow(2).mean(-1).allclose(torch.ones(3), atol=1e-3)
    assert r(h, 8).pow(2).mean(-1).allclose(torch.ones(3), atol=1e-3)


@pytest.mark.parametrize('readout', ['rmsnorm', 'final_norm', 'alpha'])
def test_checkpointed_readouts_give_the_same_gradients(readout):
    """forward() checkpoints the per-loop readouts before the last; the gradients must be the plain ones (with
    readouts that depend on the loop index too, so that a wrong k in the recomputation shows)."""
    x, y = batch()
    model = tiny(readout=readout)
    model(x, y)[1].backward()
    checkpointed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ces = [model.loop_loss(h, k, y)[1] for k, h in model.loops(model.embed(x), 3)]
    torch.stack(ces).mean().backward()
    assert all(torch.allclose(checkpointed[n], p.grad, atol=1e-6) for n, p in model.named_parameters())


def test_per_loop_readouts_are_recomputed_in_backward_not_kept():
    """The memory promise itself: loops 1..K-1 run their readout (and the LM head) once in forward and once more
    in backward, where it is recomputed from h_k; loop K's logits are kept."""
    model, (x, y) = tiny(), batch()
    calls = []
    model.lm_head.register_forward_hook(lambda *a: calls.append(torch.is_grad_enabled()))
    loss = model(x, y)[1]
    forward_calls = len(calls)
    loss.backward()
    K = model.config.n_loop
    assert forward_calls == K and len(calls) - forward_calls == K - 1, (forward_calls, len(calls))


def test_rmsnorm_keeps_its_epsilon_inside_the_root():
    """x / sqrt(mean(x^2) + eps): a zero vector stays zero (finite), and a tiny one is damped by eps."""
    from looped import RMSNorm
    norm = RMSNorm(4, eps=1e-6)
    assert torch.equal(norm(torch.zeros(2, 4)), torch.zeros(2, 4))
    tiny_x = torch.full((1, 4), 1e-4)
    assert norm(tiny_x)[0, 0].item() == pytest.approx(1e-4 / math.sqrt(1e-8 + 1e-6), rel=1e-5)  # 0.0995, not 1
    x64 = torch.randn(3, 4, dtype=torch.float64)
    assert norm.double()(x64).dtype == torch.float64


def test_kl_exit_rule_measures_kl_of_this_loop_from_the_previous():
    """KL(p_k || p_(k-1)), not the reverse: p = (0.9, 0.1), q = (0.5, 0.5) give KL(p||q) = 0.368 and
    KL(q||p) = 0.511, so a threshold of 0.44 separates the two directions."""
    p, q = torch.tensor([[0.9, 0.1]]).log(), torch.tensor([[0.5, 0.5]]).log()
    assert exit_passes('kl', 0.44, p, q).tolist() == [True]    # this loop p, previous loop q: 0.368 <= 0.44
    assert exit_passes('kl', 0.44, q, p).tolist() == [False]   # the other way round: 0.511 > 0.44


def test_dropout_acts_where_the_authors_put_it(monkeypatch):
    """Three dropout sites, as in the authors' layer: the input embedding once, and in every layer of every loop
    the attention probabilities and the MLP output; none on the attention output projection."""
    model = tiny(dropout=0.5, attention='manual').train()
    shapes = []
    real = F.dropout

    def counting(x, p=0.5, training=True, inplace=False):
        shapes.append(tuple(x.shape))
        return real(x, p, training, inplace)
    monkeypatch.setattr(F, 'dropout', counting)
    x, y = batch()
    model(x, y)
    K, L = model.config.n_loop, model.config.n_layer
    assert shapes.count((2, 4, 16, 16)) == K * L                     # attention probabilities (B, nh, T, T)
    assert shapes.count((2, 16, 32)) == 1 + K * L                    # the embedding, then each MLP output
    assert len(shapes) == 1 + 2 * K * L
    # looped.py's own attention drops its probabilities inside the fused kernel: the rest as above
    shapes.clear()
    tiny(dropout=0.5).train()(x, y)
    assert shapes == [(2, 16, 32)] * (1 + K * L), shapes
