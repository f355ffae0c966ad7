"""The repository's layout rules: the top level a reader opens (four scripts), the lab in one package, line
budgets, every function on one screen, and no two modules that import each other."""

import ast
import dataclasses
import glob
import os
import re
import sys

import pytest

from conftest import ROOT, run_together

MAX_LINES = 60  # one screen: a reader sees a whole function at once
LOOP = ('train.py', 'train', 80)  # but the training loop a reader sees whole, of about nanoGPT's length
# the files a reader opens first, and the most lines each may have (the model alone, the loop on one screen)
# train.py keeps a single run's promises (the device, resume, Ctrl-C, the progress line) with the run folder's
# files in plumbing/run.py: it imports nothing from lab/, and is longer than nanoGPT's for it
TOP_LEVEL = {'looped.py': 400, 'train.py': 450, 'sample.py': 230, 'plot_norms.py': 300}
MAX_WIDTH = 100  # characters a line in the files a reader opens first, and in the engine
NARROW = (*TOP_LEVEL, 'lab/engine.py')
LAB_TOOLS = ('diagnose', 'matched_depth', 'atlas', 'norm_course', 'bench', 'compare')


def test_the_top_level_is_the_four_scripts_and_the_lab_is_one_package():
    assert sorted(p for p in os.listdir(ROOT) if p.endswith('.py')) == sorted(TOP_LEVEL), \
        "a Python file at the root beside looped.py, train.py, sample.py and plot_norms.py: move it into lab/"
    for folder in ('data', 'tests', 'assignments', 'docs', 'figures', 'lab'):
        assert os.path.isdir(os.path.join(ROOT, folder)), folder
    assert os.path.exists(os.path.join(ROOT, 'lab', '__init__.py'))
    with open(os.path.join(ROOT, 'lab', '__init__.py')) as f:
        index = f.read()
    for path in glob.glob(os.path.join(ROOT, 'lab', '*.py')):
        name = os.path.basename(path)[:-3]
        assert name == '__init__' or re.search(rf'^    {name}\b', index, re.M), f"lab/__init__.py does not list {name}"


def test_the_top_level_files_keep_their_line_budgets():
    for name, budget in TOP_LEVEL.items():
        with open(os.path.join(ROOT, name)) as f:
            n = len(f.read().splitlines())
        assert n <= budget, f"{name} has {n} lines, over its budget of {budget}"


def test_the_root_files_and_the_engine_have_no_line_over_100_characters():
    for name in NARROW:
        with open(os.path.join(ROOT, name)) as f:
            wide = [i + 1 for i, line in enumerate(f.read().splitlines()) if len(line) > MAX_WIDTH]
        assert not wide, f"{name}: lines {wide} are over {MAX_WIDTH} characters"


def test_the_model_file_is_the_model_alone():
    """looped.py imports nothing of the lab or the data, has no field-metadata helper and no KV cache class
    (generation's engine is lab/engine.py), and keeps a plain generate as the reference."""
    with open(os.path.join(ROOT, 'looped.py')) as f:
        source = f.read()
    tree = ast.parse(source)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
               {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m and m.split('.')[0] in ('lab', 'data', 'train')}, imported
    assert 'metadata' not in source and 'field(' not in source, 'looped.py declares field metadata'
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    assert not [name for name in classes if 'cache' in name.lower()], 'a cache class in looped.py'
    methods = {n.name: n for n in classes['LoopedGPT'].body if isinstance(n, ast.FunctionDef)}
    generate = [a.arg for a in methods['generate'].args.args]
    assert generate == ['self', 'idx', 'max_new_tokens', 'temperature', 'top_k', 'n_loop', 'exit_rule',
                        'exit_threshold', 'return_depths'], generate


# what looped.py must not name: the other looped LMs and their designs, which live in lab/designs.py
OTHER_DESIGNS = ('injection', 'inject', 'prelude', 'coda', 'sandwich', 'deepnorm', 'diagonal', 'damp', 'jacobian',
                 'exit gate', 'exit_gate', 'gated', 'bptt', 'truncated', 'depth_sampling', 'residual_scale',
                 'parcae', 'ouro', 'stars', 'deeploop', 'huginn', 'nanochat', 'gelu', 'gpt2', 'gpt-2')


def test_the_model_file_is_the_papers_model_and_names_no_other_design():
    """LoopedConfig: at most 14 fields, the paper's among them with the paper's choices alone; looped.py names no
    other system or design (a causal mask's diagonal, tril's keyword, is not one)."""
    from looped import CHOICES, LoopedConfig
    names = [f.name for f in dataclasses.fields(LoopedConfig)]
    assert len(names) <= 14, f"LoopedConfig has {len(names)} fields: {names}"
    assert {'readout', 'alpha', 'recurrence', 'supervision', 'norm_penalty'} <= set(names)
    assert CHOICES['recurrence'] == ('residual', 'normed') and CHOICES['supervision'] == ('per_loop', 'terminal')
    with open(os.path.join(ROOT, 'looped.py')) as f:
        text = f.read().lower().replace('tril(diagonal', 'tril(')
    named = [w for w in OTHER_DESIGNS if re.search(rf'\b{re.escape(w)}', text)]
    assert not named, f"looped.py names {named}: that belongs in lab/designs.py"


def test_no_train_py_function_takes_more_than_6_parameters_or_returns_more_than_4_values():
    with open(os.path.join(ROOT, 'train.py')) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            a = node.args
            n = len(a.posonlyargs + a.args + a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
            assert n <= 6, f"train.py: {node.name} takes {n} parameters"
            for r in ast.walk(node):
                if isinstance(r, ast.Return) and isinstance(r.value, ast.Tuple):
                    assert len(r.value.elts) <= 4, f"train.py: {node.name} returns {len(r.value.elts)} values"


@pytest.fixture(scope='module')
def as_modules():
    """{argv: (returncode, stdout, stderr)} of each lab tool run as `python -m lab.<tool>`: --help for every one,
    and a bad flag value for the atlas. All are started at once (run_together)."""
    commands = [('-m', f'lab.{tool}', '--help') for tool in LAB_TOOLS] + [('-m', 'lab.atlas', '--seeds=0')]
    results = run_together(*[dict(args=[sys.executable, *argv], cwd=ROOT) for argv in commands], timeout=120)
    return dict(zip(commands, results))


@pytest.mark.parametrize('tool', LAB_TOOLS)
def test_every_lab_tool_runs_as_a_module_with_help(as_modules, tool):
    code, out, err = as_modules['-m', f'lab.{tool}', '--help']
    assert code == 0 and f'lab.{tool}' in out and not err, err


def test_a_lab_tool_run_as_a_module_names_itself_in_its_error(as_modules):
    code, _, err = as_modules['-m', 'lab.atlas', '--seeds=0']
    assert code == 1 and err == 'python -m lab.atlas: error: --seeds=0 must be at least 1\n', err


def test_every_function_fits_on_one_screen():
    """No function (methods and nested functions included) over MAX_LINES lines, from def to its last line, in the
    scripts and modules at the top level and in data/: a longer one is split along the steps of its own work."""
    paths = glob.glob(os.path.join(ROOT, '*.py')) + glob.glob(os.path.join(ROOT, 'lab', '*.py')) + \
        glob.glob(os.path.join(ROOT, 'data', '**', '*.py'), recursive=True)
    too_long = []
    for path in paths:
        with open(path) as f:
            tree = ast.parse(f.read())
        too_long += [f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} "
                     f"({node.end_lineno - node.lineno + 1} lines)"
                     for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and node.end_lineno - node.lineno + 1 > (LOOP[2] if (os.path.relpath(path, ROOT), node.name)
                                                              == LOOP[:2] else MAX_LINES)]
    assert ({'train.py', 'plot_norms.py', 'lab/grid.py', 'lab/stats.py', 'data/common.py'}
            <= {os.path.relpath(p, ROOT) for p in paths})
    assert not too_long, too_long


def test_no_two_modules_import_each_other():
    """The repository's modules form no import cycle (imports inside functions count too): a reader can take
    them in order, and none half-imports another."""
    modules = {}
    for path in glob.glob(os.path.join(ROOT, '**', '*.py'), recursive=True):
        rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, '.')
        modules[rel[:-len('.__init__')] if rel.endswith('.__init__') else rel] = path
    edges = {}
    for name, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        found = set()
        for node in ast.walk(tree):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] + [f"{node.module}.{a.name}" for a in node.names] \
                if isinstance(node, ast.ImportFrom) and node.module else []
            found |= {t for t in targets if t in modules and t != name}
        edges[name] = found

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, seen + (n,))) for n in edges.get(start, ()))
    cycles = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if reaches(b, a)})
    assert not cycles, cycles
    assert len(modules) > 20 and 'data.common' in edges['data.shakespeare_char.prepare']
