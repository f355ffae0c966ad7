"""
Measure a trained looped model: perplexity at every exit depth, a calibrated early exit, and the paper's
scale mechanism (readout scale sensitivity, radial gradient, radial/angular split of each loop, radial clamp).

    python diagnose.py --out_dir=out/laptop                  # all of it, on the validation split
    python diagnose.py --out_dir=out/laptop-raw --only=scale
    python diagnose.py --out_dir=out/laptop --only=depth --max_windows=200

Depth and exit numbers use non-overlapping windows of block_size tokens, so every validation token (all but
the last few that do not fill a window) is predicted exactly once. The scale diagnostics use the first
--diag_windows windows.
"""

import argparse
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

from looped import EXITS
from train import find_dataset, load_model

SCALES = (0.1, 0.5, 1.0, 2.0, 10.0)


def windows(tokens, T, max_windows=None):
    """Non-overlapping (x, y) windows: x = tokens[i*T:(i+1)*T], y shifted by one. (N, T) each."""
    n = (len(tokens) - 1) // T
    n = n if max_windows is None else min(n, max_windows)
    x = torch.from_numpy(tokens[:n * T].astype(np.int64)).view(n, T)
    y = torch.from_numpy(tokens[1:n * T + 1].astype(np.int64)).view(n, T)
    return x, y


def readout_logp(model, h, k):
    return F.log_softmax(model.lm_head(model.readout(h, k)).float(), dim=-1)  # (B, T, V)


@torch.no_grad()
def per_token_depth_stats(model, x, y, n_loop, batch_size=32):
    """For every target token and loop k = 1..n_loop: cross-entropy, top probability, and KL(p_k || p_{k-1})
    (inf at k = 1). Three arrays of shape (tokens, n_loop)."""
    ce, pmax, kl = [], [], []
    for i in range(0, len(x), batch_size):
        xb, yb = x[i:i + batch_size], y[i:i + batch_size]
        h, prev, rows = model.embed(xb), None, ([], [], [])
        for k in range(1, n_loop + 1):
            h = model.loop_step(h)
            logp = readout_logp(model, h, k)                              # (B, T, V)
            rows[0].append(-logp.gather(-1, yb.unsqueeze(-1)).squeeze(-1))
            rows[1].append(logp.max(-1).values.exp())
            rows[2].append(torch.full_like(rows[0][-1], math.inf) if prev is None else (logp.exp() * (logp - prev)).sum(-1))
            prev = logp
        for out, row in zip((ce, pmax, kl), rows):
            out.append(torch.stack(row, dim=-1).reshape(-1, n_loop))        # (B*T, n_loop)
    return [torch.cat(a).numpy() for a in (ce, pmax, kl)]


def exit_depths(kind, threshold, pmax, kl, K):
    """The loop (1..K) at which each token exits under a rule; K where the rule never passes."""
    passes = pmax[:, :K] >= threshold if kind == 'confidence' else kl[:, :K] <= threshold  # same rule as exit_passes
    passes[:, K - 1] = True
    return passes.argmax(axis=1) + 1


def calibrate_exit(kind, ce, pmax, kl, K, tolerance=0.01):
    """The threshold with the fewest mean loops whose perplexity stays within (1 + tolerance) of depth K.
    Returns (threshold, mean loops, perplexity)."""
    signal = pmax[:, :K] if kind == 'confidence' else kl[:, 1:K]
    candidates = np.unique(np.quantile(signal, np.linspace(0, 1, 201)))
    full = math.exp(ce[:, K - 1].mean())
    best = (math.inf if kind == 'confidence' else -math.inf, float(K), full)  # never exit early
    for t in candidates:
        d = exit_depths(kind, t, pmax, kl, K)
        ppl = math.exp(ce[np.arange(len(d)), d - 1].mean())
        if ppl <= full * (1 + tolerance) and d.mean() < best[1]:
            best = (float(t), float(d.mean()), ppl)
    return best


def scale_sensitivity(model, x, y, K, scales=SCALES):
    """Loss at every loop when h_k is multiplied by a before the readout (the recurrence is untouched).
    (K, len(scales)) array."""
    out = np.zeros((K, len(scales)))
    with torch.no_grad():
        h = model.embed(x)
        for k in range(1, K + 1):
            h = model.loop_step(h)
            for j, a in enumerate(scales):
                out[k - 1, j] = F.nll_loss(readout_logp(model, a * h, k).flatten(0, 1), y.flatten()).item()
    return out


def radial_gradient(model, x, y, K):
    """Mean over tokens of |<g, h_k>| / (||g|| ||h_k||) at every loop, for g = the gradient of loop k's own
    cross-entropy (through its readout only) and g = the gradient of the training objective. (K, 2) array."""
    states, ces = [], []
    h = model.embed(x)
    for k in range(1, K + 1):
        h = model.loop_step(h)
        states.append(h)
        ces.append(F.nll_loss(readout_logp(model, h, k).flatten(0, 1), y.flatten()))
    objective = torch.stack(ces).mean() if model.config.supervision == 'per_loop' else ces[-1]
    if model.config.norm_penalty > 0:
        objective = objective + model.config.norm_penalty * torch.stack([s.pow(2).mean() for s in states]).mean()
    direct = [torch.autograd.grad(ce, s, retain_graph=True)[0] for ce, s in zip(ces, states)]
    total = torch.autograd.grad(objective, states)
    frac = lambda g, s: (F.cosine_similarity(g, s.detach(), dim=-1).abs()).mean().item()
    return np.array([[frac(d, s), frac(t, s)] for d, t, s in zip(direct, total, states)])


@torch.no_grad()
def update_split(model, x, K, clamp=False):
    """Per loop: mean radial increment ||h_k|| - ||h_{k-1}|| and mean angle between h_{k-1} and h_k (degrees),
    from h_0 = the embedding. With clamp=True every loop after the first is rescaled to the norm it started
    from (its radial change removed) before it moves on. Returns ((K, 2) array, the states h_1..h_K)."""
    h, rows, states = model.embed(x), [], []
    for k in range(1, K + 1):
        h_new = model.loop_step(h)
        if clamp and k > 1:
            h_new = h_new * (h.norm(dim=-1, keepdim=True) / h_new.norm(dim=-1, keepdim=True))
        u, v = F.normalize(h, dim=-1), F.normalize(h_new, dim=-1)
        angle = 2 * torch.atan2((u - v).norm(dim=-1), (u + v).norm(dim=-1))  # acos(<u, v>), accurate near 0
        rows.append([(h_new.norm(dim=-1) - h.norm(dim=-1)).mean().item(), torch.rad2deg(angle).mean().item()])
        states.append(h_new)
        h = h_new
    return np.array(rows), states


def clamp_perplexity(model, x, y, K):
    """Depth-K perplexity as trained and with every loop's radial change removed (see update_split)."""
    out = []
    for clamp in (False, True):
        _, states = update_split(model, x, K, clamp)
        with torch.no_grad():
            out.append(math.exp(F.nll_loss(readout_logp(model, states[-1], K).flatten(0, 1), y.flatten()).item()))
    return out


def val_tokens(ckpt):
    """The validation split of the dataset a checkpoint was trained on, as a uint16 array."""
    return np.memmap(os.path.join(find_dataset(ckpt['args']['dataset']), 'val.bin'), dtype=np.uint16, mode='r')


def fmt_row(label, values, f='8.3f'):
    return f"{label:>10} " + ' '.join(f"{v:{f}}" for v in values)


def get_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda msg: sys.exit(f"diagnose.py: error: {msg}")
    p.add_argument('--out_dir', default='out/laptop', help='the run folder that holds ckpt.pt')
    p.add_argument('--only', default='all', choices=['all', 'depth', 'exit', 'scale'])
    p.add_argument('--max_windows', type=int, default=None, help='cap on validation windows for depth and exit')
    p.add_argument('--diag_windows', type=int, default=32, help='validation windows for the scale diagnostics')
    p.add_argument('--device', default='cpu')
    return p


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    try:
        model, ckpt = load_model(args.out_dir, args.device)
        tokens = val_tokens(ckpt)
    except (ValueError, OSError) as e:
        sys.exit(f"diagnose.py: error: {e}")
    c = model.config
    K = c.n_loop
    print(f"{args.out_dir} at step {ckpt['step']}: {c.supervision} + {c.readout}, {c.recurrence} recurrence, "
          f"norm_penalty {c.norm_penalty:g}, K={K}")

    if args.only in ('all', 'depth', 'exit'):
        x, y = windows(tokens, c.block_size, args.max_windows)
        ce, pmax, kl = per_token_depth_stats(model, x, y, 2 * K)
        print(f"\nperplexity by exit depth ({ce.shape[0]:,} validation tokens, each counted once)")
        print(fmt_row('depth', range(1, 2 * K + 1), '8d'))
        print(fmt_row('ppl', np.exp(ce.mean(0))))
        if args.only != 'depth':
            print(f"\nearly exit: the threshold with the fewest mean loops whose perplexity is within 1% of depth {K}")
            for kind in EXITS:
                t, depth, ppl = calibrate_exit(kind, ce, pmax, kl, K)
                print(f"{kind:>10}: threshold {t:.4g}, mean loops {depth:.2f} of {K}, perplexity {ppl:.3f} "
                      f"(depth {K}: {math.exp(ce[:, K - 1].mean()):.3f})")

    if args.only in ('all', 'scale'):
        x, y = windows(tokens, c.block_size, args.diag_windows)
        print(f"\nscale sensitivity: validation loss when h_k is multiplied by a before the readout ({len(x)} windows)")
        print(fmt_row('a =', SCALES, '8g'))
        for k, row in enumerate(scale_sensitivity(model, x, y, K), 1):
            print(fmt_row(f"loop {k}", row))
        print("\nradial gradient fraction |<g, h_k>| / (|g| |h_k|), mean over tokens")
        print(f"{'':>10} {'own CE':>8} {'training':>8}")
        for k, row in enumerate(radial_gradient(model, x, y, K), 1):
            print(fmt_row(f"loop {k}", row, '8.2e'))
        split, states = update_split(model, x, K)
        print("\nper-loop update: radial increment ||h_k|| - ||h_{k-1}|| and angular step (degrees)")
        print(f"{'':>10} {'||h_k||':>8} {'radial':>8} {'angle':>8}")
        for k, (row, h) in enumerate(zip(split, states), 1):
            print(fmt_row(f"loop {k}", [h.norm(dim=-1).mean().item(), *row], '8.2f'))
        before, after = clamp_perplexity(model, x, y, K)
        print(f"\nradial clamp (loops 2..{K} keep the norm they start from): depth-{K} perplexity "
              f"{before:.3f} as trained, {after:.3f} clamped")


if __name__ == '__main__':
    main()
