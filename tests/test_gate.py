"""Gated supervision (looped.py: Ouro's learned exit gate and its objective) and the gate as an exit
rule (lab/engine.py, python -m lab.sample --exit=gate)."""

import json
import math

import pytest
import torch

from lab import engine
from lab import sample  # sample.py's flags and the engine's exit rules, the gate too: python -m lab.sample
from lab import train  # train.py with the designs: python -m lab.train
from test_designs import tiny, tokens


def set_gate(model, weight=0.0, bias=0.0):
    with torch.no_grad():
        model.exit_gate.weight.fill_(weight)
        model.exit_gate.bias.fill_(bias)


def test_the_exit_distribution_sums_to_1_and_the_last_loop_takes_what_is_left():
    model = tiny(supervision='gated').eval()
    set_gate(model, bias=math.log(0.3 / 0.7))  # lambda = 0.3 at every loop, for every token
    x, y = tokens()
    with torch.no_grad():
        p = model(x, y)[2]['exit_prob']
    assert torch.allclose(p, torch.tensor([0.3, 0.7 * 0.3, 0.7 ** 2]), atol=1e-6)  # K = 3: the last, 0.49
    logits = torch.randn(5, 2, 8) * 4  # any gate, per token
    dist = model.exit_distribution(logits)
    assert torch.allclose(dist.sum(0), torch.ones(2, 8), atol=1e-6) and bool((dist >= 0).all())
    lam = torch.sigmoid(logits)
    assert torch.allclose(dist[-1], (1 - lam[:-1]).prod(0), atol=1e-6)  # the mass no earlier loop took


def test_with_beta_0_and_the_gate_exiting_at_K_the_loss_is_terminal_supervisions():
    gated, terminal = tiny(supervision='gated', gate_beta=0.0), tiny(supervision='terminal')
    terminal.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith('exit_gate')})
    set_gate(gated, bias=-1e4)  # lambda = 0 at every loop: all the mass reaches loop K
    x, y = tokens()
    torch.manual_seed(0)
    a = gated(x, y)[1]
    torch.manual_seed(0)
    b = terminal(x, y)[1]
    assert torch.allclose(a, b, atol=1e-6), (a, b)


def test_with_the_gate_uniform_the_cross_entropy_part_is_per_loop_supervisions():
    gated, per_loop = tiny(supervision='gated', gate_beta=0.0), tiny()
    per_loop.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith('exit_gate')})
    x, y = tokens()
    K = 3
    with torch.no_grad():
        e = gated.embed(x)
        ces = [gated.loop_loss(h, k, y)[1] for k, h in gated.loops(e, K)]
        # lambda_k = 1 / (K - k + 1): p_k = 1/K at every loop
        uniform = [torch.full(x.shape, math.log(1 / (K - k + 1) / (1 - 1 / (K - k + 1)))) for k in range(1, K)]
        loss, p = gated.gated_loss(ces, uniform + [torch.zeros(x.shape)])
        assert torch.allclose(p, torch.full_like(p, 1 / K), atol=1e-6)
        assert torch.allclose(loss, per_loop(x, y)[1], atol=1e-6)


def test_the_entropy_bonus_is_beta_times_the_exit_distributions_entropy():
    model = tiny(supervision='gated', gate_beta=0.25)
    ces = [torch.rand(16) for _ in range(3)]
    gates = [torch.randn(2, 8) for _ in range(3)]
    loss, p = model.gated_loss(ces, gates)
    entropy = -(p * p.log()).sum(0)
    assert torch.allclose(loss, ((p * torch.stack(ces)).sum(0) - 0.25 * entropy).mean(), atol=1e-6)


def test_the_norm_penalty_adds_to_the_gated_loss():
    """Gated supervision keeps the paper's norm penalty: the same weights with lambda = 0.01 add lambda * mean_k
    mean(h_k^2), on the states before any readout, to the gated loss."""
    plain, penalized = tiny(supervision='gated'), tiny(supervision='gated', norm_penalty=0.01)  # same seed, weights
    x, y = tokens()
    with torch.no_grad():
        states = [h for _, h in penalized.loops(penalized.embed(x), 3)]
        expected = 0.01 * torch.stack([h.pow(2).mean() for h in states]).mean()
        assert expected > 1e-3  # well above float32's noise on the loss
        assert torch.allclose(penalized(x, y)[1] - plain(x, y)[1], expected, rtol=1e-4)


def test_the_jacobian_penalty_adds_to_the_gated_loss_at_h_K():
    """Gated supervision keeps STARS's penalty too: w * ||v^T J||^2 added to the gated loss, the estimate at h_K (the
    same random direction gives pass_jacobian(h_K, e), which differs from the estimate at h_1)."""
    plain, penalized = tiny(supervision='gated').eval(), tiny(supervision='gated', jacobian_penalty=0.5).eval()
    x, y = tokens()
    torch.manual_seed(3)
    _, loss, stats = penalized(x, y)
    jac = stats['jacobian']
    assert torch.allclose(loss - plain(x, y)[1], 0.5 * jac ** 2, atol=1e-5)
    e = penalized.embed(x)
    states = [h for _, h in penalized.loops(e, 3)]
    at = []
    for h in (states[-1], states[0]):
        torch.manual_seed(3)
        at.append(penalized.pass_jacobian(h, e))
    assert torch.allclose(jac, at[0], rtol=1e-5) and not torch.allclose(jac, at[1], rtol=1e-5), (jac, at)


def test_the_gates_gradient_reaches_its_weights():
    model = tiny(supervision='gated')
    x, y = tokens()
    model(x, y)[1].backward()
    assert model.exit_gate.weight.grad.abs().sum() > 0 and model.exit_gate.bias.grad.abs() > 0


def test_a_raw_gate_sees_the_scale_and_a_gate_on_the_readout_does_not():
    raw, normed = tiny(supervision='gated'), tiny(supervision='gated', gate_input='readout')
    h = torch.randn(2, 8, 16)
    with torch.no_grad():
        for model in (raw, normed):
            model.exit_gate.bias.fill_(0.5)
        b = 0.5
        assert torch.allclose(raw.gate_logit(10 * h, 2) - b, 10 * (raw.gate_logit(h, 2) - b), rtol=1e-4)
        assert torch.allclose(normed.gate_logit(10 * h, 2), normed.gate_logit(h, 2), atol=1e-5)


def test_under_the_raw_readout_the_two_gate_inputs_are_one_gate():
    # the raw readout reads h_k itself, so the grid trains the gate on the readout under rmsnorm only
    raw, readout = tiny(supervision='gated', readout='raw'), tiny(supervision='gated', readout='raw',
                                                                  gate_input='readout')
    readout.load_state_dict(raw.state_dict())
    h = torch.randn(2, 8, 16) * 30
    with torch.no_grad():
        assert torch.equal(raw.gate_logit(h, 2), readout.gate_logit(h, 2))


def test_gated_training_shows_the_exit_distribution_in_the_eval_line(small_data, tmp_path, capsys):
    out = tmp_path / 'run'
    train.main(['--dataset', small_data, '--out_dir', str(out), '--n_layer=1', '--n_embd=16', '--n_head=2',
                '--n_loop=2', '--block_size=16', '--batch_size=2', '--max_iters=2', '--eval_interval=1',
                '--eval_iters=1', '--supervision=gated'])
    evals = [line for line in capsys.readouterr().out.splitlines() if line.startswith('eval ')]
    assert len(evals) == 3 and all(' | exit p ' in line and ' | |gate logit| ' in line for line in evals)
    with open(out / 'log.jsonl') as f:
        last = [json.loads(line) for line in f][-1]
    assert len(last['exit_prob']) == 2 and abs(sum(last['exit_prob']) - 1) < 1e-5
    assert len(last['gate_logit']) == 2


# ---- the gate as an exit rule

def test_a_gate_that_never_fires_generates_the_plain_generates_tokens():
    model = tiny(supervision='gated').eval()
    prompt = tokens(B=2, T=3)[0]
    torch.manual_seed(4)
    want = model.generate(prompt, 20, n_loop=3)
    for cache in (True, False):
        torch.manual_seed(4)
        got, depth = engine.generate(model, prompt, 20, n_loop=3, exit_rule='gate', exit_threshold=2.0,
                                     cache=cache)
        assert torch.equal(got, want) and bool((depth == 3).all()), cache


@pytest.mark.parametrize('cache', [None, 'empty'], ids=['recomputed', 'from_an_empty_cache'])
@pytest.mark.parametrize('design', [{}, {'n_coda': 1, 'gate_input': 'readout'}], ids=['raw_gate', 'coda_readout_gate'])
def test_each_sequence_exits_where_its_own_cumulative_exit_probability_reaches_the_threshold(design, cache,
                                                                                              monkeypatch):
    """Also with a coda and a gate on the head's input (the gate then runs the coda over the whole window, through
    the cache when there is one): the engine's gate logits and exit loops are the hand computation's."""
    model = tiny(supervision='gated', seed=3, **design).eval()
    logits, next_gate = [], engine.next_gate
    monkeypatch.setattr(engine, 'next_gate', lambda *a, **k: logits.append(next_gate(*a, **k)) or logits[-1])
    with torch.no_grad():  # lambda from 0.2 to 0.6: some sequences exit at loop 1, some only once two add up
        model.exit_gate.weight.copy_(torch.randn(1, 16, generator=torch.Generator().manual_seed(0)) * 0.3)
        model.exit_gate.bias.fill_(-0.6)
    window = torch.randint(11, (6, 8), generator=torch.Generator().manual_seed(2))
    kv = engine.KVCache(model.config.block_size) if cache else None
    _, depth = engine.next_logprobs(model, window, 3, 'gate', 0.5, kv)
    with torch.no_grad():  # by hand: the first loop whose 1 - prod (1 - lambda_j) reaches 0.5, else K
        stay, want, hand = torch.ones(6), torch.full((6,), 3), []
        for k, h in model.loops(model.embed(window), 3):
            hand.append(model.gate_logit(h, k)[:, -1])
            stay = stay * (1 - torch.sigmoid(hand[-1]))
            fresh = (1 - stay >= 0.5) & (want == 3) & (k < 3)
            want[fresh] = k
    assert torch.equal(depth, want) and set(depth.tolist()) == {1, 2, 3}, (depth, want)
    assert len(logits) >= 2 and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(logits, hand)), (logits, hand)


def test_the_gate_rule_on_a_model_without_a_gate_is_one_line(small_data, tmp_path):
    with pytest.raises(ValueError, match="no exit gate"):
        engine.next_logprobs(tiny().eval(), torch.zeros(1, 4, dtype=torch.long), 3, 'gate', 0.5)
    out = tmp_path / 'plain'
    train.main(['--dataset', small_data, '--out_dir', str(out), '--n_layer=1', '--n_embd=16', '--n_head=2',
                '--n_loop=2', '--block_size=16', '--batch_size=2', '--max_iters=1', '--eval_interval=1',
                '--eval_iters=1'])
    with pytest.raises(SystemExit) as e:
        sample.main(['--out_dir', str(out), '--exit=gate', '--max_new_tokens=2'])
    assert 'needs a model trained with --supervision=gated' in str(e.value.code) and '\n' not in str(e.value.code)


def test_sample_generates_with_the_gate_from_a_gated_checkpoint_at_its_default_threshold(small_data, tmp_path,
                                                                                         capsys):
    out = tmp_path / 'gated'
    train.main(['--dataset', small_data, '--out_dir', str(out), '--n_layer=1', '--n_embd=16', '--n_head=2',
                '--n_loop=2', '--block_size=16', '--batch_size=2', '--max_iters=1', '--eval_interval=1',
                '--eval_iters=1', '--supervision=gated'])
    capsys.readouterr()
    sample.main(['--out_dir', str(out), '--exit=gate', '--max_new_tokens=5', '--num_samples=2'])
    assert 'exit=gate, threshold 0.5' in capsys.readouterr().out


# ---- the gate at matched depth (lab/diagnose.py, lab/matched_depth.py) and in lab/paper.py's table

def test_a_windows_gate_score_is_its_mean_cumulative_exit_probability():
    from lab import diagnose
    model = tiny(supervision='gated', seed=3).eval()
    with torch.no_grad():
        model.exit_gate.weight.copy_(torch.randn(1, 16, generator=torch.Generator().manual_seed(0)) * 0.3)
        model.exit_gate.bias.fill_(-0.6)
    x, y = tokens(B=5, T=8)
    ce, scores = diagnose.sequence_depth_stats(model, x, y, 3, batch_size=2, gate=True)
    ce_plain, plain = diagnose.sequence_depth_stats(model, x, y, 3, batch_size=2)
    assert set(scores) == set(plain) | {'gate'} and (ce == ce_plain).all()
    with torch.no_grad():  # by hand, per token: 1 - prod_{j<=k} (1 - lambda_j), then the window's mean
        stay, want = torch.ones(5, 8), []
        for k, h in model.loops(model.embed(x), 3):
            stay = stay * (1 - torch.sigmoid(model.gate_logit(h, k)))
            want.append((1 - stay).mean(-1))
    assert torch.allclose(torch.from_numpy(scores['gate']), torch.stack(want, 1), atol=1e-6)
    assert (scores['gate'][:, 1:] >= scores['gate'][:, :-1]).all()  # it only rises: one threshold, one exit


def test_matched_depth_pairs_the_gate_with_each_of_the_references_rules():
    from lab.grid import group_runs
    from lab.stats import pair_up
    from test_matched_depth import fake_run
    import numpy as np
    from lab import matched_depth as md
    runs = [fake_run(f"r{s}", 'per_loop + rmsnorm', s, 'rmsnorm') for s in (1, 2)]
    runs += [fake_run(f"g{s}", 'gated + rmsnorm', s, 'rmsnorm') for s in (1, 2)]
    for run in runs[2:]:
        run['config']['model']['supervision'] = run['config']['supervision'] = 'gated'
    rules = list(md.diagnose.SCORES)
    curves = {f"r{s}": {r: np.full(5, 2.0 + i + s) for i, r in enumerate(rules)} for s in (1, 2)}
    curves.update({f"g{s}": {**{r: np.full(5, 2.5 + s) for r in rules}, 'gate': np.full(5, 1.0 + s)}
                   for s in (1, 2)})
    rows = md.matched_rows(pair_up(group_runs(runs), 'per_loop + rmsnorm'), curves, 'per_loop + rmsnorm')
    assert [r['score'] for r in rows] == rules + [f"gate vs {r}" for r in rules]
    for i, row in enumerate(rows[len(rules):]):  # the gated run's gate minus the per-loop run's rule i
        assert row['stats'][0]['mean'] == pytest.approx(-1.0 - i) and row['pairs'] == 2


def train_tiny(data, out, *flags):
    train.main(['--dataset', data, '--out_dir', str(out), '--n_layer=1', '--n_embd=16', '--n_head=2',
                '--n_loop=2', '--block_size=16', '--batch_size=2', '--max_iters=2', '--eval_interval=1',
                '--eval_iters=1', *flags])
    return str(out)


def test_the_gate_against_the_rules_in_its_own_runs_and_its_table(small_data, tmp_path, capsys):
    from lab import matched_depth as md, paper
    gated = [train_tiny(small_data, tmp_path / f"gated{s}", '--supervision=gated', f'--seed={s}')
             for s in (1, 2)]
    plain = train_tiny(small_data, tmp_path / 'plain', '--seed=1')
    md.main([*gated, '--against=gate', '--max_windows=8', f"--fig_dir={tmp_path / 'md'}"])
    text = (tmp_path / 'md' / 'matched_depth.md').read_text()
    assert all(f"| {rule} - gate |" in text for rule in md.diagnose.SCORES)
    with pytest.raises(SystemExit) as e:
        md.main([plain, '--against=gate', '--max_windows=8', f"--fig_dir={tmp_path / 'md2'}"])
    assert 'has no exit gate' in str(e.value.code) and '\n' not in str(e.value.code)
    paper.main([*gated, plain, '--exit_windows=0', f"--fig_dir={tmp_path / 'fig'}"])
    lines = (tmp_path / 'fig' / 'table.md').read_text().splitlines()
    header = [c.strip() for c in lines[0].split('|')]
    col = header.index('exit p_k, k = 1..K')
    cells = {line.split('|')[1].strip(): line.split('|')[col].strip() for line in lines[2:4]}
    gated_p = [float(v) for v in cells['gated + rmsnorm'].split()]
    assert len(gated_p) == 2 and sum(gated_p) == pytest.approx(1, abs=2e-3)
    assert cells['per_loop + rmsnorm'] == ''  # no gate, no exit probability


@pytest.mark.parametrize('gate_input', ['raw', 'readout'])
def test_the_gate_alignment_splits_each_logit_into_weight_norm_state_norm_and_cosine(gate_input):
    from lab import diagnose
    model = tiny(supervision='gated', gate_input=gate_input, seed=2).eval()
    set_gate(model, bias=0.5)
    with torch.no_grad():
        model.exit_gate.weight[0, 0] = 2.0  # w = 2 e_0: the logit is 2 z_0 + 0.5
    x, _ = tokens()
    rows = diagnose.gate_alignment(model, x, 3)
    with torch.no_grad():
        for (k, h), (z_norm, w_norm, cos, logit) in zip(model.loops(model.embed(x), 3), rows):
            z = h if gate_input == 'raw' else model.exit_input(h, k)
            assert w_norm == pytest.approx(2.0)
            assert z_norm == pytest.approx(z.norm(dim=-1).mean().item(), rel=1e-5)
            assert cos == pytest.approx((z[..., 0].abs() / z.norm(dim=-1)).mean().item(), rel=1e-5)
            assert logit == pytest.approx((2 * z[..., 0] + 0.5).abs().mean().item(), rel=1e-5)


def test_diagnose_asked_for_the_gate_of_a_run_without_one_is_one_line(small_data, tmp_path):
    from lab import diagnose
    plain = train_tiny(small_data, tmp_path / 'plain')
    with pytest.raises(SystemExit) as e:
        diagnose.main(['--out_dir', plain, '--only=gate'])
    assert 'has no exit gate' in str(e.value.code) and '\n' not in str(e.value.code)
