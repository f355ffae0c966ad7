"""
Generate text from a trained looped model, at its trained loop count or any other.

    python sample.py                                   # out/laptop: the README's main run
    python sample.py --out_dir=out/laptop --n_loop=8   # twice the trained depth
    python sample.py --out_dir=... --start="ROMEO:" --num_samples=3 --max_new_tokens=300
    python sample.py --out_dir=... --start=FILE:prompt.txt
    python sample.py --exit=kl --exit_threshold=0.01   # stop looping early, token by token
    python sample.py --exit=confidence --exit_threshold=0.6 --show_depth  # see each token's loops
    python sample.py --exit=latent --exit_threshold=0.2   # exit once the hidden state settles
    python sample.py --recompute                       # no KV cache: rerun the context per token

nanoGPT's sample.py, with loops. The generation itself is lab/engine.py's generate: a KV
cache per loop, each sample of the batch exiting at its own loop (--show_depth marks where), and
the exit rules (RULES). Not here: calibrating and timing the exits (lab/diagnose.py), the cache
against recomputing (python -m lab.bench --generate). Needs only looped.py, lab/ and
data/common.py beside it: the vocabulary is in the checkpoint, so no dataset.
"""

import argparse
import math
import sys

import torch

from lab.engine import RULES, generate
from lab.report import at_least, one_line_errors
from lab.runs import condition_name, load_model
from lab.runtime import resolve_device


def get_codec(meta):
    """encode(str) -> list of ids and decode(list) -> str, from the vocabulary train.py stores in
    the checkpoint: sampling needs neither the data folder nor the prepare script."""
    if meta.get('tokenizer') == 'gpt2':
        import tiktoken
        try:
            enc = tiktoken.get_encoding('gpt2')
        except Exception as e:  # no network and no cache: one line that says how to fix it
            raise ValueError("this checkpoint uses the GPT-2 BPE and tiktoken cannot load it "
                             f"({type(e).__name__}); set TIKTOKEN_CACHE_DIR to a folder holding "
                             "tiktoken's gpt2 files") from None
        return (lambda s: enc.encode(s, allowed_special={'<|endoftext|>'})), enc.decode
    if meta.get('tokenizer') == 'word':  # data/wikitext103/prepare.py: regex tokens, id 0 is <unk>
        import re
        stoi = {tok: i for i, tok in enumerate(meta['itos'])}
        return (lambda s: [stoi.get(t, 0) for t in re.findall(meta['pattern'], s)]), \
            (lambda ids: ''.join(meta['itos'][i] for i in ids))
    itos = meta['itos']  # character level: a list, or nanoGPT's {id: character}
    itos = [itos[i] for i in range(len(itos))] if isinstance(itos, dict) else list(itos)
    stoi = {ch: i for i, ch in enumerate(itos)}

    def encode(s):  # a character the model never saw has no id: say which, rather than a KeyError
        unknown = sorted(set(s) - set(stoi))
        if unknown:
            raise ValueError("the start text has characters outside the model's vocabulary: "
                             f"{unknown!r}")
        return [stoi[c] for c in s]
    return encode, lambda ids: ''.join(itos[i] for i in ids)


# 256-colour terminal codes for exit loops 1, 2, ...: green (early), yellow, orange, red, magenta
PALETTE = (46, 154, 226, 214, 208, 196, 199, 201, 129, 93)
MARKS = '123456789abcdefghijklmnopqrstuvwxyz'  # each loop's mark in plain text; '+' past loop 35


def show_depth(prompt, pieces, depths, n_loop, ansi):
    """The prompt, then the generated tokens' texts (pieces), each marked by the loop it exited
    at (depths). In a terminal (ansi): each token in its loop's colour, under a legend. Otherwise:
    under each line of text, a line with the loop's mark under each generated character (none
    under the prompt)."""
    if ansi:
        paint = lambda text, d: f"\033[38;5;{PALETTE[min(d, len(PALETTE)) - 1]}m{text}\033[0m"
        keys = ' '.join(paint(str(k), k) for k in range(1, n_loop + 1))
        legend = 'colour = loop at which the token exited: ' + keys
        return legend + '\n' + prompt + ''.join(paint(p, d) for p, d in zip(pieces, depths))
    text, marks = [''], ['']
    for piece, d in [(prompt, None)] + list(zip(pieces, depths)):
        for ch in piece:
            if ch == '\n':
                text.append('')
                marks.append('')
            else:
                text[-1] += ch
                marks[-1] += ' ' if d is None else MARKS[d - 1] if d <= len(MARKS) else '+'
    legend = (f"under each line: the loop (1..{n_loop}) at which each generated character's token "
              "exited (blank: the prompt)")
    return legend + '\n' + '\n'.join(f"{t}\n{m.rstrip()}" for t, m in zip(text, marks))


def get_parser():
    p = argparse.ArgumentParser(description='Sample from a looped model checkpoint.')
    one_line_errors(p, 'sample.py')  # p.error: one line naming sample.py, no usage block
    p.add_argument('--out_dir', default='out/laptop',
                   help='the run folder that holds ckpt.pt (default: the demo run)')
    p.add_argument('--start', default='\n',
                   help='prompt text, or FILE:path to read it from a file')
    p.add_argument('--num_samples', type=int, default=2)
    p.add_argument('--max_new_tokens', type=int, default=300)
    p.add_argument('--temperature', type=float, default=0.8,
                   help='below 1: more conservative, above: more random')
    p.add_argument('--top_k', type=int, default=200,
                   help='sample among the k most likely tokens only')
    p.add_argument('--seed', type=int, default=1337)
    p.add_argument('--n_loop', type=int, default=None,
                   help='loops per token (default: the trained K)')
    p.add_argument('--exit', default='none', choices=('none',) + RULES,
                   help='early exit per token: confidence (top probability >= threshold), '
                        'kl (KL between successive loops <= threshold), latent (relative '
                        'change of the hidden state <= threshold) or gate (the learned exit '
                        "gate's cumulative exit probability >= threshold; --supervision=gated)")
    p.add_argument('--exit_threshold', type=float, default=None,
                   help='threshold of --exit (e.g. 0.9 for confidence, 0.01 for kl, 0.2 for '
                        'latent; lab/diagnose.py calibrates one); gate: default 0.5')
    p.add_argument('--show_depth', action='store_true',
                   help='mark every generated token with the loop at which it exited (colours in a '
                        'terminal, a line of digits under the text otherwise)')
    p.add_argument('--recompute', action='store_true',
                   help="recompute the whole context for every token instead of reading the "
                        "per-loop KV cache (the reference: the same text at a fixed depth, and "
                        "many times slower)")
    p.add_argument('--device', default='auto', help='auto, cpu, cuda or mps')
    return p


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    at_least(p, '--n_loop', args.n_loop, 1)
    if args.exit == 'gate' and args.exit_threshold is None:
        args.exit_threshold = 0.5  # a probability: exit once leaving is more likely than not
    if args.exit != 'none' and args.exit_threshold is None:
        p.error(f"--exit={args.exit} needs --exit_threshold")
    if (not args.temperature > 0 or args.top_k < 1 or args.num_samples < 1
            or args.max_new_tokens < 0):
        p.error("need --temperature > 0, --top_k >= 1, --num_samples >= 1 "
                "and --max_new_tokens >= 0")
    threshold_finite = args.exit_threshold is None or math.isfinite(args.exit_threshold)
    if not math.isfinite(args.temperature) or not threshold_finite:
        p.error("--temperature and --exit_threshold must be finite numbers")
    if not 0 <= args.seed < 2 ** 63:
        p.error(f"--seed={args.seed} must be between 0 and 2**63 - 1")

    try:
        device = resolve_device(args.device).device  # fp32 and uncompiled, on any device
        model, ckpt = load_model(args.out_dir, device)
        config = model.config
        encode, decode = get_codec(ckpt['meta'])
        start = args.start
        if start.startswith('FILE:'):
            with open(start[5:], encoding='utf-8') as f:
                start = f.read()
        ids = encode(start)
    except (ValueError, OSError) as e:
        p.error(str(e))
    if not ids:
        p.error("the start text is empty")
    if args.exit == 'gate' and model.exit_gate is None:
        p.error(f"--exit=gate needs a model trained with --supervision=gated; {args.out_dir} has "
                "no exit gate (use --exit=confidence, kl or latent)")

    torch.manual_seed(args.seed)  # the same seed gives the same samples
    n_loop = args.n_loop or config.n_loop  # more than the trained K extrapolates, fewer exits early
    print(f"{args.out_dir} at step {ckpt['step']}: {condition_name(config.to_dict())}, "
          f"trained with K={config.n_loop}, sampling with {n_loop} loops per token")
    prompt = torch.tensor(ids, dtype=torch.long, device=device)
    x = prompt[None, :].repeat(args.num_samples, 1)  # (num_samples, T): all samples in one batch
    exit_rule = None if args.exit == 'none' else args.exit
    # depth (num_samples, max_new_tokens): the loop at which each new token exited
    y, depth = generate(model, x, args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, n_loop=n_loop, exit_rule=exit_rule,
                        exit_threshold=args.exit_threshold, cache=not args.recompute)
    for row, used in zip(y.tolist(), depth.tolist()):  # each sample, with its own tokens' loops
        if args.show_depth:
            pieces = [decode([t]) for t in row[len(ids):]]  # the generated tokens' texts
            print(show_depth(decode(ids), pieces, used, n_loop, sys.stdout.isatty()))
        else:
            print(decode(row))
        print('---------------')
    if depth.numel():
        print(f"mean loops per token: {depth.float().mean().item():.2f} of {n_loop}"
              + (f" (exit={args.exit}, threshold {args.exit_threshold:g})" if exit_rule else ''))


if __name__ == '__main__':
    main()
