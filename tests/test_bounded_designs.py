"""The 2026 designs that bound the recurrence (looped.py): Parcae's diagonal injection, the authors'
damped recurrence, DeepLoop's deepnorm block, STARS's Jacobian penalty. What each computes at init,
by hand; its bound; its gradient reaching its own parameters; its value in the log and the eval line."""

from dataclasses import asdict
import json
import math

import pytest
import torch

from lab import train  # train.py with the designs: python -m lab.train
from lab.runs import load_model
from lab.designs import CHOICES, DESIGNS, DesignBlock, DesignConfig
from lab.report import design_line
from test_designs import BASE, record_passes, tiny, tokens

# ---- Parcae's diagonal injection


@pytest.mark.parametrize('init', ['paper', 'gpt2'])
def test_the_diagonal_injection_at_init_is_0447_h_plus_0805_e_per_channel(init):
    model = tiny(injection='diagonal', init=init)
    h, e = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    with torch.no_grad():
        got = model.inject(h, e)
    # decay exp(-Delta) = sqrt(1/5) = 0.4472, Delta = ln(sqrt(5)) = 0.8047, B the identity
    assert torch.allclose(got, 0.44721 * h + 0.80472 * e, atol=1e-4)
    assert torch.equal(model.diagonal.B.weight, torch.eye(16))


def test_the_diagonal_decay_stays_in_0_1_whatever_its_parameters():
    model = tiny(injection='diagonal')
    with torch.no_grad():
        model.diagonal.A_log.copy_(torch.linspace(-4, 2, 16))  # Delta * A from 3e-4 to 22
        model.diagonal.dt_bias.copy_(torch.linspace(-4, 3, 16))
        delta, decay = model.diagonal.coefficients()
    assert bool((delta > 0).all()) and bool((decay > 0).all()) and bool((decay < 1).all())


def test_the_diagonal_injection_runs_at_every_pass_on_the_carried_state():
    model = tiny(injection='diagonal').eval()
    x, _ = tokens()
    inputs = record_passes(model)
    with torch.no_grad():
        e = model.embed(x)
        states = [h for _, h in model.loops(e, 3)]
        delta, decay = model.diagonal.coefficients()
    assert torch.allclose(inputs[0], decay * e + delta * e, atol=1e-6)  # pass 1: h_0 = e
    for k in (1, 2):
        assert torch.allclose(inputs[k], decay * states[k - 1] + delta * e, atol=1e-6), k


def test_the_diagonal_injections_gradient_reaches_its_three_parameters():
    model = tiny(injection='diagonal')
    x, y = tokens()
    model(x, y)[1].backward()
    for name in ('A_log', 'dt_bias', 'B.weight'):
        grad = model.diagonal.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name


@pytest.mark.parametrize('init', ['paper', 'gpt2'])
def test_the_diagonal_injections_parameters_take_no_weight_decay(init):
    model = tiny(injection='diagonal', init=init)
    groups = model.configure_optimizers(0.1, 1e-3, 'cpu').param_groups
    decay_of = {id(p): g['weight_decay'] for g in groups for p in g['params']}
    assert len(decay_of) == len(list(model.parameters()))  # every parameter in one group
    for p in model.diagonal.parameters():
        assert decay_of[id(p)] == 0.0
    assert decay_of[id(model.blocks[0].attn.c_attn.weight)] == 0.1  # the rest as the init says
    assert decay_of[id(model.blocks[0].norm_1.weight)] == (0.1 if init == 'paper' else 0.0)


def test_without_a_design_the_paper_init_keeps_one_optimizer_group():
    """Checkpoints of earlier runs hold one group; resuming them needs the same layout."""
    assert len(tiny().configure_optimizers(0.1, 1e-3, 'cpu').param_groups) == 1
    assert len(tiny(init='gpt2').configure_optimizers(0.1, 1e-3, 'cpu').param_groups) == 2


# ---- the damped recurrence

def test_a_damped_pass_2_starts_from_sigmoid_2_times_h_1_and_h_1_is_read_out_undamped():
    model = tiny(recurrence='damped').eval()
    x, _ = tokens()
    inputs = record_passes(model)
    with torch.no_grad():
        e = model.embed(x)
        states = [h for _, h in model.loops(e, 3)]
        first = model.blocks[0](e)  # pass 1 from e, with nothing damped
    assert torch.allclose(states[0], first, atol=1e-6)  # the yielded (read out) h_1
    assert torch.allclose(inputs[1], torch.sigmoid(torch.tensor(2.0)) * states[0], atol=1e-6)
    assert abs(torch.sigmoid(model.damping).item() - 0.8808) < 1e-4


def test_the_dampings_gradient_reaches_its_parameter():
    model = tiny(recurrence='damped')
    x, y = tokens()
    model(x, y)[1].backward()
    assert model.damping.grad is not None and model.damping.grad.abs() > 0


# ---- DeepLoop's deepnorm block

@pytest.mark.parametrize('scale', [1e-3, 1.0, 1e3])
def test_a_deepnorm_block_hands_on_the_rms_of_its_gain_whatever_the_input_scale(scale):
    torch.manual_seed(0)
    block = DesignBlock(DesignConfig(**BASE, block='deepnorm'))
    with torch.no_grad():
        block.norm_2.weight.fill_(2.5)
        out = block(scale * torch.randn(2, 8, 16))
    assert torch.allclose(out.pow(2).mean(-1).sqrt(), torch.full((2, 8), 2.5), rtol=1e-3)


def test_a_deepnorm_block_is_post_ln_with_alpha_sqrt_2n_by_hand():
    torch.manual_seed(0)
    block = DesignBlock(DesignConfig(**BASE, block='deepnorm'))  # N = 1 layer x 3 loops
    alpha = math.sqrt(2 * 3)
    with torch.no_grad():
        block.norm_1.weight.copy_(torch.linspace(0.5, 2.0, 16))
        x = 3.0 * torch.randn(2, 8, 16)
        u = lambda v: v / (v.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        x1 = block.norm_1.weight * u(alpha * x + block.attn(x))  # the sublayer sees x, not norm(x)
        want = block.norm_2.weight * u(alpha * x1 + block.mlp(x1))
        assert torch.allclose(block(x), want, atol=1e-5)


@pytest.mark.parametrize('init', ['paper', 'gpt2'])
def test_deepnorm_shrinks_the_value_output_and_mlp_weights_by_beta(init):
    plain, deep = tiny(init=init), tiny(init=init, block='deepnorm')
    beta = (8 * 3) ** -0.5
    p, q = plain.blocks[0], deep.blocks[0]
    d = BASE['n_embd']
    assert torch.equal(q.attn.c_attn.weight[:2 * d], p.attn.c_attn.weight[:2 * d])  # q, k: gain 1
    assert torch.allclose(q.attn.c_attn.weight[2 * d:], beta * p.attn.c_attn.weight[2 * d:])
    # the MLP: two of SwiGLU's three matrices, as DeepNorm scales its FFN's two (the silu branch keeps gain 1)
    assert torch.allclose(q.mlp.c_up.weight, beta * p.mlp.c_up.weight)
    assert torch.equal(q.mlp.c_fc.weight, p.mlp.c_fc.weight)
    # the output projections: beta instead of gpt2's 1 / sqrt(2N), on the same draw
    undo = math.sqrt(2 * 3) if init == 'gpt2' else 1.0
    for name in ('attn.c_proj', 'mlp.c_proj'):
        assert torch.allclose(q.get_submodule(name).weight, beta * undo * p.get_submodule(name).weight), name


# ---- STARS's Jacobian penalty

def test_the_jacobian_estimate_is_v_times_the_passs_full_jacobian():
    model = tiny(jacobian_penalty=0.1).eval()
    x, _ = tokens(B=1)
    h = torch.randn(1, 8, 16)
    e = model.embed(x).detach()
    torch.manual_seed(5)
    got = model.pass_jacobian(h, e)
    torch.manual_seed(5)
    v = torch.randn(1, 8, 16)
    v = v / v.norm()
    one_pass = lambda s: model.loop_pass(s, e, 1, 1)
    J = torch.autograd.functional.jacobian(one_pass, h)  # (1, 8, 16, 1, 8, 16): output by input
    want = (v.flatten() @ J.reshape(128, 128)).norm()
    assert torch.allclose(got, want, rtol=1e-4)


def test_the_jacobian_penalty_adds_w_times_the_squared_estimate_and_reaches_the_stack():
    x, y = tokens()
    plain, penalized = tiny(), tiny(jacobian_penalty=0.5)
    torch.manual_seed(3)
    _, base, stats0 = plain(x, y)
    torch.manual_seed(3)
    _, loss, stats = penalized(x, y)
    assert 'jacobian' not in stats0  # off: nothing computed
    jac = stats['jacobian']
    assert jac.item() > 0 and torch.allclose(loss - base, 0.5 * jac ** 2, atol=1e-5)
    (0.5 * jac ** 2).backward()  # the penalty alone
    grad = penalized.blocks[0].mlp.c_fc.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    assert penalized.wte.weight.grad is None  # h and e are detached: only the pass's weights


def test_the_jacobian_is_estimated_at_the_last_loops_state():
    """STARS penalizes the pass at h_K, where the loop ends: the estimate forward logs is pass_jacobian(h_K, e) with
    the same random direction, which differs from the estimate at h_1."""
    model, (x, y) = tiny(jacobian_penalty=0.5).eval(), tokens()
    torch.manual_seed(3)
    got = model(x, y)[2]['jacobian']
    e = model.embed(x)
    states = [h for _, h in model.loops(e, BASE['n_loop'])]
    at = []
    for h in (states[-1], states[0]):
        torch.manual_seed(3)
        at.append(model.pass_jacobian(h, e))
    assert torch.allclose(got, at[0], rtol=1e-5) and not torch.allclose(got, at[1], rtol=1e-5), (got, at)  # ~1% apart


def test_no_jacobian_is_estimated_without_gradients():
    model = tiny(jacobian_penalty=0.1)
    x, y = tokens()
    with torch.no_grad():
        assert 'jacobian' not in model(x, y)[2]


# ---- every value of every choice field survives a checkpoint

def choice_values():
    for name, values in CHOICES.items():
        for value in values[1:]:
            yield name, value


@pytest.mark.parametrize('field,value', list(choice_values()))
def test_every_value_of_every_choice_field_survives_a_save_and_a_load(tmp_path, field, value):
    """Each value's own parameters (a second injection's, a third block's) must reach the checkpoint
    and come back: the weights are moved off their init first, so a parameter that is rebuilt
    rather than loaded shows."""
    extra = {'alpha': 0.5} if (field, value) == ('readout', 'alpha') else {}
    model = tiny(**{field: value}, **extra)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    path = tmp_path / 'ckpt.pt'
    torch.save({'model': model.state_dict(), 'config': asdict(model.config), 'step': 0}, path)
    loaded, _ = load_model(str(path))
    theirs = dict(loaded.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, theirs[name]), f"{field}={value}: {name} did not survive"
    x, y = tokens()
    model.eval()
    with torch.no_grad():
        torch.manual_seed(0)
        a = model(x, y)[1]
        torch.manual_seed(0)
        b = loaded(x, y)[1]
    assert torch.equal(a, b), f"{field}={value}: the loaded model computes another loss"


# ---- their quantities in the log and the eval line

# every design that logs something (lab/designs.py's DESIGNS: logs), with what its eval line shows at init
LOGGING = [name for name, d in DESIGNS.items() if d.logs]
AT_INIT = {'decay': 'decay mean 0.447 min 0.447 max 0.447', 'damping': 'damping 0.881', 'jacobian': '||vJ|| '}


@pytest.mark.parametrize('design', LOGGING)
def test_each_designs_quantity_is_logged_and_shown_at_every_evaluation(small_data, tmp_path, capsys, design):
    out = tmp_path / 'run'
    train.main(['--dataset', small_data, '--out_dir', str(out), '--n_layer=1', '--n_embd=16',
                '--n_head=2', '--n_loop=2', '--block_size=16', '--batch_size=2', '--max_iters=2',
                '--eval_interval=1', '--eval_iters=1', '--log_interval=1', *DESIGNS[design].flags])
    evals = [line for line in capsys.readouterr().out.splitlines() if line.startswith('eval ')]
    with open(out / 'log.jsonl') as f:
        records = [json.loads(line) for line in f][1:]
    assert len(evals) == len(records) == 3
    for log in DESIGNS[design].logs:
        assert all(log.key in r for r in records), log.key
        for line, record in zip(evals, records):  # each value in its place, as its entry shows it
            shown = design_line({log.key: record[log.key]})
            assert shown and shown in line, (log.key, line)
        assert AT_INIT.get(log.key, '') in evals[0]  # step 0: the value at init
        if log.key == 'jacobian':
            assert all(math.isfinite(r[log.key]) and r[log.key] > 0 for r in records)


def test_a_deepnorm_run_trains_and_keeps_its_norm_at_sqrt_d(small_data, tmp_path, capsys):
    train.main(['--dataset', small_data, '--out_dir', str(tmp_path / 'run'), '--n_layer=1',
                '--n_embd=16', '--n_head=2', '--n_loop=2', '--block_size=16', '--batch_size=2',
                '--max_iters=2', '--eval_interval=2', '--eval_iters=1', '--block=deepnorm'])
    with open(tmp_path / 'run' / 'log.jsonl') as f:
        last = [json.loads(line) for line in f][-1]
    # every gain starts at 1 and barely moves in 2 steps: ||h_k|| = sqrt(16) = 4
    assert all(abs(n - 4.0) < 0.1 for n in last['hidden_norm']), last['hidden_norm']


def test_the_decays_mean_min_and_max_are_logged_and_shown_in_their_places():
    """At init every channel decays alike, so the eval line's test above cannot tell mean, min and max apart:
    here the channels differ and each number must land in its own place."""
    from contextlib import nullcontext
    from lab.report import design_line, design_values
    model = tiny(injection='diagonal')
    with torch.no_grad():
        model.diagonal.A_log.copy_(torch.linspace(-2.0, 2.0, 16))  # decay exp(-Delta e^A) spread over (0, 1)
    decay = model.diagonal.coefficients()[1]
    values = design_values(model, tokens(), nullcontext())
    assert values['decay'] == pytest.approx([decay.mean().item(), decay.min().item(), decay.max().item()])
    assert values['decay'][1] < values['decay'][0] < values['decay'][2]
    record = {'step': 0, 'val_loss': [1.0] * 6, 'hidden_norm': [1.0] * 6, **values}
    shown = ' '.join(f'{v:.3f}' for v in values['decay'])
    assert f"decay mean {shown.split()[0]} min {shown.split()[1]} max {shown.split()[2]}" in design_line(record)
