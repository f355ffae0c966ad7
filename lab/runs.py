"""
The run folder: what train.py promises about out_dir, and the only place those promises are kept.

    out_dir/log.jsonl   a header line (the run's id and config), then one JSON record per evaluation
    out_dir/ckpt.pt     the latest checkpoint (weights, optimizer, RNG states, the last record, the run's id)
    out_dir/run.lock    held (flock) by the one train.py working in the folder; it holds that process's pid

The promises:
- One run per folder. A second train.py on a busy folder is refused in one line naming the pid that holds it
  (the OS releases the lock however the holder ends, so a killed run never leaves it behind). A fresh run never
  replaces an old one unless told to (--overwrite), and then clears the old checkpoint before writing anything.
- Never two runs mixed. The header and every checkpoint carry the run's id; a resume into a folder whose log and
  checkpoint disagree is refused.
- The log never runs ahead of the checkpoint. Each evaluation is saved first and logged second; a resume
  repairs the log against the checkpoint (a line cut by a crash is dropped, records past the checkpoint are
  dropped and written again, a record lost between save and log write is restored from the checkpoint).
- Atomic saves. A checkpoint is written beside the old one and renamed over it, so a crash or a full disk
  mid-save leaves the previous checkpoint whole; a failed save is one line and removes its partial file.
- Links are never followed. Every file this module writes is created fresh (exclusively, without following a
  symlink) and renamed into place; a folder whose own files are symlinks is refused.
- A signal (Ctrl-C, SIGTERM) does not kill a run: the current step finishes, a checkpoint is saved, and the
  process exits 130. Under torchrun every process learns of it at the same step (train.py shares the flag in
  its per-step all-reduce), rank 0 saves, and all of them wait for that save before exiting.
"""

import json
import os
import pickle
import shutil
import signal
import tempfile
import time
import warnings
from dataclasses import fields

import torch

from data.common import check_same_data, write_atomically
from lab.configs import LABELS, NAMED, TAGS, variant_fields
from lab.designs import DesignConfig, DesignedGPT

FILES = ('log.jsonl', 'ckpt.pt', 'run.lock')


def load_checkpoint(path, device='cpu'):
    """The checkpoint dict that train.py saved; ValueError with a one-line message when it is missing or
    unreadable (the file itself is never touched). Loaded with weights_only=True: tensors, dicts, lists,
    numbers and strings only, so a checkpoint from someone else can never run code here."""
    if not os.path.exists(path):
        raise ValueError(f"no checkpoint at {path}")
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on the way to its own clear error
            warnings.simplefilter('ignore')
            ckpt = torch.load(path, map_location=device, weights_only=True)
        missing = {'model', 'config', 'step'} - set(ckpt)
    except pickle.UnpicklingError as e:
        if 'GLOBAL ' in str(e) or 'Unsupported global' in str(e):  # names a class: how pickles run code
            raise ValueError(f"checkpoint {path} holds objects other than tensors and plain data; refused, since "
                             "loading it could run code") from None
        raise ValueError(f"checkpoint {path} is unreadable (truncated or corrupt?): UnpicklingError") from None
    except Exception as e:
        raise ValueError(f"checkpoint {path} is unreadable (truncated or corrupt?): {type(e).__name__}") from None
    if missing:
        raise ValueError(f"checkpoint {path} lacks {', '.join(sorted(missing))}; not a looped checkpoint")
    return ckpt


def load_model(path, device='cpu'):
    """(model in eval mode on device, checkpoint dict) from a ckpt.pt or a run folder that holds one.
    ValueError with a one-line message when it is missing or unreadable."""
    path = os.path.join(path, 'ckpt.pt') if os.path.isdir(path) else path
    ckpt = load_checkpoint(path, device)
    try:
        model = DesignedGPT(DesignConfig(**ckpt['config']))
        model.load_state_dict(ckpt['model'])
    except (TypeError, RuntimeError) as e:  # a config with unknown fields, or weights of another shape
        raise ValueError(f"checkpoint {path}: its weights do not fit its own config ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:150]})") from None
    return model.to(device).eval(), ckpt


# ---- names: a run's folder and its condition, both derived from the variant fields (lab/configs.py)

def _value(v):
    return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def name_part(f, value):
    """A variant field's part of a run folder's name: its tag then its value ('pen0.01'); a field
    without a tag is named by its own name ('readout_raw'), so every part says which field it is."""
    return TAGS.get(f.name, f.name + '_') + _value(value)


def label_part(f, value):
    """A variant field's part of a condition's name: its label, a format string of the value
    (' + penalty 0.1'), by default ' + <value>' (or ' + <tag><value>'); some values have a fixed one."""
    if (f.name, value) in NAMED:  # the paper's penalty is '+ penalty' alone, as the grids say
        return NAMED[f.name, value]
    default = ' + ' + TAGS.get(f.name, '') + '{v}'
    return LABELS.get(f.name, default).format(v=_value(value))


def condition_name(cfg):
    """A model's condition from its config as a dict (to_dict(), or the one in a run's log):
    'supervision + readout', then every other variant not at its default ('per_loop + rmsnorm +
    normed'); a field that an older log lacks is at its default."""
    name = f"{cfg['supervision']} + {cfg['readout']}"
    for f in variant_fields():
        value = cfg.get(f.name, f.default)
        if f.name not in ('supervision', 'readout') and value != f.default:
            name += label_part(f, value)
    return name


def run_name(config_name, values):
    """The default out_dir of a run: out/<config>, then the name part of every variant not at its
    default (out/laptop-readout_raw-pen0.01)."""
    parts = [config_name] + [name_part(f, values[f.name]) for f in variant_fields()
                             if values[f.name] != f.default]
    return os.path.join('out', '-'.join(parts))


class RunError(ValueError):
    """A failure of the run's files (a full disk, a folder that is not writable, a log that belongs to another
    run), with a one-line message; train.py exits with it and leaves the last good checkpoint in place."""


def write_failure(e, path):
    """Why a write failed, in words: torch reports a full disk as an opaque RuntimeError, so say so plainly."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        return f"write failed with {free / 2**20:,.0f} MiB free on its disk: check free space"
    except OSError:
        return str(e).strip().splitlines()[-1][:120]


class Run:
    """The files of one run in out_dir, written only by the master process (rank 0)."""

    def __init__(self, out_dir):
        self.dir = out_dir
        self.ckpt_path, self.log_path = os.path.join(out_dir, 'ckpt.pt'), os.path.join(out_dir, 'log.jsonl')
        self.lock = None
        self.run_id = None

    def check(self, resume, overwrite):
        """Before anything is built: refuse, in one line, a folder holding planted links or a run that the
        command would silently replace."""
        for name in FILES + ('ckpt.pt.tmp', 'log.jsonl.tmp'):
            if os.path.islink(os.path.join(self.dir, name)):
                raise RunError(f"{os.path.join(self.dir, name)} is a symbolic link; a run folder's own files must be "
                               "plain files (remove the link, or use another --out_dir)")
        if not resume and not overwrite and self.holds_a_run():
            raise RunError(f"{self.dir} already holds a run; pass --resume to continue it, --overwrite to replace "
                           "it, or another --out_dir")

    def resume_hint(self):
        """Where --resume looked and how to point it elsewhere: a run's folder is named by its flags, so
        `--resume` alone after `--readout=raw` looks in out/laptop, not in out/laptop-readout_raw."""
        parent = os.path.dirname(os.path.normpath(self.dir)) or '.'
        others = sorted(os.path.join(parent, d) for d in os.listdir(parent)
                        if os.path.isfile(os.path.join(parent, d, 'ckpt.pt'))) if os.path.isdir(parent) else []
        found = f"; runs there: {', '.join(others[:4])}{' ...' if len(others) > 4 else ''}" if others else ''
        return (f"--resume looked in {self.dir}, the folder these flags name; give the run's own flags (the "
                f"folder is named by them) or --out_dir=FOLDER{found}")

    def resume(self, args, given, device):
        """The checkpoint for --resume, with args made to describe it: its model wins over --config
        (resumed_flags), and its dataset and seed over the defaults unless --dataset or --seed is typed (the seed
        draws a sampled depth's loop counts, so a resumed run draws the same ones)."""
        if not os.path.lexists(self.ckpt_path):  # a run stopped before its first save has nothing to continue
            why = ("the run there stopped before its first save; run the same command without --resume to start it "
                   "afresh" if os.path.lexists(self.log_path) else "there is no run to continue: " + self.resume_hint())
            raise RunError(f"no checkpoint at {self.ckpt_path}: {why}")
        ckpt = load_checkpoint(self.ckpt_path, device)
        # the schedule too: a resumed run continues its learning rate where it stopped, unless told otherwise
        for name in ('dataset', 'seed', 'learning_rate', 'warmup_iters', 'decay_lr', 'lr_decay_iters', 'min_lr'):
            if name not in given:
                setattr(args, name, ckpt['args'].get(name, getattr(args, name)))
        resumed_flags(ckpt, args, given)
        return ckpt

    def check_data(self, ckpt, data):
        """A resumed run (ckpt not None) continues on the data it was trained on: checked, never assumed."""
        if ckpt is not None:
            check_same_data(ckpt, data.meta, data.identity, self.ckpt_path)

    def restore(self, ckpt, model, optimizer, scaler, data, args, rank, device_type):
        """restore (below): weights, optimizer, GradScaler and RNG states from the checkpoint."""
        return restore(ckpt, model, optimizer, scaler, data, args, rank, device_type)

    def interrupts(self, world, say):
        """Interrupts (below): while active, Ctrl-C and SIGTERM ask for a save at the end of the step."""
        return Interrupts(world, say)

    def kept(self):
        """What is left after a failure: the words for the last good checkpoint, or its absence."""
        return (f"the last good checkpoint in {self.dir} is kept" if os.path.exists(self.ckpt_path)
                else "no checkpoint was saved yet")

    def holds_a_run(self):
        """A checkpoint, or a log with records in it. A log that is only a header belongs to a run stopped before
        its first save (records are logged only after they are saved), so it holds nothing to lose: a fresh run
        replaces it."""
        if os.path.lexists(self.ckpt_path) or not os.path.lexists(self.log_path):
            return os.path.lexists(self.ckpt_path)
        try:
            with open(self.log_path, 'rb') as f:
                return len(f.read().strip().split(b'\n')) > 1
        except OSError:  # unreadable: be safe and call it a run
            return True

    def start(self, resume, overwrite, ckpt, header):
        """Create and lock the folder, prove it writable, then either repair the log of the run being resumed or
        write a fresh run's header. Returns a note for the user ('' if none). RunError in one line otherwise."""
        try:
            os.makedirs(self.dir, exist_ok=True)
            self._lock()
            tempfile.TemporaryFile(dir=self.dir).close()  # writable, before any training
            self.check(resume, overwrite)  # again, under the lock: another run may have started meanwhile
            if resume:
                self.run_id = ckpt.get('run_id')
                return self._repair_log(ckpt)
            # a fresh run: --overwrite clears the old run's files first, so that nothing of it can be resumed
            note = ('the log of a run stopped before its first save was replaced'
                    if not overwrite and os.path.lexists(self.log_path) else '')
            for old in (self.ckpt_path, self.ckpt_path + '.tmp'):
                if os.path.lexists(old):
                    os.remove(old)
            self.run_id = time.strftime('%Y%m%d-%H%M%S-') + os.urandom(3).hex()
            self._write_lines(self.log_path, [json.dumps({'run_id': self.run_id, **header}).encode()])
            return note
        except OSError as e:
            raise RunError(f"cannot write to {self.dir} ({e.strerror}); nothing was trained") from None

    def _lock(self):
        """Hold an exclusive lock on run.lock for the life of this process. Where the OS has no flock
        (Windows) nothing is locked."""
        try:
            import fcntl
        except ImportError:
            return
        path = os.path.join(self.dir, 'run.lock')
        # opened without truncating and without following a link: the holder's pid is read before it is replaced
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, 'O_NOFOLLOW', 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode(errors='replace').strip() or '?'
            os.close(fd)
            raise RunError(f"{self.dir} is in use by another train.py (pid {holder}); wait for it to end or choose "
                           "another --out_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.lock = fd

    def close(self):
        if self.lock is not None:
            os.close(self.lock)  # releases the lock
            self.lock = None

    def _write_lines(self, path, lines):
        """Replace path by these lines, atomically, through a fresh temporary file."""
        write_atomically(path, lambda f: f.write(b''.join(line + b'\n' for line in lines)))

    def log(self, record):
        """One JSON line onto the log (which start() created or checked, so it is a plain file of this run)."""
        try:
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | getattr(os, 'O_NOFOLLOW', 0))
            with os.fdopen(fd, 'a') as f:
                f.write(json.dumps(record) + '\n')
        except OSError as e:
            raise RunError(f"could not write {self.log_path} ({e.strerror})") from None

    def save(self, state, step):
        """Write the checkpoint beside the old one, then rename it over it."""
        try:  # to a file object: a full disk is then an OSError (ENOSPC), not torch's opaque RuntimeError
            write_atomically(self.ckpt_path, lambda f: torch.save({**state, 'run_id': self.run_id}, f))
        except (OSError, RuntimeError) as e:  # write_atomically has removed its partial .tmp
            kept = 'the previous checkpoint is kept' if os.path.exists(self.ckpt_path) else 'no checkpoint was saved before'
            raise RunError(f"could not save {self.ckpt_path} at step {step} ({write_failure(e, self.ckpt_path)}); {kept}") from None

    def _repair_log(self, ckpt):
        """Make log.jsonl agree with the checkpoint a run resumes from: the log must belong to the same run (the
        run id in its header), a line cut by a crash is dropped, so are records past the checkpoint's last
        evaluation (the resumed run writes them again), and the checkpoint's last record is restored if a crash
        came between the save and the log write. Returns a note of what changed ('' if nothing)."""
        try:
            with open(self.log_path, 'rb') as f:
                lines = f.read().split(b'\n')
            cut = lines.pop() != b''  # whatever follows the last newline is a line cut short
            head = json.loads(lines[0])
        except (OSError, ValueError, IndexError) as e:
            raise RunError(f"{self.log_path} has no readable header ({type(e).__name__}); the run cannot be resumed "
                           "into it") from None
        if head.get('run_id') != ckpt.get('run_id'):
            raise RunError(f"{self.log_path} belongs to run {head.get('run_id')}, the checkpoint to run "
                           f"{ckpt.get('run_id')}: the folder mixes two runs; start afresh with --overwrite or use "
                           "another --out_dir")
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
            self._write_lines(self.log_path, kept)
        except OSError as e:
            raise RunError(f"could not repair {self.log_path} ({e.strerror})") from None
        return 'made consistent with the checkpoint: ' + ', '.join(n for n, yes in (('a line cut by a crash removed', cut), (f'{dropped} records past the '
                         'checkpoint dropped', dropped), (f"step {ckpt['last_eval_step']}'s record restored from the "
                         'checkpoint', restored)) if yes)


class Interrupts:
    """While active (a with-block), SIGINT and SIGTERM only set a flag that the training loop reads once per
    step: it saves and exits 130 there. A second Ctrl-C aborts a single process at once; under torchrun it does
    not, because torchrun passes the user's Ctrl-C on to its workers a second time (its own 30 s kill is the
    abort there)."""

    def __init__(self, world, say):
        self.world, self.say, self.received, self.previous = world, say, [], {}

    def __enter__(self):
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):  # the caller's (e.g. pytest's) handlers as they were
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if self.received and signum == signal.SIGINT and self.world == 1:
            raise KeyboardInterrupt
        if not self.received:
            again = ' (Ctrl-C again to abort)' if signum == signal.SIGINT and self.world == 1 else ''
            self.say(f"\n{signal.Signals(signum).name}: saving a checkpoint after this step{again}", flush=True)
        self.received.append(signum)

    @property
    def requested(self):
        return bool(self.received)


# the flags that describe the model, one per DesignConfig field but the vocabulary (which comes from the data): on
# --resume they come from the checkpoint, and one given with another value is an error (a resumed run cannot
# change its model)
MODEL_FLAGS = tuple(f.name for f in fields(DesignConfig) if f.name != 'vocab_size')


def resumed_flags(ckpt, args, given):
    """Make args describe the checkpoint's model, whatever --config says (the other flags, max_iters,
    intervals..., may change): a model flag typed with another value is an error. A field the checkpoint lacks (a
    design's, in a run of looped.py's model; a newer one) is at its default there."""
    saved = {**{f.name: f.default for f in fields(DesignConfig)}, **ckpt['config']}
    for name in sorted(given & set(MODEL_FLAGS)):
        if getattr(args, name) != saved[name]:
            raise ValueError(f"--{name}={getattr(args, name)} differs from the checkpoint's {saved[name]}; "
                             "a resumed run keeps its model (drop the flag, or start a new run elsewhere)")
    for name in MODEL_FLAGS:
        setattr(args, name, saved[name])


def restore(ckpt, model, optimizer, scaler, data, args, rank, device_type):
    """Load weights, optimizer, GradScaler and RNG states from a checkpoint. Returns (step, best val loss, last
    eval step). A scaler saved disabled (not float16) has no state: a float16 resume of it starts a fresh one."""
    # the optimizer's state is matched to the parameters by their order: one saved in another order would land
    # on the wrong parameters, so a model whose parameters are registered in another order is refused
    if list(ckpt['model']) != list(model.state_dict()):
        raise ValueError("the checkpoint's parameters are in another order than this model's, so its optimizer "
                         "state cannot be restored; it was written by an older looped.py: start a new run")
    model.load_state_dict(ckpt['model'])
    optimizer.load_state_dict(ckpt['optimizer'])
    if ckpt.get('scaler') and scaler.is_enabled():
        scaler.load_state_dict(ckpt['scaler'])
    for group in optimizer.param_groups:  # the learning rate is a training flag: the command line wins
        group['lr'] = args.learning_rate
    torch.set_rng_state(ckpt['rng']['torch'].cpu())
    data.gen.set_state(ckpt['rng']['batches'].cpu())
    if rank > 0:  # only rank 0's batch order is saved; the others continue with a fresh, distinct one
        data.gen.manual_seed(args.seed + rank + 1000003 * ckpt['step'])
    if ckpt['rng']['cuda'] is not None and device_type == 'cuda':
        torch.cuda.set_rng_state_all([s.cpu() for s in ckpt['rng']['cuda']])
    return ckpt['step'], ckpt['best_val_loss'], ckpt['last_eval_step']


def fmt_time(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"

