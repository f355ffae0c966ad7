"""Train a looped transformer LM and log the per-loop hidden-state norms that the paper is about.
The laptop demo (2-core CPU: 2-4 minutes a run, 2m09s idle); each run writes its folder in out/:
    python train.py --readout=rmsnorm --norm_penalty=0  # the blind spot: ||h_K|| climbs
    python train.py --readout=raw                       # scale seen by the loss: ||h_K|| small
    python train.py --norm_penalty=0.01                 # explicit penalty
    python train.py --recurrence=normed                 # an RMSNorm between loops
    python train.py --readout=alpha                     # the loss chooses how much scale to see
One GPU (bf16 or float16, torch.compile), continuing a run, a warmup and nanoGPT's cosine, DDP:
    python train.py --config=gpu_char --readout=rmsnorm
    python train.py --readout=rmsnorm --resume --max_iters=1200
    python train.py --decay_lr --warmup_iters=50 --lr_decay_iters=500 --min_lr=3e-4
    torchrun --standalone --nproc_per_node=2 train.py --device=cpu
It trains looped.py's LoopedGPT, or lab/designs.py's extension of it for a design flag (--help's
last group); the run folder (Run), the device (resolve_device), the printed lines (Report): lab/.
"""

import math
import os
import sys
import time
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from data import open_dataset
from lab.configs import CONFIGS, FlagParser, bad_training_flag
from lab.designs import DesignConfig, DesignedGPT, add_design_flags, designs_asked
from lab.report import Report
from lab.runs import Run, run_name
from lab.runtime import resolve_device
from looped import CHOICES, LoopedConfig, LoopedGPT

# ---- flags: the paper's model, then training, evaluation and the system; the designs' last
def fail(message):  # one line on stderr and exit status 1, as the parser's errors
    sys.exit(f"train.py: error: {message}")


def get_parser():
    # argparse's, with errors in one line, nanoGPT's habits answered and True/False flags
    p = FlagParser('train.py', 'Train a looped transformer LM.')
    add, boolean = p.add_argument, p.add_boolean
    add('--config', default='laptop', choices=CONFIGS, help='its values replace the defaults below')
    # the model: looped.py's LoopedConfig, its defaults the laptop run's (2 layers x 128, K = 4)
    add('--block_size', type=int, default=128, help='context length T')
    add('--n_embd', type=int, default=128, help='width d of the residual stream')
    add('--n_head', type=int, default=4, help='attention heads; must divide n_embd')
    add('--n_layer', type=int, default=2, help='layers in the ONE shared stack (not unrolled)')
    add('--n_loop', type=int, default=4, help='K: how many times the stack is applied')
    add('--dropout', type=float, default=0.0, help='the paper: 0.1; tiny runs learn faster without')
    add('--supervision', default='per_loop', choices=('per_loop', 'terminal', 'gated'),
        help="a cross-entropy at every loop, or the last; gated: a design, Ouro's exit gate")
    add('--readout', default='rmsnorm', choices=CHOICES['readout'], help='what the head reads')
    add('--alpha', type=float, help='readout=alpha: unset learns alpha; in [0, 1] fixes it')
    add('--norm_penalty', type=float, default=0.0, help='lambda in lambda * mean_k mean(h_k^2)')
    add('--recurrence', default='residual', choices=('residual', 'normed', 'damped'),
        help='the next loop starts from h_k or RMSNorm(h_k); damped: a design, sigmoid(a) h_k')
    boolean('--tie_weights', None, "the head shares the token embedding's weight; unset: tied, "
            'but untied under the design --init=gpt2')
    add('--norm_eps', type=float, default=1e-6, help="every RMSNorm's epsilon (the authors')")
    # optimization: AdamW, constant learning rate (as in the paper) unless --decay_lr
    add('--batch_size', type=int, default=16, help='sequences per micro-step (per process)')
    add('--grad_accum', type=int, help='micro-steps per optimizer step over all processes (global '
        'batch = batch_size * grad_accum); unset: one per process')
    add('--max_iters', type=int, default=500, help='training steps in all (a resume continues)')
    add('--epochs', type=float, help='epochs instead of --max_iters (one: every window of '
        'block_size tokens at stride block_size/2, as the authors count); unset: max_iters')
    add('--learning_rate', type=float, default=3e-3, help='after any warmup (the paper: 3e-4)')
    add('--warmup_iters', type=int, default=0, help='steps of a linear ramp up to learning_rate')
    boolean('--decay_lr', False, "after the warmup, nanoGPT's cosine decay to min_lr")
    add('--lr_decay_iters', type=int, help='where the cosine reaches min_lr; unset: max_iters')
    add('--min_lr', type=float, help='the rate the cosine ends at; unset: learning_rate / 10')
    add('--weight_decay', type=float, default=0.01, help='AdamW decoupled weight decay')
    add('--grad_clip', type=float, default=1.0, help='0 disables clipping')
    # evaluation, logging, checkpoints
    add('--eval_interval', type=int, default=100, help='steps between evaluations (and saves)')
    add('--eval_iters', type=int, default=8, help='validation batches per evaluation')
    add('--log_interval', type=int, default=20, help='steps between progress lines')
    add('--dataset', default='shakespeare_char', help='shakespeare_char, shakespeare, wikitext103 '
        '(data/), or a folder with train.bin, val.bin and meta.json')
    add('--out_dir', help='unset: out/<config>-<each variant flag off its default>')
    boolean('--resume', False, 'continue the run in out_dir (named by the same flags)')
    boolean('--overwrite', False, 'start afresh even if out_dir already holds a run')
    # system
    add('--device', default='auto', help='auto, cpu, cuda, cuda:N or mps')
    add('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16', 'float16'],
        help='auto: bf16 on a GPU that has it, else float16 (GradScaler); float32 on CPU')
    boolean('--compile', 'auto', 'auto: on for CUDA only; True/False (the flag alone: True)')
    add('--seed', type=int, default=1337, help='initialization, dropout and batch order')
    add_design_flags(p)  # the extension's flags, in a group of their own (lab/designs.py)
    return p


def given_flags(argv=None):
    """The flags typed on the command line: they win over --config, and over a resumed run's."""
    argv = sys.argv[1:] if argv is None else argv
    return {a[2:].split('=', 1)[0] for a in argv if a.startswith('--')}


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser, given = get_parser(), given_flags(argv)
    args = parser.parse_args(argv)
    for name, value in CONFIGS[args.config].items():  # a named config's values, unless typed
        if name not in given:
            setattr(args, name, value)
    if 'max_iters' in given and 'epochs' in given:
        parser.error("give --max_iters or --epochs, not both")
    if 'max_iters' in given:  # a config's epochs give way to a typed --max_iters
        args.epochs = None
    if args.resume and args.overwrite:
        parser.error("--resume continues a run and --overwrite replaces it: give one of them")
    bad = bad_training_flag(args)  # a count below 1, a nan rate, ...
    if bad:
        parser.error(bad)
    if args.out_dir is None:  # named by the variant flags that differ from their defaults
        args.out_dir = run_name(args.config, vars(args))
    return args


def model_config(args, vocab_size=65):
    """The model the flags describe: (its class, its config); ValueError for an invalid config."""
    # the one choice: looped.py's LoopedGPT, or lab/designs.py's extension of it for a design flag
    GPT, Config = (DesignedGPT, DesignConfig) if designs_asked(args) else (LoopedGPT, LoopedConfig)
    values = {f.name: getattr(args, f.name) for f in fields(Config) if f.name != 'vocab_size'}
    if args.tie_weights is None:  # unset: tied as the authors', untied as nanochat's under gpt2
        values['tie_weights'] = args.init != 'gpt2'
    return GPT, Config(vocab_size=vocab_size, **values)


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


@dataclass
class Job:
    """One run: its flags, device, processes, folder, data, model, optimizer and where it stands."""
    args: object           # the flags
    rt: object             # device, dtype, autocast and compile (resolve_device)
    rank: int              # this process; rank 0 alone prints, logs and saves
    say: object            # print on rank 0, nothing on the others
    world: int             # processes
    micro_steps: int       # forward/backward passes per optimizer step, in each process
    global_batch: int      # sequences per optimizer step, over all processes
    run: Run               # the run folder: log, checkpoint, lock (lab/runs.py)
    ckpt: dict | None      # the checkpoint to resume, or None
    config: LoopedConfig
    data: Data
    model: torch.nn.Module = None  # what trains: compiled and wrapped for DDP as asked
    raw_model: LoopedGPT = None  # the plain module, for checkpoints and evaluation
    optimizer: torch.optim.Optimizer = None
    scaler: torch.amp.GradScaler = None  # float16's loss scaling; a pass-through otherwise
    step: int = 0  # where training stands (the four in every checkpoint)
    best_val_loss: float = float('inf')
    last_eval_step: int = -1
    last_record: dict | None = None  # the last evaluation's log record
    fp16_skips: int = 0  # steps the GradScaler skipped (float16 overflow), in this process's run

    def save(self):
        """ckpt.pt: enough to continue exactly and to sample without the data folder."""
        if self.rank == 0:  # the other processes hold the same weights
            rng = {'torch': torch.get_rng_state(), 'batches': self.data.gen.get_state(),
                   'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
            self.run.save({
                'model': self.raw_model.state_dict(), 'optimizer': self.optimizer.state_dict(),
                'scaler': self.scaler.state_dict(), 'config': self.config.to_dict(),
                'args': vars(self.args), 'step': self.step, 'best_val_loss': self.best_val_loss,
                'last_eval_step': self.last_eval_step, 'record': self.last_record,
                'meta': self.data.meta, 'data': self.data.identity, 'rng': rng}, self.step)


def build_model(job, GPT):
    """The model and its optimizer, fresh or from the checkpoint, compiled and wrapped as asked."""
    args, rt, config, ckpt = job.args, job.rt, job.config, job.ckpt
    torch.manual_seed(args.seed)
    model = GPT(config).to(rt.device)
    optimizer = model.configure_optimizers(args.weight_decay, args.learning_rate, rt.device_type)
    # float16's loss scaling, so that small gradients do not flush to 0; else a pass-through
    job.scaler = torch.amp.GradScaler(rt.device_type, enabled=(rt.dtype == 'float16'))
    if ckpt is not None:
        job.step, job.best_val_loss, job.last_eval_step = job.run.restore(
            ckpt, model, optimizer, job.scaler, job.data, args, job.rank, rt.device_type)
        job.last_record = ckpt.get('record')
        job.say(f"resuming {args.out_dir} at step {job.step} (model config from the checkpoint)")
    job.raw_model, job.optimizer = model, optimizer  # never the compiled or DDP wrapper
    if rt.compile:
        rt.compile_regions(model)  # the blocks and the loss, not the loop: any K reuses them
    if job.world > 1:  # gradients averaged in backward; told if a step may leave some without one
        unused = (config.may_leave_parameters_unused() if GPT is DesignedGPT else
                  config.recurrence == 'normed' or config.readout == 'final_norm')
        ids = [torch.device(rt.device)] if rt.device_type == 'cuda' else None
        model = DDP(model, device_ids=ids, find_unused_parameters=unused)
    job.model = model


def setup(args, given):
    """The run's device, processes, folder, data, model and optimizer, all checked before out_dir is
    touched: bad input never harms an earlier run."""
    rt = resolve_device(args.device, args.dtype, args.compile)
    rank, world = 0, 1
    if 'RANK' in os.environ:  # torchrun: one process per GPU (NCCL), or per CPU share (gloo)
        dist.init_process_group(backend='nccl' if rt.device_type == 'cuda' else 'gloo')
        if rt.device_type == 'cuda':
            rt.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(rt.device)
        rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(rt.describe() + (' (auto: on for CUDA only)' if args.compile == 'auto' else '')
        + (f" | data parallel: {world} processes ({dist.get_backend()})" if world > 1 else ''))
    if args.grad_accum is None:  # one micro-step a process; --grad_accum fixes the global batch
        micro_steps, global_batch = 1, args.batch_size * world
    elif args.grad_accum % world:
        fail(f"--grad_accum={args.grad_accum} is not a multiple of the {world} processes")
    else:
        micro_steps, global_batch = args.grad_accum // world, args.batch_size * args.grad_accum
    run = Run(args.out_dir)  # a resumed run keeps its model and data, whatever the flags' defaults
    ckpt = run.resume(args, given, rt.device) if args.resume else None
    data = Data(args.dataset, args.block_size, args.batch_size, rt.device, args.seed + rank)
    run.check_data(ckpt, data)  # a resumed run's: the data it was trained on
    GPT, config = model_config(args, vocab_size=data.meta['vocab_size'])
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
    run.check(args.resume, args.overwrite)
    job = Job(args, rt, rank, say, world, micro_steps, global_batch, run, ckpt, config, data)
    build_model(job, GPT)
    return job


# ---- evaluation
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


def eval_record(job, val_batches, train_batches, progress):
    """The log's record: val loss and ||h_k|| at depths 1..2K, train loss at K; stops on nan/inf."""
    raw_model, K, ctx, step = job.raw_model, job.config.n_loop, job.rt.autocast, job.step
    val_loss, val_norm = evaluate(raw_model, val_batches, 2 * K, ctx)  # every process, in step
    train_loss, _ = evaluate(raw_model, train_batches, K, ctx)
    if not all(map(math.isfinite, val_loss)):
        fail(f"validation loss is {val_loss[K - 1]} at step {step}; {job.run.kept()}")
    record = {'step': step, 'train_loss': train_loss[K - 1], 'val_loss': val_loss,
              'hidden_norm': val_norm, 'elapsed_s': round(time.time() - progress.t_start, 2)}
    record.update(progress.design_values(val_batches[0]))  # the turn; what a design learned
    return record


# ---- a training step, and the loop
def optimizer_step(job, n_loop):
    """micro_steps forward/backward passes, clip, AdamW. Returns the loss and the last exit's
    cross-entropy (unread, on the device), the last stats, and whether float16's scaler skipped."""
    model, optimizer, args, micro_steps = job.model, job.optimizer, job.args, job.micro_steps
    ctx, lossf, cef, scaler = job.rt.autocast, 0.0, 0.0, job.scaler
    for micro in range(micro_steps):
        x, y = job.data.train_batch()
        if job.world > 1:  # all-reduce the gradients only after the last micro-step, not after each
            model.require_backward_grad_sync = micro == micro_steps - 1
        with ctx:
            _, loss, stats = model(x, y, n_loop=n_loop)
        scaler.scale(loss / micro_steps).backward()
        lossf = lossf + loss.detach() / micro_steps
        cef = cef + stats['ce'][-1] / micro_steps  # the last exit's, averaged as the loss is
    if args.grad_clip > 0:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    scale = scaler.get_scale() if scaler.is_enabled() else None
    scaler.step(optimizer)
    scaler.update()  # halves the scale after an overflow, and then the step was skipped
    optimizer.zero_grad(set_to_none=True)
    return lossf, cef, stats, scale is not None and scaler.get_scale() < scale


def check_finite(losses, step, run):
    """Stop at a non-finite loss, naming its step; one sync reads all losses since the last one."""
    values = torch.stack(losses).tolist() if losses else []
    losses.clear()
    for i, v in enumerate(values):
        if not math.isfinite(v):
            fail(f"training loss is {v} at step {step - len(values) + 1 + i}; stopping, "
                 f"{run.kept()} (try a lower --learning_rate)")


def train(job, interrupts):
    """Evaluate, save and log every eval_interval steps, train one step, repeat; Ctrl-C saves."""
    args, run, say, world, K = job.args, job.run, job.say, job.world, job.config.n_loop
    val_batches = job.data.fixed_batches('val', args.eval_iters)
    train_batches = job.data.fixed_batches('train', args.eval_iters)
    progress, losses, last_line = Report(job), [], job.step
    while True:
        # ---- evaluate, save, then log (a diverged run stops first: its weights are never saved)
        at_end = job.step == args.max_iters
        if (job.step % args.eval_interval == 0 or at_end) and job.step != job.last_eval_step:
            t_eval = time.time()
            check_finite(losses, job.step, run)
            record = eval_record(job, val_batches, train_batches, progress)
            job.best_val_loss = min(job.best_val_loss, record['val_loss'][K - 1])
            job.last_eval_step, job.last_record = job.step, record
            if job.step > 0:
                job.save()  # the checkpoint first: the log never runs ahead of it
            if job.rank == 0:
                run.log(record)
            say(progress.eval_line(record))
            progress.t_last += time.time() - t_eval  # ms/step and tok/s: training steps alone
        if job.step >= args.max_iters:
            break
        for group in job.optimizer.param_groups:
            group['lr'] = get_lr(args, job.step)
        # K loops, or the count a design draws for this step (--depth_sampling)
        designed = isinstance(job.raw_model, DesignedGPT)
        n_loop = job.raw_model.sampled_depth(args.seed, job.step) if designed else K
        lossf, cef, stats, skipped = optimizer_step(job, n_loop)
        job.step += 1
        # ---- the bookkeeping: processes agree, divergence stops, progress prints, Ctrl-C saves
        lossf, cef, stop = job.rt.agree(world, lossf, cef, interrupts.requested)  # torchrun's mean
        losses.append(lossf)  # checked finite below: a non-finite loss is a divergence, always
        if skipped:  # float16 gradients overflowed and the scaler caught it: not a divergence
            job.fp16_skips += 1
        else:
            progress.losses.append(lossf)
            progress.ces.append(cef)
        log_step = job.step % args.log_interval == 0 or job.step == args.max_iters
        if log_step or stop or world > 1:  # the losses are read at log steps (and before a save)
            check_finite(losses, job.step, run)
        if log_step:
            say(progress.progress_line(stats, n_loop, job.step - last_line))
            last_line = job.step
        if stop:
            job.save()
            if world > 1:  # no process exits before the save: torchrun kills the rest when one ends
                dist.barrier()
            say(f"saved {run.ckpt_path} at step {job.step}; continue with the same flags plus "
                "--resume", flush=True)
            sys.exit(130)
    job.rt.check_replicas(job.raw_model, world, say)  # DDP's point: one set of weights
    last = job.last_record
    say(f"done: {job.step} steps in {progress.clock()}; final ||h_K|| "
        f"{last['hidden_norm'][K - 1]:.1f}, val loss {last['val_loss'][K - 1]:.4f}; "
        f"log {run.log_path}")


def main(argv=None):
    args, given = parse_args(argv), given_flags(argv)
    try:  # a bad device, config, dataset or run folder: one line (lab/runs.py's RunError too)
        job = setup(args, given)
    except ValueError as e:
        fail(e)
    say, world, config, run = job.say, job.world, job.config, job.run
    model, n_params, B = job.raw_model, job.raw_model.num_params(), job.global_batch
    say(f"{args.out_dir}: {type(model).__name__}, {n_params:,} parameters, {config.n_layer} layers "
        f"x {config.n_loop} loops; global batch {B} = {args.batch_size} x {job.micro_steps} micro-"
        f"steps x {world} processes, {B * config.block_size:,} tokens/step, "
        f"{model.flops_per_token() / 1e6:.1f} MFLOPs/token")
    if world > 1:  # every process has read out_dir and its checkpoint before rank 0 writes there
        dist.barrier()
    try:  # the run folder's promises (one run per folder, saves before logs, signals): lab/runs.py
        if job.rank == 0:
            header = {'config': {**vars(args), 'model': config.to_dict(), 'num_params': n_params},
                      'data': job.data.identity}
            note = run.start(args.resume, args.overwrite, job.ckpt, header)
            if note:
                say(f"{run.log_path}: {note}")
        with run.interrupts(world, say) as interrupts:
            if job.ckpt is not None and job.ckpt['step'] >= args.max_iters:  # nothing left to do
                say(f"{args.out_dir} is finished at step {job.ckpt['step']}; pass a larger "
                    "--max_iters to continue it")
                return
            train(job, interrupts)
    except ValueError as e:  # the run folder's one-line errors (RunError)
        fail(e)
    finally:  # the folder free for the next run, and the process group gone
        run.close()
        job.rt.end_distributed(ok=sys.exc_info()[0] is None)


if __name__ == '__main__':
    main()
