"""A3 grader: LoopedGPT.loops (looped.py), the recurrence: which state each pass starts from, what it yields.
PYTEST_DONT_REWRITE"""

import pytest
import torch

from grading import check_close, tiny, one_thread  # noqa: F401 (one_thread: autouse, torch on one thread here)


def recorded(model, scale=1.0):
    """Wrap the model's loop_step so that every pass's input is recorded and its output multiplied by scale."""
    inputs, outputs = [], []
    step = model.loop_step

    def wrapped(h, *cache):  # generation also hands on its KVCache and the pass index
        inputs.append(h)
        outputs.append(scale * step(h, *cache))
        return outputs[-1]
    model.loop_step = wrapped
    return inputs, outputs


@pytest.mark.parametrize('n_loop', [1, 3, 7])
def test_yields_every_pass_in_order(n_loop):
    model = tiny().eval()
    h0 = torch.randn(2, 5, 32)
    inputs, outputs = recorded(model)
    with torch.no_grad():
        got = list(model.loops(h0, n_loop))
    ks = [k for k, _ in got]
    assert ks == list(range(1, n_loop + 1)), \
        f"loops(h, {n_loop}) yielded k = {ks}; expected 1..{n_loop} (also beyond the trained K = 3)"
    assert len(inputs) == n_loop, f"loops(h, {n_loop}) ran loop_step {len(inputs)} times; one pass per loop"
    assert all(h is out for (_, h), out in zip(got, outputs)), \
        "a yielded h_k is not the tensor loop_step returned for pass k: yield the pass's own output (before any " \
        "inter-loop norm)"


@pytest.mark.parametrize('recurrence', ['residual', 'normed'])
def test_it_is_lazy_one_pass_per_yield(recurrence):
    """loops must be a generator that runs pass k only when (k, h_k) is asked for: generate() breaks out of the
    loop at the exit depth, and every pass computed before that is wasted. A list (or any code that runs all
    passes first) gives the right states but makes early exit save nothing."""
    model = tiny(recurrence=recurrence).eval()
    inputs, _ = recorded(model)
    with torch.no_grad():
        for k, _ in model.loops(torch.randn(2, 5, 32), 5):
            break
    assert k == 1, f"the first thing loops yields must be loop 1, got k = {k}"
    assert len(inputs) == 1, (
        f"breaking after the first yield of loops(h, 5) ran loop_step {len(inputs)} times, expected exactly 1. "
        f"Write loops as a generator: yield (k, h_k) inside the for loop right after pass k, instead of building "
        f"a list and returning it; otherwise an early exit at loop 1 still pays for all passes.")


def test_residual_recurrence_carries_the_state_as_it_is():
    model = tiny(recurrence='residual').eval()
    h0 = torch.randn(2, 5, 32)
    inputs, outputs = recorded(model, scale=50.0)  # whatever scale a pass produces is carried on
    with torch.no_grad():
        list(model.loops(h0, 4))
    assert len(inputs) == 4, f"loops(h, 4) ran loop_step {len(inputs)} times; one pass per loop"
    assert torch.equal(inputs[0], h0), "pass 1 must start from h_0 itself (no norm or change before pass 1)"
    for k, (nxt, out) in enumerate(zip(inputs[1:], outputs), 1):
        assert torch.equal(nxt, out), \
            f"residual recurrence: pass {k + 1} must start from h_{k} exactly as pass {k} returned it (scale and all)"


@pytest.mark.parametrize('scale', [0.1, 1.0, 100.0])
def test_normed_recurrence_starts_each_pass_at_the_gain(scale):
    """No norm before pass 1; pass k + 1 starts from the inter-loop RMSNorm of h_k (RMS = its gain, whatever
    the scale of h_k); and what is yielded is h_k before that norm."""
    model = tiny(recurrence='normed').eval()
    model.inter_norm.weight.data.fill_(2.5)
    h0 = torch.randn(2, 5, 32) * 3
    inputs, outputs = recorded(model, scale=scale)
    with torch.no_grad():
        got = list(model.loops(h0, 4))
    assert len(inputs) == 4, f"loops(h, 4) ran loop_step {len(inputs)} times; one pass per loop"
    assert torch.equal(inputs[0], h0), \
        "normed recurrence: pass 1 must start from h_0 itself; there is no inter-loop norm before pass 1"
    for k, (nxt, out) in enumerate(zip(inputs[1:], outputs), 1):
        rms = nxt.pow(2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.full_like(rms, 2.5), rtol=1e-4), (
            f"normed recurrence, pass outputs scaled by {scale:g}: pass {k + 1} starts at RMS {rms.mean():.4g}, "
            f"expected the inter-loop norm's gain 2.5: start it from self.inter_norm(h_{k})")
        check_close(nxt, model.inter_norm(out), f"the input of pass {k + 1} against self.inter_norm(h_{k})")
    for k, ((_, h), out) in enumerate(zip(got, outputs), 1):
        assert torch.equal(h, out), (
            f"normed recurrence: the yielded h_{k} is not pass {k}'s own output; yield the state before the "
            f"inter-loop norm (it is what is read out, penalized and logged), then normalize what is carried on")


@pytest.mark.parametrize('recurrence', ['residual', 'normed'])
def test_intervene_changes_what_is_yielded_and_carried(recurrence):
    model = tiny(recurrence=recurrence).eval()
    h0 = torch.randn(2, 5, 32)
    inputs, outputs = recorded(model)
    calls = []

    def halve(k, h_in, h):
        calls.append((k, h_in, h))
        return 0.5 * h
    with torch.no_grad():
        got = list(model.loops(h0, 3, intervene=halve))
    assert [c[0] for c in calls] == [1, 2, 3], \
        f"intervene was called with k = {[c[0] for c in calls]}; expected once per pass, k = 1, 2, 3"
    assert all(c[1] is i and c[2] is o for c, i, o in zip(calls, inputs, outputs)), \
        "intervene must be called as intervene(k, h_in, h_k): the pass's input and the pass's own output"
    for k, ((_, h), o) in enumerate(zip(got, outputs), 1):
        check_close(h, 0.5 * o, f"the yielded h_{k} against intervene's result",
                    hint="What intervene returns replaces h_k: yield it.")
    carried = [h for _, h in got[:-1]] if recurrence == 'residual' else [model.inter_norm(h) for _, h in got[:-1]]
    for k, (i, c) in enumerate(zip(inputs[1:], carried), 1):
        check_close(i, c, f"{recurrence} recurrence: the input of pass {k + 1} against what intervene returned "
                    f"at loop {k}" + (" (through the inter-loop norm)" if recurrence == 'normed' else ''),
                    hint="intervene's result replaces h_k also for the next pass, not only in what is yielded.")


@pytest.mark.parametrize('recurrence', ['residual', 'normed'])
def test_gradients_flow_through_the_carried_state(recurrence):
    """The gradient of h_3 with respect to h_0 (and, under normed recurrence, the inter-loop norm's gain) against
    the same three passes unrolled by hand. A carried state that is detached anywhere, in either recurrence,
    fails here: the loss would still be right, and only the gradient tells."""
    model = tiny(recurrence=recurrence)
    torch.manual_seed(3)
    h0 = torch.randn(2, 5, 32, requires_grad=True)
    w = torch.randn(2, 5, 32)  # a fixed direction, so that every coordinate of h_3 counts differently
    wrt = [h0] + ([model.inter_norm.weight] if recurrence == 'normed' else [])
    *_, (_, h_last) = model.loops(h0, 3)
    got = torch.autograd.grad((h_last * w).sum(), wrt, allow_unused=True)
    h = h0
    for k in (1, 2, 3):  # the recurrence by hand: pass, then (normed only) the inter-loop norm before the next pass
        h = model.loop_step(h)
        if k < 3 and recurrence == 'normed':
            h = model.inter_norm(h)
    expected = torch.autograd.grad((h * w).sum(), wrt)
    names = ['h_0', "the inter-loop norm's gain"]
    for name, g, e in zip(names, got, expected):
        assert g is not None and g.abs().sum().item() > 0, (
            f"{recurrence} recurrence: no gradient reaches {name} from h_3. Something in loops cuts the carried "
            f"state out of the graph (.detach(), .data, torch.no_grad, a copy through .item() or numpy): the next "
            f"pass must start from h_k itself{' through self.inter_norm' if recurrence == 'normed' else ''}.")
        check_close(g, e, f"{recurrence} recurrence: d h_3 / d {name} against the three passes unrolled by hand",
                    rtol=1e-4, atol=1e-6, hint="Part of the carried state is detached, or a pass starts from "
                    "something other than the state the previous pass returned.")


def spied(model):
    """Replace the model's pass_input by a recorder of its arguments (h, e, k, n_loop) that returns h + e: a stand-in
    injection written here, so that what loops hands pass_input shows in what each pass runs on, and no design's
    code (A8's) is called."""
    calls = []

    def spy(h, e, k, n_loop):
        calls.append((h, e, k, n_loop))
        return h + e
    model.pass_input = spy
    return calls


def test_each_pass_runs_on_pass_input_of_the_carried_state_and_e():
    """loops hands pass_input(h_in, e, k, n_loop) to loop_step, with e = the h that loops was given: the designs
    that inject the embedding live in pass_input, not in loops. With the stand-in h + e, pass 1 runs on 2 h_0."""
    model = tiny().eval()
    h0 = torch.randn(2, 5, 32)
    calls = spied(model)
    inputs, outputs = recorded(model)
    with torch.no_grad():
        list(model.loops(h0, 3))
    assert len(inputs) == 3 and len(calls) == 3, \
        f"loops(h, 3) ran loop_step {len(inputs)} times and pass_input {len(calls)} times; once each per pass"
    check_close(inputs[0], 2 * h0, "the input of pass 1 against pass_input(h_0, e) = h_0 + e = 2 h_0 (a stand-in "
                "pass_input that returns h + e)",
                hint="Each pass runs on self.pass_input(h_in, e, k, n_loop), with e the h that loops was given.")
    for k in (1, 2):
        check_close(inputs[k], outputs[k - 1] + h0,
                    f"the input of pass {k + 1} against pass_input(h_{k}, e) = h_{k} + e",
                    hint="Each pass runs on self.pass_input(h_in, e, k, n_loop): e stays the h loops was given.")
    for k, (_, e, _, _) in enumerate(calls, 1):
        assert torch.equal(e, h0), f"pass {k}: pass_input got an e that is not the h loops was given (the embedding)"


@pytest.mark.parametrize('n_loop', [3, 5])
def test_pass_input_gets_the_1_based_pass_index_and_the_loop_count_asked_for(n_loop):
    """pass_input(h, e, k, n_loop) is told which pass it feeds, k = 1..n_loop as loops yields it, and the n_loop
    that loops was given (which may exceed the trained K = 3): truncated backprop counts its last passes from them."""
    model = tiny().eval()
    calls = spied(model)
    with torch.no_grad():
        list(model.loops(torch.randn(2, 5, 32), n_loop))
    ks, ns = [c[2] for c in calls], [c[3] for c in calls]
    assert ks == list(range(1, n_loop + 1)), \
        f"loops(h, {n_loop}) handed pass_input k = {ks}; expected 1..{n_loop}, the same 1-based k that it yields"
    assert ns == [n_loop] * n_loop, \
        f"loops(h, {n_loop}) handed pass_input n_loop = {ns}; expected {n_loop} every time, the loop count asked for " \
        f"(not the trained K = {model.config.n_loop})"


@pytest.mark.parametrize('recurrence, n_loop', [('residual', 4), ('normed', 4), ('residual', 5)])
def test_truncated_backprop_cuts_the_state_before_the_last_bptt_passes(recurrence, n_loop):
    """With bptt = 2, pass_input detaches the state that the second-to-last pass starts from: the gradient of h_n
    reaches h_{n-1} and no earlier state (n = 5 runs beyond the trained K = 3). Which pass that is follows from the
    k and n_loop that loops hands pass_input: a pass index off by one moves the cut by one pass."""
    model = tiny(recurrence=recurrence, bptt=2)
    h0 = torch.randn(2, 5, 32, requires_grad=True)
    states = [h for _, h in model.loops(h0, n_loop)]
    assert len(states) == n_loop, f"loops(h, {n_loop}) yielded {len(states)} states"
    grads = torch.autograd.grad(states[-1].sum(), [h0] + states[:-1], allow_unused=True)
    reached = [j for j, g in enumerate(grads) if g is not None and g.abs().sum().item() > 0]
    want = [n_loop - 1]  # h_{n-1} only: the carried h_{n-2} is detached before pass n - 1
    assert reached == want, (
        f"bptt=2, {recurrence} recurrence, loops(h, {n_loop}): the gradient of h_{n_loop} reaches h_j for j = "
        f"{reached}, expected j = {want} only (backprop through the last 2 passes). Hand pass_input the 1-based pass "
        f"index k and the n_loop loops was given: pass_input(h_in, e, k, n_loop).")


def test_rows_dropped_by_intervene_leave_e_too():
    """intervene may drop rows (the exit benchmark removes sequences that exited) by returning (h_k, keep), keep a
    bool mask over the rows it was given: the yielded and carried state is h_k, and e keeps the same rows."""
    model = tiny().eval()
    h0 = torch.randn(4, 5, 32)
    spied(model)
    inputs, outputs = recorded(model)
    keep = torch.tensor([True, False, True, False])

    def drop(k, h_in, h):
        return (h[keep], keep) if k == 1 else h
    with torch.no_grad():
        got = list(model.loops(h0, 2, intervene=drop))
    assert got[0][1].shape[0] == 2, "when intervene returns (h_k, keep), loops yields h_k (the rows kept), not the pair"
    check_close(inputs[1], outputs[0][keep] + h0[keep], "pass 2's input after rows 1 and 3 left at loop 1 (a "
                "stand-in pass_input that returns h + e)",
                hint="After intervene returns (h_k, keep), carry h_k on and keep only e[keep] for the next passes.")
