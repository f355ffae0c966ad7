"""The Gradescope autograder archive (assignments/autograder/build.py): its layout, its points against the
handout's table, and its run_autograder run locally (AUTOGRADER_ROOT in a temporary folder, the Python running
these tests, setup.sh not run) on the reference code (full marks), a fresh student copy (zero) and a broken
submission (zero, with a reason, and still a results.json)."""

import importlib.util
import json
import os
import pathlib
import re
import stat
import sys
import zipfile

import pytest

from conftest import ROOT, run_together

spec = importlib.util.spec_from_file_location('autograder_build',
                                              os.path.join(ROOT, 'assignments', 'autograder', 'build.py'))
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)  # it puts assignments/ on sys.path, for make_student and stubs
import make_student  # noqa: E402
from stubs import ASSIGNMENTS  # noqa: E402

spec = importlib.util.spec_from_file_location('autograder_grade',
                                              os.path.join(ROOT, 'assignments', 'autograder', 'grade.py'))
grade = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grade)


def handout_table():
    """{'A1': points, ...} read here from the handout's table, independently of build.py's parser."""
    with open(os.path.join(ROOT, 'assignments', 'README.md'), encoding='utf-8') as f:
        rows = [line.split('|') for line in f if re.match(r'\|\s*A\d+\s*\|', line)]
    return {cells[1].strip(): int(cells[3]) for cells in rows}


@pytest.fixture(scope='module')
def archive(tmp_path_factory):
    out = tmp_path_factory.mktemp('archive') / 'autograder.zip'
    manifest = build.build(str(out))
    return out, manifest


def unpack(zip_path, root):
    """Unpack as Gradescope does, into root/source, keeping the archive's Unix modes (zipfile drops them)."""
    source = root / 'source'
    with zipfile.ZipFile(zip_path) as z:
        for info in z.infolist():
            z.extract(info, source)
            mode = info.external_attr >> 16
            if mode:
                os.chmod(source / info.filename, mode & 0o777)
    return source


def autograder(zip_path, root, files):
    """Popen's arguments that grade {submission path: text} with the archive's run_autograder in root."""
    source = unpack(zip_path, root)
    for rel, text in files.items():
        path = root / 'submission' / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return dict(args=[str(source / 'run_autograder')],
                env=dict(os.environ, AUTOGRADER_ROOT=str(root), AUTOGRADER_PYTHON=sys.executable))


@pytest.fixture(scope='module')
def graded(archive, tmp_path_factory):
    """results.json of the three submissions the tests below grade: the reference, a fresh student copy (one
    folder down, as in an upload of a zipped folder) and a looped.py that does not parse. The three graders run
    at once (run_together)."""
    zip_path, manifest = archive
    student = tmp_path_factory.mktemp('student')
    make_student.make_student(str(student))
    submissions = {
        'reference': {rel: pathlib.Path(ROOT, rel).read_text(encoding='utf-8') for rel in manifest['submission_files']},
        'fresh': {f'my-copy/{rel}': (student / rel).read_text() for rel in manifest['submission_files']},
        'broken': {'looped.py': 'def oops(:\n'}}
    roots = {name: tmp_path_factory.mktemp(name) for name in submissions}
    done = run_together(*[autograder(zip_path, roots[name], files) for name, files in submissions.items()])
    results = {}
    for name, (code, out, err) in zip(submissions, done):
        assert code == 0, out[-3000:] + err[-3000:]
        with open(roots[name] / 'results' / 'results.json') as f:
            results[name] = json.load(f)
    return results


def test_archive_has_gradescopes_files_and_no_reference_solution(archive):
    zip_path, manifest = archive
    with zipfile.ZipFile(zip_path) as z:
        names = set(z.namelist())
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
        setup = z.read('setup.sh').decode()
        repo_code = {f: z.read(f'repo/{f}').decode() for f in manifest['submission_files']}
    for name in ('setup.sh', 'run_autograder'):
        assert name in names and modes[name] & stat.S_IXUSR, f"{name} missing or not executable"
    # setup.sh installs the pins students use (not a list of its own), with torch from the CPU index
    assert 'requirements.txt' in setup and 'download.pytorch.org/whl/cpu' in setup and "'^torch=='" in setup
    assert 'repo/requirements.txt' in names
    # the repository copy is the student copy: every function students write is a stub, no key, no tests/
    for a, (_, targets) in ASSIGNMENTS.items():
        files = {t.split('::')[0] for t in targets}
        assert all(make_student.stub_marker(a) in repo_code[f] for f in files), f"{a}'s reference code ships"
    assert not any(n.startswith(('repo/assignments/key/', 'repo/tests/', 'repo/figures/', 'repo/.git/',
                                 'repo/assignments/autograder/')) for n in names)
    assert manifest['submission_files'] == sorted({t.split('::')[0] for _, ts in ASSIGNMENTS.values() for t in ts})


def test_points_add_up_to_the_handouts_table(archive):
    _, manifest = archive
    table = handout_table()
    assert set(table) == {a.upper() for a in ASSIGNMENTS} | set(manifest['graded_by_hand']), table
    for a in manifest['assignments']:
        cents = [t['cents'] for t in a['tests']]
        assert sum(cents) == 100 * table[a['name']], f"{a['name']}: {sum(cents)} hundredths"
        assert max(cents) - min(cents) <= 1, f"{a['name']}: not an even split: {cents}"
    assert manifest['autograded_total'] + sum(manifest['graded_by_hand'].values()) == sum(table.values())
    assert manifest['handout_total'] == sum(table.values())
    assert build.split_cents(10, 7) == [143, 143, 143, 143, 143, 143, 142]


def test_the_reference_scores_full_marks(archive, graded):
    _, manifest = archive
    results = graded['reference']
    failed = [(t['name'], t['output'][:300]) for t in results['tests'] if t['status'] != 'passed']
    assert not failed, failed
    n = sum(len(a['tests']) for a in manifest['assignments'])
    assert len(results['tests']) == n and results['score'] == manifest['autograded_total']
    assert sum(t['max_score'] for t in results['tests']) == pytest.approx(manifest['autograded_total'], abs=1e-9)
    assert sum(t['score'] for t in results['tests']) == pytest.approx(results['score'], abs=1e-9)


def test_a_fresh_student_copy_scores_zero(archive, graded):
    """Each test fails on its assignment's NotImplementedError (no test passes vacuously); the files are found
    one folder down, as in an upload of a zipped folder."""
    _, manifest = archive
    results = graded['fresh']
    assert results['score'] == 0 and all(t['score'] == 0 for t in results['tests'])
    other = [t['name'] for t in results['tests'] if 'NotImplementedError' not in t['output']]
    assert not other, f"failed for another reason than the stub: {other}"
    assert sum(t['max_score'] for t in results['tests']) == pytest.approx(manifest['autograded_total'], abs=1e-9)


def test_a_broken_submission_scores_zero_with_a_reason(archive, graded):
    """looped.py that does not parse and no lab/diagnose.py: every grader fails to import, and results.json says
    why for every test instead of the run crashing without one."""
    _, manifest = archive
    results = graded['broken']
    assert results['score'] == 0 and len(results['tests']) == sum(len(a['tests']) for a in manifest['assignments'])
    assert all('could not be imported' in t['output'] for t in results['tests'])
    assert 'lab/diagnose.py is not in the submission' in results['output']


def test_submitted_files_are_found_once_and_only_once(tmp_path):
    (tmp_path / 'a').mkdir()
    (tmp_path / 'a' / 'looped.py').write_text('')
    assert grade.find_submitted(str(tmp_path), 'looped.py')[0] == str(tmp_path / 'a' / 'looped.py')
    (tmp_path / 'b').mkdir()
    (tmp_path / 'b' / 'looped.py').write_text('')
    path, why = grade.find_submitted(str(tmp_path), 'looped.py')
    assert path is None and '2 files named looped.py' in why
    (tmp_path / 'looped.py').write_text('')  # one at the top level wins
    assert grade.find_submitted(str(tmp_path), 'looped.py')[0] == str(tmp_path / 'looped.py')


def test_a_test_passes_only_if_every_phase_it_ran_passed():
    """The verdict grade.py gives from the recorded phases: a setup error, a skip, and a test stopped by the
    timeout inside its call (setup recorded, no call) all score 0 and say which."""
    def phase(when, outcome, message=''):
        return {'when': when, 'outcome': outcome, 'message': message, 'details': ''}
    ok = [phase('setup', 'passed'), phase('call', 'passed'), phase('teardown', 'passed')]
    assert grade.verdict(ok, None, 'x') == (True, 'passed')
    setup_error = [phase('setup', 'failed', 'NotImplementedError: a5'), phase('teardown', 'passed')]
    assert grade.verdict(setup_error, None, 'x') == (False, 'failed (in its setup): NotImplementedError: a5')
    assert grade.verdict([phase('setup', 'skipped', 'no data')], None, 'x') == (False, 'skipped: no data')
    assert grade.verdict([phase('setup', 'passed')], None, 'stopped') == (False, 'did not finish: stopped')
    collect_error = {'message': 'SyntaxError: invalid syntax', 'details': ''}
    assert 'could not be imported: SyntaxError' in grade.verdict([], collect_error, 'x')[1]
    assert grade.verdict([], None, 'stopped') == (False, 'not run: stopped')
