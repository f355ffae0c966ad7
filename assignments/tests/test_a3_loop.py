"""A3 grader: LoopedGPT.loops (looped.py), the recurrence: which state each pass starts from, what it yields."""

import pytest
import torch

from grading import tiny


def recorded(model, scale=1.0):
    """Wrap the model's loop_step so that every pass's input is recorded and its output multiplied by scale."""
    inputs, outputs = [], []
    step = model.loop_step

    def wrapped(h):
        inputs.append(h)
        outputs.append(scale * step(h))
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
    assert [k for k, _ in got] == list(range(1, n_loop + 1))       # also beyond the trained K = 3
    assert len(inputs) == n_loop                                   # one pass per loop, none extra
    assert all(h is out for (_, h), out in zip(got, outputs))      # h_k is the pass's own output


def test_residual_recurrence_carries_the_state_as_it_is():
    model = tiny(recurrence='residual').eval()
    h0 = torch.randn(2, 5, 32)
    inputs, outputs = recorded(model, scale=50.0)  # whatever scale a pass produces is carried on
    with torch.no_grad():
        list(model.loops(h0, 4))
    assert torch.equal(inputs[0], h0)
    assert all(torch.equal(nxt, out) for nxt, out in zip(inputs[1:], outputs))


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
    assert torch.equal(inputs[0], h0)
    for nxt, out in zip(inputs[1:], outputs):
        rms = nxt.pow(2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.full_like(rms, 2.5), rtol=1e-4)
        assert torch.allclose(nxt, model.inter_norm(out))
    assert all(torch.equal(h, out) for (_, h), out in zip(got, outputs))  # pre-norm states are yielded


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
    assert [c[0] for c in calls] == [1, 2, 3]
    assert all(c[1] is i and c[2] is o for c, i, o in zip(calls, inputs, outputs))  # (k, pass input, pass output)
    assert all(torch.allclose(h, 0.5 * o) for (_, h), o in zip(got, outputs))
    carried = [h for _, h in got[:-1]] if recurrence == 'residual' else [model.inter_norm(h) for _, h in got[:-1]]
    assert all(torch.allclose(i, c) for i, c in zip(inputs[1:], carried))


def test_gradients_flow_through_every_pass():
    model = tiny(recurrence='normed')
    h0 = torch.randn(2, 5, 32, requires_grad=True)
    *_, (_, h_last) = model.loops(h0, 3)
    h_last.pow(2).sum().backward()
    assert h0.grad is not None and h0.grad.abs().sum() > 0
    assert model.inter_norm.weight.grad.abs().sum() > 0  # the inter-loop norm is inside the graph
