"""
The run's plumbing, for train.py: the parts of a run a reader can take on trust. Read it when one
of them is what you want to change; train.py's loop calls each where it needs it.

- the presets --config takes (CONFIGS), as nanoGPT's config/ files beside its train.py;
- the command line: a parser whose every error is one line, True/False flags, the nanoGPT flags a
  user types from memory (each answered), the training flags' checks, the run's default name;
- the system: the device and dtype, torchrun's processes, Ctrl-C and SIGTERM (which save the
  run), the progress line with its speed and ETA;
- the run folder: its lock (two runs never share one), checkpoints written beside the old one and
  renamed over it, read with weights_only=True, the log appended without following a link.

Every check of what a user gave raises InputError (data/common.py), which train.py prints in one
line; any other exception is a bug, and keeps its traceback.
"""

import argparse
import json
import math
import os
import signal
import sys
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from data.common import InputError, write_atomically

# ---- the presets

CONFIGS = {  # --config=NAME: {flag: value}
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


# ---- the command line

LAB = 'python -m lab.train'  # where the field's other designs train

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
    """argparse's, with every error in one line, a nanoGPT habit answered, and parse(): the
    presets of --config (which the parser adds first), the training flags' checks and the run's
    default folder."""
    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, formatter_class=Help, **kwargs)
        self.add_argument('--config', default='laptop', choices=CONFIGS,
                          help='its values replace the defaults')

    def flag(self, name, default, help):  # --x alone means True; a default of 'auto' allows auto
        type = auto_or_boolean if default == 'auto' else boolean
        self.add_argument(name, type=type, nargs='?', const=True, default=default, help=help)

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

    def parse(self, argv, out_dir_of=None):
        """(args, the flags typed): --config's values under the typed ones, every training flag
        checked, and out_dir named (out_dir_of(args), else run_name's) unless typed."""
        given = given_flags(argv)
        args = self.parse_args(argv)
        for key, value in CONFIGS[args.config].items():  # a named config's values, unless typed
            if key not in given:
                setattr(args, key, value)
        if 'max_iters' in given and 'epochs' in given:
            self.error("give --max_iters or --epochs, not both")
        if 'max_iters' in given:  # a config's epochs give way to a typed --max_iters
            args.epochs = None
        if args.resume and args.overwrite:
            self.error("--resume continues a run and --overwrite replaces it: give one of them")
        if bad_flag(args):
            self.error(bad_flag(args))
        if not args.out_dir:
            args.out_dir = out_dir_of(args) if out_dir_of else run_name(args, self)
        return args, given


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


def run_name(args, parser):
    """out/<config>, then each variant flag off its default (the parser's), as
    out/laptop-readout_raw-pen0.01."""
    parts = [args.config]
    for name in ('supervision', 'readout', 'alpha', 'norm_penalty', 'recurrence'):
        value, tag = getattr(args, name), {'alpha': 'alpha', 'norm_penalty': 'pen'}.get(name)
        if value != parser.get_default(name):
            parts.append(f"{tag}{value:g}" if tag else f"{name}_{value}")
    return os.path.join('out', '-'.join(parts))


# ---- the system: device, processes, compile, signals, progress

def resolve_device(device, dtype, compile):
    """(device, dtype, compile, autocast context). auto: CUDA, else MPS, else CPU; bf16 on a GPU
    that has it, else float16 (with a GradScaler), float32 on a CPU; compile on CUDA only."""
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else \
            'mps' if torch.backends.mps.is_available() else 'cpu'
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise InputError(f"unknown device {device!r}: use auto, cpu, cuda, cuda:N or mps") from None
    if kind not in ('cpu', 'cuda', 'mps'):
        raise InputError(f"device {device!r}: only cpu, cuda and mps are supported")
    if kind == 'cuda' and not torch.cuda.is_available():
        raise InputError(f"device {device!r}: torch sees no CUDA GPU here")
    if kind == 'mps' and not torch.backends.mps.is_available():
        raise InputError(f"device {device!r}: MPS (Apple GPU) is not available here")
    if dtype == 'auto':  # emulated bf16 (a T4's) would be slow: float16 there
        dtype = 'float32' if kind != 'cuda' else 'bfloat16' if \
            torch.cuda.is_bf16_supported(including_emulation=False) else 'float16'
    if dtype == 'float16' and kind != 'cuda':
        raise InputError(f"--dtype=float16 needs CUDA (its GradScaler is for GPUs); on {kind} use "
                         "float32 or bfloat16")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # CUDA's fp32
    half = {'bfloat16': torch.bfloat16, 'float16': torch.float16}.get(dtype)
    ctx = torch.autocast(kind, dtype=half) if half else nullcontext()  # weights stay fp32
    return device, dtype, (kind == 'cuda' if compile == 'auto' else compile), ctx


def start_processes(device, dtype, compile):
    """The flags' device, dtype and compile made concrete (resolve_device), then, under torchrun
    (RANK set), the process group joined: NCCL with one GPU a process, or gloo on CPUs. Returns
    (device, dtype, compile, autocast context, rank, world size); rank 0 of 1 alone."""
    device, dtype, compile, ctx = resolve_device(device, dtype, compile)
    if 'RANK' not in os.environ:
        return device, dtype, compile, ctx, 0, 1
    dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
    if device.startswith('cuda'):
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    return device, dtype, compile, ctx, dist.get_rank(), dist.get_world_size()


def end_processes(ok):
    """Leave the process group, if any: after the others when all went well (ok)."""
    if dist.is_initialized():
        if ok:
            dist.barrier()
        dist.destroy_process_group()
        time.sleep(0.05)  # gloo's threads need the GIL a moment to let go of their tensors


@contextmanager
def catch_signals(world, say):
    """Ctrl-C and SIGTERM append to the list it yields, which the loop reads once a step: it saves
    and exits 130 there. A second Ctrl-C aborts a single process at once (torchrun repeats the
    first). The earlier handlers come back on leaving."""
    caught = []

    def handle(signum, frame):
        if caught and signum == signal.SIGINT and world == 1:
            raise KeyboardInterrupt
        if not caught:
            again = ' (Ctrl-C again to abort)' if signum == signal.SIGINT and world == 1 else ''
            say(f"\n{signal.Signals(signum).name}: saving a checkpoint after this step{again}",
                flush=True)
        caught.append(signum)

    old = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


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
    def __init__(self, step, tokens, flops, device):  # tokens: per optimizer step, all processes
        self.step_start = self.last_line = step
        self.tokens, self.flops, self.peak = tokens, flops, peak_flops(device)
        self.t_start = self.t_last = time.time()
        self.losses, self.ces, self.skips = [], [], 0

    def leave_out(self, seconds):  # time that was not training (an evaluation, a save)
        self.t_last += seconds

    def count(self, loss, ce, skipped):  # one optimizer step's: a skipped one has no loss
        if skipped:
            self.skips += 1
        else:
            self.losses.append(loss)
            self.ces.append(ce)

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


def sync_processes(loss, ce, stop, world):
    """Under torchrun every process must see the same loss and stop at the same step, or they
    hang: one all-reduce a step (the loss, the last exit's cross-entropy, the stop flag)."""
    flag = torch.tensor(float(stop), device=loss.device)
    shared = torch.stack([loss.float(), ce.float(), flag])
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


# ---- the run folder: its lock, checkpoints and log

FILES = ('log.jsonl', 'ckpt.pt', 'log.jsonl.tmp', 'ckpt.pt.tmp')


def check_folder(out_dir, resume, overwrite):
    """Before anything is built: refuse a planted link, or a run the command would replace."""
    for name in FILES:
        if os.path.islink(os.path.join(out_dir, name)):
            raise InputError(f"{os.path.join(out_dir, name)} is a symbolic link; a run folder's "
                             "own files must be plain files (remove the link, or use another "
                             "--out_dir)")
    ckpt, log = os.path.join(out_dir, 'ckpt.pt'), os.path.join(out_dir, 'log.jsonl')
    has_records = os.path.exists(log) and len(open(log, 'rb').read().strip().split(b'\n')) > 1
    if not resume and not overwrite and (os.path.exists(ckpt) or has_records):
        raise InputError(f"{out_dir} already holds a run; pass --resume to continue it, "
                         "--overwrite to replace it, or another --out_dir")


def load_checkpoint(path, device='cpu'):
    """The checkpoint dict train.py saved, read with weights_only=True (tensors and plain data
    only: a checkpoint from someone else can never run code here); InputError in one line."""
    if not os.path.exists(path):
        raise InputError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # a pickle that names a class is how a checkpoint would run code
        if 'GLOBAL ' in str(e) or 'Unsupported global' in str(e):
            raise InputError(f"checkpoint {path} holds objects other than tensors and plain data; "
                             "refused, since loading it could run code") from None
        raise InputError(f"checkpoint {path} is unreadable (truncated or corrupt?): "
                         f"{type(e).__name__}") from None
    missing = {'model', 'config', 'step'} - set(ckpt)
    if missing:
        raise InputError(f"checkpoint {path} lacks {', '.join(sorted(missing))}; not a looped "
                         "checkpoint")
    # SwiGLU's W3 was named c_gate (a misnomer: W1, c_fc, is the gate) before it was c_up: an
    # older checkpoint reads as it was saved
    ckpt['model'] = {k.replace('.mlp.c_gate.', '.mlp.c_up.'): v for k, v in ckpt['model'].items()}
    return ckpt


def resume_checkpoint(out_dir, device):
    """The checkpoint --resume continues; an InputError that says where to look if there is none."""
    path = os.path.join(out_dir, 'ckpt.pt')
    if os.path.exists(path):
        return load_checkpoint(path, device)
    if os.path.exists(os.path.join(out_dir, 'log.jsonl')):
        raise InputError(f"no checkpoint at {path}: the run there stopped before its first save; "
                         "run the same command without --resume to start it afresh")
    parent = os.path.dirname(os.path.normpath(out_dir)) or '.'  # runs named by their flags
    runs = sorted(os.path.join(parent, d) for d in os.listdir(parent) if os.path.isfile(
        os.path.join(parent, d, 'ckpt.pt'))) if os.path.isdir(parent) else []
    raise InputError(f"no checkpoint at {path}: --resume looked in {out_dir}, the folder these "
                     "flags name; give the run's own flags or --out_dir=FOLDER"
                     + (f"; runs there: {', '.join(runs[:4])}" if runs else ''))


def resume_args(args, given, device, model_fields):
    """The checkpoint that --resume continues, with args made to describe it: its model (a model
    flag typed with another value is an error), its data, seed and schedule unless typed."""
    path = os.path.join(args.out_dir, 'ckpt.pt')
    ckpt = resume_checkpoint(args.out_dir, device)
    other = set(ckpt['config']) - {f.name for f in model_fields}
    if other:  # a design's fields
        raise InputError(f"{path} was trained with a design ({', '.join(sorted(other))}); resume "
                         f"it with {LAB}")
    for name in ('dataset', 'seed', 'learning_rate', 'warmup_iters', 'decay_lr', 'lr_decay_iters',
                 'min_lr'):
        if name not in given:
            setattr(args, name, ckpt['args'].get(name, getattr(args, name)))
    saved = {**{f.name: f.default for f in model_fields}, **ckpt['config']}
    for f in model_fields:
        if f.name in given and getattr(args, f.name) != saved[f.name]:
            raise InputError(f"--{f.name}={getattr(args, f.name)} differs from the checkpoint's "
                             f"{saved[f.name]}; a resumed run keeps its model (drop the flag, or "
                             "start a new run elsewhere)")
        if f.name != 'vocab_size':
            setattr(args, f.name, saved[f.name])
    return ckpt


def load_weights(model, state, path):
    """model.load_state_dict(state), or InputError in one line naming the parameters that one has
    and the other lacks (the first few of each): a checkpoint saved before the model was edited."""
    have, saved = model.state_dict(), state
    missing = [k for k in have if k not in saved]
    unexpected = [k for k in saved if k not in have]
    reshaped = [k for k in have if k in saved and have[k].shape != saved[k].shape]
    if missing or unexpected or reshaped:
        few = lambda names: ', '.join(names[:3]) + (f" and {len(names) - 3} more"
                                                    if len(names) > 3 else '')
        parts = [f"{what}: {few(names)}" for what, names in (
            ('missing from the checkpoint', missing), ('in the checkpoint, not in this model',
                                                       unexpected),
            ('of another shape', reshaped)) if names]
        raise InputError(f"{path} does not fit this model ({'; '.join(parts)}): was the model "
                         "edited since it was saved? Train a new run, or undo the edit")
    model.load_state_dict(state)


def restore(ckpt, model, optimizer, scaler, gen, device):
    """Weights, optimizer, scaler and random states (gen: the batches' generator) from a checkpoint
    of these data (load_data checked it); where training stood, the step and the last record, is
    the checkpoint's to read."""
    load_weights(model, ckpt['model'], 'the checkpoint being resumed')
    if list(ckpt['model']) != list(model.state_dict()):  # the optimizer state goes by order
        raise InputError("the checkpoint's parameters are in another order than this model's, "
                         "so its optimizer state cannot be restored; start a new run")
    optimizer.load_state_dict(ckpt['optimizer'])
    if ckpt.get('scaler') and scaler.is_enabled():
        scaler.load_state_dict(ckpt['scaler'])
    torch.set_rng_state(ckpt['rng']['torch'].cpu())
    gen.set_state(ckpt['rng']['batches'].cpu())
    if ckpt['rng']['cuda'] is not None and device.startswith('cuda'):
        torch.cuda.set_rng_state_all([s.cpu() for s in ckpt['rng']['cuda']])


def what_is_kept(out_dir):  # what a failure leaves behind, in words
    return (f"the last good checkpoint in {out_dir} is kept" if
            os.path.exists(os.path.join(out_dir, 'ckpt.pt')) else "no checkpoint was saved yet")


def check_finite(losses, step, out_dir):
    """Stop at a non-finite training loss among losses (the last one is step's), naming its step:
    one sync reads them all (a divergence is never saved)."""
    values = torch.stack(losses).tolist() if losses else []
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise InputError(f"training loss is {v} at step {step - len(values) + 1 + i}; "
                             f"stopping, {what_is_kept(out_dir)} (try a lower --learning_rate)")


def open_log(out_dir, resume, overwrite, ckpt, header):
    """Locks out_dir for the run's life (a second run into it is refused here), checks it again
    (a run may have ended there since check_folder) and begins or reconciles its log: (the lock,
    the run's id). Refused, it lets the lock go."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot write to {out_dir} ({e.strerror}); nothing was trained") \
            from None
    lock = lock_folder(out_dir)
    try:
        check_folder(out_dir, resume, overwrite)
        return lock, start_log(out_dir, overwrite, ckpt, header)
    except InputError:
        if lock is not None:
            os.close(lock)
        raise


def start_log(out_dir, overwrite, ckpt, header):
    """A fresh run's log: the header, the old run's files cleared first. A resumed run's: the log
    made to agree with its checkpoint (a line cut by a crash and records past the checkpoint
    dropped, a record lost between save and log restored). Returns the run's id."""
    path = os.path.join(out_dir, 'log.jsonl')
    if ckpt is None:
        for old in ('ckpt.pt', 'ckpt.pt.tmp'):
            if os.path.lexists(os.path.join(out_dir, old)):
                os.remove(os.path.join(out_dir, old))
        if not overwrite and os.path.exists(path):  # check_folder found no records in it
            print(f"{path}: the log of a run stopped before its first save was replaced")
        run_id = time.strftime('%Y%m%d-%H%M%S-') + os.urandom(3).hex()
        write_lines(path, [{'run_id': run_id, **header}])
        return run_id
    try:
        lines = open(path).read().split('\n')
        records = [json.loads(line) for line in lines[:-1]]  # a cut last line has no newline
    except (OSError, ValueError) as e:
        raise InputError(f"{path} is not readable as a log ({type(e).__name__}); the run cannot "
                         "be resumed into it") from None
    if records[0].get('run_id') != ckpt.get('run_id'):
        raise InputError(f"{path} belongs to run {records[0].get('run_id')}, the checkpoint to run "
                         f"{ckpt.get('run_id')}: the folder mixes two runs; start afresh with "
                         "--overwrite or use another --out_dir")
    kept = [r for r in records[1:] if r['step'] <= ckpt['last_eval_step']]
    if ckpt.get('record') and (not kept or kept[-1]['step'] < ckpt['last_eval_step']):
        kept.append(ckpt['record'])
    if len(kept) != len(records) - 1 or lines[-1]:
        write_lines(path, records[:1] + kept)
        print(f"{path}: made consistent with the checkpoint at step {ckpt['last_eval_step']}")
    return ckpt['run_id']


def write_lines(path, records):  # through a fresh file renamed into place: never through a link
    write_atomically(path, lambda f: f.write(''.join(json.dumps(r) + '\n' for r in records)
                                             .encode()))


def save_checkpoint(path, state, step):
    """Written beside the old checkpoint, then renamed over it: a crash keeps the old one whole."""
    try:
        write_atomically(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as e:
        kept = 'the previous checkpoint is kept' if os.path.exists(path) else \
            'no checkpoint was saved before'
        why = getattr(e, 'strerror', None) or 'is the disk full?'  # torch's own error is opaque
        raise InputError(f"could not save {path} at step {step} ({why}); {kept}") from None


def log_record(path, record):  # appended, never through a link planted since the log was written
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | getattr(os, 'O_NOFOLLOW', 0))
    with os.fdopen(fd, 'a') as f:
        f.write(json.dumps(record) + '\n')


def lock_folder(out_dir):
    """An exclusive lock on out_dir/run.lock, holding this process's pid, so that two runs never
    train in one folder: the second is refused at once, whichever started first. Returns the file
    descriptor that holds it (os.close releases it; the OS does however the holder ends), or None
    where the OS has no flock."""
    try:
        import fcntl
    except ImportError:
        return None
    path = os.path.join(out_dir, 'run.lock')
    if os.path.islink(path):
        raise InputError(f"{path} is a symbolic link; a run folder's own files must be plain "
                         "files (remove the link, or use another --out_dir)")
    # opened without truncating or following a link: the holder's pid is read before it is replaced
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, 'O_NOFOLLOW', 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 64).decode(errors='replace').strip() or '?'
        os.close(fd)
        raise InputError(f"{out_dir} is in use by another train.py (pid {holder}); wait for it "
                         "to end or choose another --out_dir")
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
