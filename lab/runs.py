"""
The lab's side of a run folder (train.py keeps a single run's promises: one run per folder, the checkpoint
saved whole before its log line, a resume that keeps its model and data, Ctrl-C saves): loading a checkpoint as
the class that trained it (load_model), and the names of runs and conditions. (Every run locks its folder:
plumbing/run.py's lock_folder, which train.py takes.)
"""

import os
from dataclasses import fields

from lab.configs import LABELS, NAMED, TAGS, head_part, variant_fields
from lab.designs import DesignConfig, DesignedGPT
from looped import LoopedConfig, LoopedGPT
from data.common import InputError
from plumbing.run import load_checkpoint, load_weights


def load_model(path, device='cpu'):
    """(model in eval mode on device, checkpoint dict) from a ckpt.pt or a run folder that holds one,
    built as the class that trained it: a config of looped.py's fields alone (train.py's own run) is
    looped.py's LoopedGPT, whose Block a student may have changed; one with a design's fields is
    DesignedGPT. InputError with a one-line message when it is missing or unreadable, or the model no longer
    fits it (plumbing/run.py's load_weights names the parameters)."""
    path = os.path.join(path, 'ckpt.pt') if os.path.isdir(path) else path
    ckpt = load_checkpoint(path, device)
    try:
        if set(ckpt['config']) <= {f.name for f in fields(LoopedConfig)}:
            model = LoopedGPT(LoopedConfig(**ckpt['config']))
        else:
            model = DesignedGPT(DesignConfig(**ckpt['config']))
    except (TypeError, ValueError) as e:  # a config with unknown fields, or values the checks refuse
        raise InputError(f"checkpoint {path}: its config is not valid here ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:150]})") from None
    load_weights(model, ckpt['model'], path)
    return model.to(device).eval(), ckpt


# ---- names: a run's folder and its condition, both derived from the variant fields (lab/configs.py)

def _value(v):
    return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def name_part(f, value):
    """A variant field's part of a run folder's name: its tag then its value ('pen0.01'); a field
    without a tag is named by its own name ('readout_raw'), so every part says which field it is."""
    return TAGS.get(f.name, f.name + '_') + _value(value)


def label_part(f, value):
    """A variant field's part of a condition's name: its label, a format string of the value
    (' + penalty 0.1'), by default ' + <value>' (or ' + <tag><value>'); some values have a fixed one."""
    if (f.name, value) in NAMED:  # the paper's penalty is '+ penalty' alone, as the grids say
        return NAMED[f.name, value]
    default = ' + ' + TAGS.get(f.name, '') + '{v}'
    return LABELS.get(f.name, default).format(v=_value(value))


def condition_name(cfg):
    """A model's condition from its config as a dict (asdict(config), or the one in a run's log):
    'supervision + readout', then every other variant not at its default ('per_loop + rmsnorm +
    normed'); a field that an older log lacks is at its default."""
    name = f"{cfg['supervision']} + {cfg['readout']}"
    for f in variant_fields():
        value = cfg.get(f.name, f.default)
        if f.name not in ('supervision', 'readout') and value != f.default:
            name += label_part(f, value)
    return name + head_part(cfg)  # a head tied or untied against its init, last (tie_weights' place)


def run_name(config_name, values):
    """The default out_dir of a run: out/<config>, then the name part of every variant not at its
    default (out/laptop-readout_raw-pen0.01)."""
    # a field train.py has no flag for (a design's, under plain train.py) is at its default
    values = {f.name: values.get(f.name, f.default) for f in variant_fields()}
    parts = [config_name] + [name_part(f, values[f.name]) for f in variant_fields()
                             if values[f.name] != f.default]
    return os.path.join('out', '-'.join(parts))
