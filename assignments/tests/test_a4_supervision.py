"""A4 grader: LoopedGPT.supervision_loss (looped.py), dense (per-loop) against terminal supervision."""

import pytest
import torch
import torch.nn.functional as F

from grading import batch, tiny


def unrolled_loss(model, x, y):
    """The training loss computed by hand, loop by loop, with no help from forward() or loops()."""
    h = model.embed(x)
    ces = []
    for k in range(1, model.config.n_loop + 1):
        h = model.loop_step(h)
        logits = model.lm_head(model.readout(h, k))
        ces.append(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))
    return sum(ces) / len(ces) if model.config.supervision == 'per_loop' else ces[-1]


@pytest.mark.parametrize('supervision', ['per_loop', 'terminal'])
def test_value_on_given_cross_entropies(supervision):
    model = tiny(supervision=supervision)
    ces = [torch.tensor(v, requires_grad=True) for v in (3.0, 2.0, 1.5)]
    loss = model.supervision_loss(ces)
    assert loss.dim() == 0 and loss.item() == pytest.approx(6.5 / 3 if supervision == 'per_loop' else 1.5)
    loss.backward()
    expected = [1 / 3] * 3 if supervision == 'per_loop' else [0.0, 0.0, 1.0]
    assert [0.0 if c.grad is None else c.grad.item() for c in ces] == pytest.approx(expected)


@pytest.mark.parametrize('supervision', ['per_loop', 'terminal'])
def test_parameter_gradients_match_a_hand_unrolled_reference(supervision):
    """Same loss and the same gradient for every parameter: a detached mean (right loss, no gradient) or the
    wrong loops in the loss both fail here."""
    x, y = batch()
    model, reference = tiny(supervision=supervision), tiny(supervision=supervision)
    _, loss, _ = model(x, y)
    loss.backward()
    ref = unrolled_loss(reference, x, y)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def test_terminal_supervision_gives_early_readouts_no_say():
    """Under terminal supervision the loss does not change when an early loop's readout is made worse."""
    x, y = batch()
    model = tiny(supervision='terminal', readout='final_norm')  # raw readouts before K: we can scale them
    base = model(x, y)[1].item()
    original = model.readout.forward
    model.readout.forward = lambda h, k: original(h, k) * (100.0 if k < 3 else 1.0)
    assert model(x, y)[1].item() == pytest.approx(base, rel=1e-6)
    model = tiny(supervision='per_loop', readout='final_norm')
    base = model(x, y)[1].item()
    original = model.readout.forward
    model.readout.forward = lambda h, k: original(h, k) * (100.0 if k < 3 else 1.0)
    assert model(x, y)[1].item() != pytest.approx(base, rel=1e-3)
