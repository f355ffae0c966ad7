"""diagnose.py on tiny models whose answers are known in advance."""

import math

import numpy as np
import pytest
import torch

import diagnose
from looped import LoopedConfig, LoopedGPT


def tiny(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=11, block_size=8, n_embd=32, n_head=4, n_layer=1, n_loop=3)
    return LoopedGPT(LoopedConfig(**{**cfg, **kw})).eval()


def data(n_windows=6, T=8, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 11, n_windows * T + 3).astype(np.uint16)
    return diagnose.windows(tokens, T)


def test_windows_count_every_token_once():
    tokens = np.arange(8 * 5 + 3, dtype=np.uint16)
    x, y = diagnose.windows(tokens, 8)
    assert x.shape == (5, 8) and torch.equal(x.flatten(), torch.arange(40)) and torch.equal(y.flatten(), torch.arange(1, 41))


def test_depth_stats_agree_with_forward():
    model, (x, y) = tiny(), data()
    ce, pmax, kl = diagnose.per_token_depth_stats(model, x, y, 6, batch_size=4)
    _, _, stats = model(x, y, n_loop=6)
    assert ce.shape == (48, 6) and np.allclose(ce.mean(0), stats['ce'].numpy(), atol=1e-5)
    assert np.isinf(kl[:, 0]).all() and (kl[:, 1:] >= -1e-6).all() and ((pmax > 0) & (pmax <= 1)).all()


def test_exit_calibration_bounds():
    model, (x, y) = tiny(), data()
    ce, pmax, kl = diagnose.per_token_depth_stats(model, x, y, 3)
    full = math.exp(ce[:, 2].mean())
    assert (diagnose.exit_depths('confidence', 1.1, pmax, kl, 3) == 3).all()  # never confident enough
    assert (diagnose.exit_depths('confidence', 0.0, pmax, kl, 3) == 1).all()  # always
    assert (diagnose.exit_depths('kl', 1e9, pmax, kl, 3) == 2).all()          # KL needs a previous loop
    for kind in ('confidence', 'kl'):
        t, depth, ppl = diagnose.calibrate_exit(kind, ce, pmax, kl, 3)
        assert 1 <= depth <= 3 and ppl <= full * 1.01 + 1e-9
        d = diagnose.exit_depths(kind, t, pmax, kl, 3)
        assert d.mean() == pytest.approx(depth) and math.exp(ce[np.arange(len(d)), d - 1].mean()) == pytest.approx(ppl)


@pytest.mark.parametrize('readout, flat', [('rmsnorm', True), ('layernorm', True), ('raw', False)])
def test_scale_sensitivity(readout, flat):
    model, (x, y) = tiny(readout=readout), data()
    table = diagnose.scale_sensitivity(model, x, y, 3)
    spread = table.max(1) - table.min(1)
    assert table.shape == (3, 5)
    assert (spread < 1e-3).all() if flat else (spread > 0.1).all()  # flat up to the norm's epsilon


@pytest.mark.parametrize('readout', ['rmsnorm', 'raw'])
def test_radial_gradient_fraction(readout):
    model, (x, y) = tiny(readout=readout, supervision='terminal'), data()
    frac = diagnose.radial_gradient(model, x, y, 3)
    own, training = frac[:, 0], frac[:, 1]
    if readout == 'rmsnorm':
        assert (own < 1e-4).all() and training[-1] < 1e-4  # the last loop's only gradient is its own readout's
    else:
        assert (own > 1e-2).all() and training[-1] == pytest.approx(own[-1], rel=1e-4)


def test_update_split_of_an_identity_loop_is_zero():
    model, (x, _) = tiny(), data()
    for block in model.blocks:  # zero residual writes: every loop returns its input
        block.attn.c_proj.weight.data.zero_()
        block.mlp.c_proj.weight.data.zero_()
    split, states = diagnose.update_split(model, x, 3)
    assert np.allclose(split, 0, atol=1e-3) and torch.allclose(states[-1], model.embed(x))


def test_radial_clamp_keeps_norms_and_is_a_no_op_when_scale_is_already_removed():
    (x, y) = data()
    model = tiny()
    _, states = diagnose.update_split(model, x, 3, clamp=True)
    assert torch.allclose(states[2].norm(dim=-1), states[0].norm(dim=-1), rtol=1e-4)
    # normed recurrence: every state already has norm sqrt(d) at init, so clamping changes nothing
    before, after = diagnose.clamp_perplexity(tiny(recurrence='normed'), x, y, 3)
    assert after == pytest.approx(before, rel=1e-5)
    before, after = diagnose.clamp_perplexity(tiny(readout='raw'), x, y, 3)
    assert after != pytest.approx(before, rel=1e-3)


def test_cli_prints_every_table(small_data, tmp_path, capsys):
    import train
    from test_train import TINY
    train.main(['--dataset', small_data, '--out_dir', str(tmp_path), *TINY, '--max_iters=2', '--eval_interval=2'])
    diagnose.main(['--out_dir', str(tmp_path), '--max_windows=20', '--diag_windows=4'])
    out = capsys.readouterr().out
    for heading in ('perplexity by exit depth', 'early exit', 'scale sensitivity', 'radial gradient fraction',
                    'per-loop update', 'radial clamp'):
        assert heading in out
    with pytest.raises(SystemExit, match='no checkpoint'):
        diagnose.main(['--out_dir', str(tmp_path / 'nothing')])
