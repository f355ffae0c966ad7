"""Adding a design as docs/usage.md's "Adding a design" says, in a scratch copy of the repository: a toy design (a
learned scalar a_k per loop on each pass's update, h_k = x + a_k (u_k - x), a True/False field, exact at init) is
written into the files that section lists, and nothing else; then the design tests that read its entry (flags,
names, the atlas, the eval line, the pinned math, exactness at init) and its own test run green there. The real
files are never edited."""

import os
import re
import shutil
import subprocess
import sys

from conftest import ROOT

SECTION = '## Adding a design'

# the toy design, one edit per place: (file, the text it goes after, exactly once there, the text added)
FIELD = "    loop_scale: bool = False  # a learned scalar a_k per loop on each pass's update, 1 at init\n"
DOC_LINE = ("    loop_scale                                         "
            "a learned scalar a_k per loop on each pass's update\n")
MODULE = ("        self.loop_scales = nn.Parameter(torch.ones(config.n_loop)) if config.loop_scale else None"
          "  # a_k = 1\n")
CODE = ("        if self.loop_scales is not None:  # x + a_k (u_k - x), written so that a_k = 1 gives u_k exactly\n"
        "            h = h + (1 - self.loop_scales[min(k, c.n_loop) - 1]) * (x - h)\n")
ENTRY = '''    'loop scale': Design(['--loop_scale'], {'loop_scale': Flag(
        "a learned scalar a_k per loop on each pass's update, 1 at init", True, 'loop scale')}, Prediction(
        True, 'large', 'small', 'a_k scales the update, not the carried state'), exact=True,
        logs=(Logged('loop_scale', _numbers('a_k', 3),
                     lambda m: None if getattr(m, 'loop_scales', None) is None else m.loop_scales.tolist()),)),
'''
ROW = ("| `--loop_scale` | `False` | a learned scalar a_k per loop on each pass's update from x, the state after "
       "injection: `x + a_k (u_k - x)`, a_k = 1 at init; pass k > K uses a_K |\n")
TEST = '''

def test_loop_scale_scales_pass_ks_update_by_a_k_and_past_k_by_a_K():
    plain, scaled = tiny(), tiny(loop_scale=True)
    scaled.load_state_dict(plain.state_dict(), strict=False)
    a = [0.5, 2.0, 0.25]
    with torch.no_grad():
        scaled.loop_scales.copy_(torch.tensor(a))
        x, _ = tokens()
        e = plain.embed(x)
        h = e
        for k in range(1, 2 * BASE['n_loop'] + 1):
            u = plain.loop_pass(h, e, k, BASE['n_loop'])
            want = h + a[min(k, BASE['n_loop']) - 1] * (u - h)
            assert torch.allclose(scaled.loop_pass(h, e, k, BASE['n_loop']), want, atol=1e-5), k
            h = want
'''
EDITS = [
    ('lab/designs.py', "    attention: str = 'sdpa'  # fused kernels (sdpa), or the same math spelled out (manual)\n",
     FIELD),
    ('lab/designs.py', "    init, mlp, attention, tie_weights                  "
                       "GPT-2's init, GELU, attention spelled out, an untied head\n", DOC_LINE),
    ('lab/designs.py', "        self.exit_gate = nn.Linear(config.n_embd, 1) if gated else None"
                       "  # lambda_k = sigmoid(exit_gate(z_k))\n", MODULE),
    ('lab/designs.py', re.compile(r'^        h = super\(\)\.loop_pass\(.*\n', re.MULTILINE), CODE),  # after the stack
    ('lab/designs.py', "        pinned={'manual': {'attention': 'manual'}}),\n", ENTRY),  # DESIGNS' last entry
    ('tests/test_designs.py', re.compile(r'\Z'), TEST),
    ('docs/usage.md', "| `--attention` | `sdpa` | `sdpa` (fused kernels) or `manual` (the same math spelled out) |\n",
     ROW),
]
# the tests that read a design's entry, and the toy's own; each selects the toy's case where it has one
TESTS = ['tests/test_designs.py::test_loop_scale_scales_pass_ks_update_by_a_k_and_past_k_by_a_K',
         'tests/test_designs.py::test_a_design_exact_at_init_computes_the_defaults_logits_and_loss_bit_for_bit'
         '[loop scale]',
         'tests/test_designs.py::test_the_paper_grid_is_its_ten_conditions_whatever_is_declared',
         'tests/test_design_flags.py::test_the_table_has_one_entry_per_design_field_with_help_and_a_value_off_its_default',
         'tests/test_registry.py::test_usage_and_the_model_docstrings_name_every_config_field',
         'tests/test_registry.py::test_the_usage_flag_table_gives_every_flag_and_exactly_each_text_fields_choices',
         'tests/test_registry.py::test_every_config_field_is_a_flag_with_help_and_the_configs_default',
         'tests/test_train_reads.py::test_every_design_flag_trains_a_step[loop_scale]',
         'tests/test_train_reads.py::test_help_lists_the_papers_flags_then_the_designs_in_a_group_of_their_own',
         'tests/test_bounded_designs.py::'
         'test_each_designs_quantity_is_logged_and_shown_at_every_evaluation[loop scale]',
         'tests/test_pinned_math.py::test_a_design_computes_what_it_computed_when_pinned[loop scale]']


def files_to_touch():
    """The files docs/usage.md's "Adding a design" lists in its table (the first column)."""
    with open(os.path.join(ROOT, 'docs', 'usage.md')) as f:
        section = f.read().split(SECTION, 1)[1].split('\n## ', 1)[0]
    return re.findall(r'^\| (\S+\.\w+) \|', section, re.MULTILINE)


def scratch_copy(dest):
    """The working tree without git, runs, figures, notebooks, the course kit or caches."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns('.git', 'out', 'figures', 'notebooks', 'assignments',
                                                              '__pycache__', '.pytest_cache', '*.bin', '*.pt'))


def add_the_toy(repo):
    """Write the toy design into the copy, each text after its place (a line found exactly once); returns the
    files edited."""
    for path, after, text in EDITS:
        target = os.path.join(repo, path)
        with open(target) as f:
            source = f.read()
        where = [m.end() for m in
                 (after if hasattr(after, 'finditer') else re.compile(re.escape(after))).finditer(source)]
        assert len(where) == 1, f"{path}: {getattr(after, 'pattern', after)!r} is there {len(where)} times, not once"
        with open(target, 'w') as f:
            f.write(source[:where[0]] + text + source[where[0]:])
    return {path for path, _, _ in EDITS}


def test_a_toy_design_added_where_the_docs_say_passes_the_design_tests(tmp_path):
    listed = files_to_touch()
    assert 0 < len(listed) <= 4, listed
    repo = tmp_path / 'repo'
    scratch_copy(repo)
    edited = add_the_toy(str(repo))
    pin = subprocess.run([sys.executable, 'tests/test_pinned_math.py', '--missing'], cwd=repo, capture_output=True,
                         text=True, timeout=120)
    assert pin.returncode == 0 and 'loop scale' in pin.stdout, pin.stderr
    edited.add('tests/data/pinned_math.json')
    assert edited <= set(listed), f"the toy needed {sorted(edited - set(listed))}, which the docs do not list"
    run = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', *TESTS], cwd=repo,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert f"{len(TESTS)} passed" in run.stdout, run.stdout[-500:]
