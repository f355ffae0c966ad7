"""The handout as a class takes it: a student's bug keeps its traceback while bad input stays one line, h_k
becomes logits in one place that training and sampling share, a checkpoint from before an edit names what no
longer fits, two runs never share a folder, and data/ holds the data alone. Each test works on a scratch copy
of the handout (test_handout_alone.copy_handout), so the real files are never edited."""

import ast
import glob
import json
import os
import re
import subprocess
import sys

from conftest import ROOT, run_together
from test_handout_alone import copy_handout

TINY = ['--n_layer=1', '--n_embd=16', '--n_head=2', '--block_size=16', '--batch_size=2', '--eval_iters=1',
        '--device=cpu', '--log_interval=1']


def child(folder, *argv):
    """subprocess.Popen's keyword arguments for one script run in folder (run_together starts them)."""
    return dict(args=[sys.executable, *argv], cwd=folder, env={**os.environ, 'PYTHONPATH': ''})


def plant(folder, path, old, new):
    source = (folder / path).read_text()
    assert source.count(old) == 1, f"{path} changed: update this test's anchor {old!r}"
    (folder / path).write_text(source.replace(old, new))


def test_a_students_shape_bug_keeps_its_traceback_and_bad_input_stays_one_line(tmp_path):
    """A target sliced short in looped.py's head_loss is a bug: train.py exits non-zero with Python's traceback
    through looped.py. A bogus readout and a missing dataset are the user's input: one line each."""
    copy_handout(tmp_path / 'bug')
    plant(tmp_path / 'bug', 'looped.py', 'targets.flatten(), ignore_index=-1', 'targets[:, 1:].flatten(), '
          'ignore_index=-1')
    bug, bogus, missing = run_together(
        child(tmp_path / 'bug', 'train.py', '--max_iters=1', '--out_dir=run', *TINY),
        child(ROOT, 'train.py', '--readout=bogus'),
        child(ROOT, 'train.py', '--dataset=/nonexistent', f'--out_dir={tmp_path / "none"}', *TINY))
    assert bug[0] != 0 and 'Traceback (most recent call last)' in bug[2], bug[2][-1500:]
    assert re.search(r'File ".*looped\.py", line \d+, in head_loss', bug[2]), bug[2][-1500:]
    for code, _, err in (bogus, missing):
        assert code != 0 and len(err.strip().splitlines()) == 1 and 'Traceback' not in err, err
    assert "invalid choice: 'bogus'" in bogus[2] and '/nonexistent' in missing[2]


def generation_loops(tree):
    """The for and while loops of sample.py whose bodies run the model's pieces (embed, loops, lm_head)."""
    pieces = {'embed', 'loops', 'lm_head', 'exit_input', 'head_loss'}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, (ast.For, ast.While))
            and any(isinstance(n, ast.Attribute) and n.attr in pieces for n in ast.walk(node))]


def test_sample_py_generates_through_the_models_own_generate():
    with open(os.path.join(ROOT, 'sample.py')) as f:
        source = f.read()
    assert not generation_loops(ast.parse(source)), 'sample.py runs the model in a loop of its own'
    assert '.generate(' in source


def test_logits_doubled_in_head_loss_reach_training_and_sampling_and_an_old_checkpoint_names_the_new_parameter(
        tmp_path):
    """head_loss is the one place a state becomes logits: doubling them there changes train.py's first
    evaluation and sample.py's text from the same checkpoint at the same seed. A parameter added to Block after
    a run was saved: sample.py and train.py --resume each refuse that run in one line naming it."""
    shipped, doubled, extra = tmp_path / 'shipped', tmp_path / 'doubled', tmp_path / 'extra'
    for folder in (shipped, doubled, extra):
        copy_handout(folder)
    plant(doubled, 'looped.py', 'logits = self.lm_head(x)  ', 'logits = 2 * self.lm_head(x)  ')
    plant(extra, 'looped.py', '        self.mlp = MLP(config)\n',
          '        self.mlp = MLP(config)\n        self.extra = nn.Parameter(torch.zeros(3))\n')
    steps = ['--max_iters=2', '--eval_interval=1']
    results = run_together(child(shipped, 'train.py', *steps, '--out_dir=run', *TINY),
                           child(doubled, 'train.py', *steps, '--out_dir=run', *TINY))
    for code, out, err in results:
        assert code == 0, err[-1500:]
    first = [re.search(r'eval 0: .*', out).group(0) for _, out, _ in results]
    assert first[0] != first[1], first
    run = str(shipped / 'run')
    # hot: two steps of training leave logits in the tens, which any temperature near 1 makes a sure choice
    sample = ['--max_new_tokens=30', '--num_samples=1', '--seed=7', '--temperature=30', f'--out_dir={run}']
    texts = run_together(child(shipped, 'sample.py', *sample), child(doubled, 'sample.py', *sample),
                         child(extra, 'sample.py', *sample),
                         child(extra, 'train.py', '--resume', '--max_iters=4', f'--out_dir={run}', *TINY))
    assert texts[0][0] == texts[1][0] == 0 and texts[0][1] != texts[1][1]
    for code, _, err in texts[2:]:
        assert code != 0 and len(err.strip().splitlines()) == 1, err[-1500:]
        assert 'blocks.0.extra' in err and 'missing from the checkpoint' in err, err


def test_two_runs_started_together_into_one_out_dir_never_share_it(small_data, tmp_path):
    """Five races at once, each two train.py started together into one out_dir of its own: in each exactly one
    trains (exit 0) and the other refuses in one line, whichever wins; each log holds every evaluation once."""
    folders = [tmp_path / f'race{attempt}' for attempt in range(5)]
    children = [child(ROOT, 'train.py', f'--dataset={small_data}', f'--out_dir={out}', '--max_iters=2',
                      '--eval_interval=1', *TINY) for out in folders for _ in range(2)]
    results = run_together(*children)
    for i, out in enumerate(folders):
        pair = results[2 * i:2 * i + 2]
        codes = sorted(code for code, _, _ in pair)
        assert codes[0] == 0 and codes[1] != 0, [r[2][-800:] for r in pair]
        refusal = next(err for code, _, err in pair if code != 0)
        assert len(refusal.strip().splitlines()) == 1 and 'Traceback' not in refusal, refusal
        steps = [json.loads(line)['step'] for line in (out / 'log.jsonl').read_text().splitlines()[1:]]
        assert steps == [0, 1, 2], steps


def test_data_holds_the_data_and_the_root_holds_the_handout():
    """Under data/, only prepare scripts may parse a command line, and nothing starts processes, catches signals
    or holds the run folder; the run's plumbing lives in plumbing/; the root's Python files are the handout's."""
    for path in glob.glob(os.path.join(ROOT, 'data', '**', '*.py'), recursive=True):
        tree = ast.parse(open(path).read())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        name = os.path.relpath(path, ROOT)
        assert not imported & {'signal', 'subprocess', 'torch.distributed'}, name
        assert 'argparse' not in imported or path.endswith('prepare.py'), name
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert not defined & {'Parser', 'Progress', 'check_folder', 'lock_folder'}, name
        assert 'get_parser' not in defined or path.endswith('prepare.py'), name
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, '*.py'))) == [
        'looped.py', 'plot_norms.py', 'sample.py', 'train.py']
    tree = ast.parse(open(os.path.join(ROOT, 'plumbing', 'run.py')).read())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert {'Parser', 'Progress', 'check_folder', 'lock_folder', 'CONFIGS', 'resolve_device'} <= defined


def test_the_lint_passes_with_the_repositorys_own_configuration():
    """ruff, as .ci/run runs it, on the whole repository (pyproject.toml and the 120-column folders' ruff.toml)."""
    r = subprocess.run([sys.executable, '-m', 'ruff', 'check', '.'], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-1000:]
