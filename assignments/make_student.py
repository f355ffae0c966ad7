"""
Write the student copy of this repository: every tracked file (no git history), with the bodies of the
functions the chosen assignments ask for replaced by `raise NotImplementedError("aN: see assignments/README.md")`.
Signatures and docstrings stay, so the student sees what to write and where.

    python assignments/make_student.py /tmp/student                 # all assignments
    python assignments/make_student.py /tmp/student-a1a3 --only a1,a3   # just these; the rest keep the reference

Left out, because they state answers or are for instructors: the project README (replaced by a student README,
assignments/STUDENT_README.md: set-up, the assignments, how to run; no results), docs/ (the results pages),
figures/, the answer key, mutation suite and instructor guide (assignments/key/), the autograder builder
(assignments/autograder/), the project's own test suite (tests/, whose science tests and instructor check state
results), the project's CI script (.ci/, which runs tests/) and this tool with its list (stubs.py). Sentences of the
kept files that answer a written question or point at a left-out file are rewritten in the copy as
assignments/key/redactions.py lists them; the reference files are not touched. It runs only from the instructor's
repository (a git checkout with the reference code): from a student copy it would copy the student's code as the
reference, so it refuses.

Which functions belong to which assignment is listed in assignments/stubs.py; the bodies are found by
qualified name with Python's ast module, so the reference files need no markers.
"""

import argparse
import json
import ast
import importlib.util
import os
import shutil
import subprocess
import sys

from stubs import ASSIGNMENTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDENT_README = os.path.join('assignments', 'STUDENT_README.md')  # written as the copy's README.md
# never copied: (path prefixes) texts that state answers, instructor material, and the project's test suite
EXCLUDED = ('README.md', 'docs/', 'figures/', 'assignments/key/', 'assignments/autograder/', STUDENT_README, 'tests/',
            '.ci/', 'assignments/make_student.py', 'assignments/stubs.py')
REDACTIONS = os.path.join(ROOT, 'assignments', 'key', 'redactions.py')


def redactions(path=None):
    """{file: [(reference text, replacement, required), ...]} from the key's list (read by path: the key is no
    package)."""
    spec = importlib.util.spec_from_file_location('course_redactions', path or REDACTIONS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    by_file = {}
    for rel, old, new, *required in module.REDACTIONS:
        by_file.setdefault(rel, []).append((old, new, required[0] if required else True))
    return by_file


def redact(text, rel, edits):
    """text with each (old, new, required) of edits applied; old must occur exactly once, else the copy is refused
    (an optional one may also be absent)."""
    for old, new, required in edits:
        n = text.count(old)
        if n != 1 and (required or n > 1):
            raise SystemExit(f"make_student.py: error: a sentence assignments/key/redactions.py removes from {rel} is "
                             f"found {n} times there, not once (the file changed): {old.strip()[:80]!r}; update "
                             f"the redaction, or an answer ships in the copy")
        text = text.replace(old, new)
    return text


def excluded(rel):
    rel = rel.replace(os.sep, '/')
    return any(rel == e or (e.endswith('/') and rel.startswith(e)) for e in EXCLUDED)


def stub_marker(assignment):
    return f"{assignment}: see assignments/README.md"


def stripped_reason(root=ROOT):
    """Why root is not the instructor's repository (no .git, or stubs in place of reference code), or None."""
    if not os.path.exists(os.path.join(root, '.git')):
        return "it has no .git"
    stubbed = []
    for a, (_, targets) in ASSIGNMENTS.items():
        for target in targets:
            path, qualname = target.split('::')
            try:
                with open(os.path.join(root, path), encoding='utf-8') as f:
                    source = f.read()
            except OSError:
                continue
            fn = find_function(ast.parse(source), qualname)
            if fn is not None and stub_marker(a) in ast.get_source_segment(source, fn):
                stubbed.append(a)
                break
    if stubbed:
        return f"{', '.join(stubbed)} {'is' if len(stubbed) == 1 else 'are'} stubbed out"
    return None


def tracked_files(root):
    """The files git tracks under root, and new files it would track (not ignored): what the next commit can
    have. Without git, every file but build and run output."""
    try:
        out = subprocess.run(['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'], cwd=root,
                             capture_output=True, check=True).stdout
        return [f for f in out.decode().split('\0') if f]
    except (OSError, subprocess.CalledProcessError):
        skip = {'.git', 'out', '__pycache__', '.pytest_cache'}
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in skip]
            files += [os.path.relpath(os.path.join(folder, n), root) for n in names
                      if not n.endswith(('.bin', '.pkl', '.pt', '.pyc'))]
        return files


def find_function(tree, qualname):
    """The FunctionDef for 'name' or 'Class.name' at the top level of a module's ast; None if absent."""
    *classes, name = qualname.split('.')
    body = tree.body
    for cls in classes:
        body = next((n.body for n in body if isinstance(n, ast.ClassDef) and n.name == cls), [])
    return next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name), None)


def stub_source(source, qualnames, message):
    """source with the body of each function in qualnames cut down to its docstring plus a raise."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    cuts = []
    for qualname in qualnames:
        fn = find_function(tree, qualname)
        if fn is None:
            raise SystemExit(f"make_student.py: error: {qualname} not found; assignments/stubs.py is out of date")
        first = fn.body[0]
        has_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                   and isinstance(first.value.value, str))
        body = fn.body[1:] if has_doc else fn.body
        start = first.end_lineno if has_doc else first.lineno - 1  # 0-based index of the first line to cut
        while not has_doc and lines[start - 1].strip().startswith('#'):
            start -= 1  # comments that open the body are part of the answer too
        indent = ' ' * (body[0].col_offset if body else first.col_offset)
        cuts.append((start, fn.end_lineno, f'{indent}raise NotImplementedError("{message}")\n'))
    for start, end, stub in sorted(cuts, reverse=True):  # bottom-up, so earlier line numbers stay valid
        lines[start:end] = [stub]
    return ''.join(lines)


def make_student(out, only=None):
    chosen = only or list(ASSIGNMENTS)
    by_file = {}
    for a in chosen:
        for target in ASSIGNMENTS[a][1]:
            path, qualname = target.split('::')
            by_file.setdefault(path, []).append((qualname, stub_marker(a)))
    edits = redactions()
    missing = sorted(rel for rel in edits if not os.path.isfile(os.path.join(ROOT, rel)))
    if missing:
        raise SystemExit(f"make_student.py: error: assignments/key/redactions.py names {', '.join(missing)}, which "
                         f"this repository does not have")
    os.makedirs(out, exist_ok=True)
    shutil.copy2(os.path.join(ROOT, STUDENT_README), os.path.join(out, 'README.md'))
    for rel in tracked_files(ROOT):
        src, dst = os.path.join(ROOT, rel), os.path.join(out, rel)
        if not os.path.isfile(src) or excluded(rel):
            continue  # tracked but deleted in this working tree, or left out of every student copy
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if rel in by_file or rel in edits:
            with open(src, encoding='utf-8') as f:
                text = redact(f.read(), rel, edits.get(rel, []))
            for qualname, message in by_file.get(rel, []):  # one at a time: each cut changes the line numbers
                text = stub_source(text, [qualname], message)
            with open(dst, 'w', encoding='utf-8') as f:
                f.write(text)
        elif rel.endswith('.ipynb'):  # its committed outputs print the measurements the questions ask for
            with open(src, encoding='utf-8') as f:
                notebook = json.load(f)
            for cell in notebook['cells']:
                if cell['cell_type'] == 'code':
                    cell['outputs'], cell['execution_count'] = [], None
            with open(dst, 'w', encoding='utf-8') as f:
                json.dump(notebook, f, indent=1, ensure_ascii=False)
        else:
            shutil.copy2(src, dst)
    return chosen


def get_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda msg: sys.exit(f"make_student.py: error: {msg}")
    p.add_argument('out', help='folder for the student copy (must not exist yet, or be empty)')
    p.add_argument('--only', default=None, help=f"comma-separated assignments, e.g. a1,a3 (of {','.join(ASSIGNMENTS)})")
    return p


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    only = None
    if args.only:
        only = [a.strip().lower() for a in args.only.split(',') if a.strip()]
        unknown = [a for a in only if a not in ASSIGNMENTS]
        if unknown:
            p.error(f"unknown assignment {', '.join(unknown)}: use {', '.join(ASSIGNMENTS)}")
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        p.error(f"{args.out} exists and is not an empty folder; the student copy needs a fresh one")
    if os.path.abspath(args.out).startswith(ROOT + os.sep):
        p.error(f"{args.out} is inside the repository; write the student copy somewhere else")
    why = stripped_reason()
    if why:
        p.error(f"{ROOT} is not the instructor's repository ({why}); run make_student.py from the reference checkout")
    chosen = make_student(args.out, only)
    print(f"wrote a student copy to {args.out}, with {', '.join(chosen)} to write:")
    for a in chosen:
        title, targets = ASSIGNMENTS[a]
        print(f"  {a} {title}: {', '.join(targets)}")
    print(f"next: cd {args.out} && python -m pytest -q assignments   (every grader fails until its assignment is done)")


if __name__ == '__main__':
    main()
