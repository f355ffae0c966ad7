"""
A looped (depth-recurrent) transformer language model, in one file.

One shared stack of pre-norm transformer layers is applied n_loop (K) times. Every loop's hidden state
h_k is read out through the LM head (so it can be supervised: "per-loop" or "dense" supervision) and is
also fed back into the next loop. The paper this reproduces ("Dense Supervision Is Not Enough: The
Readout Blind Spot in Looped Language Models", Sharma & Vu, 2026) shows that a scale-invariant readout
(RMSNorm or LayerNorm before the head) hides ||h_k|| from the loss, while the pre-norm residual loop keeps
carrying and growing it. The variants below are the knobs that expose or remove that blind spot:

    readout      rmsnorm | layernorm   scale-invariant: the loss cannot see ||h||
                 raw                   no norm: the head sees the scale, so the loss controls it
                 final_norm            raw at loops 1..K-1, RMSNorm at loop K
    recurrence   residual              h_k = Stack(h_{k-1}): the scale is carried from loop to loop
                 normed                h_k = RMSNorm(Stack(h_{k-1})): the carried state has no free scale
    supervision  per_loop | terminal   mean of the K cross-entropies, or the last one only
    norm_penalty lambda                adds lambda * mean_k mean(h_k^2)

Importing this file has no side effects; train.py and sample.py drive it.
"""

import math
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

# The allowed values of every variant field; train.py uses these as argparse choices.
READOUTS = ('rmsnorm', 'layernorm', 'raw', 'final_norm')
RECURRENCES = ('residual', 'normed')
SUPERVISIONS = ('per_loop', 'terminal')
INITS = ('paper', 'gpt2')
MLPS = ('swiglu', 'gelu')
ATTENTIONS = ('sdpa', 'manual')


@dataclass
class LoopedConfig:
    vocab_size: int = 65        # 65 = the characters of tiny Shakespeare
    block_size: int = 128       # context length T; also the size of the learned position table
    n_embd: int = 128           # width d of the residual stream
    n_head: int = 4             # attention heads; must divide n_embd
    n_layer: int = 2            # layers in the ONE shared stack (unique layers, not the unrolled depth)
    n_loop: int = 4             # K: how many times the stack is applied (unrolled depth = n_layer * K)
    dropout: float = 0.0        # the paper uses 0.1; 0 on tiny CPU runs, where it only slows learning
    readout: str = 'rmsnorm'    # how h_k is turned into the LM head's input; see READOUTS above
    recurrence: str = 'residual'  # what carries h from one loop to the next; see RECURRENCES above
    supervision: str = 'per_loop'  # which loops' cross-entropies enter the loss
    norm_penalty: float = 0.0   # lambda in lambda * mean_k mean(h_k^2); the paper uses 0.01
    init: str = 'paper'         # 'paper': the authors' PyTorch-default recipe; 'gpt2': nanoGPT's; see _init_weights
    mlp: str = 'swiglu'         # SwiGLU (the paper) or GELU (GPT-2), both with hidden width 4d
    tie_weights: bool = None    # LM head shares the token embedding; None means: tied for 'paper', untied for 'gpt2'
    attention: str = 'sdpa'     # 'sdpa' (fused / flash kernels) or 'manual' (the same math, spelled out)
    norm_eps: float = 1e-6      # epsilon of every RMSNorm, as in the authors' release

    def __post_init__(self):
        if self.tie_weights is None:
            self.tie_weights = self.init == 'paper'
        for name, allowed in [('readout', READOUTS), ('recurrence', RECURRENCES), ('supervision', SUPERVISIONS),
                              ('init', INITS), ('mlp', MLPS), ('attention', ATTENTIONS)]:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for name in ['vocab_size', 'block_size', 'n_embd', 'n_head', 'n_layer', 'n_loop']:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if not (self.norm_penalty >= 0.0 and math.isfinite(self.norm_penalty)):
            raise ValueError(f"norm_penalty={self.norm_penalty} must be a finite number >= 0")

    def to_dict(self):
        return asdict(self)


class RMSNorm(nn.Module):
    """x / rms(x) * g. Scale-invariant: RMSNorm(a * x) == RMSNorm(x) for any a > 0 (up to eps)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # compute in fp32 so that huge hidden states (norms in the thousands) do not overflow under bf16
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.attention = config.attention
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.resid_drop = nn.Dropout(config.dropout)
        # the causal mask is only needed by the manual path; SDPA builds it from is_causal=True
        T = config.block_size
        self.register_buffer('mask', torch.tril(torch.ones(T, T, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)                      # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        if self.attention == 'sdpa':
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hs)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))   # (B, nh, T, T)
            att = att.masked_fill(~self.mask[:T, :T], float('-inf'))
            att = F.dropout(F.softmax(att, dim=-1), p=p)
            y = att @ v                                               # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)              # (B, T, C): heads side by side again
        return self.resid_drop(self.c_proj(y))


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
    """Pre-norm layer: x + attn(norm(x)), then x + mlp(norm(x)). The residual stream itself is never
    normalized, which is why its scale can grow from loop to loop."""

    def __init__(self, config):
        super().__init__()
        self.norm_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.norm_1(x))
        x = x + self.mlp(self.norm_2(x))
        return x


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
        else:  # raw
            self.norm = None

    def forward(self, h, k):
        # final_norm: raw readouts where the model was trained to exit early (k < K), RMSNorm at the trained
        # depth K and, by the same rule, at any extrapolated depth beyond it
        if self.norm is None or (self.kind == 'final_norm' and k < self.n_loop):
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
        # inter-loop normalization: closes every pass, so each loop starts from (and passes on) a normalized state
        self.inter_norm = RMSNorm(config.n_embd, config.norm_eps) if config.recurrence == 'normed' else None
        self.readout = Readout(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self._init_weights()

    def _init_weights(self):
        # Two recipes, because initialization decides whether the blind spot shows on short runs:
        # 'paper' is the authors' release: PyTorch's own defaults, i.e. nn.Linear U(-1/sqrt(fan_in), +1/sqrt(fan_in)),
        #   nn.Embedding N(0, 1) and norms at gain 1, with the LM head tied to the N(0, 1) token embedding.
        #   Embeddings of RMS 1 and logits in the tens make the norm run away within the first hundred steps.
        # 'gpt2' is nanoGPT's: N(0, 0.02) everywhere, residual output projections scaled down by
        #   sqrt(2 * unrolled depth) so the sum of all residual writes starts small; the head is untied.
        #   With it the blind spot takes far longer to show (README: "Where this differs from the paper").
        if self.config.init == 'paper':
            return  # the constructors above already applied PyTorch's defaults
        depth = self.config.n_layer * self.config.n_loop
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norm gains stay at 1
            std = 0.02 / math.sqrt(2 * depth) if name.endswith('c_proj.weight') else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def num_params(self):
        """Unique parameters: the shared stack counts once however many times it is looped (and a tied
        head counts once), because parameters() yields each tensor once."""
        return sum(p.numel() for p in self.parameters())

    def embed(self, idx):
        """h_0: token plus learned position embedding, (B, T) -> (B, T, C)."""
        pos = torch.arange(idx.size(1), device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def loop_step(self, h):
        """h_{k-1} -> h_k: one pass through the shared stack. With 'normed' recurrence the pass ends in an
        RMSNorm: the state handed to the next loop, and read out, has norm ~ sqrt(d) * gain whatever scale the
        pass produced."""
        for block in self.blocks:
            h = block(h)
        if self.inter_norm is not None:
            h = self.inter_norm(h)
        return h

    def readout_loss(self, h, targets, k, return_logits=False):
        """Cross-entropy of loop k's readout of h (B, T, C) against targets (B, T); optionally the logits too."""
        logits = self.lm_head(self.readout(h, k))                     # (B, T, V)
        ce = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return (ce, logits) if return_logits else ce

    def forward(self, idx, targets=None, n_loop=None):
        """idx, targets: (B, T) token ids. n_loop defaults to the trained K and may exceed it.
        Returns (logits, loss, stats):
          logits  (B, T, V) at the last loop when targets are given, else (B, 1, V) for the last position
          loss    the training objective (None without targets)
          stats   {'hidden_norm': (n_loop,) mean over tokens of ||h_k||_2, before the readout's normalization
                                  (for 'normed' recurrence h_k is the normalized state passed to the next loop),
                   'ce': (n_loop,) cross-entropy of the readout at every loop, or None without targets}
        """
        B, T = idx.shape
        K = n_loop or self.config.n_loop
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.config.block_size}")
        h = self.embed(idx)                                           # (B, T, C)

        norms, ces, losses, penalty = [], [], [], 0.0
        for k in range(1, K + 1):
            h = self.loop_step(h)                                     # (B, T, C): h_k
            norms.append(h.detach().float().norm(dim=-1).mean())
            if self.config.norm_penalty > 0:
                penalty = penalty + h.float().pow(2).mean()
            if targets is None:
                continue
            # Every loop is decoded for the statistics; only supervised loops get a gradient (the others are
            # decoded under no_grad, so they keep no activations for the backward pass).
            supervised = self.config.supervision == 'per_loop' or k == K
            if supervised and k < K and torch.is_grad_enabled():
                # Per-loop readouts before the last are checkpointed: backward recomputes their (B, T, V) logits
                # instead of keeping K copies alive, so per-loop supervision costs about the memory of terminal.
                ce = checkpoint(self.readout_loss, h, targets, k, use_reentrant=False)
            else:
                with torch.set_grad_enabled(torch.is_grad_enabled() and supervised):
                    ce, logits = self.readout_loss(h, targets, k, return_logits=True)
            ces.append(ce.detach())
            if supervised:
                losses.append(ce)

        stats = {'hidden_norm': torch.stack(norms), 'ce': torch.stack(ces) if ces else None}
        if targets is None:
            logits = self.lm_head(self.readout(h[:, [-1], :], K))     # (B, 1, V): only the next token is needed
            return logits, None, stats
        loss = torch.stack(losses).mean()
        if self.config.norm_penalty > 0:
            loss = loss + self.config.norm_penalty * penalty / K
        return logits, loss, stats

    def flops_per_token(self, n_loop=None):
        """Training FLOPs per token (forward + backward = 6 per parameter per token, as in the PaLM paper):
        the shared stack counts once per loop, the LM head once per readout that has a loss, and attention's
        score and value matmuls (12 * layers * d * T, nanoGPT's convention) once per loop."""
        c = self.config
        K = n_loop or c.n_loop
        n_stack = sum(p.numel() for p in self.blocks.parameters())
        n_embed = self.wte.weight.numel() + self.wpe.weight.numel() + (0 if c.tie_weights else self.lm_head.weight.numel())
        n_other = self.num_params() - n_stack - n_embed               # readout and inter-loop norm gains
        readouts = K if c.supervision == 'per_loop' else 1
        return 6 * (K * n_stack + n_other) + 6 * readouts * c.vocab_size * c.n_embd + 12 * K * c.n_layer * c.n_embd * c.block_size

    def configure_optimizers(self, weight_decay, learning_rate, device_type):
        # 'paper': the authors decay every parameter (embeddings and norm gains too); 'gpt2': nanoGPT decays
        # only matrices. Betas are PyTorch's defaults, as in the authors' release.
        params = [p for p in self.parameters() if p.requires_grad]
        if self.config.init == 'paper':
            groups = [{'params': params, 'weight_decay': weight_decay}]
        else:
            groups = [{'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
                      {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, fused=(device_type == 'cuda'))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, n_loop=None, exit=None, exit_threshold=None):
        """Append max_new_tokens sampled tokens to idx (B, T). Each token runs up to n_loop loops; with an exit
        rule ('confidence' or 'kl', see exit_passes) it stops at the first loop whose last-position readout passes
        the threshold (for the whole batch at once). Returns (idx, loops used per generated token)."""
        K = n_loop or self.config.n_loop
        loops_used = []
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size:]               # crop to the context the model knows
            h, logp_prev = self.embed(idx_cond), None
            for k in range(1, K + 1):
                h = self.loop_step(h)                                 # (B, T, C)
                logits = self.lm_head(self.readout(h[:, -1, :], k))    # (B, V): only the next token is needed
                logp = F.log_softmax(logits.float(), dim=-1)
                if exit is not None and exit_passes(exit, exit_threshold, logp, logp_prev).all():
                    break
                logp_prev = logp
            loops_used.append(k)
            logits = logits / max(temperature, 1e-8)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = float('-inf')
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx, loops_used


EXITS = ('confidence', 'kl')


def exit_passes(kind, threshold, logp, logp_prev):
    """Early-exit rule on one loop's log-probabilities (..., V): 'confidence' passes when the top probability
    reaches the threshold; 'kl' when KL(p_k || p_{k-1}) falls to the threshold or below (so never at loop 1:
    there is nothing to compare with). Returns a bool tensor of shape (...)."""
    if kind == 'confidence':
        return logp.max(dim=-1).values.exp() >= threshold
    if logp_prev is None:
        return torch.zeros(logp.shape[:-1], dtype=torch.bool, device=logp.device)
    return (logp.exp() * (logp - logp_prev)).sum(dim=-1) <= threshold
