"""A5 grader: LoopedGPT.norm_penalty (looped.py), then the blind spot and its fixes in 40-step training runs."""

import pytest
import torch

from grading import batch, short_run, tiny


def test_value_is_lambda_times_the_mean_over_loops_of_the_mean_square():
    """Not the squared L2 norm, not a sum over loops: lambda * mean_k mean(h_k^2)."""
    model = tiny(norm_penalty=0.5)
    states = [torch.full((2, 4, 32), 1.0), torch.full((2, 4, 32), 2.0), torch.full((2, 4, 32), 3.0)]
    assert model.norm_penalty(states).item() == pytest.approx(0.5 * (1 + 4 + 9) / 3)
    assert tiny(norm_penalty=0.0).norm_penalty(states).item() == 0.0


def test_gradient_is_radial():
    """d penalty / d h_k = 2 * lambda * h_k / (K * h_k.numel()): along h_k, so it pushes only on the scale."""
    model = tiny(norm_penalty=0.01)
    states = [(torch.randn(2, 4, 32) * s).requires_grad_() for s in (1.0, 10.0, 100.0)]
    model.norm_penalty(states).backward()
    for h in states:
        assert torch.allclose(h.grad, 2 * 0.01 * h.detach() / (3 * h.numel()), rtol=1e-5)


@pytest.mark.parametrize('recurrence', ['residual', 'normed'])
def test_the_model_penalizes_the_states_before_any_inter_loop_norm(recurrence):
    x, y = batch()
    outputs = []
    model = tiny(recurrence=recurrence, norm_penalty=0.01)
    step = model.loop_step
    model.loop_step = lambda h: outputs.append(step(h)) or outputs[-1]  # record each pass's own output
    _, loss, stats = model(x, y)
    expected = stats['ce'].mean() + 0.01 * torch.stack([h.pow(2).mean() for h in outputs]).mean()
    assert torch.allclose(loss, expected, rtol=1e-5)


@pytest.fixture(scope='module')
def norms(tmp_path_factory):
    """||h_k||, k = 1..4, after 40 steps on tiny Shakespeare: the penalty run first (it needs your code)."""
    tiny(norm_penalty=0.01, recurrence='normed')(*batch())  # your code runs before the corpus is looked for
    return {name: short_run(tmp_path_factory, *flags) for name, flags in
            [('penalty', ['--norm_penalty=0.01']), ('rmsnorm', []), ('normed', ['--recurrence=normed'])]}


def test_the_penalty_holds_the_norm_5x_below_the_blind_spot(norms):
    assert norms['rmsnorm'][-1] >= 5 * norms['penalty'][-1], norms


def test_inter_loop_norm_stops_the_growth_compounding(norms):
    """(Needs your penalty only because the fixture runs it first.) With inter-loop normalization each pass
    still writes a large state, but loops 2..K stay within 25% of loop 1, where the residual loop keeps growing."""
    h, blind = norms['normed'], norms['rmsnorm']
    assert max(h) <= 1.25 * h[0] and min(h) >= 0.8 * h[0], norms
    assert blind[-1] >= 2 * blind[0] and blind[-1] >= 2.5 * h[-1], norms
