"""
nanoGPT's sample.py, with loops: it generates through looped.py's own generate (the checkpoint
holds the vocabulary), each token running its loops up to the first whose --exit rule passes.

    python sample.py --out_dir=out/laptop
    python sample.py --out_dir=out/laptop --n_loop=8 --exit=latent --exit_threshold=0.2 --show_depth

A design's run samples with python -m lab.sample (a KV cache, and the learned exit gate).
"""

import argparse
import math
import os
import re
import sys
from dataclasses import fields

import torch

from data.common import InputError
from looped import CHOICES, LoopedConfig, LoopedGPT
from plumbing.run import load_checkpoint, load_weights

# a design's fields at their defaults (lab/designs.py): a run with one of them set is the lab's
DEFAULTS = {'gate_input': 'raw', 'gate_beta': 0.1, 'init': 'paper', 'mlp': 'swiglu',
            'block': 'prenorm', 'depth_sampling': 'fixed', 'attention': 'sdpa'}


def load_model(out_dir, device='cpu'):
    """(looped.py's LoopedGPT in eval mode, the checkpoint) from out_dir/ckpt.pt; InputError in one
    line for a missing, unsafe or unreadable checkpoint, or one the model no longer fits."""
    path = os.path.join(out_dir, 'ckpt.pt') if os.path.isdir(out_dir) else out_dir
    ckpt = load_checkpoint(path, device)  # weights_only: a checkpoint can never run code here
    if 'meta' not in ckpt:
        raise InputError(f"{path} holds no vocabulary (meta): not a checkpoint train.py wrote")
    cfg, paper = ckpt['config'], [f.name for f in fields(LoopedConfig)]
    extra = [k for k in cfg if k not in paper]
    if extra:  # a design's run: name its fields off their defaults (lab/designs.py), gated, damped
        named = [f"{k}={cfg[k]!r}" for k in extra if cfg[k] not in (0, 'none', DEFAULTS.get(k))]
        named += [f"{k}={cfg[k]!r}" for k, allowed in CHOICES.items() if cfg.get(k) not in allowed]
        raise InputError(f"{out_dir} was trained with a design ({', '.join(named)}); sample it "
                         f"with python -m lab.sample --out_dir={out_dir}")
    try:
        model = LoopedGPT(LoopedConfig(**cfg))
    except ValueError as e:  # a config LoopedConfig's checks refuse
        raise InputError(f"checkpoint {path}: its config is not valid here ({e})") from None
    load_weights(model, ckpt['model'], path)
    return model.to(device).eval(), ckpt


def get_codec(meta):
    """encode(str) -> list of ids and decode(list) -> str, from the vocabulary in the checkpoint."""
    if meta.get('tokenizer') == 'gpt2':
        import tiktoken
        try:
            enc = tiktoken.get_encoding('gpt2')
        except Exception as e:  # no network and no cache: one line that says how to fix it
            raise InputError(f"tiktoken cannot load the GPT-2 BPE ({type(e).__name__}); set "
                             "TIKTOKEN_CACHE_DIR to a folder holding its gpt2 files") from None
        return (lambda s: enc.encode(s, allowed_special={'<|endoftext|>'})), enc.decode
    itos = [meta['itos'][i] for i in range(len(meta['itos']))]  # a list, or nanoGPT's {id: char}
    stoi = {tok: i for i, tok in enumerate(itos)}

    def encode(s):
        if meta.get('tokenizer') == 'word':  # data/wikitext103/prepare.py's: id 0 is <unk>
            return [stoi.get(tok, 0) for tok in re.findall(meta['pattern'], s)]
        unknown = sorted(set(s) - set(stoi))  # characters the model never saw: say which
        if unknown:
            raise InputError(f"the start text has characters outside the vocabulary: {unknown!r}")
        return [stoi[c] for c in s]
    return encode, lambda ids: ''.join(itos[i] for i in ids)


def generate(model, idx, *args, **kwargs):
    """looped.py's generate, which holds the exit rules, with the loop each new token exited at."""
    return model.generate(idx, *args, return_depths=True, **kwargs)


PALETTE = (46, 154, 226, 214, 208, 196, 199, 201, 129, 93)  # 256-colour codes: loop 1 green ...
MARKS = '123456789abcdefghijklmnopqrstuvwxyz'  # each loop's mark in plain text; '+' past loop 35


def show_depth(prompt, pieces, depths, n_loop, ansi):
    """The prompt and the new tokens' texts (pieces), each in its loop's colour (ansi) or mark."""
    if ansi:
        paint = lambda text, d: f"\033[38;5;{PALETTE[min(d, len(PALETTE)) - 1]}m{text}\033[0m"
        keys = ' '.join(paint(str(k), k) for k in range(1, n_loop + 1))
        return (f"colour = loop at which the token exited: {keys}\n{prompt}"
                + ''.join(paint(p, d) for p, d in zip(pieces, depths)))
    text, marks = [''], ['']
    for piece, d in [(prompt, None)] + list(zip(pieces, depths)):
        for ch in piece:
            if ch == '\n':
                text.append('')
                marks.append('')
            else:
                text[-1] += ch
                marks[-1] += ' ' if d is None else MARKS[d - 1] if d <= len(MARKS) else '+'
    legend = f"under each line, the loop (1..{n_loop}) at which a token exited (blank: the prompt)"
    return legend + '\n' + '\n'.join(f"{t}\n{m.rstrip()}" for t, m in zip(text, marks))


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the command, not argparse's usage block
        sys.exit(f"{self.prog}: error: {message}")


def get_parser(prog='sample.py', exits=('confidence', 'kl', 'latent')):
    p = Parser(prog=prog, description='Sample from a looped model checkpoint.')
    add = p.add_argument
    add('--out_dir', default='out/laptop', help='the run folder with ckpt.pt (default: the demo)')
    add('--start', default='\n', help='prompt text, or FILE:path to read it from a file')
    add('--num_samples', type=int, default=2)
    add('--max_new_tokens', type=int, default=300)
    add('--temperature', type=float, default=0.8, help='below 1: conservative, above: random')
    add('--top_k', type=int, default=200, help='sample among the k most likely tokens only')
    add('--seed', type=int, default=1337)
    add('--n_loop', type=int, default=None, help='loops per token (default: the trained K)')
    add('--exit', default='none', choices=('none',) + exits, help="a token's loops stop once: its "
        "top probability >= threshold (confidence), KL to the last loop's <= it (kl), the state's "
        'relative change <= it (latent)')
    add('--exit_threshold', type=float, help='e.g. 0.9, 0.01, 0.2; lab/diagnose.py calibrates one')
    add('--show_depth', action='store_true', help='mark each token with the loop it exited at')
    add('--recompute', action='store_true', help='no KV cache (what sample.py always does)')
    add('--device', default='auto', help='auto (cuda, else mps, else cpu), cpu, cuda or mps')
    return p


def run(p, args, load_model, generate):
    """Check args, load the run, sample, print: sample.py's, and lab.sample's with its own two."""
    if args.n_loop is not None and args.n_loop < 1:
        p.error(f"--n_loop={args.n_loop} must be at least 1")
    if args.exit != 'none' and args.exit_threshold is None:
        p.error(f"--exit={args.exit} needs --exit_threshold")
    if not (args.temperature > 0 and args.top_k > 0 and args.num_samples > 0
            and args.max_new_tokens >= 0):
        p.error("need --temperature > 0, --top_k >= 1, --num_samples >= 1 and "
                "--max_new_tokens >= 0")
    if not math.isfinite(args.temperature) or not math.isfinite(args.exit_threshold or 0):
        p.error("--temperature and --exit_threshold must be finite numbers")
    if not 0 <= args.seed < 2 ** 63:
        p.error(f"--seed={args.seed} must be between 0 and 2**63 - 1")
    cuda, mps = torch.cuda.is_available(), torch.backends.mps.is_available()  # mps: Apple's GPU
    device = args.device if args.device != 'auto' else 'cuda' if cuda else 'mps' if mps else 'cpu'
    try:
        if {'cpu': True, 'cuda': cuda, 'mps': mps}.get(device.split(':')[0]) is not True:
            raise InputError(f"unknown device {device!r}, or not here: use auto, cpu, cuda or mps")
        model, ckpt = load_model(args.out_dir, device)
        encode, decode = get_codec(ckpt['meta'])
        start = args.start
        if start.startswith('FILE:'):  # the prompt in a file
            start = open(start[5:], encoding='utf-8').read()
        ids = encode(start)
    except (InputError, OSError) as e:
        p.error(str(e))
    if not ids:
        p.error("the start text is empty")
    torch.manual_seed(args.seed)  # the same seed gives the same samples
    c, n_loop = model.config, args.n_loop or model.config.n_loop  # above K: extrapolates
    print(f"{args.out_dir} at step {ckpt['step']}: {c.supervision} + {c.readout}, trained with "
          f"K={c.n_loop}, sampling with {n_loop} loops per token")
    x = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)  # (B, T)
    exit_rule = None if args.exit == 'none' else args.exit
    y, depth = generate(model, x, args.max_new_tokens, args.temperature, args.top_k,
                        n_loop=n_loop, exit_rule=exit_rule, exit_threshold=args.exit_threshold)
    for row, used in zip(y.tolist(), depth.tolist()):
        pieces = [decode([t]) for t in row[len(ids):]]  # the generated tokens' texts
        marked = show_depth(decode(ids), pieces, used, n_loop, sys.stdout.isatty())
        print(marked if args.show_depth else decode(row), '---------------', sep='\n')
    rule = f" (exit={args.exit}, threshold {args.exit_threshold:g})" if exit_rule else ''
    if depth.numel():
        print(f"mean loops per token: {depth.float().mean().item():.2f} of {n_loop}{rule}")


def main(argv=None):
    p = get_parser()
    run(p, p.parse_args(argv), load_model, generate)


if __name__ == '__main__':
    main()
