"""
The system a run trains on, for train.py: the device and dtype, the processes torchrun starts,
what torch.compile compiles, the signals that save a run (Ctrl-C, SIGTERM), and the progress
line's speed and ETA. train.py's loop calls these where it needs them.
"""

import os
import signal
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist


def resolve_device(device, dtype, compile):
    """(device, dtype, compile, autocast context). auto: CUDA, else MPS, else CPU; bf16 on a GPU
    that has it, else float16 (with a GradScaler), float32 on a CPU; compile on CUDA only."""
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else \
            'mps' if torch.backends.mps.is_available() else 'cpu'
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}: use auto, cpu, cuda, cuda:N or mps") from None
    if kind not in ('cpu', 'cuda', 'mps'):
        raise ValueError(f"device {device!r}: only cpu, cuda and mps are supported")
    if kind == 'cuda' and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA GPU here")
    if kind == 'mps' and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: MPS (Apple GPU) is not available here")
    if dtype == 'auto':  # emulated bf16 (a T4's) would be slow: float16 there
        dtype = 'float32' if kind != 'cuda' else 'bfloat16' if \
            torch.cuda.is_bf16_supported(including_emulation=False) else 'float16'
    if dtype == 'float16' and kind != 'cuda':
        raise ValueError(f"--dtype=float16 needs CUDA (its GradScaler is for GPUs); on {kind} use "
                         "float32 or bfloat16")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # CUDA's fp32
    half = {'bfloat16': torch.bfloat16, 'float16': torch.float16}.get(dtype)
    ctx = torch.autocast(kind, dtype=half) if half else nullcontext()  # weights stay fp32
    return device, dtype, kind == 'cuda' if compile == 'auto' else compile, ctx


def start_processes(device):
    """Under torchrun (RANK set), join the process group: NCCL with one GPU a process, or gloo on
    CPUs. (device, rank, world size); (device, 0, 1) for a single process."""
    if 'RANK' not in os.environ:
        return device, 0, 1
    dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
    if device.startswith('cuda'):
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    return device, dist.get_rank(), dist.get_world_size()


def end_processes(ok):
    """Leave the process group, if any: after the others when all went well (ok)."""
    if dist.is_initialized():
        if ok:
            dist.barrier()
        dist.destroy_process_group()
        time.sleep(0.05)  # gloo's threads need the GIL a moment to let go of their tensors


def compile_regions(model):
    """Regional torch.compile: each layer of the stack (one graph serves every loop) and the head's
    loss (float32 logits are never written); the loop stays Python, so any K reuses them."""
    for block in model.blocks:
        block.compile()
    model.head_loss = torch.compile(model.head_loss)  # an attribute shadows the method


class Interrupts:
    """Ctrl-C and SIGTERM set a flag that the loop reads once a step: it saves and exits 130
    there. A second Ctrl-C aborts a single process at once (torchrun repeats the first)."""
    def __init__(self, world, say):
        self.world, self.say, self.received = world, say, []

    def __enter__(self):
        self.old = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.old.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        if self.received and signum == signal.SIGINT and self.world == 1:
            raise KeyboardInterrupt
        if not self.received:
            again = ' (Ctrl-C again to abort)' if signum == signal.SIGINT and self.world == 1 \
                else ''
            self.say(f"\n{signal.Signals(signum).name}: saving a checkpoint after this step{again}",
                     flush=True)
        self.received.append(signum)


def fmt_time(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


PEAK_TFLOPS = {'H100': 989, 'H200': 989, 'A100': 312}  # dense bf16; elsewhere MFU reads n/a


def peak_flops(device):
    name = torch.cuda.get_device_name(device) if device.startswith('cuda') else ''
    return next((t * 1e12 for gpu, t in PEAK_TFLOPS.items() if gpu in name), None)


class Progress:
    """The progress line: the means of the loss and ce_K since the last line, ms/step and tok/s of
    the training steps alone (evaluations and saves are left out), MFU, and the ETA."""
    def __init__(self, step, tokens, flops, peak):  # tokens: per optimizer step, every process
        self.step_start = self.last_line = step
        self.tokens, self.flops, self.peak = tokens, flops, peak
        self.t_start = self.t_last = time.time()
        self.losses, self.ces, self.skips = [], [], 0

    def line(self, step, max_iters, h_norm, drawn=None):  # drawn: a loop count a lab design drew
        d, now = 'K' if drawn is None else 'r', time.time()
        dt = (now - self.t_last) / (step - self.last_line)
        eta = (now - self.t_start) / (step - self.step_start) * (max_iters - step)
        mean = lambda xs: f"{torch.stack(xs).mean().item():.4f}" if xs else 'skipped'
        mfu = 'n/a' if not self.peak else f"{100 * self.tokens / dt * self.flops / self.peak:.1f}%"
        line = (f"step {step}/{max_iters} | loss {mean(self.losses)} | "
                + (f"r {drawn} | " if drawn is not None else '') + f"ce_{d} {mean(self.ces)} | "
                f"||h_{d}|| {h_norm:.1f} | {dt * 1000:.0f} ms/step | {self.tokens / dt:,.0f} tok/s"
                f" | MFU {mfu} | ETA {fmt_time(eta)}"
                + (f" | float16 steps skipped {self.skips}" if self.skips else ''))
        self.t_last, self.last_line, self.losses, self.ces = now, step, [], []
        return line


def agree(world, lossf, cef, stop):
    """Under torchrun every process must see the same loss and stop at the same step, or they
    hang: one all-reduce a step (the loss, the last exit's cross-entropy, the stop flag)."""
    if world == 1:
        return lossf, cef, stop
    flag = torch.tensor(float(stop), device=lossf.device)
    shared = torch.stack([lossf.float(), cef.float(), flag])
    dist.all_reduce(shared)
    return shared[0] / world, shared[1] / world, shared[2].item() > 0


def check_replicas(model, world, device, say):
    """DDP's point: every process ends with rank 0's weights, compared tensor by tensor."""
    differ = 0
    for p in model.parameters():
        theirs = p.detach().clone()
        dist.broadcast(theirs, src=0)
        differ += int(not torch.equal(theirs, p.detach()))
    differ = torch.tensor([differ], device=device)  # NCCL reduces GPU tensors only
    dist.all_reduce(differ)
    say(f"weights identical on all {world} processes: {differ.item() == 0} "
        f"({len(list(model.parameters()))} tensors compared with rank 0's)")
