"""train.py as a student reads it: it trains looped.py's model (an edit to looped.py reaches the run), it needs
few names from the lab to follow; python -m lab.train's --help lists the paper's flags before the designs', and
every design flag trains through it (and is refused by train.py in one line naming it)."""

import ast
import dataclasses
import importlib
import io
import keyword
import os
import re
import shutil
import subprocess
import sys
import tokenize
import types

import pytest
import torch

import lab.train as lab_train
import train
from conftest import ROOT
from lab.designs import DESIGN_FLAGS, DesignConfig, DesignedGPT, design_examples
from looped import LoopedConfig, LoopedGPT

TINY = ['--n_layer=1', '--n_embd=16', '--n_head=2', '--n_loop=2', '--block_size=16', '--batch_size=2',
        '--eval_iters=1', '--max_iters=1', '--eval_interval=1', '--log_interval=1']


PACKAGES = ('lab', 'data', 'plumbing')  # the repository's own, beside looped.py


def lab_names(source):
    """The distinct names a script takes from lab/, data/ and plumbing/: each name it imports from them, and each
    attribute it reads off a module imported from them (`from lab import runs` then `runs.Run`: runs and Run)."""
    tree = ast.parse(source)
    names, modules = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split('.')[0] in PACKAGES:
            for alias in node.names:
                local = alias.asname or alias.name
                names.add(local)
                if isinstance(getattr(importlib.import_module(node.module), alias.name), types.ModuleType):
                    modules.add(local)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split('.')[0] in PACKAGES:
                    names.add(alias.asname or alias.name)
                    modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            names.add(node.attr)
    return names


def test_train_py_takes_nothing_from_the_lab_and_at_most_19_names_from_data_and_plumbing():
    """What a single run needs beside its loop (the parser, the device, the run folder) is in plumbing/ and the
    batches in data/, so train.py reads short; each name taken from there is a look-up, so their count is held.
    (Members are look-ups too, and this leaves them out: data/ hands over plain functions and values, no object
    whose members a reader must look up; plumbing/ hands over Parser and Progress.)"""
    with open(os.path.join(ROOT, 'train.py')) as f:
        source = f.read()
    assert not re.search(r'^\s*(from|import) lab\b', source, flags=re.M)
    names = lab_names(source)
    assert len(names) <= 19, sorted(names)


def test_the_name_count_counts_module_attributes():
    source = "from lab import runs\nfrom data.loader import load_data\nruns.Run(); runs.fail(); runs.Run"
    assert lab_names(source) == {"runs", "Run", "fail", "load_data"}


def test_train_py_and_looped_py_stay_short_enough_to_read():
    for name, most in (('train.py', 450), ('looped.py', 400)):  # the ceilings; never a reason to pack
        with open(os.path.join(ROOT, name)) as f:
            lines = f.read().splitlines()
        assert len(lines) <= most, f"{name}: {len(lines)} lines"
        assert all(len(line) <= 100 for line in lines), f"{name} has a line over 100 characters"


def reading_cost(source):
    """Seconds to read a file by one fixed estimate: 10 a non-blank line, 5 a distinct identifier (tokenize's
    NAME tokens that are not keywords, outside f-strings)."""
    lines = sum(1 for line in source.splitlines() if line.strip())
    names, in_fstring = set(), 0
    for t in tokenize.generate_tokens(io.StringIO(source).readline):
        # Python 3.12+ tokenizes inside f-strings; 3.11 gives one STRING: both count the names outside only
        start, end = getattr(tokenize, 'FSTRING_START', None), getattr(tokenize, 'FSTRING_END', None)
        in_fstring += (t.type == start) - (t.type == end)
        if t.type == tokenize.NAME and not keyword.iskeyword(t.string) and not in_fstring:
            names.add(t.string)
    return 10 * lines + 5 * len(names)


def test_the_reading_cost_counts_lines_and_distinct_names_but_not_keywords_or_strings():
    assert reading_cost("x = y + x\n\n# a comment\nif x:\n    z = 'w v'\n") == 10 * 4 + 5 * 3
    assert reading_cost("x = f'{y} {z:.1f}'\n") == 10 + 5  # on every Python: not the names inside an f-string


def test_looped_py_and_train_py_read_within_1_2x_nanogpts_model_py_and_train_py():
    """nanoGPT's model.py and train.py cost 7,995 s by the same estimate (look-ups in other files left out; with
    its 9 look-ups at 60 s each, 8,535 s, the figure the whole reading with look-ups is compared to);
    1.2x of it is 9,594 s. (It was 1.15x until generate took the exit rules from sample.py, +40 lines, and the
    loop's inputs got a declared Run; the look-ups, which this leaves out, are counted by a student's read.)"""
    total = 0
    for name in ('looped.py', 'train.py'):
        with open(os.path.join(ROOT, name)) as f:
            total += reading_cost(f.read())
    assert total <= 9594, f"looped.py + train.py: {total} s to read, over 9,594"


def scratch_copy(tmp_path):
    """The repository's code in a scratch folder (no history, runs, figures or docs): edits there touch nothing."""
    dst = tmp_path / 'repo'
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns('.git', 'out', 'figures', 'notebooks', 'docs', 'tests',
                                                             'assignments', '__pycache__', '*.bin'))
    return dst


def run_train(repo, small_data, *flags, script=('train.py',)):
    cmd = [sys.executable, *script, '--dataset', small_data, '--out_dir', 'out/x', '--overwrite', *TINY, *flags]
    return subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300)


def edit(path, old, new):
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def parameter_count(output):
    return int(re.search(r'([\d,]+) parameters', output).group(1).replace(',', ''))


def test_an_edit_to_looped_py_reaches_the_default_run_and_a_design_run_still_trains(small_data, tmp_path):
    repo = scratch_copy(tmp_path)
    before = run_train(repo, small_data)
    assert before.returncode == 0, before.stderr
    assert 'LoopedGPT' in before.stdout
    looped = repo / 'looped.py'
    # a student's extra parameter in Block, sized by a new config field that has no flag in train.py yet: the
    # field's default is used, and the count train.py prints grows by it, once per layer
    edit(looped, "    norm_eps: float = 1e-6", "    extra: int = 7  # a student's field\n    norm_eps: float = 1e-6")
    edit(looped, "        self.mlp = MLP(config)\n",
         "        self.mlp = MLP(config)\n        self.extra = nn.Parameter(torch.zeros(config.extra))\n")
    after = run_train(repo, small_data)
    assert after.returncode == 0, after.stderr
    assert parameter_count(after.stdout) == parameter_count(before.stdout) + 7
    # sample.py rebuilds the edited model from that run's checkpoint and generates with it
    sampled = subprocess.run([sys.executable, 'sample.py', '--out_dir=out/x', '--max_new_tokens=5'], cwd=repo,
                             capture_output=True, text=True, timeout=300)
    assert sampled.returncode == 0 and 'mean loops per token' in sampled.stdout, sampled.stderr[-1500:]
    # a student's configure_optimizers is the one the run calls
    edit(looped, "        params = [p for p in self.parameters() if p.requires_grad]\n        return torch.optim",
         "        raise RuntimeError('a student was here')\n        return torch.optim")
    stopped = run_train(repo, small_data)
    assert stopped.returncode != 0 and 'a student was here' in stopped.stderr
    # the extension has its own optimizer groups, so it trains still, through the lab's entry
    sandwich = run_train(repo, small_data, '--block=sandwich', script=('-m', 'lab.train'))
    assert sandwich.returncode == 0, sandwich.stderr
    assert 'DesignedGPT' in sandwich.stdout


def test_train_py_refuses_a_design_flag_in_one_line_naming_the_labs_entry():
    out = subprocess.run([sys.executable, 'train.py', '--block=sandwich'], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and not out.stdout
    assert out.stderr.strip().count('\n') == 0 and 'python -m lab.train' in out.stderr, out.stderr
    assert "the field's designs:" not in train.get_parser().format_help()


def test_help_lists_the_papers_flags_then_the_designs_in_a_group_of_their_own():
    text = lab_train.get_parser().format_help()
    assert "the field's designs:" in text
    paper, designs = text.split("the field's designs:")
    listed = lambda flag, part: re.search(rf'\n  {flag} ', part)  # where --help describes the flag
    for flag in ('--readout', '--norm_penalty', '--recurrence', '--supervision', '--n_loop', '--learning_rate'):
        assert listed(flag, paper), flag
    for flag in ['--' + name for name in DESIGN_FLAGS]:  # every design field's flag, from lab/designs.py
        assert listed(flag, designs) and not listed(flag, paper), flag


# one value off its default for each design flag (and the paper's flags' design values), from lab/designs.py's
# table of the designs' flags (DESIGN_FLAGS): a new design brings its own
DESIGN_VALUES = design_examples()


def test_every_design_flag_is_listed_and_chooses_the_extension():
    paper = {f.name for f in __import__('dataclasses').fields(LoopedConfig)}
    design_fields = {f.name for f in __import__('dataclasses').fields(DesignConfig)} - paper
    assert design_fields | {'supervision', 'recurrence'} == set(DESIGN_VALUES)
    GPT, config = lab_train.model_config(lab_train.parse_args([]))
    assert GPT is LoopedGPT and type(config) is LoopedConfig
    for name, value in DESIGN_VALUES.items():
        GPT, config = lab_train.model_config(lab_train.parse_args([f'--{name}={value}']))
        assert GPT is DesignedGPT and getattr(config, name) == value, name


@pytest.mark.parametrize('name', sorted(DESIGN_VALUES))
def test_every_design_flag_trains_a_step(name):
    """Each design flag alone builds the model python -m lab.train builds for it, and one step changes its
    weights."""
    argv = [f'--{name}={DESIGN_VALUES[name]}', '--n_layer=1', '--n_embd=16', '--n_head=2', '--n_loop=2',
            '--block_size=8']
    GPT, config = lab_train.model_config(lab_train.parse_args(argv), vocab_size=11)
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = model.configure_optimizers(0.01, 1e-3, 'cpu')
    x = torch.randint(11, (2, 8))
    n_loop = model.sampled_depth(1, 0)
    _, loss, _ = model(x, x, n_loop=n_loop)
    assert torch.isfinite(loss), name
    before = [p.detach().clone() for p in model.parameters()]
    loss.backward()
    optimizer.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters())), name


@pytest.mark.parametrize('flag', ['--injection=diagonal', '--supervision=gated'])
def test_a_design_run_trains_through_the_labs_entry(small_data, tmp_path, flag, capsys):
    lab_train.main(['--dataset', small_data, '--out_dir', str(tmp_path / 'r'), *TINY, flag])
    out = capsys.readouterr().out
    assert 'DesignedGPT' in out and 'done: 1 steps' in out


def test_train_pys_model_flags_default_to_looped_configs_fields():
    """train.py's parser writes each model default again beside its help (a reader sees both files): the two copies
    agree, so a run with no flags builds LoopedConfig()'s model."""
    parser = train.get_parser()
    for f in dataclasses.fields(LoopedConfig):
        if f.name != 'vocab_size':  # from the data
            assert parser.get_default(f.name) == f.default, f.name
