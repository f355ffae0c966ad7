"""
Train a looped transformer LM and log the per-loop hidden-state norms that the paper is about.

The laptop demo (2-core CPU, about 3 minutes each); each run writes its own folder (out/laptop, out/laptop-readout_raw...):
    python train.py --readout=rmsnorm --norm_penalty=0      # the blind spot: ||h_K|| climbs
    python train.py --readout=raw                           # scale visible to the loss: ||h_K|| stays small
    python train.py --norm_penalty=0.01                     # explicit penalty
    python train.py --recurrence=normed                     # inter-loop normalization: an RMSNorm between loops
    python train.py --readout=alpha                         # let cross-entropy choose how much scale to see
A larger character-level model on one GPU (CUDA: bf16, TF32, fused AdamW, torch.compile by default):
    python train.py --config=gpu_char --readout=rmsnorm
Continue an interrupted run (same flags), or extend it:
    python train.py --readout=rmsnorm --resume --max_iters=1200
Several processes (each takes one micro-step per optimizer step unless --grad_accum says otherwise):
    torchrun --standalone --nproc_per_node=2 train.py --device=cpu

Not here: the model (looped.py), the named configurations (lab/configs.py), the run folder's promises (lab/runs.py:
lock, saves, resume, signals), the datasets (data/), a grid of runs and its figures (lab/grid.py, plot_norms.py),
measurements of a trained model (lab/diagnose.py).
"""

import argparse
import math
import sys
import time
from dataclasses import fields

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lab import runs
from lab import configs
from lab.configs import CONFIGS
from lab.report import one_line_errors
from data import DATASETS, find_dataset
from data.common import check_same_data, read_dataset
from lab.runtime import check_replicas, compile_regions, end_distributed, peak_flops, resolve_device, setup_distributed
from looped import LoopedConfig, LoopedGPT, sampled_depth


def str2bool(s):
    """argparse type for booleans: plain type=bool would turn the string 'False' into True."""
    if s.lower() not in ('1', 'true', 'yes', '0', 'false', 'no'):
        raise argparse.ArgumentTypeError(f"expected True/False/1/0, got {s!r}")
    return s.lower() in ('1', 'true', 'yes')


def get_parser():
    p = argparse.ArgumentParser(description='Train a looped transformer LM.',
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    one_line_errors(p, 'train.py')  # one line, not argparse's usage block, which is longer than the screen here
    p.add_argument('--config', default='laptop', choices=CONFIGS, help='named configuration; flags override it')
    # the model: one flag per LoopedConfig field (looped.py declares each one, its choices and its help)
    for f in fields(LoopedConfig):
        if f.name != 'vocab_size':  # set from the dataset
            kind = str2bool if 'bool' in str(f.type) else float if 'float' in str(f.type) else f.type
            p.add_argument(f'--{f.name}', type=kind, default=f.default, choices=f.metadata['choices'],
                           help=f.metadata['help'])
    # optimization: AdamW, constant learning rate, as in the paper
    p.add_argument('--batch_size', type=int, help='sequences per micro-step (per process)')
    p.add_argument('--grad_accum', type=int, default=None,
                   help='micro-steps per optimizer step, counted over all processes (global batch = batch_size * '
                        'grad_accum; under torchrun a multiple of the process count); default: one per process')
    p.add_argument('--max_iters', type=int, help='training steps in all (a resumed run continues to this step)')
    p.add_argument('--epochs', type=float, default=None,
                   help='train for this many epochs instead of --max_iters (an epoch: one pass over the training '
                        'windows of block_size tokens at stride block_size/2, as the authors count it)')
    p.add_argument('--learning_rate', type=float, help='constant (after any warmup); the paper uses 3e-4')
    p.add_argument('--warmup_iters', type=int, default=0,
                   help='raise the learning rate linearly from learning_rate / warmup_iters to learning_rate over the '
                        'first warmup_iters steps; 0: constant from the first step (the paper)')
    p.add_argument('--weight_decay', type=float, default=0.01, help='AdamW decoupled weight decay')
    p.add_argument('--grad_clip', type=float, default=1.0, help='0 disables clipping')
    # evaluation, logging, checkpoints
    p.add_argument('--eval_interval', type=int, help='steps between evaluations (each also saves ckpt.pt)')
    p.add_argument('--eval_iters', type=int, help='validation batches per evaluation')
    p.add_argument('--log_interval', type=int, help='steps between progress lines')
    p.add_argument('--dataset', default='shakespeare_char',
                   help=f"one of {', '.join(DATASETS)} (folders under data/), or a path to a folder with "
                        "train.bin, val.bin and meta.json")
    p.add_argument('--out_dir', default=None, help='default: out/<config> plus each variant flag not at its default: '
                                                   'out/laptop-readout_raw, out/laptop-readout_raw-pen0.01, ...')
    p.add_argument('--resume', type=str2bool, nargs='?', const=True, default=False, help='continue the run in out_dir')
    p.add_argument('--overwrite', type=str2bool, nargs='?', const=True, default=False,
                   help='start afresh even if out_dir already holds a run (its ckpt.pt and log.jsonl are replaced)')
    # system
    p.add_argument('--device', default='auto', help='auto, cpu, cuda, cuda:N or mps')
    p.add_argument('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16'], help='auto: bf16 on CUDA')
    p.add_argument('--compile', type=lambda s: 'auto' if s == 'auto' else str2bool(s), default='auto', help='auto: on for CUDA')
    p.add_argument('--seed', type=int, default=1337, help='initialization, dropout and batch order')
    return p


def parse_args(argv=None):
    """Two passes: the first finds --config, whose values then become the defaults of the second."""
    first = argparse.ArgumentParser(add_help=False)
    for name in ('--config', '--max_iters', '--epochs'):
        first.add_argument(name)
    known, _ = first.parse_known_args(argv)
    parser = get_parser()
    parser.set_defaults(**CONFIGS.get(known.config or 'laptop', {}))  # an unknown name is reported by the full parser
    args = parser.parse_args(argv)
    # steps come from --max_iters or from --epochs; a paper configuration's epochs give way to an explicit --max_iters
    if known.max_iters is not None and known.epochs is not None:
        parser.error("give --max_iters or --epochs, not both")
    if known.epochs is None and known.max_iters is not None:
        args.epochs = None
    if args.resume and args.overwrite:
        parser.error("--resume continues a run and --overwrite replaces it: give one of them")
    finite = lambda v: v is not None and math.isfinite(v)  # nan and inf pass comparisons that were not meant for them
    counts = ('batch_size', 'eval_interval', 'eval_iters', 'log_interval') + (('max_iters',) if args.epochs is None else ())
    for name, ok, want in (*((n, getattr(args, n) >= 1, 'at least 1') for n in counts),
                           ('grad_accum', args.grad_accum is None or args.grad_accum >= 1, 'at least 1'),
                           ('warmup_iters', args.warmup_iters >= 0, 'at least 0 (0: no warmup)'),
                           ('learning_rate', finite(args.learning_rate) and args.learning_rate > 0, 'a finite number > 0'),
                           ('weight_decay', finite(args.weight_decay) and args.weight_decay >= 0, 'a finite number >= 0'),
                           ('grad_clip', finite(args.grad_clip) and args.grad_clip >= 0, 'a finite number >= 0 (0: off)'),
                           ('epochs', args.epochs is None or (finite(args.epochs) and args.epochs > 0), 'finite and > 0'),
                           ('block_size', args.epochs is None or args.block_size >= 2, '>= 2 with --epochs (stride T/2)'),
                           ('seed', 0 <= args.seed < 2 ** 63, 'between 0 and 2**63 - 1')):
        if not ok:
            parser.error(f"--{name}={getattr(args, name)} must be {want}")
    if args.out_dir is None:  # named by the variant flags that differ from their defaults
        args.out_dir = runs.run_name(args.config, vars(args))
    return args


def given_flags(argv=None):
    """The names of the flags typed on the command line (not those from defaults or from --config)."""
    parser, unset = get_parser(), object()
    parser.set_defaults(**{a.dest: unset for a in parser._actions})
    return {name for name, value in vars(parser.parse_args(argv)).items() if value is not unset}


def model_config(args, vocab_size=65):
    """The LoopedConfig that the flags describe (ValueError for invalid combinations)."""
    return LoopedConfig(vocab_size=vocab_size, **{name: getattr(args, name) for name in runs.MODEL_FLAGS})


class Data:
    """train.bin / val.bin as uint16 arrays, random training windows and fixed evaluation windows."""

    def __init__(self, folder, block_size, batch_size, device, seed):
        self.folder, self.T, self.B, self.device = folder, block_size, batch_size, device
        # every check of the files is in read_dataset; identity names this data in the log and the checkpoint
        self.meta, self.splits, self.identity = read_dataset(folder)
        for split, data in self.splits.items():
            if len(data) <= block_size + 1:
                raise ValueError(f"{folder}/{split}.bin has {len(data)} tokens, too few for block_size={block_size}")
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


def setup(args, given):
    """Everything checked before out_dir is touched, so that bad input never harms an earlier run: the device and
    processes, the batch split, the checkpoint to resume (whose model wins over --config), the data."""
    try:
        rt = resolve_device(args.device, args.dtype, args.compile)
    except ValueError as e:
        runs.fail(e)
    rank, world = setup_distributed(rt)
    # Gradient accumulation: with no --grad_accum every process takes one micro-step (global batch = batch_size
    # x processes); an explicit --grad_accum fixes the global batch, split over the processes.
    if args.grad_accum is None:
        micro_steps, global_batch = 1, args.batch_size * world
    elif args.grad_accum % world:
        runs.fail(f"--grad_accum={args.grad_accum} is not a multiple of the {world} processes")
    else:
        micro_steps, global_batch = args.grad_accum // world, args.batch_size * args.grad_accum
    run = runs.Run(args.out_dir)
    try:
        # a resumed run keeps its model and its data (runs.resume), whatever --config and the defaults say
        ckpt, config = run.resume(args, given, rt.device) if args.resume else (None, model_config(args))
        data = Data(find_dataset(args.dataset), config.block_size, args.batch_size, rt.device, args.seed + rank)
        if ckpt is not None:  # the same data it was trained on: checked, never assumed
            check_same_data(ckpt, data.meta, data.identity, run.ckpt_path)
        config.vocab_size = data.meta['vocab_size']
        if args.epochs is not None:
            n, T = len(data.splits['train']), config.block_size
            args.max_iters, windows = configs.steps_from_epochs(args.epochs, n, T, global_batch)
            if rank == 0:
                print(f"{args.epochs:g} epochs x {windows:,} windows ({n:,} tokens in windows of {T} at stride "
                      f"{T // 2}) / {global_batch} per step = {args.max_iters:,} steps")
        run.check(args.resume, args.overwrite)
    except (ValueError, runs.RunError) as e:
        runs.fail(e)
    return rt, rank, world, micro_steps, global_batch, run, ckpt, config, data


def build(args, config, rt, rank, world, ckpt, data, say):
    """The model and its optimizer, fresh or from the checkpoint; compiled and wrapped for DDP as the run asks.
    Returns (model to train, the plain module for checkpoints and evaluation, optimizer, (step, best val loss,
    last evaluated step, last record))."""
    torch.manual_seed(args.seed)
    model = LoopedGPT(config).to(rt.device)
    optimizer = model.configure_optimizers(args.weight_decay, args.learning_rate, rt.device_type)
    state = (0, float('inf'), -1, None)
    if ckpt is not None:
        state = (*runs.restore(ckpt, model, optimizer, data, args, rank, rt.device_type), ckpt.get('record'))
        say(f"resuming {args.out_dir} at step {state[0]} (model config from the checkpoint)")
    raw_model = model  # checkpoints and evaluation use the plain module, never the compiled or DDP wrapper
    if rt.compile:
        compile_regions(model)  # the blocks and the head's loss, not the unrolled loop: any loop count reuses them
    if world > 1:  # gradients are averaged across processes in backward
        model = DDP(model, device_ids=[torch.device(rt.device)] if rt.device_type == 'cuda' else None)
    return model, raw_model, optimizer, state


def main(argv=None):
    args, given = parse_args(argv), given_flags(argv)
    rt, rank, world, micro_steps, global_batch, run, ckpt, config, data = setup(args, given)
    master = rank == 0  # the one process that prints, logs and checkpoints
    say = print if master else (lambda *a, **k: None)
    ddp = f" | data parallel: {world} processes ({dist.get_backend()})" if world > 1 else ''
    say(rt.describe() + (' (auto: on for CUDA only)' if args.compile == 'auto' else '') + ddp)
    model, raw_model, optimizer, state = build(args, config, rt, rank, world, ckpt, data, say)
    say(f"{args.out_dir}: {raw_model.num_params():,} parameters, {config.n_layer} layers x {config.n_loop} loops, "
        f"{runs.condition_name(config.to_dict())}; global batch {global_batch} = {args.batch_size} "
        f"x {micro_steps} micro-steps x {world} processes, {global_batch * config.block_size:,} tokens/step, "
        f"{raw_model.flops_per_token() / 1e6:.1f} MFLOPs/token")
    if world > 1:  # every process has checked out_dir and read its checkpoint before rank 0 writes there
        dist.barrier()
    try:  # the run folder's promises (one run per folder, saves before logs, what a signal does) live in lab/runs.py
        if master:
            header = {'config': {**vars(args), 'model': config.to_dict(), 'num_params': raw_model.num_params()},
                      'data': data.identity}
            note = run.start(args.resume, args.overwrite, ckpt, header)
            if note:
                say(f"{run.log_path}: {note}")
        with runs.Interrupts(world, say) as interrupts:
            if ckpt is not None and ckpt['step'] >= args.max_iters:  # nothing to train; the log was repaired above
                say(f"{args.out_dir} is finished at step {ckpt['step']}; pass a larger --max_iters to continue it")
                return
            train(args, model, raw_model, optimizer, data, run, rt, world, micro_steps, state, interrupts, say)
    except runs.RunError as e:
        runs.fail(e)
    finally:  # the folder free for the next run, and the process group gone
        run.close()
        end_distributed(ok=sys.exc_info()[0] is None)


def eval_record(raw_model, val_batches, train_batches, K, ctx, step, t_start, alpha, run):
    """Evaluate at every depth 1..2K (2K: beyond the trained depth) on the validation batches, and at depth K on
    the training batches: the log's record for this step. A non-finite validation loss stops the run."""
    val_loss, val_norm = evaluate(raw_model, val_batches, 2 * K, ctx)  # every process, in step
    train_loss, _ = evaluate(raw_model, train_batches, K, ctx)
    if not all(map(math.isfinite, val_loss)):
        runs.fail(f"validation loss is {val_loss[K - 1]} at step {step}; {runs.kept(run)}")
    return {'step': step, 'train_loss': train_loss[K - 1], 'val_loss': val_loss, 'hidden_norm': val_norm,
            'elapsed_s': round(time.time() - t_start, 2), **({'alpha': alpha().item()} if alpha else {})}


def optimizer_step(model, optimizer, data, args, micro_steps, world, ctx, n_loop):
    """One optimizer step at n_loop loops: micro_steps forward/backward passes, clip, AdamW. Returns the mean loss
    over the micro-steps (a tensor on the device: reading it would wait for the device) and the last micro-step's
    stats."""
    lossf = 0.0
    for micro in range(micro_steps):
        x, y = data.train_batch()
        if world > 1:  # all-reduce the gradients only after the last micro-step, not after each
            model.require_backward_grad_sync = micro == micro_steps - 1
        with ctx:
            _, loss, stats = model(x, y, n_loop=n_loop)
        (loss / micro_steps).backward()
        lossf = lossf + loss.detach() / micro_steps
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lossf, stats


def check_finite(losses, step, run):
    """Stop on a non-finite training loss, naming its step. losses: the loss tensors of the steps up to `step` since
    the last check, read in one sync (at log and evaluation steps, as nanoGPT reads its loss) instead of each step."""
    values = torch.stack(losses).tolist() if losses else []
    losses.clear()
    for i, v in enumerate(values):
        if not math.isfinite(v):
            runs.fail(f"training loss is {v} at step {step - len(values) + 1 + i}; stopping, {runs.kept(run)} "
                      "(try a lower --learning_rate)")


def train(args, model, raw_model, optimizer, data, run, rt, world, micro_steps, state, interrupts, say):
    """The training loop: evaluate, save and log every eval_interval steps; one optimizer step; progress."""
    step, best_val_loss, last_eval_step, last_record = state
    K, ctx, master = raw_model.config.n_loop, rt.autocast, not dist.is_initialized() or dist.get_rank() == 0
    alpha = raw_model.readout.norm.alpha if raw_model.config.readout == 'alpha' else None  # logged at every evaluation
    val_batches, train_batches = data.fixed_batches('val', args.eval_iters), data.fixed_batches('train', args.eval_iters)
    tokens_per_step = micro_steps * world * args.batch_size * raw_model.config.block_size
    peak, flops_per_token = peak_flops(rt.device), raw_model.flops_per_token()
    save = lambda: run.save(runs.checkpoint_state(raw_model, optimizer, args, step, best_val_loss, last_eval_step,
                                                  last_record, data), step) if master else None
    t_start, step_start, t_last, train_ces, losses = time.time(), step, time.time(), [], []
    while True:
        # ---- evaluate, save, then log (a diverged run stops first: its weights are never saved)
        if (step % args.eval_interval == 0 or step == args.max_iters) and step != last_eval_step:
            check_finite(losses, step, run)
            last_record = eval_record(raw_model, val_batches, train_batches, K, ctx, step, t_start, alpha, run)
            best_val_loss, last_eval_step = min(best_val_loss, last_record['val_loss'][K - 1]), step
            if step > 0:
                save()  # first the checkpoint, then the log: the log never runs ahead of it
            if master:
                run.log(last_record)
            say(runs.eval_line(last_record, K))
        if step >= args.max_iters:
            break
        if args.warmup_iters:  # linear warmup: step i (0-based) trains at (i + 1) / warmup_iters of the rate
            for group in optimizer.param_groups:
                group['lr'] = args.learning_rate * min(1.0, (step + 1) / args.warmup_iters)
        r = sampled_depth(raw_model.config, args.seed, step)  # K, unless the depth is sampled
        lossf, stats = optimizer_step(model, optimizer, data, args, micro_steps, world, ctx, r)
        step += 1

        # ---- agree across processes, stop on divergence, print progress, honour Ctrl-C
        stop = interrupts.requested  # read once: a signal landing after this line is seen at the next step
        if world > 1:  # every process must see the same loss and Ctrl-C at the same step, or some would wait forever
            shared = torch.stack([lossf.float(), torch.tensor(float(stop), device=rt.device)])
            dist.all_reduce(shared)  # a sync every step, which a single process goes without
            lossf, stop = shared[0] / world, shared[1].item() > 0
        losses.append(lossf)
        train_ces.append(stats['ce'][-1])
        log_step = step % args.log_interval == 0 or step == args.max_iters
        if log_step or stop or world > 1:  # the losses are read at log steps (and before a save)
            check_finite(losses, step, run)
        if log_step:
            dt = (time.time() - t_last) / len(train_ces)
            eta = (time.time() - t_start) / (step - step_start) * (args.max_iters - step)
            say(runs.progress_line(step, args.max_iters, train_ces, stats, dt, tokens_per_step, flops_per_token, peak, eta,
                              None if raw_model.config.depth_sampling == 'fixed' else r))
            t_last, train_ces = time.time(), []
        if stop:
            save()
            if world > 1:  # no process exits before the save is done: torchrun kills the rest when one ends
                dist.barrier()
            say(f"saved {run.ckpt_path} at step {step}; continue with the same flags plus --resume", flush=True)
            sys.exit(130)
    check_replicas(raw_model, world, say)
    say(f"done: {step} steps in {runs.fmt_time(time.time() - t_start)}; final ||h_K|| "
        f"{last_record['hidden_norm'][K - 1]:.1f}, val loss {last_record['val_loss'][K - 1]:.4f}; log {run.log_path}")


if __name__ == '__main__':
    main()
