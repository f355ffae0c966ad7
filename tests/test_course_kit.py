"""The instructor check for assignments/: the student copy (no answers in it), graders that cannot pass
vacuously and that catch known wrong implementations (the mutation suite), answer checking, the handout's
lab/diagnose.py commands."""

import ast
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, run_together

sys.path.insert(0, os.path.join(ROOT, 'assignments'))  # make_student.py imports its list as plain 'stubs'
import check_answers  # noqa: E402
import make_student  # noqa: E402
from stubs import ASSIGNMENTS  # noqa: E402

KEY = os.path.join(ROOT, 'assignments', 'key')


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
    for a, (_, targets) in ASSIGNMENTS.items():
        assert grader(a)
        for target in targets:
            path, qualname = target.split('::')
            with open(os.path.join(ROOT, path)) as f:
                assert make_student.find_function(ast.parse(f.read()), qualname) is not None, target


def test_every_grader_assertion_carries_a_message():
    """No bare asserts (whose failure would print tensors and no advice), and pytest's introspection is off."""
    for path in glob.glob(os.path.join(ROOT, 'assignments', 'tests', 'test_a*.py')):
        with open(path) as f:
            tree = ast.parse(f.read())
        assert 'PYTEST_DONT_REWRITE' in ast.get_docstring(tree), path
        bare = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert) and n.msg is None]
        assert not bare, f"{os.path.relpath(path, ROOT)}: asserts without a message on lines {bare}"


def test_mutation_suite_every_wrong_implementation_fails_its_grader(capsys):
    """assignments/key/mutations.py: the reference passes every grader; each assignment stripped as in the
    student copy fails every test of its grader with its NotImplementedError; and every known wrong
    implementation fails its grader with a message (not a dump of tensors)."""
    # two processes at once, each with about half of the mutations (counted in the list's text), so that on two
    # cores the wait is halved; every assignment is in exactly one half
    with open(os.path.join(KEY, 'mutations.py'), encoding='utf-8') as f:
        entries = re.findall(r"^\s*\('(a\d+)', ", f.read(), re.M)
    halves = [[], []]
    for a in sorted(ASSIGNMENTS, key=entries.count, reverse=True):
        min(halves, key=lambda half: sum(map(entries.count, half))).append(a)
    done = run_together(*[dict(args=[sys.executable, os.path.join('assignments', 'key', 'mutations.py'), '--stubs',
                                     f"--only={','.join(half)}"], cwd=ROOT) for half in halves])
    out = ''.join(o for _, o, _ in done)
    records = [json.loads(line) for line in out.splitlines() if line.startswith('{')]
    summary = [line for line in out.splitlines() if line.startswith('mutation suite:')]
    with capsys.disabled():
        print(f"\n{' | '.join(summary) if summary else 'mutation suite: no summary'}")
    for code, half_out, half_err in done:
        assert code == 0, (half_out + half_err)[-4000:]
    stubbed = {r['stubbed']: r for r in records if 'stubbed' in r}
    assert sorted(stubbed) == sorted(ASSIGNMENTS)
    for a, r in stubbed.items():
        assert r['passed'] == 0 and r['failed'] > 0 and r['all_not_implemented'], r
    mutations = [r for r in records if 'mutation' in r]
    missed = [f"{r['assignment']}: {r['mutation']}" for r in mutations if not r['caught']]
    assert not missed, f"wrong implementations that pass their grader: {missed}"
    unhinted = [f"{r['assignment']}: {r['mutation']}: {r['first'][:200]!r} lacks {r['hint']!r}" for r in mutations
                if 'hint' in r and not r['hint_given']]
    assert not unhinted, f"caught, but without the grader's own hint: {unhinted}"
    assert sum('hint' in r for r in mutations) >= 4, "the A5 mutations that name their grader's hint"
    assert len(mutations) >= 80 and {r['assignment'] for r in mutations} == set(ASSIGNMENTS), summary
    per_assignment = {a: sum(r['assignment'] == a for r in mutations) for a in ASSIGNMENTS}
    assert per_assignment['a8'] >= 8, per_assignment
    blamed = [f"{r['assignment']}: {r['mutation']} failed {r['failed_in']}" for r in mutations
              if r['failed_in'] != [grader(r['assignment'])]]
    assert not blamed, f"wrong implementations charged to another grader than their assignment's: {blamed}"
    dumps = [r['mutation'] for r in mutations if 'tensor(' in r['first'] or len(r['first']) < 40]
    assert not dumps, f"caught, but with a tensor dump or no explanation: {dumps}"
    assert len(summary) == 2, summary
    counts = [tuple(map(int, re.search(r'(\d+) tried, (\d+) caught', line).groups())) for line in summary]
    tried, caught = sum(t for t, _ in counts), sum(c for _, c in counts)
    assert tried == caught == len(mutations)
    with open(os.path.join(ROOT, 'assignments', 'README.md')) as f:
        assert f"{tried} known wrong implementations" in f.read(), "the handout must state the mutation count"


def test_the_full_student_copy_imports_and_fails_every_grader(tmp_path):
    make_student.make_student(str(tmp_path))
    for name, _ in ASSIGNMENTS.items():
        assert f'{name}: see assignments/README.md' in ''.join(
            open(tmp_path / t.split('::')[0]).read() for t in ASSIGNMENTS[name][1])
    # every script imports, and train.py's parser builds (one process: each start costs seconds of torch import)
    code, out = run([sys.executable, '-c', "import looped, train, sample, plot_norms; "
                     "from lab import diagnose, bench, engine; "
                     "train.get_parser().parse_args(['--help'])"], tmp_path)
    assert code == 0 and '--readout' in out, out
    # --tb=line: formatting 77 full tracebacks was half of this test's time; test_autograder reads each failure
    code, out = run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '--tb=line', 'assignments'],
                    tmp_path)
    counts = outcome(out)
    assert code != 0 and counts.get('passed', 0) == 0, out[-3000:]
    assert not os.path.exists(tmp_path / '.git') and not glob.glob(str(tmp_path / 'data' / '*' / '*.bin'))


def student_text(folder):
    """{relative path: text} for every file of a student copy that reads as UTF-8."""
    texts = {}
    for path in glob.glob(os.path.join(folder, '**', '*'), recursive=True):
        if os.path.isfile(path):
            try:
                with open(path, encoding='utf-8') as f:
                    texts[os.path.relpath(path, folder)] = f.read()
            except UnicodeDecodeError:
                pass
    return texts


def handout_questions():
    """['A1 Q1', 'A1 Q2', ...]: every numbered written question of the handout, read from its Written paragraphs."""
    with open(os.path.join(ROOT, 'assignments', 'README.md'), encoding='utf-8') as f:
        handout = f.read()
    questions = []
    for name, section in re.findall(r'^## (A\d+)\.(.*?)(?=^## )', handout, flags=re.M | re.S):
        written = re.search(r'\*\*Written\b.*?(?=\n\n|\Z)', section, flags=re.S)
        if written:
            questions += [f"{name} Q{n}" for n in dict.fromkeys(re.findall(r'\((\d)\) ', written.group(0)))]
    return questions


def normalized(text):
    return re.sub(r'\s+', ' ', text.replace('`', '')).lower()


def test_the_student_copy_states_no_answer(tmp_path):
    """No figures, no answer key, no instructor section, the student README instead of the project's, and none of
    the answer markers the key lists for each written question (read from key.json, each checked to be in the
    key's prose), nor the project README's result numbers, anywhere in the copy."""
    make_student.make_student(str(tmp_path))
    assert not (tmp_path / 'figures').exists() and not (tmp_path / 'assignments' / 'key').exists()
    assert not (tmp_path / 'tests').exists() and not (tmp_path / 'assignments' / 'STUDENT_README.md').exists()
    with open(os.path.join(ROOT, 'assignments', 'STUDENT_README.md')) as f:
        assert (tmp_path / 'README.md').read_text() == f.read()
    with open(os.path.join(KEY, 'key.json')) as f:
        key = json.load(f)
    with open(os.path.join(KEY, 'KEY.md')) as f:
        prose = normalized(re.sub(r'(?<![\w)])\*|\*(?![\w(])', ' ', f.read()))  # the italics' asterisks only
    questions = handout_questions()
    assert len(questions) >= 14 and sorted(key['questions']) == sorted(questions), \
        f"key.json's questions {sorted(key['questions'])} against the handout's {questions}"
    for q, markers in key['questions'].items():
        phrases = [m for m in markers if re.search(r'[a-z]{3}', m, flags=re.I)]
        assert phrases, f"{q}: no key phrase among its markers, only numbers"
        for m in markers:  # each marker is the key's own words, so the grep below means something
            assert normalized(m) in prose, f"{q}: marker {m!r} is not in KEY.md"
    numbers = set(key['grep_numbers']) | {str(v['reference']) for v in key['numbers'].values()}
    numbers |= {str(x) for v in key['numbers'].values() if v['range'] for x in v['range']}
    # the project README's result tables: every number with a decimal point in a table row
    with open(os.path.join(ROOT, 'README.md')) as f:
        readme_numbers = {n for line in f if line.startswith('|') for n in re.findall(r'\d+\.\d+', line)
                          if len(n.replace('.', '').strip('0')) >= 3}  # 2.244, 30.7, 0.305; not 0.01, 1.5 or 10.0
    texts = {rel: normalized(t) for rel, t in student_text(tmp_path).items()}
    found = []
    for n in sorted(numbers | readme_numbers | {m for ms in key['questions'].values() for m in ms
                                                 if re.fullmatch(r'[\d.]+', m)}):
        pattern = re.compile(r'(?<![\d.])' + re.escape(n) + r'(?![\d])')
        found += [f"{n} in {rel}" for rel, t in texts.items() if pattern.search(t)]
    for q, markers in key['questions'].items():
        for m in markers:
            if not re.fullmatch(r'[\d.]+', m):
                found += [f"{q}: '{m}' in {rel}" for rel, t in texts.items() if normalized(m) in t]
    for rel, t in texts.items():
        if 'for instructors' in t or 'assignments/key' in t:
            found.append(f"an instructor section or a pointer to the key in {rel}")
    assert not found, f"the student copy states answers: {found[:20]}"
    assert len(numbers) >= 15 and len(readme_numbers) >= 20  # the check has something to find


def test_the_student_copy_refers_to_no_file_it_does_not_have(tmp_path):
    """Every path of the instructor's repository that the copy leaves out (files and their folders: tests/,
    docs/, figures/, the key, the autograder, .ci/) is named nowhere in the copy, except as a figure the copy's
    own commands write (--fig=, --fig_dir=); and the copy has no CI script that would run what it does not have."""
    make_student.make_student(str(tmp_path))
    have = {os.path.relpath(os.path.join(d, f), tmp_path).replace(os.sep, '/')
            for d, _, fs in os.walk(tmp_path) for f in fs}
    missing = {rel for rel in make_student.tracked_files(ROOT) if rel not in have and rel != 'README.md'}
    missing |= {rel.rsplit('/', 1)[0] + '/' for rel in missing if '/' in rel}
    missing = {m for m in missing if not any(h.startswith(m) for h in have if m.endswith('/'))}  # folders gone
    assert {'tests/', 'docs/', 'assignments/key/', '.ci/'} <= missing, sorted(missing)[:20]
    found = []
    # one pattern for all the missing paths, longest first so that a folder never hides a file inside it
    named = re.compile(r'(?<![\w/.-])(' + '|'.join(map(re.escape, sorted(missing, key=len, reverse=True))) + ')')
    for rel, text in student_text(tmp_path).items():
        for hit in named.finditer(text):
            if not re.search(r'--fig(_dir)?=$', text[max(0, hit.start() - 10):hit.start()]):
                found.append(f"{hit.group(1)} in {rel}")
    assert not found, f"the student copy refers to what it does not have: {sorted(set(found))[:20]}"
    assert not (tmp_path / '.ci').exists(), "the copy's CI would run tests/, which the copy leaves out"


def test_make_student_refuses_a_redaction_that_no_longer_matches(tmp_path, monkeypatch):
    """A sentence of redactions.py not found once in its file: the copy is refused (an answer would ship)."""
    stale = tmp_path / 'redactions.py'
    stale.write_text("REDACTIONS = [('train.py', 'a sentence train.py does not have', '')]\n")
    monkeypatch.setattr(make_student, 'REDACTIONS', str(stale))
    with pytest.raises(SystemExit, match='found 0 times there, not once'):
        make_student.make_student(str(tmp_path / 'copy'))


def test_the_graders_run_torch_on_one_thread():
    """grading.one_thread, which every grader imports: one thread inside a grader module, the previous count after."""
    import importlib.util
    import torch
    spec = importlib.util.spec_from_file_location('grader_helpers',
                                                  os.path.join(ROOT, 'assignments', 'tests', 'grading.py'))
    grading = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grading)
    fixture = getattr(grading.one_thread, '__wrapped__', None) or grading.one_thread.__pytest_wrapped__.obj
    for a in ASSIGNMENTS:  # every grader, the new ones included
        with open(os.path.join(ROOT, grader(a))) as f:
            assert re.search(r'^from grading import .*\bone_thread\b', f.read(), re.M), f'{grader(a)} runs unpinned'
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        steps = fixture()
        next(steps)
        assert torch.get_num_threads() == 1
        next(steps, None)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize('mistake, hint', [
    ('detach', 'the penalty must stay in the autograd graph: do not .detach() or .item() it'),
    ('item', 'the penalty must stay in the autograd graph: do not .detach() or .item() it'),
    ('float at lambda = 0', 'return a tensor, also at lambda = 0 (torch.zeros(())'),
])
def test_the_a5_grader_names_a_detached_penalty_and_a_float_at_lambda_0(mistake, hint, monkeypatch):
    """Two mistakes a student made that torch answers in its own words ("element 0 of tensors does not require
    grad" at .backward(), an AttributeError at .item()): planted into LoopedGPT.penalty_loss, each fails the A5
    grader's first test with the grader's own hint instead."""
    import importlib.util
    import looped
    monkeypatch.syspath_prepend(os.path.join(ROOT, 'assignments', 'tests'))
    spec = importlib.util.spec_from_file_location('a5_grader', os.path.join(ROOT, grader('a5')))
    a5 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(a5)
    reference = looped.LoopedGPT.penalty_loss
    wrong = {'detach': lambda self, states: reference(self, states).detach(),
             'item': lambda self, states: reference(self, states).item(),
             'float at lambda = 0': lambda self, states: 0.0 if self.config.norm_penalty == 0
             else reference(self, states)}[mistake]
    a5.test_value_is_lambda_times_the_mean_over_loops_of_the_mean_square()  # the reference passes
    monkeypatch.setattr(looped.LoopedGPT, 'penalty_loss', wrong)
    with pytest.raises(AssertionError) as failure:
        a5.test_value_is_lambda_times_the_mean_over_loops_of_the_mean_square()
    assert hint in str(failure.value), str(failure.value)


def test_make_student_refuses_a_used_folder_and_unknown_assignments(tmp_path):
    (tmp_path / 'x').write_text('keep me')
    with pytest.raises(SystemExit, match='not an empty folder'):
        make_student.main([str(tmp_path)])
    with pytest.raises(SystemExit, match='unknown assignment a9'):
        make_student.main([str(tmp_path / 'new'), '--only', 'a1,a9'])
    assert (tmp_path / 'x').read_text() == 'keep me' and not (tmp_path / 'new').exists()


def test_make_student_refuses_to_run_from_a_stripped_copy(tmp_path):
    """From a student copy it would hand out the student's code as the reference: it refuses, in one line."""
    copy = tmp_path / 'copy'
    make_student.make_student(str(copy), ['a4'])
    assert not (copy / 'assignments' / 'make_student.py').exists()  # the tool is not handed out
    for tool in ('make_student.py', 'stubs.py'):  # an instructor who copies it into a student copy anyway
        with open(os.path.join(ROOT, 'assignments', tool)) as f:
            (copy / 'assignments' / tool).write_text(f.read())
    code, out = run([sys.executable, os.path.join('assignments', 'make_student.py'), str(tmp_path / 'again')], copy)
    assert code != 0 and out.strip().count('\n') == 0 and 'no .git' in out, out
    os.makedirs(copy / '.git')  # a student who runs git init: the stubs still give it away
    code, out = run([sys.executable, os.path.join('assignments', 'make_student.py'), str(tmp_path / 'again')], copy)
    assert code != 0 and out.strip().count('\n') == 0 and 'a4 is stubbed out' in out, out
    assert not (tmp_path / 'again').exists()
    assert make_student.stripped_reason(ROOT) is None


def test_reference_files_carry_no_solution_markers():
    for path in ('looped.py', 'lab/engine.py', 'lab/diagnose.py'):
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        assert not re.search(r'\ba[1-8]\b|assignment|solution|student|TODO', text, flags=re.I), path


def write_log(folder, records, max_iters=500, **flags):
    os.makedirs(folder, exist_ok=True)
    model = {'n_loop': 4, 'readout': 'rmsnorm', 'norm_penalty': 0.0, 'recurrence': 'residual',
             'supervision': 'per_loop', **flags}
    with open(os.path.join(folder, 'log.jsonl'), 'w') as f:
        f.write(json.dumps({'run_id': 'x', 'config': {'max_iters': max_iters, 'model': model}}) + '\n')
        for r in records:
            f.write(json.dumps(r) + '\n')


def test_check_answers_compares_with_the_students_own_runs(tmp_path, capsys):
    write_log(tmp_path / 'laptop', [{'step': 100, 'hidden_norm': [9, 9, 9, 1305.6]},
                                    {'step': 500, 'hidden_norm': [1, 2, 3, 930.7]}])
    write_log(tmp_path / 'laptop-pen0.01', [{'step': 500, 'hidden_norm': [1, 2, 3, 30.0]}], norm_penalty=0.01)
    write_log(tmp_path / 'laptop-readout_alpha', [{'step': 500, 'hidden_norm': [1, 2, 3, 4], 'alpha': 0.3071}],
              readout='alpha')
    answers = tmp_path / 'ANSWERS.md'
    answers.write_text('a5_rmsnorm_norm_K = 931\na5_penalty_norm_K = 45\na6_alpha_per_loop = ?\n')
    assert check_answers.main([str(answers), '--runs', str(tmp_path), '--key', str(tmp_path / 'none.json')]) == 1
    out = capsys.readouterr().out
    assert re.search(r'a5_rmsnorm_norm_K\s+ok', out) and 'you wrote 45' in out
    assert re.search(r'a6_alpha_per_loop\s+missing: write the number', out), out
    assert '1 of 6 numbers match' in out
    for value in ('30', '0.3071', '0.307', '1305', '930.7'):  # never a number the student has not written
        assert not re.search(r'(?<![\d.])' + re.escape(value) + r'(?![\d])', out), (value, out)


def test_check_answers_refuses_a_run_that_has_not_reached_the_step(tmp_path, capsys):
    """A run still at step 100 (or trained for fewer steps) cannot answer a question about step 500."""
    write_log(tmp_path / 'laptop', [{'step': 100, 'hidden_norm': [1, 2, 3, 1305.6]}])
    write_log(tmp_path / 'laptop-readout_alpha', [{'step': 100, 'alpha': 0.446}], max_iters=100, readout='alpha')
    write_log(tmp_path / 'laptop-pen0.01', [{'step': 500, 'hidden_norm': [1, 2, 3, 30.0]}])  # no penalty: wrong flags
    answers = tmp_path / 'ANSWERS.md'
    answers.write_text('a5_rmsnorm_norm_K = 1305.6\na6_alpha_per_loop = 0.446\na5_penalty_norm_K = 30\n')
    assert check_answers.main([str(answers), '--runs', str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert re.search(r'a5_rmsnorm_norm_K\s+not checked: laptop stopped at step 100 of 500', out), out
    assert re.search(r'a6_alpha_per_loop\s+not checked: laptop-readout_alpha was trained for --max_iters=100', out), out
    assert re.search(r'a5_penalty_norm_K\s+not checked: .*--norm_penalty=0.0', out), out
    assert '0 of 6' in out


def test_check_answers_compares_with_the_key(tmp_path, capsys):
    """A number that matches the student's own (broken) run but lies outside the key's range is not ok, and the
    range is not printed."""
    write_log(tmp_path / 'laptop-readout_alpha', [{'step': 500, 'alpha': 0.93}], readout='alpha')
    answers = tmp_path / 'ANSWERS.md'
    answers.write_text('a6_alpha_per_loop = 0.93\n')
    assert check_answers.main([str(answers), '--runs', str(tmp_path)]) == 1  # the real key
    out = capsys.readouterr().out
    assert re.search(r'a6_alpha_per_loop\s+outside the key', out), out
    with open(os.path.join(KEY, 'key.json')) as f:
        low, high = json.load(f)['numbers']['a6_alpha_per_loop']['range']
    assert str(low) not in out and str(high) not in out
    key = tmp_path / 'key.json'
    key.write_text(json.dumps({'numbers': {'a6_alpha_per_loop': {'range': [0.9, 0.95]}}}))
    assert check_answers.main([str(answers), '--runs', str(tmp_path), '--key', str(key)]) == 1
    assert re.search(r'a6_alpha_per_loop\s+ok \(0.93, within the key', capsys.readouterr().out)


def test_handout_diagnose_commands_work_without_a2_and_without_the_timed_benchmark(small_data, tmp_path, capsys,
                                                                                 monkeypatch):
    """A4 Q3's --only=scale for a student who skipped A2 (the radial-gradient table is left out, nothing
    crashes), and A7 Q1's --only=exit with --timed=False (no timed benchmark)."""
    from lab import diagnose
    import train
    train.main(['--dataset', small_data, '--out_dir', str(tmp_path), '--n_layer=1', '--n_embd=32', '--n_head=2',
                '--n_loop=2', '--block_size=16', '--batch_size=4', '--eval_iters=2', '--max_iters=2',
                '--eval_interval=2', '--log_interval=2'])

    def not_written(*args):
        raise NotImplementedError("a2: see assignments/README.md")
    monkeypatch.setattr(diagnose, 'rmsnorm_radial_grad', not_written)
    capsys.readouterr()
    diagnose.main(['--out_dir', str(tmp_path), '--only=scale', '--diag_windows=4'])
    out = capsys.readouterr().out
    assert 'scale sensitivity' in out and 'radial gradient fraction: left out' in out and 'radial clamps' in out
    diagnose.main(['--out_dir', str(tmp_path), '--only=exit', '--max_windows=20', '--timed=False'])
    out = capsys.readouterr().out
    assert 'early exit per token' in out and 'early exit per sequence' not in out and '--timed=False' in out
    with pytest.raises(SystemExit, match='expected True or False'):
        diagnose.main(['--out_dir', str(tmp_path), '--only=exit', '--timed=maybe'])
