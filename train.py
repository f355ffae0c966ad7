"""Train a looped transformer LM and log the per-loop hidden-state norms that the paper is about.

The laptop demo (2-core CPU, about 3 minutes a run); each run writes its own folder under out/:
    python train.py --readout=rmsnorm --norm_penalty=0  # the blind spot: ||h_K|| climbs
    python train.py --readout=raw                       # scale seen by the loss: ||h_K|| small
    python train.py --norm_penalty=0.01                 # explicit penalty
    python train.py --recurrence=normed                 # an RMSNorm between loops
    python train.py --readout=alpha                     # the loss chooses how much scale to see
One GPU (bf16, or float16 with a GradScaler where bf16 is missing, and torch.compile by default);
continuing or extending a run (same flags); a warmup and nanoGPT's cosine decay; DDP:
    python train.py --config=gpu_char --readout=rmsnorm
    python train.py --readout=rmsnorm --resume --max_iters=1200
    python train.py --decay_lr --warmup_iters=50 --lr_decay_iters=500 --min_lr=3e-4
    torchrun --standalone --nproc_per_node=2 train.py --device=cpu

The laptop run's values are the defaults written below; a named --config replaces some (lab/
configs.py), a flag overrides both. Each lab call names its module: designs (the model), runs (the
run folder: log, checkpoint, resume), runtime (device, dtype, compile, DDP), report (the lines).
"""

import argparse
import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from data import DATASETS, find_dataset
from data.common import check_same_data, read_dataset
from lab import configs, report, runs, runtime  # flags, printed lines, the run folder, the device
# looped.py's model with the field's designs as options: with none on, looped.py's LoopedGPT
from lab.designs import DesignConfig, DesignedGPT, sampled_depth


def get_parser():
    p = argparse.ArgumentParser(description='Train a looped transformer LM.',
                                formatter_class=configs.Help)
    report.one_line_errors(p, 'train.py')  # argparse's usage block is longer than the screen here
    add = p.add_argument
    add('--config', default='laptop', choices=configs.CONFIGS,
        help='named configuration: its values replace the defaults below; flags override both')
    configs.add_model_flags(p)  # the model's shape and variants: DesignConfig's fields and defaults
    # optimization: AdamW, constant learning rate (as in the paper) unless --decay_lr. The defaults
    # here and below are the laptop run's (2 layers x 128 looped 4 times, about 3 minutes on a CPU)
    add('--batch_size', type=int, default=16, help='sequences per micro-step (per process)')
    add('--grad_accum', type=int, default=None, help='micro-steps per optimizer step, counted over '
        'all processes (global batch = batch_size * grad_accum; under torchrun a multiple of the '
        'process count); default: one per process')
    add('--max_iters', type=int, default=500, help='training steps in all (a resumed run '
        'continues to this step)')
    add('--epochs', type=float, default=None, help='train for this many epochs instead of '
        '--max_iters (an epoch: one pass over the training windows of block_size tokens at stride '
        'block_size/2, as the authors count it); unset: --max_iters decides')
    add('--learning_rate', type=float, default=3e-3, help='the rate after any warmup, constant '
        'unless --decay_lr; the paper uses 3e-4 on larger models')
    add('--warmup_iters', type=int, default=0, help='raise the learning rate linearly from '
        'learning_rate / warmup_iters to learning_rate over the first warmup_iters steps; 0: '
        'constant from the first step (the paper)')
    add('--decay_lr', **configs.BOOLEAN, default=False, help="after the warmup, nanoGPT's cosine "
        'decay from learning_rate to min_lr at lr_decay_iters, and min_lr after it')
    add('--lr_decay_iters', type=int, help='where the cosine reaches min_lr; unset: max_iters')
    add('--min_lr', type=float, help='the rate the cosine ends at; unset: learning_rate / 10')
    add('--weight_decay', type=float, default=0.01, help='AdamW decoupled weight decay')
    add('--grad_clip', type=float, default=1.0, help='0 disables clipping')
    # evaluation, logging, checkpoints
    add('--eval_interval', type=int, default=100, help='steps between evaluations (each also '
        'saves ckpt.pt)')
    add('--eval_iters', type=int, default=8, help='validation batches per evaluation')
    add('--log_interval', type=int, default=20, help='steps between progress lines')
    add('--dataset', default='shakespeare_char', help=f"one of {', '.join(DATASETS)} (folders "
        "under data/), or a path to a folder with train.bin, val.bin and meta.json")
    add('--out_dir', default=None, help='default: out/<config> plus each variant flag not at its '
        'default: out/laptop-readout_raw, out/laptop-readout_raw-pen0.01, ...')
    add('--resume', **configs.BOOLEAN, default=False, help='continue the run in out_dir (found by '
        "the same flags as the run's, or named by --out_dir)")
    add('--overwrite', **configs.BOOLEAN, default=False, help='start afresh even if out_dir '
        'already holds a run (its ckpt.pt and log.jsonl are replaced)')
    # system
    add('--device', default='auto', help='auto, cpu, cuda, cuda:N or mps')
    add('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16', 'float16'],
        help='auto: bf16 on a CUDA GPU that has it, float16 with a GradScaler on one that does not '
        '(T4, V100), float32 elsewhere; float16 needs CUDA')
    add('--compile', type=configs.compile_flag, nargs='?', const=True, default='auto',
        help='auto: on for CUDA only; True/False (the flag alone: True)')
    add('--seed', type=int, default=1337, help='initialization, dropout and batch order')
    return p


def parse_args(argv=None):
    """Two passes: the first finds --config, whose values then become the defaults of the second."""
    habit = configs.habit_error(sys.argv[1:] if argv is None else argv)
    if habit:  # a nanoGPT habit gets this repository's way, not argparse's "unrecognized arguments"
        get_parser().error(habit)
    first = argparse.ArgumentParser(add_help=False)
    for name in ('--config', '--max_iters', '--epochs'):
        first.add_argument(name)
    known, _ = first.parse_known_args(argv)
    parser = get_parser()
    # a named configuration's values become the defaults (an unknown name is reported below)
    parser.set_defaults(**configs.CONFIGS.get(known.config or 'laptop', {}))
    args = parser.parse_args(argv)
    # steps come from --max_iters or --epochs; a config's epochs give way to a typed --max_iters
    if known.max_iters is not None and known.epochs is not None:
        parser.error("give --max_iters or --epochs, not both")
    if known.epochs is None and known.max_iters is not None:
        args.epochs = None
    if args.resume and args.overwrite:
        parser.error("--resume continues a run and --overwrite replaces it: give one of them")
    bad = configs.bad_training_flag(args)  # a count below 1, a nan rate, ...
    if bad:
        parser.error(bad)
    if args.out_dir is None:  # named by the variant flags that differ from their defaults
        args.out_dir = runs.run_name(args.config, vars(args))
    return args


def model_config(args, vocab_size=65):
    """The DesignConfig that the flags describe (ValueError for invalid combinations)."""
    return DesignConfig(vocab_size=vocab_size, **{n: getattr(args, n) for n in runs.MODEL_FLAGS})


class Data:
    """train.bin / val.bin as uint16 arrays, random training windows, fixed evaluation windows."""
    def __init__(self, folder, block_size, batch_size, device, seed):
        self.folder, self.T, self.B, self.device = folder, block_size, batch_size, device
        self.meta, self.splits, self.identity = read_dataset(folder)  # checks every file
        for split, data in self.splits.items():
            if len(data) <= block_size + 1:
                raise ValueError(f"{folder}/{split}.bin has {len(data)} tokens, too few for "
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


@dataclass
class Job:
    """One run: what setup() checked, the model that build() made, and where training stands."""
    args: argparse.Namespace
    rt: runtime.Runtime            # device, dtype, autocast and compile (lab/runtime.py)
    rank: int              # this process; rank 0 alone prints, logs and saves
    world: int             # processes
    micro_steps: int       # forward/backward passes per optimizer step, in each process
    global_batch: int      # sequences per optimizer step, over all processes
    run: runs.Run          # the run folder (lab/runs.py)
    ckpt: dict | None      # the checkpoint to resume, or None
    config: DesignConfig
    data: Data
    model: torch.nn.Module = None  # what trains: compiled and wrapped for DDP as asked
    raw_model: DesignedGPT = None  # the plain module, for checkpoints and evaluation
    optimizer: torch.optim.Optimizer = None
    scaler: torch.amp.GradScaler = None  # float16's loss scaling; a pass-through otherwise
    step: int = 0  # where training stands (these four are in every checkpoint)
    best_val_loss: float = float('inf')
    last_eval_step: int = -1
    last_record: dict | None = None  # the last evaluation's log record
    fp16_skips: int = 0  # steps the GradScaler skipped (float16 overflow), in this process's run

    def say(self, *a, **k):
        if self.rank == 0:
            print(*a, **k)

    def save(self):
        # ckpt.pt: weights, optimizer, GradScaler, config, flags, step, last record, data, RNGs
        if self.rank == 0:  # the other processes hold the same weights
            self.run.save(runs.checkpoint_state(
                self.raw_model, self.optimizer, self.scaler, self.args, self.step,
                self.best_val_loss, self.last_eval_step, self.last_record, self.data), self.step)


def setup(args, given):
    """Everything checked before out_dir is touched: bad input never harms an earlier run."""
    try:
        rt = runtime.resolve_device(args.device, args.dtype, args.compile)
    except ValueError as e:
        runs.fail(e)
    rank, world = runtime.setup_distributed(rt)
    # no --grad_accum: one micro-step per process; --grad_accum fixes the global batch instead
    if args.grad_accum is None:
        micro_steps, global_batch = 1, args.batch_size * world
    elif args.grad_accum % world:
        runs.fail(f"--grad_accum={args.grad_accum} is not a multiple of the {world} processes")
    else:
        micro_steps, global_batch = args.grad_accum // world, args.batch_size * args.grad_accum
    run = runs.Run(args.out_dir)
    try:
        # a resumed run keeps its model and its data (runs.resume), whatever the flags default to
        ckpt, config = (run.resume(args, given, rt.device) if args.resume
                        else (None, model_config(args)))
        data = Data(find_dataset(args.dataset), config.block_size, args.batch_size, rt.device,
                    args.seed + rank)
        if ckpt is not None:  # the same data it was trained on: checked, never assumed
            check_same_data(ckpt, data.meta, data.identity, run.ckpt_path)
        config.vocab_size = data.meta['vocab_size']
        if args.epochs is not None:
            n, T = len(data.splits['train']), config.block_size
            args.max_iters, windows = configs.steps_from_epochs(args.epochs, n, T, global_batch)
            if rank == 0:
                print(f"{args.epochs:g} epochs x {windows:,} windows ({n:,} tokens in windows "
                      f"of {T} at stride {T // 2}) / {global_batch} per step = "
                      f"{args.max_iters:,} steps")
        configs.schedule_defaults(args)  # --decay_lr's unset values: max_iters, learning_rate / 10
        run.check(args.resume, args.overwrite)
    except (ValueError, runs.RunError) as e:
        runs.fail(e)
    return Job(args, rt, rank, world, micro_steps, global_batch, run, ckpt, config, data)


def learning_rate(args, step):
    """The rate of optimizer step `step` (0-based): a linear warmup to learning_rate, then constant
    (the paper), or with --decay_lr nanoGPT's cosine from learning_rate at the warmup's end down to
    min_lr at lr_decay_iters, and min_lr after it. It depends on the step alone: a resumed run
    continues the schedule where it stopped."""
    lr, warmup = args.learning_rate, args.warmup_iters
    if step < warmup:
        return lr * ((step + 1) / warmup)  # this repository's ramp, bit for bit as committed runs
    if not args.decay_lr:
        return lr
    if step > args.lr_decay_iters:
        return args.min_lr
    progress = (step - warmup) / (args.lr_decay_iters - warmup)  # 0 after the warmup, 1 at the end
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - args.min_lr)


def build(job):
    """The model and its optimizer, fresh or from the checkpoint, compiled and wrapped as asked."""
    args, rt, ckpt = job.args, job.rt, job.ckpt
    torch.manual_seed(args.seed)
    model = DesignedGPT(job.config).to(rt.device)
    optimizer = model.configure_optimizers(args.weight_decay, args.learning_rate, rt.device_type)
    job.scaler = runtime.grad_scaler(rt)
    if ckpt is not None:
        job.step, job.best_val_loss, job.last_eval_step = runs.restore(
            ckpt, model, optimizer, job.scaler, job.data, args, job.rank, rt.device_type)
        job.last_record = ckpt.get('record')
        job.say(f"resuming {args.out_dir} at step {job.step} (model config from the checkpoint)")
    job.raw_model, job.optimizer = model, optimizer  # never the compiled or DDP wrapper
    if rt.compile:
        runtime.compile_regions(model)  # the blocks and the loss, not the loop: any K reuses them
    if job.world > 1:  # gradients are averaged across processes in backward
        cuda = rt.device_type == 'cuda'
        model = DDP(model, device_ids=[torch.device(rt.device)] if cuda else None,
                    find_unused_parameters=job.config.may_leave_parameters_unused())
    job.model = model


def main(argv=None):
    args, given = parse_args(argv), configs.given_flags(get_parser(), argv)
    job = setup(args, given)
    say, world, config, run = job.say, job.world, job.config, job.run
    ddp = f" | data parallel: {world} processes ({dist.get_backend()})" if world > 1 else ''
    say(job.rt.describe() + (' (auto: on for CUDA only)' if args.compile == 'auto' else '') + ddp)
    build(job)
    n_params = job.raw_model.num_params()
    say(f"{args.out_dir}: {n_params:,} parameters, {config.n_layer} layers x {config.n_loop} "
        f"loops, {runs.condition_name(config.to_dict())}; global batch {job.global_batch} = "
        f"{args.batch_size} x {job.micro_steps} micro-steps x {world} processes, "
        f"{job.global_batch * config.block_size:,} tokens/step, "
        f"{job.raw_model.flops_per_token() / 1e6:.1f} MFLOPs/token")
    if world > 1:  # every process has read out_dir and its checkpoint before rank 0 writes there
        dist.barrier()
    try:  # the run folder's promises (one run per folder, saves before logs, signals): lab/runs.py
        if job.rank == 0:
            header = {'config': {**vars(args), 'model': config.to_dict(), 'num_params': n_params},
                      'data': job.data.identity}
            note = run.start(args.resume, args.overwrite, job.ckpt, header)
            if note:
                say(f"{run.log_path}: {note}")
        with runs.Interrupts(world, say) as interrupts:
            if job.ckpt is not None and job.ckpt['step'] >= args.max_iters:  # nothing left to do
                say(f"{args.out_dir} is finished at step {job.ckpt['step']}; pass a larger "
                    "--max_iters to continue it")
                return
            train(job, interrupts)
    except runs.RunError as e:
        runs.fail(e)
    finally:  # the folder free for the next run, and the process group gone
        run.close()
        runtime.end_distributed(ok=sys.exc_info()[0] is None)


@torch.no_grad()
def evaluate(model, batches, n_loop, ctx):
    """Mean cross-entropy at every exit depth 1..n_loop and mean ||h_k|| at every loop."""
    model.eval()
    ce, norm, n = 0.0, 0.0, 0
    for x, y in batches:
        with ctx:
            _, _, stats = model(x, y, n_loop=n_loop)
        # weighted by batch size: the last batch may be smaller
        ce, norm = ce + len(x) * stats['ce'].float(), norm + len(x) * stats['hidden_norm'].float()
        n = n + len(x)
    model.train()
    return (ce / n).tolist(), (norm / n).tolist()


def eval_record(job, val_batches, train_batches, t_start):
    """The log's record: val loss and ||h_k|| at depths 1..2K, train loss at K; stops on nan/inf."""
    raw_model, K, ctx, step = job.raw_model, job.config.n_loop, job.rt.autocast, job.step
    val_loss, val_norm = evaluate(raw_model, val_batches, 2 * K, ctx)  # every process, in step
    train_loss, _ = evaluate(raw_model, train_batches, K, ctx)
    if not all(map(math.isfinite, val_loss)):
        runs.fail(f"validation loss is {val_loss[K - 1]} at step {step}; {runs.kept(job.run)}")
    record = {'step': step, 'train_loss': train_loss[K - 1], 'val_loss': val_loss,
              'hidden_norm': val_norm, 'elapsed_s': round(time.time() - t_start, 2)}
    record.update(report.design_values(raw_model, val_batches[0], ctx))
    return record


def optimizer_step(job, n_loop):
    """micro_steps forward/backward passes, clip, AdamW, through the GradScaler (a pass-through but
    under float16, where reading its scale syncs with the GPU). Returns the loss and the last exit's
    cross-entropy unread on the device, the last pass's stats, and whether the scaler skipped the
    step (float16 gradients that overflowed: the weights were not changed)."""
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
            runs.fail(f"training loss is {v} at step {step - len(values) + 1 + i}; stopping, "
                      f"{runs.kept(run)} (try a lower --learning_rate)")


def agree(job, lossf, cef, stop):
    """Under torchrun every process must see the same loss and stop at the same step, or they hang:
    one all-reduce a step, which a single process goes without. Returns (loss, ce_K, stop)."""
    if job.world == 1:
        return lossf, cef, stop
    flag = torch.tensor(float(stop), device=lossf.device)
    shared = torch.stack([lossf.float(), cef.float(), flag])
    dist.all_reduce(shared)
    return shared[0] / job.world, shared[1] / job.world, shared[2].item() > 0


def exit_interrupted(job):
    """After Ctrl-C's save: no process exits before it (torchrun kills the rest when one ends)."""
    if job.world > 1:
        dist.barrier()
    job.say(f"saved {job.run.ckpt_path} at step {job.step}; continue with the same flags plus "
            "--resume", flush=True)
    sys.exit(130)


def train(job, interrupts):
    """Evaluate, save and log every eval_interval steps, train one step, repeat; Ctrl-C saves."""
    args, run, say, world, K = job.args, job.run, job.say, job.world, job.config.n_loop
    val_batches = job.data.fixed_batches('val', args.eval_iters)
    train_batches = job.data.fixed_batches('train', args.eval_iters)
    progress, losses, last_line = report.Report(job), [], job.step
    while True:
        # ---- evaluate, save, then log (a diverged run stops first: its weights are never saved)
        at_end = job.step == args.max_iters
        if (job.step % args.eval_interval == 0 or at_end) and job.step != job.last_eval_step:
            t_eval = time.time()
            check_finite(losses, job.step, run)
            record = eval_record(job, val_batches, train_batches, progress.t_start)
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
            group['lr'] = learning_rate(args, job.step)
        n_loop = sampled_depth(job.config, args.seed, job.step)  # K, unless --depth_sampling
        lossf, cef, stats, skipped = optimizer_step(job, n_loop)
        job.step += 1
        # ---- the bookkeeping: processes agree, divergence stops, progress prints, Ctrl-C saves
        lossf, cef, stop = agree(job, lossf, cef, interrupts.requested)  # the flag read once
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
            exit_interrupted(job)
    runtime.check_replicas(job.raw_model, world, say)
    say(f"done: {job.step} steps in {runs.fmt_time(time.time() - progress.t_start)}; final ||h_K|| "
        f"{job.last_record['hidden_norm'][K - 1]:.1f}, val loss "
        f"{job.last_record['val_loss'][K - 1]:.4f}; log {run.log_path}")


if __name__ == '__main__':
    main()
