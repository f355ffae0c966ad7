"""The instructor check for assignments/: the student copy, graders that cannot pass vacuously, answer checking."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, 'assignments'))  # make_student.py imports its list as plain 'stubs'
import check_answers  # noqa: E402
import make_student  # noqa: E402
from stubs import ASSIGNMENTS  # noqa: E402


def grader(assignment):
    (path,) = glob.glob(os.path.join(ROOT, 'assignments', 'tests', f'test_{assignment}_*.py'))
    return os.path.relpath(path, ROOT)


def run(cmd, cwd):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr


def outcome(output):
    """{'passed': n, 'failed': n, 'error': n} from pytest's closing line."""
    return {word: int(n) for n, word in re.findall(r'(\d+) (passed|failed|error)', output.strip().splitlines()[-1])}


def test_every_assignment_has_a_grader_and_its_functions_exist():
    import ast
    for a, (_, targets) in ASSIGNMENTS.items():
        assert grader(a)
        for target in targets:
            path, qualname = target.split('::')
            with open(os.path.join(ROOT, path)) as f:
                assert make_student.find_function(ast.parse(f.read()), qualname) is not None, target


@pytest.mark.parametrize('assignment', list(ASSIGNMENTS))
def test_stripping_one_assignment_fails_every_test_of_its_grader(assignment, tmp_path):
    make_student.make_student(str(tmp_path), [assignment])
    code, out = run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', grader(assignment)], tmp_path)
    counts = outcome(out)
    assert code != 0 and counts.get('passed', 0) == 0 and counts.get('failed', 0) + counts.get('error', 0) > 0, out[-3000:]
    assert f'NotImplementedError: {assignment}: see assignments/README.md' in out


def test_the_full_student_copy_imports_and_fails_every_grader(tmp_path):
    make_student.make_student(str(tmp_path))
    for name, _ in ASSIGNMENTS.items():
        assert f'{name}: see assignments/README.md' in ''.join(
            open(tmp_path / t.split('::')[0]).read() for t in ASSIGNMENTS[name][1])
    code, out = run([sys.executable, '-c', 'import looped, train, sample, diagnose, plot_norms, bench'], tmp_path)
    assert code == 0, out
    code, out = run([sys.executable, 'train.py', '--help'], tmp_path)
    assert code == 0 and '--readout' in out, out
    code, out = run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', 'assignments'], tmp_path)
    counts = outcome(out)
    assert code != 0 and counts.get('passed', 0) == 0, out[-3000:]
    assert not os.path.exists(tmp_path / '.git') and not glob.glob(str(tmp_path / 'data' / '*' / '*.bin'))


def test_reference_files_carry_no_solution_markers():
    for path in ('looped.py', 'diagnose.py'):
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        assert not re.search(r'\ba[1-8]\b|assignment|solution|student|TODO', text, flags=re.I), path


def test_make_student_refuses_a_used_folder_and_unknown_assignments(tmp_path):
    (tmp_path / 'x').write_text('keep me')
    with pytest.raises(SystemExit, match='not an empty folder'):
        make_student.main([str(tmp_path)])
    with pytest.raises(SystemExit, match='unknown assignment a9'):
        make_student.main([str(tmp_path / 'new'), '--only', 'a1,a9'])
    assert (tmp_path / 'x').read_text() == 'keep me' and not (tmp_path / 'new').exists()


def test_check_answers_compares_with_the_students_own_runs(tmp_path, capsys):
    def log(folder, record):
        os.makedirs(tmp_path / folder)
        with open(tmp_path / folder / 'log.jsonl', 'w') as f:
            f.write(json.dumps({'config': {'model': {'n_loop': 4}}}) + '\n' + json.dumps(record) + '\n')
    log('laptop', {'hidden_norm': [1, 2, 3, 930.7]})
    log('laptop-pen0.01', {'hidden_norm': [1, 2, 3, 30.0]})
    answers = tmp_path / 'ANSWERS.md'
    answers.write_text('a5_rmsnorm_norm_K = 931\na5_penalty_norm_K = 45\na6_alpha_per_loop = ?\n')
    assert check_answers.main([str(answers), '--runs', str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert re.search(r'a5_rmsnorm_norm_K\s+ok', out) and 'you wrote 45' in out and 'no ' in out
    assert '1 of 6 numbers match' in out
