"""
Sample any run the lab trains: sample.py's flags and printing, lab/engine.py's generation (a KV cache
per loop and layer; --recompute reruns the window for every token instead), and the designs' learned
exit, --exit=gate (Ouro's: a token exits once the gate's cumulative exit probability reaches
--exit_threshold, 0.5 unless given; a run trained with --supervision=gated has the gate).

    python -m lab.sample --out_dir=out/laptop-supervision_gated --exit=gate --show_depth
    python -m lab.sample --out_dir=out/laptop-injection_add --exit=kl --exit_threshold=0.01
    python -m lab.sample --out_dir=out/laptop --recompute      # looped.py's run, as sample.py does

A run loads as the class that trained it (lab/runs.py's load_model): looped.py's LoopedGPT for a run
of train.py's own model, lab/designs.py's DesignedGPT for a design's.
"""

import sample
from data.common import InputError
from lab.engine import RULES, generate
from lab.runs import load_model

PROG = 'python -m lab.sample'


def get_parser():
    """sample.py's flags, with every exit rule of the engine's (the gate too)."""
    return sample.get_parser(PROG, exits=RULES)


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    if args.exit == 'gate' and args.exit_threshold is None:
        args.exit_threshold = 0.5  # a probability: exit once leaving is more likely than not

    def load(out_dir, device):  # the run's own class; the gate asked of a model that has one
        model, ckpt = load_model(out_dir, device)
        if args.exit == 'gate' and getattr(model, 'exit_gate', None) is None:
            raise InputError(f"--exit=gate needs a model trained with --supervision=gated; {out_dir} "
                             "has no exit gate (use --exit=confidence, kl or latent)")
        return model, ckpt

    def cached(model, idx, *args_, **kwargs):  # the engine's generation, with or without its cache
        return generate(model, idx, *args_, cache=not args.recompute, **kwargs)

    sample.run(p, args, load, cached)


if __name__ == '__main__':
    main()
