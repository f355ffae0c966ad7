"""The field's looped designs (looped.py: injection, prelude and coda, sandwich blocks, sampled depth, truncated
backprop, the latent exit rule), the registry they are declared in, and the generation controls."""

import math
import os
import re
import subprocess
import sys
from dataclasses import asdict, fields

import numpy as np
import pytest
import torch

from lab import grid
from lab import train  # train.py with the designs: python -m lab.train
from conftest import ROOT
from lab.runs import condition_name, load_model
from lab import engine
from lab.engine import exit_passes, generate, latent_change
from lab.designs import DESIGN_FLAGS, DESIGNS, DesignBlock, DesignConfig, DesignedGPT, flag_values, sampled_depth
from looped import LoopedConfig, LoopedGPT

BASE = dict(vocab_size=11, block_size=8, n_embd=16, n_head=2, n_layer=1, n_loop=3)


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return DesignedGPT(DesignConfig(**{**BASE, **kw}))


def tokens(B=2, T=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(11, (B, T), generator=g), torch.randint(11, (B, T), generator=g)


def record_passes(model):
    """Hook the stack's first layer: returns the list that every pass's input is appended to."""
    inputs = []
    model.blocks[0].register_forward_pre_hook(lambda layer, args: inputs.append(args[0]))
    return inputs


# ---- the registry: a design is its DesignConfig field

# a value other than the default for every field train.py has a flag for, all valid together: the paper's here,
# each design's its example in lab/designs.py's DESIGN_FLAGS (concat and sandwich: the asserts below read them)
NON_DEFAULT = dict(block_size=16, n_embd=16, n_head=2, n_layer=1, n_loop=3, dropout=0.1, supervision='terminal',
                   readout='alpha', alpha=0.5, norm_penalty=0.02, recurrence='normed', tie_weights=True,
                   norm_eps=1e-5, **{name: flag.example for name, flag in DESIGN_FLAGS.items()})
NON_DEFAULT.update(injection='concat', block='sandwich')


def test_every_config_field_is_a_flag_that_reaches_the_model_and_the_checkpoint(small_data, tmp_path):
    assert set(NON_DEFAULT) == {f.name for f in fields(DesignConfig)} - {'vocab_size'}, \
        "a DesignConfig field was added or removed: give it a non-default value in NON_DEFAULT"
    for f in fields(DesignConfig):
        if f.name in NON_DEFAULT:
            assert NON_DEFAULT[f.name] != f.default, f.name
    out = tmp_path / 'run'
    flags = [f'--{k}={v}' for k, v in NON_DEFAULT.items()]
    train.main(['--dataset', small_data, '--out_dir', str(out), '--batch_size=2', '--max_iters=2', '--eval_interval=2',
                '--eval_iters=1', '--log_interval=1', *flags])
    model, ckpt = load_model(str(out))
    for name, value in NON_DEFAULT.items():
        assert ckpt['config'][name] == value, f"--{name}={value} did not reach the checkpoint ({ckpt['config'][name]})"
        assert getattr(model.config, name) == value, f"--{name}={value} did not reach the loaded model"
    assert model.adapter is not None and len(model.prelude) == len(model.coda) == 1
    assert isinstance(model.blocks[0].post_mlp, torch.nn.Module) and model.blocks[0].post_mlp.weight.shape == (16,)


def test_a_default_run_is_named_by_every_variant_not_at_its_default():
    args = train.parse_args(['--readout=raw', '--injection=add', '--n_prelude=2', '--bptt=1', '--block=sandwich'])
    assert args.out_dir == os.path.join('out', 'laptop-readout_raw-injection_add-prelude2-block_sandwich-bptt1')
    assert condition_name(asdict(train.model_config(args)[1])) == 'per_loop + raw + add + prelude2 + sandwich + bptt1'


def test_the_paper_grid_is_its_ten_conditions_whatever_is_declared():
    assert len(grid.GRIDS['paper']) == 10 and grid.GRIDS['paper'] == grid.CONDITIONS
    assert grid.grid_of('laptop') is grid.GRIDS['paper'] and grid.grid_of('laptop_long') is grid.GRIDS['claim4']
    assert len(grid.ATLAS) == 2 * len(grid.DESIGNS) and set(grid.ATLAS_DESIGN.values()) == \
        {(d, r) for d in grid.DESIGNS for r in grid.ATLAS_READOUTS}
    for design, entry in grid.DESIGNS.items():  # one entry a design: its flags and its prediction together
        assert isinstance(entry, grid.Design) and isinstance(entry.carried, bool) and entry.why, design
        assert entry.rmsnorm in ('large', 'small') and entry.raw in ('large', 'small'), design
    for grid_name, conditions in grid.GRIDS.items():
        for name, flags in conditions.items():
            assert grid.flags_name(flags) == name, (grid_name, name)


@pytest.mark.parametrize('flag, message', [('--bptt=-1', 'bptt=-1 must be at least 0'),
                                           ('--n_coda=-2', 'n_coda=-2 must be at least 0'),
                                           ('--n_prelude=-1', 'n_prelude=-1 must be at least 0'),
                                           ('--injection=mul', "invalid choice: 'mul'"),
                                           ('--depth_sampling=uniform', "invalid choice: 'uniform'")])
def test_a_bad_design_flag_is_a_one_line_error(small_data, tmp_path, capsys, flag, message):
    with pytest.raises(SystemExit) as e:
        train.main(['--dataset', small_data, '--out_dir', str(tmp_path / 'x'), '--max_iters=1', flag])
    text = str(e.value.code)
    assert message in text and '\n' not in text.strip()
    assert not os.path.exists(tmp_path / 'x' / 'ckpt.pt')


# ---- the designs

def test_concat_at_init_computes_what_none_does():
    x, y = tokens()
    plain, concat = tiny(), tiny(injection='concat')
    missing = concat.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert missing == ['adapter.weight']  # the adapter keeps its own start, [I | 0]
    with torch.no_grad():
        (a, la, _), (b, lb, _) = plain(x, y), concat(x, y)
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(la, lb, atol=1e-6)
    d = BASE['n_embd']
    assert torch.equal(concat.adapter.weight, torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1))


def test_add_adds_e_at_every_pass_not_once():
    model = tiny(injection='add').eval()
    x, _ = tokens()
    inputs = record_passes(model)
    with torch.no_grad():
        e = model.embed(x)
        states = [h for _, h in model.loops(e, 3)]
    assert torch.allclose(inputs[0], 2 * e)  # pass 1 runs on h_0 + e with h_0 = e
    for k in (1, 2):
        assert torch.allclose(inputs[k], states[k - 1] + e), f"pass {k + 1} did not run on h_{k} + e"


@pytest.mark.parametrize('supervision', ['per_loop', 'terminal'])
def test_the_prelude_runs_once_and_the_coda_at_every_readout(supervision):
    model = tiny(n_prelude=1, n_coda=1, supervision=supervision).eval()
    calls = {'prelude': 0, 'coda': 0}
    model.prelude[0].register_forward_hook(lambda *a: calls.__setitem__('prelude', calls['prelude'] + 1))
    model.coda[0].register_forward_hook(lambda *a: calls.__setitem__('coda', calls['coda'] + 1))
    x, y = tokens()
    with torch.no_grad():
        _, _, stats = model(x, y)
    assert calls == {'prelude': 1, 'coda': 3}, calls  # every loop is decoded, so every readout goes through the coda
    # the carried and logged state is the core's output, before the coda
    with torch.no_grad():
        h = model.loop_pass(model.embed(x), model.embed(x), 1, 1)
    assert torch.allclose(stats['hidden_norm'][0], h.norm(dim=-1).mean())
    # the next-token logits of a coda model see the whole sequence, as in a full forward pass
    with torch.no_grad():
        full, _, _ = model(x, y)
        last, _, _ = model(x)
    assert torch.allclose(last[:, 0], full[:, -1], atol=1e-5)


@pytest.mark.parametrize('scale', [1e-3, 1.0, 1e3])
def test_a_sandwich_block_hands_on_the_rms_of_its_last_gain_whatever_the_input_scale(scale):
    torch.manual_seed(0)
    block = DesignBlock(DesignConfig(**BASE, block='sandwich'))
    with torch.no_grad():
        block.post_mlp.weight.fill_(2.5)
        out = block(scale * torch.randn(2, 8, 16))
    assert torch.allclose(out.pow(2).mean(-1).sqrt(), torch.full((2, 8), 2.5), rtol=1e-3)
    prenorm = DesignBlock(DesignConfig(**BASE))
    with torch.no_grad():
        assert prenorm(scale * torch.randn(2, 8, 16)).pow(2).mean().sqrt() > scale / 10  # a pre-norm block keeps scale


def test_a_sandwich_block_normalizes_both_sublayer_sums_by_hand():
    """Its output RMS alone cannot tell whether the norm after attention is there; the block written out can:
    y = g2 * u(x1 + mlp(norm_2(x1))) with x1 = g1 * u(x + attn(norm_1(x))) and u(v) = v / rms(v)."""
    torch.manual_seed(0)
    block = DesignBlock(DesignConfig(**BASE, block='sandwich'))
    with torch.no_grad():
        block.post_attn.weight.copy_(torch.linspace(0.5, 2.0, 16))  # gains that differ, so each norm shows
        block.post_mlp.weight.copy_(torch.linspace(2.0, 0.5, 16))
        x = 7.0 * torch.randn(2, 8, 16)
        u = lambda v: v / (v.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        x1 = block.post_attn.weight * u(x + block.attn(block.norm_1(x)))
        want = block.post_mlp.weight * u(x1 + block.mlp(block.norm_2(x1)))
        assert torch.allclose(block(x), want, atol=1e-5)
        assert not torch.allclose(x + block.attn(block.norm_1(x)), x1, atol=1e-2)  # the first norm changes the sum


def expected_sampled_mean(K, sigma=0.5):
    """E[r] of the clamped draw, by quadrature over tau and the exact Poisson probabilities (not by sampling)."""
    taus = np.linspace(-6, 6, 4001) * sigma + math.log(K - 1) - sigma ** 2 / 2
    w = np.exp(-0.5 * ((taus - taus.mean()) / sigma) ** 2)
    w /= w.sum()
    total = 0.0
    for tau, wt in zip(taus, w):
        lam = math.exp(tau)
        pmf = [math.exp(-lam + n * math.log(lam) - math.lgamma(n + 1)) for n in range(2 * K)]  # P(r = n + 1)
        total += wt * (sum((n + 1) * p for n, p in enumerate(pmf)) + 2 * K * (1 - sum(pmf)))
    return total


def test_sampled_depths_have_the_distributions_mean_and_range():
    config = DesignConfig(**{**BASE, 'n_loop': 4}, depth_sampling='poisson_lognormal')
    r = np.array([sampled_depth(config, 7, step) for step in range(20000)])
    assert r.min() == 1 and r.max() == 8, (r.min(), r.max())
    want = expected_sampled_mean(4)
    assert abs(r.mean() - want) < 0.04, (r.mean(), want)  # 20,000 draws: standard error about 0.013
    assert 3.8 < want < 4.0  # mean K = 4 before the clamp, which trims the tail above 2K
    assert sampled_depth(DesignConfig(**{**BASE, 'n_loop': 4}), 7, 3) == 4  # fixed depth: K at every step


def test_sampled_depths_are_the_same_in_another_process():
    code = ("from lab.designs import DesignConfig, sampled_depth; c = DesignConfig(n_loop=4, depth_sampling="
            "'poisson_lognormal'); print([sampled_depth(c, 3, s) for s in range(40)])")
    other = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, check=True)
    config = DesignConfig(n_loop=4, depth_sampling='poisson_lognormal')
    assert other.stdout.strip() == str([sampled_depth(config, 3, s) for s in range(40)])


def drawn_depths(output):
    return [int(r) for r in re.findall(r'\| r (\d+) \|', output)]


def test_sampled_depth_trains_at_the_drawn_count_and_resumes_the_same_sequence(small_data, tmp_path, capsys):
    flags = ['--dataset', small_data, '--n_layer=1', '--n_embd=16', '--n_head=2', '--n_loop=2', '--block_size=16',
             '--batch_size=2', '--eval_iters=1', '--log_interval=1', '--eval_interval=3',
             '--depth_sampling=poisson_lognormal']
    train.main([*flags, '--out_dir', str(tmp_path / 'a'), '--max_iters=6', '--seed=5'])
    whole = drawn_depths(capsys.readouterr().out)
    train.main([*flags, '--out_dir', str(tmp_path / 'b'), '--max_iters=3', '--seed=5'])
    train.main([*flags, '--out_dir', str(tmp_path / 'b'), '--max_iters=6', '--resume'])  # the seed is the run's
    resumed = drawn_depths(capsys.readouterr().out)
    config = DesignConfig(n_loop=2, depth_sampling='poisson_lognormal')
    assert whole == resumed == [sampled_depth(config, 5, s) for s in range(6)]
    assert len(set(whole)) > 1


def test_training_uses_the_drawn_loop_count(small_data, tmp_path, monkeypatch):
    counts = []
    forward = DesignedGPT.forward
    monkeypatch.setattr(DesignedGPT, 'forward',
                        lambda self, *a, n_loop=None, **k: (self.training and counts.append(n_loop))
                        or forward(self, *a, n_loop=n_loop, **k))
    monkeypatch.setattr(DesignedGPT, 'sampled_depth', lambda self, seed, step: 1 + step % 3)
    train.main(['--dataset', small_data, '--out_dir', str(tmp_path / 'r'), '--n_layer=1', '--n_embd=16', '--n_head=2',
                '--depth_sampling=poisson_lognormal',
                '--n_loop=2', '--block_size=16', '--batch_size=2', '--eval_iters=1', '--log_interval=1',
                '--eval_interval=100', '--max_iters=4'])
    assert counts == [1, 2, 3, 1]  # training steps only (evaluations run in eval mode, at K and 2K)


@pytest.mark.parametrize('b', [1, 2])
def test_bptt_cuts_the_gradient_through_the_carried_state_before_the_last_b_passes(b):
    model = tiny(n_loop=4, bptt=b)
    x, _ = tokens()
    states = []
    h0 = model.embed(x)
    for k, h in model.loops(h0, 4):
        states.append(h)
    grads = torch.autograd.grad(states[-1].sum(), [h0, *states[:-1]], allow_unused=True)
    for j, g in enumerate(grads):  # j = 0: h_0, j: h_j
        cut = j <= 4 - b  # pass 4 - b + 1 runs on h_{4-b} detached: nothing before it reaches h_4
        zero = g is None or not g.abs().sum().item()
        assert zero == cut, f"bptt={b}: gradient of h_4 through h_{j} {'survived' if not zero else 'was cut'}"


def test_bptt_leaves_the_injected_embedding_its_gradient():
    """With injection, e reaches every pass directly: truncation cuts the carried state only."""
    model = tiny(n_loop=4, bptt=1, injection='add')
    x, _ = tokens()
    h0 = model.embed(x)
    states = [h for _, h in model.loops(h0, 4)]
    grads = torch.autograd.grad(states[-1].sum(), [h0, *states[:-1]], allow_unused=True)
    assert grads[0].abs().sum() > 0, "the injected e lost its gradient"
    assert all(g is None or not g.abs().sum() for g in grads[1:]), "bptt=1 let gradient through a carried state"


@pytest.mark.parametrize('b', [4, 9])
def test_bptt_at_least_k_is_full_backprop(b):
    x, y = tokens()
    grads = []
    for bptt in (0, b):
        model = tiny(n_loop=4, bptt=bptt)
        model(x, y)[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, c) for a, c in zip(*grads))


def test_the_latent_rule_on_hand_made_states():
    h_prev = torch.tensor([[3.0, 4.0], [1.0, 0.0]])                 # norms 5 and 1
    h = h_prev + torch.tensor([[0.3, 0.4], [0.0, 0.2]])             # relative changes 0.1 and 0.2
    logp = torch.log_softmax(torch.zeros(2, 5), -1)
    assert torch.allclose(latent_change(h, h_prev), torch.tensor([0.1, 0.2]))
    assert exit_passes('latent', 0.15, logp, None, h, h_prev).tolist() == [True, False]
    assert exit_passes('latent', 0.2 + 1e-6, logp, None, h, h_prev).tolist() == [True, True]
    assert exit_passes('latent', 1e9, logp, None, h, None).tolist() == [False, False]  # nothing to compare with
    # scale-free: a state 100 times larger with the same update direction relative to it exits alike
    assert exit_passes('latent', 0.15, logp, None, 100 * h, 100 * h_prev).tolist() == [True, False]


def test_the_exit_benchmark_drops_exited_rows_of_e_too():
    """The per-sequence benchmark removes exited sequences from the batch mid-loop; the injected e must follow."""
    from lab import diagnose
    from lab.designs import CHOICES
    for injection in CHOICES['injection'][1:]:  # every injection there is: each adds e to a pass
        model = tiny(injection=injection).eval()
        x, y = tokens(B=6)
        for score in diagnose.SCORES:
            ce, scores = diagnose.sequence_depth_stats(model, x, y, 3)
            t = float(np.median(scores[score][:, 0]))  # about half the sequences leave at loop 1
            loops, ppl, _ = diagnose.timed_exit_run(model, x, y, 3, score, t, batch_size=6)
            want_loops, want_ppl = diagnose.sequence_exit(ce, scores[score], t, 3)
            assert loops == pytest.approx(want_loops) and ppl == pytest.approx(want_ppl, rel=1e-4), (injection, score)


# ---- generation controls, each tested directly

def test_generate_with_top_k_1_is_greedy_at_any_temperature():
    model = tiny().eval()
    x, _ = tokens()
    outs = []
    for seed, temperature in ((1, 1.0), (2, 5.0)):
        torch.manual_seed(seed)
        outs.append(generate(model, x, 5, temperature=temperature, top_k=1)[0])
    assert torch.equal(outs[0], outs[1])
    idx = x
    for _ in range(5):  # greedy by hand
        logits, _, _ = model(idx[:, -BASE['block_size']:])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(outs[0], idx)


def test_generate_samples_only_among_the_top_k():
    model = tiny().eval()
    x, _ = tokens(B=1)
    logits, _, _ = model(x)
    allowed = set(logits[0, -1].topk(3).indices.tolist())
    seen = set()
    for seed in range(60):
        torch.manual_seed(seed)
        seen.add(generate(model, x, 1, top_k=3, temperature=100.0)[0][0, -1].item())  # flat among the 3
    assert seen == allowed, (seen, allowed)


def test_generate_temperature_sharpens_and_flattens():
    model = tiny().eval()
    x, _ = tokens(B=1)
    draws = {}
    for temperature in (0.05, 100.0):
        torch.manual_seed(0)
        draws[temperature] = {generate(model, x, 1, temperature=temperature)[0][0, -1].item() for _ in range(80)}
    assert len(draws[0.05]) <= 2 < len(draws[100.0]), draws


def test_generate_crops_the_context_at_block_size(monkeypatch):
    """The window generate reads: the prompt's last block_size tokens, growing to block_size, then restarting at its
    newest block_size // 2 (the same with the cache and without)."""
    model = tiny().eval()
    long = torch.randint(11, (1, 3 * BASE['block_size']))
    step = engine.next_logprobs
    for cache in (True, False):
        windows = []
        monkeypatch.setattr(engine, 'next_logprobs', lambda self, w, *a: windows.append(w) or step(self, w, *a))
        out, _ = generate(model, long, 6, top_k=1, cache=cache)
        assert torch.equal(windows[0], long[:, -BASE['block_size']:])
        assert [w.size(1) for w in windows] == [8, 4, 5, 6, 7, 8] and torch.equal(windows[-1], out[:, -9:-1])


@pytest.mark.parametrize('rule, threshold, loops', [('confidence', 0.0, 1), ('confidence', 2.0, 3), ('kl', 1e9, 2),
                                                    ('kl', -1.0, 3), ('latent', 1e9, 1), ('latent', -1.0, 3)])
def test_generate_stops_looping_where_each_exit_rule_says(rule, threshold, loops):
    model = tiny().eval()
    x, _ = tokens()
    _, used = generate(model, x, 3, exit_rule=rule, exit_threshold=threshold)
    assert used.tolist() == [[loops] * 3] * x.size(0)


def test_the_latent_rule_in_generate_watches_the_last_positions_state():
    model = tiny().eval()
    x, _ = tokens(B=1)
    with torch.no_grad():
        h0 = model.embed(x)
        states = [h for _, h in model.loops(h0, 3)]
    changes = [latent_change(b[:, -1], a[:, -1]).item() for a, b in zip([h0] + states, states)]
    # at the smallest change exactly, the rule first passes at the loop that has it
    _, used = generate(model, x, 1, exit_rule='latent', exit_threshold=min(changes))
    assert used.tolist() == [[int(np.argmin(changes)) + 1]], changes


# What the code before the designs (commit 407eef2) computed for tiny() with seed 0 on tokens(): the loss, three
# logits at the last position and ||h_k||. The defaults must still give exactly these (same draws, same math).
# (init='gpt2' left this list when each of its weights got a generator of its own: tests/test_registry.py)
BEFORE = [({}, 10.599486351013184, [2.688375949859619, 13.639297485351562, 2.5225934982299805],
           [5.583408355712891, 5.833728790283203, 6.2412919998168945]),
          ({'recurrence': 'normed', 'readout': 'raw', 'supervision': 'terminal'}, 10.719040870666504,
           [3.4080591201782227, 15.060771942138672, 3.0049312114715576],
           [5.583408355712891, 4.274403095245361, 4.487105846405029])]


@pytest.mark.parametrize('kw, loss, logits, norms', BEFORE)
def test_the_default_designs_compute_what_the_model_computed_before_them(kw, loss, logits, norms):
    x, y = tokens()
    out, got, stats = tiny(**kw)(x, y)
    assert got.item() == pytest.approx(loss, rel=1e-6)
    assert out[0, -1, :3].tolist() == pytest.approx(logits, rel=1e-5)
    assert stats['hidden_norm'].tolist() == pytest.approx(norms, rel=1e-6)


def test_a_checkpoint_written_before_the_designs_loads_and_computes_the_same(tmp_path):
    """A checkpoint's config from before the design fields existed (the fields as of commit 407eef2) loads as the
    default model it was: the same weights and the same logits."""
    before = ('vocab_size', 'block_size', 'n_embd', 'n_head', 'n_layer', 'n_loop', 'dropout', 'readout', 'alpha',
              'recurrence', 'supervision', 'norm_penalty', 'init', 'mlp', 'tie_weights', 'attention', 'norm_eps')
    model = tiny().eval()
    old_config = {k: asdict(model.config)[k] for k in before}
    torch.save({'model': model.state_dict(), 'config': old_config, 'step': 1}, tmp_path / 'ckpt.pt')
    loaded, _ = load_model(str(tmp_path / 'ckpt.pt'))
    x, _ = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(x)[0], model(x)[0])
    assert condition_name(old_config) == 'per_loop + rmsnorm'


def test_the_paper_model_is_the_designed_model_at_its_defaults():
    """looped.py's LoopedGPT, which the lab never builds (its tools build DesignedGPT), is DesignedGPT with every
    design field at its default: the same parameters drawn from the same seed, the same loss, logits, norms and
    cross-entropies, and the same optimizer, the authors' (one group: weight decay on every parameter)."""
    torch.manual_seed(0)
    paper, designed = LoopedGPT(LoopedConfig(**BASE)), tiny()
    assert [n for n, _ in paper.named_parameters()] == [n for n, _ in designed.named_parameters()]
    for (name, a), b in zip(paper.named_parameters(), designed.parameters()):
        assert torch.equal(a, b), name
    x, y = tokens()
    (logits_p, loss_p, stats_p), (logits_d, loss_d, stats_d) = paper(x, y), designed(x, y)
    assert torch.equal(logits_p, logits_d) and torch.equal(loss_p, loss_d)
    assert torch.equal(stats_p['hidden_norm'], stats_d['hidden_norm']) and torch.equal(stats_p['ce'], stats_d['ce'])
    for model in (paper, designed):
        groups = model.configure_optimizers(0.1, 1e-3, 'cpu').param_groups
        assert [(g['weight_decay'], len(g['params'])) for g in groups] == [(0.1, len(list(model.parameters())))]


# ---- the learning-rate warmup (off by default)

def test_warmup_raises_the_learning_rate_linearly_then_holds_it(small_data, tmp_path, monkeypatch):
    rates, real = [], torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, 'step', lambda self, *a, **k: rates.append(self.param_groups[0]['lr'])
                        or real(self, *a, **k))
    flags = ['--dataset', small_data, '--n_layer=1', '--n_embd=16', '--n_head=2', '--n_loop=2', '--block_size=16',
             '--batch_size=2', '--eval_iters=1', '--log_interval=10', '--eval_interval=10', '--learning_rate=0.01']
    train.main([*flags, '--out_dir', str(tmp_path / 'w'), '--max_iters=6', '--warmup_iters=4'])
    assert rates == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01])
    rates.clear()
    train.main([*flags, '--out_dir', str(tmp_path / 'c'), '--max_iters=3'])
    assert rates == pytest.approx([0.01] * 3)  # the default: constant from the first step
    with pytest.raises(SystemExit) as e:
        train.main([*flags, '--out_dir', str(tmp_path / 'bad'), '--warmup_iters=-1'])
    assert 'warmup_iters=-1 must be at least 0' in str(e.value.code)


def test_inverse_k_residual_scale_divides_each_pass_update_by_k():
    plain, scaled = tiny(), tiny(residual_scale='inverse_k')
    scaled.load_state_dict(plain.state_dict())
    h = torch.randn(2, 8, 16)
    with torch.no_grad():
        assert torch.allclose(next(scaled.loops(h, 1))[1], h + (plain.loop_pass(h, h, 1, 1) - h) / 3, atol=1e-6)


def test_parameters_are_registered_in_the_order_the_committed_runs_trained_in():
    """The optimizer's state is saved by position, and gradient clipping sums the parameters' norms in order: the
    stack, then the prelude, the coda and the concat adapter, then the readout, then the designs made after the head."""
    model = tiny(n_prelude=1, n_coda=1, injection='concat', recurrence='damped', supervision='gated',
                 readout='alpha')
    order = []
    for name, _ in model.named_parameters():
        if name.split('.')[0] not in order:
            order.append(name.split('.')[0])
    # the model's own parameter (damping) comes first, as named_parameters lists a module's own before its children's
    assert order == ['damping', 'wte', 'wpe', 'blocks', 'prelude', 'coda', 'adapter', 'readout', 'exit_gate'], order


def test_a_checkpoint_whose_parameters_are_in_another_order_is_refused_on_resume():
    """Its optimizer state, saved by position, would land on the wrong parameters: one line, not a silent resume."""
    from collections import OrderedDict
    from plumbing.run import restore
    model = tiny(n_prelude=1)
    state = model.state_dict()
    shuffled = OrderedDict(reversed(list(state.items())))
    with pytest.raises(ValueError, match='another order'):
        restore({'model': shuffled, 'meta': {}}, model, None, None, torch.Generator(), 'cpu')


def test_the_jacobian_penalty_keeps_the_norm_penalty():
    """Under the Jacobian penalty DesignedGPT runs its own forward (designed_forward): its loss is still looped.py's
    training loss (the cross-entropies plus the norm penalty) plus w times the squared estimate."""
    model = tiny(norm_penalty=0.5, jacobian_penalty=0.1)
    x, y = tokens()
    _, loss, stats = model(x, y)
    states = [h for _, h in model.loops(model.embed(x), model.config.n_loop)]
    expected = model.training_loss(list(stats['ce']), states) + 0.1 * stats['jacobian'] ** 2
    assert model.penalty_loss(states) > 0.01
    assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-6)


# ---- the designs exact at init, from their entries (lab/designs.py's DESIGNS: exact)

@pytest.mark.parametrize('design', [name for name, d in DESIGNS.items() if d.exact])
def test_a_design_exact_at_init_computes_the_defaults_logits_and_loss_bit_for_bit(design):
    """With the default's weights (its own parameters at their start), at every depth 1..2K: torch.equal, not
    allclose, so the design's arithmetic must be exact (h + 1 * (u - h) is not u in floating point)."""
    values, defaults = flag_values(DESIGNS[design].flags), flag_values([])
    plain, designed = tiny(), tiny(**{k: v for k, v in values.items() if v != defaults[k]})
    designed.load_state_dict(plain.state_dict(), strict=False)
    x, y = tokens()
    plain.eval(), designed.eval()
    with torch.no_grad():
        for n_loop in range(1, 2 * BASE['n_loop'] + 1):
            (a, la, _), (b, lb, _) = plain(x, y, n_loop=n_loop), designed(x, y, n_loop=n_loop)
            assert torch.equal(a, b) and torch.equal(la, lb), (design, n_loop)
