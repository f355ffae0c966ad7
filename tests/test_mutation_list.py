"""The mutation check's list (tests/mutations.py) follows the code: every breakage names a line that occurs
exactly once in its file, a broken line that differs from it, and tests that exist. Without this, an entry
whose code moved only shows up when someone runs the whole (slow) mutation check."""

import ast
import os

import pytest

import mutations
from conftest import ROOT


@pytest.mark.parametrize('entry', mutations.MUTATIONS, ids=lambda e: e[0])
def test_every_breakage_names_a_line_that_occurs_exactly_once_in_its_file(entry):
    name, path, old, new, _ = entry
    with open(os.path.join(ROOT, path)) as f:
        count = f.read().count(old)
    assert count == 1, f"{name!r}: its line occurs {count} times in {path}, not once: move the entry with its code"
    assert new != old, f"{name!r}: the broken line is the line itself"


def test_every_breakage_names_tests_that_exist():
    defined = {}
    for _, _, _, _, tests in mutations.MUTATIONS:
        for test in tests:
            path, _, func = test.partition('::')
            assert os.path.exists(os.path.join(ROOT, path)), f"{test}: no such file"
            if func:
                if path not in defined:
                    with open(os.path.join(ROOT, path)) as f:
                        defined[path] = {n.name for n in ast.walk(ast.parse(f.read()))
                                         if isinstance(n, ast.FunctionDef)}
                assert func.split('[')[0] in defined[path], f"{test}: no such test function"


def test_every_breakage_has_a_name_of_its_own():
    names = [entry[0] for entry in mutations.MUTATIONS]
    assert len(names) == len(set(names)), 'two breakages share a name: --only could not tell them apart'


def test_a_breakages_whole_name_picks_it_alone_and_a_word_picks_every_name_with_it():
    """--only=loop picks every breakage with a word starting 'loop'; a whole name (any case) picks that one."""
    for entry in mutations.MUTATIONS:
        assert mutations.choose(entry[0]) == [entry] == mutations.choose(entry[0].upper()), entry[0]
    loop = mutations.choose('loop')
    assert len(loop) > 1 and all('loop' in name.lower() for name, *_ in loop)
    assert not mutations.choose('no_such_breakage')


def test_the_counts_docs_testing_md_states_are_the_lists_own():
    """docs/testing.md's numbers of breakages (the suite's, the course kit's) and of pinned configurations are
    those of the lists themselves, so that a list that grows cannot leave a stale count behind."""
    import importlib.util
    import json
    import re
    with open(os.path.join(ROOT, 'docs', 'testing.md')) as f:
        text = f.read()
    number = lambda pattern: int(re.search(pattern, text).group(1).replace(',', ''))
    assert number(r'The list has ([\d,]+) breakages') == len(mutations.MUTATIONS)
    spec = importlib.util.spec_from_file_location('kit', os.path.join(ROOT, 'assignments', 'key', 'mutations.py'))
    kit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kit)
    assert number(r"The course kit's list holds ([\d,]+) breakages") == len(kit.MUTATIONS)
    assert number(r'writes ([\d,]+) known-wrong student') == len(kit.MUTATIONS)
    with open(os.path.join(ROOT, 'tests', 'data', 'pinned_math.json')) as f:
        assert number(r'for ([\d,]+)\s+configurations') == len(json.load(f))
