"""
A looped (depth-recurrent) transformer language model, in one file.

One shared stack of pre-norm layers is applied n_loop = K times. Every loop's state h_k is read
out by the LM head (so each loop can get a cross-entropy: "per-loop" or "dense" supervision) and
fed into the next loop. The paper this reproduces ("Dense Supervision Is Not Enough: The Readout
Blind Spot in Looped Language Models", Sharma & Vu, 2026): a scale-invariant readout (RMSNorm or
LayerNorm before the head) hides ||h_k|| from the loss, while the residual loop keeps carrying and
growing it. The fields that expose or remove it:

    readout       rmsnorm | layernorm   scale-invariant: the loss cannot see ||h_k||
                  raw                   no norm: the head sees the scale, so the loss controls it
                  final_norm            raw at loops 1..K-1, RMSNorm at loop K and beyond
                  alpha                 s_ref^(1-alpha) * s^alpha * h / s, s = RMS(h)
    recurrence    residual | normed     loop k+1 starts from h_k, or from RMSNorm(h_k)
                  damped                or from sigmoid(a) * h_k, a learned (the authors' damping)
    supervision   per_loop | terminal   the mean of the K cross-entropies, or the last one alone
                  gated                 Ouro's: sum_k p_k CE_k - beta H(p), p a learned exit gate's
                                        (gate_input: what it reads; gate_beta: beta)
    norm_penalty  lambda                adds lambda * mean_k mean(h_k^2)

The other looped LMs (Huginn, looped_nanochat, nanoLOOP) build the loop in ways that are fields
here too: injection, n_prelude, n_coda, block, depth_sampling, bptt, residual_scale. So do the 2026
designs that bound the recurrence: Parcae's injection='diagonal' (the carried state decays per
channel), block='deepnorm' (DeepLoop's scaled Post-LN) and STARS's jacobian_penalty. The rest is the
shape (vocab_size, block_size, n_embd, n_head, n_layer, n_loop, dropout) and choices that leave the
idea alone (init, mlp, tie_weights, attention, norm_eps). LoopedGPT.loops is where the passes run.

Generation with a KV cache and early exit lives in lab/engine.py; this file has the plain reference.
"""

import math
import zlib
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

# The allowed values of every text field; the first is the default.
CHOICES = {
    'supervision': ('per_loop', 'terminal', 'gated'),
    'gate_input': ('raw', 'readout'),
    'readout': ('rmsnorm', 'layernorm', 'raw', 'final_norm', 'alpha'),
    'recurrence': ('residual', 'normed', 'damped'),
    'init': ('paper', 'gpt2', 'paper_small_embed'),
    'mlp': ('swiglu', 'gelu'),
    'injection': ('none', 'add', 'concat', 'diagonal'),
    'block': ('prenorm', 'sandwich', 'deepnorm'),
    'depth_sampling': ('fixed', 'poisson_lognormal'),
    'residual_scale': ('none', 'inverse_k'),
    'attention': ('sdpa', 'manual'),
}


@dataclass
class LoopedConfig:
    vocab_size: int = 65  # vocabulary size (65: tiny Shakespeare's characters; set from the data)
    block_size: int = 128  # context length T, and the size of the learned position table
    n_embd: int = 128  # width d of the residual stream
    n_head: int = 4  # attention heads; must divide n_embd
    n_layer: int = 2  # layers in the ONE shared stack (unique layers, not the unrolled depth)
    n_loop: int = 4  # K: how many times the stack is applied (unrolled depth n_layer * K)
    dropout: float = 0.0  # the paper uses 0.1; tiny CPU runs learn faster without
    supervision: str = 'per_loop'  # which loops get a cross-entropy: all K, the last, or gated
    gate_input: str = 'raw'  # gated: the exit gate reads h_k itself (the authors'), or the readout
    gate_beta: float = 0.1  # gated: beta in sum_k p_k CE_k - beta H(p); H <= ln 4 = 1.39 at K = 4
    readout: str = 'rmsnorm'  # what the LM head sees of h_k (see Readout)
    alpha: Optional[float] = None  # readout=alpha: unset learns alpha, a number in [0, 1] fixes it
    norm_penalty: float = 0.0  # lambda in lambda * mean_k mean(h_k^2); the paper uses 0.01
    recurrence: str = 'residual'  # the next loop starts from h_k, RMSNorm(h_k) or sigmoid(a) h_k
    init: str = 'paper'  # the authors', GPT-2's (head untied), or paper with small embeddings
    mlp: str = 'swiglu'  # SwiGLU (the paper) or GELU (GPT-2), hidden width 4d
    injection: str = 'none'  # what a pass runs on: h, h + e, W [h; e], or decay * h + Delta * B e
    n_prelude: int = 0  # unshared layers run once on the embedding, before the loop
    n_coda: int = 0  # unshared layers between every h_k and its readout
    block: str = 'prenorm'  # each sublayer x + f(norm(x)), sandwich, or deepnorm: norm(a x + f(x))
    depth_sampling: str = 'fixed'  # training only: K loops every step, or a drawn count of mean K
    residual_scale: str = 'none'  # inverse_k: each pass's update scaled by 1/K
    bptt: int = 0  # the last exit's loss reaches the last bptt passes only; 0: all of them
    jacobian_penalty: float = 0.0  # w in w * ||v^T J||^2, J one pass's Jacobian (STARS); 0: off
    tie_weights: Optional[bool] = None  # the head shares wte's weight; unset: tied unless gpt2
    attention: str = 'sdpa'  # fused kernels (sdpa), or the same math spelled out (manual)
    norm_eps: float = 1e-6  # epsilon of every RMSNorm, as in the authors' release

    def __post_init__(self):
        if self.tie_weights is None:
            self.tie_weights = self.init != 'gpt2'  # the authors tie; gpt2 unties, as nanochat does
        checks = [(name, getattr(self, name) in allowed, 'is not one of ' + ', '.join(allowed))
                  for name, allowed in CHOICES.items()]
        checks += [(name, getattr(self, name) >= 1, 'must be at least 1') for name in
                   ('vocab_size', 'block_size', 'n_embd', 'n_head', 'n_layer', 'n_loop')]
        checks += [(name, getattr(self, name) >= 0, 'must be at least 0')
                   for name in ('n_prelude', 'n_coda', 'bptt')]
        checks += [
            ('n_embd', self.n_embd % max(self.n_head, 1) == 0,
             f"is not divisible by n_head={self.n_head}"),
            ('norm_eps', 0 < self.norm_eps < math.inf, 'must be a finite number > 0'),  # nan fails
            ('dropout', 0.0 <= self.dropout < 1.0, 'must be in [0, 1)'),
            ('norm_penalty', 0 <= self.norm_penalty < math.inf, 'must be a finite number >= 0'),
            ('jacobian_penalty', 0 <= self.jacobian_penalty < math.inf,
             'must be a finite number >= 0'),
            ('gate_beta', 0 <= self.gate_beta < math.inf, 'must be a finite number >= 0'),
            ('alpha', self.alpha is None or 0 <= self.alpha <= 1,
             'must be in [0, 1] (or unset, to learn it)'),
            ('alpha', self.alpha is None or self.readout == 'alpha',
             f"is only used by readout='alpha', not {self.readout!r}")]
        for name, ok, why in checks:  # the first failure, in one line
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} {why}")

    def to_dict(self):
        return asdict(self)


class RMSNorm(nn.Module):
    """x / rms(x) * weight: scale-invariant, RMSNorm(a * x) == RMSNorm(x) for any a > 0."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        """x (..., C) -> weight * x / sqrt(mean(x^2 over C) + eps), returned in the dtype of x."""
        # at least fp32 (bf16 is upcast, float64 kept): norms in the thousands keep their precision
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rms_inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., 1)
        return (xf * rms_inv * self.weight).type_as(x)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head, self.dropout, self.attention = config.n_head, config.dropout, config.attention
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)  # q, k, v at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)  # no dropout after it
        # the causal mask, for 'manual' and for T new queries after L - T cached keys
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer('mask', mask, persistent=False)

    def forward(self, x, kv=None):
        """x (B, T, C) -> (B, T, C). kv, from generation's cache (lab/engine.py), takes this call's
        keys and values (B, nh, T, hs) and returns all so far: x is then the newest T positions."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if kv is not None:
            k, v = kv(k, v)                                           # (B, nh, L, hs), L >= T
        L, p = k.size(2), self.dropout if self.training else 0.0     # dropout on the probabilities
        if self.attention == 'sdpa':
            mask = None if T in (1, L) else self.mask[L - T:L, :L]  # (T, L) after a cache
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                               is_causal=(T == L and T > 1))
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))   # (B, nh, T, L)
            att = att.masked_fill(~self.mask[L - T:L, :L], float('-inf'))
            att = F.dropout(F.softmax(att, dim=-1), p=p)
            y = att @ v                                               # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)              # heads side by side again
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
    """One layer. Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)). The residual stream itself is
    never normalized, which is why its scale can grow from loop to loop. Sandwich (Huginn's and
    looped_nanochat's) also normalizes each sum: a layer hands on a state of fixed RMS. DeepNorm
    (DeepLoop's Post-LN) normalizes the sum alone, norm(alpha * x + f(x)): DeepNorm's alpha is
    (2N)^(1/4), DeepLoop squares it for a loop, sqrt(2N), N = n_layer * n_loop unrolled layers."""

    def __init__(self, config):
        super().__init__()
        self.sandwich = sandwich = config.block == 'sandwich'
        self.deepnorm = config.block == 'deepnorm'
        self.residual_weight = math.sqrt(2 * config.n_layer * config.n_loop)  # deepnorm's alpha
        self.norm_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.post_attn = RMSNorm(config.n_embd, config.norm_eps) if sandwich else nn.Identity()
        self.norm_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)
        self.post_mlp = RMSNorm(config.n_embd, config.norm_eps) if sandwich else nn.Identity()

    def forward(self, x, kv=None):
        if self.sandwich:
            return self.sandwich_forward(x, kv)
        if self.deepnorm:  # (B, T, C): the sublayers see x itself; the norms come after the sums
            x = self.norm_1(self.residual_weight * x + self.attn(x, kv))
            return self.norm_2(self.residual_weight * x + self.mlp(x))
        x = x + self.attn(self.norm_1(x), kv)
        return x + self.mlp(self.norm_2(x))

    def sandwich_forward(self, x, kv=None):
        """(B, T, C) -> (B, T, C): norm(x + f(norm(x))) for f = attention, then the MLP."""
        x = self.post_attn(x + self.attn(self.norm_1(x), kv))
        return self.post_mlp(x + self.mlp(self.norm_2(x)))


class AlphaNorm(nn.Module):
    """The alpha readout, between scale-invariant and raw. Per token h = s * u, s = RMS(h),
    u = h / s; the output is s_ref^(1 - alpha) * s^alpha * u: alpha = 1 gives h, 0 gives s_ref * u.
    alpha = sigmoid(logit) is learned from 0.5 unless fixed; log s_ref is learned too."""

    def __init__(self, config):
        super().__init__()
        self.eps = config.norm_eps
        self.fixed_alpha = config.alpha
        self.alpha_logit = nn.Parameter(torch.zeros(())) if config.alpha is None else None
        self.log_s_ref = nn.Parameter(torch.zeros(()))                # s_ref = 1 at the start

    def alpha(self):
        if self.fixed_alpha is None:
            return torch.sigmoid(self.alpha_logit)
        return torch.tensor(float(self.fixed_alpha), device=self.log_s_ref.device)

    def forward(self, h):
        """h (..., C) -> s_ref^(1 - alpha) * s^alpha * h / s, s = RMS(h) per token (>= eps)."""
        hf = h.to(torch.promote_types(h.dtype, torch.float32))       # at least fp32, as in RMSNorm
        s = hf.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(self.eps)  # (..., 1): per-token RMS
        # s_ref^(1-a) * s^a * h / s == h * (s_ref / s)^(1-a): so alpha = 1 returns h exactly
        return (hf * torch.exp((1 - self.alpha()) * (self.log_s_ref - s.log()))).type_as(h)


class DiagonalInjection(nn.Module):
    """Parcae's injection: pass k runs on decay * h + Delta * B e, per channel, with Delta =
    softplus(dt_bias) > 0 and decay = exp(-Delta * exp(A_log)) in (0, 1): whatever training does,
    the carried part is multiplied by less than 1 (the pass may grow it again). At init A_log = 0,
    decay = sqrt(1/5), B = I."""

    def __init__(self, config):
        super().__init__()
        d = config.n_embd
        self.A_log = nn.Parameter(torch.zeros(d))
        # softplus(log(sqrt(5) - 1)) = log(sqrt(5)), so the decay exp(-Delta) starts at sqrt(1/5)
        self.dt_bias = nn.Parameter(torch.full((d,), math.log(math.sqrt(5) - 1)))
        self.B = nn.Linear(d, d, bias=False)  # the identity, set in LoopedGPT._init_weights

    def coefficients(self):
        """(Delta, decay), each (C,): what e and h are multiplied by, channel by channel."""
        delta = F.softplus(self.dt_bias)
        return delta, torch.exp(-delta * self.A_log.exp())

    def forward(self, h, e):
        delta, decay = self.coefficients()
        return decay * h + delta * self.B(e)                          # (B, T, C)


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
        """The head's input for h_k (..., C): self.norm(h), except that final_norm reads out raw
        before the trained depth K (the early exits) and normalizes at K and beyond."""
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
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])  # the ONE stack
        # unshared layers around the loop (none by default): prelude once, coda at every readout
        self.prelude = nn.ModuleList([Block(config) for _ in range(config.n_prelude)])
        self.coda = nn.ModuleList([Block(config) for _ in range(config.n_coda)])
        d = config.n_embd
        self.adapter = nn.Linear(2 * d, d, bias=False) if config.injection == 'concat' else None
        self.inter_norm = RMSNorm(d, config.norm_eps) if config.recurrence == 'normed' else None
        self.readout = Readout(config)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        # made last: under the paper init every weight above draws as it did before these existed
        diagonal, damped = config.injection == 'diagonal', config.recurrence == 'damped'
        self.diagonal = DiagonalInjection(config) if diagonal else None
        self.damping = nn.Parameter(torch.tensor(2.0)) if damped else None  # sigmoid(2) = 0.88
        gated = config.supervision == 'gated'
        self.exit_gate = nn.Linear(d, 1) if gated else None  # lambda_k = sigmoid(exit_gate(z_k))
        self._init_weights()

    def _init_weights(self):
        # 'paper' (the authors'): PyTorch's defaults, the head tied to the N(0, 1) embedding, so
        # the logits start in the tens and the norm jumps in the first steps. 'gpt2': GPT-2's
        # N(0, 0.02), residual projections scaled by 1/sqrt(2 * unrolled depth), and the head
        # untied (nanochat's choice; nanoGPT draws the same but ties its head to wte).
        # 'paper_small_embed': 'paper' with both embeddings at N(0, 0.02). A redrawn weight has its
        # own generator, seeded by the seed and its name: a new parameter never shifts another's.
        c, seed = self.config, torch.initial_seed()
        depth = c.n_layer * c.n_loop
        for name, p in self.named_parameters():
            if c.init == 'gpt2' and p.dim() >= 2:  # norm gains stay at 1
                scaled = name.endswith('c_proj.weight') and c.block != 'deepnorm'  # its own below
                std = 0.02 / math.sqrt(2 * depth) if scaled else 0.02
            elif c.init == 'paper_small_embed' and name in ('wte.weight', 'wpe.weight'):
                std = 0.02
            else:
                continue
            draw = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=draw) * std)
        if self.adapter is not None:  # W = [I | 0]: at step 0 'concat' computes what 'none' does
            with torch.no_grad():
                self.adapter.weight.copy_(torch.eye(c.n_embd, 2 * c.n_embd))
        if self.diagonal is not None:  # Parcae's B = I, whatever the init drew
            with torch.no_grad():
                self.diagonal.B.weight.copy_(torch.eye(c.n_embd))
        if c.block == 'deepnorm':  # beta = (8N)^(-1/2), DeepNorm's (8N)^(-1/4) squared as alpha is
            with torch.no_grad():
                for block in [*self.prelude, *self.blocks, *self.coda]:
                    block.attn.c_attn.weight[2 * c.n_embd:].mul_((8 * depth) ** -0.5)  # v's rows
                    # two MLP matrices, as in DeepNorm's FFN (SwiGLU: the linear branch, not silu's)
                    first = block.mlp.c_gate if block.mlp.swiglu else block.mlp.c_fc
                    for m in (block.attn.c_proj, first, block.mlp.c_proj):
                        m.weight.mul_((8 * depth) ** -0.5)

    def num_params(self):
        """Unique parameters: the looped stack and a tied head count once."""
        return sum(p.numel() for p in self.parameters())

    # ---- the forward pass in the order it runs: embed, loops, readout, loss

    def embed(self, idx, cache=None):
        """h_0 = e: token plus position embedding, then the prelude, (B, T) -> (B, T, C).
        With a cache (lab/engine.py) idx holds the tokens after the cached ones."""
        t0 = cache.length if cache is not None else 0
        pos = torch.arange(t0, t0 + idx.size(1), device=idx.device)
        h = self.drop(self.wte(idx) + self.wpe(pos))
        for i, block in enumerate(self.prelude):
            h = block(h, cache and cache.layer('prelude', i))  # kv: None without a cache
        return h

    def inject(self, h, e):
        """Input injection of the embedding e into the carried state h, (B, T, C) each:
        'add' h + e; 'concat' W [h; e] = W_h h + W_e e (W = [I | 0] at init); 'diagonal' Parcae's
        decay * h + Delta * B e (DiagonalInjection)."""
        if self.config.injection == 'add':
            return h + e
        if self.config.injection == 'diagonal':
            return self.diagonal(h, e)
        return self.adapter(torch.cat([h, e], dim=-1))

    def loop_step(self, h, cache=None, k=None):
        """One pass through the shared stack, (B, T, C) -> (B, T, C): every layer once, in order."""
        for i, block in enumerate(self.blocks):
            h = block(h, cache and cache.layer('loop', k, i))  # k names the cache entry
        return h

    def loops(self, e, n_loop, edit=None, cache=None, h=None):
        """The recurrence, the one place it is written: yields (k, h_k), k = 1..n_loop, from e.
        h_k is pass k's output before any inter-loop norm or damping: what is read out, penalized
        and logged.
        edit(k, h_in, h_k, e) -> (h_k, e), if given, may change each output or drop rows of the
        batch from both (lab/diagnose.py's clamps and its exit benchmark). h: the state pass 1
        starts from, e unless given (pass_jacobian runs one pass from another state)."""
        c, h = self.config, e if h is None else h
        for k in range(1, n_loop + 1):
            if c.bptt and k == n_loop - c.bptt + 1 and k > 1:
                h = h.detach()              # truncated backprop: the later losses stop here
            h_in = h                        # the carried state: h_{k-1}, its RMSNorm or damped
            x = h if c.injection == 'none' else self.inject(h, e)      # what pass k runs on
            h = self.loop_step(x, cache, k)                            # (B, T, C)
            if c.residual_scale == 'inverse_k':
                h = x + (h - x) / c.n_loop  # the update shrunk by 1/K, K the trained count
            if edit is not None:
                h, e = edit(k, h_in, h, e)
            yield k, h
            if self.inter_norm is not None:
                h = self.inter_norm(h)      # 'normed': the next pass starts from RMSNorm(h_k)
            elif self.damping is not None:
                h = torch.sigmoid(self.damping) * h  # 'damped': from sigmoid(a) h_k, a learned

    # ---- exit k: h_k -> the coda's layers -> the readout -> the LM head (-> the cross-entropy).
    # exit_logits = lm_head(exit_input) and exit_loss = head_loss(exit_input) are the two ways in

    def exit_logits(self, h, k, cache=None):
        """Loop k's logits from h_k: (B, T, C) -> (B, T, V)."""
        return self.lm_head(self.exit_input(h, k, cache))

    def exit_loss(self, h, k, targets, reduction='mean'):
        """Loop k's (logits (B, T, V), float32 cross-entropy) from h_k (B, T, C), targets (B, T);
        reduction 'none': the cross-entropy of every token, (B * T,)."""
        return self.head_loss(self.exit_input(h, k), targets, reduction)

    def exit_input(self, h, k, cache=None):
        """What the LM head reads of h_k (B, T, C) at loop k: the coda's layers, the readout."""
        for i, block in enumerate(self.coda):
            h = block(h, cache and cache.layer('coda', k, i))
        return self.readout(h, k)

    def head_loss(self, x, targets, reduction='mean'):
        """The LM head and its float32 cross-entropy on x = exit_input(h_k, k): (logits, loss).
        lab/runtime.py compiles it on a GPU, so no float32 copy of the logits is kept."""
        logits = self.lm_head(x)                                      # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1,
                               reduction=reduction)
        return logits, loss

    def gate_logit(self, h, k, cache=None):
        """Loop k's exit-gate logit, (B, T, C) -> (B, T): of h_k itself ('raw', as the authors'
        gate, which sees the scale), or of what the head reads ('readout', which may not)."""
        x = h if self.config.gate_input == 'raw' else self.exit_input(h, k, cache)
        return self.exit_gate(x).squeeze(-1).float()

    def supervision_loss(self, ces):
        """The training loss from the per-loop cross-entropies ces[k-1], k = 1..K (scalars): their
        mean under per-loop ("dense") supervision, the last one alone under terminal supervision."""
        if self.config.supervision == 'per_loop':
            return torch.stack(ces).mean()
        return ces[-1]

    def exit_distribution(self, gate_logits):
        """Ouro's exit distribution from the gate's logits (n, ...) of loops 1..n: p_k = lambda_k
        * prod_{j<k} (1 - lambda_j) with lambda = sigmoid(logit), and the last loop takes the mass
        left, so p sums to 1 over k for every token. Returns (n, ...)."""
        lam = torch.sigmoid(gate_logits.float())
        left = torch.cumprod(1 - lam, dim=0)                          # prod_{j<=k} (1 - lambda_j)
        before = torch.cat([torch.ones_like(left[:1]), left[:-1]])    # prod_{j<k}
        return torch.cat([(lam * before)[:-1], before[-1:]])

    def gated_loss(self, ces, gate_logits):
        """Gated supervision: sum_k p_k CE_k - beta H(p) per token, averaged over the tokens, from
        every loop's per-token cross-entropy (B * T,) and gate logits (B, T). The entropy keeps the
        gate from putting all its mass on one loop. Every target counts (no ignore_index -1 here,
        which no dataset of this repository produces). Returns (loss, p (n, B * T))."""
        p = self.exit_distribution(torch.stack([g.flatten() for g in gate_logits]))
        entropy = -(p * p.clamp_min(1e-12).log()).sum(0)              # (B * T,)
        loss = (p * torch.stack(ces)).sum(0) - self.config.gate_beta * entropy
        return loss.mean(), p

    def norm_penalty(self, states):
        """lambda * mean over loops of mean(h_k^2), on the states h_1..h_K that loops() yields
        (before any inter-loop norm, as in the paper). Its gradient is purely radial."""
        mean_squares = torch.stack([h.float().pow(2).mean() for h in states])  # (K,)
        return self.config.norm_penalty * mean_squares.mean()

    def pass_jacobian(self, h, e):
        """STARS's one-step estimate of a pass's spectral norm at h (B, T, C): ||v^T J||, v a
        random unit vector, J one pass's Jacobian; h detached: the gradient reaches the weights."""
        x = h.detach().requires_grad_()
        with sdpa_kernel(SDPBackend.MATH):  # the fused attention kernels have no double backward
            _, out = next(self.loops(e.detach(), 1, h=x))            # one pass from x: (B, T, C)
        v = torch.randn_like(out)
        (vJ,) = torch.autograd.grad(out, x, v / v.norm(), create_graph=True)
        return vJ.float().norm()

    def forward(self, idx, targets=None, n_loop=None):
        """idx, targets (B, T) token ids; n_loop defaults to the trained K and may exceed it.
        Returns (logits, loss, stats): logits (B, T, V) of the last loop, or (B, 1, V) for the last
        position without targets; the training loss (None without targets); stats: 'hidden_norm'
        (n_loop,), the mean ||h_k|| over tokens, 'ce' (n_loop,), every loop's cross-entropy (None
        without targets); 'jacobian' (pass_jacobian); gated, 'exit_prob' and 'gate_logit' (n_loop,),
        the mean p_k and |gate logit| (the last gate has no effect: p_K is the mass left)."""
        T, K = idx.size(1), n_loop or self.config.n_loop              # K: the depth run here
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than "
                             f"block_size={self.config.block_size}")
        gated = self.exit_gate is not None
        reduction = 'none' if gated else 'mean'  # gated weighs each token's CE by its own p_k
        norms, states, ces, gates, e = [], [], [], [], self.embed(idx)
        for k, h in self.loops(e, K):                                 # h = h_k: (B, T, C)
            norms.append(h.detach().float().norm(dim=-1).mean())     # ||h_k||, before any norm
            states.append(h)
            if targets is None:
                continue
            if k < K:  # recomputed in backward, not kept: K copies of the logits would not fit
                ce = checkpoint(self.exit_loss, h, k, targets, reduction, use_reentrant=False)[1]
            else:
                logits, ce = self.exit_loss(h, k, targets, reduction)  # (B, T, V), returned
            ces.append(ce)
            if gated:
                gates.append(self.gate_logit(h, k))                   # (B, T)
        stats = {'hidden_norm': torch.stack(norms),
                 'ce': torch.stack([ce.detach().mean() for ce in ces]) if ces else None}
        if targets is None:  # only the next token is needed; a coda attends over the whole sequence
            logits = self.exit_logits(h if self.coda else h[:, -1:, :], K)[:, -1:, :]
            return logits, None, stats
        if gated:
            loss, p = self.gated_loss(ces, gates)
            stats['exit_prob'] = p.detach().mean(dim=1)               # (n_loop,): mean p_k
            stats['gate_logit'] = torch.stack(gates).detach().abs().mean(dim=(1, 2))  # its scale
        else:
            loss = self.supervision_loss(ces)
        if self.config.norm_penalty > 0:
            loss = loss + self.norm_penalty(states)
        if self.config.jacobian_penalty > 0 and torch.is_grad_enabled():  # at h_K, as STARS
            stats['jacobian'] = jac = self.pass_jacobian(h, e)
            loss = loss + self.config.jacobian_penalty * jac ** 2
        return logits, loss, stats

    def flops_per_token(self, n_loop=None):
        """Training FLOPs per token: 6 per use of a matrix's weight (forward and backward) plus
        attention's 12 * layers * d * T (nanoGPT's count); vectors (norm gains, Parcae's decay) are
        elementwise work, not counted. `uses` says how often a token runs each module that holds a
        matrix; one missing from it is an error, so a new design must say. The Jacobian penalty's
        extra pass is counted as one more pass (its double backward costs somewhat more)."""
        c, K = self.config, n_loop or self.config.n_loop
        readouts = 1 if c.supervision == 'terminal' else K
        passes = K + (c.jacobian_penalty > 0)
        uses = {'blocks': passes, 'adapter': passes, 'diagonal': passes, 'prelude': 1,
                'coda': readouts, 'exit_gate': K, 'wte': 0, 'wpe': 0,
                'lm_head': 0}  # lm_head: below, tied or not
        unknown = [n for n, p in self.named_parameters()
                   if p.dim() >= 2 and n.split('.')[0] not in uses]
        if unknown:
            raise ValueError(f"flops_per_token: no count for {', '.join(unknown)}; "
                             "add its module to uses")
        n_uses = sum(uses[name] * sum(p.numel() for p in m.parameters() if p.dim() >= 2)
                     for name, m in self.named_children() if name in uses)
        layers = passes * c.n_layer + c.n_prelude + readouts * c.n_coda
        head = readouts * c.vocab_size * c.n_embd
        return 6 * n_uses + 6 * head + 12 * layers * c.n_embd * c.block_size

    def configure_optimizers(self, weight_decay, learning_rate, device_type):
        # the authors decay every parameter; GPT-2's recipe (gpt2) only matrices. A design whose
        # source exempts its own parameters lists them here: decay would pull Parcae's B to 0, not
        # to the identity. Betas: PyTorch's defaults
        params = [p for p in self.parameters() if p.requires_grad]
        exempt = {id(p) for p in (self.diagonal.parameters() if self.diagonal else [])}
        decays = lambda p: id(p) not in exempt and (self.config.init != 'gpt2' or p.dim() >= 2)
        groups = [{'params': [p for p in params if decays(p)], 'weight_decay': weight_decay},
                  {'params': [p for p in params if not decays(p)], 'weight_decay': 0.0}]
        groups = [g for g in groups if g['params']]  # paper init, no diagonal: one group, as before
        return torch.optim.AdamW(groups, lr=learning_rate, fused=(device_type == 'cuda'))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, n_loop=None):
        """Append max_new_tokens sampled tokens to idx (B, T), each from the whole window rerun
        through n_loop loops. The window holds the last block_size tokens and, once full, restarts
        from its newest half: the rule a KV cache can keep (lab/engine.py), so both agree."""
        block = self.config.block_size
        start = max(0, idx.size(1) - block)
        for _ in range(max_new_tokens):
            if idx.size(1) - start > block:
                start = idx.size(1) - block // 2
            logits, _, _ = self(idx[:, start:], n_loop=n_loop)        # (B, 1, V)
            logp = F.log_softmax(logits[:, -1, :].float(), dim=-1)    # (B, V)
            idx = torch.cat((idx, sample(logp, temperature, top_k)), dim=1)
        return idx


def sample(logp, temperature=1.0, top_k=None):
    """One token id per row, (B, V) log-probabilities -> (B, 1), at a temperature, among top_k."""
    logits = logp / max(temperature, 1e-8)        # log-probabilities are logits up to a shift
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = float('-inf')
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


def sampled_depth(config, seed, step):
    """The loop count that training step `step` trains at: K, or under 'poisson_lognormal'
    looped_nanochat's draw tau ~ N(ln(K - 1) - sigma^2 / 2, sigma), r = Poisson(e^tau) + 1,
    sigma = 0.5, clamped to [1, 2K]; r has mean K before the clamp. It depends on (seed, step)
    alone, so every process and a resumed run draw the same r."""
    K = config.n_loop
    if config.depth_sampling == 'fixed' or K == 1:
        return K
    rng, sigma = np.random.default_rng([seed, step]), 0.5
    tau = rng.normal(math.log(K - 1) - sigma ** 2 / 2, sigma)
    return int(min(max(rng.poisson(math.exp(tau)) + 1, 1), 2 * K))
