"""The GPU code path, exercised as far as a CPU can: bf16 autocast, torch.compile of the blocks, per-loop readouts
checkpointed inside autocast and compile, resume and generation with a compiled model, fused AdamW. (CUDA itself,
TF32 and pinned memory are measured by python -m lab.bench --suite on a GPU.)"""

import copy
import math
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from lab.runs import load_model
from lab.runtime import compile_regions
from lab.engine import generate
from lab.designs import DesignConfig, DesignedGPT
from test_train import read_log, run_train

# bf16 keeps about 3 significant digits; after 8 steps the compiled bf16 run stays within 1% of fp32 eager
BF16_RTOL = 0.01


def test_bf16_compiled_training_tracks_fp32_eager_and_resumes(small_data, tmp_path):
    common = ['--device=cpu', '--max_iters=6', '--eval_interval=3', '--supervision=per_loop']
    run_train(small_data, tmp_path / 'fp32', *common, '--dtype=float32', '--compile=False')
    run_train(small_data, tmp_path / 'bf16', *common, '--dtype=bfloat16', '--compile=True')
    fp32, bf16 = read_log(tmp_path / 'fp32'), read_log(tmp_path / 'bf16')
    assert bf16[0]['config']['dtype'] == 'bfloat16' and bf16[0]['config']['compile'] is True
    for a, b in zip(fp32[1:], bf16[1:]):
        for la, lb in zip(a['val_loss'], b['val_loss']):  # every depth, 1..2K
            assert abs(la - lb) <= BF16_RTOL * la, (a['step'], la, lb)
    assert fp32[-1]['val_loss'][1] < fp32[1]['val_loss'][1] - 1  # both runs really trained
    # resume the compiled bf16 run: the checkpoint holds the plain module's weights
    run_train(small_data, tmp_path / 'bf16', *common[:1], '--max_iters=8', '--eval_interval=2', '--dtype=bfloat16',
              '--compile=True', '--resume')
    ckpt = torch.load(tmp_path / 'bf16' / 'ckpt.pt', weights_only=True)
    assert ckpt['step'] == 8 and not any('_orig_mod' in k for k in ckpt['model'])
    # generation with compiled blocks gives the eager model's tokens (greedy, so no sampling noise)
    model, _ = load_model(str(tmp_path / 'bf16'))
    start = torch.zeros(1, 3, dtype=torch.long)
    eager, _ = generate(model, start, 6, top_k=1, n_loop=4)
    compile_regions(model)
    compiled, loops = generate(model, start, 6, top_k=1, n_loop=4)
    assert torch.equal(eager, compiled) and loops.tolist() == [[4] * 6]


def test_compiled_head_loss_never_writes_float32_logits():
    """lab.runtime.compile_regions fuses the head's float32 cross-entropy: under bf16 autocast every (tokens x V) buffer
    that the compiled forward and backward allocate is bf16, where eager writes float32 copies; loss and gradients match
    the eager model's. (Read from the code Inductor generates, so a torch that stops fusing fails here.)"""
    V, N = 1009, 2 * 16  # V prime and N tokens != n_embd, so only a logits-sized buffer has N * V elements
    cfg = DesignConfig(vocab_size=V, block_size=16, n_embd=24, n_head=2, n_layer=1, n_loop=2, dropout=0.0)
    torch.manual_seed(0)
    eager = DesignedGPT(cfg)
    compiled = compile_regions(copy.deepcopy(eager))
    x = torch.randint(V, (2, 16))

    def step(model):
        with torch.autocast('cpu', dtype=torch.bfloat16):
            loss = model(x, x)[1]
        loss.backward()
        return loss.item()

    loss_e = step(eager)
    loss_c, codes = run_and_get_code(step, compiled)
    assert abs(loss_c - loss_e) <= BF16_RTOL * loss_e
    grads = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (eager, compiled)]
    assert (grads[1] - grads[0]).norm() <= BF16_RTOL * grads[0].norm()  # bf16 rounds each element differently
    buffers = re.findall(r'empty_strided_cpu\(\(([\d, ]+)\), \([\d, ]+\), torch\.(\w+)\)', '\n'.join(codes))
    logits_sized = [dtype for shape, dtype in buffers
                    if math.prod(int(d) for d in shape.split(',') if d.strip()) == N * V]
    assert len(logits_sized) >= 2, buffers          # the forward's logits and the backward's gradient at least
    assert set(logits_sized) == {'bfloat16'}, logits_sized


def test_fused_adamw_on_cpu_matches_the_default(monkeypatch):
    """configure_optimizers asks for the fused AdamW where the device is CUDA. torch also has that kernel on a CPU,
    so the CUDA branch runs here: the fused kernel must really run (counted) and give the default's steps."""
    cfg = DesignConfig(vocab_size=11, block_size=8, n_embd=16, n_head=2, n_layer=1, n_loop=2)
    x = torch.randint(11, (4, 8))
    calls, real = [], torch._fused_adamw_
    monkeypatch.setattr(torch, '_fused_adamw_', lambda *a, **k: calls.append(1) or real(*a, **k))
    weights = []
    for device_type in ('cpu', 'cuda'):  # 'cuda': the flag the GPU path gets; the tensors stay on the CPU
        torch.manual_seed(0)
        model = DesignedGPT(cfg)
        opt = model.configure_optimizers(0.01, 1e-2, device_type)
        assert opt.param_groups[0]['fused'] == (device_type == 'cuda')
        for _ in range(3):
            model(x, x)[1].backward()
            opt.step()
            opt.zero_grad()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert len(calls) == 3, calls  # one fused call per step, and none for the default optimizer
    assert torch.allclose(weights[0], weights[1], atol=1e-6)


def test_compiled_regions_train_with_the_jacobian_penalty_as_eager_does():
    """The Jacobian penalty's estimate takes a double backward through one pass, which a compiled block cannot
    give: compile_regions leaves the blocks eager then, and a step's loss and gradients are the eager model's."""
    cfg = DesignConfig(vocab_size=11, block_size=8, n_embd=16, n_head=2, n_layer=1, n_loop=2, jacobian_penalty=0.1)
    torch.manual_seed(0)
    eager = DesignedGPT(cfg)
    compiled = compile_regions(copy.deepcopy(eager))
    x = torch.randint(11, (2, 8), generator=torch.Generator().manual_seed(1))
    grads = []
    for model in (eager, compiled):
        torch.manual_seed(2)  # the estimate's random direction
        loss, stats = model(x, x)[1:]
        loss.backward()
        grads.append((loss.item(), stats['jacobian'].item(), [p.grad.clone() for p in model.parameters()]))
    assert grads[0][:2] == pytest.approx(grads[1][:2], rel=1e-4)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads[0][2], grads[1][2]))
