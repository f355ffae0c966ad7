"""lab/diagnose.py on tiny models whose answers are known in advance."""

import math

import numpy as np
import pytest
import torch

from lab import diagnose
from lab.designs import DesignConfig, DesignedGPT


def tiny(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=11, block_size=8, n_embd=32, n_head=4, n_layer=1, n_loop=3)
    return DesignedGPT(DesignConfig(**{**cfg, **kw})).eval()


def data(n_windows=6, T=8, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 11, n_windows * T + 3).astype(np.uint16)
    return diagnose.windows(tokens, T)


def test_windows_count_every_token_once():
    tokens = np.arange(8 * 5 + 3, dtype=np.uint16)
    x, y = diagnose.windows(tokens, 8)
    assert (x.shape == (5, 8) and torch.equal(x.flatten(), torch.arange(40))
            and torch.equal(y.flatten(), torch.arange(1, 41)))


def test_depth_stats_agree_with_forward():
    model, (x, y) = tiny(), data()
    ce, pmax, kl, latent = diagnose.per_token_depth_stats(model, x, y, 6, batch_size=4)
    _, _, stats = model(x, y, n_loop=6)
    assert ce.shape == (48, 6) and np.allclose(ce.mean(0), stats['ce'].numpy(), atol=1e-5)
    assert np.isinf(kl[:, 0]).all() and (kl[:, 1:] >= -1e-6).all() and ((pmax > 0) & (pmax <= 1)).all()
    with torch.no_grad():  # the latent signal: the relative change of each token's state, from h_0 on
        states = [model.embed(x)] + [h for _, h in model.loops(model.embed(x), 6)]
    want = torch.stack([(b - a).norm(dim=-1) / a.norm(dim=-1) for a, b in zip(states, states[1:])], -1)
    assert np.allclose(latent, want.reshape(-1, 6).numpy(), rtol=1e-5)


def test_exit_calibration_bounds():
    model, (x, y) = tiny(), data()
    ce, pmax, kl, latent = diagnose.per_token_depth_stats(model, x, y, 3)
    full = math.exp(ce[:, 2].mean())
    assert (diagnose.exit_depths('confidence', 1.1, pmax, kl, 3) == 3).all()  # never confident enough
    assert (diagnose.exit_depths('confidence', 0.0, pmax, kl, 3) == 1).all()  # always
    assert (diagnose.exit_depths('kl', 1e9, pmax, kl, 3) == 2).all()          # KL needs a previous loop
    assert (diagnose.exit_depths('latent', 1e9, pmax, kl, 3, latent) == 1).all()  # h_1 is compared with h_0
    assert (diagnose.exit_depths('latent', -1, pmax, kl, 3, latent) == 3).all()
    for kind in ('confidence', 'kl', 'latent'):
        t, depth, ppl = diagnose.calibrate_exit(kind, ce, pmax, kl, 3, latent=latent)
        assert 1 <= depth <= 3 and ppl <= full * 1.01 + 1e-9
        d = diagnose.exit_depths(kind, t, pmax, kl, 3, latent)
        assert d.mean() == pytest.approx(depth) and math.exp(ce[np.arange(len(d)), d - 1].mean()) == pytest.approx(ppl)


def test_exit_calibration_considers_loop_1_thresholds():
    """The only good threshold is a loop-1 confidence: token 0 is sure at loop 1 (0.95) and right there; token 1
    is almost as sure at loop 1 (0.92) but wrong there. Only t in (0.92, 0.95] (the candidates are quantiles,
    so interpolated between the loop-1 values) lets token 0 alone exit at loop 1
    (mean loops (1 + 3) / 2 = 2), and no later loop's confidence lies in that range."""
    ce = np.array([[1.0, 1.0, 1.0], [3.0, 1.0, 1.0]])
    pmax = np.array([[0.95, 0.9, 0.9], [0.92, 0.5, 0.5]])
    kl = np.zeros_like(pmax)
    t, depth, ppl = diagnose.calibrate_exit('confidence', ce, pmax, kl, 3)
    assert 0.92 < t <= 0.95 and depth == 2.0 and ppl == pytest.approx(math.e)


def test_sequence_exit_calibration_on_a_known_case():
    """Four sequences, K = 3. Two are easy (score 0.9 at loop 1, and loop 1 is as good as loop 3), two are hard
    (score 0.2 at loop 1, where their loss is far worse): the calibrated threshold must let exactly the easy ones
    leave at loop 1, for mean loops (1 + 1 + 3 + 3) / 4 = 2 and perplexity exactly depth 3's."""
    ce = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    score = np.array([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9], [0.2, 0.3, 0.9], [0.2, 0.3, 0.9]])
    t = diagnose.calibrate_sequence_exit(ce, score, 3)
    assert 0.3 < t <= 0.9
    assert diagnose.sequence_exit(ce, score, t, 3) == (2.0, pytest.approx(math.e))
    # the hard ones at loop 2 cost more than 1%: allowed only with a looser tolerance
    loose = diagnose.calibrate_sequence_exit(ce, score, 3, tolerance=1.0)
    assert 0.2 < loose <= 0.3 and diagnose.sequence_exit(ce, score, loose, 3)[0] == 1.5
    assert diagnose.calibrate_sequence_exit(ce[:, :1], score[:, :1], 1) == math.inf  # K = 1: nothing to skip


def test_a_windows_kl_score_is_minus_its_mean_kl_to_the_loop_before():
    model, (x, y) = tiny(), data(n_windows=6)
    _, scores = diagnose.sequence_depth_stats(model, x, y, 3, batch_size=4)
    with torch.no_grad():  # by hand: KL(p_k || p_{k-1}) per token, its mean over the window, negated
        logps = [diagnose.readout_logp(model, h, k) for k, h in model.loops(model.embed(x), 3)]
    want = [-(b.exp() * (b - a)).sum(-1).mean(-1).numpy() for a, b in zip(logps, logps[1:])]
    assert np.isneginf(scores['kl'][:, 0]).all()  # loop 1 has no loop before it: never settled
    assert np.allclose(scores['kl'][:, 1:], np.stack(want, 1), atol=1e-6)


def test_timed_exit_run_matches_the_computed_exits():
    """The served run (exited sequences leave the batch) must give the very loops and perplexity that the
    per-sequence statistics predict for the same threshold; and the scores are what they say."""
    model, (x, y) = tiny(), data(n_windows=10)
    ce, scores = diagnose.sequence_depth_stats(model, x, y, 3, batch_size=4)
    _, _, stats = model(x, y, n_loop=3)
    assert np.allclose(ce.mean(0), stats['ce'].numpy(), atol=1e-5)
    assert ((scores['max_prob'] > 0) & (scores['max_prob'] <= 1)).all() and (scores['margin'] >= 0).all()
    assert ((scores['entropy'] >= -1e-6) & (scores['entropy'] <= 1)).all()
    for name, s in ((name, scores[name]) for name in diagnose.SCORES):  # the scores a timed run serves
        for t in np.quantile(s[:, :2], [0.2, 0.6]):
            loops, ppl, tok_s = diagnose.timed_exit_run(model, x, y, 3, name, t, batch_size=4)
            assert (loops, ppl) == pytest.approx(diagnose.sequence_exit(ce, s, t, 3), rel=1e-5) and tok_s > 0
    assert diagnose.timed_exit_run(model, x, y, 3)[:2] == pytest.approx((3.0, math.exp(ce[:, 2].mean())), rel=1e-5)
    uniform = torch.zeros(11).log_softmax(-1)  # the scores' ends: a uniform prediction is the least confident
    score = lambda name: diagnose.SCORES[name](uniform, None, None).item()
    assert score('entropy') == pytest.approx(0, abs=1e-6)
    assert score('margin') == 0 and score('max_prob') == pytest.approx(1 / 11)
    h = torch.tensor([[3.0, 4.0]])  # the latent score: minus the relative change, 1 / 5 here
    assert diagnose.SCORES['latent'](None, h + torch.tensor([[0.6, 0.8]]), h).item() == pytest.approx(-0.2)


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
    own, training, closed = frac[:, 0], frac[:, 1], frac[:, 2]
    if readout == 'rmsnorm':
        assert (own < 1e-4).all() and training[-1] < 1e-4  # the last loop's only gradient is its own readout's
        assert (closed < 1e-4).all()
    else:
        assert (own > 1e-2).all() and training[-1] == pytest.approx(own[-1], rel=1e-4) and np.isnan(closed).all()


def test_radial_gradient_training_column_is_the_gradient_of_the_training_loss():
    """Under per-loop supervision h_1 gets gradient from every later loop too: the 'training' column must be the
    gradient of forward()'s own loss with respect to h_k (caught here through LoopedGPT.loops), which differs
    from loop k's own cross-entropy gradient before the last loop."""
    model, (x, y) = tiny(readout='raw', norm_penalty=0.01), data()
    frac = diagnose.radial_gradient(model, x, y, 3)
    states, real_loops = [], model.loops

    def loops(h, n_loop):
        for k, h_k in real_loops(h, n_loop):
            h_k.retain_grad()
            states.append(h_k)
            yield k, h_k
    model.loops = loops
    model(x, y)[1].backward()
    expected = [torch.nn.functional.cosine_similarity(s.grad, s.detach(), dim=-1).abs().mean().item() for s in states]
    assert frac[:, 1] == pytest.approx(expected, rel=1e-4)
    assert abs(frac[0, 1] - frac[0, 0]) > 1e-3  # so the own-loss column could not pass for it


@pytest.mark.parametrize('eps', [1e-6, 0.5])
def test_closed_form_radial_gradient_matches_autograd(eps):
    """<dL/dh, h> = (S / r) * eps / r^2 for an RMSNorm, against autograd in float64 (a large eps makes it visible)."""
    torch.manual_seed(0)
    h = (torch.randn(4, 6, 16, dtype=torch.float64) * 0.7).requires_grad_()
    weight, grad_y = torch.rand(16, dtype=torch.float64) + 0.5, torch.randn(4, 6, 16, dtype=torch.float64)
    y = weight * h / (h.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    (g,) = torch.autograd.grad(y, h, grad_y)
    expected = (g * h).sum(-1)
    got = diagnose.rmsnorm_radial_grad(h.detach(), grad_y, weight, eps)
    assert torch.allclose(got, expected, rtol=1e-8, atol=1e-14)
    assert expected.abs().max() > (1e-3 if eps == 0.5 else 0)


def test_update_split_of_an_identity_loop_is_zero():
    model, (x, _) = tiny(), data()
    for block in model.blocks:  # zero residual writes: every loop returns its input
        block.attn.c_proj.weight.data.zero_()
        block.mlp.c_proj.weight.data.zero_()
    split, states = diagnose.update_split(model, x, 3)
    assert np.allclose(split, 0, atol=1e-3) and torch.allclose(states[-1], model.embed(x))


def test_radial_clamps_on_known_updates():
    """freeze keeps loop 1's norm; remove_radial leaves an update orthogonal to the state it started from, and
    turns a purely radial update (h_k = 1.5 h_in) into no update at all."""
    torch.manual_seed(0)
    h_in, h = torch.randn(2, 5, 32), torch.randn(2, 5, 32) * 3
    out = diagnose.clamp('remove_radial')(2, h_in, h)
    assert torch.allclose(((out - h_in) * h_in).sum(-1), torch.zeros(2, 5), atol=1e-4)
    assert torch.allclose(diagnose.clamp('remove_radial')(2, h_in, 1.5 * h_in), h_in, atol=1e-5)
    frozen = diagnose.clamp('freeze')(2, h_in, h)
    assert (torch.allclose(frozen.norm(dim=-1), h_in.norm(dim=-1))
            and torch.equal(diagnose.clamp('freeze')(1, h_in, h), h))
    (x, y) = data()
    _, states = diagnose.update_split(tiny(), x, 3, 'freeze')
    assert torch.allclose(states[2].norm(dim=-1), states[0].norm(dim=-1), rtol=1e-4)
    ppl = diagnose.clamp_perplexity(tiny(readout='raw'), x, y, 3)
    assert set(ppl) == set(diagnose.CLAMPS) and ppl['freeze'] != pytest.approx(ppl['none'], rel=1e-3)


def test_lemma_check_on_a_loop_that_doubles_its_input(monkeypatch):
    """A pass h -> 2h is purely radial: s_k = 2^k s_0, radial increment s_{k-1}, no turn at all."""
    model, (x, _) = tiny(), data()
    monkeypatch.setattr(model, 'loop_pass', lambda h, e, k, n_loop: 2 * h)
    table = diagnose.lemma_check(model, x, n_loop=5)
    s0 = model.embed(x).pow(2).mean(-1).sqrt().mean().item()
    assert table.shape == (5, 4)
    assert np.allclose(table[:, 0], s0 * 2.0 ** np.arange(1, 6), rtol=1e-5)
    assert np.allclose(table[:, 1], s0 * 2.0 ** np.arange(0, 5), rtol=1e-5)
    assert np.allclose(table[:, 2:], 0, atol=1e-2)


@pytest.mark.parametrize('design', [{}, dict(recurrence='normed'), dict(recurrence='damped'),
                                    dict(injection='add', block='sandwich')],
                         ids=['residual', 'normed', 'damped', 'add'])
def test_edited_loops_is_the_models_recurrence_with_each_edit_carried_on(design):
    """edited_loops, the diagnostics' loop that edits the states between passes: with an edit that changes nothing
    it yields model.loops' states bit for bit; an edit's h_k is yielded and carried on (through carry), its h_in is
    what the pass started from, and rows it drops leave e for the later passes too."""
    model, (x, _) = tiny(**design), data()
    with torch.no_grad():
        e = model.embed(x)
        seen = []

        def record(k, h_in, h, e_):
            seen.append((k, h_in))
            return h, e_
        same = list(diagnose.edited_loops(model, e, 4, record))
        plain = list(model.loops(e, 4))
        assert [k for k, _ in same] == [1, 2, 3, 4] and all(torch.equal(a, b) for (_, a), (_, b) in zip(same, plain))
        assert seen[0][1] is e and all(torch.equal(h_in, model.carry(h)) for (_, h_in), (_, h) in zip(seen[1:], plain))
        keep = torch.tensor([True, False, True, False, False, True])

        def halve_and_drop(k, h_in, h, e_):
            return (0.5 * h[keep], e_[keep]) if k == 1 else (0.5 * h, e_)
        got = list(diagnose.edited_loops(model, e, 3, halve_and_drop))
        h1 = 0.5 * model.loop_pass(e, e, 1, 3)[keep]
        h2 = 0.5 * model.loop_pass(model.carry(h1), e[keep], 2, 3)
        assert torch.equal(got[0][1], h1) and torch.equal(got[1][1], h2) and got[2][1].shape[0] == 3


def test_cli_prints_every_table(small_data, tmp_path, capsys):
    import train
    from test_train import TINY
    train.main(['--dataset', small_data, '--out_dir', str(tmp_path), *TINY, '--max_iters=2', '--eval_interval=2'])
    diagnose.main(['--out_dir', str(tmp_path), '--max_windows=20', '--diag_windows=4'])
    out = capsys.readouterr().out
    for heading in ('perplexity by exit depth', 'early exit per token', 'early exit per sequence',
                    '| max_prob | calibrated',
                    '| entropy | q0.5', 'scale sensitivity', 'radial gradient fraction',
                    'per-loop update', 'radial clamps', 'lemma check over 30 loops'):
        assert heading in out
    # the numbers, not only the headings: the perplexity row against the model's own forward on the same windows,
    # and the lemma table's first scale against the RMS of pass 1's output on the scale windows
    from lab.runs import load_model
    model, ckpt = load_model(str(tmp_path))
    tokens, K = diagnose.val_tokens(ckpt), model.config.n_loop
    x, y = diagnose.windows(tokens, model.config.block_size, 20)
    with torch.no_grad():
        expected = np.exp(model(x, y, n_loop=2 * K)[2]['ce'].numpy())
    row = next(line for line in out.splitlines() if line.strip().startswith('ppl'))
    assert np.allclose([float(v) for v in row.split()[1:]], expected, atol=2e-3), (row, expected)
    xd, _ = diagnose.windows(tokens, model.config.block_size, 4)
    with torch.no_grad():
        s1 = next(iter(model.loops(model.embed(xd), 1)))[1].pow(2).mean(-1).sqrt().mean().item()
    lemma = out[out.index('lemma check over 30 loops'):].splitlines()
    loop1 = next(line for line in lemma if line.strip().startswith('loop 1 '))
    assert float(loop1.split()[2]) == pytest.approx(s1, abs=2e-3), (loop1, s1)
    assert (tmp_path / 'lemma.png').stat().st_size > 0
    with pytest.raises(SystemExit, match='no checkpoint'):
        diagnose.main(['--out_dir', str(tmp_path / 'nothing')])


def token_exit_notes(capsys, ce, pmax, kl, latent, m, K):
    """print_token_exit's output as {rule: the note printed under its line, or None}."""
    diagnose.print_token_exit(ce, pmax, kl, latent, m, K)
    lines = capsys.readouterr().out.splitlines()
    at = {rule: next(i for i, line in enumerate(lines) if line.strip().startswith(f"{rule}:"))
          for rule in diagnose.EXITS}
    return {rule: (lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].strip().startswith('note:')
                   else None) for rule, i in at.items()}


def test_token_exit_notes_a_rule_that_sends_every_token_out_at_one_loop(capsys):
    """Every token equally sure (0.99), equally right at every loop and settled from loop 1: each calibrated rule
    sends all the reported tokens out at one loop (confidence and latent at 1, kl at 2, its first), and says so."""
    K, n = 3, 8
    ce, pmax = np.ones((n, K)), np.full((n, K), 0.99)
    kl, latent = np.zeros((n, K)), np.zeros((n, K))
    kl[:, 0] = math.inf
    notes = token_exit_notes(capsys, ce, pmax, kl, latent, n // 2, K)
    for rule, loop in (('confidence', 1), ('kl', 2), ('latent', 1)):
        assert notes[rule] is not None and f"every token exits at loop {loop} of {K}" in notes[rule], notes
    assert 'does not tell tokens apart' in notes['confidence']


def test_token_exit_has_no_note_where_tokens_exit_at_different_loops(capsys):
    """The loop-1 case of test_exit_calibration_considers_loop_1_thresholds twice over: the calibrated confidence
    sends the sure token out at loop 1 and the other at 3, so no note under the confidence line."""
    ce = np.array([[1.0, 1.0, 1.0], [3.0, 1.0, 1.0]] * 2)
    pmax = np.array([[0.95, 0.9, 0.9], [0.92, 0.5, 0.5]] * 2)
    kl, latent = np.zeros_like(pmax), np.ones_like(pmax)
    kl[:, 0] = math.inf
    assert token_exit_notes(capsys, ce, pmax, kl, latent, 2, 3)['confidence'] is None
    assert diagnose.same_exit_note(np.array([1, 3]), 3) is None
    assert 'no token exits early' in diagnose.same_exit_note(np.array([3, 3]), 3)


@pytest.mark.parametrize('recurrence', ['residual', 'normed'])
def test_layer_norms_end_each_pass_at_forwards_norm_and_start_at_the_embedding(recurrence):
    """The per-layer table: its first row is ||e||, its last row of pass k is the ||h_k|| that forward logs, the
    rows between are the layers run by hand, and the angle is angle(e, h_1); the gain's RMS reads the weight."""
    from looped import LoopedConfig, LoopedGPT
    torch.manual_seed(0)
    model = LoopedGPT(LoopedConfig(n_layer=2, n_loop=3, n_embd=32, block_size=16, recurrence=recurrence)).eval()
    x = torch.randint(0, 65, (3, 16))
    rows, angle = diagnose.layer_norms(model, x, 3)
    _, _, stats = model(x)
    e = model.embed(x)
    assert [what for what, _ in rows][:3] == ['embedding e', 'pass 1, after layer 1', 'pass 1, after layer 2']
    assert rows[0][1] == pytest.approx(e.norm(dim=-1).mean().item())
    assert [v for what, v in rows if what.endswith('layer 2')] == pytest.approx(stats['hidden_norm'].tolist())
    assert rows[1][1] == pytest.approx(model.blocks[0](e).norm(dim=-1).mean().item())
    h1 = model.blocks[1](model.blocks[0](e))
    assert angle == pytest.approx(diagnose.angle_deg(e, h1).mean().item())
    with torch.no_grad():
        model.readout.norm.weight.copy_(torch.tensor([3.0, 4.0] * 16))
    assert diagnose.readout_gain(model) == pytest.approx(math.sqrt(12.5))
