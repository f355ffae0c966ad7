"""
Time training steps on synthetic data: tokens/s, MFU, peak memory, compile time. Nothing is written.

    python -m lab.bench                                                   # the laptop model on this machine
    python -m lab.bench --config=gpu_char --supervision=terminal          # on a GPU: compare with per_loop
    python -m lab.bench --vocab_size=50257 --n_embd=64 --n_layer=1 --batch_size=4 --block_size=64
    python -m lab.bench --suite                                           # everything below in one table (+ JSON)
    python -m lab.bench --generate --ckpt=out/laptop --exit=kl --exit_threshold=0.01   # the KV cache, see below

Takes train.py's flags (--config, the model and variant flags, --device, --dtype, --compile, ...: see
python train.py --help) plus its own --vocab_size, --steps and --warmup. Peak memory is the CUDA allocator's
peak on a GPU, the MPS driver's allocation on Apple silicon, and on a CPU how far the process's peak resident
memory rose above its resident memory before the first step (run one configuration per process to compare them).

--suite measures, on CUDA at the paper_44m shape (8 x 512, K=4, T=256, batch 64, V=20k; under 8 minutes on one
H100/H200): tokens/s and MFU for per_loop and terminal supervision, eager and compiled, SDPA and manual
attention; peak memory per_loop / terminal at V = 20k and 50k, eager and compiled; recompiles during training
plus evaluation at 2K after a warm-up; compiled against eager loss over 20 steps; and a 300-step gpu_char pair
(rmsnorm, raw) on tiny Shakespeare with its final ||h_K||, the blind spot on a GPU. On a CPU it runs the same
suite at toy sizes in under a minute and marks the rows it did not measure. It prints a markdown table and
writes it as JSON (--json).

--generate times generation instead: LoopedGPT.generate with its KV cache per loop against recomputing the
whole window for every token, alternating (cached, recomputed, twice; the faster of each), greedy, for batches of
1 and 8 and 256 and 1,024 new tokens after a prompt of block_size // 2 random tokens, on the model of the flags
given (random weights) or of --ckpt. --recompute_cap=N stops each recomputing run after N tokens: its rate over
the window's shortest stretch, so the speed-up is then a lower bound. With --ckpt and --exit it also measures
what sharing costs: generation under the exit rule with the cache (the loops a token skipped take its last loop's
keys and values) and recomputing (they are recomputed), each scored by the full-depth model on its own text.

Not here: the training step it times (train.py's, called as bench.train_step does it), what the model learns
(train.py's evaluations), the early-exit speed of a trained model (lab/diagnose.py, plot_norms.py).
"""

from dataclasses import asdict
import argparse
import contextlib
import gc
import json
import math
import os
import resource
import sys
import tempfile
import time

import torch

from data.common import check_writable, write_atomically
import lab.train as lab_train  # train.py's flags with the designs', and the model they build
import train  # lab/bench.py times train.py's training step
from lab.report import fail, markdown
from lab.runs import condition_name, load_model
from lab.runtime import compile_regions, fmt_mfu, peak_flops, resolve_device, synchronize
from lab.engine import EXITS, KVCache, generate, next_logprobs
from lab.designs import DesignConfig, DesignedGPT

PROG = 'python -m lab.bench'


def reset_peak_rss():
    """Start the peak resident memory afresh (Linux: /proc/self/clear_refs), so that the peak read after the
    timed steps is theirs, not the import's: importing torch and building the model can briefly hold more than
    a step does, and a peak over the whole process then measures the import (the per-loop / terminal ratio came
    out 1.25x at random). Returns whether it could; elsewhere the peak stays the whole process's."""
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        return True
    except OSError:
        return False


def peak_rss_mib():
    """The process's peak resident memory since reset_peak_rss (Linux's VmHWM), or over the whole process
    (ru_maxrss, in KiB on Linux, in bytes on macOS)."""
    try:
        with open('/proc/self/status') as f:
            return next(int(line.split()[1]) for line in f if line.startswith('VmHWM:')) / 2**10
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == 'darwin' else peak / 2**10


def saved_for_backward_mib(model, rt, x, y):
    """What one training forward keeps for its backward: the bytes of every distinct storage autograd saves
    (activations, and the weights a matmul's backward needs). This is what "per-loop supervision keeps K copies
    of the logits" is about, measured exactly, where a CPU's resident memory also holds whatever the allocator
    kept from earlier and varies from run to run with its threads' arenas."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rt.autocast:
        model(x, y)
    return sum(storages.values()) / 2**20


def rss_mib():
    """Resident memory now, where /proc tells it (Linux); elsewhere the peak so far, the best portable stand-in."""
    try:
        with open('/proc/self/statm') as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return peak_rss_mib()


def train_step(model, optimizer, rt, x, y):
    """One training step as train.py takes it (forward under autocast, backward, AdamW); returns the loss tensor."""
    with rt.autocast:
        _, loss, _ = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def time_steps(model, optimizer, rt, x, y, steps, warmup):
    """Seconds per training step on the batch (x, y), after warmup untimed steps; on CUDA the peak-memory
    counter is reset after the warm-up. Returns (seconds per step, warm-up seconds)."""
    t0 = time.time()
    for _ in range(warmup):
        train_step(model, optimizer, rt, x, y)
    synchronize(rt.device_type)
    warm_s = time.time() - t0
    if rt.device_type == 'cuda':
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    for _ in range(steps):
        train_step(model, optimizer, rt, x, y)
    synchronize(rt.device_type)
    return (time.time() - t0) / steps, warm_s


def own_parser():
    """lab/bench.py's own flags (train.py's come on top of them, see parse)."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument('--vocab_size', type=int, default=65, help='synthetic vocabulary (65: the char-level one)')
    own.add_argument('--steps', type=int, default=10, help='timed steps')
    own.add_argument('--warmup', type=int, default=3, help='untimed steps first (compilation happens here)')
    own.add_argument('--suite', action='store_true', help='the whole benchmark suite (see above); other flags ignored')
    own.add_argument('--json', default='out/bench_suite.json', help='where --suite writes its table as JSON')
    own.add_argument('--generate', action='store_true', help='time generation: the KV cache against recomputing')
    own.add_argument('--ckpt', default=None, help='--generate: a run folder or ckpt.pt whose model generates')
    own.add_argument('--recompute_cap', type=int, default=0, help='--generate: tokens per recomputing run (0: all)')
    own.add_argument('--exit', default='none', choices=('none',) + EXITS, help='--generate --ckpt: an exit rule')
    own.add_argument('--exit_threshold', type=float, default=None, help='--generate --ckpt: its threshold')
    return own


def parse(argv=None):
    """lab/bench.py's own flags, then train.py's flags from the rest; --help describes both."""
    own = own_parser()
    mine, rest = own.parse_known_args(argv)
    if '-h' in rest or '--help' in rest:
        print(__doc__.strip() + f'\n\n{PROG} flags:')
        for action in own._actions:
            print(f"  {'/'.join(action.option_strings):<14} {action.help} (default: {action.default})")
        print('\nthe rest are train.py flags (python train.py --help)')
        sys.exit(0)
    try:
        return mine, lab_train.parse_args(rest)
    except SystemExit as e:  # train.py's parser names itself; the user typed python -m lab.bench
        code = str(e.code)
        lab = f'{lab_train.PROG}: error:'
        sys.exit(code.replace(lab, f'{PROG}: error:', 1) if code.startswith(lab) else e.code)


def main(argv=None):
    """Time one configuration (train.py's flags) on synthetic data, or run the whole suite."""
    mine, args = parse(argv)
    if mine.suite:
        try:
            check_writable(mine.json)  # before the suite's minutes of work, not after them
        except ValueError as e:
            fail(PROG, e)
        return suite(mine.json)
    if mine.generate:
        return generation(mine, args)
    if mine.vocab_size < 1 or mine.steps < 1 or mine.warmup < 0:
        fail(PROG, "need --vocab_size >= 1, --steps >= 1 and --warmup >= 0")
    try:
        rt = resolve_device(args.device, args.dtype, args.compile)
        GPT, config = lab_train.model_config(args, mine.vocab_size)  # what train.py would build
    except ValueError as e:
        fail(PROG, e)
    print(rt.describe())
    device = rt.device
    torch.manual_seed(args.seed)
    model = GPT(config).to(device)
    optimizer = model.configure_optimizers(args.weight_decay, args.learning_rate, rt.device_type)
    if rt.compile:
        compile_regions(model)
    B, T = args.batch_size, config.block_size
    x = torch.randint(mine.vocab_size, (B, T), device=device)
    y = torch.randint(mine.vocab_size, (B, T), device=device)
    base = rss_mib()  # what the model, optimizer and batch hold before the first step
    reset_peak_rss()
    dt, warm_s = time_steps(model, optimizer, rt, x, y, mine.steps, mine.warmup)
    if rt.device_type == 'cuda':
        peak, what = torch.cuda.max_memory_allocated() / 2**20, 'CUDA allocated'
    elif rt.device_type == 'mps':
        peak, what = torch.mps.driver_allocated_memory() / 2**20, 'MPS driver allocated'
    else:
        peak, what = peak_rss_mib() - base, 'CPU peak RSS above baseline'
    tok_s = B * T / dt
    saved = saved_for_backward_mib(model, rt, x, y)
    print(f"{condition_name(asdict(config))} K={config.n_loop} d={config.n_embd} L={config.n_layer} "
          f"V={mine.vocab_size} B={B} T={T}: {model.num_params():,} params | {dt * 1000:.1f} ms/step | "
          f"{tok_s:,.0f} tok/s | MFU {fmt_mfu(tok_s, model.flops_per_token(), peak_flops(device, rt.dtype))} | "
          f"peak memory {peak:,.0f} MiB ({what}) | saved for backward {saved:,.1f} MiB | "
          f"warm-up {warm_s:.1f} s ({mine.warmup} steps"
          f"{', compile included' if rt.compile else ''})")


# ---- generation: the KV cache against recomputing ----

def timed_generate(model, prompt, new, cache):
    """Seconds generate takes for `new` greedy tokens after prompt (B, T), with its KV cache or recomputing."""
    t0 = time.perf_counter()
    generate(model, prompt, new, top_k=1, cache=cache)
    return time.perf_counter() - t0


def full_depth_score(model, idx, start, n_loop):
    """The full-depth model on generated text idx (B, start + N): the mean loss (nats) of the N generated tokens
    and the fraction that are its own greedy choice, each read through the window generate had (a fresh cache,
    n_loop loops, no exit rule: recomputing's numbers, to float rounding)."""
    block = model.config.block_size
    first, cache, nll, same = max(0, start - block), KVCache(block), [], []
    for t in range(start, idx.size(1)):
        if t - first > block:  # generate's window rule (LoopedGPT.generate)
            first, cache = t - block // 2, KVCache(block)
        logp, _ = next_logprobs(model, idx[:, first:t], n_loop, cache=cache)
        nll.append(-logp.gather(1, idx[:, t:t + 1]).squeeze(1))
        same.append(logp.argmax(-1) == idx[:, t])
    return torch.stack(nll).mean().item(), torch.stack(same).float().mean().item()


def generation_speed(model, device, cap):
    """The timing table's rows: tokens/s cached and recomputed for batches of 1 and 8 and 256 and 1,024 new tokens
    after a prompt of block_size // 2 random tokens (where the window restarts: its mean length from the start)."""
    rows, g = [], torch.Generator().manual_seed(0)
    for B in (1, 8):
        prompt = torch.randint(model.config.vocab_size, (B, model.config.block_size // 2), generator=g).to(device)
        timed_generate(model, prompt, 8, True)  # warm-up: the first calls allocate
        best = {}  # (cache, tokens) -> the fastest seconds; a capped recomputing run serves both lengths
        for new in (256, 1024):
            runs = [(True, new), (False, min(new, cap or new))]
            for cache, n in runs + runs:  # alternating, so that any drift of the machine hits both alike
                best[cache, n] = min(best.get((cache, n), math.inf), timed_generate(model, prompt, n, cache))
            n = runs[1][1]
            cached, recomputed = B * new / best[True, new], B * n / best[False, n]
            rows.append([B, new, f"{cached:,.0f}", f"{recomputed:,.0f}" + (f" (first {n})" if n < new else ''),
                         f"{cached / recomputed:.1f}x"])
            print(f"  batch {B}, {new} new tokens: cached {cached:,.0f} tok/s, recomputed {recomputed:,.0f} tok/s",
                  flush=True)
    return rows


def sharing_cost(model, device, rule, threshold):
    """The exit table's rows: 8 greedy sequences of 256 tokens (each after its own random first token) at full
    depth, under the exit rule with the cache (skipped loops shared) and recomputing (skipped loops recomputed),
    each scored by full_depth_score."""
    g, rows = torch.Generator().manual_seed(0), []
    prompt = torch.randint(model.config.vocab_size, (8, 1), generator=g).to(device)
    runs = (('full depth, no exit', None, True), ('exit, skipped loops shared (cache)', rule, True),
            ('exit, skipped loops recomputed', rule, False))
    for label, exit_rule, cache in runs:
        idx, depth = generate(model, prompt, 256, top_k=1, exit_rule=exit_rule, exit_threshold=threshold, cache=cache)
        loss, agree = full_depth_score(model, idx, 1, model.config.n_loop)
        rows.append([label, f"{depth.float().mean().item():.2f}", f"{loss:.3f}", f"{agree:.3f}"])
    return rows


def generation(mine, args):
    """--generate: the timing table, then (with --ckpt and --exit) what sharing the skipped loops costs."""
    if mine.recompute_cap < 0 or (mine.exit != 'none') != (mine.exit_threshold is not None):
        fail(PROG, "need --recompute_cap >= 0, and --exit with --exit_threshold (or neither)")
    if mine.exit != 'none' and not mine.ckpt:
        fail(PROG, "--exit needs --ckpt: what sharing costs is measured on a trained model")
    try:
        rt = resolve_device(args.device, 'float32', False)  # generation runs in fp32, uncompiled (as sample.py)
        if mine.ckpt:
            model, ckpt = load_model(mine.ckpt, rt.device)
            what = f"{mine.ckpt} (step {ckpt['step']})"
        else:
            torch.manual_seed(args.seed)
            GPT, config = lab_train.model_config(args, mine.vocab_size)
            model, what = GPT(config).to(rt.device).eval(), 'random weights'
    except ValueError as e:
        fail(PROG, e)
    c = model.config
    print(f"{rt.describe()} | {condition_name(asdict(c))} d={c.n_embd} L={c.n_layer} K={c.n_loop} T={c.block_size} "
          f"V={c.vocab_size}, {model.num_params():,} params, {what}, {torch.get_num_threads()} threads", flush=True)
    print(markdown(['batch', 'new tokens', 'cached tok/s', 'recomputed tok/s', 'speed-up'],
                   generation_speed(model, rt.device, mine.recompute_cap)))
    if mine.exit != 'none':
        rows = sharing_cost(model, rt.device, mine.exit, mine.exit_threshold)
        print(f"\n8 greedy sequences of 256 tokens after a random first token, exit={mine.exit} threshold "
              f"{mine.exit_threshold:g}, each scored by the full-depth model ({c.n_loop} loops) on its own text:")
        print(markdown(['generation', 'mean loops per token', 'full-depth loss (nats)', 'full-depth greedy agreement'],
                       rows))


# ---- the suite ----

def build(rt, vocab_size, batch, compile=False, seed=0, **fields):
    """A model (DesignConfig fields) on rt's device, its optimizer, and a batch of random tokens."""
    config = DesignConfig(vocab_size=vocab_size, dropout=0.0, **fields)
    torch.manual_seed(seed)
    model = DesignedGPT(config).to(rt.device)
    optimizer = model.configure_optimizers(0.01, 3e-4, rt.device_type)
    if compile:
        compile_regions(model)
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(vocab_size, (batch, config.block_size), generator=g).to(rt.device) for _ in range(2))
    return model, optimizer, x, y


def unique_graphs():
    """How many graphs torch.compile has built so far in this process (a recompile builds one more)."""
    from torch._dynamo.utils import counters
    return counters['stats']['unique_graphs']


class Suite:
    """What every measurement of the suite shares: the device, the model shape for it, and the table so far."""

    def __init__(self):
        self.rt = resolve_device('auto', 'auto', 'auto')
        self.gpu = self.rt.device_type == 'cuda'
        self.peak = peak_flops(self.rt.device, self.rt.dtype)
        if self.gpu:  # the paper_44m shape
            self.shape = dict(n_layer=8, n_embd=512, n_head=8, n_loop=4, block_size=256, batch=64)
            self.V, self.steps, self.name = 20000, 10, 'paper_44m'
        else:    # toy sizes: the same measurements in under a minute on 2 cores
            self.shape = dict(n_layer=2, n_embd=64, n_head=4, n_loop=4, block_size=64, batch=8)
            self.V, self.steps, self.name = 512, 5, 'toy'
        self.B = self.shape['batch']
        self.dims = {k: v for k, v in self.shape.items() if k != 'batch'}
        self.rows, self.skipped, self.t_start = [], [], time.time()

    def add(self, measure, config, result, goal=''):
        """One table row, printed at once so that the wait shows progress (and where the time goes)."""
        self.rows.append({'measure': measure, 'config': config, 'result': result, 'goal': goal})
        print(f"  [{time.time() - self.t_start:4.0f} s] {measure} | {config} | {result}", flush=True)


def peak_memory(s):
    """1. Peak memory, per_loop against terminal, at two vocabularies, eager and compiled (measured first, while no
    other model holds GPU memory). The GPU allocator's peak only: on a CPU the row is listed as not measured."""
    if not s.gpu:
        s.skipped.append('peak memory per_loop / terminal at V = 20k and 50k (GPU allocator only; on a CPU: '
                         'python -m lab.bench --vocab_size=50257 ... once per supervision)')
        return
    for vocab in (20000, 50257):
        for compile in (False, True):
            peaks = {}
            for supervision in ('per_loop', 'terminal'):
                model, opt, x, y = build(s.rt, vocab, s.B, compile, supervision=supervision, **s.dims)
                time_steps(model, opt, s.rt, x, y, 2, 1)
                peaks[supervision] = torch.cuda.max_memory_allocated() / 2**20
                del model, opt
                gc.collect()  # a compiled model refers to itself (lab.runtime.compile_regions), so only gc frees it
                torch.cuda.empty_cache()
            s.add('peak memory', f"{s.name} V={vocab:,}, {'compiled' if compile else 'eager'}: per_loop / terminal",
                  f"{peaks['per_loop']:,.0f} / {peaks['terminal']:,.0f} MiB = "
                  f"{peaks['per_loop'] / peaks['terminal']:.2f}x",
                  '<= 1.25x')


def throughput(s):
    """2. Tokens/s and MFU for each supervision, eager and compiled, sdpa and manual attention. Returns the
    compiled per_loop sdpa model with its optimizer and batch, which the recompile check goes on training."""
    compiled_model = None
    for supervision in ('per_loop', 'terminal'):
        for compile in (False, True):
            for attention in ('sdpa', 'manual'):
                what = f"{s.name} {supervision}, {'compiled' if compile else 'eager'}, {attention}"
                if compile and not s.gpu and (supervision, attention) != ('per_loop', 'sdpa'):
                    s.skipped.append(f"tokens/s: {what} (on a CPU only one compiled row: each compile costs "
                                     "seconds here)")
                    continue
                model, opt, x, y = build(s.rt, s.V, s.B, compile, supervision=supervision, attention=attention,
                                         **s.dims)
                dt, warm = time_steps(model, opt, s.rt, x, y, s.steps, 3)
                tok_s = x.numel() / dt
                goal = '>= 40% MFU' if s.gpu and supervision == 'per_loop' and compile and attention == 'sdpa' else ''
                s.add('tokens/s, MFU', what,
                      f"{tok_s:,.0f} tok/s, MFU {fmt_mfu(tok_s, model.flops_per_token(), s.peak)}"
                      f" ({dt * 1000:.1f} ms/step, warm-up {warm:.1f} s)", goal)
                if compile and supervision == 'per_loop' and attention == 'sdpa':
                    compiled_model = (model, opt, x, y)
    return compiled_model


def recompiles(s, compiled_model):
    """3. After a warm-up (a training step, an evaluation at 2K loops, a training step), more of the same must build
    no new graph."""
    model, opt, x, y = compiled_model
    K = model.config.n_loop
    one_step = lambda: train_step(model, opt, s.rt, x, y)

    @torch.no_grad()
    def evaluate():  # the evaluation train.py runs: 2K loops, no gradients
        model.eval()
        with s.rt.autocast:
            model(x, y, n_loop=2 * K)
        model.train()
    for f in (one_step, evaluate, one_step):
        f()
    before = unique_graphs()
    for f in (one_step, one_step, evaluate, one_step, evaluate):
        f()
    s.add('recompiles after warm-up', f"{s.name} per_loop compiled: 3 training steps + 2 evaluations at 2K={2 * K}",
          f"{unique_graphs() - before} (warm-up built {before})", '0')


def compiled_vs_eager(s):
    """4. Compiled against eager: the same 20 steps from the same weights on the same batches."""
    rt, V, B, dims = s.rt, s.V, s.B, s.dims
    losses = {}
    for compile in (False, True):
        model, opt, _, _ = build(rt, V, B, compile, supervision='per_loop', **dims)
        g = torch.Generator().manual_seed(1)
        losses[compile] = []
        for _ in range(20):
            x, y = (torch.randint(V, (B, s.shape['block_size']), generator=g).to(rt.device) for _ in range(2))
            losses[compile].append(train_step(model, opt, rt, x, y).item())
    diff = max(abs(a - b) for a, b in zip(losses[False], losses[True]))
    # the last model built is the compiled side: a row that compared eager with eager would prove nothing
    regions = (sum(b._compiled_call_impl is not None for b in model.blocks)
               + hasattr(model.head_loss, '_torchdynamo_orig_callable'))
    s.add('compiled vs eager loss', f"{s.name} per_loop, 20 steps", f"largest difference {diff:.2e} (final loss "
          f"{losses[True][-1]:.3f}; {regions} of {len(model.blocks) + 1} regions compiled)", '<= 1e-2')


def blind_spot(s):
    """5. The blind spot on this device: rmsnorm and raw readouts trained side by side on tiny Shakespeare (listed
    as not measured where there is no dataset and no network to fetch it)."""
    config, pair_steps = ('gpu_char', 300) if s.gpu else ('laptop', 30)
    pair = [f'--config={config}', f'--max_iters={pair_steps}', f'--eval_interval={pair_steps}', '--log_interval=1000']
    if not s.gpu:  # a tiny model of the laptop configuration
        pair += ['--n_layer=1', '--n_embd=32', '--n_head=2', '--block_size=32', '--batch_size=8', '--eval_iters=2']
    try:
        found = {}
        with tempfile.TemporaryDirectory() as tmp:
            for readout in ('rmsnorm', 'raw'):
                print(f"  [{time.time() - s.t_start:4.0f} s] training the blind-spot pair: {readout}, "
                      f"{pair_steps} steps", flush=True)
                out = os.path.join(tmp, readout)
                with open(os.devnull, 'w') as quiet, contextlib.redirect_stdout(quiet):
                    train.main([*pair, f'--readout={readout}', f'--out_dir={out}'])
                with open(os.path.join(out, 'log.jsonl')) as f:
                    last = [json.loads(line) for line in f][-1]
                found[readout] = (last['hidden_norm'][3], last['val_loss'][3])  # loop K = 4 in both configurations
        s.add('blind spot', f"{config}{'' if s.gpu else ' (tiny)'}, {pair_steps} steps: final ‖h_K‖ rmsnorm / raw",
              f"{found['rmsnorm'][0]:,.1f} / {found['raw'][0]:,.1f} "
              f"(val loss {found['rmsnorm'][1]:.3f} / {found['raw'][1]:.3f})",
              'rmsnorm >> raw')
    except (SystemExit, ValueError) as e:  # no dataset here and no network to fetch it
        s.skipped.append(f"blind spot pair: {e}")


def report(s, json_path):
    """The table and what was not measured, printed, and the same as JSON at json_path."""
    gpu_name = torch.cuda.get_device_name(s.rt.device) if s.gpu else None
    table = markdown(['measure', 'configuration', 'result', 'goal'],
                     [[r['measure'], r['config'], r['result'], r['goal']] for r in s.rows])
    print(f"\n{s.rt.describe()}" + (f" ({gpu_name})" if s.gpu else '') + '\n')
    print(table)
    if s.skipped:
        print('\nnot measured here:\n' + '\n'.join(f"- {line}" for line in s.skipped))
    result = {'device': s.rt.device, 'gpu': gpu_name, 'torch': torch.__version__, 'rows': s.rows,
              'not_measured': s.skipped, 'seconds': round(time.time() - s.t_start, 1)}
    write_atomically(json_path, lambda f: f.write(json.dumps(result, indent=1).encode()))
    print(f"\nsuite done in {time.time() - s.t_start:.0f} s; wrote {json_path}")


def suite(json_path):
    """Run every measurement (see the module docstring), print one markdown table, write it as JSON."""
    # The suite compiles several models in one process; past dynamo's recompile limit a compiled row would
    # quietly run eager under its 'compiled' label. Fail instead.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    s = Suite()
    print(f"{s.rt.describe()} | {s.name} shape: {s.shape}, V={s.V:,}", flush=True)
    peak_memory(s)
    recompiles(s, throughput(s))
    compiled_vs_eager(s)
    blind_spot(s)
    report(s, json_path)


if __name__ == '__main__':
    main()
