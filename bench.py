"""
Time training steps on synthetic data: tokens/s, MFU, peak memory, compile time. Nothing is written.

    python bench.py                                                   # the laptop model on this machine
    python bench.py --config=gpu_char --supervision=terminal          # on a GPU: compare with per_loop
    python bench.py --vocab_size=50257 --n_embd=64 --n_layer=1 --batch_size=4 --block_size=64

Takes train.py's flags (--config, the model and variant flags, --device, --dtype, --compile, ...: see
python train.py --help) plus its own --vocab_size, --steps and --warmup. Peak memory is the CUDA allocator's
peak on a GPU, the MPS driver's allocation on Apple silicon, and on a CPU how far the process's peak resident
memory rose above its resident memory before the first step (run one configuration per process to compare them).
"""

import argparse
import resource
import sys
import time

import torch

import train  # bench.py times train.py's training step, so it takes train.py's flags and model config
from looped import LoopedGPT, resolve_device


def peak_rss_mib():
    """The process's peak resident memory so far (ru_maxrss is in KiB on Linux, in bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == 'darwin' else peak / 2**10


def rss_mib():
    """Resident memory now, where /proc tells it (Linux); elsewhere the peak so far, the best portable stand-in."""
    try:
        with open('/proc/self/statm') as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return peak_rss_mib()


def parse(argv=None):
    """bench.py's own flags, then train.py's flags from the rest; --help describes both."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument('--vocab_size', type=int, default=65, help='synthetic vocabulary (65: the char-level one)')
    own.add_argument('--steps', type=int, default=10, help='timed steps')
    own.add_argument('--warmup', type=int, default=3, help='untimed steps first (compilation happens here)')
    mine, rest = own.parse_known_args(argv)
    if '-h' in rest or '--help' in rest:
        print(__doc__.strip() + '\n\nbench.py flags:')
        for action in own._actions:
            print(f"  {'/'.join(action.option_strings):<14} {action.help} (default: {action.default})")
        print('\nthe rest are train.py flags (python train.py --help)')
        sys.exit(0)
    return mine, train.parse_args(rest)


def main(argv=None):
    mine, args = parse(argv)
    if mine.vocab_size < 1 or mine.steps < 1 or mine.warmup < 0:
        sys.exit("bench.py: error: need --vocab_size >= 1, --steps >= 1 and --warmup >= 0")
    try:
        rt = resolve_device(args.device, args.dtype, args.compile)
        config = train.model_config(args, mine.vocab_size)
    except ValueError as e:
        sys.exit(f"bench.py: error: {e}")
    print(rt.describe())
    device = rt.device
    torch.manual_seed(args.seed)
    model = LoopedGPT(config).to(device)
    optimizer = model.configure_optimizers(args.weight_decay, args.learning_rate, rt.device_type)
    if rt.compile:  # regional, as in train.py
        for block in model.blocks:
            block.compile()
    B, T = args.batch_size, config.block_size
    x = torch.randint(mine.vocab_size, (B, T), device=device)
    y = torch.randint(mine.vocab_size, (B, T), device=device)

    def step():
        with rt.autocast:
            _, loss, _ = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # a sync, as in train.py

    sync = {'cuda': torch.cuda.synchronize, 'mps': torch.mps.synchronize}.get(rt.device_type, lambda: None)
    base = rss_mib()  # what the model, optimizer and batch hold before the first step
    t0 = time.time()
    for _ in range(mine.warmup):
        step()
    sync()
    warm_s = time.time() - t0
    if rt.device_type == 'cuda':
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    for _ in range(mine.steps):
        step()
    sync()
    dt = (time.time() - t0) / mine.steps
    if rt.device_type == 'cuda':
        peak, what = torch.cuda.max_memory_allocated() / 2**20, 'CUDA allocated'
    elif rt.device_type == 'mps':
        peak, what = torch.mps.driver_allocated_memory() / 2**20, 'MPS driver allocated'
    else:
        peak, what = peak_rss_mib() - base, 'CPU peak RSS above baseline'
    tok_s = B * T / dt
    print(f"{config.supervision} {config.readout} K={config.n_loop} d={config.n_embd} L={config.n_layer} "
          f"V={mine.vocab_size} B={B} T={T}: {model.num_params():,} params | {dt * 1000:.1f} ms/step | "
          f"{tok_s:,.0f} tok/s | MFU {train.fmt_mfu(tok_s, model.flops_per_token(), train.peak_flops(device))} | "
          f"peak memory {peak:,.0f} MiB ({what}) | warm-up {warm_s:.1f} s ({mine.warmup} steps"
          f"{', compile included' if rt.compile else ''})")


if __name__ == '__main__':
    main()
