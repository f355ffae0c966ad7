"""A1 grader: RMSNorm.forward and Readout.forward (looped.py). PYTEST_DONT_REWRITE"""

import pytest
import torch

from grading import check_close, tiny, one_thread  # noqa: F401 (one_thread: autouse, torch on one thread here)
from looped import LoopedConfig, Readout, RMSNorm

UPCAST_HINT = ("Compute in at least float32 without lowering a float64 input: x.to(torch.promote_types(x.dtype, "
               "torch.float32)), then cast the result back with .type_as(x).")


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
    assert out.dtype == x.dtype, f"RMSNorm returned {out.dtype} for a {x.dtype} input; return the input's dtype"
    check_close(out, reference_rmsnorm(x, norm.weight, 1e-6), "RMSNorm against weight * x / sqrt(mean(x^2) + eps)",
                rtol=1e-5, atol=1e-6, hint="Check the gain (self.weight), the mean over the last dimension (not the "
                "sum) and the square root.")


def test_eps_goes_inside_the_square_root():
    """With a large eps and a small input, sqrt(mean(x^2) + eps) and sqrt(mean(x^2)) + eps differ clearly."""
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=0.1)
    x = torch.randn(4, 16) * 0.3
    check_close(norm(x), reference_rmsnorm(x, norm.weight, 0.1), "RMSNorm with eps = 0.1 on a small input",
                rtol=1e-5, atol=1e-6, hint="eps goes inside the square root: sqrt(mean(x^2) + eps), not "
                "sqrt(mean(x^2)) + eps.")
    zero = torch.zeros(2, 16, requires_grad=True)
    out = norm(zero)
    assert torch.isfinite(out).all().item(), "RMSNorm of a zero vector is not finite; eps belongs inside the sqrt"
    out.sum().backward()
    assert torch.isfinite(zero.grad).all().item(), \
        "the gradient of RMSNorm at a zero vector is nan or inf (its forward pass may still be finite there): " \
        "eps belongs inside the square root, sqrt(mean(x^2) + eps). A1's written question 1 asks why."


@pytest.mark.parametrize('a', [0.1, 7.0, 1000.0])
def test_rmsnorm_is_scale_invariant(a):
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-6)
    h = torch.randn(2, 7, 32) * 3
    check_close(norm(a * h), norm(h), f"RMSNorm({a:g} h) against RMSNorm(h)", rtol=1e-4, atol=1e-4,
                hint="Divide by the root mean square of the input itself, so that any scale a > 0 cancels.")


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_huge_low_precision_states_stay_finite(dtype):
    """A state of norm 1e4 per coordinate (the blind spot's territory): its squares overflow fp16 unless the
    norm computes in fp32. The output keeps the input's dtype and matches the fp32 result to its precision."""
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6)
    x = (torch.randn(4, 64) * 1e4).to(dtype)
    out = norm(x)
    assert out.dtype == dtype, f"RMSNorm returned {out.dtype} for a {dtype} input; cast back with .type_as(x)"
    check_close(out, reference_rmsnorm(x, norm.weight, 1e-6), f"RMSNorm of a {dtype} input of size 1e4",
                rtol=2e-2, atol=2e-2, hint="Squares of 1e4 overflow float16 (max 65504): " + UPCAST_HINT)


def test_float64_input_stays_float64():
    """A float64 input is computed and returned in float64 (the A6 and A2 graders use float64 for autograd
    checks): an upcast to float32 with .float() would lower it and lose eight digits."""
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-6).double()
    norm.weight.data = torch.rand(32, dtype=torch.float64) + 0.5
    x = torch.randn(3, 32, dtype=torch.float64) * 5
    out = norm(x)
    assert out.dtype == torch.float64, f"RMSNorm returned {out.dtype} for a float64 input. " + UPCAST_HINT
    check_close(out, reference_rmsnorm(x, norm.weight, 1e-6), "RMSNorm of a float64 input", rtol=1e-12,
                atol=1e-12, hint="The result has float32 precision only: a float64 input was lowered to float32 "
                "somewhere (e.g. by .float()). " + UPCAST_HINT)


@pytest.mark.parametrize('readout', ['rmsnorm', 'layernorm', 'raw', 'final_norm'])
def test_the_readout_rule(readout):
    """rmsnorm / layernorm: normalized at every loop; raw: h itself; final_norm: raw before the trained depth K,
    normalized at K and beyond (2K included)."""
    r = Readout(LoopedConfig(readout=readout, n_loop=4, n_embd=32, n_head=4))
    h = torch.randn(3, 5, 32) * 50
    for k in (1, 2, 3, 4, 8):
        out = r(h, k)
        normalized = readout in ('rmsnorm', 'layernorm') or (readout == 'final_norm' and k >= 4)
        rule = f"readout '{readout}' (trained K = 4) at loop {k} should " + \
            ("normalize h (output RMS 1)" if normalized else "return h itself, unnormalized")
        if normalized:
            rms = out.pow(2).mean(-1).sqrt()
            assert torch.allclose(rms, torch.ones(3, 5), atol=1e-3), f"{rule}; its output has RMS {rms.mean():.4g}"
            check_close(r(0.01 * h, k), out, f"{rule}: it is not scale-invariant there", rtol=1e-4, atol=1e-4)
        else:
            assert torch.equal(out, h), f"{rule}; it changed h (RMS {h.pow(2).mean().sqrt():.4g} -> " \
                f"{out.pow(2).mean().sqrt():.4g})"


@pytest.mark.parametrize('readout', ['rmsnorm', 'layernorm', 'final_norm'])
def test_logits_of_a_scaled_state_are_unchanged(readout):
    """Through the model's own head: logits(a * h_K) == logits(h_K) for a scale-invariant readout at loop K."""
    model = tiny(readout=readout)
    h = torch.randn(2, 5, 32) * 3
    for a in (0.1, 7.0, 1000.0):
        scaled, plain = (model.lm_head(model.exit_input(x, 3)) for x in (a * h, h))  # loop K's logits
        check_close(scaled, plain,
                    f"logits of {a:g} h_K against those of h_K through the '{readout}' readout at loop K", rtol=1e-4,
                    atol=1e-4, hint="At the trained depth K this readout must normalize, so the scale cannot show.")
