"""tests/docs_commands.py, without running the commands (that takes minutes; it is a command of its own, like
tests/faults.py): every documented command is found and either run or skipped with a reason, a shrunk command
still parses with its script's parser, and the bad-input table is checked row by row."""

import re
import shlex

import plot_norms
import train
from lab import train as lab_train
from lab import paper
from docs_commands import commands, plan, written_files


def test_every_documented_command_is_run_or_skipped_with_a_reason():
    found = commands()
    assert len(found) >= 60, len(found)
    steps = [plan(cmd, documented) for _, _, cmd, documented in found]
    skipped = [s for s in steps if s[0] == 'skip']
    assert all(len(reason) > 10 for _, reason in skipped)
    assert len(skipped) < len(steps) / 4, [s[1] for s in skipped]  # most commands really run
    cmds = [cmd for _, _, cmd, _ in found]
    # the front page's first command, the grid, the suite, a shell loop and an inline handout command are all found
    assert 'python train.py --readout=rmsnorm --norm_penalty=0' in cmds
    assert any(c.startswith('for seed in') and 'train.py' in c and c.endswith('done') for c in cmds)
    assert ('python -m lab.bench --suite' in cmds
            and plan('python -m lab.bench --suite') == ('run', 'python -m lab.bench --suite', '', None))
    assert written_files('python -m lab.bench --suite') == ['out/bench_suite.json']


def test_long_commands_are_shrunk_and_still_parse():
    for _, _, cmd, documented in commands():
        step = plan(cmd, documented)
        if step[0] == 'skip' or documented or '$' in step[1]:
            continue
        argv = shlex.split(step[1])
        if '--help' in argv:
            continue
        if argv[:2] == ['python', 'train.py']:
            assert train.get_parser().parse(argv[2:])[0].max_iters == 4, cmd  # never the documented thousands
        elif argv[:3] == ['python', '-m', 'lab.train']:  # a design's: train.py's flags and its own
            assert lab_train.parse_args(argv[3:]).max_iters == 4, cmd
        elif argv[:2] == ['python', 'plot_norms.py'] or argv[:3] == ['python', '-m', 'lab.paper']:
            tool = plot_norms if argv[1] == 'plot_norms.py' else paper
            args = tool.get_parser().parse_args(argv[2 if tool is plot_norms else 3:])
            if args.run:
                # two conditions, or all of a small named grid (the gate grid's five), four steps each
                assert args.seeds <= 2 and len(args.conditions.split(',')) <= 6, cmd
                assert args.train_args.endswith('--max_iters=4 --eval_interval=2 --eval_iters=2'), cmd


def test_the_bad_input_table_is_checked_row_by_row():
    rows = [(cmd, documented) for page, _, cmd, documented in commands()
            if page == 'docs/reliability.md' and documented]
    assert len(rows) >= 20
    # each line names the command as it was typed: a root script by its file, a lab tool by python -m lab.<tool>
    named = re.compile(r'((train|sample|plot_norms|prepare)\.py|'
                       r'python -m lab\.(diagnose|atlas|norm_course|cost|paper|train)): error: ')
    for cmd, (code, line) in rows:
        assert plan(cmd, (code, line)) == ('run', cmd, '', (code, line))  # run as written: the failure is the point
        assert code == 1 and named.match(line), line
