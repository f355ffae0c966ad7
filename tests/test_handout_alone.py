"""The handout stands alone: the files a student reads and runs (looped.py, train.py, sample.py,
plot_norms.py, the notebook, the data scripts) import nothing of the lab, and a checkpoint loads as the
class that trained it, so a student who changes looped.py trains and samples the changed model."""

import ast
import glob
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, fields

import pytest
import torch

from conftest import ROOT

ROOT_SCRIPTS = ('train', 'sample', 'plot_norms')  # the scripts beside looped.py, which data/ may not import


def imported_modules(source):
    """The top-level names of every module that source imports, wherever in it the import is."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split('.')[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split('.')[0])
    return names


def notebook_code(path):
    with open(path) as f:
        cells = json.load(f)['cells']
    return '\n\n'.join(''.join(c['source']) for c in cells if c['cell_type'] == 'code')


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


HANDOUT = ['train.py', 'sample.py', 'plot_norms.py',
           *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'notebooks', '*.ipynb'))),
           *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'data', '**', '*.py'),
                                                                 recursive=True))]


@pytest.mark.parametrize('path', HANDOUT)
def test_the_handout_imports_nothing_of_the_lab(path):
    source = notebook_code(os.path.join(ROOT, path)) if path.endswith('.ipynb') else read(path)
    imported = imported_modules(source)
    assert 'lab' not in imported, f"{path} imports the lab"
    if path.startswith('data' + os.sep):
        assert not imported & set(ROOT_SCRIPTS), f"{path} imports {sorted(imported & set(ROOT_SCRIPTS))}"


def test_the_model_imports_nothing_of_the_repository():
    ours = {'lab', 'data', 'looped', *ROOT_SCRIPTS}
    assert not imported_modules(read('looped.py')) & ours


def test_sample_py_knows_the_designs_defaults_it_names():
    """sample.py names a design run's fields that are off their defaults without importing the lab: its table
    of those defaults (the ones that are not 0 or 'none') is lab/designs.py's."""
    import sample
    from lab.designs import DesignConfig
    from looped import LoopedConfig
    paper = {f.name for f in fields(LoopedConfig)}
    defaults = {f.name: f.default for f in fields(DesignConfig) if f.name not in paper}
    assert sample.DEFAULTS == {k: v for k, v in defaults.items() if v not in (0, 'none')}


def test_the_wikitext_prepare_script_counts_train_pys_paper_shapes():
    import train
    from data.wikitext103 import prepare
    from plumbing.run import CONFIGS
    for name, shape in prepare.PAPER_SHAPES.items():
        args = train.get_parser().parse([f'--config={name}'])[0]  # the config's values over train.py's defaults
        assert shape == {k: getattr(args, k) for k in shape}, name
    assert set(prepare.PAPER_SHAPES) == {name for name in CONFIGS if name.startswith('paper_')}


def save_run(folder, model, config):
    os.makedirs(folder)
    torch.save({'model': model.state_dict(), 'config': asdict(config), 'step': 0,
                'meta': {'itos': list('abcdefghijk')}, 'args': {}}, os.path.join(folder, 'ckpt.pt'))
    return str(folder)


def test_a_run_loads_as_the_class_that_trained_it(tmp_path, capsys):
    """train.py's own run loads as looped.py's LoopedGPT in sample.py and the lab; a design's as DesignedGPT in
    the lab, while sample.py names the design in one line and points at python -m lab.sample, which samples it."""
    import sample
    from lab import sample as lab_sample
    from lab.designs import DesignConfig, DesignedGPT
    from lab.runs import load_model
    from looped import LoopedConfig, LoopedGPT
    shape = dict(vocab_size=11, block_size=16, n_embd=16, n_head=2, n_layer=1, n_loop=2)
    plain = save_run(tmp_path / 'plain', LoopedGPT(LoopedConfig(**shape)), LoopedConfig(**shape))
    design = save_run(tmp_path / 'design', DesignedGPT(DesignConfig(**shape, injection='add')),
                      DesignConfig(**shape, injection='add'))
    assert type(sample.load_model(plain)[0]) is LoopedGPT and type(load_model(plain)[0]) is LoopedGPT
    assert type(load_model(design)[0]) is DesignedGPT
    with pytest.raises(SystemExit) as e:
        sample.main(['--out_dir', design, '--start=abc', '--max_new_tokens=2'])
    assert str(e.value.code) == (f"sample.py: error: {design} was trained with a design (injection='add'); "
                                 f"sample it with python -m lab.sample --out_dir={design}")
    capsys.readouterr()
    for argv in ([], ['--recompute'], ['--exit=kl', '--exit_threshold=0.1']):
        lab_sample.main(['--out_dir', design, '--start=abc', '--max_new_tokens=3', '--num_samples=1', *argv])
        assert 'mean loops per token' in capsys.readouterr().out
    gated = save_run(tmp_path / 'gated', DesignedGPT(DesignConfig(**shape, supervision='gated')),
                     DesignConfig(**shape, supervision='gated'))
    with pytest.raises(SystemExit) as e:
        sample.main(['--out_dir', gated, '--start=abc'])
    assert "a design (supervision='gated')" in str(e.value.code)
    lab_sample.main(['--out_dir', gated, '--start=abc', '--max_new_tokens=3', '--exit=gate'])
    assert 'exit=gate, threshold 0.5' in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        lab_sample.main(['--out_dir', plain, '--start=abc', '--exit=gate'])
    assert 'needs a model trained with --supervision=gated' in str(e.value.code) and '\n' not in str(e.value.code)


def copy_handout(dest, lab=False):
    """looped.py, train.py, sample.py, data/ (with the shipped tiny Shakespeare) and plumbing/, as a student has
    them; lab=True adds the lab, which stands on them."""
    os.makedirs(dest)
    for name in ('looped.py', 'train.py', 'sample.py'):
        shutil.copy(os.path.join(ROOT, name), dest / name)
    skip = shutil.ignore_patterns('__pycache__', '*.zip')
    for folder in ('data', 'plumbing') + (('lab',) if lab else ()):
        shutil.copytree(os.path.join(ROOT, folder), dest / folder, ignore=skip)


def run(folder, *argv):
    r = subprocess.run([sys.executable, *argv], cwd=folder, capture_output=True, text=True, timeout=300,
                       env={**os.environ, 'PYTHONPATH': ''})
    assert r.returncode == 0, (argv, r.stdout[-2000:], r.stderr[-2000:])
    return r.stdout
