"""
Where the lab's tools run: the device, dtype and compile choice (resolve_device), regional compilation with the
designs' layers (compile_regions), and the timing helpers (synchronize, MFU). train.py resolves its own device
and starts its own processes.
"""

from dataclasses import dataclass

import torch

from plumbing import run as system


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


def synchronize(device_type):
    """Wait for the device's queued work (a no-op on a CPU), so that a timer measures the work itself."""
    {'cuda': torch.cuda.synchronize, 'mps': torch.mps.synchronize}.get(device_type, lambda: None)()


def resolve_device(device='auto', dtype='auto', compile='auto'):
    """train.py's choice of device, dtype and compile (plumbing/run.py's resolve_device: 'auto' is CUDA, else MPS, else
    CPU; bf16 on a GPU that has it, else float16; compile on CUDA only), as a Runtime. ValueError in one line for a
    device this machine does not have, or float16 off CUDA."""
    device, dtype, compile, ctx = system.resolve_device(device, dtype, compile)
    return Runtime(device, torch.device(device).type, dtype, bool(compile), ctx)


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
