"""Declaring a design once: what a new DesignConfig field or parameter gets for free, and the traps a researcher
adding one fell into (an init that shifts with every new weight, FLOPs that count an unknown weight silently,
run names that do not say which field they come from, docs that miss a field)."""

import os
import re
from dataclasses import dataclass, fields

import pytest
import torch
import torch.nn as nn

from conftest import ROOT
from lab.runs import condition_name, label_part, name_part, run_name
from lab import configs
from lab.designs import DesignConfig, DesignedGPT
from looped import LoopedConfig

BASE = dict(vocab_size=11, block_size=8, n_embd=16, n_head=2, n_layer=1, n_loop=3)


class WithLoopEmbedding(DesignedGPT):
    """A researcher's new design: a learned per-loop embedding set directly on the model, drawn from torch's
    global stream before the rest of the init runs (as a parameter made in __init__ would be)."""

    def init_weights(self):
        self.loop_emb = nn.Parameter(torch.randn(self.config.n_loop, self.config.n_embd))
        super().init_weights()


@pytest.mark.parametrize('init', ['gpt2', 'paper_small_embed'])
def test_init_draws_every_other_weight_the_same_when_a_parameter_is_added(init):
    torch.manual_seed(3)
    plain = DesignedGPT(DesignConfig(**BASE, init=init)).state_dict()
    torch.manual_seed(3)
    added = WithLoopEmbedding(DesignConfig(**BASE, init=init)).state_dict()
    redrawn = ['wte.weight', 'wpe.weight'] if init == 'paper_small_embed' else \
        [k for k, v in plain.items() if v.dim() >= 2 and not k.startswith('lm_head')] + ['lm_head.weight']
    for name in redrawn:
        assert torch.equal(plain[name], added[name]), f"{name} drew differently once loop_emb was added"
    assert 'loop_emb' in added


def test_gpt2_init_draws_depend_on_the_seed_and_have_gpt2s_scale():
    torch.manual_seed(3)
    a = DesignedGPT(DesignConfig(**BASE, init='gpt2'))
    torch.manual_seed(4)
    b = DesignedGPT(DesignConfig(**BASE, init='gpt2'))
    assert not torch.equal(a.wte.weight, b.wte.weight)
    assert abs(a.blocks[0].mlp.c_fc.weight.std().item() - 0.02) < 0.003
    depth = BASE['n_layer'] * BASE['n_loop']
    assert abs(a.blocks[0].mlp.c_proj.weight.std().item() - 0.02 / (2 * depth) ** 0.5) < 0.002
    assert not a.config.tie_weights and a.lm_head.weight is not a.wte.weight


def test_paper_small_embed_is_the_paper_init_but_for_the_embeddings():
    torch.manual_seed(3)
    paper = DesignedGPT(DesignConfig(**BASE)).state_dict()
    torch.manual_seed(3)
    small = DesignedGPT(DesignConfig(**BASE, init='paper_small_embed'))
    for name, value in small.state_dict().items():
        if name in ('wte.weight', 'wpe.weight', 'lm_head.weight'):  # the head is tied to wte
            assert abs(value.std().item() - 0.02) < 0.005, name
        else:
            assert torch.equal(value, paper[name]), f"{name} is not the paper init's"
    assert small.lm_head.weight is small.wte.weight


def test_flops_per_token_refuses_a_parameter_it_has_no_count_for():
    model = WithLoopEmbedding(DesignConfig(**BASE))
    with pytest.raises(ValueError, match='loop_emb'):
        model.flops_per_token()
    model = DesignedGPT(DesignConfig(**BASE))
    model.gate = nn.Linear(16, 16)  # a new module
    with pytest.raises(ValueError, match='gate.weight'):
        model.flops_per_token()


def test_flops_per_token_counts_each_module_by_hand():
    """6 per use of a matrix weight; vectors (norm gains, the diagonal decay) are not multiplies."""
    c = DesignConfig(**BASE, n_prelude=1, n_coda=1, injection='concat', recurrence='normed')
    model = DesignedGPT(c)
    n = lambda m: sum(p.numel() for p in m.parameters() if p.dim() == 2)
    K, V, d, T = c.n_loop, c.vocab_size, c.n_embd, c.block_size
    per_loop = K * (n(model.blocks) + d * 2 * d) + n(model.prelude) + K * n(model.coda)
    attention = 12 * (K * c.n_layer + 1 + K * 1) * d * T
    assert model.flops_per_token() == 6 * per_loop + 6 * K * V * d + attention
    terminal = DesignedGPT(DesignConfig(**BASE, supervision='terminal'))
    expected = 6 * K * n(terminal.blocks) + 6 * V * d + 12 * K * c.n_layer * d * T
    assert terminal.flops_per_token() == expected
    diagonal = DesignedGPT(DesignConfig(**BASE, supervision='terminal', injection='diagonal'))
    assert diagonal.flops_per_token() == expected + 6 * K * d * d  # B alone: A_log, dt_bias are vectors
    jacobian = DesignedGPT(DesignConfig(**BASE, supervision='terminal', jacobian_penalty=0.1))
    one_pass = 6 * n(terminal.blocks) + 12 * c.n_layer * d * T
    assert jacobian.flops_per_token() == expected + one_pass  # its extra pass, counted once


def test_a_choice_field_names_its_run_by_field_and_a_tag_works_on_any_field(monkeypatch):
    @dataclass
    class Trial:
        trial_design: str = 'none'  # a trial design
        kind: str = 'a'  # a text field with a tag
        width: int = 0  # a number with a tag and a label
    monkeypatch.setitem(configs.TAGS, 'kind', 'kind')
    monkeypatch.setitem(configs.TAGS, 'width', 'w')
    monkeypatch.setitem(configs.LABELS, 'width', ' + width {v}')
    choice, text, number = fields(Trial)
    assert name_part(choice, 'learned') == 'trial_design_learned'
    assert name_part(text, 'b') == 'kindb' and label_part(text, 'b') == ' + kindb'
    assert name_part(number, 3) == 'w3' and label_part(number, 3) == ' + width 3'
    assert label_part(choice, 'learned') == ' + learned'


def test_every_config_field_is_a_flag_with_help_and_the_configs_default():
    """train.py writes the paper's flags and lab/designs.py the designs' (in their own group, which python -m
    lab.train adds): each field has one, with help, defaulting to the field's default (tie_weights: unset,
    resolved by the init)."""
    from lab import train
    actions = {a.dest: a for a in train.get_parser()._actions}
    for field in fields(DesignConfig):
        if field.name == 'vocab_size':
            continue
        assert field.name in actions, f"DesignConfig.{field.name} has no train.py flag"
        assert actions[field.name].help.strip(), f"--{field.name} has no help"
        assert actions[field.name].default == field.default, field.name


def test_run_names_and_condition_names_of_the_existing_variants():
    values = {f.name: f.default for f in fields(DesignConfig)}
    assert run_name('laptop', values) == os.path.join('out', 'laptop')
    values.update(readout='raw', norm_penalty=0.01, init='gpt2', n_prelude=2)
    assert run_name('laptop', values) == os.path.join('out', 'laptop-readout_raw-pen0.01-init_gpt2-prelude2')
    assert condition_name(values) == 'per_loop + raw + penalty (gpt2 init) + prelude2'
    assert condition_name({**values, 'norm_penalty': 0.1}) == 'per_loop + raw + penalty 0.1 (gpt2 init) + prelude2'


def test_usage_and_the_model_docstrings_name_every_config_field():
    """docs/usage.md's flag table names every field; looped.py's docstring the paper's model's, lab/designs.py's
    the designs'."""
    with open(os.path.join(ROOT, 'docs', 'usage.md')) as f:
        table = '\n'.join(line for line in f.read().splitlines() if line.startswith('|'))
    docstrings = {}
    for name in ('looped.py', os.path.join('lab', 'designs.py')):
        with open(os.path.join(ROOT, name)) as f:
            docstrings[name] = f.read().split('"""')[1]
    paper = {f.name for f in fields(LoopedConfig)}
    for field in fields(DesignConfig):
        assert re.search(rf'`(--)?{field.name}`', table), f"docs/usage.md's flag table does not name {field.name}"
        where = 'looped.py' if field.name in paper else os.path.join('lab', 'designs.py')
        assert re.search(rf'\b{field.name}\b', docstrings[where]), f"{where}'s docstring does not name {field.name}"


def test_the_usage_flag_table_gives_every_flag_and_exactly_each_text_fields_choices():
    """docs/usage.md's flag table: every DesignConfig field but vocab_size (set from the data) in a
    row's flag column, and each text field in a row of its own whose default is CHOICES' first value
    and whose quoted values are exactly looped.CHOICES[field]."""
    from lab.designs import CHOICES
    with open(os.path.join(ROOT, 'docs', 'usage.md')) as f:
        flag_table = f.read().split('### From nanoGPT')[0]  # that section's table maps nanoGPT's flags
        lines = [line for line in flag_table.splitlines() if line.startswith('| `--')]
    rows = {}
    for line in lines:
        _, flags, default, values, _ = re.split(r'(?<!\\)\|', line)  # '\|' is a bar inside a cell
        rows[tuple(re.findall(r'`--(\w+)`', flags))] = (default.strip(), values)
    in_table = {name for flags in rows for name in flags}
    missing = {f.name for f in fields(DesignConfig)} - {'vocab_size'} - in_table
    assert not missing, f"docs/usage.md's flag table has no row for {', '.join(sorted(missing))}"
    for name, allowed in CHOICES.items():
        assert (name,) in rows, f"docs/usage.md's flag table: --{name} has no row of its own"
        default, values = rows[name,]
        assert default == f'`{allowed[0]}`', (name, default)
        named = set(re.findall(r'`(\w+)`', default + values))
        assert named == set(allowed), f"--{name}: the table says {sorted(named)}, looped.CHOICES {allowed}"


def test_each_text_fields_choices_start_with_its_default():
    from lab.designs import CHOICES
    defaults = {f.name: f.default for f in fields(DesignConfig)}
    for name, allowed in CHOICES.items():
        assert allowed[0] == defaults[name], f"CHOICES[{name!r}] starts with {allowed[0]!r}, not the default"
    text = [f.name for f in fields(DesignConfig) if f.type is str]
    assert sorted(text) == sorted(CHOICES), 'a text field without its CHOICES entry (or one too many)'
