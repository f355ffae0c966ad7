"""A4 grader: LoopedGPT.supervision_loss (looped.py), dense (per-loop) against terminal supervision.
PYTEST_DONT_REWRITE"""

import pytest
import torch
import torch.nn.functional as F

from grading import batch, check_close, distinct, tiny, one_thread  # noqa: F401 (one_thread: autouse, torch on one thread here)


def unrolled_loss(model, x, y):
    """The training loss computed by hand, loop by loop, with no help from forward() or loops()."""
    h = e = model.embed(x)
    ces = []
    for k in range(1, model.config.n_loop + 1):
        h = model.loop_pass(h, e, k, model.config.n_loop)
        logits = model.lm_head(model.readout(h, k))
        ces.append(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))
    return sum(ces) / len(ces) if model.config.supervision == 'per_loop' else ces[-1]


@pytest.mark.parametrize('supervision', ['per_loop', 'terminal'])
def test_value_on_given_cross_entropies(supervision):
    model = tiny(supervision=supervision)
    ces = [torch.tensor(v, requires_grad=True) for v in (3.0, 2.0, 1.5)]
    loss = model.supervision_loss(ces)
    want = 6.5 / 3 if supervision == 'per_loop' else 1.5
    rule = 'the mean of all K' if supervision == 'per_loop' else 'the last one alone'
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0, \
        f"supervision_loss must return a scalar tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}"
    assert loss.item() == pytest.approx(want), \
        "{} supervision, the loss's value on ces = (3.0, 2.0, 1.5): got {}, expected {} ({})".format(
            supervision, *distinct(loss.item(), want), rule)
    assert loss.requires_grad, "the loss does not require grad: it must be computed from the ces, not from .item()"
    loss.backward()
    expected = [1 / 3] * 3 if supervision == 'per_loop' else [0.0, 0.0, 1.0]
    got = [0.0 if c.grad is None else c.grad.item() for c in ces]
    assert got == pytest.approx(expected), \
        f"{supervision} supervision: d loss / d ce_k = {[round(g, 4) for g in got]}, " \
        f"expected {[round(e, 4) for e in expected]}"


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
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5), \
        "{}: the model's training loss is {}, the hand-unrolled reference's {}".format(
            supervision, *distinct(loss.item(), ref.item()))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, f"{supervision}: parameter {name} gets no gradient (is the loss detached?)"
        check_close(p.grad, q.grad, f"{supervision}: the gradient of {name} against the hand-unrolled reference",
                    rtol=1e-4, atol=1e-6, hint="Right loss, wrong gradient: is part of the loss detached?")


def test_terminal_supervision_gives_early_readouts_no_say():
    """Under terminal supervision the loss does not change when an early loop's readout is made worse."""
    x, y = batch()
    model = tiny(supervision='terminal', readout='final_norm')  # raw readouts before K: we can scale them
    base = model(x, y)[1].item()
    original = model.readout.forward
    model.readout.forward = lambda h, k: original(h, k) * (100.0 if k < 3 else 1.0)
    worse = model(x, y)[1].item()
    assert worse == pytest.approx(base, rel=1e-6), \
        "terminal supervision: making loops 1..K-1's readouts worse moved the loss from {} to {}; only the last " \
        "loop's cross-entropy may count".format(*distinct(base, worse))
    model = tiny(supervision='per_loop', readout='final_norm')
    base = model(x, y)[1].item()
    original = model.readout.forward
    model.readout.forward = lambda h, k: original(h, k) * (100.0 if k < 3 else 1.0)
    worse = model(x, y)[1].item()
    assert worse != pytest.approx(base, rel=1e-3), \
        f"per-loop supervision: making loops 1..K-1's readouts worse left the loss at {base:.5g}; every loop's " \
        f"cross-entropy must count"
