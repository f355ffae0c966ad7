"""
Measure a trained looped model: perplexity at every exit depth, a calibrated early exit, and the paper's
scale mechanism (readout scale sensitivity, radial gradient, radial/angular split of each loop, radial
clamps, and the lemma check over 30 loops); in a gated run, what bounds the exit gate's logit.

    python -m lab.diagnose --out_dir=out/laptop                  # all of it, on the validation split
    python -m lab.diagnose --out_dir=out/laptop-readout_raw --only=scale
    python -m lab.diagnose --out_dir=out/laptop --only=depth --max_windows=200
    python -m lab.diagnose --out_dir=out/laptop --only=lemma --fig=figures/laptop/lemma_rmsnorm.png
    python -m lab.diagnose --out_dir=out/laptop-supervision_gated --only=gate
    python -m lab.diagnose --out_dir=out/laptop --only=layers   # ||h|| after every layer of every pass

Depth and exit numbers use non-overlapping windows of block_size tokens, so every validation token (all but
the last few that do not fill a window) is predicted exactly once. The scale diagnostics use the first
--diag_windows windows. Every loop is run through LoopedGPT.loops, the model's one implementation of the
recurrence, so a change there shows here too; a diagnostic that edits the states between passes (the radial
clamps, a bf16 state, the exit benchmark's leaving rows) runs edited_loops, the same recurrence from the
model's own loop_pass and carry (a test holds the two to the same states). lab/paper.py
runs the timed per-sequence benchmark over many runs through exit_results, exit_summary and plot_pareto here.

Not here: training (train.py), generation (sample.py), the figures over a grid of runs (plot_norms.py).
"""

from dataclasses import asdict
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from data.common import check_writable
from data.loader import check_same_data, find_dataset, read_dataset
from lab.report import at_least, markdown, pyplot, save_figure, tool_parser
from lab.runs import condition_name, load_model
from looped import LoopedGPT
from lab.runtime import resolve_device, synchronize
from lab.engine import EXITS, angle_deg, latent_change

PROG = 'python -m lab.diagnose'

SCALES = (0.1, 0.5, 1.0, 2.0, 10.0)
CLAMPS = ('none', 'freeze', 'remove_radial')  # see clamp(): ways to take the radial part out of each loop


def windows(tokens, T, max_windows=None):
    """Non-overlapping (x, y) windows: x = tokens[i*T:(i+1)*T], y shifted by one. (N, T) each."""
    n = (len(tokens) - 1) // T
    n = n if max_windows is None else min(n, max_windows)
    x = torch.from_numpy(tokens[:n * T].astype(np.int64)).view(n, T)
    y = torch.from_numpy(tokens[1:n * T + 1].astype(np.int64)).view(n, T)
    return x, y


def readout_logp(model, h, k):
    """Loop k's log-probabilities from h_k, in float32 (the entropy and KL scores need them exact)."""
    return F.log_softmax(model.head_loss(model.exit_input(h, k))[0].float(), dim=-1)  # (B, T, V)


def rms(h):
    """The per-token scale s = RMS(h) that the paper's lemma is about."""
    return h.pow(2).mean(-1, keepdim=True).sqrt()  # (..., 1): per-token root mean square


def radial_step(h_in, h):
    """Per token, u = h_in / RMS(h_in) (so |u|^2 = d) and a = mean(u * (h - h_in)): the update's component
    along u is a * u. Returns (u, a) with a of shape (..., 1)."""
    u = h_in / rms(h_in)
    return u, (u * (h - h_in)).mean(-1, keepdim=True)


def edited_loops(model, e, n_loop, edit):
    """LoopedGPT.loops(e, n_loop) with edit(k, h_in, h_k, e) -> (h_k, e) after every pass, h_in being what pass k
    started from: the h_k it returns is yielded and carried on, and it may drop rows of the batch (from h_k and,
    for the later passes, e). The recurrence of loops, from the model's own carry and loop_pass."""
    h = e
    for k in range(1, n_loop + 1):
        h_in = h if k == 1 else model.carry(h)
        h, e = edit(k, h_in, model.loop_pass(h_in, e, k, n_loop), e)
        yield k, h


def passes(model, x, n_loop, clamp=None):
    """(k, h_in, h_k) for every pass: what the pass started from (h_{k-1}, or its RMSNorm under 'normed'
    recurrence) and what it produced, after clamp(k, h_in, h_k) -> h_k if one is given."""
    inputs = []

    def record(k, h_in, h, e):  # keeps what each pass started from, which loops does not hand out
        inputs.append(h_in)
        return (h if clamp is None else clamp(k, h_in, h)), e
    for k, h in edited_loops(model, model.embed(x), n_loop, record):
        yield k, inputs[-1], h


# ---- perplexity by depth and early exit ----

@torch.no_grad()
def per_token_depth_stats(model, x, y, n_loop, batch_size=32):
    """For every target token and loop k = 1..n_loop: cross-entropy, top probability, KL(p_k || p_{k-1}) (inf at
    k = 1), and the relative change of the state ||h_k - h_{k-1}|| / ||h_{k-1}|| (at k = 1 from h_0, the
    embedding). Four arrays of shape (tokens, n_loop)."""
    ce, pmax, kl, latent = [], [], [], []
    for i in range(0, len(x), batch_size):  # in batches: all windows at once would hold (N, T, V) log-probs
        xb, yb = x[i:i + batch_size], y[i:i + batch_size]
        h_prev = model.embed(xb)
        prev, rows = None, ([], [], [], [])
        for k, h in model.loops(h_prev, n_loop):
            logp = readout_logp(model, h, k)                              # (B, T, V)
            rows[0].append(-logp.gather(-1, yb.unsqueeze(-1)).squeeze(-1))
            rows[1].append(logp.max(-1).values.exp())
            rows[2].append(torch.full_like(rows[0][-1], math.inf) if prev is None
                           else (logp.exp() * (logp - prev)).sum(-1))
            rows[3].append(latent_change(h, h_prev))
            prev, h_prev = logp, h
        for out, row in zip((ce, pmax, kl, latent), rows):
            out.append(torch.stack(row, dim=-1).reshape(-1, n_loop))        # (B*T, n_loop)
    return [torch.cat(a).numpy() for a in (ce, pmax, kl, latent)]


def exit_depths(rule, threshold, pmax, kl, K, latent=None):
    """The loop (1..K) at which each token exits under a rule (lab/engine.py's exit_passes, on precomputed signals):
    the first loop whose top probability reaches the threshold ('confidence'), or whose KL to the previous
    loop ('kl') or relative change of the state ('latent') falls to it; K where the rule never passes.
    pmax, kl, latent: (tokens, >= K). Returns (tokens,) ints."""
    if rule == 'latent':  # it passes, as the KL rule does, when its signal falls to the threshold
        kl = latent
    passes = pmax[:, :K] >= threshold if rule == 'confidence' else kl[:, :K] <= threshold
    passes[:, K - 1] = True  # the last loop always answers
    return passes.argmax(axis=1) + 1  # argmax finds the first True


def calibrate_exit(rule, ce, pmax, kl, K, tolerance=0.01, latent=None):
    """The threshold with the fewest mean loops whose perplexity stays within (1 + tolerance) of depth K's,
    searched over quantiles of the rule's signal. ce, pmax, kl, latent: (tokens, >= K).
    Returns (threshold, mean loops, perplexity); a threshold that never exits early when nothing qualifies."""
    signal = pmax[:, :K] if rule == 'confidence' else kl[:, 1:K]
    if rule == 'latent':  # finite from loop 1 on: h_1 is compared with h_0
        signal = latent[:, :K]
    # candidate thresholds at the signal's quantiles: every operating point the data can produce, in 201 steps
    candidates = np.unique(np.quantile(signal, np.linspace(0, 1, 201)))
    full = math.exp(ce[:, K - 1].mean())
    best = (math.inf if rule == 'confidence' else -math.inf, float(K), full)  # never exit early
    for t in candidates:
        d = exit_depths(rule, t, pmax, kl, K, latent)
        ppl = math.exp(ce[np.arange(len(d)), d - 1].mean())
        if ppl <= full * (1 + tolerance) and d.mean() < best[1]:
            best = (float(t), float(d.mean()), ppl)
    return best


# ---- variable depth per sequence: the authors' benchmark, calibrated on held-out windows and timed ----

# Per-token scores of one loop, from its log-probabilities logp (..., V) or its state h_k and the previous one
# (..., C) -> (...); a sequence's score is their mean over its tokens, and it leaves the batch at the first loop
# whose score reaches the threshold. 'latent' is the latent exit rule's signal, negated (higher = more settled); it
# needs no readout to decide, so the timed run reads out only the sequences that leave.
SCORES = {
    'max_prob': lambda logp, h, h_prev: logp.max(-1).values.exp(),                         # top-1 probability
    'margin': lambda logp, h, h_prev: -logp.topk(2, dim=-1).values.diff(dim=-1).squeeze(-1),  # top-1 minus top-2 logit
    # 1 - H / log V
    'entropy': lambda logp, h, h_prev: 1 - torch.special.entr(logp.exp()).sum(-1) / math.log(logp.size(-1)),
    'latent': lambda logp, h, h_prev: -latent_change(h, h_prev),  # minus ||h_k - h_{k-1}|| / ||h_{k-1}||
}
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)  # operating points besides the calibrated one, at these score quantiles


@torch.no_grad()
def sequence_depth_stats(model, x, y, K, batch_size=32, gate=False):
    """Per window (sequence) and loop k = 1..K: its mean cross-entropy and the mean over its tokens of every
    score; and of two more, which the timed benchmark does not serve: 'kl', minus KL(p_k || p_{k-1}), the KL
    rule's signal negated as 'latent' is (-inf at loop 1, which has no loop before it), and with gate (a model
    trained with supervision='gated') 'gate', the learned gate's cumulative exit probability
    1 - prod_{j<=k} (1 - lambda_j), Ouro's rule's signal (the engine's 'gate'). Returns ce (N, K) and
    {score: (N, K)}."""
    names = list(SCORES) + ['kl'] + (['gate'] if gate else [])
    ce, scores = [], {name: [] for name in names}
    for i in range(0, len(x), batch_size):
        xb, yb = x[i:i + batch_size], y[i:i + batch_size]
        rows, h_prev, prev = ([], {name: [] for name in names}), model.embed(xb), None
        stay = torch.ones(yb.shape, device=yb.device)                     # (B, T): no exit so far
        for k, h in model.loops(h_prev, K):
            logp = readout_logp(model, h, k)                              # (B, T, V)
            rows[0].append(-logp.gather(-1, yb.unsqueeze(-1)).squeeze(-1).mean(-1))  # (B,)
            for name, f in SCORES.items():
                rows[1][name].append(f(logp, h, h_prev).mean(-1))         # (B,)
            kl = (logp.exp() * (logp - prev)).sum(-1).mean(-1) if prev is not None else None
            rows[1]['kl'].append(torch.full_like(rows[0][-1], -math.inf) if kl is None else -kl)
            if gate:
                stay = stay * (1 - torch.sigmoid(model.gate_logit(h, k)))
                rows[1]['gate'].append((1 - stay).mean(-1))              # (B,)
            h_prev, prev = h, logp
        ce.append(torch.stack(rows[0], dim=1))
        for name in names:
            scores[name].append(torch.stack(rows[1][name], dim=1))
    return torch.cat(ce).numpy(), {name: torch.cat(v).numpy() for name, v in scores.items()}


def sequence_exit(ce, score, threshold, K):
    """Each sequence exits at the first loop k < K whose score reaches the threshold, else at K. ce, score: (N, >= K).
    Returns (mean loops, perplexity over all the tokens, each sequence read out at its exit loop)."""
    passes = score[:, :K] >= threshold
    passes[:, K - 1] = True
    depth = passes.argmax(axis=1) + 1
    return float(depth.mean()), math.exp(ce[np.arange(len(depth)), depth - 1].mean())


def calibrate_sequence_exit(ce, score, K, tolerance=0.01):
    """The threshold, among the quantiles of the score at loops 1..K-1, with the fewest mean loops whose
    perplexity stays within (1 + tolerance) of depth K's on these sequences; inf (never exit early) if none does."""
    full = math.exp(ce[:, K - 1].mean())
    best_t, best_loops = math.inf, float(K)
    for t in np.unique(np.quantile(score[:, :K - 1], np.linspace(0, 1, 201))) if K > 1 else []:
        loops, ppl = sequence_exit(ce, score, t, K)
        if ppl <= full * (1 + tolerance) and loops < best_loops:
            best_t, best_loops = float(t), loops
    return best_t


def split_halves(x, y):
    """The validation windows cut in two: the first half calibrates, the second reports (the authors calibrated
    and reported on the same batches, which flatters the rule)."""
    n = len(x) // 2
    return (x[:n], y[:n]), (x[n:], y[n:])


@torch.no_grad()
def timed_exit_run(model, x, y, K, score=None, threshold=math.inf, batch_size=32, repeats=1):
    """Early exit as it would be served, timed: batches of sequences in which a sequence leaves the batch at the
    first loop whose mean score reaches the threshold, so that the passes after it are not run for it. With
    score=None every sequence runs K loops and only loop K is read out: the plain model, the speed to beat.
    The run is repeated and the fastest kept (timing noise only ever slows a run down).
    Returns (mean loops, perplexity, tokens/s)."""
    device = next(model.parameters()).device
    best = math.inf
    for _ in range(repeats):
        total_ce, total_loops, dt = _exit_run(model, x, y, K, score, threshold, batch_size, device)
        best = min(best, dt)
    return total_loops / len(x), math.exp(total_ce / y.numel()), y.numel() / best


def _exit_run(model, x, y, K, score, threshold, batch_size, device):
    """One pass of timed_exit_run: (summed cross-entropy, summed exit loops, seconds)."""
    total_ce, total_loops = 0.0, 0
    synchronize(device.type)
    t0 = time.perf_counter()
    for i in range(0, len(x), batch_size):
        xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)

        def leave(k, h_in, h, e):  # runs in edited_loops after pass k: the exiting rows leave h and e
            nonlocal total_ce, total_loops, targets, h_prev
            if score is None and k < K:
                return h, e
            logp = None if score == 'latent' and k < K else readout_logp(model, h, k)  # (b, T, V)
            done = SCORES[score](logp, h, h_prev).mean(-1) >= threshold if score is not None and k < K \
                else torch.ones(len(h), dtype=torch.bool, device=h.device)
            if done.any():  # read out only who leaves
                logp = readout_logp(model, h[done], k) if logp is None else logp[done]
                total_ce += -logp.gather(-1, targets[done].unsqueeze(-1)).sum().item()
            total_loops += k * int(done.sum())
            targets, h_prev = targets[~done], h[~done]
            return h[~done], e[~done]
        h_prev, targets = model.embed(xb), yb  # the last states and targets of the sequences still in the batch
        for k, h in edited_loops(model, h_prev, K, leave):
            if len(h) == 0:
                break
    synchronize(device.type)
    return total_ce, total_loops, time.perf_counter() - t0


def exit_benchmark(model, x, y, K, batch_size=32, repeats=3):
    """The per-sequence variable-depth benchmark: every score calibrated on the first half of the windows, then
    each operating point (the calibrated threshold and the QUANTILES of the score) measured on the second half in
    a timed run (the fastest of repeats). Returns rows of dicts: score, point, threshold, mean loops, ppl, tok/s;
    the first row is the plain depth-K model."""
    (xa, ya), (xb, yb) = split_halves(x, y)
    ce_a, scores_a = sequence_depth_stats(model, xa, ya, K, batch_size)
    timed_exit_run(model, xb[:batch_size], yb[:batch_size], K)  # warm-up: first calls allocate and pick kernels
    loops, ppl, tok_s = timed_exit_run(model, xb, yb, K, batch_size=batch_size, repeats=repeats)
    rows = [dict(score='none', point=f'depth {K}', threshold=math.inf, loops=loops, ppl=ppl, tok_s=tok_s)]
    for name in SCORES:  # the scores a timed run can serve
        s = scores_a[name]
        points = [('calibrated', calibrate_sequence_exit(ce_a, s, K))]
        points += [(f'q{q:g}', float(np.quantile(s[:, :K - 1], q))) for q in QUANTILES] if K > 1 else []
        for point, t in points:
            loops, ppl, tok_s = timed_exit_run(model, xb, yb, K, name, t, batch_size, repeats)
            rows.append(dict(score=name, point=point, threshold=t, loops=loops, ppl=ppl, tok_s=tok_s))
    return rows


# ---- the same benchmark over many runs: lab/paper.py's exit_table.md and fig4_pareto.png ----

def exit_results(groups, max_windows):
    """exit_benchmark for every run of lab/paper.py's groups ({condition: runs}), from its ckpt.pt: {condition: [rows
    of each seed]}. It times real batched runs, so the tok/s columns mean something only on an otherwise idle
    machine."""
    device = resolve_device().device
    results = {}
    for name, runs in groups.items():
        results[name] = []
        for run in runs:
            model, ckpt = load_model(run['folder'], device)
            x, y = windows(val_tokens(ckpt), model.config.block_size, max_windows)
            results[name].append(exit_benchmark(model, x, y, model.config.n_loop))
    return results


def seed_mean(seeds, score, point, key):
    """One entry of exit_benchmark's rows (score, operating point -> key: loops, ppl or tok_s), averaged over the
    seeds of a condition (seeds: one list of rows per seed)."""
    return float(np.mean([next(r[key] for r in rows if r['score'] == score and r['point'] == point) for rows in seeds]))


def exit_summary(results):
    """exit_table.md's header and rows. Per condition (mean over seeds): the plain depth-K model's perplexity and
    tok/s, and for every score the calibrated exit's mean loops, perplexity and tok/s, measured on the held-out half
    of the windows."""
    header = ['condition', 'ppl (depth K)', 'tok/s (depth K)'] + [f"{s} {col}" for s in SCORES
                                                                  for col in ('loops', 'ppl', 'tok/s')]
    rows = []
    for name, seeds in results.items():
        plain = seeds[0][0]['point']  # 'depth K': the first row, the model without an exit
        row = [name, f"{seed_mean(seeds, 'none', plain, 'ppl'):.3f}",
               f"{seed_mean(seeds, 'none', plain, 'tok_s'):,.0f}"]
        for s in SCORES:
            row += [f"{seed_mean(seeds, s, 'calibrated', 'loops'):.2f}",
                    f"{seed_mean(seeds, s, 'calibrated', 'ppl'):.3f}",
                    f"{seed_mean(seeds, s, 'calibrated', 'tok_s'):,.0f}"]
        rows.append(row)
    return header, rows


def plot_pareto(results, path, title, styles):
    """fig4_pareto.png and .svg: perplexity against measured throughput, one panel per exit score and one line per
    condition through its operating points (mean over seeds; styles: (colour, line, marker) per condition, the
    other figures' own); the star is the plain depth-K model."""
    plt = pyplot()
    import matplotlib.ticker
    fig, axes = plt.subplots(1, len(SCORES), figsize=(15, 4.8), sharey=True)
    for ax, score in zip(axes, SCORES):
        for (name, seeds), (color, ls, marker) in zip(results.items(), styles):
            points = [p['point'] for p in seeds[0] if p['score'] == score]
            xy = sorted((seed_mean(seeds, score, p, 'tok_s'), seed_mean(seeds, score, p, 'ppl')) for p in points)
            ax.plot(*zip(*xy), color=color, ls=ls, marker=marker, ms=4, label=name)
            plain = seeds[0][0]['point']
            ax.plot(seed_mean(seeds, 'none', plain, 'tok_s'), seed_mean(seeds, 'none', plain, 'ppl'),
                    marker='*', ms=12, color=color, ls='none')
        ax.set(xlabel='measured throughput (thousand tokens/s)', title=f"score: {score}")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1000:g}"))
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel('validation perplexity (held-out half)')
    axes[-1].legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1))
    fig.suptitle(f"Early exit per sequence: perplexity against measured speed (star: all sequences run K "
                 f"loops)\n{title}", fontsize=10)
    return save_figure(fig, path)


# ---- the scale mechanism ----

def scale_sensitivity(model, x, y, K, scales=SCALES):
    """Loss at every loop when h_k is multiplied by a before the readout (the recurrence is untouched).
    (K, len(scales)) array."""
    out = np.zeros((K, len(scales)))
    with torch.no_grad():
        for k, h in model.loops(model.embed(x), K):
            for j, a in enumerate(scales):
                out[k - 1, j] = F.nll_loss(readout_logp(model, a * h, k).flatten(0, 1), y.flatten()).item()
    return out


def rmsnorm_radial_grad(h, grad_y, weight, eps):
    """<dL/dh, h> per token for y = weight * h / sqrt(mean(h^2) + eps), in closed form, given dL/dy.
    With r^2 = mean(h^2) + eps and S = sum(weight * grad_y * h):
        dL/dh = weight * grad_y / r - h * S / (d * r^3),   so   <dL/dh, h> = (S / r) * eps / r^2,
    zero but for eps: an RMSNorm readout never pushes on the scale of h. h, grad_y: (..., d). Returns (...)."""
    r2 = h.pow(2).mean(-1) + eps
    S = (weight * grad_y * h).sum(-1)
    return S / r2.sqrt() * eps / r2


def radial_gradient(model, x, y, K):
    """Mean over tokens of |<g, h_k>| / (||g|| ||h_k||) at every loop, for g = the gradient of loop k's own
    cross-entropy (through its readout only) and g = the gradient of the training objective; for loops read out
    through an RMSNorm a third column gives the first from the closed form (rmsnorm_radial_grad), else nan.
    (K, 3) array."""
    states, ces, normed = [], [], []
    for k, h in model.loops(model.embed(x), K):
        y_k = model.exit_input(h, k)  # the readout's output (after the coda, if the model has one)
        states.append(h)
        normed.append(y_k)
        ces.append(F.nll_loss(F.log_softmax(model.lm_head(y_k).float(), -1).flatten(0, 1), y.flatten()))
    objective = model.supervision_loss(ces)  # the loss training actually follows, penalty included
    if model.config.norm_penalty > 0:
        objective = objective + model.penalty_loss(states)
    # 'own CE': loop k's cross-entropy through its readout alone; 'training': the whole objective, which also
    # reaches h_k through the later loops
    direct = [torch.autograd.grad(ce, [s, n], retain_graph=True) for ce, s, n in zip(ces, states, normed)]
    total = torch.autograd.grad(objective, states)
    frac = lambda g, s: (F.cosine_similarity(g, s.detach(), dim=-1).abs()).mean().item()
    rows = []
    kind, norm = model.readout.kind, model.readout.norm
    for k, ((g_h, g_y), g_total, s) in enumerate(zip(direct, total, states), 1):
        closed = math.nan
        # loop k is read out through an RMSNorm straight from h_k (a coda comes between them: no closed form;
        # looped.py's LoopedGPT has none)
        if not getattr(model, 'coda', None) and (kind == 'rmsnorm' or (kind == 'final_norm' and k >= K)):
            radial = rmsnorm_radial_grad(s.detach(), g_y, norm.weight.detach(), norm.eps)
            closed = (radial.abs() / (g_h.norm(dim=-1) * s.detach().norm(dim=-1))).mean().item()
        rows.append([frac(g_h, s), frac(g_total, s), closed])
    return np.array(rows)


def clamp(mode):
    """A clamp(k, h_in, h_k) -> h_k for diagnose.passes that takes the radial part out of each loop's update:
    'freeze' rescales every loop after the first to the per-token norm it started from (so all keep loop 1's);
    'remove_radial' subtracts from each update delta = h_k - h_in its component a * u along u = h_in / RMS(h_in),
    a = mean(u * delta) per token; 'none' changes nothing."""
    def freeze(k, h_in, h):  # every pass keeps the scale it started from: the radial part of the update is undone
        return h if k == 1 else h * (h_in.norm(dim=-1, keepdim=True) / h.norm(dim=-1, keepdim=True))

    def remove_radial(k, h_in, h):  # the update loses its component along the state's own direction
        u, a = radial_step(h_in, h)                                   # (B, T, C), (B, T, 1)
        return h - a * u
    return {'none': None, 'freeze': freeze, 'remove_radial': remove_radial}[mode]


@torch.no_grad()
def update_split(model, x, K, mode='none'):
    """Per loop: mean radial increment ||h_k|| - ||h_in|| and mean angle between h_in and h_k (degrees), where
    h_in is what the pass started from (h_{k-1}, or its RMSNorm under 'normed' recurrence), with a radial clamp
    applied (see clamp). Returns ((K, 2) array, the states h_1..h_K)."""
    rows, states = [], []
    for k, h_in, h in passes(model, x, K, clamp(mode)):
        rows.append([(h.norm(dim=-1) - h_in.norm(dim=-1)).mean().item(), angle_deg(h_in, h).mean().item()])
        states.append(h)
    return np.array(rows), states


@torch.no_grad()
def clamp_perplexity(model, x, y, K):
    """Depth-K perplexity as trained and under each radial clamp: {mode: perplexity}."""
    out = {}
    for mode in CLAMPS:
        _, states = update_split(model, x, K, mode)
        out[mode] = math.exp(F.nll_loss(readout_logp(model, states[-1], K).flatten(0, 1), y.flatten()).item())
    return out


@torch.no_grad()
def lemma_check(model, x, n_loop=30):
    """The paper's lemma, measured: run n_loop loops (far past K) and record per loop, as means over tokens,
    s_k = RMS(h_k), the radial increment a = mean(u * delta) with u = h_in / RMS(h_in) and delta = h_k - h_in,
    the angle between h_in and h_k (degrees), and ||u_k - u_in|| * s_k with u = h / RMS(h): the size of the
    step across the direction. If the step stays about the same size while s grows, the turn shrinks like 1/s.
    Returns an (n_loop, 4) array: s_k, a, angle, ||delta u|| * s_k."""
    rows = []
    for k, h_in, h in passes(model, x, n_loop):
        u_in, a = radial_step(h_in, h)
        s = rms(h)                                                    # (B, T, 1)
        step_across = ((h / s - u_in).norm(dim=-1) * s.squeeze(-1)).mean().item()
        rows.append([s.mean().item(), a.mean().item(), angle_deg(h_in, h).mean().item(), step_across])
    return np.array(rows)


def plot_lemma(table, K, title, path):
    """Two panels against loop k: the scale s_k with the step across the direction, and the angle with c / s_k
    (c fitted through loops 2..n) for reference. The grey line marks the trained K. A PNG at path, an SVG
    beside it."""
    plt = pyplot()
    k = np.arange(1, len(table) + 1)
    s, angle, step = table[:, 0], table[:, 2], table[:, 3]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(k, s, 'o-', color='#0072B2', ms=3, label='scale $s_k$ = RMS($h_k$)')
    left.plot(k, step, 's--', color='#D55E00', ms=3, label=r'step across: $\|\Delta u\| \cdot s_k$')
    left.set(xlabel='loop k', ylabel='RMS units', yscale='log', title='scale of the state, and the step across it')
    right.plot(k, angle, 'o-', color='#000000', ms=3, label='angle turned by loop k')
    fit = np.median(angle[1:] * s[1:]) / s  # the best c / s_k through the later loops
    right.plot(k, fit, ':', color='#009E73', label=r'$c / s_k$')
    right.set(xlabel='loop k', ylabel='degrees', yscale='log', title='angle turned per loop, against c / s')
    for ax in (left, right):
        ax.axvline(K, color='grey', lw=0.8)
        ax.grid(True, which='both', alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


PRECISIONS = ('float32', 'bf16_state', 'bf16_autocast')


@torch.no_grad()
def precision_losses(model, x, y, K, batch_size=32):
    """The precision hazard: validation loss at depths K and 2K measured three ways, {mode: [loss at K,
    loss at 2K]}: float32; 'bf16_state', the state rounded to bf16 after every pass (as a bf16 state would be
    stored and carried, read out from the rounded value); 'bf16_autocast', the whole forward under bf16
    autocast (the matrix products in bf16, the residual stream as autocast keeps it). A large state keeps
    its absolute rounding error large while each later pass changes it little."""
    device = x.device.type
    sums = {mode: torch.zeros(2) for mode in PRECISIONS}

    def rounding(k, h_in, h, e):  # 'bf16_state': the state stored, and carried on, in bf16
        return h.bfloat16().to(h.dtype), e
    for i in range(0, len(x), batch_size):
        xb, yb = x[i:i + batch_size], y[i:i + batch_size]
        for mode in PRECISIONS:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=mode == 'bf16_autocast'):
                e = model.embed(xb)
                states = edited_loops(model, e, 2 * K, rounding) if mode == 'bf16_state' else model.loops(e, 2 * K)
                for k, h in states:
                    if k in (K, 2 * K):  # weighted by the batch's windows: the last batch may be smaller
                        sums[mode][k // K - 1] += (len(xb)
                                                   * model.head_loss(model.exit_input(h, k), yb)[1].float().item())
    return {mode: (total / len(x)).tolist() for mode, total in sums.items()}


def val_tokens(ckpt, dataset=None, name='the checkpoint'):
    """The validation split, as a uint16 array, of the dataset a checkpoint was trained on: the folder its data
    identity names (an absolute path, so it does not depend on where this runs), or the one given; either way
    checked to be the very data it was trained on (ValueError in one line otherwise)."""
    recorded = (ckpt.get('data') or {}).get('path')
    folder = find_dataset(dataset or (recorded if recorded and os.path.isdir(recorded) else ckpt['args']['dataset']))
    meta, splits, identity = read_dataset(folder)
    check_same_data(ckpt, meta, identity, name)
    return splits['val']


def exit_table_text(rows):
    """exit_benchmark's rows as a markdown table."""
    return markdown(['score', 'operating point', 'threshold', 'mean loops', 'ppl', 'tok/s'],
                    [[r['score'], r['point'], f"{r['threshold']:.4g}", f"{r['loops']:.2f}", f"{r['ppl']:.3f}",
                      f"{r['tok_s']:,.0f}"] for r in rows])


def fmt_row(label, values, f='8.3f'):
    """One fixed-width table row, so that the printed tables line up."""
    return f"{label:>10} " + ' '.join(f"{v:{f}}" for v in values)


def get_parser():
    p = tool_parser(PROG, __doc__)
    p.add_argument('--out_dir', default='out/laptop', help='the run folder that holds ckpt.pt')
    p.add_argument('--only', default='all',
                   choices=['all', 'depth', 'exit', 'scale', 'gate', 'lemma', 'precision', 'layers'],
                   help="gate: the exit gate's weight against what it reads (runs with --supervision=gated); "
                        "precision: the loss at K and 2K in float32 against a bf16 state and bf16 autocast; "
                        "layers: ||h|| after every layer of every pass, where the scale is written")
    p.add_argument('--max_windows', type=int, default=None, help='cap on validation windows for depth and exit')
    p.add_argument('--diag_windows', type=int, default=32, help='validation windows for the scale diagnostics')
    p.add_argument('--lemma_loops', type=int, default=30, help='loops run by the lemma check')
    p.add_argument('--fig', default=None, help='where the lemma figure goes (default: <out_dir>/lemma.png)')
    p.add_argument('--timed', default=True, type=flag, metavar='BOOL',
                   help='with --only=exit or all: also run the timed per-sequence benchmark (True/False)')
    p.add_argument('--dataset', default=None,
                   help='the data to measure on (default: the dataset the checkpoint records); it must be the data '
                        'the checkpoint was trained on')
    p.add_argument('--device', default='auto', help='auto, cpu, cuda or mps')
    return p


def flag(text):
    """argparse type for True/False flags (also 1/0, yes/no)."""
    value = {'true': True, '1': True, 'yes': True, 'false': False, '0': False, 'no': False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")
    return value


def load(p, args):
    """Check every flag, then the checkpoint and the data it was trained on, and that the lemma figure can be
    written: all before any table. Returns (model, ckpt, validation tokens, the figure's path)."""
    for flag_name, value, least in (('max_windows', args.max_windows, 2), ('diag_windows', args.diag_windows, 1),
                                    ('lemma_loops', args.lemma_loops, 2)):
        at_least(p, f'--{flag_name}', value, least)  # the exit tables calibrate on one half and measure on the other
    # --out_dir may name the run folder or its ckpt.pt (as sample.py allows); the figure goes into the folder
    run_dir = os.path.dirname(args.out_dir) if os.path.isfile(args.out_dir) else args.out_dir
    ckpt_path = args.out_dir if os.path.isfile(args.out_dir) else os.path.join(args.out_dir, 'ckpt.pt')
    fig_path = args.fig or os.path.join(run_dir, 'lemma.png')
    try:
        model, ckpt = load_model(ckpt_path, resolve_device(args.device).device)
        tokens = val_tokens(ckpt, args.dataset, ckpt_path)
        if args.only in ('all', 'lemma'):
            check_writable(fig_path)  # before the work, not after it
    except (ValueError, OSError) as e:
        p.error(str(e))
    return model, ckpt, tokens, fig_path


def print_depth_table(ce, K):
    """Perplexity at every exit depth 1..2K."""
    print(f"\nperplexity by exit depth ({ce.shape[0]:,} validation tokens, each counted once)")
    print(fmt_row('depth', range(1, 2 * K + 1), '8d'))
    print(fmt_row('ppl', np.exp(ce.mean(0))))


def same_exit_note(depths, K):
    """A one-line note when an exit rule sends every token out at the same loop (depths: (tokens,) ints), so that
    its mean loops is no per-token decision at all; None when the tokens exit at different loops."""
    if len(depths) == 0 or not (depths == depths[0]).all():
        return None
    loop = int(depths[0])
    why = "no token exits early" if loop == K else "the rule does not tell tokens apart here"
    return f"note: at this threshold every token exits at loop {loop} of {K}: {why}"


def print_token_exit(ce, pmax, kl, latent, m, K):
    """Per token (sample.py's rules): calibrated on the first m tokens (the first half of the windows), reported on
    the rest, with a note under a rule that sends every token out at the same loop."""
    print(f"\nearly exit per token (sample.py --exit): the threshold with the fewest mean loops whose perplexity "
          f"is within 1% of depth {K} on the first half of the windows, measured on the second half")
    for rule in EXITS:
        t = calibrate_exit(rule, ce[:m], pmax[:m], kl[:m], K, latent=latent[:m])[0]
        d = exit_depths(rule, t, pmax[m:], kl[m:], K, latent[m:])
        print(f"{rule:>10}: threshold {t:.4g}, mean loops {d.mean():.2f} of {K}, perplexity "
              f"{math.exp(ce[m:][np.arange(len(d)), d - 1].mean()):.3f} "
              f"(depth {K}: {math.exp(ce[m:, K - 1].mean()):.3f})")
        note = same_exit_note(d, K)
        if note:
            print(f"{'':>12}{note}")


def print_sequence_exit(model, x, y, K, device):
    """Per sequence, timed: exit_benchmark's table."""
    rows = exit_benchmark(model, x, y, K)
    print(f"\nearly exit per sequence (scores averaged over a window's tokens; exited windows leave the "
          f"batch): calibrated on {len(x) // 2} windows, measured on {len(x) - len(x) // 2}, tok/s timed "
          f"on {device}")
    print(exit_table_text(rows))


def print_scale_sensitivity(model, x, y, K):
    print(f"\nscale sensitivity: validation loss when h_k is multiplied by a before the readout ({len(x)} windows)")
    print(fmt_row('a =', SCALES, '8g'))
    for k, row in enumerate(scale_sensitivity(model, x, y, K), 1):
        print(fmt_row(f"loop {k}", row))


def print_radial_gradient(model, x, y, K):
    try:  # the closed form is a function of its own: where it is not written yet, this table is left out
        table = radial_gradient(model, x, y, K)
    except NotImplementedError as e:
        print(f"\nradial gradient fraction: left out (rmsnorm_radial_grad is not implemented: {e})")
        return
    print("\nradial gradient fraction |<g, h_k>| / (|g| |h_k|), mean over tokens (closed form: RMSNorm readouts)")
    print(f"{'':>10} {'own CE':>8} {'training':>8} {'closed':>8}")
    for k, row in enumerate(table, 1):
        print(fmt_row(f"loop {k}", row, '8.2e'))


@torch.no_grad()
def gate_alignment(model, x, K):
    """Why a gate on a large state need not saturate (supervision='gated'): its logit is w . z_k + b, so
    |logit| <= ||w|| ||z_k|| |cos(w, z_k)| + |b|. Per loop k, means over tokens: ||z_k|| (what the gate reads),
    ||w||, |cos(w, z_k)| and |logit|."""
    w = model.exit_gate.weight[0].float()
    rows = []
    for k, _, h in passes(model, x, K):
        z = (h if model.config.gate_input == 'raw' else model.exit_input(h, k)).float()  # (B, T, C)
        cos = (z @ w) / (z.norm(dim=-1) * w.norm()).clamp_min(1e-12)  # (B, T)
        logit = model.gate_logit(h, k)
        rows.append([z.norm(dim=-1).mean().item(), w.norm().item(), cos.abs().mean().item(),
                     logit.abs().mean().item()])
    return rows


def print_gate_alignment(model, x, K):
    print(f"\nthe exit gate (reads {model.config.gate_input}): logit = w . z_k + b with bias b = "
          f"{model.exit_gate.bias.item():+.2f}; means over tokens ({len(x)} windows)")
    print(f"{'':>10} {'||z_k||':>8} {'||w||':>8} {'|cos|':>8} {'|logit|':>8}")
    for k, row in enumerate(gate_alignment(model, x, K), 1):
        print(fmt_row(f"loop {k}", row, '8.3f'))


def print_update_split(model, x, K):
    split, states = update_split(model, x, K)
    print("\nper-loop update from the state the pass starts from: radial increment and angle (degrees)")
    print(f"{'':>10} {'||h_k||':>8} {'radial':>8} {'angle':>8}")
    for k, (row, h) in enumerate(zip(split, states), 1):
        print(fmt_row(f"loop {k}", [h.norm(dim=-1).mean().item(), *row], '8.2f'))


def print_clamps(model, x, y, K):
    ppl = clamp_perplexity(model, x, y, K)
    print(f"\nradial clamps: depth-{K} perplexity {ppl['none']:.3f} as trained, {ppl['freeze']:.3f} with every "
          f"loop frozen at loop 1's norm, {ppl['remove_radial']:.3f} with the radial part of every update removed")


def print_precision(model, x, y, K):
    losses = precision_losses(model, x, y, K)
    print(f"\nprecision: validation loss at depth {K} and {2 * K} ({len(x)} windows), float32 against the "
          "state rounded to bf16 after every pass and against bf16 autocast (difference from float32)")
    print(f"{'':>14} {'depth ' + str(K):>10} {'depth ' + str(2 * K):>10} {'diff K':>8} {'diff 2K':>8}")
    base = losses['float32']
    for mode, (at_k, at_2k) in losses.items():
        print(f"{mode:>14} {at_k:10.4f} {at_2k:10.4f} {at_k - base[0]:+8.4f} {at_2k - base[1]:+8.4f}")


def print_lemma(model, x, K, n_loop, title, fig_path):
    """The lemma check's table over n_loop loops, and its figure."""
    table = lemma_check(model, x, n_loop)
    print(f"\nlemma check over {n_loop} loops (trained K={K}; means over tokens, RMS units)")
    print(f"{'':>10} {'s_k':>8} {'radial':>8} {'angle':>8} {'|du|*s':>8}")
    for k, row in enumerate(table, 1):
        print(fmt_row(f"loop {k}", row, '8.3f'))
    print(f"wrote {plot_lemma(table, K, title, fig_path)}")


@torch.no_grad()
def layer_norms(model, x, K):
    """Where the scale is written: the mean per-token ||h|| of the embedding e, then after every layer of every
    pass 1..K (the carry, if any, applied between passes as LoopedGPT.loops does), and the angle in degrees
    between e and h_1 (mean over tokens). [(what, ||h||)] and the angle. looped.py's stack (model.blocks) with
    its loop_pass of layers in order; a design that overrides loop_pass is measured at its passes only."""
    e = model.embed(x)
    rows, h = [('embedding e', e.float().norm(dim=-1).mean().item())], e
    plain = type(model).loop_pass is LoopedGPT.loop_pass
    for k in range(1, K + 1):
        if k > 1:
            h = model.carry(h)
        if plain:
            for i, block in enumerate(model.blocks):
                h = block(h)
                rows.append((f"pass {k}, after layer {i + 1}", h.float().norm(dim=-1).mean().item()))
        else:
            h = model.loop_pass(h, e, k, K)
            rows.append((f"pass {k}", h.float().norm(dim=-1).mean().item()))
        if k == 1:
            angle = angle_deg(e.float(), h.float()).mean().item()
    return rows, angle


def readout_gain(model):
    """The RMS of the readout norm's per-channel gain (1 at init), or None for a readout without one."""
    weight = getattr(getattr(model.readout, 'norm', None), 'weight', None)
    return None if weight is None else weight.detach().float().pow(2).mean().sqrt().item()


def print_layer_norms(model, x, K):
    rows, angle = layer_norms(model, x, K)
    gain = readout_gain(model)
    print(f"\n||h|| after each layer (mean over tokens of {len(x)} validation windows); angle(e, h_1) "
          f"{angle:.1f} degrees; readout gain RMS " + ('-' if gain is None else f"{gain:.3f}"))
    print(markdown(['where', '||h||'], [[what, f"{v:,.2f}"] for what, v in rows]))


def main(argv=None):
    """Check every flag and the checkpoint's data first, then print the chosen tables in order."""
    p = get_parser()
    args = p.parse_args(argv)
    model, ckpt, tokens, fig_path = load(p, args)
    device = next(model.parameters()).device
    c = model.config
    K = c.n_loop
    print(f"{args.out_dir} at step {ckpt['step']}: {condition_name(asdict(c))}, K={K}, on {device}")

    if args.only in ('all', 'depth', 'exit'):
        x, y = windows(tokens, c.block_size, args.max_windows)
        ce, pmax, kl, latent = per_token_depth_stats(model, x.to(device), y.to(device), 2 * K)
        print_depth_table(ce, K)
        if args.only != 'depth':
            print_token_exit(ce, pmax, kl, latent, len(x) // 2 * c.block_size, K)
            if args.timed:
                print_sequence_exit(model, x, y, K, device)
            else:
                print("\n(timed per-sequence benchmark skipped: --timed=False)")

    # the scale diagnostics need gradients or many forward passes per window: a fixed, smaller set of windows
    x, y = (t.to(device) for t in windows(tokens, c.block_size, args.diag_windows))
    if args.only in ('all', 'scale'):
        print_scale_sensitivity(model, x, y, K)
        print_radial_gradient(model, x, y, K)
        print_update_split(model, x, K)
        print_clamps(model, x, y, K)
    gate = getattr(model, 'exit_gate', None)  # looped.py's LoopedGPT has none; a gated design run has one
    if args.only == 'gate' or (args.only == 'all' and gate is not None):
        if gate is None:
            p.error(f"--only=gate: {args.out_dir} has no exit gate (not trained with --supervision=gated)")
        print_gate_alignment(model, x, K)
    if args.only in ('all', 'precision'):
        print_precision(model, x, y, K)
    if args.only in ('all', 'layers'):
        print_layer_norms(model, x, K)
    if args.only in ('all', 'lemma'):
        title = f"{args.out_dir} ({condition_name(asdict(c))}), step {ckpt['step']}"
        print_lemma(model, x, K, args.lemma_loops, title, fig_path)


if __name__ == '__main__':
    main()
