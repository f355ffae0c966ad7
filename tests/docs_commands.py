"""
Every command the documentation gives, run as a newcomer would: in a fresh copy of the repository with nothing
prepared and no out/ folder, in the order the pages give them (README.md, docs/*.md, assignments/README.md), so
that a command that needs an earlier one's output finds it, as it would for a reader going down the page.

    python tests/docs_commands.py            # all of them (about 10 minutes on 2 cores)
    python tests/docs_commands.py --list     # what would run, shrink or be skipped, and why; runs nothing
    python tests/docs_commands.py --only=plot_norms   # the commands that contain this text

A command is every line of a fenced code block that calls python, torchrun or pip (a shell loop is one command
with its body), and every complete `python ...` command quoted inline. Each is checked for: exit 0 (or the
failure the documentation says it gives), no traceback, and the files the documentation says it writes. Long
commands are shrunk: the smallest flags that keep the same code path are appended (argparse lets a later flag
win), listed with --list and in the summary. Commands that cannot run here (8 GPUs, a 190 MB download, the
test suite itself) are skipped with the reason. The suite (tests/test_docs_commands.py) checks that every
documented command is classified, without running them.
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ['README.md', *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'docs', '*.md'))),
         'assignments/README.md']
TINY_TRAIN = '--max_iters=4 --eval_interval=2 --eval_iters=2'
# the model flags of the bad-input table's run W/run ($TINY there)
TINY = '--n_layer=1 --n_embd=32 --n_head=2 --n_loop=2 --block_size=16 --batch_size=4 --eval_iters=2 --device=cpu'

# (pattern, reason): commands that are not run here, first match wins
SKIP = [
    (r'^pip install', 'installs packages (CI has installed requirements.txt already; no network here)'),
    (r'-m pytest', 'the test suite itself (this check runs beside it)'),
    (r'nproc_per_node=8', 'needs 8 GPUs'),
    (r'data\.wikitext103\.prepare', 'downloads WikiText-103 (190 MB; no network here)'),
    (r"plot_norms\.py 'out/paper_44m", 'needs the paper-scale runs (GPU hours)'),
    (r'^export ', 'sets a variable for the commands after it (this check pins threads itself)'),
    (r'tests/docs_commands\.py', 'this check itself (its bad-input rows, what --only=W/ runs, are run here)'),
    (r'--against=/tmp/', 'needs a checkout of another commit (the `git worktree add` line before it)'),
    (r'<\w+>', "a placeholder (python -m lab.<tool>), not a command: each tool's own commands are run"),
    (r'train\.py config/', "nanoGPT's habit, shown as what train.py refuses "
                            "(tests/test_nanogpt_user.py checks its line)"),
]
# (pattern, expected stderr text): commands the documentation says fail here, and how
FAILS = [
    (r'--config=paper_\w+', 'wikitext103.prepare'),  # no prepared WikiText-103: one line naming the prepare command
]


def grid_slugs(name):
    """The condition slugs (--conditions values) of a named grid, in order."""
    if ROOT not in sys.path:  # run as python tests/docs_commands.py, the repository is not on the path
        sys.path.insert(0, ROOT)
    from lab.grid import GRIDS, slug
    return [slug(n) for n in GRIDS[name]]


def shrink(cmd):
    """(the command with shrinking flags appended, a note of what was added or ''). The flags go at the end of the
    script's own command (before any ';' or '&&'), where argparse lets them win over the documented ones."""
    notes = []

    def append(script, flags, text):
        name = re.sub(r'[(][?].*?[)]|[\\]', '', script)  # the script's name without its regex

        def add(match):
            notes.append(name + ' + ' + flags)
            return f"{match.group(0).rstrip()} {flags}"
        return re.sub(script + r'[^;&|]*', add, text)
    tool = r'plot_norms\.py' if 'plot_norms.py' in cmd else r'-m lab\.paper'  # the figures, or with the tables
    benchmark = '-m lab.paper' in cmd and '--exit_windows=0' not in cmd  # lab.paper's early-exit benchmark
    if re.search(tool, cmd) and '--run' in cmd:  # a shrunk grid: 2 seeds at most, 2 conditions, 4 steps
        seeds = min(int((re.search(r'--seeds=(\d+)', cmd) or [0, 1])[1]), 2)
        grid = re.search(r'--grid=(\w+)', cmd)  # another grid than the paper's: all of a small one
        small = grid and len(grid_slugs(grid[1])) <= 6
        conditions = (','.join(grid_slugs(grid[1])) if small else ','.join(grid_slugs(grid[1])[i] for i in (0, -1))
                      if grid else 'per_loop-rmsnorm,per_loop-raw')
        given = re.search(r'--conditions=([\w-]+,[\w-]+)', cmd)
        documented = re.search(r"--train_args='([^']*)'", cmd)  # kept (an --init, say), the tiny steps after it
        train_args = (documented[1] + ' ' if documented else '') + TINY_TRAIN
        flags = (f"--seeds={seeds} --conditions={given[1] if given else conditions} --train_args='{train_args}'"
                 + (' --exit_windows=4' if benchmark else ''))
        cmd = append(tool, flags, cmd)
    elif benchmark:
        cmd = append(r'-m lab\.paper', '--exit_windows=4', cmd)
    if re.search(r'-m lab\.atlas(?! \')', cmd):  # the atlas trains all twenty conditions: one seed of 4 steps each
        cmd = append(r'-m lab\.atlas', f"--seeds=1 --train_args='{TINY_TRAIN}'", cmd)
    if '-m lab.cost' in cmd and '--run' in cmd:  # the cost grid's 43 runs: one seed of its 13 cells, 4 steps each
        cmd = append(r'-m lab\.cost', f"--seeds=1 --train_args='{TINY_TRAIN}'", cmd)
    if '-m lab.norm_course' in cmd and '--run' in cmd:  # the seven 10,000-step runs: 4 steps each, fitted from step 1
        cmd = append(r'-m lab\.norm_course', f"--after=1 --train_args='{TINY_TRAIN}'", cmd)
    cmd = append(r'(?<!\w)train\.py', TINY_TRAIN + (' --batch_size=2 --block_size=64' if 'gpu_char' in cmd else ''),
                 cmd)
    cmd = append(r'-m lab\.train', TINY_TRAIN, cmd)  # a design's run: train.py's loop, 4 steps
    cmd = append(r'-m lab\.sample', '--num_samples=1 --max_new_tokens=20', cmd)
    cmd = append(r'-m lab\.diagnose', '--max_windows=4 --diag_windows=2 --lemma_loops=3', cmd)
    cmd = append(r'sample\.py', '--num_samples=1 --max_new_tokens=20', cmd)
    cmd = append(r'-m lab\.bench(?! --suite)', '--steps=2 --warmup=1', cmd)
    cmd = append(r'-m lab\.compare', '--rounds=1 --gen_rounds=1 --tokens=8', cmd)
    cmd = append(r'tests/faults\.py', '--kills=1 --interrupts=1', cmd)
    cmd = append(r'tests/mutations\.py(?! --only)', '--only=kl', cmd)
    return cmd, '; '.join(notes)


def commands():
    """(page, line number, command, documented failure or None) for every documented command, in reading order,
    each once. A documented failure is (exit code, the line it prints), from a table row `| `cmd` | code | line |`."""
    found, seen = [], set()
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding='utf-8') as f:
            lines = f.read().splitlines()
        in_block, loop, start = False, [], 0
        for i, line in enumerate(lines, 1):
            if line.lstrip().startswith('```'):
                in_block = not in_block
                continue
            text = re.split(r'\s+#\s', line)[0].strip()  # a comment after the command is not part of it
            if in_block and (loop or re.match(r'(for|while) ', text)):  # a shell loop: one command with its body
                loop, start = loop + [text], start or i
                body = ' '.join(loop)
                if len(re.findall(r'\bdone\b', body)) == len(re.findall(r'\bdo\b', body)):
                    found.append((page, start, ' '.join(part if part.endswith(('do', ';')) else part + ';'
                                                        for part in loop).rstrip(';'), None))
                    loop, start = [], 0
            elif in_block and re.match(r'(export |pip |python3? |torchrun )', text):
                found.append((page, i, text, None))
            elif not in_block:
                row = re.match(r'\| `((?:python3?|torchrun) [^`]+)` \| (\d+) \| (.*) \|$', line)
                if row:
                    found.append((page, i, row[1], (int(row[2]), row[3])))
                else:
                    found += [(page, i, m, None) for m in re.findall(r'`(python3? [^`]+)`', line)]
    unique = []
    for page, i, cmd, fails in found:
        cmd = cmd.split(' && ', 1)[1] if cmd.startswith('pip install -r requirements.txt && ') else cmd
        if cmd not in seen:
            seen.add(cmd)
            unique.append((page, i, cmd, fails))
    return unique


def plan(cmd, documented=None):
    """('skip', reason) or ('run', command to run, shrink note, expected failure or None). An expected failure is
    (exit code, the one line the documentation says is printed, with '...' standing for anything)."""
    for pattern, reason in SKIP:
        if re.search(pattern, cmd):
            return ('skip', reason)
    if documented is not None:  # a bad input: run exactly as written, since the failure is the point
        return ('run', cmd, '', documented)
    run, note = shrink(re.sub(r'=S\b', '=1', cmd))
    note = '; '.join(n for n in ('S = 1' if run != shrink(cmd)[0] else '', note) if n)
    fails = next(((1, f'...{text}...') for pattern, text in FAILS if re.search(pattern, cmd)), None)
    return ('run', run, note, fails)


def written_files(cmd):
    """The files the documentation says cmd leaves behind (relative to the repository)."""
    flag = lambda name, default=None: (re.search(rf'--{name}=(\S+)', cmd) or [None, default])[1]
    if 'lab.bench --suite' in cmd:
        return [flag('json', 'out/bench_suite.json')]
    if re.search(r'(?<!\w)train\.py', cmd) and '$' not in cmd and not re.search('paper_', cmd):
        out = flag('out_dir')
        return [os.path.join(out, 'log.jsonl'), os.path.join(out, 'ckpt.pt')] if out else []
    if 'plot_norms.py' in cmd or '-m lab.paper' in cmd:
        fig_dir = flag('fig_dir') or (os.path.join('out', 'figures', flag('config', 'laptop')) if '--run' in cmd
                                      else os.path.join('out', 'figures'))
        table = [os.path.join(fig_dir, 'table.md')] if '-m lab.paper' in cmd else []  # plot_norms.py: figures only
        return table + [os.path.join(fig_dir, 'fig1_norm_explosion.png')]
    if 'lab.diagnose' in cmd and re.search(r'--only=(all|lemma)|^(?!.*--only)', cmd):
        return [flag('fig') or os.path.join(flag('out_dir', 'out/laptop'), 'lemma.png')]
    return []


def fresh_copy(dest):
    """The working tree as a new user has it: no git, outputs, caches or prepared data."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns('.git', 'out', '__pycache__', '.pytest_cache', '*.bin',
                                                              '*.pkl', '*.pt', '*.zip', 'meta.json', '*.tmp'))


def make_scratch(copy):
    """The folder W that the bad-input table in docs/reliability.md uses: a finished tiny run (W/run, made with
    $TINY), a truncated checkpoint (W/trunc, and W/plotbad beside a good log), one run's log with another's
    checkpoint (W/mixed), an empty folder (W/empty, W/custom), a text file, a binary file and a text of 67,953
    distinct characters."""
    w = os.path.join(copy, 'W')
    for flags, out in (('--max_iters=2', 'W/run'), ('--max_iters=2 --seed=2', 'W/other')):
        subprocess.run(f"python train.py {TINY} {flags} --out_dir={out}", shell=True, cwd=copy, check=True,
                       capture_output=True)
    for name in ('trunc', 'plotbad', 'mixed'):
        shutil.copytree(os.path.join(w, 'run'), os.path.join(w, name))
    for name in ('trunc', 'plotbad'):
        with open(os.path.join(w, name, 'ckpt.pt'), 'r+b') as f:
            f.truncate(os.path.getsize(f.name) // 2)
    shutil.copy(os.path.join(w, 'other', 'log.jsonl'), os.path.join(w, 'mixed', 'log.jsonl'))
    for name in ('empty', 'custom'):
        os.makedirs(os.path.join(w, name))
    with open(os.path.join(w, 'text.txt'), 'w') as f:
        f.write('A text file where a folder is expected, long enough to be a corpus.\n' * 3)
    with open(os.path.join(w, 'binary.bin'), 'wb') as f:
        f.write(bytes(range(128, 256)))
    chars = [chr(c) for c in range(0x21, 0x30000) if not 0xD800 <= c < 0xE000][:67953]
    with open(os.path.join(w, 'huge.txt'), 'w', encoding='utf-8') as f:
        f.write(''.join(chars))


def check(copy, cmd, run, fails, timeout):
    """Run one command in the copy; returns (ok, seconds, why)."""
    t0 = time.time()
    env = {**os.environ, 'TINY': TINY, 'PYTHONUNBUFFERED': '1'}
    try:
        r = subprocess.run(['bash', '-c', run], cwd=copy, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return False, time.time() - t0, f"timed out after {timeout} s"
    seconds, out = time.time() - t0, r.stdout + r.stderr
    if 'Traceback' in out:
        return False, seconds, 'a traceback: ' + out[out.index('Traceback'):][-300:].replace('\n', ' | ')
    if fails is not None:  # exit code and stderr: exactly the documented line, nothing else
        code, line = fails
        err = r.stderr.strip().splitlines()
        pattern = '.*'.join(map(re.escape, line.split('...')))
        ok = r.returncode == code and len(err) == 1 and re.fullmatch(pattern, err[0]) is not None
        return ok, seconds, (f"fails as documented: {err[0][:100]}" if ok else
                             f"documented: exit {code}, {line!r}; got exit {r.returncode}, "
                             f"stderr {r.stderr.strip()[-300:]!r}")
    if r.returncode != 0:
        return False, seconds, f"exit {r.returncode}: {(r.stderr.strip() or r.stdout.strip())[-300:]}"
    missing = [f for f in written_files(cmd) if not os.path.exists(os.path.join(copy, f))]
    return not missing, seconds, f"did not write {', '.join(missing)}" if missing else ''


def get_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--list', action='store_true', help='show each command and what would be done with it; run nothing')
    p.add_argument('--only', default='', help='only the commands that contain this text')
    p.add_argument('--timeout', type=int, default=600, help='seconds one command may take')
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    chosen = [c for c in commands() if args.only in c[2]]
    if not chosen:
        sys.exit(f"docs_commands.py: error: no documented command contains {args.only!r}")
    if args.list:
        for page, i, cmd, documented in chosen:
            step = plan(cmd, documented)
            how = f"skip: {step[1]}" if step[0] == 'skip' else (f"shrunk: {step[2]}" if step[2] else 'as written') + (
                f" (documented failure: exit {step[3][0]}, {step[3][1][:80]})" if step[3] else '')
            print(f"{page}:{i}: {cmd}\n    {how}")
        return
    counts, failed, t_start = {'as written': 0, 'shrunk': 0, 'skipped': 0}, [], time.time()
    skipped = []
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, 'looped')
        fresh_copy(copy)
        for n, (page, i, cmd, documented) in enumerate(chosen, 1):
            step = plan(cmd, documented)
            if step[0] == 'skip':
                counts['skipped'] += 1
                skipped.append(f"{page}:{i} {cmd[:70]}: {step[1]}")
                print(f"[{n}/{len(chosen)}] skipped {page}:{i}: {step[1]}", flush=True)
                continue
            _, run, note, fails = step
            if 'W/' in run and not os.path.exists(os.path.join(copy, 'W')):
                make_scratch(copy)
            counts['shrunk' if note else 'as written'] += 1
            ok, seconds, why = check(copy, cmd, run, fails, args.timeout)
            if not ok:
                failed.append(f"{page}:{i}: {cmd}\n    {why}")
            eta = (time.time() - t_start) / n * (len(chosen) - n)
            print(f"[{n}/{len(chosen)}, ETA {eta / 60:.0f} min] {'ok' if ok else 'FAILED'} ({seconds:.0f} s) "
                  f"{page}:{i}: {cmd[:90]}" + (f"\n    shrunk: {note}" if note else '')
                  + (f"\n    {why}" if why else ''),
                  flush=True)
    ran = counts['as written'] + counts['shrunk']
    print(f"\n{ran} commands ran ({counts['as written']} as written, {counts['shrunk']} shrunk), {counts['skipped']} "
          f"skipped, in {(time.time() - t_start) / 60:.1f} min")
    for line in skipped:
        print(f"  skipped {line}")
    if failed:
        print(f"\n{len(failed)} failed:\n" + '\n'.join(failed))
    sys.exit(1 if failed else 0)


if __name__ == '__main__':
    main()
