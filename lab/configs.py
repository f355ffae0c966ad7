"""
train.py's named configurations (--config: sizes, steps, evaluation and learning rate of each; any flag typed on
the command line overrides its value here), its parser (FlagParser: one-line errors, nanoGPT's habits answered,
True/False flags), the checks of its training flags (bad_training_flag), and the variant fields that name a run
and a condition (lab/runs.py). The model's flags are written out in train.py (the paper's) and lab/designs.py
(add_design_flags, the designs').
"""

import argparse
import math
import sys
from dataclasses import fields

from lab.designs import DesignConfig

# 'laptop' is the default and changes nothing: train.py's own defaults (and LoopedConfig's) are the laptop run,
# which on a 2-core CPU trains, evaluates and checkpoints in a few minutes and whose log shows the blind spot.
CONFIGS = {
    'laptop': {},
    # Claim 4 on a laptop (plot_norms.py --run --config=laptop_long --seeds=8): a narrow model, so that a 2-core CPU
    # gets through 2000 steps in about 4 minutes a run; laptop_deep asks the same of a deeper, wider stack (13 min)
    'laptop_long': dict(n_layer=2, n_embd=64, n_head=4, n_loop=4, block_size=128, batch_size=16, dropout=0.0,
                        max_iters=2000, eval_interval=100, eval_iters=4, log_interval=100, learning_rate=3e-3),
    'laptop_deep': dict(n_layer=4, n_embd=128, n_head=4, n_loop=4, block_size=128, batch_size=16, dropout=0.0,
                        max_iters=1500, eval_interval=100, eval_iters=4, log_interval=100, learning_rate=1e-3),
    # The norm's course over long training (lab/norm_course.py --run): the laptop model for 10,000 steps, evaluated every
    # 250; about an hour a run on 2 cores with two runs side by side, single-threaded. Pass --learning_rate=3e-4 for
    # the paper's rate, --warmup_iters or --init=gpt2 to soften the first steps.
    'laptop_10k': dict(n_layer=2, n_embd=128, n_head=4, n_loop=4, block_size=128, batch_size=16, dropout=0.0,
                       max_iters=10000, eval_interval=250, eval_iters=8, log_interval=100, learning_rate=3e-3),
    'gpu_char': dict(n_layer=4, n_embd=256, n_head=4, n_loop=4, block_size=256, batch_size=32, dropout=0.1,
                     max_iters=3000, eval_interval=250, eval_iters=20, log_interval=50, learning_rate=3e-4),
    # The authors' recipe: the whole stack looped K=4 times, SwiGLU, tied embeddings, dropout 0.1, AdamW 3e-4
    # constant with weight decay 0.01 on everything, clip 1.0, context 256, 4 epochs of WikiText-103 with the
    # word-level tokenizer (python -m data.wikitext103.prepare). An epoch is counted their way: one pass over
    # the windows of 256 tokens taken at stride 128 (train.py's steps_from_epochs). For a GPU; on a CPU try
    # --max_iters=2 --batch_size=2.
    'paper_44m': dict(n_layer=8, n_embd=512, n_head=8, n_loop=4, block_size=256, batch_size=64, dropout=0.1,
                      max_iters=None, epochs=4, eval_interval=1000, eval_iters=20, log_interval=50,
                      learning_rate=3e-4, dataset='wikitext103'),
    'paper_129m': dict(n_layer=12, n_embd=768, n_head=12, n_loop=4, block_size=256, batch_size=32, dropout=0.1,
                       max_iters=None, epochs=4, eval_interval=1000, eval_iters=20, log_interval=50,
                       learning_rate=3e-4, dataset='wikitext103'),
}


# ---- the names of runs and conditions, derived from the fields of DesignConfig (LoopedConfig's, then the designs')
#
# Every field is a train.py flag (train.py writes the paper's, lab/designs.py the designs'). Every field that is not
# the shape or an implementation choice is a variant: a run folder's name and a condition's name (lab/runs.py)
# list the variants that differ from their defaults. A new field is a variant, named 'field_value', with no
# entry here; the tables below only keep the names that the committed runs already have.

NOT_VARIANTS = ('vocab_size', 'block_size', 'n_embd', 'n_head', 'n_layer', 'n_loop', 'dropout',
                'tie_weights', 'attention', 'norm_eps')
TAGS = {'alpha': 'alpha', 'norm_penalty': 'pen', 'n_prelude': 'prelude', 'n_coda': 'coda', 'bptt': 'bptt',
        'jacobian_penalty': 'jac', 'gate_input': 'gate_', 'gate_beta': 'beta'}
LABELS = {'alpha': ' {v}', 'norm_penalty': ' + penalty {v}', 'init': ' ({v} init)'}
NAMED = {('norm_penalty', 0.01): ' + penalty'}  # the paper's penalty, as the grids' tables name it


def variant_fields():
    """The DesignConfig fields that make a condition, in their order; the gate's two follow supervision, where they
    stood when the committed gate runs were named."""
    variants = [f for f in fields(DesignConfig) if f.name not in NOT_VARIANTS]
    gate = [f for f in variants if f.name in ('gate_input', 'gate_beta')]
    rest = [f for f in variants if f not in gate]
    at = [f.name for f in rest].index('supervision') + 1
    return rest[:at] + gate + rest[at:]


# ---- train.py's parser: the argparse types and help its flags need, and its one-line errors

def str2bool(s):
    """argparse type for booleans: plain type=bool would turn the string 'False' into True."""
    if s.lower() not in ('1', 'true', 'yes', '0', 'false', 'no'):
        raise argparse.ArgumentTypeError(f"expected True/False/1/0 (or the flag alone), got {s!r}")
    return s.lower() in ('1', 'true', 'yes')


def compile_flag(s):
    """--compile's values: auto (on for CUDA only) or a boolean."""
    if s == 'auto':
        return s
    try:
        return str2bool(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto or True/False/1/0, got {s!r}") from None


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help with every default but an unset one: that flag's own help says what unset means."""
    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


# ---- nanoGPT's habits: flags a nanoGPT user types from memory, each answered by train.py in one line that
# names this repository's way (the usage guide's table "From nanoGPT" lists them beside the flags that are the same)
NANOGPT_HABITS = {
    'init_from': 'continue a run with --resume (the same flags, or --out_dir=FOLDER); no GPT-2 weights '
                 'are loaded here',
    'eval_only': 'evaluate a checkpoint with python -m lab.diagnose --out_dir=FOLDER',
    'gradient_accumulation_steps': 'use --grad_accum=N (micro-steps per optimizer step, counted over all '
                                   'processes)',
    'wandb_log': 'no wandb here: each evaluation goes to out_dir/log.jsonl; plot_norms.py draws it',
    'wandb_project': 'no wandb here: each evaluation goes to out_dir/log.jsonl; plot_norms.py draws it',
    'wandb_run_name': 'no wandb here: each evaluation goes to out_dir/log.jsonl; plot_norms.py draws it',
    'lr': 'use --learning_rate',
    'always_save_checkpoint': 'every evaluation saves out_dir/ckpt.pt (and only after the loss is '
                              'checked finite)',
    'bias': 'the layers have no biases (as the paper)',
    'beta1': "AdamW's betas are PyTorch's defaults (0.9, 0.999), as the authors', not flags",
    'beta2': "AdamW's betas are PyTorch's defaults (0.9, 0.999), as the authors', not flags",
    'backend': 'torchrun joins NCCL on CUDA and gloo on a CPU by itself',
}


def habit_error(argv):
    """One line for the first nanoGPT habit in argv (a config file, or a flag of NANOGPT_HABITS), or None."""
    for arg in argv:
        if not arg.startswith('-') and arg.endswith('.py'):
            return (f"{arg}: config files are not read here; name a configuration with --config=NAME "
                    f"(one of {', '.join(CONFIGS)}) and override any value with its flag")
        name = arg[2:].split('=', 1)[0] if arg.startswith('--') else None
        if name in NANOGPT_HABITS:
            return f"--{name} is nanoGPT's; {NANOGPT_HABITS[name]}"
    return None


def bad_training_flag(args):
    """One line for the first training flag (not a model field: LoopedConfig checks those) whose value
    cannot work, or None."""
    finite = lambda v: v is not None and math.isfinite(v)  # nan and inf pass a plain comparison
    a = args  # a short name, so that each check fits on one line
    counts = ('batch_size', 'eval_interval', 'eval_iters', 'log_interval')
    counts += ('max_iters',) if a.epochs is None else ()
    checks = [(n, getattr(a, n) >= 1, 'at least 1') for n in counts] + [
        ('grad_accum', a.grad_accum is None or a.grad_accum >= 1, 'at least 1'),
        ('warmup_iters', a.warmup_iters >= 0, 'at least 0 (0: no warmup)'),
        ('lr_decay_iters', a.lr_decay_iters is None or a.lr_decay_iters >= 1, 'at least 1'),
        ('min_lr', a.min_lr is None or (finite(a.min_lr) and 0 <= a.min_lr <= a.learning_rate),
         'a finite number between 0 and --learning_rate'),
        ('learning_rate', finite(a.learning_rate) and a.learning_rate > 0, 'a finite number > 0'),
        ('weight_decay', finite(a.weight_decay) and a.weight_decay >= 0, 'a finite number >= 0'),
        ('grad_clip', finite(a.grad_clip) and a.grad_clip >= 0, 'a finite number >= 0 (0: off)'),
        ('epochs', a.epochs is None or (finite(a.epochs) and a.epochs > 0), 'finite and > 0'),
        ('block_size', a.epochs is None or a.block_size >= 2, '>= 2 with --epochs (stride T/2)'),
        ('seed', 0 <= a.seed < 2 ** 63, 'between 0 and 2**63 - 1')]
    for name, ok, want in checks:
        if not ok:
            return f"--{name}={getattr(args, name)} must be {want}"
    return None


class FlagParser(argparse.ArgumentParser):
    """train.py's parser: argparse's, with each default in --help (but an unset one, whose help says what unset
    means), every error in one line naming the program (argparse's usage block is longer than a screen here), a
    nanoGPT habit answered in one line, flags typed whole (no abbreviations: train.py reads the typed flags from
    argv), and add_boolean for True/False flags."""

    def __init__(self, prog, description):
        super().__init__(prog=prog, description=description, formatter_class=Help, allow_abbrev=False)

    def error(self, message):
        sys.exit(f"{self.prog}: error: {message}")

    def parse_args(self, args=None, namespace=None):
        habit = habit_error(sys.argv[1:] if args is None else args)
        if habit:  # this repository's way, not argparse's "unrecognized arguments"
            self.error(habit)
        return super().parse_args(args, namespace)

    def add_boolean(self, name, default, help):
        """A flag that takes True/False/1/0, or stands alone for True; --compile also takes 'auto'."""
        self.add_argument(name, type=compile_flag if default == 'auto' else str2bool, nargs='?', const=True,
                          default=default, help=help)
