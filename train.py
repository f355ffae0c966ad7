"""
Train a looped transformer LM and log the per-loop hidden-state norms the paper is about.

The laptop demo (an idle 2-core CPU: about 2 minutes a run); each run writes out/<name>/
    python train.py --readout=rmsnorm --norm_penalty=0  # the blind spot: ||h_K|| ~930
    python train.py --readout=raw                       # the loss sees the scale: ||h_K|| small
    python train.py --norm_penalty=0.01                 # an explicit penalty
    python train.py --recurrence=normed                 # an RMSNorm between loops
One GPU (bf16 or float16, torch.compile), continuing a run, nanoGPT's cosine, several processes:
    python train.py --config=gpu_char
    python train.py --resume --max_iters=1000  # goes on with out/laptop, the set-up's run
    python train.py --decay_lr --warmup_iters=50 --out_dir=out/cosine
    torchrun --standalone --nproc_per_node=2 train.py --device=cpu --out_dir=out/ddp
data/loader.py reads a dataset and cuts its batches; plumbing/run.py holds the rest of the run.
"""

import argparse
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from data.loader import load_data, get_batch, eval_batches  # prepared if need be, checked; windows
from data.common import InputError  # bad input, or a run that cannot go on: one line
from looped import CHOICES, ConfigError, LoopedConfig, LoopedGPT
# the run's plumbing (plumbing/run.py), each group said in a line so it can be taken on trust:
from plumbing.run import Parser  # argparse, errors in one line; flag: True/False; parse: --config
from plumbing.run import start_processes, end_processes  # the device; torchrun's group in, out
from plumbing.run import sync_processes, check_replicas  # torchrun: losses, then weights, agree
from plumbing.run import catch_signals, check_finite, Progress  # Ctrl-C caught; NaN stops; the line
from plumbing.run import check_folder, open_log, log_record, save_checkpoint  # the run's folder
from plumbing.run import resume_args, restore, what_is_kept  # --resume; what a failure leaves

# ---- flags: the paper's model, training, evaluation, the system (presets: plumbing/run.py)


def get_parser(prog='train.py'):
    # plumbing/run.py's Parser: one-line errors, and --config (the presets; parse() applies them)
    p = Parser(prog=prog, description='Train a looped transformer LM.')
    add, flag = p.add_argument, p.flag  # flag: True/False, and --x alone means --x=True
    # the model: a flag per field of looped.py's LoopedConfig, with its default (a test checks)
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
    flag('--tie_weights', True, "the head shares the token embedding's weight (the authors')")
    add('--norm_eps', type=float, default=1e-6, help="every RMSNorm's epsilon (the authors')")
    # optimization: AdamW, a constant learning rate (as the paper) unless --decay_lr
    add('--batch_size', type=int, default=16, help='sequences per micro-step (per process)')
    add('--grad_accum', type=int, help='micro-steps a step, all processes together (unset: 1 each)')
    add('--max_iters', type=int, default=500, help='training steps in all (a resume continues)')
    add('--epochs', type=float, help="the authors' epochs (stride T/2); unset: --max_iters")
    add('--learning_rate', type=float, default=3e-3, help='after any warmup (the paper: 3e-4)')
    add('--warmup_iters', type=int, default=0, help='steps of a linear ramp up to learning_rate')
    flag('--decay_lr', False, "after the warmup, nanoGPT's cosine decay to min_lr")
    add('--lr_decay_iters', type=int, help='where the cosine reaches min_lr (unset: max_iters)')
    add('--min_lr', type=float, help='where the cosine ends (unset: learning_rate / 10)')
    add('--weight_decay', type=float, default=0.01, help='AdamW decoupled weight decay')
    add('--grad_clip', type=float, default=1.0, help='0 disables clipping')
    # evaluation, logging, checkpoints
    add('--eval_interval', type=int, default=100, help='steps between evaluations (and saves)')
    add('--eval_iters', type=int, default=8, help='batches of each split per evaluation')
    add('--log_interval', type=int, default=20, help='steps between progress lines')
    add('--dataset', default='shakespeare_char', help='shakespeare_char, shakespeare, '
        'wikitext103 (data/), or a folder with train.bin, val.bin and meta.json')
    add('--out_dir', help='unset: out/<config>, then supervision, readout, alpha, norm_penalty and '
        'recurrence where off their defaults (out/laptop-readout_raw)')
    flag('--resume', False, 'continue the run in out_dir (named by the same flags)')
    flag('--overwrite', False, 'start afresh even if out_dir already holds a run')
    # the system
    add('--device', default='auto', help='auto, cpu, cuda, cuda:N or mps')
    add('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16', 'float16'],
        help='auto: bf16 where CUDA has it, else float16 (GradScaler); float32 on CPU or MPS')
    flag('--compile', 'auto', 'auto: on for CUDA only')
    add('--seed', type=int, default=1337, help='initialization, dropout and batch order')
    return p


def model_config(args, vocab_size=65):
    """The model the flags describe: (its class, its config); InputError for an invalid one. The
    class comes too because python -m lab.train's version of this function may pick another."""
    values = {f.name: getattr(args, f.name, f.default) for f in fields(LoopedConfig)}
    try:  # LoopedConfig's own checks, of values the user typed (a field with no flag: its default)
        return LoopedGPT, LoopedConfig(**{**values, 'vocab_size': vocab_size})
    except ConfigError as e:
        raise InputError(str(e)) from None


def get_lr(args, step):
    """The rate at step `step` (0-based; a resume continues): a linear warmup, then constant (the
    paper) or nanoGPT's cosine to min_lr (--decay_lr; resolve_schedule, below, sets its values)."""
    lr, warmup = args.learning_rate, args.warmup_iters
    if step < warmup:
        return lr * ((step + 1) / warmup)  # / warmup, not nanoGPT's + 1: committed logs reproduce
    if not args.decay_lr:
        return lr
    if step > args.lr_decay_iters:
        return args.min_lr
    decay_ratio = (step - warmup) / (args.lr_decay_iters - warmup)  # 0 after the warmup, 1 at end
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * decay_ratio)) * (lr - args.min_lr)


def resolve_schedule(args, n_tokens, T, global_batch, say):
    """Writes into args the steps --epochs asks for (saying how) and --decay_lr's defaults: over the
    whole run to a tenth of the rate (nanoGPT's). InputError: a decay ending by the warmup's end."""
    if args.epochs is not None:  # the authors' epoch: every window of T tokens at stride T/2
        windows = (n_tokens - T - 1) // (T // 2) + 1
        args.max_iters = math.ceil(args.epochs * windows / global_batch)
        say(f"{args.epochs:g} epochs x {windows:,} windows ({n_tokens:,} tokens in windows of {T} "
            f"at stride {T // 2}) / {global_batch} per step = {args.max_iters:,} steps")
    if args.decay_lr:
        args.lr_decay_iters = args.lr_decay_iters or args.max_iters
        args.min_lr = args.learning_rate / 10 if args.min_lr is None else args.min_lr
        if args.lr_decay_iters <= args.warmup_iters:
            raise InputError(f"--lr_decay_iters={args.lr_decay_iters} must be greater than "
                             f"--warmup_iters={args.warmup_iters} (the decay follows the warmup)")


# ---- evaluation and the printed lines

@torch.no_grad()
def evaluate(model, batches, n_loop, ctx):
    """Mean cross-entropy and mean ||h_k|| at each exit depth 1..n_loop (forward's stats)."""
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
    larger ||h||, the less a pass of roughly fixed size turns the state, and so its prediction."""
    model.eval()
    turns = []
    with ctx:
        h_prev = model.embed(x)
        for _, h in model.loops(h_prev, n_loop):
            u, v = F.normalize(h_prev.float(), dim=-1), F.normalize(h.float(), dim=-1)
            angle = torch.rad2deg(2 * torch.atan2((u - v).norm(dim=-1), (u + v).norm(dim=-1)))
            turns.append(round(angle.mean().item(), 4))  # angle: acos(u.v), accurate near 0 too
            h_prev = h
    model.train()
    return turns


def eval_line(record, K):
    """The printed line of an evaluation: the loss by exit depth 1..K and at 2K, then ||h_k||."""
    loss, norm = record['val_loss'], record['hidden_norm']
    return (f"eval {record['step']}: val loss by depth {' '.join(f'{v:.3f}' for v in loss[:K])} | "
            f"2K {loss[-1]:.3f} | ||h_k|| {' '.join(f'{v:.1f}' for v in norm[:K])} | "
            f"2K {norm[-1]:.1f}")


# ---- what python -m lab.train changes: the model, its depth, DDP's unused ones, compile, the log

class Hooks:
    """A plain run's answers (read hooks.x(...) as this code); lab/train.py's subclass differs."""
    Config = LoopedConfig  # its fields are the model's flags, which a resumed run keeps

    def model_config(self, args, vocab_size):  # model_config above; the lab's picks a design
        return model_config(args, vocab_size)

    def depth(self, model, seed, step):  # the loops a training step runs (None: the model's K)
        return None

    def unused_parameters(self, config):  # may a step leave a parameter without a gradient?
        return config.recurrence == 'normed' and config.n_loop == 1  # inter_norm, never run

    def compile(self, model):  # each layer; the head's matmul and cross-entropy fused (head_loss)
        for block in model.blocks:  # the loop stays Python, so any K reuses the compiled layers
            block.compile()
        model.head_loss = torch.compile(model.head_loss)  # an attribute shadows the method

    def values(self, model, batch, ctx):  # readout=alpha's alpha (AlphaNorm); batch, ctx: designs'
        alpha = model.readout.norm.alpha().item() if model.config.readout == 'alpha' else None
        return {} if alpha is None else {'alpha': alpha}  # how much of the scale the head sees

    def eval_extra(self, record):  # those values in the eval line
        return f" | alpha {record['alpha']:.3f}" if 'alpha' in record else ''


def eval_record(model, step, batches, ctx, hooks, out_dir):
    """The log's record: validation loss and ||h_k|| at depths 1..2K, training CE at K, the turn
    at each loop, what a design learned. A non-finite loss at any depth stops the run."""
    K = model.config.n_loop
    val_loss, val_norm = evaluate(model, batches['val'], 2 * K, ctx)
    for k, v in enumerate(val_loss, 1):  # k: the depth; a divergence ends in one line, as bad input
        if not math.isfinite(v):
            raise InputError(f"validation loss is {v} at depth {k} at step {step}; stopping, "
                             f"{what_is_kept(out_dir)}")
    train_ce, _ = evaluate(model, batches['train'], K, ctx)  # cross-entropies by depth 1..K
    x, y = batches['val'][0]  # the first validation batch: the turn, and what a design learned
    return {'step': step, 'train_loss': train_ce[K - 1], 'val_loss': val_loss,  # train: CE at K
            'hidden_norm': val_norm, 'turn': state_turn(model, x, 2 * K, ctx),
            **hooks.values(model, (x, y), ctx)}


# ---- the run: set up, then the training loop

@dataclass
class Run:
    """Made once by setup(): what the loop works with (the step and best loss live in the loop)."""
    args: argparse.Namespace  # the flags, with a resumed run's and the schedule's values in them
    raw_model: nn.Module  # the model (its layers compiled in place by --compile): saved, evaluated
    model: nn.Module  # what a step calls: raw_model itself, or raw_model wrapped by DDP
    optimizer: torch.optim.Optimizer  # AdamW
    scaler: torch.amp.GradScaler  # float16's loss scaling; a pass-through otherwise
    splits: dict  # 'train' and 'val': each split's token ids, uint16 arrays read as needed
    gen: torch.Generator  # draws the training windows: seeded, saved and restored (exact resume)
    meta: dict  # the vocabulary, kept in the checkpoint so that sample.py needs no data folder
    identity: dict  # the data's path, sizes and hashes: a checkpoint is read with its data only
    ctx: object  # autocast to bf16 or float16, or nothing
    device: str  # 'cpu', 'cuda', 'cuda:N' (typed, or torchrun's local rank) or 'mps'
    rank: int  # this process of world (torchrun); 0 of 1 alone
    world: int
    say: Callable  # print on rank 0; nothing on the other processes
    micro_steps: int  # forward/backward passes per optimizer step, in this process
    ckpt: dict | None  # the checkpoint a resumed run continues, else None


def setup(args, given, hooks):
    """The Run the flags describe, all of it checked before out_dir is written: bad input never
    harms an earlier run. Resumed: the saved model and state; data, seed, schedule if not typed."""
    device, dtype, use_compile, ctx, rank, world = start_processes(args.device, args.dtype,
                                                                   args.compile)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"device: {device} | dtype: {dtype} | compile: {use_compile}"
        + (' (auto: on for CUDA only)' if args.compile == 'auto' else '')
        + (f" | data parallel: {world} processes ({dist.get_backend()})" if world > 1 else ''))
    if args.grad_accum is not None and args.grad_accum % world:
        raise InputError(f"--grad_accum={args.grad_accum} is not a multiple of {world} processes")
    micro_steps = 1 if args.grad_accum is None else args.grad_accum // world
    ckpt = resume_args(args, given, device, fields(hooks.Config)) if args.resume else None
    meta, splits, identity = load_data(args.dataset, args.block_size, ckpt)  # all checked
    gen = torch.Generator().manual_seed(args.seed + rank)  # the order of the training windows
    Model, config = hooks.model_config(args, meta['vocab_size'])
    resolve_schedule(args, len(splits['train']), config.block_size,
                     args.batch_size * micro_steps * world, say)
    check_folder(args.out_dir, args.resume, args.overwrite)  # every process, before the model
    torch.manual_seed(args.seed)
    raw_model = Model(config).to(device)
    kind = device.split(':')[0]  # 'cuda', 'cpu' or 'mps': the fused AdamW and the scaler take it
    optimizer = raw_model.configure_optimizers(args.weight_decay, args.learning_rate, kind)
    scaler = torch.amp.GradScaler(kind, enabled=dtype == 'float16')
    if ckpt is not None:  # trained on these data (load_data checked)
        restore(ckpt, raw_model, optimizer, scaler, gen, device)  # weights, AdamW, scaler, RNGs
        if rank > 0:  # only rank 0's batch order is saved; the others draw a fresh one
            gen.manual_seed(args.seed + rank + 1000003 * ckpt['step'])  # a prime: fresh per step
    model = raw_model
    if use_compile:
        hooks.compile(raw_model)
    if world > 1:  # gradients averaged in backward; told if a step may leave some without one
        model = DDP(raw_model, device_ids=[torch.device(device)] if kind == 'cuda' else None,
                    find_unused_parameters=hooks.unused_parameters(config))
    return Run(args, raw_model, model, optimizer, scaler, splits, gen, meta, identity, ctx, device,
               rank, world, say, micro_steps, ckpt)


def begin_log(run):
    """Rank 0 locks out_dir for the run's life (a second run is refused), checks it and begins or
    reconciles its log, all in open_log. Returns (lock, run_id); lock is None on ranks > 0."""
    args, c = run.args, run.raw_model.config
    n_params, batch = run.raw_model.num_params(), args.batch_size * run.micro_steps * run.world
    run.say(f"{args.out_dir}: {type(run.raw_model).__name__}, {n_params:,} parameters, "
            f"{c.n_layer} layers x {c.n_loop} loops; global batch {batch} = {args.batch_size} x "
            f"{run.micro_steps} micro-steps x {run.world} processes, {batch * c.block_size:,} "
            f"tokens/step, {run.raw_model.flops_per_token() / 1e6:.1f} MFLOPs/token")
    if run.world > 1:  # every process has read out_dir and its checkpoint before rank 0 writes
        dist.barrier()
    if run.rank > 0:
        return None, (run.ckpt.get('run_id') if run.ckpt else None)
    header = {'config': {**vars(args), 'model': asdict(c), 'num_params': n_params},
              'data': run.identity}
    return open_log(args.out_dir, args.resume, args.overwrite, run.ckpt, header)


def save(run, step, best_val_loss, last_eval_step, record, run_id):
    """ckpt.pt: enough to continue exactly, and to sample without the data folder."""
    rng = {'torch': torch.get_rng_state(), 'batches': run.gen.get_state(),
           'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    if run.rank == 0:  # the other processes hold the same weights
        save_checkpoint(os.path.join(run.args.out_dir, 'ckpt.pt'), {  # a new file, renamed in place
            'model': run.raw_model.state_dict(), 'optimizer': run.optimizer.state_dict(),
            'scaler': run.scaler.state_dict(), 'config': asdict(run.raw_model.config),
            'args': vars(run.args), 'step': step, 'best_val_loss': best_val_loss,
            'last_eval_step': last_eval_step, 'record': record, 'meta': run.meta,
            'data': run.identity, 'rng': rng, 'run_id': run_id}, step)
    if run.world > 1:  # no process goes on, or exits, before it is written: torchrun kills the rest
        dist.barrier()


def train(run, hooks, run_id):
    """The loop: each eval_interval steps evaluate, save (not step 0), log; each step micro_steps
    batches forward and backward, clip, AdamW; each log_interval a progress line. Ctrl-C saves."""
    args, model, optimizer, scaler, say = run.args, run.model, run.optimizer, run.scaler, run.say
    K, T, B = run.raw_model.config.n_loop, run.raw_model.config.block_size, args.batch_size
    step, best_val_loss, last_eval_step, record = 0, float('inf'), -1, None
    if run.ckpt is not None:  # where the resumed run stood
        step, best_val_loss = run.ckpt['step'], run.ckpt['best_val_loss']
        last_eval_step, record = run.ckpt['last_eval_step'], run.ckpt.get('record')
        say(f"resuming {args.out_dir} at step {step} (model config from the checkpoint)")
        if step >= args.max_iters:  # nothing left to do
            say(f"{args.out_dir} is finished at step {step}; a larger --max_iters goes on")
            return
    batches = eval_batches(run.splits, args.eval_iters, B, T, run.device)  # the same every time
    tokens = B * run.micro_steps * run.world * T
    progress = Progress(step, tokens, run.raw_model.flops_per_token(), run.device)
    t_start = time.time()  # for the log's elapsed_s (a resumed run's clock starts again)
    losses = []  # the training losses since the last check that they are finite
    with catch_signals(run.world, say) as caught:  # the Ctrl-Cs and SIGTERMs received
        while True:
            # ---- evaluate, save, then log: a diverged run stops first, and is never saved
            if (step % args.eval_interval == 0 or step == args.max_iters) \
                    and step != last_eval_step:
                t_eval = time.time()
                record = eval_record(run.raw_model, step, batches, run.ctx, hooks, args.out_dir)
                record['elapsed_s'] = round(time.time() - t_start, 2)
                best_val_loss = min(best_val_loss, record['val_loss'][K - 1])  # not a save rule
                last_eval_step = step
                if step > 0:  # the checkpoint first: the log never runs ahead of it
                    save(run, step, best_val_loss, last_eval_step, record, run_id)
                if run.rank == 0:
                    log_record(os.path.join(args.out_dir, 'log.jsonl'), record)
                say(eval_line(record, K) + hooks.eval_extra(record))
                progress.leave_out(time.time() - t_eval)  # ms/step and tok/s: training alone
            if step >= args.max_iters:
                break
            # ---- one optimizer step: micro_steps forward/backward passes, clip, AdamW
            for group in optimizer.param_groups:
                group['lr'] = get_lr(args, step)
            drawn = hooks.depth(run.raw_model, args.seed, step)  # None: K (a lab design draws)
            step_loss = step_ce = 0.0
            for micro in range(run.micro_steps):  # windows start anywhere but the last T + 1
                starts = torch.randint(len(run.splits['train']) - T - 1, (B,), generator=run.gen)
                x, y = get_batch(run.splits['train'], starts, T, run.device)
                if run.world > 1:  # all-reduce the gradients after the last micro-step only
                    model.require_backward_grad_sync = micro == run.micro_steps - 1
                with run.ctx:
                    _, loss, stats = model(x, y, n_loop=drawn)
                scaler.scale(loss / run.micro_steps).backward()
                step_loss = step_loss + loss.detach() / run.micro_steps
                step_ce = step_ce + stats['ce'][-1] / run.micro_steps  # at the last exit (K)
            if args.grad_clip > 0:
                scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            scale = scaler.get_scale()  # float16: update() lowers it after a step it skipped
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            # ---- the bookkeeping: processes agree, divergence stops, progress, Ctrl-C saves
            stop = bool(caught)
            if run.world > 1:  # every process the same loss and the same stop, or they hang
                step_loss, step_ce, stop = sync_processes(step_loss, step_ce, stop, run.world)
            losses.append(step_loss)  # a non-finite loss is a divergence, always
            progress.count(step_loss, step_ce, skipped=scaler.get_scale() < scale)  # for the line
            log_step = step % args.log_interval == 0 or step == args.max_iters
            # one host read checks the losses since the last check (torchrun: synced every step)
            if log_step or step % args.eval_interval == 0 or stop or run.world > 1:
                check_finite(losses, step, args.out_dir)
                losses.clear()
            if log_step:
                say(progress.line(step, args.max_iters, stats['hidden_norm'][-1].item(), drawn))
            if stop:
                save(run, step, best_val_loss, last_eval_step, record, run_id)
                say(f"saved {os.path.join(args.out_dir, 'ckpt.pt')} at step {step}; continue "
                    "with the same flags plus --resume", flush=True)
                sys.exit(130)
    say(f"done: {step} steps in {time.time() - t_start:.0f} s; final ||h_K|| "
        f"{record['hidden_norm'][K - 1]:.1f}, val loss {record['val_loss'][K - 1]:.4f}; "
        f"log {os.path.join(args.out_dir, 'log.jsonl')}")


def main(argv=None, parser=None, hooks=None, out_dir_of=None):
    """One run (lab/train.py passes its parser, hooks and run names). A check of what the user gave
    (InputError) prints one line; anything else is a bug, and its traceback shows."""
    parser, hooks = parser or get_parser(), hooks or Hooks()
    # args: every flag, a typed one over --config's value, checked; given: the names typed
    args, given = parser.parse(argv, out_dir_of)
    lock, ok = None, False
    try:
        run = setup(args, given, hooks)
        lock, run_id = begin_log(run)
        train(run, hooks, run_id)
        if run.world > 1:
            check_replicas(run.raw_model, run.world, run.device, run.say)  # rank 0's weights?
        ok = True
    except InputError as e:  # one line on stderr and exit status 1, as the parser's errors
        sys.exit(f"{parser.prog}: error: {e}")
    finally:
        if lock is not None:  # the folder free for the next run
            os.close(lock)
        end_processes(ok)  # torchrun's process group left


if __name__ == '__main__':
    main()
