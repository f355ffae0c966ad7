"""
Train one of the field's designs: train.py's flags, data, loop, evaluation and checkpoints, with the
designs' flags on top and lab/designs.py's DesignedGPT where one of them is on.

    python -m lab.train --block=sandwich                        # a design, the laptop run otherwise
    python -m lab.train --injection=add --readout=raw --n_loop=8
    python -m lab.train --readout=raw                           # no design: train.py's LoopedGPT

Nothing here is a second training loop: train.main runs, given this parser (train.py's plus the
designs' group, and --supervision=gated, --recurrence=damped) and train.Hooks answered for the
designs (Designs). With no design flag off its default the run is train.py's own: LoopedGPT, the
same records and weights, bit for bit (the logged flags differ in tie_weights' unset).
"""

import argparse
from dataclasses import fields

import train
from looped import ConfigError
from data.common import InputError
from lab.designs import CHOICES, DesignConfig, DesignedGPT, add_design_flags, designs_asked
from lab.report import design_line, design_values
from lab.runs import run_name
from lab.runtime import compile_regions

PROG = 'python -m lab.train'


def get_parser():
    """train.py's parser under this command's name, with the designs' choices and flags added."""
    p = train.get_parser(PROG)
    for action in p._actions:  # the paper's two choice flags take the designs' values too
        if action.dest in ('supervision', 'recurrence'):
            action.choices = CHOICES[action.dest]
        if action.dest == 'tie_weights':  # unset: tied, or untied under --init=gpt2 (nanochat's)
            action.default = None
            action.help = "the head shares the token embedding's weight (unset: tied, untied " \
                "under --init=gpt2)"
    add_design_flags(p)
    return p


def model_config(args, vocab_size=65):
    """(class, config): train.py's LoopedGPT where no design is asked, else DesignedGPT."""
    if not designs_asked(args):  # train.py's model: an unset tie_weights is its default, tied
        tied = args.tie_weights is not False
        return train.model_config(argparse.Namespace(**{**vars(args), 'tie_weights': tied}),
                                  vocab_size)
    # every field's flag (a looped.py field a student added without one: its default, as train.py does)
    values = {f.name: getattr(args, f.name, f.default) for f in fields(DesignConfig) if f.name != 'vocab_size'}
    if args.tie_weights is None:  # unset: tied as the authors', untied as nanochat's under gpt2
        values['tie_weights'] = args.init != 'gpt2'
    try:  # DesignConfig's own checks, of values the user typed
        return DesignedGPT, DesignConfig(vocab_size=vocab_size, **values)
    except ConfigError as e:
        raise InputError(str(e)) from None


class Designs(train.Hooks):
    """train.py's hooks, answered for the designs: the model, the depth a step draws, what DDP is
    told, what is compiled, and what the eval line and the log show of what a design learned."""
    Config = DesignConfig  # a resumed run keeps every design field too

    def model_config(self, args, vocab_size):
        return model_config(args, vocab_size)

    def depth(self, model, seed, step):  # r, this step's drawn count, under --depth_sampling
        sampled = getattr(model.config, 'depth_sampling', 'fixed') != 'fixed'
        return model.sampled_depth(seed, step) if sampled else super().depth(model, seed, step)

    def unused_parameters(self, config):
        return config.may_leave_parameters_unused() if isinstance(config, DesignConfig) else \
            super().unused_parameters(config)

    def compile(self, model):
        compile_regions(model)  # the prelude and coda too; nothing under the Jacobian penalty

    def values(self, model, batch, ctx):
        return {**super().values(model, batch, ctx), **design_values(model, batch, ctx)}

    def eval_extra(self, record):
        return super().eval_extra(record) + design_line(record)


def parse_args(argv=None):
    """The flags as train.py reads them, with this command's parser and run names (the lab's tools
    read a design's flags so)."""
    return get_parser().parse(argv, out_dir_of=lambda args: run_name(args.config, vars(args)))[0]


def main(argv=None):
    train.main(argv, get_parser(), Designs(), out_dir_of=lambda a: run_name(a.config, vars(a)))


if __name__ == '__main__':
    main()
