"""
Train a looped transformer LM and log the per-loop hidden-state norms the paper is about.

The laptop demo (a 2-core CPU: about 3 minutes a run, 2m56s idle); each run writes out/<name>/
    python train.py --readout=rmsnorm --norm_penalty=0  # the blind spot: ||h_K|| climbs
    python train.py --readout=raw                       # the loss sees the scale: ||h_K|| small
    python train.py --norm_penalty=0.01                 # an explicit penalty
    python train.py --recurrence=normed                 # an RMSNorm between loops
One GPU (bf16 or float16, torch.compile), continuing a run, nanoGPT's cosine, several processes:
    python train.py --config=gpu_char
    python train.py --resume --max_iters=1200
    python train.py --decay_lr --warmup_iters=50
    torchrun --standalone --nproc_per_node=2 train.py --device=cpu
The field's other designs (lab/designs.py) train through this file: python -m lab.train <flags>.
"""

import argparse
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import fields

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from data import open_dataset
from data.common import check_same_data
from data.run_folder import (check_folder, log_record, resume_checkpoint, save_checkpoint,
                             start_log)
from looped import CHOICES, LoopedConfig, LoopedGPT

# ---- flags: the named configurations, then the paper's model, training, evaluation, the system

CONFIGS = {  # --config: values that replace the defaults below, unless typed on the command line
    'laptop': {},  # the defaults: a 2-core CPU trains it in about 2 minutes and sees the blind spot
    'laptop_long': dict(n_embd=64, max_iters=2000, eval_iters=4, log_interval=100),
    'laptop_deep': dict(n_layer=4, max_iters=1500, eval_iters=4, log_interval=100,
                        learning_rate=1e-3),
    'laptop_10k': dict(max_iters=10000, eval_interval=250, log_interval=100),
    'gpu_char': dict(n_layer=4, n_embd=256, block_size=256, batch_size=32, dropout=0.1,
                     max_iters=3000, eval_interval=250, eval_iters=20, log_interval=50,
                     learning_rate=3e-4),
    # the authors' recipe: 4 epochs of WikiText-103 (python -m data.wikitext103.prepare), AdamW 3e-4
    'paper_44m': dict(n_layer=8, n_embd=512, n_head=8, block_size=256, batch_size=64, dropout=0.1,
                      max_iters=None, epochs=4, eval_interval=1000, eval_iters=20, log_interval=50,
                      learning_rate=3e-4, dataset='wikitext103'),
    'paper_129m': dict(n_layer=12, n_embd=768, n_head=12, block_size=256, batch_size=32,
                       dropout=0.1, max_iters=None, epochs=4, eval_interval=1000, eval_iters=20,
                       log_interval=50, learning_rate=3e-4, dataset='wikitext103'),
}
HABITS = {  # flags a nanoGPT user types from memory, each answered in one line
    'init_from': 'continue a run with --resume; no GPT-2 weights are loaded here',
    'eval_only': 'evaluate a checkpoint with python -m lab.diagnose --out_dir=FOLDER',
    'gradient_accumulation_steps': 'use --grad_accum=N (micro-steps over all processes)',
    **dict.fromkeys(['wandb_log', 'wandb_project', 'wandb_run_name'],
                    'no wandb here: evaluations go to out_dir/log.jsonl; plot_norms.py draws it'),
    'lr': 'use --learning_rate',
    'always_save_checkpoint': 'every evaluation saves out_dir/ckpt.pt',
    'bias': 'the layers have no biases (as the paper)',
    'beta1': "AdamW's betas are PyTorch's defaults (0.9, 0.999), as the authors'",
    'beta2': "AdamW's betas are PyTorch's defaults (0.9, 0.999), as the authors'",
    'backend': 'torchrun joins NCCL on CUDA and gloo on a CPU by itself',
}
LAB = 'python -m lab.train'  # where the field's other designs train


def fail(message):  # one line on stderr and exit status 1, as the parser's errors
    sys.exit(f"train.py: error: {message}")


def boolean(s):  # True/False/1/0; plain type=bool would read the string 'False' as True
    if s.lower() not in ('1', 'true', 'yes', '0', 'false', 'no'):
        raise argparse.ArgumentTypeError(f"expected True/False/1/0 (or the flag alone), got {s!r}")
    return s.lower() in ('1', 'true', 'yes')


def auto_or_boolean(s):  # --compile: auto (on for CUDA only), or a boolean
    if s == 'auto':
        return s
    try:
        return boolean(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto or True/False/1/0, got {s!r}") from None


class Help(argparse.ArgumentDefaultsHelpFormatter):  # each default, but an unset one's help says
    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse's, with every error in one line and a nanoGPT habit answered."""
    def error(self, message):
        if self.prog == 'train.py' and 'invalid choice' in message \
                and message.startswith(('argument --supervision', 'argument --recurrence')):
            message += f" (gated, damped: {LAB})"  # the designs' values
        sys.exit(f"{self.prog}: error: {message}")

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else args
        for arg in args:
            name = arg[2:].split('=', 1)[0]
            if arg.endswith('.py') and not arg.startswith('-'):
                self.error(f"{arg}: config files are not read here; use --config=NAME "
                           f"(one of {', '.join(CONFIGS)}) and flags")
            if arg.startswith('--') and name in HABITS:
                self.error(f"--{name} is nanoGPT's; {HABITS[name]}")
        args, unknown = super().parse_known_args(args, namespace)
        if unknown:  # a design's flag, most likely: those are the lab's
            self.error(f"unrecognized arguments: {' '.join(unknown)} (designs train with {LAB})")
        return args


def get_parser(prog='train.py'):
    p = Parser(prog=prog, description='Train a looped transformer LM.', allow_abbrev=False,
               formatter_class=Help)
    add = p.add_argument
    flag = lambda name, default, help, type=boolean: add(name, type=type, nargs='?', const=True,
                                                         default=default, help=help)
    add('--config', default='laptop', choices=CONFIGS, help='its values replace the defaults')
    # the model: looped.py's LoopedConfig, its defaults the laptop run's (2 layers x 128, K = 4)
    add('--block_size', type=int, default=128, help='context length T')
    add('--n_embd', type=int, default=128, help='width d of the residual stream')
    add('--n_head', type=int, default=4, help='attention heads; must divide n_embd')
    add('--n_layer', type=int, default=2, help='layers in the ONE shared stack (not unrolled)')
    add('--n_loop', type=int, default=4, help='K: how many times the stack is applied')
    add('--dropout', type=float, default=0.0, help='the paper: 0.1; tiny runs learn faster without')
    add('--supervision', default='per_loop', choices=CHOICES['supervision'],
        help='a cross-entropy at every loop, or at the last')
    add('--readout', default='rmsnorm', choices=CHOICES['readout'], help='what the head reads')
    add('--alpha', type=float, help='readout=alpha: unset learns alpha; in [0, 1] fixes it')
    add('--norm_penalty', type=float, default=0.0, help='lambda in lambda * mean_k mean(h_k^2)')
    add('--recurrence', default='residual', choices=CHOICES['recurrence'],
        help='the next loop starts from h_k, or from RMSNorm(h_k)')
    flag('--tie_weights', None, "the head shares the token embedding's weight (unset: tied)")
    add('--norm_eps', type=float, default=1e-6, help="every RMSNorm's epsilon (the authors')")
    # optimization: AdamW, a constant learning rate (as the paper) unless --decay_lr
    add('--batch_size', type=int, default=16, help='sequences per micro-step (per process)')
    add('--grad_accum', type=int, help='micro-steps per optimizer step over all processes '
        '(unset: one per process)')
    add('--max_iters', type=int, default=500, help='training steps in all (a resume continues)')
    add('--epochs', type=float, help='epochs instead of --max_iters (windows of block_size at '
        'stride block_size/2, as the authors count); unset: --max_iters')
    add('--learning_rate', type=float, default=3e-3, help='after any warmup (the paper: 3e-4)')
    add('--warmup_iters', type=int, default=0, help='steps of a linear ramp up to learning_rate')
    flag('--decay_lr', False, "after the warmup, nanoGPT's cosine decay to min_lr")
    add('--lr_decay_iters', type=int, help='where the cosine reaches min_lr (unset: max_iters)')
    add('--min_lr', type=float, help='where the cosine ends (unset: learning_rate / 10)')
    add('--weight_decay', type=float, default=0.01, help='AdamW decoupled weight decay')
    add('--grad_clip', type=float, default=1.0, help='0 disables clipping')
    # evaluation, logging, checkpoints
    add('--eval_interval', type=int, default=100, help='steps between evaluations (and saves)')
    add('--eval_iters', type=int, default=8, help='validation batches per evaluation')
    add('--log_interval', type=int, default=20, help='steps between progress lines')
    add('--dataset', default='shakespeare_char', help='shakespeare_char, shakespeare, '
        'wikitext103 (data/), or a folder with train.bin, val.bin and meta.json')
    add('--out_dir', help='unset: out/<config>-<each variant flag off its default>')
    flag('--resume', False, 'continue the run in out_dir (named by the same flags)')
    flag('--overwrite', False, 'start afresh even if out_dir already holds a run')
    # the system
    add('--device', default='auto', help='auto, cpu, cuda, cuda:N or mps')
    add('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16', 'float16'],
        help='auto: bf16 on a GPU that has it, else float16 (GradScaler); float32 on a CPU')
    flag('--compile', 'auto', 'auto: on for CUDA only', auto_or_boolean)
    add('--seed', type=int, default=1337, help='initialization, dropout and batch order')
    return p


def given_flags(argv=None):
    """The flags typed on the command line: they win over --config, and over a resumed run's."""
    argv = sys.argv[1:] if argv is None else argv
    return {a[2:].split('=', 1)[0] for a in argv if a.startswith('--')}


def bad_flag(a):
    """One line for the first training flag whose value cannot work (LoopedConfig checks the
    model's), or None. nan and inf would pass a plain comparison, hence finite()."""
    finite = lambda v: v is not None and math.isfinite(v)
    counts = ['batch_size', 'eval_interval', 'eval_iters', 'log_interval']
    checks = [(n, getattr(a, n) >= 1, 'at least 1') for n in counts] + [
        ('max_iters', a.epochs is not None or a.max_iters >= 1, 'at least 1'),
        ('grad_accum', a.grad_accum is None or a.grad_accum >= 1, 'at least 1'),
        ('warmup_iters', a.warmup_iters >= 0, 'at least 0 (0: no warmup)'),
        ('lr_decay_iters', a.lr_decay_iters is None or a.lr_decay_iters >= 1, 'at least 1'),
        ('min_lr', a.min_lr is None or finite(a.min_lr) and 0 <= a.min_lr <= a.learning_rate,
         'a finite number between 0 and --learning_rate'),
        ('learning_rate', finite(a.learning_rate) and a.learning_rate > 0, 'a finite number > 0'),
        ('weight_decay', finite(a.weight_decay) and a.weight_decay >= 0, 'a finite number >= 0'),
        ('grad_clip', finite(a.grad_clip) and a.grad_clip >= 0, 'a finite number >= 0 (0: off)'),
        ('epochs', a.epochs is None or finite(a.epochs) and a.epochs > 0, 'finite and > 0'),
        ('block_size', a.epochs is None or a.block_size >= 2, '>= 2 with --epochs (stride T/2)'),
        ('seed', 0 <= a.seed < 2 ** 63, 'between 0 and 2**63 - 1')]
    return next((f"--{n}={getattr(a, n)} must be {want}" for n, ok, want in checks if not ok), None)


def run_name(args):
    """out/<config>, then each variant flag off its default: out/laptop-readout_raw-pen0.01."""
    tags = {'alpha': 'alpha', 'norm_penalty': 'pen'}
    parts = [args.config]
    for f in fields(LoopedConfig):
        value = getattr(args, f.name, f.default)
        if f.name in ('supervision', 'readout', 'alpha', 'norm_penalty', 'recurrence') \
                and value != f.default:
            parts.append(tags.get(f.name, f.name + '_') + (f"{value:g}" if tags.get(f.name)
                                                          else str(value)))
    return os.path.join('out', '-'.join(parts))


def parse_args(argv=None, parser=None, name=run_name):
    argv = sys.argv[1:] if argv is None else argv
    parser, given = parser or get_parser(), given_flags(argv)
    args = parser.parse_args(argv)
    for key, value in CONFIGS[args.config].items():  # a named config's values, unless typed
        if key not in given:
            setattr(args, key, value)
    if 'max_iters' in given and 'epochs' in given:
        parser.error("give --max_iters or --epochs, not both")
    if 'max_iters' in given:  # a config's epochs give way to a typed --max_iters
        args.epochs = None
    if args.resume and args.overwrite:
        parser.error("--resume continues a run and --overwrite replaces it: give one of them")
    if bad_flag(args):
        parser.error(bad_flag(args))
    args.out_dir = args.out_dir or name(args)
    return args


def model_config(args, vocab_size=65):
    """The model the flags describe: (its class, its config); ValueError for an invalid one."""
    values = {f.name: getattr(args, f.name) for f in fields(LoopedConfig) if f.name != 'vocab_size'}
    values['tie_weights'] = args.tie_weights is not False  # unset: tied, as the authors'
    return LoopedGPT, LoopedConfig(vocab_size=vocab_size, **values)


# ---- data
class Data:
    """train.bin / val.bin as uint16 arrays, random training windows, fixed evaluation windows."""
    def __init__(self, dataset, block_size, batch_size, device, seed):  # dataset: name or folder
        self.folder, self.meta, self.splits, self.identity = open_dataset(dataset)  # all checked
        self.T, self.B, self.device = block_size, batch_size, device
        for split, data in self.splits.items():
            if len(data) <= block_size + 1:
                raise ValueError(f"{self.folder}/{split}.bin has {len(data)} tokens, too few for "
                                 f"block_size={block_size}")
        self.gen = torch.Generator().manual_seed(seed)  # saved in the checkpoint, for exact resume

    def _batch(self, data, starts):
        # one fancy-indexing gather of (B, T + 1) windows: 10x faster than stacking B slices
        windows = np.asarray(starts)[:, None] + np.arange(self.T + 1)
        w = torch.from_numpy(data[windows].astype(np.int64))
        x, y = w[:, :-1], w[:, 1:]  # (B, T) each: y is x shifted by one
        if self.device.startswith('cuda'):  # pinned memory: the copy overlaps with the GPU's work
            return (x.pin_memory().to(self.device, non_blocking=True),
                    y.pin_memory().to(self.device, non_blocking=True))
        return x.to(self.device), y.to(self.device)

    def train_batch(self):
        data = self.splits['train']
        starts = torch.randint(len(data) - self.T - 1, (self.B,), generator=self.gen).numpy()
        return self._batch(data, starts)

    def fixed_batches(self, split, n_batches):
        """Up to n_batches batches of windows spread evenly over the split, the same in every
        evaluation; no more windows than fit without overlap (so a tiny split stays cheap)."""
        data = self.splits[split]
        n = max(1, min(n_batches * self.B, (len(data) - 1) // self.T))
        starts = np.linspace(0, len(data) - self.T - 1, n).astype(np.int64).tolist()
        return [self._batch(data, starts[i:i + self.B]) for i in range(0, n, self.B)]


def steps_from_epochs(epochs, n_tokens, block_size, global_batch):
    """(steps, windows per epoch), an epoch being the authors': windows at stride block_size/2"""
    windows = (n_tokens - block_size - 1) // (block_size // 2) + 1
    return math.ceil(epochs * windows / global_batch), windows


def get_lr(args, step):
    """The rate of optimizer step `step` (0-based): a linear warmup, then constant (the paper) or
    nanoGPT's cosine down to min_lr (--decay_lr); the step alone decides it (a resume continues)."""
    lr, warmup = args.learning_rate, args.warmup_iters
    if step < warmup:
        return lr * ((step + 1) / warmup)  # this repository's ramp, bit for bit as committed runs
    if not args.decay_lr:
        return lr
    if step > args.lr_decay_iters:
        return args.min_lr
    progress = (step - warmup) / (args.lr_decay_iters - warmup)  # 0 after the warmup, 1 at the end
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - args.min_lr)


# ---- the device, and what runs on it

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


def compile_regions(model):
    """Regional torch.compile: each layer of the stack (one graph serves every loop) and the head's
    loss (float32 logits are never written); the loop stays Python, so any K reuses them."""
    for block in model.blocks:
        block.compile()
    model.head_loss = torch.compile(model.head_loss)  # an attribute shadows the method


# ---- resuming, and Ctrl-C (the run folder's files: data/run_folder.py)

def resume_args(args, given, device, model_fields):
    """The checkpoint that --resume continues, with args made to describe it: its model (a model
    flag typed with another value is an error), its data, seed and schedule unless typed."""
    path = os.path.join(args.out_dir, 'ckpt.pt')
    ckpt = resume_checkpoint(args.out_dir, device)
    other = set(ckpt['config']) - {f.name for f in model_fields}
    if other:  # a design's fields
        raise ValueError(f"{path} was trained with a design ({', '.join(sorted(other))}); resume "
                         f"it with {LAB}")
    for name in ('dataset', 'seed', 'learning_rate', 'warmup_iters', 'decay_lr', 'lr_decay_iters',
                 'min_lr'):
        if name not in given:
            setattr(args, name, ckpt['args'].get(name, getattr(args, name)))
    saved = {**{f.name: f.default for f in model_fields}, **ckpt['config']}
    for f in model_fields:
        if f.name in given and getattr(args, f.name) != saved[f.name]:
            raise ValueError(f"--{f.name}={getattr(args, f.name)} differs from the checkpoint's "
                             f"{saved[f.name]}; a resumed run keeps its model (drop the flag, or "
                             "start a new run elsewhere)")
        if f.name != 'vocab_size':
            setattr(args, f.name, saved[f.name])
    return ckpt


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


# ---- evaluation and the printed lines

@torch.no_grad()
def evaluate(model, batches, n_loop, ctx):
    """Mean cross-entropy at every exit depth 1..n_loop and mean ||h_k|| at every loop."""
    model.eval()
    ce, norm, n = 0.0, 0.0, 0
    for x, y in batches:
        with ctx:
            _, _, stats = model(x, y, n_loop=n_loop)
        ce, norm = ce + len(x) * stats['ce'].float(), norm + len(x) * stats['hidden_norm'].float()
        n = n + len(x)  # weighted by batch size: the last batch may be smaller
    model.train()
    return (ce / n).tolist(), (norm / n).tolist()


@torch.no_grad()
def state_turn(model, x, n_loop, ctx):
    """The angle in degrees between h_{k-1} and h_k (h_0 = e) at each loop, mean over tokens: the
    larger ||h||, the less a pass of roughly fixed size can turn the state, and the prediction."""
    model.eval()
    turns, h_prev = [], None
    with ctx:
        h_prev = model.embed(x)
        for _, h in model.loops(h_prev, n_loop):
            u, v = F.normalize(h_prev.float(), dim=-1), F.normalize(h.float(), dim=-1)
            angle = torch.rad2deg(2 * torch.atan2((u - v).norm(dim=-1), (u + v).norm(dim=-1)))
            turns.append(round(angle.mean().item(), 4))  # 2 atan2: acos, accurate near 0
            h_prev = h
    model.train()
    return turns


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

    def line(self, step, max_iters, h_norm, d='K', n_loop=None):
        now = time.time()
        dt = (now - self.t_last) / (step - self.last_line)
        eta = (now - self.t_start) / (step - self.step_start) * (max_iters - step)
        mean = lambda xs: f"{torch.stack(xs).mean().item():.4f}" if xs else 'skipped'
        mfu = 'n/a' if not self.peak else f"{100 * self.tokens / dt * self.flops / self.peak:.1f}%"
        line = (f"step {step}/{max_iters} | loss {mean(self.losses)} | "
                + (f"r {n_loop} | " if d == 'r' else '') + f"ce_{d} {mean(self.ces)} | "
                f"||h_{d}|| {h_norm:.1f} | {dt * 1000:.0f} ms/step | {self.tokens / dt:,.0f} tok/s"
                f" | MFU {mfu} | ETA {fmt_time(eta)}"
                + (f" | float16 steps skipped {self.skips}" if self.skips else ''))
        self.t_last, self.last_line, self.losses, self.ces = now, step, [], []
        return line


# ---- what python -m lab.train changes (a design's model, depth, DDP note and logged values)

class Hooks:
    """train.py's own choices; lab/train.py's subclass gives the designs' instead."""
    Config = LoopedConfig  # its fields are the model's flags, which a resumed run keeps

    def model_config(self, args, vocab_size):
        return model_config(args, vocab_size)

    def depth(self, model, seed, step):  # the loops a training step runs
        return model.config.n_loop

    def depth_label(self, config):  # how the progress line names that count
        return 'K'

    def unused_parameters(self, config):  # may a step leave a parameter without a gradient?
        return config.recurrence == 'normed' or config.readout == 'final_norm'

    def compile(self, model):
        compile_regions(model)

    def start(self, args, ckpt, header):  # the folder checked again, then the log begun
        check_folder(args.out_dir, args.resume, args.overwrite)
        return start_log(args.out_dir, args.overwrite, ckpt, header)

    def values(self, model, batch, ctx):  # what the run learned beyond the weights, for the log
        alpha = model.config.readout == 'alpha'  # how much of the scale the readout chose to see
        return {'alpha': model.readout.norm.alpha().item()} if alpha else {}

    def eval_extra(self, record):  # those values in the eval line
        return f" | alpha {record['alpha']:.3f}" if 'alpha' in record else ''


# ---- the run: set up, then the training loop

def setup(args, given, hooks):
    """Device, processes, data, model and optimizer (fresh or resumed), all checked before out_dir
    is written: bad input never harms an earlier run. Returns them as a namespace."""
    device, dtype, compile, ctx = resolve_device(args.device, args.dtype, args.compile)
    rank, world = 0, 1
    if 'RANK' in os.environ:  # torchrun: one process per GPU (NCCL), or per CPU share (gloo)
        dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
        if device.startswith('cuda'):
            device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(device)
        rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"device: {device} | dtype: {dtype} | compile: {compile}"
        + (' (auto: on for CUDA only)' if args.compile == 'auto' else '')
        + (f" | data parallel: {world} processes ({dist.get_backend()})" if world > 1 else ''))
    if args.grad_accum is not None and args.grad_accum % world:
        fail(f"--grad_accum={args.grad_accum} is not a multiple of the {world} processes")
    micro_steps = 1 if args.grad_accum is None else args.grad_accum // world
    ckpt = resume_args(args, given, device, fields(hooks.Config)) if args.resume else None
    data = Data(args.dataset, args.block_size, args.batch_size, device, args.seed + rank)
    if ckpt is not None:  # a resumed run continues on the data it was trained on: checked
        check_same_data(ckpt, data.meta, data.identity, os.path.join(args.out_dir, 'ckpt.pt'))
    GPT, config = hooks.model_config(args, data.meta['vocab_size'])
    global_batch = args.batch_size * micro_steps * world
    if args.epochs is not None:
        n, T = len(data.splits['train']), config.block_size
        args.max_iters, windows = steps_from_epochs(args.epochs, n, T, global_batch)
        say(f"{args.epochs:g} epochs x {windows:,} windows ({n:,} tokens in windows of {T} at "
            f"stride {T // 2}) / {global_batch} per step = {args.max_iters:,} steps")
    if args.decay_lr:  # nanoGPT's defaults: decay over the whole run to a tenth of the rate
        args.lr_decay_iters = args.lr_decay_iters or args.max_iters
        args.min_lr = args.learning_rate / 10 if args.min_lr is None else args.min_lr
        if args.lr_decay_iters <= args.warmup_iters:
            fail(f"--lr_decay_iters={args.lr_decay_iters} must be greater than "
                 f"--warmup_iters={args.warmup_iters}: the decay starts after the warmup")
    check_folder(args.out_dir, args.resume, args.overwrite)
    torch.manual_seed(args.seed)
    model = GPT(config).to(device)
    kind = device.split(':')[0]  # 'cuda', 'cpu' or 'mps': the fused AdamW and the scaler ask
    optimizer = model.configure_optimizers(args.weight_decay, args.learning_rate, kind)
    # float16's loss scaling, so that small gradients do not flush to 0; else a pass-through
    scaler = torch.amp.GradScaler(kind, enabled=dtype == 'float16')
    return argparse.Namespace(args=args, device=device, ctx=ctx, compile=compile, rank=rank,
                              world=world, say=say, micro_steps=micro_steps,
                              global_batch=global_batch, ckpt=ckpt, data=data, config=config,
                              model=model, optimizer=optimizer, scaler=scaler)


def restore(r):
    """Weights, optimizer, scaler and random states from r.ckpt; where training stands."""
    ckpt = r.ckpt
    if list(ckpt['model']) != list(r.model.state_dict()):  # the optimizer state goes by order
        raise ValueError("the checkpoint's parameters are in another order than this model's, so "
                         "its optimizer state cannot be restored; start a new run")
    r.model.load_state_dict(ckpt['model'])
    r.optimizer.load_state_dict(ckpt['optimizer'])
    if ckpt.get('scaler') and r.scaler.is_enabled():
        r.scaler.load_state_dict(ckpt['scaler'])
    torch.set_rng_state(ckpt['rng']['torch'].cpu())
    r.data.gen.set_state(ckpt['rng']['batches'].cpu())
    if r.rank > 0:  # only rank 0's batch order is saved; the others draw a fresh, distinct one
        r.data.gen.manual_seed(r.args.seed + r.rank + 1000003 * ckpt['step'])
    if ckpt['rng']['cuda'] is not None and r.device.startswith('cuda'):
        torch.cuda.set_rng_state_all([s.cpu() for s in ckpt['rng']['cuda']])
    r.say(f"resuming {r.args.out_dir} at step {ckpt['step']} (model config from the checkpoint)")
    return ckpt['step'], ckpt['best_val_loss'], ckpt['last_eval_step'], ckpt.get('record')


def save(r):
    """ckpt.pt: enough to continue exactly, and to sample without the data folder."""
    rng = {'torch': torch.get_rng_state(), 'batches': r.data.gen.get_state(),
           'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    if r.rank == 0:  # the other processes hold the same weights
        save_checkpoint(os.path.join(r.args.out_dir, 'ckpt.pt'), {
            'model': r.raw_model.state_dict(), 'optimizer': r.optimizer.state_dict(),
            'scaler': r.scaler.state_dict(), 'config': r.config.to_dict(), 'args': vars(r.args),
            'step': r.step, 'best_val_loss': r.best_val_loss, 'last_eval_step': r.last_eval_step,
            'record': r.record, 'meta': r.data.meta, 'data': r.data.identity, 'rng': rng,
            'run_id': r.run_id}, r.step)


def kept(out_dir):  # what a failure leaves behind, in words
    return (f"the last good checkpoint in {out_dir} is kept" if
            os.path.exists(os.path.join(out_dir, 'ckpt.pt')) else "no checkpoint was saved yet")


def check_finite(losses, step, out_dir):
    """Stop at a non-finite training loss, naming its step: one sync reads every loss since the
    last check (a divergence is never saved)."""
    values = torch.stack(losses).tolist() if losses else []
    for i, v in enumerate(values):
        if not math.isfinite(v):
            fail(f"training loss is {v} at step {step - len(values) + 1 + i}; stopping, "
                 f"{kept(out_dir)} (try a lower --learning_rate)")
    losses.clear()


def eval_record(r, hooks, val_batches, train_batches, t_start):
    """The log's record: the validation loss and ||h_k|| at depths 1..2K, the training loss at K,
    the turn at each loop, what a design learned. A non-finite loss at any depth stops the run."""
    K = r.config.n_loop
    val_loss, val_norm = evaluate(r.raw_model, val_batches, 2 * K, r.ctx)
    bad = [k + 1 for k, v in enumerate(val_loss) if not math.isfinite(v)]
    if bad:
        fail(f"validation loss is {val_loss[bad[0] - 1]} at depth {bad[0]} at step {r.step}; "
             f"stopping, {kept(r.args.out_dir)}")
    train_loss = evaluate(r.raw_model, train_batches, K, r.ctx)[0][K - 1]
    return {'step': r.step, 'train_loss': train_loss, 'val_loss': val_loss,
            'hidden_norm': val_norm, 'elapsed_s': round(time.time() - t_start, 2),
            'turn': state_turn(r.raw_model, val_batches[0][0], 2 * K, r.ctx),
            **hooks.values(r.raw_model, val_batches[0], r.ctx)}


def agree(r, lossf, cef, stop):
    """Under torchrun every process must see the same loss and stop at the same step, or they
    hang: one all-reduce a step (the loss, the last exit's cross-entropy, the stop flag)."""
    if r.world == 1:
        return lossf, cef, stop
    flag = torch.tensor(float(stop), device=lossf.device)
    shared = torch.stack([lossf.float(), cef.float(), flag])
    dist.all_reduce(shared)
    return shared[0] / r.world, shared[1] / r.world, shared[2].item() > 0


def train(r, hooks, interrupts):
    """The loop: every eval_interval steps evaluate, save, then log; every step a batch through
    forward, backward, clip and AdamW; every log_interval steps a progress line. Ctrl-C saves."""
    args, model, K, say = r.args, r.model, r.config.n_loop, r.say
    val_batches = r.data.fixed_batches('val', args.eval_iters)
    train_batches = r.data.fixed_batches('train', args.eval_iters)
    progress = Progress(r.step, r.global_batch * r.config.block_size,
                        r.raw_model.flops_per_token(), peak_flops(r.device))
    losses = []  # the training losses since the last check that they are finite
    while True:
        # ---- evaluate, save, then log: a diverged run stops first, and is never saved
        if (r.step % args.eval_interval == 0 or r.step == args.max_iters) \
                and r.step != r.last_eval_step:
            t_eval = time.time()
            check_finite(losses, r.step, args.out_dir)
            record = eval_record(r, hooks, val_batches, train_batches, progress.t_start)
            r.best_val_loss = min(r.best_val_loss, record['val_loss'][K - 1])
            r.last_eval_step, r.record = r.step, record
            if r.step > 0:
                save(r)  # the checkpoint first: the log never runs ahead of it
            if r.rank == 0:
                log_record(os.path.join(args.out_dir, 'log.jsonl'), record)
            loss, norm = record['val_loss'], record['hidden_norm']
            say(f"eval {r.step}: val loss by depth {' '.join(f'{v:.3f}' for v in loss[:K])} | "
                f"2K {loss[-1]:.3f} | ||h_k|| {' '.join(f'{v:.1f}' for v in norm[:K])} | "
                f"2K {norm[-1]:.1f}{hooks.eval_extra(record)}")
            progress.t_last += time.time() - t_eval  # ms/step and tok/s: training steps alone
        if r.step >= args.max_iters:
            break
        # ---- one optimizer step: micro_steps forward/backward passes, clip, AdamW
        for group in r.optimizer.param_groups:
            group['lr'] = get_lr(args, r.step)
        n_loop = hooks.depth(r.raw_model, args.seed, r.step)  # K (a lab design may draw one)
        lossf = cef = 0.0
        for micro in range(r.micro_steps):
            x, y = r.data.train_batch()
            if r.world > 1:  # all-reduce the gradients after the last micro-step only
                model.require_backward_grad_sync = micro == r.micro_steps - 1
            with r.ctx:
                _, loss, stats = model(x, y, n_loop=n_loop)
            r.scaler.scale(loss / r.micro_steps).backward()
            lossf = lossf + loss.detach() / r.micro_steps
            cef = cef + stats['ce'][-1] / r.micro_steps  # the last exit's, averaged as the loss
        if args.grad_clip > 0:
            r.scaler.unscale_(r.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scale = r.scaler.get_scale() if r.scaler.is_enabled() else None
        r.scaler.step(r.optimizer)
        r.scaler.update()  # a lower scale after it: float16 overflowed and the step was skipped
        r.optimizer.zero_grad(set_to_none=True)
        r.step += 1
        # ---- the bookkeeping: processes agree, divergence stops, progress prints, Ctrl-C saves
        lossf, cef, stop = agree(r, lossf, cef, bool(interrupts.received))
        losses.append(lossf)  # a non-finite loss is a divergence, always
        if scale is not None and r.scaler.get_scale() < scale:  # the scaler skipped this step
            progress.skips += 1
        else:
            progress.losses.append(lossf)
            progress.ces.append(cef)
        log_step = r.step % args.log_interval == 0 or r.step == args.max_iters
        if log_step or stop or r.world > 1:
            check_finite(losses, r.step, args.out_dir)
        if log_step:
            say(progress.line(r.step, args.max_iters, stats['hidden_norm'][-1].item(),
                              hooks.depth_label(r.config), n_loop))
        if stop:
            save(r)
            if r.world > 1:  # no process exits before the save: torchrun kills the rest
                dist.barrier()
            say(f"saved {os.path.join(args.out_dir, 'ckpt.pt')} at step {r.step}; continue with "
                "the same flags plus --resume", flush=True)
            sys.exit(130)
    return progress.t_start


def check_replicas(r):
    """DDP's point: every process ends with rank 0's weights, compared tensor by tensor."""
    differ = 0
    for p in r.raw_model.parameters():
        theirs = p.detach().clone()
        dist.broadcast(theirs, src=0)
        differ += int(not torch.equal(theirs, p.detach()))
    differ = torch.tensor([differ], device=r.device)  # NCCL reduces GPU tensors only
    dist.all_reduce(differ)
    r.say(f"weights identical on all {r.world} processes: {differ.item() == 0} "
          f"({len(list(r.raw_model.parameters()))} tensors compared with rank 0's)")


def main(argv=None, parser=None, hooks=Hooks(), name=run_name):
    """One run: python train.py's; lab/train.py passes its parser, hooks and run names."""
    args, given = parse_args(argv, parser, name), given_flags(argv)
    try:  # a bad device, config, dataset or run folder: one line
        r = setup(args, given, hooks)
        r.step, r.best_val_loss, r.last_eval_step, r.record = 0, float('inf'), -1, None
        if r.ckpt is not None:
            r.step, r.best_val_loss, r.last_eval_step, r.record = restore(r)
        for group in r.optimizer.param_groups:  # the learning rate is a flag: the command line wins
            group['lr'] = args.learning_rate
    except ValueError as e:
        fail(e)
    r.raw_model = r.model  # the plain module, for checkpoints and evaluation
    if r.compile:
        hooks.compile(r.model)
    if r.world > 1:  # gradients averaged in backward; told if a step may leave some without one
        r.model = DDP(r.model, device_ids=[torch.device(r.device)] if r.device.startswith('cuda')
                      else None, find_unused_parameters=hooks.unused_parameters(r.config))
    c, n_params, B = r.config, r.raw_model.num_params(), r.global_batch
    r.say(f"{args.out_dir}: {type(r.raw_model).__name__}, {n_params:,} parameters, {c.n_layer} "
          f"layers x {c.n_loop} loops; global batch {B} = {args.batch_size} x {r.micro_steps} "
          f"micro-steps x {r.world} processes, {B * c.block_size:,} tokens/step, "
          f"{r.raw_model.flops_per_token() / 1e6:.1f} MFLOPs/token")
    ok = False
    try:
        if r.world > 1:  # every process has read out_dir and its checkpoint before rank 0 writes
            dist.barrier()
        r.run_id = r.ckpt and r.ckpt.get('run_id')
        if r.rank == 0:
            header = {'config': {**vars(args), 'model': c.to_dict(), 'num_params': n_params},
                      'data': r.data.identity}
            try:
                os.makedirs(args.out_dir, exist_ok=True)
                r.run_id = hooks.start(args, r.ckpt, header)
            except OSError as e:
                fail(f"cannot write to {args.out_dir} ({e.strerror}); nothing was trained")
        with Interrupts(r.world, r.say) as interrupts:
            if r.ckpt is not None and r.ckpt['step'] >= args.max_iters:  # nothing left to do
                r.say(f"{args.out_dir} is finished at step {r.ckpt['step']}; pass a larger "
                      "--max_iters to continue it")
                ok = True
                return
            t_start = train(r, hooks, interrupts)
        if r.world > 1:
            check_replicas(r)
        last = r.record
        r.say(f"done: {r.step} steps in {fmt_time(time.time() - t_start)}; final ||h_K|| "
              f"{last['hidden_norm'][c.n_loop - 1]:.1f}, val loss "
              f"{last['val_loss'][c.n_loop - 1]:.4f}; "
              f"log {os.path.join(args.out_dir, 'log.jsonl')}")
        ok = True
    except ValueError as e:  # the run folder's one-line errors
        fail(e)
    finally:
        if dist.is_initialized():  # leave the process group, after the others when all went well
            if ok:
                dist.barrier()
            dist.destroy_process_group()
            time.sleep(0.05)  # gloo's threads need the GIL a moment to let go of their tensors


if __name__ == '__main__':
    main()
