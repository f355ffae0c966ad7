"""A8 grader: DesignedGPT.inject and DesignBlock.sandwich_forward (lab/designs.py, the extension of looped.py's model
that builds the field's designs), against invariants and computations done here by hand: what concat computes at
initialization, what add's passes run on, what the adapter's two halves do, that the diagonal injection (Parcae's,
which the full atlas trains) is handed h and e, and the RMS a sandwich layer hands on; and every design inside
generation with its KV cache (lab/engine.py) against the plain model.generate.
PYTEST_DONT_REWRITE"""

import pytest
import torch
import torch.nn.functional as F

from grading import check_close, designed, generated_both_ways, one_thread  # noqa: F401
from lab.designs import DesignBlock, DesignConfig


def pair(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 32, generator=g)


def test_add_returns_h_plus_e_with_both_gradients():
    model = designed(injection='add')
    h, e = (x.requires_grad_() for x in pair())
    w = torch.randn(2, 5, 32)
    out = model.inject(h, e)
    check_close(out, h + e, "injection='add': inject(h, e) against h + e")
    gh, ge = torch.autograd.grad((out * w).sum(), [h, e], allow_unused=True)
    for name, g in (('h', gh), ('e', ge)):
        assert g is not None, f"injection='add': no gradient reaches {name} (is it detached?)"
        check_close(g, w, f"injection='add': d(w . inject(h, e)) / d{name} against w (the sum passes it on unchanged)")


def stack_inputs(model):
    """What each pass runs on, after the injection: the input of the shared stack's first layer, recorded at each
    of its calls."""
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda block, args: seen.append(args[0]))
    return seen


@pytest.mark.parametrize('recurrence', ['residual', 'normed'])
def test_adds_first_pass_runs_on_2e_and_each_later_one_on_the_carried_state_plus_e(recurrence):
    """Through the model's own loop (DesignedGPT.loop_pass hands inject the carried state and e): pass 1 starts
    from h_0 = e, so it runs on e + e = 2e; pass k + 1 on h_k + e, or under normed recurrence on
    inter_norm(h_k) + e."""
    model = designed(injection='add', recurrence=recurrence).eval()
    e = torch.randn(2, 5, 32)
    inputs = stack_inputs(model)
    with torch.no_grad():
        states = [h for _, h in model.loops(e, 3)]
        carried = [model.inter_norm(h) if recurrence == 'normed' else h for h in states]
    assert len(inputs) == 3, f"loops(e, 3) ran the stack {len(inputs)} times"
    check_close(inputs[0], 2 * e, "injection='add': the input of pass 1 against 2e (h_0 = e, plus e)",
                hint="inject(h, e) returns h + e: the carried state and the embedding, each as it is.")
    for k in (1, 2):
        check_close(inputs[k], carried[k - 1] + e, f"injection='add', {recurrence} recurrence: the input of pass "
                    f"{k + 1} against the state carried from loop {k} plus e",
                    hint="inject gets the carried state first and the embedding second.")


def concat_and_none(seed=0):
    """A concat model and a model without injection with the same weights; the adapter keeps its [I | 0] start."""
    none, concat = designed(seed), designed(seed, injection='concat')
    missing, unexpected = concat.load_state_dict(none.state_dict(), strict=False)
    assert missing == ['adapter.weight'] and not unexpected, \
        f"the concat model's extra weights are {missing} (a fault of the grader or of lab/designs.py, not of inject)"
    d = 32
    start = torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1)
    assert torch.equal(concat.adapter.weight, start), \
        "the adapter does not start at [I | 0] (set in init_weights, not by inject): the grader cannot check concat"
    return none.eval(), concat.eval()


def test_concat_at_initialization_computes_what_no_injection_computes():
    """W = [I | 0] at initialization, so W [h; e] = h: every pass, every state and the logits are those of the same
    weights without injection. Only training lets e in."""
    none, concat = concat_and_none()
    h, e = pair()
    check_close(concat.inject(h, e), h, "injection='concat' at initialization: inject(h, e) against h (W = [I | 0])",
                rtol=1e-6, atol=1e-6, hint="inject returns W [h; e]: the adapter applied to h and e side by side, "
                "h first, on the last dimension.")
    idx = torch.randint(11, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = [h for _, h in none.loops(none.embed(idx), 4)]
        b = [h for _, h in concat.loops(concat.embed(idx), 4)]
        la, lb = none(idx)[0], concat(idx)[0]
    for k, (x, y) in enumerate(zip(a, b), 1):
        check_close(y, x, f"h_{k} of the concat model at initialization against the same model without injection",
                    rtol=1e-5, atol=1e-5)
    check_close(lb, la, "the concat model's logits at initialization against the same model without injection",
                rtol=1e-5, atol=1e-5)


def test_concat_is_W_h_h_plus_W_e_e_by_hand():
    """With any W = [W_h | W_e] (C x 2C), W [h; e] = h W_h^T + e W_e^T per token."""
    model = designed(injection='concat')
    W = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) / 8
    with torch.no_grad():
        model.adapter.weight.copy_(W)
    h, e = pair()
    check_close(model.inject(h, e), h @ W[:, :32].T + e @ W[:, 32:].T,
                "injection='concat' with a random W: inject(h, e) against W_h h + W_e e",
                rtol=1e-5, atol=1e-5, hint="W's first 32 columns act on the carried state h, the last 32 on e.")


def test_changing_the_adapters_second_half_changes_the_output():
    """From the [I | 0] start, W_e = B adds exactly e B^T: the second half of W is how e gets in."""
    _, model = concat_and_none()
    h, e = pair()
    with torch.no_grad():
        before = model.inject(h, e)
        B = torch.randn(32, 32, generator=torch.Generator().manual_seed(4)) / 8
        model.adapter.weight[:, 32:] = B
        after = model.inject(h, e)
    assert (after - before).abs().max().item() > 1e-3, \
        "injection='concat': changing the adapter's second half W_e leaves the output as it was: e never gets in"
    check_close(after - before, e @ B.T, "the change of inject(h, e) when W_e goes from 0 to B, against e B^T",
                rtol=1e-4, atol=1e-5)


def test_concat_gradients_reach_h_e_and_both_halves_of_the_adapter():
    """For L = sum(w * W [h; e]): dL/dh = w W_h, dL/de = w W_e, dL/dW = sum over tokens of w^T [h; e]."""
    model = designed(injection='concat')
    W = torch.randn(32, 64, generator=torch.Generator().manual_seed(5)) / 8
    with torch.no_grad():
        model.adapter.weight.copy_(W)
    h, e = (x.requires_grad_() for x in pair())
    w = torch.randn(2, 5, 32)
    grads = torch.autograd.grad((model.inject(h, e) * w).sum(), [h, e, model.adapter.weight], allow_unused=True)
    he = torch.cat([h, e], dim=-1).detach()
    expected = [w @ W[:, :32], w @ W[:, 32:], torch.einsum('btc,btd->cd', w, he)]
    for name, g, want in zip(['h', 'e', 'the adapter W'], grads, expected):
        assert g is not None, f"injection='concat': no gradient reaches {name} (is it detached?)"
        check_close(g, want, f"injection='concat': dL/d{name} against its hand computation", rtol=1e-4, atol=1e-5)


def with_random_diagonal(model, seed=10):
    """The diagonal injection's A_log, dt_bias and B drawn at random (B = I at initialization, where B e = e would
    let e stand in for B e), so that no part of it can stand in for another."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.diagonal.A_log.copy_(torch.randn(32, generator=g) / 2)
        model.diagonal.dt_bias.copy_(torch.randn(32, generator=g) / 2)
        model.diagonal.B.weight.copy_(torch.randn(32, 32, generator=g) / 6)
    return model


DIAGONAL_HINT = ("inject must handle every injection a DesignConfig can ask for, and the full atlas (python -m "
                 "lab.atlas) trains 'diagonal' (its diagonal and parcae designs): under injection='diagonal' "
                 "hand h and e, in this order, to Parcae's injection, self.diagonal (lab/designs.py's "
                 "DiagonalInjection, written for you)")


def test_diagonal_hands_h_and_e_to_parcaes_injection():
    """injection='diagonal': inject(h, e) is Parcae's decay * h + Delta * B e, per channel, with Delta =
    softplus(dt_bias) and decay = exp(-Delta exp(A_log)), computed here by hand from the injection's own
    parameters (random, so h, e and B e cannot stand in for each other); the gradient reaches h, e and the
    injection's three parameters. An inject without the diagonal case fails here (with add and concat only, it
    falls through to the concat adapter, which a diagonal model does not have)."""
    model = with_random_diagonal(designed(injection='diagonal'))
    h, e = (x.requires_grad_() for x in pair())
    try:
        out = model.inject(h, e)
    except NotImplementedError:
        raise
    except Exception as exc:  # one sentence that names the missing case, not a traceback into lab/designs.py
        raise AssertionError(f"injection='diagonal': inject(h, e) raised {type(exc).__name__}: {exc}; "
                             f"{DIAGONAL_HINT}") from None
    d = model.diagonal
    delta = F.softplus(d.dt_bias.detach())
    decay = torch.exp(-delta * d.A_log.detach().exp())
    B = d.B.weight.detach()
    check_close(out, decay * h + delta * (e @ B.T), "injection='diagonal': inject(h, e) against Parcae's "
                "decay * h + Delta * B e, computed by hand", rtol=1e-5, atol=1e-6, hint=DIAGONAL_HINT + '.')
    w = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(11))
    params = [d.A_log, d.dt_bias, d.B.weight]
    gh, ge, *gp = torch.autograd.grad((out * w).sum(), [h, e, *params], allow_unused=True)
    for name, g, want in (('h', gh, w * decay), ('e', ge, (w * delta) @ B)):
        assert g is not None, f"injection='diagonal': no gradient reaches {name} (is it detached?)"
        check_close(g, want, f"injection='diagonal': d(w . inject(h, e)) / d{name} against its hand computation",
                    rtol=1e-4, atol=1e-6)
    for name, g in zip(('A_log', 'dt_bias', 'B'), gp):
        assert g is not None and g.abs().sum().item() > 0, \
            f"injection='diagonal': no gradient reaches the injection's {name} (is it detached?)"


def sandwich_block(last_gain=None, seed=6):
    """A sandwich DesignBlock whose four norms have different gains (so that none can stand in for another), the last
    one a constant if last_gain is given."""
    torch.manual_seed(seed)
    block = DesignBlock(DesignConfig(vocab_size=11, block_size=16, n_embd=32, n_head=4, n_layer=1, n_loop=1,
                                     block='sandwich')).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for norm in (block.norm_1, block.post_attn, block.norm_2, block.post_mlp):
            norm.weight.copy_(0.5 + torch.rand(32, generator=g))
        if last_gain is not None:
            block.post_mlp.weight.fill_(last_gain)
    return block


@pytest.mark.parametrize('scale', [1e-2, 1.0, 1e3])
def test_a_sandwich_blocks_output_rms_is_its_last_gain_whatever_the_input_scale(scale):
    block = sandwich_block(last_gain=1.7)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(7)) * scale
    with torch.no_grad():
        y = block(x)
    rms = y.pow(2).mean(-1).sqrt()
    check_close(rms, torch.full_like(rms, 1.7), f"block='sandwich', input scale {scale:g}: the output's RMS per token "
                f"against post_mlp's gain 1.7", rtol=1e-4, atol=1e-6,
                hint="The layer ends in a norm: the MLP's sum is normalized, post_mlp(x + mlp(norm_2(x))).")


def test_both_sublayer_sums_are_normalized():
    """The sandwich by hand: y = post_attn(x + attn(norm_1(x))), then post_mlp(y + mlp(norm_2(y))), with the
    block's own sublayers and four different gains."""
    block = sandwich_block()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(8)) * 3
    with torch.no_grad():
        got = block(x)
        y = block.post_attn(x + block.attn(block.norm_1(x)))
        expected = block.post_mlp(y + block.mlp(block.norm_2(y)))
        y0 = x + block.attn(block.norm_1(x))
        no_post_attn = block.post_mlp(y0 + block.mlp(block.norm_2(y0)))
    hint = ''
    if torch.allclose(got, no_post_attn, rtol=1e-4, atol=1e-5):
        hint = "Your output is the one without post_attn: the attention's sum must be normalized too."
    check_close(got, expected, "block='sandwich': the block's output against norm(x + f(norm(x))) for attention "
                "(norm_1, post_attn), then for the MLP (norm_2, post_mlp), computed by hand", rtol=1e-4, atol=1e-5,
                hint=hint or "Each sublayer f reads its own pre-norm and its sum with x passes through its post-norm.")


def test_a_sandwich_model_hands_on_every_state_at_the_gain():
    """Through the model: with every block's last gain at 0.7, each h_k (B, T, C) has RMS 0.7 per token whatever
    the scale of h_0, so ||h_k|| = 0.7 sqrt(C) at every loop: the scale is not carried."""
    model = designed(block='sandwich').eval()
    with torch.no_grad():
        for block in model.blocks:
            block.post_mlp.weight.fill_(0.7)
        states = [h for _, h in model.loops(torch.randn(2, 5, 32) * 1e3, 4)]
    for k, h in enumerate(states, 1):
        rms = h.pow(2).mean(-1).sqrt()
        check_close(rms, torch.full_like(rms, 0.7), f"block='sandwich': the RMS per token of h_{k} from h_0 of "
                    f"RMS 1000, against the last block's post_mlp gain 0.7", rtol=1e-4, atol=1e-6)


def with_random_gains_and_adapter(model, seed=9):
    """Every RMSNorm gain drawn from [0.5, 1.5], under concat a random adapter W (so that e gets
    in) and under diagonal a random A_log, dt_bias and B: no part of a design can stand in for
    another in what generation samples."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split('.')[-2] in ('norm_1', 'norm_2', 'post_attn', 'post_mlp'):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
        if model.adapter is not None:
            model.adapter.weight.copy_(torch.randn(32, 64, generator=g) / 6)
    return with_random_diagonal(model) if model.diagonal is not None else model


@pytest.mark.parametrize('design', [dict(injection='add'), dict(injection='concat'), dict(injection='diagonal'),
                                    dict(block='sandwich')], ids=['add', 'concat', 'diagonal', 'sandwich'])
def test_cached_generation_gives_the_plain_generations_tokens(design):
    """Generation's KV cache (lab/engine.py) runs a new token's passes over its own position only:
    inject gets that position's state and embedding, and each sandwich layer must run its own
    attention, self.attn, whose cached forward reaches the earlier positions' keys and values. With the
    same seed lab.engine.generate with cache=True must sample the very tokens model.generate
    samples (the whole window rerun for every token), from the same log-probabilities (to 1e-4),
    at the trained depth K = 3 and at 5 loops, across a restart of the window (block_size 16)."""
    model = with_random_gains_and_adapter(designed(**design).eval())
    prompt = torch.randint(11, (2, 5), generator=torch.Generator().manual_seed(4))
    name = ', '.join(f"{k}='{v}'" for k, v in design.items())
    hint = ("run the layer's own attention, self.attn(self.norm_1(x)), as Block.forward does"
            if 'block' in design else
            "inject must act on each position's own h and e, whatever the number of positions")
    for n_loop in (3, 5):
        try:
            plain, cached, _, diffs = generated_both_ways(model, prompt, 20, n_loop)
        except NotImplementedError:
            raise
        except Exception as exc:
            raise AssertionError(f"{name}, n_loop={n_loop}: generation raised {type(exc).__name__}: {exc}"
                                 + (f"; {DIAGONAL_HINT}" if design.get('injection') == 'diagonal' else '')) from None
        bad = [i for i, d in enumerate(diffs) if not d <= 1e-4]
        assert torch.equal(plain, cached) and len(diffs) == 20 and not bad, (
            f"{name}, n_loop={n_loop}: generation with the KV cache drew its tokens from other "
            f"log-probabilities than model.generate (off by up to {max(diffs):.3g}, first at new "
            f"token {bad[0] + 1 if bad else '?'} of 20): {hint}")
