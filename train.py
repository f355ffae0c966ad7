"""
Train a looped transformer LM and log the per-loop hidden-state norms that the paper is about.

The laptop demo (2-core CPU, about 3 minutes each); each run writes its own folder (out/laptop, out/laptop-raw...):
    python train.py --readout=rmsnorm --norm_penalty=0      # the blind spot: ||h_K|| climbs
    python train.py --readout=raw                           # scale visible to the loss: ||h_K|| stays small
    python train.py --norm_penalty=0.01                     # explicit penalty
    python train.py --recurrence=normed                     # inter-loop normalization: no compounding
    python train.py --readout=alpha                         # let cross-entropy choose how much scale to see
A larger character-level model on one GPU (CUDA: bf16, TF32, fused AdamW, torch.compile by default):
    python train.py --config=gpu_char --readout=rmsnorm
Continue an interrupted run (same flags), or extend it:
    python train.py --readout=rmsnorm --resume --max_iters=1200
Several processes (each takes one micro-step per optimizer step unless --grad_accum says otherwise):
    torchrun --standalone --nproc_per_node=2 train.py --device=cpu
Tests (and the course graders):
    python -m pytest -q tests assignments
"""

import argparse
import json
import math
import os
import pickle
import signal
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from data import DATASETS, find_dataset
from looped import (LoopedConfig, LoopedGPT, READOUTS, RECURRENCES, SUPERVISIONS, INITS, MLPS, load_checkpoint,
                    resolve_device)

# Named configurations; any explicit flag overrides them. 'laptop' is the default: on a 2-core CPU it
# trains, evaluates and checkpoints in a few minutes and its log shows the blind spot.
CONFIGS = {
    'laptop': dict(n_layer=2, n_embd=128, n_head=4, n_loop=4, block_size=128, batch_size=16, dropout=0.0,
                   max_iters=500, eval_interval=100, eval_iters=8, log_interval=20, learning_rate=3e-3),
    # Claim 4 on a laptop (plot_norms.py --run --config=laptop_long --seeds=3): a narrower model, so that a 2-core
    # CPU gets through 2000 steps (4M tokens) in about 4 minutes a run, and evaluations close enough to see curves cross
    'laptop_long': dict(n_layer=2, n_embd=64, n_head=4, n_loop=4, block_size=128, batch_size=16, dropout=0.0,
                        max_iters=2000, eval_interval=100, eval_iters=4, log_interval=100, learning_rate=3e-3),
    'gpu_char': dict(n_layer=4, n_embd=256, n_head=4, n_loop=4, block_size=256, batch_size=32, dropout=0.1,
                     max_iters=3000, eval_interval=250, eval_iters=20, log_interval=50, learning_rate=3e-4),
    # The authors' recipe: the whole stack looped K=4 times, SwiGLU, tied embeddings, dropout 0.1, AdamW 3e-4
    # constant with weight decay 0.01 on everything, clip 1.0, context 256, 4 epochs of WikiText-103 with the
    # word-level tokenizer (python -m data.wikitext103.prepare). An epoch is counted their way: one pass over
    # the windows of 256 tokens taken at stride 128 (see steps_from_epochs). For a GPU; on a CPU try
    # --max_iters=2 --batch_size=2.
    'paper_44m': dict(n_layer=8, n_embd=512, n_head=8, n_loop=4, block_size=256, batch_size=64, dropout=0.1,
                      max_iters=None, epochs=4, eval_interval=1000, eval_iters=20, log_interval=50,
                      learning_rate=3e-4, dataset='wikitext103'),
    'paper_129m': dict(n_layer=12, n_embd=768, n_head=12, n_loop=4, block_size=256, batch_size=32, dropout=0.1,
                       max_iters=None, epochs=4, eval_interval=1000, eval_iters=20, log_interval=50,
                       learning_rate=3e-4, dataset='wikitext103'),
}


def str2bool(s):
    """argparse type for booleans: plain type=bool would turn the string 'False' into True."""
    if s.lower() in ('1', 'true', 'yes'):
        return True
    if s.lower() in ('0', 'false', 'no'):
        return False
    raise argparse.ArgumentTypeError(f"expected True/False/1/0, got {s!r}")


def auto_or_bool(s):
    return 'auto' if s == 'auto' else str2bool(s)


def get_parser():
    p = argparse.ArgumentParser(description='Train a looped transformer LM.',
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # a one-line error instead of argparse's usage block, which is longer than the screen here
    p.error = lambda msg: sys.exit(f"train.py: error: {msg}")
    p.add_argument('--config', default='laptop', choices=CONFIGS, help='named configuration; flags override it')
    # the model (LoopedConfig in looped.py says what each one means)
    p.add_argument('--readout', default='rmsnorm', choices=READOUTS, help='what the LM head sees of h_k')
    p.add_argument('--alpha', type=float, default=None,
                   help='--readout=alpha: fix alpha in [0, 1] (1 = raw, 0 = scale-invariant); default: learned')
    p.add_argument('--recurrence', default='residual', choices=RECURRENCES,
                   help='normed: each pass starts from the RMSNorm of the previous pass output')
    p.add_argument('--supervision', default='per_loop', choices=SUPERVISIONS, help='which loops get a loss')
    p.add_argument('--norm_penalty', type=float, default=0.0, help='lambda of lambda * mean_k mean(h_k^2)')
    p.add_argument('--init', default='paper', choices=INITS, help="paper: PyTorch defaults, tied N(0,1) embedding; gpt2: N(0,0.02)")
    p.add_argument('--mlp', default='swiglu', choices=MLPS, help='MLP of every layer')
    p.add_argument('--tie_weights', type=str2bool, default=None, help='default: tied for init=paper only')
    p.add_argument('--n_loop', type=int, help='K, loops of the shared stack')
    p.add_argument('--n_layer', type=int, help='layers in the shared stack')
    p.add_argument('--n_embd', type=int, help='width d')
    p.add_argument('--n_head', type=int, help='attention heads')
    p.add_argument('--block_size', type=int, help='context length')
    p.add_argument('--dropout', type=float, help='dropout rate (the paper: 0.1)')
    # optimization: AdamW, constant learning rate, as in the paper
    p.add_argument('--batch_size', type=int, help='sequences per micro-step (per process)')
    p.add_argument('--grad_accum', type=int, default=None,
                   help='micro-steps per optimizer step, counted over all processes (global batch = batch_size * '
                        'grad_accum; under torchrun a multiple of the process count); default: one per process')
    p.add_argument('--max_iters', type=int, help='training steps in all (a resumed run continues to this step)')
    p.add_argument('--epochs', type=float, default=None,
                   help='train for this many epochs instead of --max_iters (an epoch: one pass over the training '
                        'windows of block_size tokens at stride block_size/2, as the authors count it)')
    p.add_argument('--learning_rate', type=float, help='constant; the paper uses 3e-4')
    p.add_argument('--weight_decay', type=float, default=0.01, help='AdamW decoupled weight decay')
    p.add_argument('--grad_clip', type=float, default=1.0, help='0 disables clipping')
    # evaluation, logging, checkpoints
    p.add_argument('--eval_interval', type=int, help='steps between evaluations (each also saves ckpt.pt)')
    p.add_argument('--eval_iters', type=int, help='validation batches per evaluation')
    p.add_argument('--log_interval', type=int, help='steps between progress lines')
    p.add_argument('--dataset', default='shakespeare_char',
                   help=f"one of {', '.join(DATASETS)} (folders under data/), or a path to a folder with "
                        "train.bin, val.bin and meta.pkl")
    p.add_argument('--out_dir', default=None, help='default: out/<config>, plus every variant flag that is not at its '
                                                   'default: out/laptop-raw, out/laptop-terminal-pen0.01, ...')
    p.add_argument('--resume', type=str2bool, nargs='?', const=True, default=False,
                   help="continue the run in out_dir from its ckpt.pt")
    p.add_argument('--overwrite', type=str2bool, nargs='?', const=True, default=False,
                   help='start afresh even if out_dir already holds a run (its ckpt.pt and log.jsonl are replaced)')
    # system
    p.add_argument('--device', default='auto', help='auto, cpu, cuda, cuda:N or mps')
    p.add_argument('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16'], help='auto: bf16 on CUDA')
    p.add_argument('--compile', type=auto_or_bool, default='auto', help='auto: on for CUDA')
    p.add_argument('--seed', type=int, default=1337, help='initialization, dropout and batch order')
    return p


def parse_args(argv=None):
    """Two passes: the first finds --config, whose values then become the defaults of the second."""
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument('--config', default='laptop')
    first.add_argument('--max_iters')
    first.add_argument('--epochs')
    known, _ = first.parse_known_args(argv)
    parser = get_parser()
    parser.set_defaults(**CONFIGS.get(known.config, {}))  # an unknown name is reported by the full parser
    args = parser.parse_args(argv)
    # steps come from --max_iters or from --epochs; a paper configuration's epochs give way to an explicit --max_iters
    if known.max_iters is not None and known.epochs is not None:
        parser.error("give --max_iters or --epochs, not both")
    if known.epochs is None and known.max_iters is not None:
        args.epochs = None
    for name in ('batch_size', 'eval_interval', 'eval_iters', 'log_interval') + (('max_iters',) if args.epochs is None else ()):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be at least 1")
    if args.grad_accum is not None and args.grad_accum < 1:
        parser.error(f"--grad_accum={args.grad_accum} must be at least 1")
    if args.epochs is not None and not args.epochs > 0:
        parser.error(f"--epochs={args.epochs} must be positive")
    if not args.learning_rate > 0:
        parser.error(f"--learning_rate={args.learning_rate} must be positive")
    if args.out_dir is None:  # named by the variant flags that differ from their defaults: out/laptop-raw-pen0.01
        parts = [args.config] + [getattr(args, f) for f in ('supervision', 'readout', 'recurrence', 'init', 'mlp')
                                 if getattr(args, f) != parser.get_default(f)]
        parts += [f"alpha{args.alpha:g}"] if args.alpha is not None else []
        parts += [f"pen{args.norm_penalty:g}"] if args.norm_penalty else []
        args.out_dir = os.path.join('out', '-'.join(parts))
    return args


# the flags that describe the model: on --resume they come from the checkpoint, and one given with another value
# is an error (a resumed run cannot change its model)
MODEL_FLAGS = ('block_size', 'n_embd', 'n_head', 'n_layer', 'n_loop', 'dropout', 'readout', 'alpha', 'recurrence',
               'supervision', 'norm_penalty', 'init', 'mlp', 'tie_weights')


def given_flags(argv=None):
    """The names of the flags typed on the command line (not those from defaults or from --config)."""
    parser, unset = get_parser(), object()
    parser.set_defaults(**{a.dest: unset for a in parser._actions})
    return {name for name, value in vars(parser.parse_args(argv)).items() if value is not unset}


def model_config(args, vocab_size=65):
    """The LoopedConfig that the flags describe (ValueError for invalid combinations)."""
    return LoopedConfig(
        vocab_size=vocab_size, block_size=args.block_size, n_embd=args.n_embd, n_head=args.n_head,
        n_layer=args.n_layer, n_loop=args.n_loop, dropout=args.dropout, readout=args.readout, alpha=args.alpha,
        recurrence=args.recurrence, supervision=args.supervision, norm_penalty=args.norm_penalty, init=args.init,
        mlp=args.mlp, tie_weights=args.tie_weights)


def steps_from_epochs(epochs, n_tokens, block_size, global_batch):
    """Optimizer steps for a number of epochs, counted as the authors count them: the training tokens are cut
    into windows of block_size at stride block_size // 2 (so every token is in about two windows), and an epoch
    is one pass over those windows. Returns (steps, windows per epoch)."""
    stride = block_size // 2
    windows = (n_tokens - block_size - 1) // stride + 1
    return math.ceil(epochs * windows / global_batch), windows


# Dense bf16 peak FLOP/s by GPU name, for MFU; anything else prints n/a rather than a guess.
PEAK_FLOPS = {'H100': 989e12, 'H200': 989e12, 'A100': 312e12}


def peak_flops(device):
    if not device.startswith('cuda'):
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def fmt_mfu(tokens_per_s, flops_per_token, peak):
    return 'n/a' if peak is None else f"{100 * tokens_per_s * flops_per_token / peak:.1f}%"


def fmt_time(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Data:
    """train.bin / val.bin as uint16 arrays, random training windows and fixed evaluation windows."""

    def __init__(self, folder, block_size, batch_size, device, seed):
        self.folder, self.T, self.B, self.device = folder, block_size, batch_size, device
        self.splits = {s: np.memmap(os.path.join(folder, f'{s}.bin'), dtype=np.uint16, mode='r') for s in ('train', 'val')}
        for split, data in self.splits.items():
            if len(data) <= block_size + 1:
                raise ValueError(f"{folder}/{split}.bin has {len(data)} tokens, too few for block_size={block_size}")
        with open(os.path.join(folder, 'meta.pkl'), 'rb') as f:
            self.meta = pickle.load(f)
        self.gen = torch.Generator().manual_seed(seed)  # its state goes into the checkpoint, for exact resume

    def _batch(self, data, starts):
        # one fancy-indexing gather of (B, T + 1) windows: 10x faster than stacking B slices (0.05 against
        # 0.46 ms for 64 x 256 here), which matters on a GPU, where it runs while the GPU waits for the next step
        w = torch.from_numpy(data[np.asarray(starts)[:, None] + np.arange(self.T + 1)].astype(np.int64))
        x, y = w[:, :-1], w[:, 1:]                                    # (B, T) each: y is x shifted by one
        if self.device.startswith('cuda'):  # pinned memory lets the copy overlap with the GPU's work
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def train_batch(self):
        data = self.splits['train']
        return self._batch(data, torch.randint(len(data) - self.T - 1, (self.B,), generator=self.gen).numpy())

    def fixed_batches(self, split, n_batches):
        """Up to n_batches batches of windows spread evenly over the split, the same for every run and every
        evaluation; never more windows than the split holds without overlap (so a tiny split stays cheap)."""
        data = self.splits[split]
        n = max(1, min(n_batches * self.B, (len(data) - 1) // self.T))
        starts = np.linspace(0, len(data) - self.T - 1, n).astype(np.int64).tolist()
        return [self._batch(data, starts[i:i + self.B]) for i in range(0, n, self.B)]


@torch.no_grad()
def evaluate(model, batches, n_loop, ctx):
    """Mean cross-entropy at every exit depth 1..n_loop and mean ||h_k|| at every loop, over fixed batches."""
    model.eval()
    ce, norm, n = 0.0, 0.0, 0
    for x, y in batches:
        with ctx:
            _, _, stats = model(x, y, n_loop=n_loop)
        # weighted by batch size: the last batch may be smaller
        ce, norm, n = ce + len(x) * stats['ce'].float(), norm + len(x) * stats['hidden_norm'].float(), n + len(x)
    model.train()
    return (ce / n).tolist(), (norm / n).tolist()


class RunError(Exception):
    """A failure of the run's files (a full disk, a folder that is not writable, a log that belongs to another
    run), with a one-line message; train.py exits with it and leaves the last good checkpoint in place."""


def save_checkpoint(path, raw_model, optimizer, args, run_id, step, best_val_loss, last_eval_step, record, data):
    """Write the checkpoint beside the old one, then rename it over it (atomic: a crash or a full disk mid-save
    leaves the previous checkpoint intact). record is the last evaluation's log line, so that a resumed run can
    restore it if a crash came between this save and the log write."""
    ckpt = {
        'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(), 'config': raw_model.config.to_dict(),
        'args': vars(args), 'run_id': run_id, 'step': step, 'best_val_loss': best_val_loss,
        'last_eval_step': last_eval_step, 'record': record,
        'meta': data.meta,  # the vocabulary travels with the weights, so sample.py needs no data folder
        'rng': {'torch': torch.get_rng_state(), 'batches': data.gen.get_state(),
                'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
    }
    tmp = path + '.tmp'
    try:
        torch.save(ckpt, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch reports a failed write (ENOSPC) as a RuntimeError
        if os.path.exists(tmp):
            os.remove(tmp)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[-1][:120]
        kept = 'the previous checkpoint is kept' if os.path.exists(path) else 'no checkpoint was saved before'
        raise RunError(f"could not save {path} at step {step} ({why}); {kept}") from None


def append_log(path, record, mode='a'):
    """One JSON line onto the log (mode 'w': a fresh log)."""
    try:
        with open(path, mode) as f:
            f.write(json.dumps(record) + '\n')
    except OSError as e:
        raise RunError(f"could not write {path} ({e.strerror})") from None


def repair_log(log_path, ckpt):
    """Make log.jsonl agree with the checkpoint a run resumes from: the log must belong to the same run (the run
    id in its header), a line cut by a crash is dropped, so are records past the checkpoint's last evaluation
    (the resumed run writes them again), and the checkpoint's last record is restored if a crash came between
    the save and the log write. Returns a note of what changed ('' if nothing)."""
    try:
        with open(log_path, 'rb') as f:
            lines = f.read().split(b'\n')
        cut = lines.pop() != b''  # whatever follows the last newline is a line cut short
        head = json.loads(lines[0])
    except (OSError, ValueError, IndexError) as e:
        raise RunError(f"{log_path} has no readable header ({type(e).__name__}); the run cannot be resumed into it")
    if head.get('run_id') != ckpt.get('run_id'):
        raise RunError(f"{log_path} belongs to run {head.get('run_id')}, the checkpoint to run {ckpt.get('run_id')}: "
                       "the folder mixes two runs; start afresh with --overwrite or use another --out_dir")
    kept, dropped, last = [lines[0]], 0, -1  # last: the step of the last record kept
    for line in lines[1:]:
        try:
            step = json.loads(line)['step']
        except (ValueError, KeyError, TypeError):
            dropped += 1
            continue
        if last < step <= ckpt['last_eval_step']:
            kept.append(line)
            last = step
        else:
            dropped += 1
    restored = ckpt.get('record') is not None and last < ckpt['last_eval_step']
    if restored:
        kept.append(json.dumps(ckpt['record']).encode())
    if not (cut or dropped or restored):
        return ''
    try:
        with open(log_path + '.tmp', 'wb') as f:
            f.write(b''.join(line + b'\n' for line in kept))
        os.replace(log_path + '.tmp', log_path)
    except OSError as e:
        raise RunError(f"could not repair {log_path} ({e.strerror})") from None
    return ', '.join(n for n, yes in (('a line cut by a crash removed', cut), (f'{dropped} records past the '
                     'checkpoint dropped', dropped), (f"step {ckpt['last_eval_step']}'s record restored from the "
                     'checkpoint', restored)) if yes)


def lock_out_dir(out_dir):
    """Hold an exclusive lock on out_dir/run.lock for the life of this run, so that two runs never write one
    folder (the OS drops the lock when the process ends, however it ends). Returns the open lock file; exits
    with one line naming the pid that holds it. Where the OS has no flock (Windows) nothing is locked."""
    try:
        import fcntl
    except ImportError:
        return None
    f = open(os.path.join(out_dir, 'run.lock'), 'a+')
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or '?'
        f.close()
        sys.exit(f"train.py: error: {out_dir} is in use by another train.py (pid {holder}); wait for it to end "
                 "or choose another --out_dir")
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


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


def restore(ckpt, model, optimizer, data, args, rank, device_type):
    """Load weights, optimizer and RNG states from a checkpoint. Returns (step, best val loss, last eval step)."""
    model.load_state_dict(ckpt['model'])
    optimizer.load_state_dict(ckpt['optimizer'])
    for group in optimizer.param_groups:  # the learning rate is a training flag: the command line wins
        group['lr'] = args.learning_rate
    torch.set_rng_state(ckpt['rng']['torch'].cpu())
    data.gen.set_state(ckpt['rng']['batches'].cpu())
    if rank > 0:  # only rank 0's batch order is saved; the others continue with a fresh, distinct one
        data.gen.manual_seed(args.seed + rank + 1000003 * ckpt['step'])
    if ckpt['rng']['cuda'] is not None and device_type == 'cuda':
        torch.cuda.set_rng_state_all([s.cpu() for s in ckpt['rng']['cuda']])
    return ckpt['step'], ckpt['best_val_loss'], ckpt['last_eval_step']


def main(argv=None):
    # -------------------------------------------------------------------------------------------------------
    # setup: flags, device, processes. Everything is validated before out_dir is touched, so that bad input
    # never harms an earlier run.
    args, given = parse_args(argv), given_flags(argv)
    ckpt_path, log_path = os.path.join(args.out_dir, 'ckpt.pt'), os.path.join(args.out_dir, 'log.jsonl')
    try:
        rt = resolve_device(args.device, args.dtype, args.compile)
    except ValueError as e:
        sys.exit(f"train.py: error: {e}")
    rank, world = setup_distributed(rt)
    device, ctx = rt.device, rt.autocast
    master = rank == 0  # the one process that prints, logs and checkpoints
    say = print if master else (lambda *a, **k: None)
    # Gradient accumulation: with no --grad_accum every process takes one micro-step (global batch = batch_size
    # x processes); an explicit --grad_accum fixes the global batch, split over the processes.
    if args.grad_accum is None:
        micro_steps, global_batch = 1, args.batch_size * world
    elif args.grad_accum % world:
        sys.exit(f"train.py: error: --grad_accum={args.grad_accum} is not a multiple of the {world} processes")
    else:
        micro_steps, global_batch = args.grad_accum // world, args.batch_size * args.grad_accum

    try:
        ckpt = load_checkpoint(ckpt_path, device) if args.resume else None
        # on resume the model is what was trained; the other flags (max_iters, intervals...) may change
        config = model_config(args) if ckpt is None else LoopedConfig(**ckpt['config'])
        if ckpt is not None:
            for name in sorted(given & set(MODEL_FLAGS)):
                if getattr(args, name) != getattr(config, name):
                    raise ValueError(f"--{name}={getattr(args, name)} differs from the checkpoint's {getattr(config, name)}; "
                                     "a resumed run keeps its model (drop the flag, or start a new run elsewhere)")
            for name in MODEL_FLAGS:  # the saved args describe the model that is trained, whatever --config says
                setattr(args, name, getattr(config, name))
        data = Data(find_dataset(args.dataset), config.block_size, args.batch_size, device, args.seed + rank)
        if ckpt is not None and config.vocab_size != data.meta['vocab_size']:
            raise ValueError(f"{ckpt_path} was trained with vocab {config.vocab_size}, {args.dataset} has {data.meta['vocab_size']}")
        config.vocab_size = data.meta['vocab_size']
        if args.epochs is not None:
            n_train = len(data.splits['train'])
            args.max_iters, windows = steps_from_epochs(args.epochs, n_train, config.block_size, global_batch)
            say(f"{args.epochs:g} epochs x {windows:,} windows ({n_train:,} tokens in windows of {config.block_size} "
                f"at stride {config.block_size // 2}) / {global_batch} per step = {args.max_iters:,} steps")
    except ValueError as e:
        sys.exit(f"train.py: error: {e}")
    if not args.resume and not args.overwrite and any(map(os.path.exists, (ckpt_path, log_path))):
        sys.exit(f"train.py: error: {args.out_dir} already holds a run; pass --resume to continue it, "
                 "--overwrite to replace it, or another --out_dir")
    ddp = f" | data parallel: {world} processes ({dist.get_backend()})" if world > 1 else ''
    why = ' (auto: on for CUDA only)' if args.compile == 'auto' else ''
    say(rt.describe() + why + ddp)  # after validation, so that an error is the only line a bad command prints

    # -------------------------------------------------------------------------------------------------------
    # model and optimizer, fresh or from the checkpoint
    torch.manual_seed(args.seed)
    model = LoopedGPT(config).to(device)
    optimizer = model.configure_optimizers(args.weight_decay, args.learning_rate, rt.device_type)
    step, best_val_loss, last_eval_step = 0, float('inf'), -1
    if ckpt is not None:
        step, best_val_loss, last_eval_step = restore(ckpt, model, optimizer, data, args, rank, rt.device_type)
        say(f"resuming {args.out_dir} at step {step} (model config from the checkpoint)")
    raw_model = model  # checkpoints and evaluation use the plain module, never the compiled or DDP wrapper
    if rt.compile:
        model.compile_regions()  # the blocks and the head's loss, not the unrolled loop: any loop count reuses them
    if world > 1:  # gradients are averaged across processes in backward
        model = DDP(model, device_ids=[torch.device(device)] if rt.device_type == 'cuda' else None)

    K, peak, flops_per_token = config.n_loop, peak_flops(device), raw_model.flops_per_token()
    alpha = raw_model.readout.norm.alpha if config.readout == 'alpha' else None  # logged at every evaluation
    val_batches = data.fixed_batches('val', args.eval_iters)
    train_batches = data.fixed_batches('train', args.eval_iters)
    tokens_per_step = global_batch * config.block_size
    say(f"{args.out_dir}: {raw_model.num_params():,} parameters, {config.n_layer} layers x {K} loops, "
        f"readout={config.readout}, recurrence={config.recurrence}, supervision={config.supervision}, "
        f"norm_penalty={config.norm_penalty:g}, init={config.init}; global batch {global_batch} = {args.batch_size} "
        f"x {micro_steps} micro-steps x {world} processes, {tokens_per_step:,} tokens/step, "
        f"{flops_per_token / 1e6:.1f} MFLOPs/token")

    if world > 1:  # every process has checked out_dir and read its checkpoint before rank 0 writes there
        dist.barrier()
    # The run's identity: the log header and every checkpoint carry it, and a resume refuses a folder that mixes
    # two runs. Writability is proven here, before any training, by the lock, a probe file and the log itself.
    run_id = ckpt['run_id'] if ckpt is not None and 'run_id' in ckpt else time.strftime('%Y%m%d-%H%M%S-') + os.urandom(3).hex()
    lock = None
    if master:
        try:
            os.makedirs(args.out_dir, exist_ok=True)
            lock = lock_out_dir(args.out_dir)
            tempfile.TemporaryFile(dir=args.out_dir).close()
            if not args.resume and not args.overwrite and any(map(os.path.exists, (ckpt_path, log_path))):
                sys.exit(f"train.py: error: {args.out_dir} already holds a run (it appeared while this one started)")
            if args.resume:
                note = repair_log(log_path, ckpt)
                if note:
                    say(f"{log_path} made consistent with the checkpoint: {note}")
                open(log_path, 'a').close()
            else:  # a fresh run: --overwrite clears the old run's files first, so that nothing of it can be resumed
                for old in (ckpt_path, ckpt_path + '.tmp'):
                    if os.path.exists(old):
                        os.remove(old)
                append_log(log_path, {'run_id': run_id, 'config': {**vars(args), 'model': config.to_dict(),
                                                                  'num_params': raw_model.num_params()}}, 'w')
        except OSError as e:
            sys.exit(f"train.py: error: cannot write to {args.out_dir} ({e.strerror}); nothing was trained")
        except RunError as e:
            sys.exit(f"train.py: error: {e}")
    # Ctrl-C or SIGTERM: finish the current step, save, exit. The handler only records the signal; the loop reads
    # the record, and under torchrun every process learns of it through the same all-reduce, so all of them stop
    # at the same step. A second Ctrl-C aborts a single process at once; under torchrun it does not, because
    # torchrun passes the user's Ctrl-C on to its workers a second time (its own 30 s kill is the abort there).
    interrupted = []
    def on_signal(signum, frame):
        if interrupted and signum == signal.SIGINT and world == 1:
            raise KeyboardInterrupt
        if not interrupted:
            say(f"\n{signal.Signals(signum).name}: saving a checkpoint after this step"
                + (" (Ctrl-C again to abort)" if world == 1 else ''), flush=True)
        interrupted.append(signum)
    previous_handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    try:
        if ckpt is not None and ckpt['step'] >= args.max_iters:  # nothing to train; the log was checked above
            say(f"{args.out_dir} is finished at step {ckpt['step']}; pass a larger --max_iters to continue it")
            return  # through the finally below, which frees the folder and the process group
        t_start, step_start = time.time(), step
        t_last, train_ces = time.time(), []
        last_record = ckpt.get('record') if ckpt is not None else None
        while True:
            # ---------------------------------------------------------------------------------------------------
            # evaluate at every depth 1..2K (2K: beyond the trained depth), save, then log
            if (step % args.eval_interval == 0 or step == args.max_iters) and step != last_eval_step:
                val_loss, val_norm = evaluate(raw_model, val_batches, 2 * K, ctx)  # every process, in step
                train_loss, _ = evaluate(raw_model, train_batches, K, ctx)
                if not all(map(math.isfinite, val_loss)):
                    kept = f"keeping the last good checkpoint in {args.out_dir}" if os.path.exists(ckpt_path) \
                        else "no checkpoint was saved yet"
                    sys.exit(f"train.py: error: validation loss is {val_loss[K - 1]} at step {step}; {kept}")
                best_val_loss, last_eval_step = min(best_val_loss, val_loss[K - 1]), step
                record = {'step': step, 'train_loss': train_loss[K - 1], 'val_loss': val_loss,
                          'hidden_norm': val_norm, 'elapsed_s': round(time.time() - t_start, 2)}
                if alpha is not None:
                    record['alpha'] = alpha().item()
                last_record = record
                if step > 0 and master:  # save first, then log: the log never runs ahead of the checkpoint
                    save_checkpoint(ckpt_path, raw_model, optimizer, args, run_id, step, best_val_loss, last_eval_step, record, data)
                if master:
                    append_log(log_path, record)
                say(f"eval {step}: val loss by depth " + ' '.join(f'{v:.3f}' for v in val_loss[:K])
                    + f" | 2K {val_loss[-1]:.3f} | ||h_k|| " + ' '.join(f'{v:.1f}' for v in val_norm[:K])
                    + f" | 2K {val_norm[-1]:.1f}" + (f" | alpha {record['alpha']:.3f}" if alpha is not None else ''))
            if step >= args.max_iters:
                break

            # ---------------------------------------------------------------------------------------------------
            # one optimizer step: micro_steps forward/backward passes, clip, AdamW
            lossf = 0.0
            for micro in range(micro_steps):
                x, y = data.train_batch()
                if world > 1:  # all-reduce the gradients only after the last micro-step, not after each
                    model.require_backward_grad_sync = micro == micro_steps - 1
                with ctx:
                    _, loss, stats = model(x, y)
                (loss / micro_steps).backward()
                lossf += loss.item() / micro_steps  # one sync per step buys an exact step number on divergence
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            # ---------------------------------------------------------------------------------------------------
            # agree across processes, stop on divergence, print progress, honour Ctrl-C
            stop = bool(interrupted)  # read once: a signal landing after this line is seen at the next step
            if world > 1:  # every process must see the same loss and the same Ctrl-C, or some would wait forever
                shared = torch.tensor([lossf, float(stop)], device=device)
                dist.all_reduce(shared)
                lossf, stop = shared[0].item() / world, shared[1].item() > 0
            if not math.isfinite(lossf):
                kept = f"the last good checkpoint in {args.out_dir} is kept" if os.path.exists(ckpt_path) \
                    else "no checkpoint was saved yet"
                sys.exit(f"train.py: error: training loss is {lossf} at step {step}; stopping, {kept} "
                         "(try a lower --learning_rate)")
            train_ces.append(stats['ce'][-1])
            if step % args.log_interval == 0 or step == args.max_iters:
                dt = (time.time() - t_last) / len(train_ces)
                eta = (time.time() - t_start) / (step - step_start) * (args.max_iters - step)
                say(f"step {step}/{args.max_iters} | loss {torch.stack(train_ces).mean().item():.4f} | "
                    f"||h_K|| {stats['hidden_norm'][-1].item():.1f} | {dt * 1000:.0f} ms/step | "
                    f"{tokens_per_step / dt:,.0f} tok/s | MFU {fmt_mfu(tokens_per_step / dt, flops_per_token, peak)} | "
                    f"ETA {fmt_time(eta)}")
                t_last, train_ces = time.time(), []
            if stop:
                if master:
                    save_checkpoint(ckpt_path, raw_model, optimizer, args, run_id, step, best_val_loss, last_eval_step,
                                    last_record, data)
                if world > 1:  # no process exits before the save is done: torchrun kills the rest when one ends
                    dist.barrier()
                say(f"saved {ckpt_path} at step {step}; continue with the same flags plus --resume", flush=True)
                sys.exit(130)

        if world > 1:  # the point of DDP: every process ends with the same weights
            total = torch.stack([p.detach().double().sum() for p in raw_model.parameters()]).sum().reshape(1)
            sums = [torch.zeros_like(total) for _ in range(world)]
            dist.all_gather(sums, total)
            say(f"weights identical on all {world} processes: {all(torch.equal(sums[0], t) for t in sums)}")
        say(f"done: {step} steps in {fmt_time(time.time() - t_start)}; final ||h_K|| {val_norm[K - 1]:.1f}, "
            f"val loss {val_loss[K - 1]:.4f}; log {log_path}")
        if world > 1:  # no process tears the group down while another is still using it (gloo aborts then)
            dist.barrier()
    except RunError as e:
        sys.exit(f"train.py: error: {e}")
    finally:  # leave the caller's (e.g. pytest's) signal handling as it was, and the folder free for the next run
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        if lock is not None:
            lock.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == '__main__':
    main()
