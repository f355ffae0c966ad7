"""A3 grader: LoopedGPT.loops (looped.py), the recurrence: which state each pass starts from,
what it runs on, what it yields, where truncated backprop cuts, and that generation's KV cache
reaches every pass. PYTEST_DONT_REWRITE"""

import pytest
import torch

from grading import check_close, generated_both_ways, tiny, one_thread  # noqa: F401


def recorded(model, scale=1.0):
    """Wrap the model's loop_step so that every pass's input is recorded and its output
    multiplied by scale."""
    inputs, outputs = [], []
    step = model.loop_step

    def wrapped(h, *cache):  # generation also hands on its KVCache and the pass index
        inputs.append(h)
        outputs.append(scale * step(h, *cache))
        return outputs[-1]
    model.loop_step = wrapped
    return inputs, outputs


def spied(model):
    """Replace the model's inject by a recorder of its arguments (h, e) that returns h + e: a
    stand-in injection written here, so that what loops hands inject shows in what each pass
    runs on, and no design's code (A8's) is called."""
    calls = []

    def spy(h, e):
        calls.append((h, e))
        return h + e
    model.inject = spy
    return calls


@pytest.mark.parametrize('n_loop', [1, 3, 7])
def test_yields_every_pass_in_order(n_loop):
    model = tiny().eval()
    h0 = torch.randn(2, 5, 32)
    inputs, outputs = recorded(model)
    with torch.no_grad():
        got = list(model.loops(h0, n_loop))
    ks = [k for k, _ in got]
    assert ks == list(range(1, n_loop + 1)), (
        f"loops(h, {n_loop}) yielded k = {ks}; expected 1..{n_loop} (also beyond the trained "
        f"K = 3)")
    assert len(inputs) == n_loop, \
        f"loops(h, {n_loop}) ran loop_step {len(inputs)} times; one pass per loop"
    assert all(h is out for (_, h), out in zip(got, outputs)), (
        "a yielded h_k is not the tensor loop_step returned for pass k: yield the pass's own "
        "output (before any inter-loop norm)")


@pytest.mark.parametrize('recurrence', ['residual', 'normed'])
def test_it_is_lazy_one_pass_per_yield(recurrence):
    """loops must be a generator that runs pass k only when (k, h_k) is asked for: generation
    breaks out of the loop at the exit depth, and every pass computed before that is wasted. A
    list (or any code that runs all passes first) gives the right states but makes early exit
    save nothing."""
    model = tiny(recurrence=recurrence).eval()
    inputs, _ = recorded(model)
    with torch.no_grad():
        for k, _ in model.loops(torch.randn(2, 5, 32), 5):
            break
    assert k == 1, f"the first thing loops yields must be loop 1, got k = {k}"
    assert len(inputs) == 1, (
        f"breaking after the first yield of loops(h, 5) ran loop_step {len(inputs)} times, "
        f"expected exactly 1. Write loops as a generator: yield (k, h_k) inside the for loop "
        f"right after pass k, instead of building a list and returning it; otherwise an early "
        f"exit at loop 1 still pays for all passes.")


def test_residual_recurrence_carries_the_state_as_it_is():
    model = tiny(recurrence='residual').eval()
    h0 = torch.randn(2, 5, 32)
    inputs, outputs = recorded(model, scale=50.0)  # whatever scale a pass produces is carried on
    with torch.no_grad():
        list(model.loops(h0, 4))
    assert len(inputs) == 4, f"loops(h, 4) ran loop_step {len(inputs)} times; one pass per loop"
    assert torch.equal(inputs[0], h0), \
        "pass 1 must start from h_0 itself (no norm or change before it)"
    for k, (nxt, out) in enumerate(zip(inputs[1:], outputs), 1):
        assert torch.equal(nxt, out), (
            f"residual recurrence: pass {k + 1} must start from h_{k} exactly as pass {k} "
            f"returned it (scale and all)")


def test_damped_recurrence_starts_each_pass_from_sigmoid_a_times_h_k_and_yields_it_undamped():
    model = tiny(recurrence='damped').eval()
    with torch.no_grad():
        model.damping.fill_(0.5)  # sigmoid(0.5) = 0.6225, not its initial 0.88
    h0 = torch.randn(2, 5, 32)
    inputs, outputs = recorded(model, scale=3.0)
    with torch.no_grad():
        yielded = [h for _, h in model.loops(h0, 3)]
    assert torch.equal(inputs[0], h0), "pass 1 must start from h_0 itself (no damping before it)"
    factor = torch.sigmoid(torch.tensor(0.5))
    for k in (1, 2):
        assert torch.equal(yielded[k - 1], outputs[k - 1]), \
            f"loops must yield h_{k} undamped: the damping is for what the next pass starts from"
        check_close(inputs[k], factor * outputs[k - 1], f"damped: pass {k + 1} must start from sigmoid(a) * h_{k}")


def test_a_start_state_h_replaces_e_as_h_0_but_not_as_the_injected_e():
    model = tiny(injection='add').eval()
    calls = spied(model)
    e, start = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    with torch.no_grad():
        list(model.loops(e, 2, h=start))
    assert torch.equal(calls[0][0], start), "given h, pass 1 must start from it, not from e"
    assert all(torch.equal(c[1], e) for c in calls), "e stays what is injected, whatever h starts from"


@pytest.mark.parametrize('scale', [0.1, 1.0, 100.0])
def test_normed_recurrence_starts_each_pass_at_the_gain(scale):
    """No norm before pass 1; pass k + 1 starts from the inter-loop RMSNorm of h_k (RMS = its
    gain, whatever the scale of h_k); and what is yielded is h_k before that norm."""
    model = tiny(recurrence='normed').eval()
    model.inter_norm.weight.data.fill_(2.5)
    h0 = torch.randn(2, 5, 32) * 3
    inputs, outputs = recorded(model, scale=scale)
    with torch.no_grad():
        got = list(model.loops(h0, 4))
    assert len(inputs) == 4, f"loops(h, 4) ran loop_step {len(inputs)} times; one pass per loop"
    assert torch.equal(inputs[0], h0), (
        "normed recurrence: pass 1 must start from h_0 itself; there is no inter-loop norm "
        "before pass 1")
    for k, (nxt, out) in enumerate(zip(inputs[1:], outputs), 1):
        rms = nxt.pow(2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.full_like(rms, 2.5), rtol=1e-4), (
            f"normed recurrence, pass outputs scaled by {scale:g}: pass {k + 1} starts at RMS "
            f"{rms.mean():.4g}, expected the inter-loop norm's gain 2.5: start it from "
            f"self.inter_norm(h_{k})")
        check_close(nxt, model.inter_norm(out),
                    f"the input of pass {k + 1} against self.inter_norm(h_{k})")
    for k, ((_, h), out) in enumerate(zip(got, outputs), 1):
        assert torch.equal(h, out), (
            f"normed recurrence: the yielded h_{k} is not pass {k}'s own output; yield the "
            f"state before the inter-loop norm (it is what is read out, penalized and logged), "
            f"then normalize what is carried on")


@pytest.mark.parametrize('recurrence', ['residual', 'normed'])
def test_edit_changes_what_is_yielded_and_carried(recurrence):
    model = tiny(recurrence=recurrence).eval()
    h0 = torch.randn(2, 5, 32)
    inputs, outputs = recorded(model)
    calls = []

    def halve(k, h_in, h, e):
        calls.append((k, h_in, h, e))
        return 0.5 * h, e
    with torch.no_grad():
        got = list(model.loops(h0, 3, edit=halve))
    assert [c[0] for c in calls] == [1, 2, 3], \
        f"edit was called with k = {[c[0] for c in calls]}; expected once per pass, k = 1, 2, 3"
    assert all(c[1] is i and c[2] is o for c, i, o in zip(calls, inputs, outputs)), (
        "edit must be called as edit(k, h_in, h_k, e): the state the pass started from, its "
        "own output, and e")
    assert all(c[3] is h0 for c in calls), \
        "edit's e must be the h that loops was given (the embedding)"
    for k, ((_, h), o) in enumerate(zip(got, outputs), 1):
        check_close(h, 0.5 * o, f"the yielded h_{k} against the h_k edit returned",
                    hint="What edit returns replaces h_k: yield it.")
    carried = [h for _, h in got[:-1]] if recurrence == 'residual' else \
        [model.inter_norm(h) for _, h in got[:-1]]
    how = " (through the inter-loop norm)" if recurrence == 'normed' else ''
    for k, (i, c) in enumerate(zip(inputs[1:], carried), 1):
        check_close(i, c, f"{recurrence} recurrence: the input of pass {k + 1} against what "
                    f"edit returned at loop {k}{how}",
                    hint="edit's h_k replaces h_k also for the next pass, not only in what is "
                    "yielded.")


def test_rows_dropped_by_edit_leave_e_too():
    """edit may drop rows of the batch (the exit benchmark removes sequences that exited) by
    returning (h_k[keep], e[keep]): the yielded and carried state is its h_k, and the later
    passes inject its e (here with a stand-in inject that returns h + e)."""
    model = tiny(injection='add').eval()
    h0 = torch.randn(4, 5, 32)
    spied(model)
    inputs, outputs = recorded(model)
    keep = torch.tensor([True, False, True, False])

    def drop(k, h_in, h, e):
        return (h[keep], e[keep]) if k == 1 else (h, e)
    with torch.no_grad():
        got = list(model.loops(h0, 3, edit=drop))
    assert [h.shape[0] for _, h in got] == [2, 2, 2], \
        "when edit returns (h_k, e) with rows dropped, loops yields and carries that h_k"
    for k in (1, 2):
        check_close(inputs[k], got[k - 1][1] + h0[keep], f"pass {k + 1}'s input after rows 1 "
                    f"and 3 left at loop 1 (a stand-in inject that returns h + e)",
                    hint="Carry on both of edit's results: its h_k, and its e for the later "
                    "passes.")


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
        h = model.loop_step(h)
        if k < 3 and recurrence == 'normed':
            h = model.inter_norm(h)
    expected = torch.autograd.grad((h * w).sum(), wrt)
    names = ['h_0', "the inter-loop norm's gain"]
    through = ' through self.inter_norm' if recurrence == 'normed' else ''
    for name, g, e in zip(names, got, expected):
        assert g is not None and g.abs().sum().item() > 0, (
            f"{recurrence} recurrence: no gradient reaches {name} from h_3. Something in loops "
            f"cuts the carried state out of the graph (.detach(), .data, torch.no_grad, a copy "
            f"through .item() or numpy): the next pass must start from h_k itself{through}.")
        check_close(g, e, f"{recurrence} recurrence: d h_3 / d {name} against the three passes "
                    f"unrolled by hand", rtol=1e-4, atol=1e-6,
                    hint="Part of the carried state is detached, or a pass starts from "
                    "something other than the state the previous pass returned.")


def test_the_default_model_never_calls_inject():
    """Under injection='none' a pass runs on the carried state itself: loops must not call
    inject (A8's function, which a student may not have written yet)."""
    model = tiny().eval()
    calls = spied(model)
    inputs, _ = recorded(model)
    h0 = torch.randn(2, 5, 32)
    with torch.no_grad():
        list(model.loops(h0, 3))
    assert not calls, (
        f"under injection='none' loops called inject {len(calls)} times; call "
        f"self.inject(h, e) only when self.config.injection is not 'none'")
    assert torch.equal(inputs[0], h0), "without injection pass 1 must run on h_0 itself"


@pytest.mark.parametrize('recurrence', ['residual', 'normed'])
def test_each_pass_runs_on_inject_of_the_carried_state_and_e(recurrence):
    """Under input injection pass k runs on self.inject(h_in, e): h_in the carried state
    (h_{k-1}, or its inter-loop norm), e the h that loops was given (the embedding). With a
    stand-in inject that returns h + e, pass 1 runs on 2 h_0 and pass k + 1 on h_k + e (or
    inter_norm(h_k) + e)."""
    model = tiny(injection='add', recurrence=recurrence).eval()
    h0 = torch.randn(2, 5, 32)
    calls = spied(model)
    inputs, outputs = recorded(model)
    with torch.no_grad():
        list(model.loops(h0, 3))
    assert len(inputs) == 3 and len(calls) == 3, (
        f"loops(h, 3) under injection ran loop_step {len(inputs)} times and inject "
        f"{len(calls)} times; once each per pass")
    check_close(inputs[0], 2 * h0, "the input of pass 1 against inject(h_0, e) = h_0 + e = "
                "2 h_0 (a stand-in inject that returns h + e)",
                hint="Each pass runs on self.inject(h_in, e), with e the h that loops was given.")
    for k in (1, 2):
        carried = outputs[k - 1] if recurrence == 'residual' else model.inter_norm(outputs[k - 1])
        check_close(inputs[k], carried + h0,
                    f"{recurrence} recurrence: the input of pass {k + 1} against inject(h_in, e) "
                    f"= h_in + e, h_in the state carried from loop {k}",
                    hint="inject gets the carried state first and e second; e stays the h that "
                    "loops was given.")
    for k, (_, e) in enumerate(calls, 1):
        assert torch.equal(e, h0), \
            f"pass {k}: inject got an e that is not the h loops was given"


def test_edit_gets_the_carried_state_not_the_injected_one():
    """edit(k, h_in, h_k, e) gets the state the pass was carried from, before the injection:
    the stand-in inject's h + e is what the pass runs on, not h_in."""
    model = tiny(injection='add').eval()
    h0 = torch.randn(2, 5, 32)
    spied(model)
    _, outputs = recorded(model)
    got = []

    def record(k, h_in, h, e):
        got.append(h_in)
        return h, e
    with torch.no_grad():
        list(model.loops(h0, 3, edit=record))
    carried = [h0] + outputs[:2]
    assert len(got) == 3 and all(a is b for a, b in zip(got, carried)), (
        "under injection edit's h_in must be the carried state (h_0 at loop 1, then h_{k-1}), "
        "not inject's result: the update a pass makes is measured from the state it was "
        "carried from")


@pytest.mark.parametrize('recurrence, n_loop', [('residual', 4), ('normed', 4), ('residual', 5)])
def test_truncated_backprop_cuts_the_state_before_the_last_bptt_passes(recurrence, n_loop):
    """With bptt = 2 loops detaches the state that pass n - 1 starts from: the gradient of h_n
    reaches h_{n-1} and no earlier state (n = 5 runs beyond the trained K = 3). The cut follows
    from the 1-based pass index and the n_loop that loops was given: off by one moves it by
    one pass."""
    model = tiny(recurrence=recurrence, bptt=2)
    h0 = torch.randn(2, 5, 32, requires_grad=True)
    states = [h for _, h in model.loops(h0, n_loop)]
    assert len(states) == n_loop, f"loops(h, {n_loop}) yielded {len(states)} states"
    grads = torch.autograd.grad(states[-1].sum(), [h0] + states[:-1], allow_unused=True)
    reached = [j for j, g in enumerate(grads) if g is not None and g.abs().sum().item() > 0]
    want = [n_loop - 1]  # h_{n-1} only: the carried h_{n-2} is detached before pass n - 1
    assert reached == want, (
        f"bptt=2, {recurrence} recurrence, loops(h, {n_loop}): the gradient of h_{n_loop} "
        f"reaches h_j for j = {reached}, expected j = {want} only (backprop through the last 2 "
        f"passes). Detach the carried state before pass k = n_loop - bptt + 1, counting k from "
        f"1 and with the n_loop that loops was given.")


def test_truncated_backprop_leaves_e_and_a_cut_at_pass_1_alone():
    """The cut detaches the carried state only: under injection the last passes still add e, so
    the gradient of h_n reaches e (here h_0) through them. And bptt >= n_loop cuts nothing:
    detaching before pass 1 would cut the embedding off from every gradient."""
    model = tiny(injection='add', bptt=2)
    spied(model)
    h0 = torch.randn(2, 5, 32, requires_grad=True)
    states = [h for _, h in model.loops(h0, 4)]
    grads = torch.autograd.grad(states[-1].sum(), [h0] + states[:-1], allow_unused=True)
    reached = [j for j, g in enumerate(grads) if g is not None and g.abs().sum().item() > 0]
    assert reached == [0, 3], (
        f"bptt=2 under injection (a stand-in inject, h + e), loops(h, 4): the gradient of h_4 "
        f"reaches h_j for j = {reached}, expected j = [0, 3]: h_3, and e = h_0 through the "
        f"injections of passes 3 and 4. Detach the carried state, not e nor what inject "
        f"returns.")
    for bptt, n_loop in ((3, 3), (5, 3)):
        model = tiny(bptt=bptt)
        h0 = torch.randn(2, 5, 32, requires_grad=True)
        *_, (_, h_last) = model.loops(h0, n_loop)
        (g,) = torch.autograd.grad(h_last.sum(), [h0], allow_unused=True)
        assert g is not None and g.abs().sum().item() > 0, (
            f"bptt={bptt}, loops(h, {n_loop}): no gradient reaches h_0. With bptt >= n_loop "
            f"every pass is backpropagated through: there is no cut before pass 1.")


@pytest.mark.parametrize('n_loop', [3, 5])
def test_inverse_k_shrinks_each_update_by_the_trained_K(n_loop):
    """residual_scale='inverse_k': h_k = x + (pass(x) - x) / K with x what the pass ran on
    (here, with a stand-in inject, h_in + e) and K the trained loop count (3), also when loops
    runs 5. That h_k is what edit gets, what is yielded and what is carried on."""
    model = tiny(residual_scale='inverse_k', injection='add').eval()
    h0 = torch.randn(2, 5, 32)
    spied(model)
    inputs, outputs = recorded(model)
    edited = []

    def record(k, h_in, h, e):
        edited.append(h)
        return h, e
    with torch.no_grad():
        got = list(model.loops(h0, n_loop, edit=record))
    assert len(got) == n_loop == len(inputs), f"loops(h, {n_loop}) yielded {len(got)} states"
    for k, ((_, h), x, out) in enumerate(zip(got, inputs, outputs), 1):
        check_close(h, x + (out - x) / 3, f"residual_scale='inverse_k', loops(h, {n_loop}): "
                    f"h_{k} against x + (pass(x) - x) / 3, x what pass {k} ran on",
                    hint="Shrink the pass's update, measured from what it ran on (after the "
                    "injection), by the trained K = self.config.n_loop, not by the n_loop "
                    "asked for.")
        assert edited[k - 1] is h, (
            f"residual_scale='inverse_k': edit got another h_{k} than the one yielded: shrink "
            f"the update first, then hand h_k to edit")
    for k in range(1, n_loop):
        check_close(inputs[k], got[k - 1][1] + h0, f"the input of pass {k + 1} against h_{k} + e",
                    hint="The shrunk update is what is carried on.")


@pytest.mark.parametrize('design', [{}, dict(recurrence='normed')], ids=['residual', 'normed'])
def test_cached_generation_gives_the_plain_generations_tokens(design):
    """Generation's KV cache (lab/engine.py) keeps one entry per layer and loop, which loops
    reaches through the cache and pass index it hands loop_step. With the same seed,
    lab.engine.generate with cache=True must sample the very tokens model.generate samples
    (every token from the whole window rerun), from the same log-probabilities (to 1e-4), at the
    trained depth and beyond it, across a restart of the window (block_size 16)."""
    model = tiny(**design).eval()
    prompt = torch.randint(11, (2, 5), generator=torch.Generator().manual_seed(4))
    for n_loop in (3, 5):
        plain, cached, depth, diffs = generated_both_ways(model, prompt, 20, n_loop)
        bad = [i for i, d in enumerate(diffs) if not d <= 1e-4]
        assert torch.equal(plain, cached) and len(diffs) == 20 and not bad, (
            f"n_loop={n_loop}: generation with the KV cache drew its tokens from other "
            f"log-probabilities than model.generate (off by up to {max(diffs):.3g}, first at new "
            f"token {bad[0] + 1 if bad else '?'} of 20). Pass k must run as self.loop_step(x, "
            f"cache, k): the cache that loops was given and the pass's own 1-based index, which "
            f"picks the keys and values of that loop.")
        assert depth.unique().tolist() == [n_loop], \
            f"fixed depth {n_loop}: depths {depth.unique().tolist()}"
