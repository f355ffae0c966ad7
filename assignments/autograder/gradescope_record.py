"""
A pytest plugin, loaded by grade.py with `-p gradescope_record`: it appends one JSON line per test phase (setup,
call, teardown) and per file that fails to collect to the file named by $AUTOGRADER_RECORD.

It only records; grade.py does the scoring. One line is written and flushed as each phase ends, so a run that
is killed (a submission that loops forever hits grade.py's timeout) still leaves the outcomes of every test
that finished before it, and those keep their points.
"""

import json
import os

MAX_CHARS = 3000  # enough for a grader's one-sentence message and a short traceback into the student's code


def _write(record):
    path = os.environ.get('AUTOGRADER_RECORD')
    if not path:
        return  # loaded outside grade.py: record nothing rather than fail the run
    with open(path, 'a', encoding='utf-8') as f:
        f.write(json.dumps(record) + '\n')


def _message(report):
    """(the one-line reason a phase failed, the rest of its report), both cut to a readable size. The graders'
    assertions carry a sentence each; the first line is that sentence, or the exception a stub raises."""
    if report.passed:
        return '', ''
    crash = getattr(report.longrepr, 'reprcrash', None)
    if crash is not None:
        first = crash.message
    elif isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        first = str(report.longrepr[2])
    else:
        first = str(report.longrepr).strip().splitlines()[-1:] or ['']
        first = first[0]
    text = report.longreprtext
    if len(text) > MAX_CHARS:
        text = '...\n' + text[-MAX_CHARS:]  # the end of a traceback is where the error is
    return first[:MAX_CHARS], text


def pytest_runtest_logreport(report):
    first, text = _message(report)
    _write({'nodeid': report.nodeid, 'when': report.when, 'outcome': report.outcome, 'message': first,
            'details': text})


def pytest_collectreport(report):
    # a grader file that cannot be imported (a syntax error in looped.py, say) yields no tests at all; grade.py
    # knows the tests it should have had from the archive's manifest and gives each this reason
    if report.failed:
        first, text = _message(report)
        _write({'collect': report.nodeid, 'outcome': report.outcome, 'message': first, 'details': text})
