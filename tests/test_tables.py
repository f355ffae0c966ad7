"""No table without its logs: every table under figures/ (its .md and .csv files) is either what a read-only command
writes from the run logs committed beside it, byte for byte, or one whose missing logs docs/results.md explains
(section "Every committed table and its logs"). A table in neither list fails, so none is committed unaccounted for."""

import glob
import json
import os
import re
import shlex

import matplotlib.figure
import pytest

from conftest import ROOT
from lab import atlas, converge, cost, interaction, norm_course, one_pass, paper, testbed, verdicts

DOCS = os.path.join(ROOT, 'docs', 'results.md')
SECTION = '## Every committed table and its logs'
# a folder -> the command, as docs/results.md gives it, that rebuilds every table in it from its committed runs/
REBUILT = {
    'figures/atlas': "python -m lab.atlas 'figures/atlas/runs/*' --fig_dir=figures/atlas",
    'figures/atlas_gpt2': "python -m lab.atlas --init=gpt2 'figures/atlas_gpt2/runs/*' --fig_dir=figures/atlas_gpt2",
    'figures/atlas_untied': "python -m lab.atlas 'figures/atlas_untied/runs/*' --fig_dir=figures/atlas_untied",
    'figures/gate': "python -m lab.paper 'figures/gate/runs/*' --fig_dir=figures/gate",
    'figures/laptop_10k': "python -m lab.norm_course 'figures/laptop_10k/runs/*' --fig_dir=figures/laptop_10k",
    'figures/verdicts': "python -m lab.verdicts --fig_dir=figures/verdicts",
    'figures/cost': "python -m lab.cost 'figures/cost/runs/*' --fig_dir=figures/cost",
    'figures/converge': "python -m lab.converge 'figures/converge/runs/*' --fig_dir=figures/converge",
    'figures/laptop': "python -m lab.paper 'figures/laptop/runs/*' --fig_dir=figures/laptop --exit_windows=0",
}
# the interaction's table, once its runs are committed and it is written: read from the convergence grid's
# committed runs and its own (the default folders), so its command names none
# the same for the one-pass grid (its own runs beside the committed tied K = 1 runs) and the testbed (its runs'
# logs and answers.json)
for folder, command in (('figures/interaction', "python -m lab.interaction --fig_dir=figures/interaction"),
                        ('figures/one_pass', "python -m lab.one_pass --fig_dir=figures/one_pass"),
                        ('figures/testbed', "python -m lab.testbed --fig_dir=figures/testbed")):
    if os.path.exists(os.path.join(ROOT, folder, 'table.md')):
        REBUILT[folder] = command
TOOLS = {'lab.atlas': atlas.main, 'lab.norm_course': norm_course.main, 'lab.paper': paper.main,
         'lab.verdicts': verdicts.main, 'lab.cost': cost.main, 'lab.converge': converge.main,
         'lab.interaction': interaction.main, 'lab.one_pass': one_pass.main, 'lab.testbed': testbed.main}
# the tables no committed log backs: their runs' folders (out/) or checkpoints were never committed; the docs'
# section gives each one's reason and the command that trains its runs again
LOGLESS = [
    'figures/atlas/exit/matched_depth.csv', 'figures/atlas/exit/matched_depth.md',
    'figures/laptop/alpha/table.csv', 'figures/laptop/alpha/table.md',
    'figures/laptop/exit/exit_table.md',
    'figures/one_pass_layers/layers.md',
    'figures/laptop_10k_more/course.csv', 'figures/laptop_10k_more/course.md',
    'figures/laptop_deep/paired.csv', 'figures/laptop_deep/table.csv', 'figures/laptop_deep/table.md',
    'figures/laptop_long/exit_table.md', 'figures/laptop_long/table.csv', 'figures/laptop_long/table.md',
    'figures/laptop_long_paired/paired.csv', 'figures/laptop_long_paired/table.csv',
    'figures/laptop_long_paired/table.md',
    'figures/matched_depth/matched_depth.csv', 'figures/matched_depth/matched_depth.md',
    'figures/gate/exit_rmsnorm/matched_depth.csv', 'figures/gate/exit_rmsnorm/matched_depth.md',
    'figures/gate/exit_raw/matched_depth.csv', 'figures/gate/exit_raw/matched_depth.md',
    'figures/gate/exit_against/matched_depth.csv', 'figures/gate/exit_against/matched_depth.md',
]


def committed_tables():
    """Every .md and .csv under figures/, as paths from the repository's root."""
    return sorted(os.path.relpath(p, ROOT) for ext in ('md', 'csv')
                  for p in glob.glob(os.path.join(ROOT, 'figures', '**', f'*.{ext}'), recursive=True))


def docs_section():
    with open(DOCS, encoding='utf-8') as f:
        text = f.read()
    assert SECTION in text, f"docs/results.md has no section {SECTION!r}"
    return text.split(SECTION, 1)[1].split('\n## ', 1)[0]


# one case per folder that holds a table or is named in either list: a new folder of tables is a new case, and fails
FOLDERS = sorted({os.path.dirname(p) for p in committed_tables()} | set(REBUILT)
                 | {os.path.dirname(p) for p in LOGLESS})


@pytest.mark.parametrize('folder', FOLDERS)
def test_every_table_under_figures_is_rebuilt_from_its_committed_logs(folder, shakespeare_data, tmp_path, monkeypatch):
    """A rebuilt folder's tables are its command's output on its committed logs, byte for byte (a row no log backs,
    or a log changed after its table was written, fails); every other table is in LOGLESS and has its row in the
    docs' section, with the reason it has no logs and the command that trains its runs again."""
    tables = [p for p in committed_tables() if os.path.dirname(p) == folder]
    assert tables, f"{folder} is listed in tests/test_tables.py but holds no table: drop it from the list"
    section = docs_section()
    if folder in REBUILT:
        command = REBUILT[folder]
        assert f"`{command}`" in section, f"docs/results.md's section {SECTION!r} does not name {command}"
        words = shlex.split(command)  # python -m lab.<tool> ...
        tool, argv = (words[2], words[3:]) if words[1] == '-m' else (words[1], words[2:])
        # the runs' dataset from a prepared copy of the shipped text: the atlas's unigram loss needs it, and the
        # repository's data/ is never touched by the tests
        monkeypatch.setattr(atlas, 'find_dataset', lambda name: {'shakespeare_char': shakespeare_data}[name])
        monkeypatch.chdir(ROOT)  # the command's globs are relative to the root, as the docs run it
        # the figures are drawn but not rendered to PNG (half of this test's time): only the tables are compared
        monkeypatch.setattr(matplotlib.figure.Figure, 'savefig', lambda self, *a, **k: None)
        TOOLS[tool]([*argv, f'--fig_dir={tmp_path}'])  # argparse: the later --fig_dir wins
        for path in tables:
            rebuilt = tmp_path / os.path.basename(path)
            assert rebuilt.exists(), f"{path}: its folder's command ({command}) does not write it"
            with open(os.path.join(ROOT, path), 'rb') as f:
                assert rebuilt.read_bytes() == f.read(), f"{path} is not what {command} writes from its logs"
        return
    for path in tables:
        assert path in LOGLESS, (f"{path}: a table with no command that rebuilds it from committed logs (REBUILT) "
                                 f"and no reason in the docs (LOGLESS)")
        rows = [line for line in section.splitlines() if line.startswith('|') and path in line]
        assert rows, f"{path}: docs/results.md's section {SECTION!r} does not say why it has no logs"
        assert all(cell.strip() for cell in rows[0].strip('|').split('|')), rows[0]
    assert all(os.path.exists(os.path.join(ROOT, p)) for p in LOGLESS if os.path.dirname(p) == folder), \
        f"a table listed in LOGLESS under {folder} is gone: drop it from the list"


def test_every_committed_log_reads_back_with_every_flag_train_py_has_today():
    """A flag added to train.py after a log was written must read back at its default (lab/grid.py NEWER_FLAGS);
    otherwise an older run and a newer one of the same condition and seed settings fall into two groups."""
    import train
    from lab.grid import load_run
    flags = {a.dest for a in train.get_parser()._actions if a.dest != 'help'}
    for log in sorted(glob.glob(os.path.join(ROOT, 'figures', '**', 'log.jsonl'), recursive=True)):
        missing = flags - set(load_run(os.path.dirname(log))['config'])
        assert not missing, (f"{os.path.relpath(log, ROOT)} reads back without {sorted(missing)}: "
                             "add them to NEWER_FLAGS")


def close(text, x):
    """Is the table's number x the page's number text ('0.569', '-0.075') at the page's precision, sign aside?
    A table's +0.5685 is quoted as 0.569; a page may state raw - rmsnorm where a table has rmsnorm - raw."""
    decimals = len(text.split('.')[1])
    return abs(abs(x) - abs(float(text))) <= 0.5 * 10 ** -decimals + 1e-9


def intervals(path, line):
    """The (lo, hi) pairs a table's line holds: '[lo, hi]' in a markdown table, and in a CSV every two adjacent
    numeric fields (its lo and hi columns stand side by side)."""
    pairs = [(float(a), float(b)) for a, b in re.findall(r'\[([+-]?\d+\.\d+), ([+-]?\d+\.\d+)\]', line)]
    if path.endswith('.csv'):
        fields = line.strip().split(',')
        number = lambda f: re.fullmatch(r'[+-]?\d+\.\d+(e[+-]?\d+)?', f)
        pairs += [(float(a), float(b)) for a, b in zip(fields, fields[1:]) if number(a) and number(b)]
    return pairs


@pytest.mark.parametrize('page', ['README.md', 'docs/results.md'])
def test_every_interval_a_page_quotes_is_an_interval_of_a_committed_table(page):
    """A 95% interval on the front page or the results page is copied from a table, never worked out by hand: it
    must be one of the intervals of a table committed under figures/ (with its ends swapped where its sign is)."""
    held = [pair for path in glob.glob(os.path.join(ROOT, 'figures', '**', '*.*'), recursive=True)
            if path.endswith(('.md', '.csv')) for line in open(path, encoding='utf-8')
            for pair in intervals(path, line)]
    text = open(os.path.join(ROOT, page), encoding='utf-8').read()
    missing = [m.group(0) for m in re.finditer(r'\[([+-]?\d+\.\d+), ([+-]?\d+\.\d+)\]', text)
               if not any((close(m.group(1), x) and close(m.group(2), y)) or (close(m.group(1), y) and
                                                                          close(m.group(2), x)) for x, y in held)]
    assert not missing, f"{page} quotes intervals no committed table holds: {missing}"


def test_the_readme_demo_table_is_the_step_500_evaluation_of_the_committed_demo_logs():
    """The front page's four commands: each row's ||h_k|| and validation losses are the last evaluation (step 500) in
    that command's log under figures/demo/runs (norms of 100 or more in whole numbers), and the ratio the page
    draws from them is theirs."""
    text = open(os.path.join(ROOT, 'README.md'), encoding='utf-8').read()
    rows = re.findall(r'^\| `(--[^`]+)` \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$', text, re.M)
    assert [flags for flags, *_ in rows] == ['--readout=rmsnorm --norm_penalty=0', '--readout=raw',
                                             '--norm_penalty=0.01', '--recurrence=normed'], rows
    last = {}
    for flags, norms, losses, loss_2k in rows:
        name = flags.replace('--', '').replace('=', '_').replace(' ', '-')
        with open(os.path.join(ROOT, 'figures', 'demo', 'runs', name, 'log.jsonl')) as f:
            last[flags] = record = json.loads(f.read().splitlines()[-1])
        assert record['step'] == 500, (flags, record['step'])
        shown = [f"{v:.0f}" if v >= 100 else f"{v:.1f}" for v in record['hidden_norm'][:4]]
        assert [v.strip(' *') for v in norms.split(',')] == shown, flags
        assert [v.strip() for v in losses.split('/')] == [f"{v:.3f}" for v in record['val_loss'][:4]], flags
        assert loss_2k.strip() == f"{record['val_loss'][-1]:.3f}", flags
    rms, raw = (last[f]['hidden_norm'][3] for f in ('--readout=rmsnorm --norm_penalty=0', '--readout=raw'))
    assert f"ends {rms / raw:.0f} times raw's ({rms:.0f} against {raw:.2f})" in text.replace('\n', ' ')
