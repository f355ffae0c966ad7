"""
A looped (depth-recurrent) transformer language model, in one file.

One shared stack of pre-norm transformer layers is applied n_loop (K) times. Every loop's hidden state h_k is read out
through the LM head (so it can be supervised: "per-loop" or "dense" supervision) and is also fed back into the next
loop. The paper this reproduces ("Dense Supervision Is Not Enough: The Readout Blind Spot in Looped Language Models",
Sharma & Vu, 2026) shows that a scale-invariant readout (RMSNorm or LayerNorm before the head) hides ||h_k|| from the
loss, while the pre-norm residual loop keeps carrying and growing it. The variants below expose or remove that blind
spot (each one LoopedConfig field with its choices, and a train.py flag of the same name):

    readout      rmsnorm | layernorm   scale-invariant: the loss cannot see ||h||
                 raw                   no norm: the head sees the scale, so the loss controls it
                 final_norm            raw at loops 1..K-1, RMSNorm at loop K
                 alpha                 s_ref^(1-alpha) * s^alpha * h/s with s = RMS(h): alpha=0 invariant, 1 raw
    recurrence   residual              loop k+1 starts from h_k: the scale is carried from loop to loop
                 normed                loop k+1 starts from RMSNorm(h_k): the scale is not carried over
    supervision  per_loop | terminal   mean of the K cross-entropies, or the last one only
    norm_penalty lambda                adds lambda * mean_k mean(h_k^2)

The other looped LMs (Huginn, looped_nanochat, nanoLOOP) build the loop in ways that are knobs here too:

    injection    none | add | concat   pass k runs on h_{k-1}, on h_{k-1} + e, or on W [h_{k-1}; e] (W = [I | 0] at
                                       init); e = h_0, the embedding after the prelude (LoopedGPT.pass_input)
    n_prelude    int                   unshared layers run once on the embedding, before the loop (embed)
    n_coda       int                   unshared layers between every h_k and its readout (head_input)
    block        prenorm | sandwich    x + f(norm(x)), or norm(x + f(norm(x))) for each sublayer (Block)
    depth_sampling fixed | poisson_lognormal   training only: a loop count drawn per step (sampled_depth)
    bptt         int                   gradient through the last bptt passes only; 0: all (pass_input)
    residual_scale none | inverse_k    each pass's update scaled by 1/K (loop_step)
    exit rules   confidence | kl | latent      at inference: exit_passes (sample.py --exit, lab/diagnose.py)

The other fields are the shape (vocab_size, block_size, n_embd, n_head, n_layer, n_loop, dropout), the readout's alpha,
and choices that leave the concept alone: init, mlp, tie_weights, attention, norm_eps.

In every variant h_k is the output of pass k before any inter-loop norm or coda: it is what is carried, read out,
penalized and logged (LoopedGPT.loops is the one place that runs the passes).

The model alone, no side effects on import: checkpoints and run names are lab/runs.py's, the device lab/runtime.py's.
"""

import math
import zlib
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

def knob(default, help, choices=None, tag=None, label=None, named=None, variant=True):
    """A LoopedConfig field and what the scripts derive from it: argparse choices and help (train.py's flags) and,
    for a variant (a field with choices or a tag), its names off its default: tag + value in the run folder's name
    (out/laptop-pen0.01; no tag: the field's name, out/laptop-readout_raw), and label, a format string of the value
    v, in the condition's name (' + penalty {v}'; default ' + {v}' or ' + <tag>{v}'); named: values with a fixed one.
    Declaring a design here, once, gives it a flag, a checkpoint entry, a run name and a row in the tables (lab/runs.py
    derives the names). variant=False keeps a field with choices out of names (an implementation choice)."""
    return field(default=default, metadata={'help': help, 'choices': choices, 'tag': tag, 'label': label,
                                            'named': named or {}, 'variant': variant})


@dataclass
class LoopedConfig:
    # ---- size (train.py's --config sets these; they are not variants of the model)
    vocab_size: int = knob(65, 'vocabulary size: 65 = the characters of tiny Shakespeare (set from the data)')
    block_size: int = knob(128, 'context length T; also the size of the learned position table')
    n_embd: int = knob(128, 'width d of the residual stream')
    n_head: int = knob(4, 'attention heads; must divide n_embd')
    n_layer: int = knob(2, 'layers in the ONE shared stack (unique layers, not the unrolled depth)')
    n_loop: int = knob(4, 'K: how many times the stack is applied (unrolled depth = n_layer * K)')
    dropout: float = knob(0.0, 'the paper uses 0.1; 0 on tiny CPU runs, where it only slows learning')
    # ---- the paper's variants
    supervision: str = knob('per_loop', 'which loops get a cross-entropy: all K (dense), or the last',
                            ('per_loop', 'terminal'))
    readout: str = knob('rmsnorm', 'what the LM head sees of h_k (table at the top of looped.py)',
                        ('rmsnorm', 'layernorm', 'raw', 'final_norm', 'alpha'))
    alpha: Optional[float] = knob(None, "readout=alpha only: unset learns alpha, a number in [0, 1] fixes it "
                                  "(1 = raw, 0 = scale-invariant)", tag='alpha', label=' {v}')
    norm_penalty: float = knob(0.0, 'lambda in lambda * mean_k mean(h_k^2); the paper uses 0.01', tag='pen',
                               label=' + penalty {v}', named={0.01: ' + penalty'})
    recurrence: str = knob('residual', 'what the next loop starts from: h_k, or RMSNorm(h_k)', ('residual', 'normed'))
    init: str = knob('paper', "'paper': the authors' PyTorch-default recipe; 'gpt2': nanoGPT's; 'paper_small_embed': "
                     "the paper's with the embeddings at gpt2's scale; see _init_weights",
                     ('paper', 'gpt2', 'paper_small_embed'), label=' ({v} init)')
    mlp: str = knob('swiglu', 'SwiGLU (the paper) or GELU (GPT-2), both with hidden width 4d', ('swiglu', 'gelu'))
    # ---- the field's designs (Huginn, looped_nanochat, nanoLOOP build the loop these ways)
    injection: str = knob('none', "what each pass starts from besides the carried state: nothing, h + e, or W [h; e] "
                          "(W initialised to [I | 0]); e = the embedding after the prelude", ('none', 'add', 'concat'))
    n_prelude: int = knob(0, 'unshared layers applied once, before the loop', tag='prelude')
    n_coda: int = knob(0, "unshared layers applied to each loop's state on its way to the readout", tag='coda')
    block: str = knob('prenorm', "every layer: x + f(norm(x)), or sandwich: norm(x + f(norm(x))) for each sublayer",
                      ('prenorm', 'sandwich'))
    depth_sampling: str = knob('fixed', 'training only: every step trains K loops, or a loop count drawn from a '
                               'Poisson log-normal of mean K (see sampled_depth)', ('fixed', 'poisson_lognormal'))
    residual_scale: str = knob('none', "'inverse_k': each pass's update scaled by 1/K, h_in + (pass(h_in) - h_in) / K "
                               "(arXiv 2606.18524's fix for residual growth)", ('none', 'inverse_k'))
    bptt: int = knob(0, 'backprop through the last bptt loops only (the carried state detached before them); 0: all',
                     tag='bptt')
    # ---- implementation choices (the same model, or nearly); tie_weights unset follows init: one flag a recipe
    tie_weights: Optional[bool] = knob(None, "LM head shares the token embedding; unset: tied unless init=gpt2")
    attention: str = knob('sdpa', "'sdpa' (fused / flash kernels) or 'manual' (the same math, spelled out)",
                          ('sdpa', 'manual'), variant=False)
    norm_eps: float = knob(1e-6, 'epsilon of every RMSNorm, as in the authors\' release')

    def __post_init__(self):
        self.tie_weights = self.init != 'gpt2' if self.tie_weights is None else self.tie_weights
        choices = {f.name: f.metadata['choices'] for f in fields(self) if f.metadata['choices']}
        checks = [(name, getattr(self, name) in c, 'is not one of ' + ', '.join(c)) for name, c in choices.items()]
        checks += [(n, getattr(self, n) >= 1, 'must be at least 1')
                   for n in ('vocab_size', 'block_size', 'n_embd', 'n_head', 'n_layer', 'n_loop')]
        checks += [(n, getattr(self, n) >= 0, 'must be at least 0') for n in ('n_prelude', 'n_coda', 'bptt')]
        checks += [('n_embd', self.n_embd % max(self.n_head, 1) == 0, f"is not divisible by n_head={self.n_head}"),
                   ('norm_eps', 0 < self.norm_eps < math.inf, 'must be a finite number > 0'),  # nan fails both
                   ('dropout', 0.0 <= self.dropout < 1.0, 'must be in [0, 1)'),
                   ('norm_penalty', 0 <= self.norm_penalty < math.inf, 'must be a finite number >= 0'),
                   ('alpha', self.alpha is None or 0 <= self.alpha <= 1, 'must be in [0, 1] (or unset, to learn it)'),
                   ('alpha', self.alpha is None or self.readout == 'alpha',
                    f"is only used by readout='alpha', not {self.readout!r}")]
        for name, ok, why in checks:  # the first failure, in one line
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} {why}")

    @staticmethod
    def choices(name):
        return LoopedConfig.__dataclass_fields__[name].metadata['choices']

    @staticmethod
    def variants():
        """The fields that make a condition (with choices or a tag, not implementation choices), in order."""
        return [f for f in fields(LoopedConfig)
                if (f.metadata['choices'] or f.metadata['tag']) and f.metadata['variant']]

    def to_dict(self):
        return asdict(self)


EXITS = ('confidence', 'kl', 'latent')  # early-exit rules at inference, see exit_passes


class RMSNorm(nn.Module):
    """x / rms(x) * g. Scale-invariant: RMSNorm(a * x) == RMSNorm(x) for any a > 0 (up to eps)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        """x (..., C) -> weight * x / sqrt(mean(x^2 over C) + eps), returned in the dtype of x."""
        # in at least fp32 (bf16 and fp16 are upcast): states with norms in the thousands keep their precision
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).type_as(x)


class KVCache:
    """Generation's memory (LoopedGPT.generate): every attention layer's keys and values for the context so far, one
    entry per layer and loop, since the shared stack sees another state at every loop: ('prelude', i), ('loop', k, i),
    ('coda', k, i) for coda layer i on loop k's readout. An entry: two buffers (B, nh, block_size, hs), to length."""

    def __init__(self, block_size):
        self.block_size, self.length, self.kv = block_size, 0, {}

    def layer(self, *key):
        """What layer `key`'s attention calls: stores its keys, values (B, nh, T, hs) at length, returns all so far."""
        def attend(k, v):
            if key not in self.kv:
                self.kv[key] = tuple(t.new_zeros(*t.shape[:2], self.block_size, t.size(3)) for t in (k, v))
            end = self.length + k.size(2)
            keys, values = self.kv[key]
            keys[:, :, self.length:end], values[:, :, self.length:end] = k, v
            return keys[:, :, :end], values[:, :, :end]
        return attend

    def share(self, depth, n_loop):
        """After a decoded token: a sequence that exited at loop depth[b] ran no later loop, so each later loop's entry
        at that position takes its last loop's (Huginn's sharing: running them to fill the cache would undo the exit)"""
        t = self.length - 1  # the newest position
        for j in range(2, n_loop + 1):
            skipped = depth < j                                       # (B,): the rows that stopped before loop j
            for kind, k, i in [key for key in self.kv if key[0] != 'prelude' and key[1] == j - 1]:
                src = self.kv[kind, k, i]
                for to, fro in zip(self.kv.setdefault((kind, j, i), tuple(map(torch.zeros_like, src))), src):
                    to[skipped, :, t] = fro[skipped, :, t]


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head, self.dropout, self.attention = config.n_head, config.dropout, config.attention
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        # dropout acts on the attention probabilities only, as in the authors' layer (three dropout sites in all:
        # embedding, attention probabilities, MLP output); the causal mask serves the manual path (SDPA: is_causal)
        self.register_buffer('mask', torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool)),
                             persistent=False)

    def forward(self, x, kv=None):
        """x (B, T, C) -> (B, T, C); with kv (KVCache.layer) x is the newest T positions, after the cached ones."""
        B, T, C = x.shape
        # q, k, v: (B, T, C) each from one matmul, split into heads: (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        if kv is not None:
            k, v = kv(k, v)                                           # (B, nh, L, hs): the cached positions, then these
        L, p = k.size(2), self.dropout if self.training else 0.0
        if self.attention == 'sdpa':
            mask = None if T in (1, L) else self.mask[L - T:L, :L]  # (T, L); None: causal (square) or one query
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=T == L > 1)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))   # (B, nh, T, L)
            att = att.masked_fill(~self.mask[L - T:L, :L], float('-inf'))
            att = F.dropout(F.softmax(att, dim=-1), p=p)
            y = att @ v                                               # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)              # (B, T, C): heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):
    """SwiGLU: W2 (silu(W1 x) * W3 x), or GELU: W2 gelu(W1 x); hidden width 4d in both."""

    def __init__(self, config):
        super().__init__()
        hidden = 4 * config.n_embd
        self.swiglu = config.mlp == 'swiglu'
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=False)
        self.c_gate = nn.Linear(config.n_embd, hidden, bias=False) if self.swiglu else None
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):
        u = self.c_fc(x)                                              # (B, T, 4C)
        u = F.silu(u) * self.c_gate(x) if self.swiglu else F.gelu(u)  # (B, T, 4C)
        return self.drop(self.c_proj(u))                              # (B, T, C)


class Block(nn.Module):
    """One layer. Pre-norm (block='prenorm'): x + attn(norm(x)), then x + mlp(norm(x)); the residual stream itself is
    never normalized, which is why its scale can grow from loop to loop. Sandwich (block='sandwich', Huginn's and
    looped_nanochat's layer): each sublayer's sum is normalized too, norm(x + attn(norm(x))), so every layer hands on a
    state of RMS equal to its last norm's gain, whatever scale it was given."""

    def __init__(self, config):
        super().__init__()
        self.sandwich = sandwich = config.block == 'sandwich'
        self.norm_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.post_attn = RMSNorm(config.n_embd, config.norm_eps) if sandwich else nn.Identity()
        self.norm_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)
        self.post_mlp = RMSNorm(config.n_embd, config.norm_eps) if sandwich else nn.Identity()

    def forward(self, x, kv=None):
        if self.sandwich:  # a method of its own, so that the default pre-norm layer never runs it
            return self.sandwich_forward(x, kv)
        x = x + self.attn(self.norm_1(x), kv)
        return x + self.mlp(self.norm_2(x))

    def sandwich_forward(self, x, kv=None):
        """(B, T, C) -> (B, T, C): norm(x + f(norm(x))) for f = attention, then the MLP; post_attn, post_mlp last."""
        x = self.post_attn(x + self.attn(self.norm_1(x), kv))
        return self.post_mlp(x + self.mlp(self.norm_2(x)))


class AlphaNorm(nn.Module):
    """The alpha readout, a continuum between a scale-invariant and a raw readout. Per token write
    h = s * u with s = RMS(h) (clamped at eps) and u = h / s; the output is s_ref^(1 - alpha) * s^alpha * u.
    alpha = 1 gives h itself (raw), alpha = 0 gives s_ref * u (scale-invariant, like RMSNorm without a gain).
    alpha = sigmoid(logit) is learned from 0.5 unless fixed; log s_ref is learned too (an EMA of the batch's
    log s, the other option, let alpha collapse to 0 under terminal cross-entropy)."""

    def __init__(self, config):
        super().__init__()
        self.eps = config.norm_eps
        self.fixed_alpha = config.alpha
        self.alpha_logit = nn.Parameter(torch.zeros(())) if config.alpha is None else None  # sigmoid(0) = 0.5
        self.log_s_ref = nn.Parameter(torch.zeros(()))                # s_ref = 1 at the start

    def alpha(self):
        return torch.sigmoid(self.alpha_logit) if self.fixed_alpha is None else \
            torch.tensor(float(self.fixed_alpha), device=self.log_s_ref.device)

    def forward(self, h):
        """h (..., C) -> s_ref^(1 - alpha) * s^alpha * h / s per token, s = RMS(h) clamped at eps, in h's dtype."""
        hf = h.to(torch.promote_types(h.dtype, torch.float32))       # at least fp32, as in RMSNorm
        s = hf.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(self.eps)  # (..., 1): per-token RMS
        # s_ref^(1-a) * s^a * h / s == h * (s_ref / s)^(1-a); written this way alpha = 1 returns h exactly
        return (hf * torch.exp((1 - self.alpha()) * (self.log_s_ref - s.log()))).type_as(h)


class Readout(nn.Module):
    """What the LM head sees of h_k at loop k (1-indexed)."""

    def __init__(self, config):
        super().__init__()
        self.kind = config.readout
        self.n_loop = config.n_loop
        if self.kind == 'layernorm':
            self.norm = nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=False)
        elif self.kind in ('rmsnorm', 'final_norm'):
            self.norm = RMSNorm(config.n_embd, config.norm_eps)
        elif self.kind == 'alpha':
            self.norm = AlphaNorm(config)
        else:  # raw
            self.norm = nn.Identity()

    def forward(self, h, k):
        """The LM head's input for h_k (..., C) at loop k: self.norm(h), except that 'final_norm' reads out raw where
        the model was trained to exit early (k < K) and normalizes at the trained depth K and, by the same rule, at any
        extrapolated depth beyond it. ('raw' has an identity for its norm.)"""
        if self.kind == 'final_norm' and k < self.n_loop:
            return h
        return self.norm(h)


class LoopedGPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])  # the ONE shared stack
        # unshared layers around the loop (empty by default): the prelude runs once, the coda on every readout
        self.prelude = nn.ModuleList([Block(config) for _ in range(config.n_prelude)])
        self.coda = nn.ModuleList([Block(config) for _ in range(config.n_coda)])
        # input injection W [h; e], a Linear(2d -> d), see pass_input; the inter-loop norm: pass k + 1 starts from it
        self.adapter = nn.Linear(2 * config.n_embd, config.n_embd, bias=False) if config.injection == 'concat' else None
        self.inter_norm = RMSNorm(config.n_embd, config.norm_eps) if config.recurrence == 'normed' else None
        self.readout = Readout(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self._init_weights()

    def _init_weights(self):
        # Three recipes, because initialization decides whether the blind spot shows on short runs. 'paper', the
        #   authors': PyTorch's defaults (nn.Linear U(+-1/sqrt(fan_in)), nn.Embedding N(0, 1), gains 1), the head tied
        #   to the N(0, 1) embedding: logits in the tens make the norm jump in the first steps. 'gpt2', nanoGPT's: N(0,
        #   0.02), residual projections scaled down by sqrt(2 * unrolled depth), the head untied; the blind spot then
        #   takes far longer to show (docs/results.md: "Where this differs from the paper"). 'paper_small_embed':
        #   'paper' with both embeddings (so the tied head too) at N(0, 0.02), an ablation. Under all three the adapter
        #   W starts as [I | 0]: at step 0 'concat' computes what 'none' does (nanoLOOP's and looped_nanochat's
        #   identity start). A redrawn weight has a generator of its own, seeded by the run's seed and its name, so
        #   that a parameter added anywhere never shifts another's draw ('paper' keeps PyTorch's stream: it is the
        #   default, its numbers are pinned).
        c, seed = self.config, torch.initial_seed()
        depth = c.n_layer * c.n_loop
        for name, p in self.named_parameters():
            if c.init == 'gpt2' and p.dim() >= 2:  # norm gains stay at 1, the alpha readout's scalars at their start
                std = 0.02 / math.sqrt(2 * depth) if name.endswith('c_proj.weight') else 0.02
            elif c.init == 'paper_small_embed' and name in ('wte.weight', 'wpe.weight'):
                std = 0.02
            else:
                continue
            draw = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=draw) * std)
        if self.adapter is not None:
            with torch.no_grad():
                self.adapter.weight.copy_(torch.eye(c.n_embd, 2 * c.n_embd))  # [I | 0]

    def num_params(self):
        """Unique parameters: the looped stack and a tied head count once (parameters() yields each tensor once)."""
        return sum(p.numel() for p in self.parameters())

    # ---- the forward pass, in the order it runs: embed, loops (loop_step, inter-loop norm), readout, loss ----

    def embed(self, idx, cache=None):
        """h_0 = e: token plus learned position embedding, through the prelude if there is one, (B, T) -> (B, T, C);
        with a KVCache, idx is the tokens after the cached ones."""
        t0 = cache.length if cache is not None else 0
        h = self.drop(self.wte(idx) + self.wpe(torch.arange(t0, t0 + idx.size(1), device=idx.device)))
        for i, block in enumerate(self.prelude):
            h = block(h, cache and cache.layer('prelude', i))
        return h

    def loop_step(self, h, cache=None, k=None):
        """Pass k through the shared stack, (B, T, C) -> (B, T, C). residual_scale='inverse_k' scales the pass's update
        by 1/K, which shrinks each pass's step but leaves the state carried from loop to loop."""
        x = h
        for i, block in enumerate(self.blocks):
            x = block(x, cache and cache.layer('loop', k, i))
        return h + (x - h) / self.config.n_loop if self.config.residual_scale == 'inverse_k' else x

    def pass_input(self, h, e, k, n_loop):
        """What pass k of n_loop runs on, from the carried state h (h_{k-1}, or its inter-loop norm) and the embedding
        e = h_0 (B, T, C) -> (B, T, C). The designs that change it (all off by default, which returns h):
          bptt = b     the carried state is detached before pass n_loop - b + 1: backprop through the last b passes
                       only (each earlier pass still gets its own readout's gradient under per-loop supervision)
          injection    self.inject(h, e): 'add' h + e (so pass 1 runs on 2e), 'concat' W [h; e] (W = [I | 0] at init)"""
        b = self.config.bptt
        first_with_grad = n_loop - b + 1  # the first of the last b passes, the only ones backprop reaches
        if b and k == first_with_grad and k > 1:  # (at pass 1 there is nothing earlier to cut off)
            h = h.detach()
        return h if self.config.injection == 'none' else self.inject(h, e)

    def inject(self, h, e):
        """e injected into h, (B, T, C) each: 'add' h + e; 'concat' self.adapter(h, e side by side) = W_h h + W_e e."""
        return h + e if self.config.injection == 'add' else self.adapter(torch.cat([h, e], dim=-1))

    def loops(self, h, n_loop, intervene=None, cache=None):
        """The recurrence, the one place it is written: yields (k, h_k) for k = 1..n_loop, starting from h = h_0 = e.
        h_k is pass k's output before any inter-loop norm: what is read out, penalized and logged. With 'normed'
        recurrence pass k + 1 starts from RMSNorm(h_k) (so there is no norm before pass 1, and after the last pass it
        changes nothing); with 'residual' it starts from h_k itself, scale and all. Each pass runs on pass_input (the
        injection and truncation designs). intervene(k, h_in, h_k) -> h_k, if given, may change each pass's output
        before it is used (lab/diagnose.py's radial clamps); to drop rows from the batch (the exit benchmark) it
        returns (h_k, keep) with keep a bool mask of the rows kept, and e follows them. cache: generation's KVCache."""
        e = h
        for k in range(1, n_loop + 1):
            h_in = h
            h = self.loop_step(self.pass_input(h_in, e, k, n_loop), cache, k)  # (B, T, C)
            if intervene is not None:
                h = intervene(k, h_in, h)
                if isinstance(h, tuple):  # rows left the batch: e must keep the same rows as h for the next pass
                    h, keep = h
                    e = e[keep]
            yield k, h
            # after the yield, so that what the caller reads out is h_k itself; the next pass starts from its norm
            if self.inter_norm is not None:
                h = self.inter_norm(h)

    # The head, inside out, one entry point a use: head_input (coda, readout), readout_logits (+ LM head), next_logits
    # (last position: generation), head_loss (LM head + loss, what lab/runtime.py compiles) and readout_loss (head_input
    # + head_loss: what per-loop supervision checkpoints, so that backward can recompute it).

    def head_input(self, h, k, cache=None):
        """What the LM head reads of h_k (B, T, C) at loop k: the coda's layers (if any), then the readout."""
        for i, block in enumerate(self.coda):
            h = block(h, cache and cache.layer('coda', k, i))         # (B, T, C): the coda attends over the sequence
        return self.readout(h, k)

    def readout_logits(self, h, k, cache=None):
        """Loop k's prediction from h_k: (B, T, C) -> (B, T, V); without a coda any (..., C) works."""
        return self.lm_head(self.head_input(h, k, cache))

    def next_logits(self, h, k, cache=None):
        """Loop k's prediction of the token after the last position, (B, T, C) -> (B, V). The coda (if any) runs on the
        whole sequence (its attention needs it; a KVCache holds the rest); without one only the last position is."""
        return self.readout_logits(h if self.coda else h[:, -1:, :], k, cache)[:, -1, :]

    def head_loss(self, x, targets):
        """The LM head and its cross-entropy on x = readout(h_k) (B, T, C) against targets (B, T): (logits (B, T, V),
        scalar loss). The loss is taken in float32. Eagerly that writes a float32 copy of all B*T*V logits (and the
        log-softmax and both their gradients); lab/runtime.py compiles this function so that the upcast, log-softmax
        and loss fuse into kernels that read the bf16 logits instead."""
        logits = self.lm_head(x)                                      # (B, T, V)
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)

    def readout_loss(self, h, targets, k):
        """Cross-entropy of loop k's readout of h (B, T, C) against targets (B, T); a scalar."""
        return self.head_loss(self.head_input(h, k), targets)[1]

    def supervision_loss(self, ces):
        """The training loss from the per-loop cross-entropies ces[k-1], k = 1..K (scalars): their mean under per-loop
        ("dense") supervision, the last one alone under terminal supervision."""
        if self.config.supervision == 'per_loop':
            return torch.stack(ces).mean()
        return ces[-1]

    def norm_penalty(self, states):
        """lambda * mean over loops of mean(h_k^2), on the states h_1..h_K that loops() yields (before any inter-loop
        norm, as in the paper). Its gradient, 2 * lambda * h_k / (K * h_k.numel()), is purely radial."""
        return self.config.norm_penalty * torch.stack([h.float().pow(2).mean() for h in states]).mean()

    def forward(self, idx, targets=None, n_loop=None):
        """idx, targets: (B, T) token ids. n_loop defaults to the trained K and may exceed it.
        Returns (logits, loss, stats):
          logits  (B, T, V) at the last loop when targets are given, else (B, 1, V) for the last position
          loss    the training objective (None without targets)
          stats   {'hidden_norm': (n_loop,) mean over tokens of ||h_k||_2 before any normalization, 'ce': (n_loop,)
                   cross-entropy of the readout at every loop, or None without targets}"""
        T, K = idx.size(1), n_loop or self.config.n_loop
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.config.block_size}")
        norms, ces, states = [], [], []
        for k, h in self.loops(self.embed(idx), K):                   # h: (B, T, C)
            norms.append(h.detach().float().norm(dim=-1).mean())
            if self.config.norm_penalty > 0:
                states.append(h)
            if targets is None:
                continue
            # every loop is decoded for the statistics; those without a loss under no_grad, keeping no activations
            supervised = self.config.supervision == 'per_loop' or k == K
            if k == K:  # always supervised; its logits are also returned
                logits, ce = self.head_loss(self.head_input(h, k), targets)  # logits: (B, T, V)
            elif supervised and torch.is_grad_enabled():
                # Per-loop readouts before the last are checkpointed: backward recomputes their (B, T, V) logits
                # instead of keeping K copies alive, so per-loop supervision costs about the memory of terminal.
                ce = checkpoint(self.readout_loss, h, targets, k, use_reentrant=False)
            else:
                with torch.no_grad():
                    ce = self.readout_loss(h, targets, k)
            ces.append(ce)

        stats = {'hidden_norm': torch.stack(norms), 'ce': torch.stack([c.detach() for c in ces]) if ces else None}
        if targets is None:
            return self.next_logits(h, K)[:, None, :], None, stats  # (B, 1, V): only the next token is needed
        loss = self.supervision_loss(ces)
        if self.config.norm_penalty > 0:
            loss = loss + self.norm_penalty(states)
        return logits, loss, stats

    def flops_per_token(self, n_loop=None):
        """Training FLOPs per token (6 per parameter use, forward and backward, as in the PaLM paper) module by module:
        the stack and adapter once per loop, the prelude once, the coda once per supervised readout, the norms' gains
        once, the head's matmul once per supervised readout (tied or not), attention's score and value matmuls (12 *
        layers * d * T, nanoGPT's convention) once per layer run. A module missing from `uses` is an error: a new design
        says how often a token uses it."""
        c, K = self.config, n_loop or self.config.n_loop
        readouts = K if c.supervision == 'per_loop' else 1
        uses = {'blocks': K, 'adapter': K, 'prelude': 1, 'coda': readouts, 'readout': 1, 'inter_norm': 1,
                'wte': 0, 'wpe': 0, 'lm_head': 0}  # lm_head: its matmul is counted on its own below
        unknown = [n for n, _ in self.named_parameters() if n.split('.')[0] not in uses]
        if unknown:
            raise ValueError(f"flops_per_token: no count for {', '.join(unknown)}; add its module to uses")
        n_uses = sum(uses[name] * sum(p.numel() for p in m.parameters()) for name, m in self.named_children()
                     if name in uses)
        layers = K * c.n_layer + c.n_prelude + readouts * c.n_coda
        return 6 * n_uses + 6 * readouts * c.vocab_size * c.n_embd + 12 * layers * c.n_embd * c.block_size

    def configure_optimizers(self, weight_decay, learning_rate, device_type):
        # the authors decay every parameter (embeddings, gains); nanoGPT (gpt2) only matrices; betas: PyTorch's defaults
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{'params': params, 'weight_decay': weight_decay}] if self.config.init != 'gpt2' else \
            [{'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
             {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, fused=(device_type == 'cuda'))

    # ---- generation: a window of the context, one token at a time, each through its loops and its exit ----

    @torch.inference_mode()
    def next_logprobs(self, window, n_loop, exit_rule=None, exit_threshold=None, cache=None):
        """One step of generation: the log-probabilities (B, V) of the token after window (B, T) and the loop (B,) each
        sequence exited at, the first whose last-position readout passes the exit rule (exit_passes), or n_loop. The
        batch runs until its last sequence stops; one that stopped earlier keeps its own loop's readout. With a KVCache
        only the positions after its length run; a prefill (an empty cache: the prompt, a restarted window) runs every
        loop so that the cache holds them all, and after a decoded token KVCache.share fills the loops it skipped."""
        B, prefill = window.size(0), cache is None or cache.length == 0
        h0 = self.embed(window if cache is None else window[:, cache.length:], cache)  # (B, T_new, C)
        logp, logp_prev, h_prev = None, None, h0[:, -1, :]           # the latent rule compares h_1 with h_0 = e
        depth, done = window.new_full((B,), n_loop), window.new_zeros(B, dtype=torch.bool)  # (B,) each
        for k, h in self.loops(h0, n_loop, cache=cache):
            if exit_rule is None and k < n_loop:
                continue                                              # no rule: only the last loop is read out
            logp_k = F.log_softmax(self.next_logits(h, k, cache).float(), dim=-1)  # (B, V): next token only
            h_last = h[:, -1, :]                                      # (B, C): the state the latent rule watches
            stops = ~done if exit_rule is None or k == n_loop else \
                exit_passes(exit_rule, exit_threshold, logp_k, logp_prev, h_last, h_prev) & ~done
            logp = logp_k if logp is None else torch.where(stops[:, None], logp_k, logp)
            depth[stops], done = k, done | stops
            if done.all() and not (cache is not None and prefill):
                break
            logp_prev, h_prev = logp_k, h_last
        if cache is not None:
            cache.length += h0.size(1)
            if exit_rule is not None and not prefill:
                cache.share(depth, n_loop)
        return logp, depth

    @torch.inference_mode()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, n_loop=None, exit_rule=None,
                 exit_threshold=None, cache=True):
        """Append max_new_tokens sampled tokens to idx (B, T), each from next_logprobs (with an exit rule each sequence
        stops at its own loop). cache: True keeps a KVCache, so a new token runs its loops over one position; False
        recomputes the window for every token (the reference: the same tokens at a fixed depth; with an exit rule it
        also recomputes what the cache shares); or a fresh KVCache to fill. The window, the same either way, starts as
        the prompt's last block_size tokens and when full restarts at its newest block_size // 2, recomputed (a rolling
        window cannot be cached: every kept token's position would shift). Returns (idx, depth (B, new): exit loops)."""
        K, block = n_loop or self.config.n_loop, self.config.block_size
        cache = KVCache(block) if cache is True else cache or None
        start, depths = max(0, idx.size(1) - block), []
        for _ in range(max_new_tokens):
            if idx.size(1) - start > block:  # the window is full: keep its newer half, a fresh cache refilled from it
                start, cache = idx.size(1) - block // 2, cache and KVCache(block)
            logp, depth = self.next_logprobs(idx[:, start:], K, exit_rule, exit_threshold, cache)
            depths.append(depth)
            logits = logp / max(temperature, 1e-8)                    # log-probabilities are logits up to a shift
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = float('-inf')
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx, torch.stack(depths, 1) if depths else idx.new_zeros(idx.size(0), 0)


def exit_passes(rule, threshold, logp, logp_prev, h=None, h_prev=None):
    """Early-exit rule on one loop's log-probabilities (..., V), or for 'latent' on its hidden state (..., C):
    'confidence' passes when the top probability reaches the threshold; 'kl' when KL(p_k || p_{k-1}) falls to the
    threshold or below; 'latent' when the relative change ||h_k - h_{k-1}|| / ||h_{k-1}|| does (Huginn's and
    looped_nanochat's training-free rule). With nothing to compare (logp_prev or h_prev None) it does not pass: 'kl'
    never at loop 1, 'latent' can (h_0, the embedding, is the state before loop 1). Returns a bool tensor (...)."""
    if rule == 'confidence':
        return logp.max(dim=-1).values.exp() >= threshold
    if (logp_prev if rule == 'kl' else h_prev) is None:
        return torch.zeros(logp.shape[:-1], dtype=torch.bool, device=logp.device)
    if rule == 'latent':
        return latent_change(h, h_prev) <= threshold
    return (logp.exp() * (logp - logp_prev)).sum(dim=-1) <= threshold


def latent_change(h, h_prev):
    """||h - h_prev|| / ||h_prev|| over the last dimension, in float32: (..., C) -> (...)."""
    h, h_prev = h.float(), h_prev.float()
    return (h - h_prev).norm(dim=-1) / h_prev.norm(dim=-1).clamp_min(1e-12)


def sampled_depth(config, seed, step):
    """The loop count that training step `step` trains at: K, or under depth_sampling='poisson_lognormal'
    looped_nanochat's draw tau ~ N(ln(K - 1) - sigma^2 / 2, sigma), r = Poisson(e^tau) + 1, sigma = 0.5, clamped to
    [1, 2K]: E[e^tau] = K - 1, so r has mean K before the clamp (looped_nanochat centres e^tau on its mean, so r is one
    loop higher). It depends on (seed, step) alone: every process draws the same r, a resumed run the same sequence."""
    K = config.n_loop
    if config.depth_sampling == 'fixed' or K == 1:
        return K
    rng, sigma = np.random.default_rng([seed, step]), 0.5
    tau = rng.normal(math.log(K - 1) - sigma ** 2 / 2, sigma)
    return int(min(max(rng.poisson(math.exp(tau)) + 1, 1), 2 * K))
