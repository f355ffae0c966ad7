"""A5 grader: LoopedGPT.penalty_loss (looped.py), then the blind spot and its fixes in 40-step training runs.
PYTEST_DONT_REWRITE"""

import pytest
import torch

from grading import batch, check_close, distinct, penalty_of, short_run, tiny, one_thread  # noqa: F401 (one_thread: autouse, torch on one thread here)


def test_value_is_lambda_times_the_mean_over_loops_of_the_mean_square():
    """Not the squared L2 norm, not a sum over loops: lambda * mean_k mean(h_k^2). First (penalty_of): a tensor that
    keeps the states' gradient, also at lambda = 0 a tensor."""
    model = tiny(norm_penalty=0.5)
    states = [torch.full((2, 4, 32), v, requires_grad=True) for v in (1.0, 2.0, 3.0)]
    got = penalty_of(model, states).item()
    want = 0.5 * (1 + 4 + 9) / 3
    hints = {0.5 * 14: 'a sum over loops instead of the mean', 0.5 * 14 / 3 * 256: 'a sum over elements (squared L2 '
             'norm) instead of the mean', 0.5 * 14 * 256: 'sums over loops and elements', 14 / 3: 'lambda left out',
             0.5 * (1 + 2 + 3) / 3: 'the RMS instead of the mean square'}
    hint = next((v for k, v in hints.items() if got == pytest.approx(k)), 'compare with the formula')
    assert got == pytest.approx(want), \
        "the penalty's value, lambda = 0.5 and states filled with 1, 2 and 3: got {}, expected lambda * mean_k " \
        "mean(h_k^2) = {} ({})".format(*distinct(got, want), hint)
    zero = penalty_of(tiny(norm_penalty=0.0), states).item()
    assert zero == 0.0, f"with lambda = 0 the penalty must be 0, got {zero:.4g}"


def test_gradient_is_radial():
    """d penalty / d h_k = 2 * lambda * h_k / (K * h_k.numel()): along h_k, so it pushes only on the scale."""
    model = tiny(norm_penalty=0.01)
    states = [(torch.randn(2, 4, 32) * s).requires_grad_() for s in (1.0, 10.0, 100.0)]
    penalty_of(model, states).backward()
    for k, h in enumerate(states, 1):
        assert h.grad is not None, f"h_{k} gets no gradient from the penalty: is it detached?"
        check_close(h.grad, 2 * 0.01 * h.detach() / (3 * h.numel()), f"d penalty / d h_{k} against "
                    "2 lambda h_k / (K numel)", rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize('recurrence', ['residual', 'normed'])
def test_the_model_penalizes_the_states_before_any_inter_loop_norm(recurrence):
    x, y = batch()
    outputs = []
    model = tiny(recurrence=recurrence, norm_penalty=0.01)
    step = model.loop_pass
    model.loop_pass = lambda *a: outputs.append(step(*a)) or outputs[-1]  # each pass's own output
    _, loss, stats = model(x, y)
    expected = stats['ce'].mean() + 0.01 * torch.stack([h.pow(2).mean() for h in outputs]).mean()
    check_close(loss, expected, f"{recurrence} recurrence: the training loss against mean CE + lambda * mean_k "
                "mean(h_k^2) of the passes' own outputs", rtol=1e-5,
                hint="Use the states you are given (h_k before any inter-loop norm).")


@pytest.fixture(scope='module')
def norms(tmp_path_factory):
    """||h_k||, k = 1..4, after 40 steps on tiny Shakespeare: the penalty run first (it needs your code)."""
    tiny(norm_penalty=0.01, recurrence='normed')(*batch())  # your code runs before the corpus is looked for
    return {name: short_run(tmp_path_factory, *flags) for name, flags in
            [('penalty', ['--norm_penalty=0.01']), ('rmsnorm', []), ('normed', ['--recurrence=normed'])]}


def test_the_penalty_holds_the_norm_5x_below_the_blind_spot(norms):
    blind, pen = norms['rmsnorm'][-1], norms['penalty'][-1]
    assert blind >= 5 * pen, \
        f"after 40 steps ||h_K|| is {blind:.4g} without the penalty and {pen:.4g} with lambda = 0.01: the penalty " \
        f"should hold it at least 5x lower. Does your penalty reach the states' scale with the gradient given above?"


def test_inter_loop_norm_stops_the_growth_compounding(norms):
    """(Needs your penalty only because the fixture runs it first.) With inter-loop normalization loops 2..K must
    stay within 25% of loop 1; the residual run must grow at least 2x from loop 1 to K."""
    h, blind = norms['normed'], norms['rmsnorm']
    fmt = lambda v: ', '.join(f"{x:.3g}" for x in v)
    assert max(h) <= 1.25 * h[0] and min(h) >= 0.8 * h[0], \
        f"normed recurrence: ||h_k|| for k = 1..4 is {fmt(h)}; loops 2..K should stay within 25% of loop 1 " \
        f"(is the inter-loop norm applied to what each pass starts from, A3?)"
    assert blind[-1] >= 2 * blind[0] and blind[-1] >= 2.5 * h[-1], \
        f"residual recurrence: ||h_k|| = {fmt(blind)} against normed {fmt(h)}; the residual loop should grow at " \
        f"least 2x over the loops and end 2.5x above the normed one (A3's residual recurrence carries the scale)"
