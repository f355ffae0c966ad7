"""
Where a script runs: the device, dtype and compile choice (resolve_device, the one place that decides them), the
timing helpers (synchronize, MFU), and the process group of a torchrun launch (setup_distributed and the rest).
Every script calls resolve_device; only train.py starts processes.
"""

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Runtime:
    device: str          # 'cpu', 'cuda', 'cuda:1', 'mps'
    device_type: str     # 'cpu', 'cuda' or 'mps': what torch.autocast and the optimizer want
    dtype: str           # 'float32', 'bfloat16' or 'float16' (the autocast dtype; weights stay fp32)
    compile: bool        # regional torch.compile (compile_regions)
    autocast: object     # a context manager: bf16 or float16 autocast, or nothing

    def describe(self):
        return f"device: {self.device} | dtype: {self.dtype} | compile: {self.compile}"

    def compile_regions(self, model):
        """compile_regions (below): each layer and the head's loss, not the loop. Returns the model."""
        return compile_regions(model)

    def check_replicas(self, raw_model, world, say):
        """check_replicas (below): under torchrun, every process ends with rank 0's weights."""
        check_replicas(raw_model, world, say)

    def end_distributed(self, ok):
        """end_distributed (below): leave torchrun's process group, if any."""
        end_distributed(ok)

    def agree(self, world, loss, ce, stop):
        """Under torchrun every process must see the same loss and stop at the same step, or they hang: one
        all-reduce a step (of the loss, the last exit's cross-entropy and the stop flag), which a single process
        goes without. Returns (loss, ce, stop), the losses averaged over the processes."""
        if world == 1:
            return loss, ce, stop
        shared = torch.stack([loss.float(), ce.float(), torch.tensor(float(stop), device=loss.device)])
        dist.all_reduce(shared)
        return shared[0] / world, shared[1] / world, shared[2].item() > 0


# Dense (no sparsity) peak TFLOP/s for MFU, from NVIDIA's datasheets: (a part of the name torch gives the
# device, bf16, float16, float32). float32 is the TF32 tensor-core peak where the GPU has one, since
# resolve_device lets float32 matmuls run as TF32 (T4 and V100 have none: their plain FP32 peak); None where
# the GPU has no bf16. The GeForce cards' tensor peaks are with FP32 accumulation, which torch uses. The A10G
# (AWS's A10) has no datasheet of its own: 70 is the figure in use, and a large bf16 matmul reaches 69.5 on it.
# The first match wins, so a variant comes before its family ('H100 PCIe' before 'H100', 'A100' before
# 'A10'); any other device prints n/a rather than a guess.
PEAK_TFLOPS = [
    ('H100 PCIe', 756, 756, 378), ('H100 NVL', 835, 835, 418), ('H100', 989, 989, 495),  # H100: SXM
    ('H200', 989, 989, 495), ('A100', 312, 312, 156), ('A10G', 70, 70, 35), ('A10', 125, 125, 62.5),
    ('L40S', 362, 362, 183), ('L40', 181, 181, 90.5), ('L4', 121, 121, 60),
    ('T4', None, 65, 8.1), ('V100-PCIE', None, 112, 14), ('V100', None, 125, 15.7),  # V100: SXM2
    ('RTX 4090', 165, 165, 82.6), ('RTX 3090', 71, 71, 35.6),
]
DTYPES = ('bfloat16', 'float16', 'float32')  # PEAK_TFLOPS' columns


def peak_flops(device, dtype='bfloat16'):
    """The device's dense peak FLOP/s in the dtype that its matmuls run in, or None (n/a)."""
    if not str(device).startswith('cuda'):
        return None
    name = torch.cuda.get_device_name(device).lower()
    peaks = next((p for p in PEAK_TFLOPS if p[0].lower() in name), None)
    tflops = peaks and peaks[1 + DTYPES.index(dtype)]
    return tflops * 1e12 if tflops else None


def fmt_mfu(tokens_per_s, flops_per_token, peak):
    """Model FLOPs utilization: the share of the device's peak that the model's own FLOPs use."""
    return 'n/a' if peak is None else f"{100 * tokens_per_s * flops_per_token / peak:.1f}%"


def grad_scaler(rt):
    """float16's loss scaling, which keeps small gradients from flushing to zero and skips a step whose
    gradients overflowed; under any other dtype a pass-through (its scale, step and update do nothing more)."""
    return torch.amp.GradScaler(rt.device_type, enabled=rt.dtype == 'float16')


def synchronize(device_type):
    """Wait for the device's queued work (a no-op on a CPU), so that a timer measures the work itself."""
    {'cuda': torch.cuda.synchronize, 'mps': torch.mps.synchronize}.get(device_type, lambda: None)()


def resolve_device(device='auto', dtype='auto', compile='auto'):
    """The one place where device, dtype and compile are decided (every script calls it). 'auto' means: CUDA,
    else MPS, else CPU; bf16 autocast on a CUDA GPU that has bf16, float16 autocast (with train.py's GradScaler)
    on one that does not, as nanoGPT chooses, float32 elsewhere; compile on CUDA only (on a CPU it costs about
    30 s and gains nothing at this size). ValueError with a one-line message for a device this machine does not
    have, or for float16 off CUDA."""
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else 'cpu'
    try:
        device_type = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}: use auto, cpu, cuda, cuda:N or mps") from None
    if device_type == 'cuda' and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA GPU here")
    if device_type == 'mps' and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: MPS (Apple GPU) is not available here")
    if device_type not in ('cpu', 'cuda', 'mps'):
        raise ValueError(f"device {device!r}: only cpu, cuda and mps are supported")
    if dtype == 'auto' and device_type == 'cuda':  # emulated bf16 (a T4's) would be slow: float16 there
        dtype = 'bfloat16' if torch.cuda.is_bf16_supported(including_emulation=False) else 'float16'
    elif dtype == 'auto':
        dtype = 'float32'
    if dtype == 'float16' and device_type != 'cuda':
        raise ValueError(f"--dtype=float16 needs CUDA (its GradScaler is for GPUs); on {device_type} use "
                         "float32 or bfloat16")
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 for any fp32 matmul that autocast leaves alone
        torch.backends.cudnn.allow_tf32 = True
    # autocast: weights and the residual stream stay fp32, matmuls run in bf16 or float16
    half = {'bfloat16': torch.bfloat16, 'float16': torch.float16}.get(dtype)
    ctx = torch.autocast(device_type, dtype=half) if half else nullcontext()
    return Runtime(device, device_type, dtype, device_type == 'cuda' if compile == 'auto' else bool(compile), ctx)


def compile_regions(model):
    """Regional torch.compile, the one place that says what is compiled: each block of the shared stack (one graph
    serves every block and every loop count, since the loop itself stays Python), the prelude and coda, and the
    head's loss (so that float32 logits are never written). Checkpoints keep the plain weights: nothing is renamed.
    Returns the model."""
    # torch.compile has no double backward, which the Jacobian penalty's estimate needs; the prelude and coda
    # are lab/designs.py's (looped.py's LoopedGPT has neither)
    jacobian = getattr(model.config, 'jacobian_penalty', 0) > 0
    around = [*getattr(model, 'prelude', []), *getattr(model, 'coda', [])]
    for block in [] if jacobian else [*model.blocks, *around]:
        block.compile()
    # an attribute of the method's own name: every caller (loop_loss, and so forward) gets the compiled
    # one, and `del model.head_loss` brings back the plain method
    model.head_loss = torch.compile(model.head_loss)
    return model


# ---- several processes (torchrun): the process group, and the check that it did its job

def setup_distributed(rt):
    """Under torchrun (RANK is set): join the process group, NCCL with one GPU per process or gloo on CPUs.
    Returns (rank, world size); (0, 1) for a plain run."""
    if 'RANK' not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group(backend='nccl' if rt.device_type == 'cuda' else 'gloo')
    if rt.device_type == 'cuda':
        rt.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(rt.device)
    return dist.get_rank(), dist.get_world_size()


def end_distributed(ok):
    """Leave the process group, if any: after a barrier when the run ended well, so that no process tears the
    group down while another still uses it."""
    if not dist.is_initialized():
        return
    if ok:
        dist.barrier()
    dist.destroy_process_group()
    # gloo's threads let go of the last collectives' tensors a moment after they complete, and need the GIL for
    # it; a process that exits first aborts in Python's shutdown (SIGABRT in 3 of 39 two-process runs on CPU,
    # torch 2.13; none in 100 with this sleep, which hands them the GIL)
    time.sleep(0.05)


def check_replicas(raw_model, world, say):
    """The point of DDP: every process ends with the same weights; compared here tensor by tensor with rank 0's."""
    if world == 1:
        return
    differ = 0
    for p in raw_model.parameters():
        theirs = p.detach().clone()
        dist.broadcast(theirs, src=0)
        differ += int(not torch.equal(theirs, p.detach()))
    differ = torch.tensor([differ], device=next(raw_model.parameters()).device)  # NCCL reduces GPU tensors only
    dist.all_reduce(differ)
    say(f"weights identical on all {world} processes: {differ.item() == 0} "
        f"({len(list(raw_model.parameters()))} tensors compared with rank 0's)")
