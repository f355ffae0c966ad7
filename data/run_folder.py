"""
A run's folder, out_dir, as train.py writes it: ckpt.pt (the weights, the optimizer and where
training stands) and log.jsonl (a header line, then one record per evaluation).

Every function here keeps one promise: a crash, a full disk, a planted link or a command that
names the wrong folder never harms a run already there. The checkpoint is written beside the old
one and renamed over it; the log is appended to without following a link; a folder that holds a
run is refused unless the command says --resume or --overwrite; a resumed run's log is made to
agree with its checkpoint. A checkpoint is read with weights_only=True, so it can never run code.
"""

import json
import os
import time

import torch

from data.common import write_atomically

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

