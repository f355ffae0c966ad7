"""
Grids of conditions: what each condition is, training every one for every seed, reading the runs back.

    python -m lab.paper --run                                 # the paper's ten conditions, figures and tables
    python -m lab.paper --run --config=laptop_long --seeds=8 --conditions=per_loop-rmsnorm,per_loop-alpha
    python -m lab.atlas                                           # the field's designs (grid 'atlas'), then its table

What is here: the named grids (GRIDS: 'paper', plot_norms.py's ten conditions, CONDITIONS; 'claim4' and
'readouts', parts of it;
'atlas', every design of DESIGNS under rmsnorm and raw, each with its prediction written before its runs; 'gate',
the learned exit gate beside per-loop supervision), each a fixed list of {condition name: train.py flags}, so that
declaring a design in looped.py changes none of them; the grid each configuration runs by default; one folder per
run, reuse and resume (rerunning the command never redoes finished work or loses an interrupted run), the child
train.py with Ctrl-C passed on to it (the child saves a checkpoint, the grid waits for that save, says where it
stopped in one line and exits 130; the same command continues), and reading a run's log back (load_run, group_runs: the
runs of one condition together, in the grids' order), which the grid needs to tell a finished run from an interrupted
one. A condition's name comes from its model config (lab.runs.condition_name), so a run made by hand is named the same
way; it is reused by a grid only from the grid's own folder, with the grid's flags (seed 1.., GRID_FLAGS).

Not here: the flags (lab/paper.py and lab/atlas.py parse --run, --seeds, --conditions, --train_args and pass them
on), the figures and tables (plot_norms.py, lab/paper.py, lab/atlas.py), the paired statistics (lab/stats.py). The
paper's grid is plot_norms.py's and the log reader plumbing/logs.py's (the handout stands alone; the lab builds on
it): load_run adds to its read the lab's condition names and the defaults of flags newer than a log.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import namedtuple
from dataclasses import fields

from lab.runs import condition_name
from lab.designs import DESIGNS as LAB_DESIGNS, DesignConfig, flag_values
from plumbing.logs import LogError, read_log, run_folders
from plot_norms import CONDITIONS, GRID_FLAGS
from plot_norms import group_runs as group_in_order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, where train.py is


def flags_name(flags):
    """The condition name of a list of train.py model flags ('--name=value', '--name' alone for a True/False
    field), as condition_name names its run: each value read as the parser reads its flag (flag_values)."""
    return condition_name(flag_values(flags, DesignConfig))


# The paper's main grid plus the two variants its abstract names (CONDITIONS): plot_norms.py's, as is claim 4's.
# The field's looped designs for the atlas ("does this design carry the state's scale from loop to loop, and does
# the loss see it?"): every design of lab/designs.py's DESIGNS with a prediction, in its order, as its train.py
# flags, then what the design rule predicts, written down before the atlas was run (is the scale carried: nothing
# renormalizes the state between passes, so ||h_K|| / ||h_1|| > 1.5 at the end of training; is ||h_K|| large,
# > 100, under the scale-invariant rmsnorm readout, and under raw, where the loss sees the scale; and why).
# lab/atlas.py sets each prediction beside its measurement.
Design = namedtuple('Design', 'flags carried rmsnorm raw why')
DESIGNS = {name: Design(d.flags, *d.predicted) for name, d in LAB_DESIGNS.items() if d.predicted is not None}
ATLAS_READOUTS = ('rmsnorm', 'raw')


def atlas_grid(init='paper', designs=None):
    """Every design under both readouts, per-loop supervision, at one initialization: ({condition name: flags} to
    train, {condition name: (design, readout)} to read the runs back). The names to train are the paper init's,
    so the run folders do not change with the init; the names read back are the runs' own (the init's label in
    them under any other init). designs: only these DESIGNS names (None: all), in DESIGNS' order."""
    grid, names = {}, {}
    for design, entry in DESIGNS.items():
        if designs is not None and design not in designs:
            continue
        for readout in ATLAS_READOUTS:
            flags = ['--supervision=per_loop', f'--readout={readout}', *entry.flags]
            init_flags = [] if init == 'paper' else [f'--init={init}']
            grid[flags_name(flags)] = flags + init_flags
            names[flags_name(flags + init_flags)] = (design, readout)
    return grid, names


ATLAS, ATLAS_DESIGN = atlas_grid()
# Gated supervision: Ouro's learned exit gate on the raw state under both readouts, and on the head's
# input under rmsnorm (under raw the head reads h_k itself: the same gate), beside per-loop supervision's two
# (their checkpoints: the exit rules at matched depth need them)
GATE = {'per_loop + rmsnorm': CONDITIONS['per_loop + rmsnorm'], 'per_loop + raw': CONDITIONS['per_loop + raw'],
        'gated + rmsnorm': ['--supervision=gated', '--readout=rmsnorm'],
        'gated + raw': ['--supervision=gated', '--readout=raw'],
        'gated + rmsnorm + gate_readout': ['--supervision=gated', '--readout=rmsnorm', '--gate_input=readout']}
# Where the blind spot costs (python -m lab.cost --run): a factorial under the paper's init, K = 4, 1,000 steps
# evaluated every 100, paired by seed. Stack {2, 4} layers x 128 wide x learning rate {3e-3, 1e-3} x readout
# {rmsnorm, raw}; a norm penalty dose-response in the 4-layer 1e-3 cell (rmsnorm held fixed, so only the scale
# moves); one-loop baselines (K = 1, the same unique layers). Its predictions, margin and families: lab/cost.py
COST_FLAGS = ['--max_iters=1000', '--eval_interval=100', '--eval_iters=8', '--log_interval=100']


def cost_grid():
    """({cell name: train.py flags}, {cell name: its number of seeds}), in the order the cells are trained."""
    grid, seeds = {}, {}
    for n_layer in (2, 4):
        for lr in ('3e-3', '1e-3'):
            for readout in ('rmsnorm', 'raw'):
                name = f"L{n_layer}-lr{lr}-K4 + {readout}"
                grid[name] = [f'--n_layer={n_layer}', f'--learning_rate={lr}', f'--readout={readout}']
                seeds[name] = 5 if (n_layer, lr) == (4, '1e-3') else 3  # the paper-like cell: 5
    for lam in ('0.001', '0.01', '0.1'):
        name = f"L4-lr1e-3-K4 + rmsnorm + pen{lam}"
        grid[name] = ['--n_layer=4', '--learning_rate=1e-3', '--readout=rmsnorm', f'--norm_penalty={lam}']
        seeds[name] = 3
    for readout in ('rmsnorm', 'raw'):
        name = f"L4-lr1e-3-K1 + {readout}"
        grid[name] = ['--n_layer=4', '--learning_rate=1e-3', f'--readout={readout}', '--n_loop=1']
        seeds[name] = 3
    return {name: flags + COST_FLAGS for name, flags in grid.items()}, seeds


COST, COST_SEEDS = cost_grid()
# Claim 4 (scale control wins at matched depth once training is long) compares per-loop runs of the paper's grid
CLAIM4 = ['per_loop + rmsnorm', 'per_loop + raw', 'per_loop + rmsnorm + penalty', 'per_loop + final_norm',
          'per_loop + rmsnorm + normed', 'per_loop + alpha']
# The named grids (python -m lab.paper --grid): each a fixed list of conditions, so adding a design changes none of them
# (the paper's ten are plot_norms.py's CONDITIONS, as are GRID_FLAGS)
GRIDS = {'paper': CONDITIONS, 'claim4': {n: CONDITIONS[n] for n in CLAIM4}, 'atlas': ATLAS,
         'readouts': {n: CONDITIONS[n] for n in ('per_loop + rmsnorm', 'per_loop + raw')}, 'gate': GATE}
# a configuration's grid unless --grid names one (laptop_deep: do the two readouts swap places in a deeper stack?);
# any other configuration: the paper's ten
DEFAULT_GRID = {'laptop_long': 'claim4', 'laptop_deep': 'readouts'}


# train.py's flags that are not model fields and came after the first logs, with their defaults (see load_run)
NEWER_FLAGS = {'warmup_iters': 0, 'decay_lr': False, 'lr_decay_iters': None, 'min_lr': None}


def load_run(folder):
    """{'name', 'config', 'records', ...} from folder/log.jsonl, read by plumbing.logs.read_log (a one-line
    LogError otherwise), under the lab's condition name, with the defaults of every flag the log predates."""
    head, records, K = read_log(folder)
    # flags added since a log was written are at their defaults there, so an older run still pairs with a newer one
    model_defaults = {f.name: f.default for f in fields(DesignConfig) if f.name != 'vocab_size'}
    config = {**model_defaults, **NEWER_FLAGS, **head}
    config['model'] = cfg = {**model_defaults, **head['model']}
    # K is each run's own: runs of different depths can share one plot
    return {'folder': folder, 'name': condition_name(cfg), 'config': config, 'records': records, 'K': K}


def load_runs(patterns, folders=()):
    """load_run of every folder, then of every folder the patterns name (quoted globs are expanded here, so they
    work the same on every shell); a folder named twice is read once. LogError for a pattern that matches nothing."""
    return [load_run(folder) for folder in run_folders(patterns, folders)]


def group_runs(runs):
    """Runs that differ only in their seed together, in the order of the grids' conditions, then any others
    (plot_norms.group_runs, in the order of every grid here)."""
    return group_in_order(runs, dict.fromkeys(name for conditions in GRIDS.values() for name in conditions))


def slug(name):
    """'per_loop + rmsnorm + penalty' -> 'per_loop-rmsnorm-penalty': a condition's folder name and --conditions
    value."""
    return name.replace(' + ', '-')


def run_child(cmd):
    """Run one train.py to its end and return (exit code, its output, the signals received meanwhile). Ctrl-C and
    SIGTERM are passed on to the child, which saves a checkpoint and exits; the grid waits for that save."""
    received, pending, proc = [], [], None

    def forward(signum, frame):  # the child saves on this signal; the grid waits for it instead of dying first
        received.append(signum)
        if proc is None:
            pending.append(signum)
        else:  # a second Ctrl-C is passed on as well: train.py takes it as "abort now"
            proc.send_signal(signum)
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # its output goes to a file, not a pipe: reading a busy pipe to its end runs no Python signal handler until
        # the child exits, so a Ctrl-C landing between two reads would wait for the end of the run
        with tempfile.TemporaryFile('w+') as out:
            # its own process group: a Ctrl-C in the terminal reaches only the grid, which passes it on once (the
            # child would take a second copy of the same keypress as "abort")
            # python -m lab.train finds the repository from any folder the grid is run in
            env = {**os.environ, 'PYTHONPATH': os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))}
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, text=True,
                                    process_group=0, env=env)
            while pending:  # one that landed while the child was being started
                proc.send_signal(pending.pop(0))
            while proc.poll() is None:  # a short sleep, not a blocking wait: forward() runs within 0.1 s
                time.sleep(0.1)
            out.seek(0)
            return proc.returncode, out.read(), received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def grid_of(config, grid=None):
    """The conditions {name: flags} of the named grid (or grid itself, when it is such a dict), or of the
    configuration's default one."""
    return grid if isinstance(grid, dict) else GRIDS[grid or DEFAULT_GRID.get(config, 'paper')]


def finished(folder, cmd):
    """Whether the run in folder is finished at the step cmd asks for (its last --max_iters wins, as in train.py),
    else at its own max_iters: a longer request resumes the run to it. An unreadable log is not finished."""
    wanted = [int(a.split('=', 1)[1]) for a in cmd if a.startswith('--max_iters=')]
    try:
        run = load_run(folder)
    except LogError:
        return False
    return run['records'][-1]['step'] >= (wanted[-1] if wanted else run['config']['max_iters'])


def run_grid(config, seeds, out_root, extra, names=None, grid=None, prog='plot_norms.py', max_seed=None,
             after=None, finished_in=None, jobs=None, part=(1, 1)):
    """Train every condition of the grid (or those named) for every seed, one after another; reuse finished runs,
    resume interrupted ones. Seed by seed: whatever is finished when the grid is stopped is a complete set of pairs.
    prog: the command that runs it, for its one-line messages; max_seed: {condition: its last seed} where a
    condition has fewer seeds than the others; after(folder): called on every finished run, reused or new;
    finished_in: a folder of committed run logs (its run folders named as the grid's): a run whose log there is
    finished is reused from there, so a grid resumes in a fresh clone from what it committed. jobs: the
    [(condition, seed)] to train, in this order (default: seed by seed, every condition); part (i, n): this
    worker trains jobs i, i + n, i + 2n, ... only, so n workers share a grid without meeting."""
    folders, t0, trained, train_s, conditions = [], time.time(), 0, 0.0, grid_of(config, grid)
    if jobs is None:
        jobs = [(name, seed) for seed in seeds for name in names or conditions
                if max_seed is None or seed <= max_seed.get(name, seed)]
    jobs = [(name, conditions[name], seed) for name, seed in jobs][part[0] - 1::part[1]]
    for i, (name, flags, seed) in enumerate(jobs):
        folder = os.path.join(out_root, config, slug(name) + f"-seed{seed}")
        folders.append(folder)
        cmd = [sys.executable, '-m', 'lab.train', f'--config={config}', *GRID_FLAGS.get(config, []),
               *flags, f'--seed={seed}', f'--out_dir={folder}', *extra]
        state = 'new'
        committed = finished_in and os.path.join(finished_in, os.path.basename(folder))
        if committed and not os.path.exists(os.path.join(folder, 'log.jsonl')) and finished(committed, cmd):
            print(f"[{i + 1}/{len(jobs)}] {committed}: finished and committed, reused")
            folders[-1] = committed
            continue
        # a grid takes a while: rerunning the command must never redo finished work or lose an interrupted run
        if os.path.exists(os.path.join(folder, 'ckpt.pt')):
            if finished(folder, cmd):
                print(f"[{i + 1}/{len(jobs)}] {folder}: finished earlier, reused")
                if after is not None:
                    after(folder)
                continue
            cmd.append('--resume')
            state = 'resumed'
        elif os.path.exists(os.path.join(folder, 'log.jsonl')):
            cmd.append('--overwrite')  # a log with no checkpoint: the run died before its first save
        # from the runs this command trained (reused ones take no time and would make the ETA 0)
        eta = f", ETA {train_s / trained * (len(jobs) - i) / 60:.0f} min" if trained else ''
        print(f"[{i + 1}/{len(jobs)}] {folder}: training ({state}{eta})", flush=True)
        # one process per run: each starts from a clean torch state, and a crash names its condition
        started = time.time()
        returncode, output, signals = run_child(cmd)
        trained, train_s = trained + 1, train_s + time.time() - started
        if os.path.isdir(folder):  # keep train.py's own output beside its log
            with open(os.path.join(folder, 'train.out'), 'a') as f:
                f.write(output)
        last = output.strip().splitlines()[-1] if output.strip() else 'no output'
        if signals:  # the child has saved (or was aborted by a second Ctrl-C): stop the grid, in one line
            # train.py's own advice (--resume) is the grid's to follow, not the user's
            last = last.split('; continue with')[0]
            print(f"{prog}: interrupted during {name} (seed {seed}): {last}; rerun the same command to "
                  "continue the grid", file=sys.stderr)
            sys.exit(128 + signals[0])
        if returncode != 0:
            sys.exit(f"{prog}: error: the run for {name} (seed {seed}) failed: {last}")
        if after is not None:
            after(folder)
    print(f"grid done in {(time.time() - t0) / 60:.1f} min")
    return folders
