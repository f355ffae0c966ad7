"""
Runs read back and trained in a list, for plot_norms.py and the lab: a run folder's log.jsonl
read whole or not at all (a one-line LogError), the folders a list of names and quoted globs
means, whether a run is finished, and a list of train.py runs that reuses the finished ones and
resumes the interrupted ones, each a child that is passed a Ctrl-C, so it saves before the list
stops.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time

from data.common import InputError


class LogError(InputError):
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
    # Ctrl-C, and SIGTERM as Ctrl-C, even where we started with SIGINT ignored (a shell script's
    # background job): then, as train.py does, an explicit kill -INT still saves the run
    previous = {s: signal.signal(s, signal.default_int_handler)
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with open(out_path, 'a') as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, process_group=0)
            # a poll and a short sleep, not a blocking wait: a Ctrl-C is passed on within 0.1 s,
            # whichever of the two it interrupts
            while True:
                try:
                    if proc.poll() is not None:
                        break
                    time.sleep(0.1)
                except KeyboardInterrupt:  # a second one is passed on too: train.py's "abort now"
                    interrupted = True
                    proc.send_signal(signal.SIGINT)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
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
