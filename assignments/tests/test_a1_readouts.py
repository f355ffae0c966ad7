"""A1 grader: RMSNorm.forward and Readout.forward (looped.py)."""

import pytest
import torch

from grading import tiny
from looped import LoopedConfig, Readout, RMSNorm


def reference_rmsnorm(x, weight, eps):
    """The formula, written out here in float64: weight * x / sqrt(mean(x^2) + eps)."""
    x = x.double()
    return weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_rmsnorm_matches_the_formula():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-6)
    norm.weight.data = torch.rand(16) + 0.5  # a gain that is not all ones, so forgetting it shows
    x = torch.randn(3, 5, 16) * 4
    out = norm(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.allclose(out.double(), reference_rmsnorm(x, norm.weight, 1e-6), rtol=1e-5, atol=1e-6)


def test_eps_goes_inside_the_square_root():
    """With a large eps and a small input, sqrt(mean(x^2) + eps) and sqrt(mean(x^2)) + eps differ clearly."""
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=0.1)
    x = torch.randn(4, 16) * 0.3
    assert torch.allclose(norm(x).double(), reference_rmsnorm(x, norm.weight, 0.1), rtol=1e-5, atol=1e-6)
    assert torch.isfinite(norm(torch.zeros(2, 16))).all()  # and a zero vector is no division by zero


@pytest.mark.parametrize('a', [0.1, 7.0, 1000.0])
def test_rmsnorm_is_scale_invariant(a):
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-6)
    h = torch.randn(2, 7, 32) * 3
    assert torch.allclose(norm(a * h), norm(h), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_huge_low_precision_states_stay_finite(dtype):
    """A state of norm 1e4 per coordinate (the blind spot's territory): its squares overflow fp16 unless the
    norm computes in fp32. The output keeps the input's dtype and matches the fp32 result to its precision."""
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6)
    x = (torch.randn(4, 64) * 1e4).to(dtype)
    out = norm(x)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert torch.allclose(out.double(), reference_rmsnorm(x, norm.weight, 1e-6), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize('readout', ['rmsnorm', 'layernorm', 'raw', 'final_norm'])
def test_the_readout_rule(readout):
    """rmsnorm / layernorm: normalized at every loop; raw: h itself; final_norm: raw before the trained depth K,
    normalized at K and beyond (2K included)."""
    r = Readout(LoopedConfig(readout=readout, n_loop=4, n_embd=32, n_head=4))
    h = torch.randn(3, 5, 32) * 50
    for k in (1, 2, 3, 4, 8):
        out = r(h, k)
        normalized = readout in ('rmsnorm', 'layernorm') or (readout == 'final_norm' and k >= 4)
        if normalized:
            assert torch.allclose(out.pow(2).mean(-1), torch.ones(3, 5), atol=1e-3), (readout, k)
            assert torch.allclose(r(0.01 * h, k), out, rtol=1e-4, atol=1e-4), (readout, k)
        else:
            assert torch.equal(out, h), (readout, k)


@pytest.mark.parametrize('readout', ['rmsnorm', 'layernorm', 'final_norm'])
def test_logits_of_a_scaled_state_are_unchanged(readout):
    """Through the model's own head: logits(a * h_K) == logits(h_K) for a scale-invariant readout at loop K."""
    model = tiny(readout=readout)
    h = torch.randn(2, 5, 32) * 3
    for a in (0.1, 7.0, 1000.0):
        assert torch.allclose(model.readout_logits(a * h, 3), model.readout_logits(h, 3), rtol=1e-4, atol=1e-4)
