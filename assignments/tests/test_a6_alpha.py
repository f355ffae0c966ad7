"""A6 grader: AlphaNorm.forward (looped.py), the readout between scale-invariant (alpha = 0) and raw (alpha = 1).
PYTEST_DONT_REWRITE"""

import pytest
import torch

from grading import batch, check_close, tiny, one_thread  # noqa: F401 (one_thread: autouse, torch on one thread here)
from looped import AlphaNorm, LoopedConfig


def alpha_norm(alpha, log_s_ref=0.0, d=32, dtype=torch.float32):
    norm = AlphaNorm(LoopedConfig(readout='alpha', alpha=alpha, n_embd=d, n_head=4)).to(dtype)
    norm.log_s_ref.data.fill_(log_s_ref)
    return norm


def test_alpha_one_is_exactly_raw():
    raw, alpha = tiny(readout='raw'), tiny(readout='alpha', alpha=1.0)
    alpha.readout.norm.log_s_ref.data.fill_(1.7)  # s_ref must not matter at alpha = 1
    h = torch.randn(2, 5, 32) * 40
    a, r = alpha.lm_head(alpha.exit_input(h, 1)), raw.lm_head(raw.exit_input(h, 1))
    assert torch.equal(a, r), \
        f"alpha = 1 must give the raw readout's logits bit for bit (largest difference " \
        f"{(a - r).abs().max().item():.3g}); write the output as h * (s_ref / s)^(1 - alpha), which is h at alpha = 1"


@pytest.mark.parametrize('a', [0.1, 7.0, 1000.0])
def test_alpha_zero_is_scale_invariant(a):
    norm = alpha_norm(0.0, log_s_ref=0.3)
    h = torch.randn(3, 5, 32) * 2
    check_close(norm(a * h), norm(h), f"alpha = 0: AlphaNorm({a:g} h) against AlphaNorm(h)", rtol=1e-4, atol=1e-5,
                hint="At alpha = 0 the output is s_ref * h / s: no trace of the scale s may remain.")
    rms = norm(h).pow(2).mean(-1).sqrt()
    check_close(rms, torch.full((3, 5), 0.3).exp(), "alpha = 0: the output's RMS against s_ref = exp(log_s_ref)",
                rtol=1e-4, hint="s is the per-token RMS, sqrt(mean(h^2)) over the last dimension, and s_ref = "
                "exp(self.log_s_ref).")


@pytest.mark.parametrize('alpha', [0.25, 0.5, 0.8])
def test_output_scales_as_a_to_the_alpha(alpha):
    """With s_ref fixed: AlphaNorm(a * h) = a^alpha * AlphaNorm(h), and the output is s_ref^(1-alpha) s^alpha u."""
    norm = alpha_norm(alpha, log_s_ref=0.4, dtype=torch.float64)
    h = torch.randn(3, 7, 32, dtype=torch.float64) * 3
    s = h.pow(2).mean(-1, keepdim=True).sqrt()
    s_ref = torch.tensor(0.4, dtype=torch.float64).exp()
    out = norm(h)
    assert out.dtype == torch.float64, \
        f"AlphaNorm returned {out.dtype} for a float64 input: compute in at least float32 without lowering " \
        f"float64, h.to(torch.promote_types(h.dtype, torch.float32)), and return h's dtype"
    check_close(out, s_ref ** (1 - alpha) * s ** alpha * h / s, f"alpha = {alpha}: AlphaNorm(h) against "
                "s_ref^(1 - alpha) s^alpha h / s", rtol=1e-6)
    for a in (0.1, 7.0, 1000.0):
        check_close(norm(a * h), a ** alpha * out, f"alpha = {alpha}: AlphaNorm({a:g} h) against {a:g}^alpha "
                    "AlphaNorm(h)", rtol=1e-6)


def test_a_zero_state_is_finite():
    """s is clamped at eps before dividing: a zero state must give zeros."""
    for alpha in (0.0, 0.5, 1.0):
        out = alpha_norm(alpha)(torch.zeros(2, 32))
        assert torch.isfinite(out).all().item(), \
            f"alpha = {alpha}: a zero state gives nan or inf; clamp s at eps (s.clamp_min(self.eps)) before dividing"
        assert out.abs().max().item() == 0, f"alpha = {alpha}: a zero state must give zeros"


@pytest.mark.parametrize('alpha', [0.0, 0.5, 1.0, None])
def test_the_gradient_at_a_zero_state_is_finite(alpha):
    """As in A1: the backward pass at a zero state must be finite too, for h, and for the alpha logit and log s_ref
    (alpha None: learned). A clamp that protects the forward pass can still leave 0 / 0 in the backward one."""
    norm = alpha_norm(alpha)
    h = torch.zeros(2, 32, requires_grad=True)
    out = norm(h)
    assert torch.isfinite(out).all().item(), \
        f"alpha = {alpha}: a zero state gives nan or inf; clamp s at eps (s.clamp_min(self.eps)) before dividing"
    out.sum().backward()
    params = [('h', h.grad), ('log s_ref', norm.log_s_ref.grad)]
    if alpha is None:
        params.append(('the alpha logit', norm.alpha_logit.grad))
    for name, g in params:
        assert g is None or torch.isfinite(g).all().item(), (
            f"alpha = {alpha}: at a zero state the gradient with respect to {name} is nan or inf, although the "
            f"output is finite. The backward pass of sqrt at 0 is 1 / (2 sqrt(0)) = inf, and inf times the zero "
            f"gradient a clamp passes back is nan: clamp the mean of squares (at eps^2) before the square root, "
            f"not s after it, so that sqrt never sees 0.")


def test_gradients_agree_with_finite_differences():
    """autograd through your forward, for h, the alpha logit and log s_ref, against finite differences."""
    norm = AlphaNorm(LoopedConfig(readout='alpha', n_embd=32, n_head=4)).double()
    h = (torch.randn(2, 3, 32, dtype=torch.float64) * 4).requires_grad_()
    logit = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(-0.2, dtype=torch.float64, requires_grad=True)
    f = lambda h, logit, ref: torch.func.functional_call(norm, {'alpha_logit': logit, 'log_s_ref': ref}, (h,))
    out = f(h, logit, ref)
    assert out.dtype == torch.float64, \
        f"AlphaNorm returned {out.dtype} for a float64 input, so this check cannot work: float64 was downcast " \
        f"(.float() lowers float64 to float32). Use h.to(torch.promote_types(h.dtype, torch.float32)) and return " \
        f"h's dtype, as in A1's RMSNorm."
    names = ['h', 'the alpha logit', 'log s_ref']
    for i, name in enumerate(names):
        ok = torch.autograd.gradcheck(lambda *xs: f(*[xs[0] if j == i else x for j, x in enumerate((h, logit, ref))]),
                                      ((h, logit, ref)[i],), raise_exception=False)
        assert ok, (
            f"autograd's gradient with respect to {name} disagrees with finite differences in float64. If a float64 "
            f"input is downcast anywhere in your forward (.float(), float32 constants), finite differences become "
            f"noise: keep float64. Otherwise something is detached (.detach(), .item(), .data) or a "
            f"non-differentiable step sits in the path of {name}.")


def test_a_learned_alpha_gets_a_gradient_in_training():
    x, y = batch()
    model = tiny(readout='alpha')
    model(x, y)[1].backward()
    norm = model.readout.norm
    assert norm.alpha().item() == 0.5, f"a learned alpha starts at 0.5, got {norm.alpha().item():.4g}"
    for name, p in (('alpha_logit', norm.alpha_logit), ('log_s_ref', norm.log_s_ref)):
        assert p.grad is not None and p.grad.abs().item() > 0, \
            f"{name} gets no gradient in training: use self.alpha() and self.log_s_ref in the forward, undetached"
