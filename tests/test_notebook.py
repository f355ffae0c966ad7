"""notebooks/blind_spot.ipynb: its code cells, run as written but for fewer steps and a temporary run
folder, with only the standard library and the project's packages (no Jupyter), so that it cannot rot."""

import json
import os
import re
import sys

import matplotlib

from conftest import ROOT

NOTEBOOK = os.path.join(ROOT, 'notebooks', 'blind_spot.ipynb')


def files_under(root):
    """{path: mtime} of every file in the checkout but git's and pytest's own."""
    found = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ('.git', '__pycache__', '.pytest_cache')]
        for name in names:
            path = os.path.join(folder, name)
            found[path] = os.stat(path).st_mtime_ns
    return found


def test_the_notebooks_code_cells_run_and_show_the_blind_spot(tmp_path, monkeypatch, capsys):
    with open(NOTEBOOK) as f:
        nb = json.load(f)
    source = '\n\n'.join(''.join(c['source']) for c in nb['cells'] if c['cell_type'] == 'code')
    run_dir = str(tmp_path / 'notebook')
    for old, new in [('STEPS = 300', 'STEPS = 4'), ('EVERY = 50', 'EVERY = 2'),
                     ("'--eval_iters=4'", "'--eval_iters=1'"),
                     ("RUN_DIR = os.path.join('out', 'notebook')", f"RUN_DIR = {run_dir!r}")]:
        assert source.count(old) == 1, f"the notebook no longer sets {old!r}: update this test with it"
        source = source.replace(old, new)
    matplotlib.use('Agg')
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, 'path', list(sys.path))  # the set-up cell puts the repository on it
    before = files_under(ROOT)
    exec(compile(source, NOTEBOOK, 'exec'), {'__name__': '__main__'})
    import matplotlib.pyplot as plt
    plt.close('all')
    assert files_under(ROOT) == before, "the notebook wrote outside its run folder"
    for readout in ('rmsnorm', 'raw'):  # both runs trained to the end, in the run folder
        with open(os.path.join(run_dir, readout, 'log.jsonl')) as f:
            assert [json.loads(line) for line in f][-1]['step'] == 4
    out = re.sub(r'\x1b\[[0-9;]*[A-Za-z]|\r', '', capsys.readouterr().out)  # IPython's clear_output's
    change = {r: [float(v) for v in re.search(rf"^{r} .*1000: (.+)$", out, re.M).group(1).split(', ')]
              for r in ('rmsnorm', 'raw')}
    assert max(change['rmsnorm']) < 1e-3 < min(change['raw']), change  # a * h: same logits under rmsnorm only
    cosine = {r: float(re.search(rf"^{r} .*mean \|cos\| ([\d.e+-]+)", out, re.M).group(1)) for r in ('rmsnorm', 'raw')}
    assert cosine['rmsnorm'] < 1e-4 and cosine['raw'] > 1e-3, cosine  # no radial gradient under rmsnorm


def test_the_readme_and_the_course_handout_link_the_notebook():
    for doc in ('README.md', os.path.join('assignments', 'README.md')):
        with open(os.path.join(ROOT, doc)) as f:
            assert 'notebooks/blind_spot.ipynb' in f.read(), f"{doc} does not link the notebook"


def test_the_notebook_is_committed_with_its_outputs():
    """A reader on the web sees what each cell printed and drew, run in order (1, 2, ...) from the top."""
    with open(NOTEBOOK) as f:
        nb = json.load(f)
    code = [cell for cell in nb['cells'] if cell['cell_type'] == 'code']
    assert [cell['execution_count'] for cell in code] == list(range(1, len(code) + 1)), "rerun it top to bottom"
    assert all(cell['outputs'] for cell in code), 'a code cell without its output'
    assert any('image/png' in out.get('data', {}) for cell in code for out in cell['outputs']), 'no figure'
    printed = ''.join(''.join(out.get('text', '')) for cell in code for out in cell['outputs'])
    assert re.search(r'^rmsnorm .*mean \|cos\|', printed, re.M), "the invariance check's output is missing"
