"""A3 grader: LoopedGPT.loops and LoopedGPT.carry (looped.py), the recurrence: which state each pass
starts from, what loops hands each pass, what it yields and in which order, and that generation
with lab/engine.py's KV cache still draws the plain generation's tokens. PYTEST_DONT_REWRITE"""

import pytest
import torch

from grading import check_close, generated_both_ways, tiny, one_thread  # noqa: F401


def recorded(model, scale=1.0):
    """Wrap the model's loop_pass so that the arguments of every pass (h, e, k, n_loop) are
    recorded and its output multiplied by scale. Returns (calls, outputs): calls[k - 1] is a dict
    of pass k's arguments, outputs[k - 1] what it returned."""
    calls, outputs = [], []
    step = model.loop_pass

    def wrapped(h, e, k, n_loop):
        calls.append(dict(h=h, e=e, k=k, n_loop=n_loop))
        outputs.append(scale * step(h, e, k, n_loop))
        return outputs[-1]
    model.loop_pass = wrapped
    return calls, outputs


def inputs(calls):
    """What each recorded pass started from."""
    return [c['h'] for c in calls]


@pytest.mark.parametrize('n_loop', [1, 3, 7])
def test_yields_every_pass_in_order(n_loop):
    model = tiny().eval()
    h0 = torch.randn(2, 5, 32)
    calls, outputs = recorded(model)
    with torch.no_grad():
        got = list(model.loops(h0, n_loop))
    ks = [k for k, _ in got]
    assert ks == list(range(1, n_loop + 1)), (
        f"loops(e, {n_loop}) yielded k = {ks}; expected 1..{n_loop} (also beyond the trained "
        f"K = 3)")
    assert len(calls) == n_loop, \
        f"loops(e, {n_loop}) ran loop_pass {len(calls)} times; one pass per loop"
    assert all(h is out for (_, h), out in zip(got, outputs)), (
        "a yielded h_k is not the tensor loop_pass returned for pass k: yield the pass's own "
        "output (before carry)")


@pytest.mark.parametrize('n_loop', [2, 5])
def test_each_pass_gets_the_carried_state_e_its_index_and_n_loop(n_loop):
    """Pass k is self.loop_pass(h_in, e, k, n_loop): the state it starts from, the embedding that
    loops was given, k counted from 1 and the n_loop that loops was given (5 here is beyond the
    trained K = 3). The designs' passes (lab/designs.py) read all of them: truncated backprop
    counts its cut from k and n_loop, the injection adds e."""
    model = tiny().eval()
    h0 = torch.randn(2, 5, 32)
    calls, outputs = recorded(model)
    with torch.no_grad():
        list(model.loops(h0, n_loop))
    assert len(calls) == n_loop, \
        f"loops(e, {n_loop}) ran loop_pass {len(calls)} times; one pass per loop"
    ks = [c['k'] for c in calls]
    assert ks == list(range(1, n_loop + 1)), (
        f"loops(e, {n_loop}) handed loop_pass the pass indices {ks}; expected 1..{n_loop}: "
        f"count k from 1, as the yielded k")
    told = [c['n_loop'] for c in calls]
    assert told == [n_loop] * n_loop, (
        f"loops(e, {n_loop}) handed loop_pass n_loop = {told}; expected {n_loop} every time: "
        f"the n_loop that loops was given, not the trained K = self.config.n_loop")
    assert all(c['e'] is h0 for c in calls), (
        "loop_pass's e must be the e that loops was given (the embedding), at every pass: not "
        "the carried state")
    assert calls[0]['h'] is h0, "pass 1 must start from h_0 = e itself"
    for k in range(1, n_loop):
        assert calls[k]['h'] is outputs[k - 1], (
            f"residual recurrence: pass {k + 1} must start from h_{k}, the very tensor pass {k} "
            f"returned (not a copy, not a detached one)")


@pytest.mark.parametrize('recurrence', ['residual', 'normed'])
def test_it_is_lazy_one_pass_per_yield(recurrence):
    """loops must be a generator that runs pass k only when (k, h_k) is asked for: generation
    breaks out of the loop at the exit depth, and every pass computed before that is wasted. A
    list (or any code that runs all passes first) gives the right states but makes early exit
    save nothing."""
    model = tiny(recurrence=recurrence).eval()
    calls, _ = recorded(model)
    with torch.no_grad():
        for k, _ in model.loops(torch.randn(2, 5, 32), 5):
            break
    assert k == 1, f"the first thing loops yields must be loop 1, got k = {k}"
    assert len(calls) == 1, (
        f"breaking after the first yield of loops(e, 5) ran loop_pass {len(calls)} times, "
        f"expected exactly 1. Write loops as a generator: yield (k, h_k) inside the for loop "
        f"right after pass k, instead of building a list and returning it; otherwise an early "
        f"exit at loop 1 still pays for all passes.")


def test_residual_recurrence_carries_the_state_as_it_is():
    model = tiny(recurrence='residual').eval()
    h0 = torch.randn(2, 5, 32)
    calls, outputs = recorded(model, scale=50.0)  # whatever scale a pass produces is carried on
    with torch.no_grad():
        list(model.loops(h0, 4))
    assert len(calls) == 4, f"loops(e, 4) ran loop_pass {len(calls)} times; one pass per loop"
    assert torch.equal(calls[0]['h'], h0), \
        "pass 1 must start from h_0 itself (no norm or change before it)"
    for k, (nxt, out) in enumerate(zip(inputs(calls)[1:], outputs), 1):
        assert torch.equal(nxt, out), (
            f"residual recurrence: pass {k + 1} must start from h_{k} exactly as pass {k} "
            f"returned it (scale and all)")


@pytest.mark.parametrize('scale', [0.1, 1.0, 100.0])
def test_normed_recurrence_starts_each_pass_at_the_gain(scale):
    """No norm before pass 1; pass k + 1 starts from the inter-loop RMSNorm of h_k (RMS = its
    gain, whatever the scale of h_k); and what is yielded is h_k before that norm."""
    model = tiny(recurrence='normed').eval()
    model.inter_norm.weight.data.fill_(2.5)
    h0 = torch.randn(2, 5, 32) * 3
    calls, outputs = recorded(model, scale=scale)
    with torch.no_grad():
        got = list(model.loops(h0, 4))
    assert len(calls) == 4, f"loops(e, 4) ran loop_pass {len(calls)} times; one pass per loop"
    assert torch.equal(calls[0]['h'], h0), (
        "normed recurrence: pass 1 must start from h_0 itself; there is no inter-loop norm "
        "before pass 1")
    for k, (nxt, out) in enumerate(zip(inputs(calls)[1:], outputs), 1):
        rms = nxt.pow(2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.full_like(rms, 2.5), rtol=1e-4), (
            f"normed recurrence, pass outputs scaled by {scale:g}: pass {k + 1} starts at RMS "
            f"{rms.mean():.4g}, expected the inter-loop norm's gain 2.5: carry must return "
            f"self.inter_norm(h_{k})")
        check_close(nxt, model.inter_norm(out),
                    f"the input of pass {k + 1} against self.inter_norm(h_{k})")
    for k, ((_, h), out) in enumerate(zip(got, outputs), 1):
        assert torch.equal(h, out), (
            f"normed recurrence: the yielded h_{k} is not pass {k}'s own output; yield the "
            f"state before the inter-loop norm (it is what is read out, penalized and logged), "
            f"then carry on its norm")


@pytest.mark.parametrize('recurrence', ['residual', 'normed'])
def test_carry_returns_the_state_or_its_inter_loop_norm(recurrence):
    """carry(h_k) on its own: h_k itself under residual recurrence, self.inter_norm(h_k) (with
    its gain) under normed, for states of RMS 0.01 to 1000."""
    model = tiny(recurrence=recurrence)
    if recurrence == 'normed':
        with torch.no_grad():
            model.inter_norm.weight.copy_(0.5 + torch.rand(32, generator=torch.Generator().manual_seed(5)))
    for scale in (0.01, 1.0, 1000.0):
        h = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(6)) * scale
        out = model.carry(h)
        if recurrence == 'residual':
            assert torch.equal(out, h), (
                f"residual recurrence: carry(h) must return h itself (scale {scale:g}); the "
                f"next pass starts from h_k as it is")
        else:
            check_close(out, model.inter_norm(h), f"normed recurrence: carry(h) of RMS {scale:g} "
                        f"against self.inter_norm(h)", rtol=1e-5, atol=1e-6,
                        hint="Use the model's own inter-loop norm, with its gain.")


def test_the_next_pass_starts_from_carry_of_the_yielded_state():
    """loops carries on through self.carry, a seam that lab/designs.py overrides (its damped
    recurrence): with a stand-in carry that returns 0.5 h - 1, pass k + 1 must start from
    carry(h_k) and the yielded h_k is carry's input, not its output. A loops that applies
    self.inter_norm itself passes the recurrences above and fails here."""
    model = tiny(recurrence='residual').eval()
    h0 = torch.randn(2, 5, 32)
    calls, outputs = recorded(model)
    carried = []

    def stand_in(h):
        carried.append((h, 0.5 * h - 1))
        return carried[-1][1]
    model.carry = stand_in
    with torch.no_grad():
        got = list(model.loops(h0, 3))
    assert len(carried) >= 2, (
        f"loops(e, 3) called self.carry {len(carried)} times: the next pass starts from "
        f"self.carry(h_k), whatever the recurrence")
    assert len(carried) == 2, (
        f"loops(e, 3) called self.carry {len(carried)} times, expected 2: carry before passes 2 "
        f"and 3 only, not after the last pass (nothing uses that carry, and under normed "
        f"recurrence it costs a norm)")
    assert calls[0]['h'] is h0, "pass 1 must start from h_0 = e itself, not from carry(e)"
    for k in (1, 2):
        assert carried[k - 1][0] is got[k - 1][1], \
            f"carry's input at loop {k} is not the yielded h_{k}: carry the state you yield"
        assert calls[k]['h'] is carried[k - 1][1], (
            f"pass {k + 1} does not start from what self.carry(h_{k}) returned: carry on its "
            f"result")
    for k, ((_, h), out) in enumerate(zip(got, outputs), 1):
        assert h is out, f"the yielded h_{k} is not pass {k}'s own output: yield, then carry"


@pytest.mark.parametrize('recurrence', ['residual', 'normed'])
def test_gradients_flow_through_the_carried_state(recurrence):
    """The gradient of h_3 with respect to h_0 (and, under normed recurrence, the inter-loop
    norm's gain) against the same three passes unrolled by hand. A carried state that is
    detached anywhere, in either recurrence, fails here: the loss would still be right, and only
    the gradient tells."""
    model = tiny(recurrence=recurrence)
    torch.manual_seed(3)
    h0 = torch.randn(2, 5, 32, requires_grad=True)
    w = torch.randn(2, 5, 32)  # a fixed direction: every coordinate of h_3 counts differently
    wrt = [h0] + ([model.inter_norm.weight] if recurrence == 'normed' else [])
    *_, (_, h_last) = model.loops(h0, 3)
    got = torch.autograd.grad((h_last * w).sum(), wrt, allow_unused=True)
    h = h0
    for k in (1, 2, 3):  # by hand: pass, then (normed only) the inter-loop norm
        h = model.loop_pass(h, h0, k, 3)
        if k < 3 and recurrence == 'normed':
            h = model.inter_norm(h)
    expected = torch.autograd.grad((h * w).sum(), wrt)
    names = ['h_0', "the inter-loop norm's gain"]
    through = ' through self.inter_norm' if recurrence == 'normed' else ''
    for name, g, e in zip(names, got, expected):
        assert g is not None and g.abs().sum().item() > 0, (
            f"{recurrence} recurrence: no gradient reaches {name} from h_3. Something in loops "
            f"or carry cuts the carried state out of the graph (.detach(), .data, "
            f"torch.no_grad, a copy through .item() or numpy): the next pass must start from "
            f"h_k itself{through}.")
        check_close(g, e, f"{recurrence} recurrence: d h_3 / d {name} against the three passes "
                    f"unrolled by hand", rtol=1e-4, atol=1e-6,
                    hint="Part of the carried state is detached, or a pass starts from "
                    "something other than the state the previous pass returned.")


@pytest.mark.parametrize('design', [{}, dict(recurrence='normed')], ids=['residual', 'normed'])
def test_cached_generation_gives_the_plain_generations_tokens(design):
    """Generation's KV cache (lab/engine.py) keeps one entry per layer and loop, and files the
    keys and values of a pass under the loop it is on between the yields of loops: pass k must
    run when (k, h_k) is asked for, and not before. With the same seed, lab.engine.generate with
    cache=True must sample the very tokens model.generate samples (every token from the whole
    window rerun), from the same log-probabilities (to 1e-4), at the trained depth and beyond it,
    across a restart of the window (block_size 16)."""
    model = tiny(**design).eval()
    prompt = torch.randint(11, (2, 5), generator=torch.Generator().manual_seed(4))
    for n_loop in (3, 5):
        plain, cached, depth, diffs = generated_both_ways(model, prompt, 20, n_loop)
        bad = [i for i, d in enumerate(diffs) if not d <= 1e-4]
        assert torch.equal(plain, cached) and len(diffs) == 20 and not bad, (
            f"n_loop={n_loop}: generation with the KV cache drew its tokens from other "
            f"log-probabilities than model.generate (off by up to {max(diffs):.3g}, first at new "
            f"token {bad[0] + 1 if bad else '?'} of 20). Run pass k, self.loop_pass(h, e, k, "
            f"n_loop), when (k, h_k) is asked for and not before: the cache files its keys and "
            f"values under the loop the engine is on between the yields of loops.")
        assert depth.unique().tolist() == [n_loop], \
            f"fixed depth {n_loop}: depths {depth.unique().tolist()}"
