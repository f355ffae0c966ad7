"""A2 grader: diagnose.rmsnorm_radial_grad, the closed form of <dL/dh, h> through an RMSNorm, against autograd.
PYTEST_DONT_REWRITE"""

import pytest
import torch

from lab.diagnose import rmsnorm_radial_grad
from grading import check_close, one_thread  # noqa: F401 (one_thread: autouse, torch on one thread here)


def autograd_radial(h, grad_y, weight, eps):
    """<dL/dh, h> per token by autograd in float64, for L with dL/dy = grad_y and y = RMSNorm(h)."""
    h = h.detach().clone().requires_grad_()
    y = weight * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    (g,) = torch.autograd.grad(y, h, grad_y)
    return (g * h).sum(-1)


def example(seed=0, scale=1.0, d=16):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(3, 5, d, generator=g, dtype=torch.float64) * scale
    grad_y = torch.randn(3, 5, d, generator=g, dtype=torch.float64)
    weight = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    return h, grad_y, weight


@pytest.mark.parametrize('eps', [1e-6, 1e-2, 0.5, 3.0])
@pytest.mark.parametrize('scale', [0.3, 1.0, 20.0])
def test_matches_autograd_in_float64(eps, scale):
    h, grad_y, weight = example(scale=scale)
    got = rmsnorm_radial_grad(h, grad_y, weight, eps)
    expected = autograd_radial(h, grad_y, weight, eps)
    assert tuple(got.shape) == (3, 5), \
        f"rmsnorm_radial_grad returned shape {tuple(got.shape)} for h of shape (3, 5, 16): one value per token"
    assert got.dtype == torch.float64, f"rmsnorm_radial_grad returned {got.dtype} for float64 inputs; keep float64"
    # autograd's own rounding: about 1e-16 of the size the terms have before they cancel
    rounding = 1e-12 * ((weight * grad_y * h).sum(-1).abs() + (weight * grad_y).norm(dim=-1) * h.norm(dim=-1))
    bad = ((got - expected).abs() > 1e-8 * expected.abs() + rounding)
    assert not bad.any().item(), (
        f"eps={eps:g}, input scale {scale:g}: the closed form differs from autograd on {bad.sum().item()} of 15 "
        f"tokens (largest error {(got - expected).abs().max().item():.3g}, autograd's largest value "
        f"{expected.abs().max().item():.3g}). Check r^2 = mean(h^2) + eps (a mean, not a sum), S = sum(g * G * h), "
        f"and the result (S / r) * eps / r^2.")


def test_it_is_not_simply_zero():
    """The radial gradient vanishes only up to eps: with eps comparable to mean(h^2) it is clearly non-zero, so
    'return zeros' (or a formula with eps dropped) fails here."""
    h, grad_y, weight = example(scale=0.5)
    got = rmsnorm_radial_grad(h, grad_y, weight, 0.5)
    assert got.abs().max().item() > 1e-2, \
        "with eps = 0.5 and mean(h^2) about 0.25 the radial gradient is clearly non-zero; yours is all but zero " \
        "(did you return zeros, or drop the eps factor?)"
    check_close(got, autograd_radial(h, grad_y, weight, 0.5), "closed form against autograd at eps = 0.5",
                rtol=1e-8, atol=1e-12)


def test_it_vanishes_as_eps_goes_to_zero():
    h, grad_y, weight = example(scale=5.0)
    full = (weight * grad_y * h).sum(-1).abs()  # the size a radial gradient would have without the norm
    got = rmsnorm_radial_grad(h, grad_y, weight, 1e-12)
    assert (got.abs() < 1e-9 * full).all().item(), (
        f"at eps = 1e-12 the radial gradient must vanish (below 1e-9 of |sum g G h|); yours reaches "
        f"{(got.abs() / full).max().item():.3g} of it. The closed form is proportional to eps.")
