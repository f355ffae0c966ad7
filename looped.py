"""A looped (depth-recurrent) transformer language model, in one file.

One shared stack of pre-norm layers is applied n_loop = K times: h_0 = e, the embedding; pass 1
runs on e itself, h_1 = stack(e), and every later pass on what the previous one carries over,
h_k = stack(carry(h_{k-1})), where carry is h itself (residual) or RMSNorm(h) (normed). Every
loop's state h_k is read out by the LM head, so every loop can get a cross-entropy ("per-loop", or
dense, supervision): loss = mean_k CE(head(readout(h_k))) + lambda * mean_k mean(h_k^2).

This is the model of "Dense Supervision Is Not Enough: The Readout Blind Spot in Looped Language
Models" (2026, arXiv 2606.24898). Its point: a scale-invariant readout (RMSNorm or LayerNorm before
the head) hides ||h_k|| from the loss, since CE(head(norm(a h))) does not depend on a > 0, while
the residual loop keeps carrying, and growing, that scale. The fields that expose or remove it:

    readout       rmsnorm | layernorm   scale-invariant: the loss cannot see ||h_k||
                  raw                   no norm: the head sees the scale, so the loss controls it
                  final_norm            raw at loops 1..K-1, RMSNorm at loop K and beyond
                  alpha                 s_ref^(1-alpha) * s^alpha * h / s, s = RMS(h)
    recurrence    residual | normed     loop k+1 starts from h_k, or from RMSNorm(h_k)
    supervision   per_loop | terminal   the mean of the K cross-entropies, or the last one alone
    norm_penalty  lambda                adds lambda * mean_k mean(h_k^2)

The rest: the shape (vocab_size, block_size, n_embd, n_head, n_layer, n_loop, dropout), tie_weights,
norm_eps. LoopedGPT.loops runs the loop; lab/designs.py overrides the methods marked "A seam", and
forward, flops_per_token and configure_optimizers too.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


class ConfigError(ValueError):  # a value the checks refuse; train.py re-raises it as InputError
    pass


# The allowed values of every text field; the first is the default.
CHOICES = {
    'readout': ('rmsnorm', 'layernorm', 'raw', 'final_norm', 'alpha'),
    'recurrence': ('residual', 'normed'),
    'supervision': ('per_loop', 'terminal'),
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
    supervision: str = 'per_loop'  # which loops get a cross-entropy: all K, or the last
    readout: str = 'rmsnorm'  # what the LM head sees of h_k (see Readout)
    alpha: float | None = None  # readout=alpha: unset learns alpha, a number in [0, 1] fixes it
    norm_penalty: float = 0.0  # lambda in lambda * mean_k mean(h_k^2); the paper uses 0.01
    recurrence: str = 'residual'  # the next loop starts from h_k, or from RMSNorm(h_k)
    tie_weights: bool = True  # the LM head shares the token embedding's weight, as the authors do
    norm_eps: float = 1e-6  # epsilon of every RMSNorm, as in the authors' release

    def __post_init__(self):
        for name, ok, why in self.checks():  # the first failure, in one line
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)!r} {why}")

    def checks(self, choices=CHOICES):
        """(field, whether its value is valid, why not) for every check. A seam: lab/designs.py
        passes its larger choices and adds the checks of its fields."""
        checks = [(name, getattr(self, name) in allowed, 'is not one of ' + ', '.join(allowed))
                  for name, allowed in choices.items()]
        checks += [(name, getattr(self, name) >= 1, 'must be at least 1') for name in
                   ('vocab_size', 'block_size', 'n_embd', 'n_head', 'n_layer', 'n_loop')]
        return checks + [
            ('n_embd', self.n_embd % max(self.n_head, 1) == 0,  # built even when n_head=0
             f"is not divisible by n_head={self.n_head}"),
            ('norm_eps', 0 < self.norm_eps < math.inf, 'must be a finite number > 0'),  # nan fails
            ('dropout', 0.0 <= self.dropout < 1.0, 'must be in [0, 1)'),
            ('norm_penalty', 0 <= self.norm_penalty < math.inf, 'must be a finite number >= 0'),
            ('alpha', self.alpha is None or 0 <= self.alpha <= 1,
             'must be in [0, 1] (or unset, to learn it)'),
            ('alpha', self.alpha is None or self.readout == 'alpha',
             f"is only used by readout='alpha', not {self.readout!r}")]


class RMSNorm(nn.Module):
    """x / rms(x) * weight: scale-invariant, RMSNorm(a * x) == RMSNorm(x) for a > 0 (up to eps)."""

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
    """Multi-head causal self-attention through SDPA (flash attention where the device has it)."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)  # q, k, v at once
        # no dropout after c_proj, as the authors' (a layer drops attention weights and MLP output)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        """x (B, T, C) -> (B, T, C): each position attends to itself and the ones before it."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)              # heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):
    """SwiGLU, as the authors': W2 (silu(W1 x) * W3 x), hidden width 4d."""

    def __init__(self, config):
        super().__init__()
        hidden = 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=False)  # W1: silu(W1 x) is the gate
        self.c_up = nn.Linear(config.n_embd, hidden, bias=False)  # W3: the branch it multiplies
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):
        u = F.silu(self.c_fc(x)) * self.c_up(x)                       # (B, T, 4C)
        return self.drop(self.c_proj(u))                              # (B, T, C)


class Block(nn.Module):
    """One layer. Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)). The residual stream itself is
    never normalized, which is why its scale can grow from loop to loop."""

    def __init__(self, config):
        super().__init__()
        self.norm_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.norm_1(x))                             # (B, T, C)
        return x + self.mlp(self.norm_2(x))                           # (B, T, C)


class AlphaNorm(nn.Module):
    """The alpha readout: per token h = s * u, s = RMS(h), out = s_ref^(1 - alpha) * s^alpha * u
    (alpha = 1: h, raw; 0: s_ref * u, scale-invariant: RMSNorm with one scalar gain s_ref, and eps a
    floor on s); alpha = sigmoid(logit), learned from 0.5 unless fixed, and log s_ref learned."""

    def __init__(self, config):
        super().__init__()
        self.eps, self.fixed_alpha = config.norm_eps, config.alpha
        self.alpha_logit = nn.Parameter(torch.zeros(())) if config.alpha is None else None
        self.log_s_ref = nn.Parameter(torch.zeros(()))                # s_ref = 1 at the start

    def alpha(self):
        if self.fixed_alpha is None:
            return torch.sigmoid(self.alpha_logit)
        return torch.tensor(float(self.fixed_alpha), device=self.log_s_ref.device)

    def forward(self, h):
        """h (..., C) -> s_ref^(1 - alpha) * s^alpha * h / s, s = RMS(h) per token (>= eps)."""
        hf = h.to(torch.promote_types(h.dtype, torch.float32))       # at least fp32, as in RMSNorm
        s = hf.pow(2).mean(-1, keepdim=True).clamp_min(self.eps ** 2).sqrt()  # (..., 1): RMS >= eps
        # s_ref^(1-a) * s^a * h / s == h * (s_ref / s)^(1-a): so alpha = 1 returns h exactly
        return (hf * torch.exp((1 - self.alpha()) * (self.log_s_ref - s.log()))).type_as(h)


class Readout(nn.Module):
    """What the LM head sees of h_k at loop k (1-indexed)."""

    def __init__(self, config):
        super().__init__()
        self.kind, self.n_loop = config.readout, config.n_loop
        if self.kind == 'layernorm':
            self.norm = nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=False)
        elif self.kind in ('rmsnorm', 'final_norm'):
            self.norm = RMSNorm(config.n_embd, config.norm_eps)
        elif self.kind == 'alpha':
            self.norm = AlphaNorm(config)
        else:  # raw
            self.norm = nn.Identity()

    def forward(self, h, k):
        """The head's input for h_k (..., C): self.norm(h); final_norm's exits before K are raw."""
        if self.kind == 'final_norm' and k < self.n_loop:
            return h
        return self.norm(h)


class LoopedGPT(nn.Module):
    """The looped LM. Initialized as the authors do: PyTorch's default draws, with the head tied to
    the N(0, 1) token embedding, so the first logits are in the tens and ||h|| jumps early on."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = self.make_stack()                               # the ONE shared stack
        normed = config.recurrence == 'normed'
        self.inter_norm = RMSNorm(config.n_embd, config.norm_eps) if normed else None
        self.readout = Readout(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight

    def make_stack(self):
        """The n_layer layers every loop runs. A seam: lab/designs.py makes its own layers here."""
        return nn.ModuleList([Block(self.config) for _ in range(self.config.n_layer)])

    def num_params(self):  # the looped stack and a tied head once; the position table too
        return sum(p.numel() for p in self.parameters())

    # ---- the forward pass in the order it runs: embed, loops, readout, loss

    def embed(self, idx):
        """h_0 = e: token plus position embedding, (B, T) -> (B, T, C). A seam."""
        pos = torch.arange(idx.size(1), device=idx.device)           # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))               # (B, T, C)

    def loops(self, e, n_loop):
        """The recurrence, the one place it is written: yields (k, h_k) for k = 1..n_loop, from
        h_0 = e, running pass k only when h_k is asked for. h_k is pass k's output, before any norm
        between loops: what is read out, penalized and logged."""
        h = e
        for k in range(1, n_loop + 1):
            if k > 1:
                h = self.carry(h)                     # what pass k starts from: no carry before 1
            h = self.loop_pass(h, e, k, n_loop)       # (B, T, C): the stack, once
            yield k, h

    def loop_pass(self, h, e, k, n_loop):
        """Pass k of n_loop: every layer of the stack once, in order, (B, T, C) -> (B, T, C), from h
        alone here. A seam: lab/designs.py's passes also read the embedding e, k and n_loop."""
        for block in self.blocks:
            h = block(h)
        return h

    def carry(self, h):
        """What pass k+1 starts from, given h_k (B, T, C): h_k, or RMSNorm(h_k) (normed). A seam."""
        return h if self.inter_norm is None else self.inter_norm(h)

    def exit_input(self, h, k):
        """What the LM head reads of h_k (B, T, C) at loop k: the readout. A seam."""
        return self.readout(h, k)

    def head_loss(self, x, targets=None, reduction='mean'):
        """(logits, and their cross-entropy given targets): the LM head on x = exit_input(h_k, k)
        (B, T, C), the one place a state becomes logits (B, T, V), for training, evaluation and
        generate. --compile fuses head and loss: logits' float32 copy is never stored."""
        logits = self.lm_head(x)                                      # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1,
                               reduction=reduction)
        return logits, loss

    def loop_loss(self, h, k, targets, reduction='mean'):
        """Loop k's (logits, cross-entropy) from h_k (B, T, C) and targets (B, T); reduction
        'none' gives every token's cross-entropy, (B * T,). A seam."""
        return self.head_loss(self.exit_input(h, k), targets, reduction)

    def supervision_loss(self, ces):
        """The training loss from the per-loop cross-entropies ces[k-1], k = 1..K (scalars): their
        mean under per-loop ("dense") supervision, the last one alone under terminal supervision."""
        if self.config.supervision == 'per_loop':
            return torch.stack(ces).mean()
        return ces[-1]

    def penalty_loss(self, states):
        """lambda * mean over loops of mean(h_k^2), on the states h_1..h_K that loops() yields
        (before any inter-loop norm, as in the paper). Its gradient is purely radial."""
        mean_squares = torch.stack([h.float().pow(2).mean() for h in states])  # (K,)
        return self.config.norm_penalty * mean_squares.mean()

    def training_loss(self, ces, states):
        """What training minimizes: the cross-entropies supervised, plus the penalty if it is on."""
        loss = self.supervision_loss(ces)
        if self.config.norm_penalty > 0:
            loss = loss + self.penalty_loss(states)
        return loss

    def forward(self, idx, targets=None, n_loop=None):
        """idx, targets (B, T) token ids; n_loop: the depth to run, the trained K unless set (more
        is allowed). Returns (logits: the last loop's, (B, T, V), or (B, 1, V) without targets;
        loss: the training loss, or None without targets; stats: 'hidden_norm' (n_loop,), each
        loop's mean ||h_k|| over tokens, and 'ce' (n_loop,), each loop's cross-entropy, or None)."""
        T, depth = idx.size(1), n_loop or self.config.n_loop
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than "
                             f"block_size={self.config.block_size}")
        e = self.embed(idx)                                           # h_0: (B, T, C)
        states, ces = [], []
        for k, h in self.loops(e, depth):                             # h = h_k: (B, T, C)
            states.append(h)
            if targets is None:
                continue
            if k < depth:  # recomputed in backward: a 50k BPE's logits at every loop won't fit
                ce = checkpoint(self.loop_loss, h, k, targets, use_reentrant=False)[1]
            else:
                logits, ce = self.loop_loss(h, k, targets)             # (B, T, V), returned
            ces.append(ce)
        stats = {'hidden_norm': torch.stack([h.detach().float().norm(dim=-1).mean()
                                             for h in states]),  # ||h_k||, before any norm
                 'ce': torch.stack([ce.detach().mean() for ce in ces]) if ces else None}
        if targets is None:  # only the next token is needed: the head on h_depth's last position
            return self.head_loss(self.exit_input(h, depth)[:, -1:, :])[0], None, stats
        return logits, self.training_loss(ces, states), stats

    def flops_per_token(self):
        """Training FLOPs per token, nanoGPT's count: 6 per use of a matrix weight (the stack's once
        a loop, the head's once a supervised loop) plus attention's 12 * K * n_layer * d * T."""
        c, K = self.config, self.config.n_loop
        readouts = 1 if c.supervision == 'terminal' else K  # terminal's logged CEs left out
        stack = sum(p.numel() for p in self.blocks.parameters() if p.dim() >= 2)
        attention = 12 * K * c.n_layer * c.n_embd * c.block_size
        return 6 * K * stack + 6 * readouts * c.vocab_size * c.n_embd + attention

    def configure_optimizers(self, weight_decay, learning_rate, device_type):
        # the authors decay every parameter, vectors too; betas are PyTorch's defaults
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW([{'params': params, 'weight_decay': weight_decay}],
                                 lr=learning_rate, fused=(device_type == 'cuda'))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, n_loop=None,
                 exit_rule=None, exit_threshold=None, return_depths=False):
        """Append max_new_tokens sampled tokens to idx (B, T), each from its window run through
        n_loop loops (the trained K unless set), or up to the first whose exit rule passes. The
        window grows to block_size tokens, then restarts from its newest half (nanoGPT's slides by
        one; this one keeps lab/engine.py's KV cache valid). return_depths: each exit loop too."""
        K, block = n_loop or self.config.n_loop, self.config.block_size
        start, depths = max(0, idx.size(1) - block), []
        for _ in range(max_new_tokens):
            if idx.size(1) - start > block:  # a full window restarts from its newest half
                start = idx.size(1) - block // 2
            if exit_rule is None:  # every loop, through forward, as nanoGPT's generate
                logits, _, _ = self(idx[:, start:], n_loop=K)             # (B, 1, V)
                logp = F.log_softmax(logits[:, -1].float(), dim=-1)       # (B, V)
                depth = torch.full_like(idx[:, 0], K)                     # (B,)
            else:
                logp, depth = self.exit_early(idx[:, start:], K, exit_rule, exit_threshold)
            depths.append(depth)
            idx = torch.cat((idx, sample(logp, temperature, top_k)), dim=1)  # sample: below
        if not return_depths:
            return idx
        return idx, (torch.stack(depths, 1) if depths else idx.new_zeros(idx.size(0), 0))

    def exit_early(self, idx, n_loop, rule, threshold):
        """Log-probabilities (B, V) of the next token after idx (B, T), each row's from the first
        loop whose rule passes (the last always does), and that loop (B,). With t the threshold:
        top p >= t (confidence), KL(p_k || p_k-1) <= t (kl), z_k's relative change <= t (latent)."""
        assert rule in ('confidence', 'kl', 'latent'), f"unknown exit rule {rule!r}"
        e = self.embed(idx)                                           # h_0: (B, T, C)
        depth = torch.zeros_like(idx[:, 0])                           # (B,): 0 until a row exits
        logp, logp_prev, z_prev = None, None, e[:, -1].float()
        for k, h in self.loops(e, n_loop):                            # h_k: (B, T, C)
            logits, _ = self.head_loss(self.exit_input(h, k)[:, -1:])  # (B, 1, V)
            logp_k = F.log_softmax(logits[:, -1].float(), dim=-1)     # (B, V)
            z = h[:, -1].float()                                      # (B, C): the last position
            passes = k == n_loop
            if rule == 'confidence':
                passes = passes | (logp_k.max(dim=-1).values.exp() >= threshold)
            elif rule == 'latent':
                change = (z - z_prev).norm(dim=-1) / z_prev.norm(dim=-1).clamp_min(1e-12)
                passes = passes | (change <= threshold)
            elif rule == 'kl' and k > 1:
                passes = passes | ((logp_k.exp() * (logp_k - logp_prev)).sum(dim=-1) <= threshold)
            stops = (depth == 0) & passes                             # (B,): rows exiting here
            logp = logp_k if logp is None else torch.where(stops[:, None], logp_k, logp)
            depth[stops] = k
            if (depth > 0).all():
                break
            logp_prev, z_prev = logp_k, z
        return logp, depth


def sample(logp, temperature=1.0, top_k=None):
    """One token id per row, (B, V) log-probabilities -> (B, 1), at a temperature, among top_k."""
    logits = logp / max(temperature, 1e-8)        # log-probabilities are logits up to a shift
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = float('-inf')
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
