"""
Fault injection for train.py: kill -9 at random moments, and Ctrl-C / SIGTERM under torchrun at random moments.
tests/test_faults.py runs a few of each in CI; the README's reliability numbers come from the long loop:

    python tests/faults.py --kills=50 --interrupts=20

The kill loop: one run with an evaluation at every step is killed (SIGKILL) again and again, each time at a
moment it reports (the folder's lock taken, or a randomly chosen step logged, so that a loaded machine moves the
kill with the run instead of letting the run finish first), and each time resumed, as a user would (--resume when
there is a checkpoint, --overwrite when the run died before its first save); its final log must equal an
uninterrupted run's record for record (elapsed_s aside), with no evaluation lost or written twice, and the log
and checkpoint must belong to one run. The interrupt loop: a 2-process gloo torchrun is sent Ctrl-C (SIGINT to
its whole process group, as a terminal does) or SIGTERM (to torchrun alone, as a cluster scheduler does) at a
random moment during training; every try must end with both processes stopped at one step and that step's
checkpoint saved.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere: the repository's modules come first

# a model small enough that 60 steps with an evaluation each take about a second
TINY = ['--device=cpu', '--n_layer=1', '--n_embd=16', '--n_head=2', '--n_loop=2', '--block_size=16',
        '--batch_size=4', '--eval_iters=1', '--log_interval=1000']


def make_dataset(folder):
    """A small char dataset (no download): the kill loop needs many starts, not much text."""
    from data.shakespeare_char import prepare
    lines = ["First Citizen:\nBefore we proceed any further, hear me speak.\n", "All:\nSpeak, speak.\n",
             "ROMEO:\nBut, soft! what light through yonder window breaks?\n"]
    prepare.prepare(''.join(lines[i % 3] for i in range(300)), folder)
    return folder


def train_cmd(data, out_dir, *flags):
    return [sys.executable, os.path.join(ROOT, 'train.py'), f'--dataset={data}', f'--out_dir={out_dir}', *TINY, *flags]


def read_log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def comparable(log):
    """A log without what legitimately differs between two runs of one command: timings and the run id, and
    the --resume/--overwrite flags a restart adds."""
    head = {k: v for k, v in log[0]['config'].items() if k not in ('resume', 'overwrite', 'out_dir')}
    return head, [{k: v for k, v in r.items() if k != 'elapsed_s'} for r in log[1:]]


def logged_step(out_dir):
    """The step of the last record in out_dir's log.jsonl, -1 if it has none; a line still being written is not
    read (what follows the last newline)."""
    try:
        with open(os.path.join(out_dir, 'log.jsonl'), 'rb') as f:
            lines = f.read().split(b'\n')
        return json.loads(lines[-2]).get('step', -1) if len(lines) > 1 else -1  # the header has no step
    except (OSError, ValueError):
        return -1


def holds_lock(out_dir, pid):
    """Whether process pid holds out_dir's run.lock (it writes its pid there once it has the lock)."""
    try:
        with open(os.path.join(out_dir, 'run.lock')) as f:
            return f.read().strip() == str(pid)
    except OSError:
        return False


def wait_until(proc, reached, poll=0.005, patience=600):
    """Poll reached() until it is true (True) or proc has ended (False). patience is no moment of the test, only
    how long a run that reports nothing may hang before the loop gives up."""
    deadline = time.time() + patience
    while proc.poll() is None:
        if reached():
            return True
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"a run reported nothing for {patience} s")
        time.sleep(poll)
    return False


# each start is killed at most STEPS_PER_KILL steps past the last step logged before it, and never later than
# MARGIN steps before the end: the run must still be alive when the kill follows the moment, however fast it runs
STEPS_PER_KILL, MARGIN = 6, 5


def kill_loop(n_kills, data, work, max_iters=None, rng=None, say=print):
    """n_kills SIGKILLs of one run (each followed by a restart), then the run is finished. Returns a dict of
    counts: kills, lost and duplicated records, mixed runs, and whether the log equals the reference run's."""
    import torch
    rng = rng or random.Random(0)
    max_iters = max_iters or 20 * n_kills + 20  # long enough that the kills, not the run, end first
    flags = [f'--max_iters={max_iters}', '--eval_interval=1']
    ref, out = os.path.join(work, 'reference'), os.path.join(work, 'killed')
    subprocess.run(train_cmd(data, ref, *flags), check=True, capture_output=True)
    kills = 0
    while True:
        restart = ['--resume'] if os.path.exists(os.path.join(out, 'ckpt.pt')) else \
            ['--overwrite'] if os.path.exists(os.path.join(out, 'log.jsonl')) else []
        done = logged_step(out)  # the restart logs only later steps (the log never runs ahead of the checkpoint)
        proc = subprocess.Popen(train_cmd(data, out, *flags, *restart), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        if kills < n_kills:
            # The moment is one the run reports, never a time: a clock calibrated on an idle machine let a loaded
            # one finish before its kill. s == done: once the run holds the folder's lock (its checkpoint loaded,
            # the log's repair or a fresh header next); s > done: once step s is logged (step s + 1 next). The
            # kill lands a poll or so later, wherever the run has got to by then.
            s = rng.randint(done, max(done, min(done + STEPS_PER_KILL, max_iters - MARGIN)))
            reached = (lambda: holds_lock(out, proc.pid)) if s == done else (lambda: logged_step(out) >= s)
            if wait_until(proc, reached):
                proc.kill()
                kills += 1
        text = proc.communicate()[0].decode()
        if proc.returncode == 0:
            break
        if proc.returncode != -signal.SIGKILL:
            raise AssertionError(f"a restart failed (rc {proc.returncode}): {text.strip().splitlines()[-1:]}")
        if kills % 10 == 0 and kills:
            say(f"  {kills}/{n_kills} kills")
    want, got = comparable(read_log(ref)), comparable(read_log(out))
    steps = [r['step'] for r in got[1]]
    ckpt = torch.load(os.path.join(out, 'ckpt.pt'), weights_only=True)
    return {'kills': kills, 'lost': len(set(range(max_iters + 1)) - set(steps)),
            'duplicated': len(steps) - len(set(steps)),
            'mixed': int(ckpt['run_id'] != read_log(out)[0]['run_id'] or want[0] != got[0]),
            'identical': want == got}


def interrupt_once(data, out_dir, rng, how):
    """Start a 2-process torchrun, wait until it trains, then interrupt it at a random moment: 'sigint' to the
    whole process group (a terminal's Ctrl-C) or 'sigterm' to torchrun alone. Returns (saved, seconds to stop,
    note): saved means every process stopped and the checkpoint holds the step rank 0 reported."""
    import torch
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
           *train_cmd(data, out_dir, '--max_iters=1000000', '--eval_interval=50')[1:]]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    log = os.path.join(out_dir, 'log.jsonl')
    deadline = time.time() + 120
    while not (os.path.exists(log) and len(open(log).readlines()) >= 2):  # the step-0 evaluation is logged
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            return False, 0.0, f"torchrun did not start training: {proc.communicate()[0].decode()[-300:]}"
        time.sleep(0.05)
    time.sleep(rng.uniform(0, 1.5))
    t0 = time.time()
    if how == 'sigint':
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        text = proc.communicate(timeout=90)[0].decode()
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return False, 90.0, 'still running 90 s after the signal'
    took = time.time() - t0
    said = [line for line in text.splitlines() if line.startswith('saved ')]
    if not said or not os.path.exists(os.path.join(out_dir, 'ckpt.pt')):
        return False, took, f"no save: {text.strip().splitlines()[-3:]}"
    step = int(said[0].split(' at step ')[1].split(';')[0])
    ckpt = torch.load(os.path.join(out_dir, 'ckpt.pt'), weights_only=True)
    return ckpt['step'] == step, took, f"step {step}"


def interrupt_loop(n, data, work, rng=None, say=print):
    rng = rng or random.Random(0)
    saved, times = 0, []
    for i in range(n):
        how = 'sigint' if i % 2 == 0 else 'sigterm'
        ok, took, note = interrupt_once(data, os.path.join(work, f'interrupt{i}'), rng, how)
        saved, times = saved + ok, times + [took]
        say(f"  try {i + 1}/{n} ({how}): {'saved' if ok else 'NOT SAVED'}, {note}, stopped in {took:.1f} s")
    return {'tries': n, 'saved': saved, 'max_stop_s': max(times)}


def get_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--kills', type=int, default=50, help='kill -9s in the kill loop (0: skip it)')
    p.add_argument('--interrupts', type=int, default=20, help='torchrun interrupts (0: skip them)')
    p.add_argument('--seed', type=int, default=0, help='the random moments')
    return p


def main():
    args = get_parser().parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as work:
        data = make_dataset(os.path.join(work, 'data'))
        if args.kills:
            t0 = time.time()
            r = kill_loop(args.kills, data, work, rng=rng)
            print(f"kill loop: {r['kills']} kill -9s, {r['lost']} records lost, {r['duplicated']} duplicated, "
                  f"{r['mixed']} mixed runs, log identical to the uninterrupted run's: {r['identical']} "
                  f"({time.time() - t0:.0f} s)")
        if args.interrupts:
            t0 = time.time()
            r = interrupt_loop(args.interrupts, data, work, rng=rng)
            print(f"torchrun interrupts: {r['saved']}/{r['tries']} saved, slowest stop {r['max_stop_s']:.1f} s "
                  f"({time.time() - t0:.0f} s)")


if __name__ == '__main__':
    main()
