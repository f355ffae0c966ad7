"""
Build the autograder archive for Gradescope (a programming assignment's "Autograder (.zip)" upload).

    python assignments/autograder/build.py /tmp/autograder.zip

The archive holds, at its root, what Gradescope asks for and what the runner needs:

    setup.sh              installs the pinned requirements (repo/requirements.txt, CPU torch) into a venv
    run_autograder        grades one submission: runs grade.py, which writes results/results.json
    grade.py              copies the submitted files over a scratch copy of repo/, runs the graders, scores
    gradescope_record.py  the pytest plugin that records each test's outcome for grade.py
    manifest.json         every grader test with its points, and which files a submission consists of
    repo/                 the student copy of this repository (make_student.py's output): graders and data, and
                          stubs in place of the functions students write, so no reference solution ships

Points come from the handout's table (assignments/README.md): each autograded assignment's points are split
evenly among its grader's tests, in whole hundredths (the first tests get the odd hundredths), so the tests'
points add up to the table's exactly. A9 and the written answers are graded by hand and are not in the archive.

Like make_student.py it runs only from the instructor's repository (a git checkout with the reference code).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # make_student.py and stubs.py live in assignments/
import make_student  # noqa: E402
from stubs import ASSIGNMENTS  # noqa: E402

HANDOUT = os.path.join(ROOT, 'assignments', 'README.md')
RUNNER = ['setup.sh', 'run_autograder', 'grade.py', 'gradescope_record.py']  # copied from here as they are
EXECUTABLE = {'setup.sh', 'run_autograder'}
# a handout table row: | A1 | Readouts and scale invariance | 10 | ... (the written-questions row has no number)
ROW = re.compile(r'^\|\s*(A\d+)\s*\|\s*([^|]*?)\s*\|\s*(\d+)\s*\|', re.M)


def handout_points(path=HANDOUT):
    """{'A1': (title, points), ...}: every numbered row of the handout's points table, A9 included."""
    with open(path, encoding='utf-8') as f:
        return {name: (title, int(points)) for name, title, points in ROW.findall(f.read())}


def split_cents(points, n):
    """points split into n shares of whole hundredths that add up to points exactly (10 over 7 tests: 1.43 for
    the first three, 1.42 for the other four): Gradescope adds the shares, and floats would not sum back."""
    base, extra = divmod(round(points * 100), n)
    return [base + (i < extra) for i in range(n)]


def collect(repo):
    """Every grader test id in repo, in pytest's order, as pytest names them (file::test[param])."""
    r = subprocess.run([sys.executable, '-m', 'pytest', '--collect-only', '-q', '-p', 'no:cacheprovider',
                        os.path.join('assignments', 'tests')], cwd=repo, capture_output=True, text=True)
    ids = [line.strip() for line in r.stdout.splitlines() if '::' in line]
    if r.returncode != 0 or not ids:
        raise SystemExit(f"build.py: error: the graders do not collect in the student copy:\n{r.stdout[-3000:]}"
                         f"{r.stderr[-3000:]}")
    return ids


def manifest_for(test_ids, points):
    """The manifest grade.py scores from: per autograded assignment, its tests and their points."""
    assignments = []
    for i, a in enumerate(ASSIGNMENTS, 1):
        name = a.upper()
        if name not in points:
            raise SystemExit(f"build.py: error: {name} has a grader but no row in the handout's points table")
        mine = [t for t in test_ids if os.path.basename(t.split('::')[0]).startswith(f'test_{a}_')]
        if not mine:
            raise SystemExit(f"build.py: error: {name}'s grader has no tests")
        title, total = points[name]
        tests = [{'id': t, 'number': f'{i}.{j}', 'cents': c}
                 for j, (t, c) in enumerate(zip(mine, split_cents(total, len(mine))), 1)]
        assignments.append({'name': name, 'title': title, 'points': total, 'tests': tests})
    by_hand = {name: p for name, (_, p) in points.items() if name.lower() not in ASSIGNMENTS}
    # a submission is the files that hold the functions students write; everything else comes from repo/
    files = sorted({target.split('::')[0] for _, targets in ASSIGNMENTS.values() for target in targets})
    return {
        'handout_total': sum(p for _, p in points.values()),
        'autograded_total': sum(a['points'] for a in assignments),
        'graded_by_hand': by_hand,
        'not_autograded': ' '.join(f"{n} ({p} points) is graded by hand." for n, p in by_hand.items()) +
                          ' The written answers (assignments/ANSWERS.md) are graded by hand.',
        'submission_files': files,
        'assignments': assignments,
    }


def write_zip(folder, out):
    """Zip folder's contents (not the folder itself: Gradescope wants setup.sh at the root), with fixed
    timestamps and sorted entries so the same repository gives the same archive, and Unix modes kept so that
    run_autograder and setup.sh stay executable."""
    tmp = out + '.tmp'
    with zipfile.ZipFile(tmp, 'w', zipfile.ZIP_DEFLATED) as z:
        for dirpath, dirs, files in os.walk(folder):
            dirs.sort()
            for name in sorted(files):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, folder).replace(os.sep, '/')
                info = zipfile.ZipInfo(rel, date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                info.external_attr = (0o100755 if rel in EXECUTABLE else 0o100644) << 16
                with open(path, 'rb') as f:
                    z.writestr(info, f.read())
    os.replace(tmp, out)  # never leave a half-written archive under the name asked for


def build(out):
    why = make_student.stripped_reason()
    if why:
        raise SystemExit(f"build.py: error: {ROOT} is not the instructor's repository ({why}); the archive needs "
                         "the reference checkout")
    with tempfile.TemporaryDirectory(prefix='autograder-build-') as tmp:
        stage = os.path.join(tmp, 'archive')
        repo = os.path.join(stage, 'repo')
        make_student.make_student(repo)  # the graders run against this, with the submitted files copied in
        shutil.rmtree(os.path.join(repo, 'assignments', 'autograder'), ignore_errors=True)  # this builder
        manifest = manifest_for(collect(repo), handout_points())
        for name in RUNNER:
            shutil.copyfile(os.path.join(HERE, name), os.path.join(stage, name))
        with open(os.path.join(stage, 'manifest.json'), 'w', encoding='utf-8') as f:
            json.dump(manifest, f, indent=1)
        for cache in ('.pytest_cache', '__pycache__'):  # left by the collection run
            for dirpath, dirs, _ in os.walk(stage):
                if cache in dirs:
                    shutil.rmtree(os.path.join(dirpath, cache))
                    dirs.remove(cache)
        write_zip(stage, out)
    return manifest


def get_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda msg: sys.exit(f"build.py: error: {msg}")
    p.add_argument('out', help='the archive to write, e.g. /tmp/autograder.zip')
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    out = os.path.abspath(args.out)
    if out.startswith(ROOT + os.sep):
        sys.exit(f"build.py: error: {args.out} is inside the repository; write the archive somewhere else")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    m = build(out)
    n = sum(len(a['tests']) for a in m['assignments'])
    print(f"wrote {args.out}: {n} tests of {', '.join(a['name'] for a in m['assignments'])} worth "
          f"{m['autograded_total']} of the handout's {m['handout_total']} points; {m['not_autograded']}")
    print(f"a submission is {', '.join(m['submission_files'])} (anywhere in the upload; nothing else is used)")


if __name__ == '__main__':
    main()
