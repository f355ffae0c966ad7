"""The repository's layout rules: every function fits on one screen, and no two modules import each other."""

import ast
import glob
import os

from conftest import ROOT

MAX_LINES = 60  # one screen: a reader sees a whole function at once


def test_every_function_fits_on_one_screen():
    """No function (methods and nested functions included) over MAX_LINES lines, from def to its last line, in the
    scripts and modules at the top level and in data/: a longer one is split along the steps of its own work."""
    paths = glob.glob(os.path.join(ROOT, '*.py')) + glob.glob(os.path.join(ROOT, 'data', '**', '*.py'), recursive=True)
    too_long = []
    for path in paths:
        with open(path) as f:
            tree = ast.parse(f.read())
        too_long += [f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
                     for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and node.end_lineno - node.lineno + 1 > MAX_LINES]
    assert {'train.py', 'plot_norms.py', 'lab/grid.py', 'lab/stats.py', 'data/common.py'} <= {os.path.relpath(p, ROOT) for p in paths}
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
                [node.module] + [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module else []
            found |= {t for t in targets if t in modules and t != name}
        edges[name] = found
    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, seen + (n,))) for n in edges.get(start, ()))
    cycles = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if reaches(b, a)})
    assert not cycles, cycles
    assert len(modules) > 20 and 'data.common' in edges['data.shakespeare_char.prepare']
