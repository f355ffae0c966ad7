"""
How well a run answers a task whose examples have known answer positions (data/chains: the digit after each
query): per exit depth 1..2K, the cross-entropy and the accuracy (argmax over the whole vocabulary) on the answer
tokens alone (every answer of every example), beside the cross-entropy over every token of the same windows, and
for data/chains the accuracy per hop count (the lookups each answer takes).

    python -m lab.answers out/chains-K4                         # one run (its folder or its ckpt.pt)
    python -m lab.answers out/chains-K1 out/chains-K4 --out=out/chains_answers    # and answers.md, answers.csv
    python -m lab.answers out/chains-K4 --max_examples=500 --depths=12

The dataset's meta.json says where the answers are: every example is example_len tokens long and its answers are
the tokens at answer_offsets within it (answer_offset, one, in older single-query datasets), the split starting
with an example. The validation split is cut into
windows that start at an example's start and hold as many whole examples as block_size allows, so every
answer is read with its whole example in context, and each example is counted once (the all-token loss is over
these windows' tokens, the first of each window's examples seen without the example before it). Where the
answers' hop counts are each example's own (data/chains --queries=all queries every letter in a shuffled order;
--queries=one with --min_hops varies the query's chain), so they are found by solving each example's text with
data/chains' resolver (hop_counts), and the accuracy is given per hop count.

Every depth is LoopedGPT.loops run past K to 2K, read out as lab/diagnose.py reads it (readout_logp).
answer_metrics is the function other tools import.
"""

from dataclasses import asdict
import os

import numpy as np
import torch

from lab import diagnose
from lab.report import at_least, check_destination, markdown, run_main, tool_parser, write_csv, write_text
from lab.runs import condition_name, load_model
from lab.runtime import resolve_device

PROG = 'python -m lab.answers'


def layout(meta):
    """(example_len, answer_offsets: a sorted list) from a dataset's meta (answer_offsets, or an older dataset's
    one answer_offset); ValueError in one line for a dataset without them."""
    L = meta.get('example_len')
    offsets = meta.get('answer_offsets', [meta['answer_offset']] if 'answer_offset' in meta else None)
    if not (isinstance(L, int) and isinstance(offsets, list) and offsets
            and all(isinstance(o, int) and 1 <= o < L for o in offsets) and len(set(offsets)) == len(offsets)):
        raise ValueError("the dataset's meta.json has no example_len and answer_offsets (a task with answers, such "
                         "as data/chains, records them)")
    return L, sorted(offsets)


def answer_windows(tokens, L, offsets, block_size, max_examples=None):
    """Windows aligned to example starts: (x, y, answer_mask), each (N, W) with W = L * (examples a window holds),
    x the tokens, y the next tokens (-1 after the split's last token), answer_mask True where y is an answer (at
    each of offsets, a list or one int, within each example). x[answer_mask] reads the answers example by example,
    each example's in offset order. ValueError when one example does not fit a window of block_size."""
    offsets = [offsets] if isinstance(offsets, int) else list(offsets)
    per = block_size // L
    if per < 1:
        raise ValueError(f"an example is {L} tokens, longer than the model's block_size {block_size}")
    n_examples = len(tokens) // L if max_examples is None else min(len(tokens) // L, max_examples)
    n = n_examples // per
    if n < 1:
        raise ValueError(f"the split holds {n_examples} whole examples, fewer than the {per} of one window")
    W = per * L
    ids = np.asarray(tokens[:n * W + 1]).astype(np.int64)
    x = torch.from_numpy(ids[:n * W].copy()).view(n, W)
    y = torch.from_numpy(np.append(ids[1:], -1)[:n * W].copy()).view(n, W)  # -1: beyond the split
    mask = torch.zeros(W, dtype=torch.bool)
    starts = torch.arange(per).unsqueeze(1) * L
    mask[(starts + torch.tensor(offsets) - 1).flatten()] = True  # x position p predicts y[p], the token at p + 1
    return x, y, mask.expand(n, W)


@torch.no_grad()
def answer_metrics(model, data, meta, n_loop=None, max_examples=None, batch_size=64, by_hops=None):
    """The answers' and all tokens' numbers at every exit depth 1..n_loop (default 2K) on data (a split's uint16
    tokens, starting with an example), its layout from meta (example_len, answer_offsets). Returns
    {'depths': [1..n], 'answer_ce', 'answer_acc', 'token_ce': float arrays (n,), 'n_answers', 'n_tokens',
    'correct': bool array (answers, n) in example order, each example's answers in offset order}; with by_hops (an
    int array, one hop count per answer in that order, as hop_counts gives) also
    'by_hops': {hops: (answers, accuracy array (n,))}."""
    L, offsets = layout(meta)
    n_loop = n_loop or 2 * model.config.n_loop
    device = next(model.parameters()).device
    x, y, mask = answer_windows(data, L, offsets, model.config.block_size, max_examples)
    ans_ce, correct, tok_ce, n_tok = [], [], torch.zeros(n_loop, dtype=torch.float64), 0
    for i in range(0, len(x), batch_size):
        xb, yb, mb = (t[i:i + batch_size].to(device) for t in (x, y, mask))
        valid = yb >= 0
        target = yb.clamp(min=0)
        rows_ce, rows_ok = [], []
        for k, h in model.loops(model.embed(xb), n_loop):
            logp = diagnose.readout_logp(model, h, k)                      # (B, W, V)
            ce = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)       # (B, W)
            tok_ce[k - 1] += ce[valid].double().sum().cpu()
            rows_ce.append(ce[mb])                                        # (answers in batch,) in example order
            rows_ok.append(logp.argmax(-1)[mb] == yb[mb])
        n_tok += int(valid.sum())
        ans_ce.append(torch.stack(rows_ce, dim=-1).cpu())
        correct.append(torch.stack(rows_ok, dim=-1).cpu())
    ans_ce, correct = torch.cat(ans_ce).numpy(), torch.cat(correct).numpy()  # (answers, n_loop)
    out = {'depths': list(range(1, n_loop + 1)), 'answer_ce': ans_ce.mean(0), 'answer_acc': correct.mean(0),
           'token_ce': (tok_ce / n_tok).numpy(), 'n_answers': len(correct), 'n_tokens': n_tok, 'correct': correct}
    if by_hops is not None:
        hops = np.asarray(by_hops)[:len(correct)]
        out['by_hops'] = {int(h): (int((hops == h).sum()), correct[hops == h].mean(0)) for h in np.unique(hops)}
    return out


def hop_counts(data, meta, max_examples=None):
    """For a data/chains split, each answer's hop count (an int array, example by example, each example's answers
    in offset order: the order of answer_metrics' answers), found by decoding each example and solving it with
    data/chains' resolver; None for another task. ValueError where an example's queries do not match the offsets
    (the data is not what the meta describes)."""
    if meta.get('task') != 'chains':
        return None
    from data.chains.prepare import solve
    L, offsets = layout(meta)
    n = len(data) // L if max_examples is None else min(len(data) // L, max_examples)
    itos, hops = meta['itos'], []
    for j in range(n):
        line = ''.join(itos[i] for i in data[j * L:(j + 1) * L])
        solved = solve(line)
        if len(solved) != len(offsets) or any(line[o] != a for o, (a, _) in zip(offsets, solved)):
            raise ValueError(f"example {j} of the split ({line!r}) does not answer its queries at offsets {offsets}")
        hops += [h for _, h in solved]
    return np.array(hops, dtype=np.int64)


def table_rows(name, K, m):
    """One row per depth: [run, K, depth, answer_ce, answer_acc, token_ce], then the per-hop accuracies."""
    hops = sorted(m.get('by_hops', {}))
    return [[name, K, d, f"{m['answer_ce'][d - 1]:.4f}", f"{m['answer_acc'][d - 1]:.4f}",
             f"{m['token_ce'][d - 1]:.4f}", *(f"{m['by_hops'][h][1][d - 1]:.4f}" for h in hops)]
            for d in m['depths']], [f"acc {h} hops" for h in hops]


def print_metrics(name, K, m):
    print(f"\n{name}: {m['n_answers']:,} answers, {m['n_tokens']:,} tokens (depths past K={K} run the loop on)")
    print(f"{'depth':>10} " + ' '.join(f"{d:>7d}{'*' if d == K else ' '}" for d in m['depths']))
    for label, key in (('answer ce', 'answer_ce'), ('answer acc', 'answer_acc'), ('token ce', 'token_ce')):
        print(f"{label:>10} " + ' '.join(f"{v:8.3f}" for v in m[key]))
    for h, (n, acc) in sorted(m.get('by_hops', {}).items()):
        print(f"{f'acc {h} hops':>10} " + ' '.join(f"{v:8.3f}" for v in acc) + f"   ({n} answers)")


def get_parser():
    p = tool_parser(PROG, __doc__)
    p.add_argument('runs', nargs='+', help='run folders (or their ckpt.pt) trained on a dataset with answers')
    p.add_argument('--out', default=None, help='a folder for answers.md and answers.csv (default: print only)')
    p.add_argument('--max_examples', type=int, default=None, help='cap on validation examples (default: all)')
    p.add_argument('--depths', type=int, default=None, help='exit depths 1..this (default: 2K of each run)')
    p.add_argument('--dataset', default=None,
                   help='the data to measure on (default: the dataset each checkpoint records; it must be that data)')
    p.add_argument('--device', default='auto', help='auto, cpu, cuda or mps')
    return p


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    at_least(p, '--max_examples', args.max_examples, 1)
    at_least(p, '--depths', args.depths, 1)
    if args.out:
        check_destination(p, os.path.join(args.out, 'answers.md'), '--out')
    device = resolve_device(args.device).device
    rows, extra = [], []
    for run in args.runs:
        try:
            model, ckpt = load_model(run, device)
            path = os.path.join(run, 'ckpt.pt') if os.path.isdir(run) else run
            tokens = diagnose.val_tokens(ckpt, args.dataset, path)
            meta = ckpt.get('meta') or {}
            m = answer_metrics(model, tokens, meta, args.depths, args.max_examples,
                               by_hops=hop_counts(tokens, meta, args.max_examples))
        except (ValueError, OSError) as e:
            p.error(f"{run}: {e}")
        K = model.config.n_loop
        print(f"{run} at step {ckpt['step']}: {condition_name(asdict(model.config))}, K={K}, "
              f"{model.config.n_layer} layers, n_embd {model.config.n_embd}")
        print_metrics(run, K, m)
        run_rows, hop_cols = table_rows(run, K, m)
        rows += run_rows
        extra = hop_cols if len(hop_cols) > len(extra) else extra
    if args.out:
        header = ['run', 'K', 'depth', 'answer_ce', 'answer_acc', 'token_ce', *extra]
        rows = [r + [''] * (len(header) - len(r)) for r in rows]
        write_text(os.path.join(args.out, 'answers.md'), markdown(header, rows) + '\n')
        write_csv(os.path.join(args.out, 'answers.csv'), [header] + rows)
        print(f"\nwrote {os.path.join(args.out, 'answers.md')} and answers.csv")


if __name__ == '__main__':
    run_main(main, PROG)
