"""
The variant fields that name a run and a condition (lab/runs.py), over every field of DesignConfig: looped.py's
and the designs'. train.py's named configurations (plumbing/run.py's CONFIGS) and the nanoGPT habits its
parser answers (plumbing/run.py's HABITS) are read here under the names the lab's tools use.
"""

from dataclasses import fields

from lab.designs import DESIGN_FLAGS, DesignConfig, field_type
from plumbing.run import CONFIGS  # noqa: F401  (read by the lab's tools)
from plumbing.run import HABITS as NANOGPT_HABITS  # noqa: F401  (read by the lab's tools)

# ---- the names of runs and conditions, derived from the fields of DesignConfig (LoopedConfig's, then the designs')
#
# Every field is a train.py flag (train.py writes the paper's, lab/designs.py the designs'). Every field that is not
# the shape or an implementation choice is a variant: a run folder's name and a condition's name (lab/runs.py)
# list the variants that differ from their defaults. A new field is a variant, named 'field_value', with no
# entry here; the tables below only keep the names that the committed runs already have.

NOT_VARIANTS = ('vocab_size', 'block_size', 'n_embd', 'n_head', 'n_layer', 'n_loop', 'dropout',
                'tie_weights', 'attention', 'norm_eps')
# the paper's fields' tags and labels here; each design field's from its Flag in lab/designs.py (tag, part)
TAGS = {'alpha': 'alpha', 'norm_penalty': 'pen',
        **{name: flag.tag for name, flag in DESIGN_FLAGS.items() if flag.tag is not None}}
LABELS = {'alpha': ' {v}', 'norm_penalty': ' + penalty {v}',
          **{name: flag.part for name, flag in DESIGN_FLAGS.items() if flag.part is not None}}
NAMED = {('norm_penalty', 0.01): ' + penalty'}  # the paper's penalty, as the grids' tables name it


def boolean_names(config=DesignConfig, flags=DESIGN_FLAGS):
    """NAMED's entries for every True/False variant field of config: its condition part is ' + <label>' when on
    and ' + no <label>' when off (not ' + True'), the label its DESIGN_FLAGS entry's or else its name; its run
    folder part stays '<field>_True'."""
    names = {}
    for f in fields(config):
        if f.name not in NOT_VARIANTS and field_type(config, f.name) is bool:
            label = getattr(flags.get(f.name), 'label', None) or f.name
            names[f.name, True], names[f.name, False] = ' + ' + label, ' + no ' + label
    return names


NAMED.update(boolean_names())
# a head tied or untied against what its init does (tied; untied under gpt2: DesignConfig's reading of an unset
# tie_weights), in a condition's name; tie_weights is no variant, so a run folder's name leaves it out
HEAD = {True: ' + tied head', False: ' + untied head'}


def head_part(cfg):
    """A condition's words for its head ('' where the head is what its init does, or is unset)."""
    tied = cfg.get('tie_weights')
    return '' if tied is None or tied == (cfg.get('init', 'paper') != 'gpt2') else HEAD[tied]


def variant_fields():
    """The DesignConfig fields that make a condition, in their order; the gate's two follow supervision, where they
    stood when the committed gate runs were named."""
    variants = [f for f in fields(DesignConfig) if f.name not in NOT_VARIANTS]
    gate = [f for f in variants if f.name in ('gate_input', 'gate_beta')]
    rest = [f for f in variants if f not in gate]
    at = [f.name for f in rest].index('supervision') + 1
    return rest[:at] + gate + rest[at:]
