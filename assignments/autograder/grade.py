"""
Grade one submission and write Gradescope's results.json. This file runs inside the autograder archive that
build.py writes (run_autograder calls it); next to it lie manifest.json (the tests and their points, fixed at
build time) and repo/ (the student copy of the repository: graders, stubs, data; no reference solutions).

    AUTOGRADER_ROOT=/tmp/ag python /tmp/ag/source/grade.py      # what run_autograder does, with a local root

The layout under the root is Gradescope's: source/ (the unpacked archive), submission/ (the student's files),
results/results.json (written here). Each can also be given by a flag, to grade a folder by hand.

What is graded: the files named in the manifest's submission_files (looped.py, lab/engine.py,
lab/diagnose.py, lab/designs.py), copied from the submission over a scratch copy of repo/. Nothing else of the
submission is used, so a submission cannot bring its own graders, grading.py or training code.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TAIL = 4000  # characters of pytest's own output kept in results.json (the end has the summary)


def find_submitted(submission, rel):
    """(path, None) of the submitted file for repository path rel, or (None, why not). The file is looked for
    at rel itself, then by its name anywhere in the submission: an upload of a zipped folder, or a GitHub
    repository with the code one level down, puts it there. Two files of the same name are ambiguous."""
    exact = os.path.join(submission, rel)
    if os.path.isfile(exact):
        return exact, None
    name = os.path.basename(rel)
    hits = sorted(os.path.join(folder, name) for folder, dirs, files in os.walk(submission)
                  if name in files and '__MACOSX' not in folder.split(os.sep))  # macOS zips add resource forks
    if len(hits) == 1:
        return hits[0], None
    if not hits:
        return None, f"{rel} is not in the submission; its assignments are graded on the unwritten stub"
    found = ', '.join(os.path.relpath(h, submission) for h in hits)
    return None, f"{len(hits)} files named {name} in the submission ({found}); submit one, at the top level"


def run_graders(work, record, timeout):
    """Run every grader in the work copy with the recording plugin. Returns (pytest's output, a note if it did
    not finish normally). The plugin writes as it goes, so a timeout loses only the tests that had not run."""
    env = dict(os.environ, AUTOGRADER_RECORD=record,
               PYTHONPATH=os.pathsep.join(p for p in [HERE, os.environ.get('PYTHONPATH')] if p))
    # --continue-on-collection-errors: a lab/diagnose.py that does not import must cost A2 and A7 only, not stop
    # pytest before the graders that need looped.py alone have run
    cmd = [sys.executable, '-m', 'pytest', '-q', '--tb=short', '-p', 'no:cacheprovider', '-p', 'gradescope_record',
           '--continue-on-collection-errors', os.path.join('assignments', 'tests')]
    try:
        r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors='replace') if isinstance(e.stdout, bytes) else (e.stdout or '')
        return out, (f"the graders were stopped after {timeout:.0f} s (does a function loop forever?); tests "
                     "that had not finished score 0")
    note = None
    if r.returncode not in (0, 1):  # 0: all passed, 1: some failed; anything else: pytest itself broke
        note = f"pytest exited with code {r.returncode}; tests it did not report score 0"
    return r.stdout + r.stderr, note


def read_record(record):
    """{nodeid: [phase records]} and {grader file: collection error record} from the plugin's JSON lines."""
    tests, collect = {}, {}
    if os.path.exists(record):
        with open(record, encoding='utf-8') as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a kill
                if 'collect' in r:
                    collect[r['collect']] = r
                else:
                    tests.setdefault(r['nodeid'], []).append(r)
    return tests, collect


def verdict(phases, collect_error, fallback):
    """(passed, output) of one test: it passes only if its call ran and passed and no phase failed (a fixture
    that errors in setup or teardown fails the test too; a skip scores nothing, and no grader skips)."""
    if not phases:
        if collect_error:
            return False, f"not run: its grader could not be imported: {collect_error['message']}\n\n" \
                          f"{collect_error['details']}".rstrip()
        return False, f"not run: {fallback}"
    failed = [p for p in phases if p['outcome'] == 'failed']
    if failed:
        p = failed[0]
        where = '' if p['when'] == 'call' else f" (in its {p['when']})"
        return False, f"failed{where}: {p['message']}\n\n{p['details']}".rstrip()
    skipped = next((p for p in phases if p['outcome'] == 'skipped'), None)
    if skipped:
        return False, f"skipped: {skipped['message']}"
    if not any(p['when'] == 'call' for p in phases):
        return False, f"did not finish: {fallback}"  # its setup ran, then the run was stopped inside it
    return True, 'passed'


def grade(source, submission, results, timeout):
    start = time.time()
    with open(os.path.join(source, 'manifest.json'), encoding='utf-8') as f:
        manifest = json.load(f)
    notes = []
    with tempfile.TemporaryDirectory(prefix='autograder-') as tmp:
        # a scratch copy, so that grading twice (or a submission that writes into the repository) starts clean
        work = os.path.join(tmp, 'repo')
        shutil.copytree(os.path.join(source, 'repo'), work)
        for rel in manifest['submission_files']:
            path, why = find_submitted(submission, rel)
            if path is None:
                notes.append(why)
            else:
                shutil.copyfile(path, os.path.join(work, rel))
                notes.append(f"graded {rel} from submission/{os.path.relpath(path, submission)}")
        record = os.path.join(tmp, 'record.jsonl')  # outside the work copy: the graders' cwd never lists it
        output, problem = run_graders(work, record, timeout)
        tests, collect = read_record(record)
    if problem:
        notes.append(problem)
    fallback = problem or "pytest did not report this test (see the output at the top)"

    entries, cents, max_cents = [], 0, 0
    for a in manifest['assignments']:
        for t in a['tests']:
            grader_file = t['id'].split('::')[0]
            passed, out = verdict(tests.get(t['id'], []), collect.get(grader_file), fallback)
            # points are whole hundredths (build.py splits them so), so the sums below are exact
            max_cents += t['cents']
            cents += t['cents'] if passed else 0
            entries.append({'name': f"{a['name']} {t['id'].split('::', 1)[1]}", 'number': t['number'],
                            'score': (t['cents'] if passed else 0) / 100, 'max_score': t['cents'] / 100,
                            'status': 'passed' if passed else 'failed', 'output': out, 'visibility': 'visible'})
    summary = (f"{cents / 100:g} of {max_cents / 100:g} points from the graders of "
               f"{manifest['assignments'][0]['name']}-{manifest['assignments'][-1]['name']}. "
               f"{manifest['not_autograded']}")
    report = {
        'score': cents / 100,
        'output': '\n'.join([summary, *notes, '', 'pytest output (the end):', output[-TAIL:]]),
        'visibility': 'visible',
        'stdout_visibility': 'visible',
        'execution_time': round(time.time() - start, 1),
        'tests': entries,
    }
    os.makedirs(os.path.dirname(results), exist_ok=True)
    with open(results, 'w', encoding='utf-8') as f:
        json.dump(report, f, indent=1)
    print(summary)
    for note in notes:
        print(note)
    return report


def main(argv=None):
    root = os.environ.get('AUTOGRADER_ROOT', '/autograder')
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--source', default=HERE, help='the unpacked archive (default: the folder of this file)')
    p.add_argument('--submission', default=os.path.join(root, 'submission'),
                   help='the submitted files (default: $AUTOGRADER_ROOT/submission, root /autograder)')
    p.add_argument('--results', default=os.path.join(root, 'results', 'results.json'),
                   help='where results.json goes (default: $AUTOGRADER_ROOT/results/results.json)')
    p.add_argument('--timeout', type=float, default=float(os.environ.get('AUTOGRADER_TIMEOUT', 900)),
                   help='seconds for all graders together (default: $AUTOGRADER_TIMEOUT or 900)')
    args = p.parse_args(argv)
    grade(args.source, args.submission, args.results, args.timeout)


if __name__ == '__main__':
    main()
