"""
What train.py's command line needs beside its flags: a parser whose every error is one line,
True/False values, the nanoGPT flags a user types from memory (each answered), and the check of
the training flags' values. The flags themselves are written in train.py, where a reader looks.
"""

import argparse
import math
import os
import sys

LAB = 'python -m lab.train'  # where the field's other designs train

HABITS = {  # flags a nanoGPT user types from memory, each answered in one line
    'init_from': 'continue a run with --resume; no GPT-2 weights are loaded here',
    'eval_only': 'evaluate a checkpoint with python -m lab.diagnose --out_dir=FOLDER',
    'gradient_accumulation_steps': 'use --grad_accum=N (micro-steps over all processes)',
    **dict.fromkeys(['wandb_log', 'wandb_project', 'wandb_run_name'],
                    'no wandb here: evaluations go to out_dir/log.jsonl; plot_norms.py draws it'),
    'lr': 'use --learning_rate',
    'always_save_checkpoint': 'every evaluation saves out_dir/ckpt.pt',
    'bias': 'the layers have no biases (as the paper)',
    'beta1': "AdamW's betas are PyTorch's defaults (0.9, 0.999), as the authors'",
    'beta2': "AdamW's betas are PyTorch's defaults (0.9, 0.999), as the authors'",
    'backend': 'torchrun joins NCCL on CUDA and gloo on a CPU by itself',
}


def boolean(s):  # True/False/1/0; plain type=bool would read the string 'False' as True
    if s.lower() not in ('1', 'true', 'yes', '0', 'false', 'no'):
        raise argparse.ArgumentTypeError(f"expected True/False/1/0 (or the flag alone), got {s!r}")
    return s.lower() in ('1', 'true', 'yes')


def auto_or_boolean(s):  # --compile: auto (on for CUDA only), or a boolean
    if s == 'auto':
        return s
    try:
        return boolean(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto or True/False/1/0, got {s!r}") from None


class Help(argparse.ArgumentDefaultsHelpFormatter):  # each default, but an unset one's help says
    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse's, with every error in one line and a nanoGPT habit answered. configs: the names
    --config takes, offered to whoever passes a config file."""
    def __init__(self, configs=(), **kwargs):
        super().__init__(allow_abbrev=False, formatter_class=Help, **kwargs)
        self.configs = configs

    def flag(self, name, default, help, type=boolean):  # --x alone means True
        self.add_argument(name, type=type, nargs='?', const=True, default=default, help=help)

    def error(self, message):
        if self.prog == 'train.py' and 'invalid choice' in message \
                and message.startswith(('argument --supervision', 'argument --recurrence')):
            message += f" (gated, damped: {LAB})"  # the designs' values
        sys.exit(f"{self.prog}: error: {message}")

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else args
        for arg in args:
            name = arg[2:].split('=', 1)[0]
            if arg.endswith('.py') and not arg.startswith('-'):
                self.error(f"{arg}: config files are not read here; use --config=NAME "
                           f"(one of {', '.join(self.configs)}) and flags")
            if arg.startswith('--') and name in HABITS:
                self.error(f"--{name} is nanoGPT's; {HABITS[name]}")
        args, unknown = super().parse_known_args(args, namespace)
        if unknown:  # a design's flag, most likely: those are the lab's
            self.error(f"unrecognized arguments: {' '.join(unknown)} (designs train with {LAB})")
        return args


def given_flags(argv=None):
    """The flags typed on the command line: they win over --config, and over a resumed run's."""
    argv = sys.argv[1:] if argv is None else argv
    return {a[2:].split('=', 1)[0] for a in argv if a.startswith('--')}


def bad_flag(a):
    """One line for the first training flag whose value cannot work (LoopedConfig checks the
    model's), or None. nan and inf would pass a plain comparison, hence finite()."""
    finite = lambda v: v is not None and math.isfinite(v)
    counts = ['batch_size', 'eval_interval', 'eval_iters', 'log_interval']
    checks = [(n, getattr(a, n) >= 1, 'at least 1') for n in counts] + [
        ('max_iters', a.epochs is not None or a.max_iters >= 1, 'at least 1'),
        ('grad_accum', a.grad_accum is None or a.grad_accum >= 1, 'at least 1'),
        ('warmup_iters', a.warmup_iters >= 0, 'at least 0 (0: no warmup)'),
        ('lr_decay_iters', a.lr_decay_iters is None or a.lr_decay_iters >= 1, 'at least 1'),
        ('min_lr', a.min_lr is None or finite(a.min_lr) and 0 <= a.min_lr <= a.learning_rate,
         'a finite number between 0 and --learning_rate'),
        ('learning_rate', finite(a.learning_rate) and a.learning_rate > 0, 'a finite number > 0'),
        ('weight_decay', finite(a.weight_decay) and a.weight_decay >= 0, 'a finite number >= 0'),
        ('grad_clip', finite(a.grad_clip) and a.grad_clip >= 0, 'a finite number >= 0 (0: off)'),
        ('epochs', a.epochs is None or finite(a.epochs) and a.epochs > 0, 'finite and > 0'),
        ('block_size', a.epochs is None or a.block_size >= 2, '>= 2 with --epochs (stride T/2)'),
        ('seed', 0 <= a.seed < 2 ** 63, 'between 0 and 2**63 - 1')]
    return next((f"--{n}={getattr(a, n)} must be {want}" for n, ok, want in checks if not ok), None)


def run_name(args, defaults):
    """out/<config>, then each variant flag off its default (defaults: the model's config), as
    out/laptop-readout_raw-pen0.01."""
    parts = [args.config]
    for name in ('supervision', 'readout', 'alpha', 'norm_penalty', 'recurrence'):
        value, tag = getattr(args, name), {'alpha': 'alpha', 'norm_penalty': 'pen'}.get(name)
        if value != getattr(defaults, name):
            parts.append(f"{tag}{value:g}" if tag else f"{name}_{value}")
    return os.path.join('out', '-'.join(parts))
