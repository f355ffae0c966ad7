"""The designs' flags as lab/designs.py declares them (DESIGN_FLAGS): a flag read back from a grid's list as the
parser reads it (lab/grid.py's flags_name), a True/False design field declared like any other, the name a
condition gives it, and the one table every test's list of design values comes from."""

import argparse
from dataclasses import asdict, dataclass, fields

import pytest

from lab import configs, grid, train
from lab.designs import (CHOICES, DESIGN_FLAGS, DesignConfig, Flag, add_design_flags, design_examples,
                         design_fields, flag_values)
from lab.runs import condition_name, run_name


@dataclass
class Toy(DesignConfig):  # a scratch design with a True/False field, declared nowhere else
    loop_norm: bool = False


TOY_FLAGS = {**DESIGN_FLAGS, 'loop_norm': Flag('a toy: normalize every loop', True, 'loop norm')}


@pytest.fixture
def toy(monkeypatch):
    """Toy in place of DesignConfig where names are made (lab/configs.py's variants, lab/grid.py's flags_name),
    with its condition names."""
    monkeypatch.setattr(configs, 'DesignConfig', Toy)
    monkeypatch.setattr(grid, 'DesignConfig', Toy)
    for key, label in configs.boolean_names(Toy, TOY_FLAGS).items():
        monkeypatch.setitem(configs.NAMED, key, label)


def toy_parser():
    parser = argparse.ArgumentParser()
    add_design_flags(parser, Toy, TOY_FLAGS)
    return parser


# ---- lab/grid.py's flags_name reads a flag as the parser does

def test_a_false_boolean_flag_names_the_default_condition_not_the_true_one(toy):
    """type(default)(value) read the text 'False' as True (bool('False')): a grid's --x=False condition was
    named, and reused, as --x=True's."""
    assert grid.flags_name(['--loop_norm=False']) == grid.flags_name([]) == 'per_loop + rmsnorm'
    for on in (['--loop_norm'], ['--loop_norm=1'], ['--loop_norm=True'], ['--loop_norm=yes']):
        assert grid.flags_name(on) == 'per_loop + rmsnorm + loop norm', on
    assert grid.flags_name(['--loop_norm=0', '--readout=raw']) == 'per_loop + raw'


def test_a_flag_whose_field_is_unset_by_default_is_read_by_its_type():
    """tie_weights (unset: resolved by the init) and alpha are None by default: float('False') raised. Both
    read now, and each names what condition_name names the run it trains: a head tied or untied against its
    init says so (not in the run folder's name: tie_weights is not a variant)."""
    for text, tied, name in (('False', False, 'per_loop + rmsnorm + untied head'), ('True', True, 'per_loop + rmsnorm'),
                             ('0', False, 'per_loop + rmsnorm + untied head')):
        values = flag_values([f'--tie_weights={text}'])
        assert values['tie_weights'] is tied
        assert grid.flags_name([f'--tie_weights={text}']) == condition_name(asdict(DesignConfig(tie_weights=tied))) \
            == name
    assert grid.flags_name(['--init=gpt2', '--tie_weights']) == 'per_loop + rmsnorm (gpt2 init) + tied head'
    assert grid.flags_name(['--init=gpt2', '--tie_weights=False']) == 'per_loop + rmsnorm (gpt2 init)'
    assert run_name('laptop', flag_values(['--tie_weights=False'])) == run_name('laptop', flag_values([]))


def test_tie_weights_false_and_true_name_two_conditions_and_neither_raises():
    untied, tied = grid.flags_name(['--tie_weights=False']), grid.flags_name(['--tie_weights=True'])
    assert untied != tied
    assert flag_values(['--alpha=0.25'])['alpha'] == 0.25
    assert grid.flags_name(['--readout=alpha', '--alpha=0.25']) == 'per_loop + alpha 0.25'


@pytest.mark.parametrize('flag, message', [('--tie_weights=maybe', 'expected True/False/1/0'),
                                           ('--bptt', '--bptt needs a value'), ('--bptt=two', '--bptt=two'),
                                           ('--no_such_field=1', 'not a field')])
def test_a_flag_that_cannot_be_read_says_which(flag, message):
    with pytest.raises(ValueError, match=message):
        grid.flags_name([flag])


# ---- a True/False design field is declared as any other

def test_a_boolean_design_field_parses_as_train_py_boolean_flags():
    parser = toy_parser()
    assert parser.parse_args([]).loop_norm is False
    for argv, value in ((['--loop_norm'], True), (['--loop_norm=1'], True), (['--loop_norm=True'], True),
                        (['--loop_norm=False'], False), (['--loop_norm=0'], False)):
        assert parser.parse_args(argv).loop_norm is value, argv
    with pytest.raises(SystemExit):
        parser.parse_args(['--loop_norm=maybe'])


def test_a_boolean_design_field_names_its_condition_and_its_folder_in_words(toy):
    values = {f.name: f.default for f in fields(Toy)}
    assert condition_name({**values, 'loop_norm': True}) == 'per_loop + rmsnorm + loop norm'
    assert run_name('laptop', {**values, 'loop_norm': True}).endswith('laptop-loop_norm_True')
    assert configs.boolean_names(Toy, DESIGN_FLAGS)['loop_norm', True] == ' + loop_norm'  # no label: its name
    on = dataclass(type('On', (DesignConfig,), {'__annotations__': {'x': bool}, 'x': True}))
    assert configs.boolean_names(on)['x', False] == ' + no x'  # on by default: named when off


def test_a_design_field_without_an_entry_is_refused_when_the_parser_is_built():
    with pytest.raises(ValueError, match='give loop_norm an entry in DESIGN_FLAGS'):
        add_design_flags(argparse.ArgumentParser(), Toy)


# ---- the one table of design values

def test_the_table_has_one_entry_per_design_field_with_help_and_a_value_off_its_default():
    assert list(DESIGN_FLAGS) == [f.name for f in design_fields()]
    actions = {a.dest: a for a in train.get_parser()._actions}
    for f in design_fields():
        entry, action = DESIGN_FLAGS[f.name], actions[f.name]
        assert entry.help and action.help == entry.help and action.default == f.default, f.name
        assert entry.example != f.default and type(entry.example) is type(f.default), f.name
        assert f.name not in CHOICES or entry.example in CHOICES[f.name][1:], f.name
    examples = design_examples()
    assert set(examples) == set(DESIGN_FLAGS) | {'supervision', 'recurrence'}
    assert examples['supervision'] == 'gated' and examples['recurrence'] == 'damped'
