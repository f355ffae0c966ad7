"""A6 grader: AlphaNorm.forward (looped.py), the readout between scale-invariant (alpha = 0) and raw (alpha = 1)."""

import pytest
import torch

from grading import batch, tiny
from looped import AlphaNorm, LoopedConfig


def alpha_norm(alpha, log_s_ref=0.0, d=32, dtype=torch.float32):
    norm = AlphaNorm(LoopedConfig(readout='alpha', alpha=alpha, n_embd=d, n_head=4)).to(dtype)
    norm.log_s_ref.data.fill_(log_s_ref)
    return norm


def test_alpha_one_is_exactly_raw():
    raw, alpha = tiny(readout='raw'), tiny(readout='alpha', alpha=1.0)
    alpha.readout.norm.log_s_ref.data.fill_(1.7)  # s_ref must not matter at alpha = 1
    h = torch.randn(2, 5, 32) * 40
    assert torch.equal(alpha.readout_logits(h, 1), raw.readout_logits(h, 1))


@pytest.mark.parametrize('a', [0.1, 7.0, 1000.0])
def test_alpha_zero_is_scale_invariant(a):
    norm = alpha_norm(0.0, log_s_ref=0.3)
    h = torch.randn(3, 5, 32) * 2
    assert torch.allclose(norm(a * h), norm(h), rtol=1e-4, atol=1e-5)
    assert torch.allclose(norm(h).pow(2).mean(-1).sqrt(), torch.full((3, 5), 0.3).exp(), rtol=1e-4)  # RMS s_ref


@pytest.mark.parametrize('alpha', [0.25, 0.5, 0.8])
def test_output_scales_as_a_to_the_alpha(alpha):
    """With s_ref fixed: AlphaNorm(a * h) = a^alpha * AlphaNorm(h), and the output is s_ref^(1-alpha) s^alpha u."""
    norm = alpha_norm(alpha, log_s_ref=0.4, dtype=torch.float64)
    h = torch.randn(3, 7, 32, dtype=torch.float64) * 3
    s = h.pow(2).mean(-1, keepdim=True).sqrt()
    s_ref = torch.tensor(0.4, dtype=torch.float64).exp()
    assert torch.allclose(norm(h), s_ref ** (1 - alpha) * s ** alpha * h / s, rtol=1e-6)
    for a in (0.1, 7.0, 1000.0):
        assert torch.allclose(norm(a * h), a ** alpha * norm(h), rtol=1e-6)


def test_a_zero_state_is_finite():
    """s is clamped at eps before dividing: a zero vector gives zeros, not NaN."""
    for alpha in (0.0, 0.5, 1.0):
        out = alpha_norm(alpha)(torch.zeros(2, 32))
        assert torch.isfinite(out).all() and out.abs().max() == 0


def test_gradients_agree_with_finite_differences():
    """autograd through your forward, for h, the alpha logit and log s_ref, against finite differences."""
    norm = AlphaNorm(LoopedConfig(readout='alpha', n_embd=32, n_head=4)).double()
    h = (torch.randn(2, 3, 32, dtype=torch.float64) * 4).requires_grad_()
    logit = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(-0.2, dtype=torch.float64, requires_grad=True)
    f = lambda h, logit, ref: torch.func.functional_call(norm, {'alpha_logit': logit, 'log_s_ref': ref}, (h,))
    assert torch.autograd.gradcheck(f, (h, logit, ref))


def test_a_learned_alpha_gets_a_gradient_in_training():
    x, y = batch()
    model = tiny(readout='alpha')
    model(x, y)[1].backward()
    norm = model.readout.norm
    assert norm.alpha().item() == 0.5 and norm.alpha_logit.grad.abs() > 0 and norm.log_s_ref.grad.abs() > 0
