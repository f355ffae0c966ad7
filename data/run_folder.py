"""
A run's folder, out_dir, as train.py writes it: ckpt.pt (the weights, the optimizer and where
training stands) and log.jsonl (a header line, then one record per evaluation).

Every function here keeps one promise: a crash, a full disk, a planted link or a command that
names the wrong folder never harms a run already there. The checkpoint is written beside the old
one and renamed over it; the log is appended to without following a link; a folder that holds a
run is refused unless the command says --resume or --overwrite; a resumed run's log is made to
agree with its checkpoint. A checkpoint is read with weights_only=True, so it can never run code.
A log is read back (read_log, for the figures) whole or not at all, in a one-line LogError. A list
of runs (train_runs: plot_norms.py --run) reuses the finished ones and resumes the interrupted
ones, each trained as a child that is passed a Ctrl-C, so it saves before the list stops.
"""

import glob
import json
import math
import os
import signal
import subprocess
import sys
import time

import torch

from data.common import write_atomically
from data.flags import LAB

FILES = ('log.jsonl', 'ckpt.pt', 'log.jsonl.tmp', 'ckpt.pt.tmp')


def check_folder(out_dir, resume, overwrite):
    """Before anything is built: refuse a planted link, or a run the command would replace."""
    for name in FILES:
        if os.path.islink(os.path.join(out_dir, name)):
            raise ValueError(f"{os.path.join(out_dir, name)} is a symbolic link; a run folder's "
                             "own files must be plain files (remove the link, or use another "
                             "--out_dir)")
    ckpt, log = os.path.join(out_dir, 'ckpt.pt'), os.path.join(out_dir, 'log.jsonl')
    has_records = os.path.exists(log) and len(open(log, 'rb').read().strip().split(b'\n')) > 1
    if not resume and not overwrite and (os.path.exists(ckpt) or has_records):
        raise ValueError(f"{out_dir} already holds a run; pass --resume to continue it, "
                         "--overwrite to replace it, or another --out_dir")


def load_checkpoint(path, device='cpu'):
    """The checkpoint dict train.py saved, read with weights_only=True (tensors and plain data
    only: a checkpoint from someone else can never run code here); ValueError in one line."""
    if not os.path.exists(path):
        raise ValueError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # a pickle that names a class is how a checkpoint would run code
        if 'GLOBAL ' in str(e) or 'Unsupported global' in str(e):
            raise ValueError(f"checkpoint {path} holds objects other than tensors and plain data; "
                             "refused, since loading it could run code") from None
        raise ValueError(f"checkpoint {path} is unreadable (truncated or corrupt?): "
                         f"{type(e).__name__}") from None
    missing = {'model', 'config', 'step'} - set(ckpt)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {', '.join(sorted(missing))}; not a looped "
                         "checkpoint")
    return ckpt


def resume_checkpoint(out_dir, device):
    """The checkpoint --resume continues; a ValueError that says where to look if there is none."""
    path = os.path.join(out_dir, 'ckpt.pt')
    if os.path.exists(path):
        return load_checkpoint(path, device)
    if os.path.exists(os.path.join(out_dir, 'log.jsonl')):
        raise ValueError(f"no checkpoint at {path}: the run there stopped before its first save; "
                         "run the same command without --resume to start it afresh")
    parent = os.path.dirname(os.path.normpath(out_dir)) or '.'  # runs named by their flags
    runs = sorted(os.path.join(parent, d) for d in os.listdir(parent) if os.path.isfile(
        os.path.join(parent, d, 'ckpt.pt'))) if os.path.isdir(parent) else []
    raise ValueError(f"no checkpoint at {path}: --resume looked in {out_dir}, the folder these "
                     "flags name; give the run's own flags or --out_dir=FOLDER"
                     + (f"; runs there: {', '.join(runs[:4])}" if runs else ''))


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


def restore(ckpt, model, optimizer, scaler, gen, device):
    """Weights, optimizer, scaler and random states from a checkpoint; where training stands:
    (step, best validation loss, last evaluated step, last log record)."""
    if list(ckpt['model']) != list(model.state_dict()):  # the optimizer state goes by order
        raise ValueError("the checkpoint's parameters are in another order than this model's, so "
                         "its optimizer state cannot be restored; start a new run")
    model.load_state_dict(ckpt['model'])
    optimizer.load_state_dict(ckpt['optimizer'])
    if ckpt.get('scaler') and scaler.is_enabled():
        scaler.load_state_dict(ckpt['scaler'])
    torch.set_rng_state(ckpt['rng']['torch'].cpu())
    gen.set_state(ckpt['rng']['batches'].cpu())
    if ckpt['rng']['cuda'] is not None and device.startswith('cuda'):
        torch.cuda.set_rng_state_all([s.cpu() for s in ckpt['rng']['cuda']])
    return ckpt['step'], ckpt['best_val_loss'], ckpt['last_eval_step'], ckpt.get('record')


def kept(out_dir):  # what a failure leaves behind, in words
    return (f"the last good checkpoint in {out_dir} is kept" if
            os.path.exists(os.path.join(out_dir, 'ckpt.pt')) else "no checkpoint was saved yet")


def check_finite(losses, step, out_dir):
    """Stop at a non-finite training loss, naming its step: one sync reads every loss since the
    last check (a divergence is never saved)."""
    values = torch.stack(losses).tolist() if losses else []
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise ValueError(f"training loss is {v} at step {step - len(values) + 1 + i}; "
                             f"stopping, {kept(out_dir)} (try a lower --learning_rate)")
    losses.clear()


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
        raise ValueError(f"{path} is not readable as a log ({type(e).__name__}); the run cannot "
                         "be resumed into it") from None
    if records[0].get('run_id') != ckpt.get('run_id'):
        raise ValueError(f"{path} belongs to run {records[0].get('run_id')}, the checkpoint to run "
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
        raise ValueError(f"could not save {path} at step {step} ({why}); {kept}") from None


def log_record(path, record):  # appended, never through a link planted since the log was written
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | getattr(os, 'O_NOFOLLOW', 0))
    with os.fdopen(fd, 'a') as f:
        f.write(json.dumps(record) + '\n')



class LogError(ValueError):
    """A run folder that cannot be read back; the message names the folder."""


def read_log(folder):
    """(header config, evaluation records, K) of folder/log.jsonl, else a one-line LogError."""
    path = os.path.join(folder, 'log.jsonl')
    if not os.path.isfile(path):
        raise LogError(f"{folder}: no log.jsonl (not a train.py run folder?)")
    try:
        with open(path) as f:
            text = f.read()
        # a run still training may be halfway through a line: read up to its last whole one
        lines = [json.loads(s) for s in text[:text.rfind('\n') + 1].splitlines() if s.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LogError(f"{folder}: log.jsonl is not valid JSON lines ({e})") from None
    if not lines:
        raise LogError(f"{folder}: log.jsonl is empty")
    config, records = lines[0].get('config', {}), lines[1:]
    K = config.get('model', {}).get('n_loop')
    need = {'step', 'train_loss', 'val_loss', 'hidden_norm', 'elapsed_s'}
    if K is None or not all(need <= set(r) and len(r['val_loss']) == len(r['hidden_norm']) == 2 * K
                            for r in records):  # every record holds depths 1..2K
        raise LogError(f"{folder}: log.jsonl is in an older or unknown format; "
                       "rerun it with this train.py")
    if not records:
        raise LogError(f"{folder}: log.jsonl has no evaluation yet")
    return config, records, K


def run_folders(patterns, folders=()):
    """folders, then the folders the patterns name (quoted globs are expanded here, the same on
    every shell), each once; LogError for a pattern that matches nothing."""
    folders = list(folders)
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise LogError(f"{pattern}: matches no folder")
        folders += [m for m in matches if m not in folders]
    return folders


def finished(folder, max_iters=None):
    """Whether the run in folder reached step max_iters (None: its own max_iters, from its log);
    a folder with no readable log holds no finished run."""
    try:
        config, records, _ = read_log(folder)
    except LogError:
        return False
    goal = config.get('max_iters') if max_iters is None else max_iters
    return goal is not None and records[-1]['step'] >= goal


def train_child(cmd, out_path):
    """Run one train.py to its end, its output appended to out_path: (exit code, whether a Ctrl-C
    came, its last line). It runs in a process group of its own, so a terminal's Ctrl-C reaches
    only us: we pass it (or SIGTERM) on, the run saves and exits, and we wait for the save. Its
    output goes to a file, not a pipe: reading a busy pipe runs no signal handler until it ends."""
    start, interrupted = os.path.getsize(out_path) if os.path.exists(out_path) else 0, False
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM: as Ctrl-C
    try:
        with open(out_path, 'a') as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, process_group=0)
            while proc.poll() is None:
                try:  # a short sleep, not a blocking wait: a Ctrl-C is handled within 0.1 s
                    time.sleep(0.1)
                except KeyboardInterrupt:  # a second one is passed on too: train.py's "abort now"
                    interrupted = True
                    proc.send_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
    with open(out_path) as f:
        lines = f.read()[start:].strip().splitlines() or ['no output']
    return proc.returncode, interrupted, lines[-1]


def train_runs(jobs, prog):
    """Train each job (label, folder, train.py command) in turn, each run in its own folder: a
    finished run (at the command's last --max_iters, as train.py reads it) is reused and an
    interrupted one resumed, so the same command goes on after a Ctrl-C, which stops here in one
    line once the running child has saved. Returns the folders."""
    trained, train_s, t0 = 0, 0.0, time.time()
    for i, (label, folder, cmd) in enumerate(jobs):
        steps = [int(a.split('=')[1]) for a in cmd if a.startswith('--max_iters=')]
        if finished(folder, steps[-1] if steps else None):  # asking for more steps resumes it
            print(f"[{i + 1}/{len(jobs)}] {folder}: finished earlier, reused")
            continue
        resume = os.path.exists(os.path.join(folder, 'ckpt.pt'))
        if resume or os.path.exists(os.path.join(folder, 'log.jsonl')):  # a log, no checkpoint:
            cmd = cmd + ['--resume' if resume else '--overwrite']  # stopped before its first save
        # the ETA from runs trained here (a reused one took no time and would make it 0)
        eta = f", ETA {train_s / trained * (len(jobs) - i) / 60:.0f} min" if trained else ''
        print(f"[{i + 1}/{len(jobs)}] {folder}: training ({'resumed' if resume else 'new'}{eta})",
              flush=True)
        os.makedirs(folder, exist_ok=True)
        started = time.time()
        code, interrupted, last = train_child(cmd, os.path.join(folder, 'train.out'))
        trained, train_s = trained + 1, train_s + time.time() - started
        last = last.split('; continue with')[0]  # train.py's advice is for one run, not a grid
        if interrupted:
            print(f"{prog}: interrupted during {label}: {last}; rerun the same command to "
                  "continue the grid", file=sys.stderr)
            sys.exit(130)
        if code != 0:
            sys.exit(f"{prog}: error: the run for {label} failed: {last}")
    print(f"grid done in {(time.time() - t0) / 60:.1f} min")
    return [folder for _, folder, _ in jobs]
