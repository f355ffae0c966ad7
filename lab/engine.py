"""
Generation's engine: a KV cache per layer and loop, per-sequence early exit, and the exit rules.

looped.py's LoopedGPT.generate is the reference: every token reruns the whole window through a fixed
number of loops. This module gives the same tokens at a fixed depth (tests/test_generation.py pins
it) while a new token runs its loops over one position, and lets each sequence of a batch stop
looping at its own loop once an exit rule passes:

    confidence   the top probability reaches the threshold
    kl           KL(p_k || p_{k-1}) falls to the threshold or below
    latent       ||h_k - h_{k-1}|| / ||h_{k-1}|| does (Huginn's and looped_nanochat's rule)
    gate         the learned gate's cumulative exit probability 1 - prod_{j<=k} (1 - lambda_j)
                 reaches it (Ouro's rule; a model trained with supervision='gated' has the gate)

The shared stack sees another state at every loop, so the cache keeps one entry per layer and loop.
A token that exits at loop d ran no later loop: each later loop's entry at its position takes loop
d's keys and values (Huginn's sharing), since running them to fill the cache would undo the exit.
The window is the last block_size tokens and, once full, restarts from its newest half, recomputed:
a rolling window cannot be cached, as every kept token's position would shift.

looped.py's model knows nothing of the cache: while a step runs, KVCache.attached installs a cached
forward on every attention layer of the model (found by its module path) and shifts the position
embedding by the cache's length, and the engine tells the cache which loop runs between the yields
of model.loops. So it serves looped.py's LoopedGPT and lab/designs.py's DesignedGPT alike.

Used by sample.py, lab/bench.py (--generate) and lab/diagnose.py (the exit rules).
"""

import inspect
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
import torch.nn.functional as F

from looped import sample

EXITS = ('confidence', 'kl', 'latent')  # the training-free rules, which any model can use
RULES = EXITS + ('gate',)  # and the learned gate's


def latent_change(h, h_prev):
    """||h - h_prev|| / ||h_prev|| over the last dimension, in float32: (..., C) -> (...)."""
    h, h_prev = h.float(), h_prev.float()
    return (h - h_prev).norm(dim=-1) / h_prev.norm(dim=-1).clamp_min(1e-12)


def angle_deg(a, b):
    """Per-token angle between a and b in degrees, 2 atan2(|u - v|, |u + v|): acos(<u, v>),
    accurate near 0. (..., C) each -> (...)."""
    u, v = F.normalize(a.float(), dim=-1), F.normalize(b.float(), dim=-1)
    return torch.rad2deg(2 * torch.atan2((u - v).norm(dim=-1), (u + v).norm(dim=-1)))


def exit_passes(rule, threshold, logp, logp_prev, h=None, h_prev=None):
    """Whether an exit rule passes at one loop: logp, logp_prev (..., V) are this loop's and the
    last loop's log-probabilities, h, h_prev (..., C) the states (h_prev = h_0 = e at loop 1).
    With nothing to compare (logp_prev or h_prev None) it does not pass: 'kl' never at loop 1.
    Returns a bool tensor (...)."""
    if rule == 'confidence':
        return logp.max(dim=-1).values.exp() >= threshold
    if (rule == 'kl' and logp_prev is None) or (rule == 'latent' and h_prev is None):
        return torch.zeros(logp.shape[:-1], dtype=torch.bool, device=logp.device)
    if rule == 'latent':
        return latent_change(h, h_prev) <= threshold
    if rule != 'kl':
        raise ValueError(f"exit rule {rule!r} is not one of {', '.join(EXITS)}")
    return (logp.exp() * (logp - logp_prev)).sum(dim=-1) <= threshold


def attend(attn, x, kv):
    """looped.py's CausalSelfAttention.forward over a cache: x (B, T, C) holds the newest T of L
    positions, and kv(k, v) stores this call's keys and values (B, nh, T, hs) and returns all so
    far (B, nh, L, hs). The T queries see every cached position and, causally, each other."""
    B, T, C = x.shape
    q, k, v = attn.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, attn.n_head, C // attn.n_head).transpose(1, 2) for t in (q, k, v))
    k, v = kv(k, v)                                                   # (B, nh, L, hs), L >= T
    L = k.size(2)
    seen = None if T == 1 else torch.ones(T, L, dtype=torch.bool, device=x.device).tril(L - T)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=seen,
                                       dropout_p=attn.dropout if attn.training else 0.0)
    return attn.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class KVCache:
    """Every attention layer's keys and values for the context so far, one entry per layer and loop:
    ('prelude', i), ('loop', k, i), ('coda', k, i). An entry is two buffers (B, nh, block_size, hs),
    filled up to length. loop is the loop running now: loop k's pass, then the coda after it."""

    KINDS = {'blocks': 'loop', 'prelude': 'prelude', 'coda': 'coda'}  # module list -> entry kind

    def __init__(self, block_size):
        self.block_size, self.length, self.kv, self.loop = block_size, 0, {}, 1

    def store(self, key, k, v):
        """Stores layer `key`'s new keys and values (B, nh, T, hs) after the cached ones and returns
        all of them, (B, nh, length + T, hs) each."""
        if key not in self.kv:
            shape = (*k.shape[:2], self.block_size, k.size(3))
            self.kv[key] = (k.new_zeros(shape), v.new_zeros(shape))
        end = self.length + k.size(2)
        keys, values = self.kv[key]
        keys[:, :, self.length:end], values[:, :, self.length:end] = k, v
        return keys[:, :, :end], values[:, :, :end]

    def layer(self, path):
        """The kv function (see attend) of the attention at module path `path` (blocks.i.attn,
        prelude.i.attn, coda.i.attn): the entry of the loop running now, but in the prelude."""
        kind, i = self.KINDS[path.split('.')[0]], int(path.split('.')[1])
        if kind == 'prelude':  # run once, before the loop
            return lambda k, v: self.store((kind, i), k, v)
        return lambda k, v: self.store((kind, self.loop, i), k, v)

    @contextmanager
    def attached(self, model):
        """While it lasts, model runs over the cache: positions start at length (a pre-hook on the
        position embedding) and every attention layer reads and writes its entry. An attention
        whose forward takes kv (lab/designs.py's ManualAttention) runs its own cached path."""
        hook = model.wpe.register_forward_pre_hook(lambda _, args: (args[0] + self.length,))
        layers = [(path, m) for path, m in model.named_modules() if path.endswith('.attn')]
        for path, attn in layers:
            kv, own = self.layer(path), 'kv' in inspect.signature(attn.forward).parameters
            attn.forward = partial(attn.forward, kv=kv) if own else partial(attend, attn, kv=kv)
        try:
            yield self
        finally:
            hook.remove()
            for _, attn in layers:
                del attn.forward  # the class's forward again

    def loops(self, model, e, n_loop):
        """model.loops(e, n_loop), with loop set to k from pass k until pass k + 1 is asked for."""
        self.loop = 1
        for k, h in model.loops(e, n_loop):
            yield k, h
            self.loop = k + 1

    def share(self, depth, n_loop):
        """After a decoded token: a sequence that exited at loop depth[b] ran no later loop, so each
        later loop's entry at the newest position takes the entry of the loop before it."""
        t = self.length - 1
        for j in range(2, n_loop + 1):
            skipped = depth < j                               # (B,): rows that stopped before j
            for kind, k, i in [key for key in self.kv if key[0] != 'prelude' and key[1] == j - 1]:
                src = self.kv[kind, k, i]
                if (kind, j, i) not in self.kv:                 # a loop no row has run yet
                    self.kv[kind, j, i] = tuple(map(torch.zeros_like, src))
                dst = self.kv[kind, j, i]
                for to, fro in zip(dst, src):
                    to[skipped, :, t] = fro[skipped, :, t]


def next_gate(model, h, k):
    """Loop k's exit-gate logit for the last position, (B, T, C) -> (B,). A coda attends, so a gate
    on the head's input runs it on every position (and writes its cache entries again, the same)."""
    coda = getattr(model, 'coda', None)  # looped.py's LoopedGPT has none (nor a gate)
    return model.gate_logit(h if coda else h[:, -1:, :], k)[:, -1]


def next_logits(model, h, k):
    """Loop k's logits for the token after the last position, (B, T, C) -> (B, V). A coda attends,
    so it runs on every position (a cache holds the earlier ones); without one the last will do."""
    coda = getattr(model, 'coda', None)  # looped.py's LoopedGPT has none; lab/designs.py's may
    x = model.exit_input(h if coda else h[:, -1:, :], k)[:, -1, :]  # (B, C)
    return model.lm_head(x)


@torch.inference_mode()
def next_logprobs(model, window, n_loop, exit_rule=None, exit_threshold=None, cache=None):
    """One step: the log-probabilities (B, V) of the token after window (B, T), and the loop (B,) at
    which each sequence exited (the first whose readout passes the rule, or n_loop). A sequence that
    stopped keeps its own loop's readout while the others go on. With a cache only the positions
    after its length run; a prefill (an empty cache) runs every loop, to fill the cache."""
    if exit_rule == 'gate' and getattr(model, 'exit_gate', None) is None:
        raise ValueError("exit rule 'gate' needs a model trained with --supervision=gated; this "
                         "one has no exit gate (use confidence, kl or latent)")
    B, prefill = window.size(0), cache is None or cache.length == 0
    new = window if cache is None else window[:, cache.length:]      # the positions not cached
    with nullcontext() if cache is None else cache.attached(model):
        e = model.embed(new)                                          # (B, T_new, C)
        logp, logp_prev, h_prev = None, None, e[:, -1, :]             # latent compares h_1 with e
        depth, done = window.new_full((B,), n_loop), window.new_zeros(B, dtype=torch.bool)
        stay = torch.ones(B, device=window.device)  # the gate: the probability of no exit so far
        loops = model.loops(e, n_loop) if cache is None else cache.loops(model, e, n_loop)
        for k, h in loops:
            if exit_rule is None and k < n_loop:
                continue                                              # no rule: the last loop alone
            logp_k = F.log_softmax(next_logits(model, h, k).float(), dim=-1)  # (B, V)
            h_last = h[:, -1, :]                                      # (B, C)
            if exit_rule is None or k == n_loop:
                stops = ~done
            elif exit_rule == 'gate':
                stay = stay * (1 - torch.sigmoid(next_gate(model, h, k)))
                stops = (1 - stay >= exit_threshold) & ~done
            else:
                passes = exit_passes(exit_rule, exit_threshold, logp_k, logp_prev, h_last, h_prev)
                stops = passes & ~done
            logp = logp_k if logp is None else torch.where(stops[:, None], logp_k, logp)
            depth[stops], done = k, done | stops
            if done.all() and not (cache is not None and prefill):
                break
            logp_prev, h_prev = logp_k, h_last
    if cache is not None:
        cache.length += e.size(1)
        if exit_rule is not None and not prefill:
            cache.share(depth, n_loop)
    return logp, depth


@torch.inference_mode()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, n_loop=None, exit_rule=None,
             exit_threshold=None, cache=True):
    """Append max_new_tokens sampled tokens to idx (B, T), each sequence exiting at its own loop by
    an exit rule. cache: True keeps a KVCache; False recomputes the window for every token (with a
    rule the two differ: recomputing reruns the context through every loop where the cache shares
    an exited token's keys and values); or a fresh KVCache to fill.
    Returns (idx, depth): depth (B, max_new_tokens) is the loop each new token exited at."""
    K, block = n_loop or model.config.n_loop, model.config.block_size
    cache = KVCache(block) if cache is True else cache or None
    start, depths = max(0, idx.size(1) - block), []
    for _ in range(max_new_tokens):
        if idx.size(1) - start > block:  # the window is full: its newer half, in a fresh cache
            start, cache = idx.size(1) - block // 2, cache and KVCache(block)
        logp, depth = next_logprobs(model, idx[:, start:], K, exit_rule, exit_threshold, cache)
        depths.append(depth)
        idx = torch.cat((idx, sample(logp, temperature, top_k)), dim=1)
    return idx, torch.stack(depths, 1) if depths else idx.new_zeros(idx.size(0), 0)
