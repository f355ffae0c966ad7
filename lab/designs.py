"""
The field's looped designs, as an extension of looped.py's model: DesignConfig adds one field per design to
LoopedConfig, DesignedGPT adds each design's code to LoopedGPT. With every design field at its default,
DesignedGPT computes exactly what LoopedGPT does (the design tests check it), so every run of the lab builds it.

    injection         none | add | concat | diagonal   what a pass runs on: h, h + e, W [h; e], or Parcae's
                                                       decay * h + Delta * B e (the carried state decays)
    n_prelude, n_coda                                  unshared layers once before the loop (Huginn's prelude),
                                                       and between every h_k and its readout (its coda)
    block             prenorm | sandwich | deepnorm    each sublayer x + f(norm(x)); norm(x + f(norm(x)))
                                                       (Huginn's, looped_nanochat's); norm(a x + f(x)) (DeepLoop's)
    recurrence        damped                           loop k+1 starts from sigmoid(a) * h_k, a learned
    depth_sampling    fixed | poisson_lognormal        training only: K loops, or a drawn count of mean K
    bptt              n                                the last exit's loss reaches the last n passes only
    residual_scale    none | inverse_k                 each pass's update scaled by 1/K
    jacobian_penalty  w                                w * ||v^T J||^2, J one pass's Jacobian (STARS)
    supervision       gated                            Ouro's: sum_k p_k CE_k - beta H(p), p from a learned exit
                                                       gate (gate_input: what it reads; gate_beta: beta)
    init, mlp, attention, tie_weights                  GPT-2's init, GELU, attention spelled out, an untied head

How a design plugs in: LoopedGPT's seams, each of which does the paper's thing in looped.py, are overridden here:
checks (the larger choices), make_stack (the layers, and those around the loop), embed (the prelude), loop_pass
(injection, truncated backprop, the 1/K update), carry (damping), exit_input (the coda), loop_loss (per-token
losses for the gate) and, in training under gated supervision or the Jacobian penalty, forward (designed_forward:
each loop's gate beside its loss, STARS's term after them). Adding a design: docs/usage.md, "Adding a design".

train.py trains looped.py's LoopedGPT unless a design is asked for (designs_asked): a flag of the designs' own
group in --help (add_design_flags) off its default, or --supervision=gated, or --recurrence=damped.
"""

import math
import typing
import zlib
from collections import namedtuple
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from looped import CHOICES as PAPER_CHOICES
from looped import MLP, Block, CausalSelfAttention, LoopedConfig, LoopedGPT, RMSNorm
from plumbing.run import boolean

# The allowed values of every text field, the paper's and the designs'; the first is the default.
CHOICES = {
    'supervision': (*PAPER_CHOICES['supervision'], 'gated'),
    'gate_input': ('raw', 'readout'),
    'readout': PAPER_CHOICES['readout'],
    'recurrence': (*PAPER_CHOICES['recurrence'], 'damped'),
    'init': ('paper', 'gpt2', 'paper_small_embed'),
    'mlp': ('swiglu', 'gelu'),
    'injection': ('none', 'add', 'concat', 'diagonal'),
    'block': ('prenorm', 'sandwich', 'deepnorm'),
    'depth_sampling': ('fixed', 'poisson_lognormal'),
    'residual_scale': ('none', 'inverse_k'),
    'attention': ('sdpa', 'manual'),
}


@dataclass
class DesignConfig(LoopedConfig):
    # the paper's fields (two with more values here), then every other design's
    supervision: str = 'per_loop'  # which loops get a cross-entropy: all K, the last, or gated
    recurrence: str = 'residual'  # the next loop starts from h_k, RMSNorm(h_k) or sigmoid(a) h_k
    gate_input: str = 'raw'  # gated: the exit gate reads h_k itself (the authors'), or the readout
    gate_beta: float = 0.1  # gated: beta in sum_k p_k CE_k - beta H(p); H <= ln 4 = 1.39 at K = 4
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

    def __post_init__(self):
        if self.tie_weights is None:
            self.tie_weights = self.init != 'gpt2'  # the authors tie; gpt2 unties, as nanochat does
        super().__post_init__()

    def may_leave_parameters_unused(self):
        """Whether a training step can leave a parameter without a gradient, which DDP must be told to expect: a
        step of one pass (a drawn depth of 1, bptt) leaves the damping, the inter-loop norm, the last gate or
        final_norm's norm without one."""
        return (self.depth_sampling != 'fixed' or self.bptt > 0 or self.recurrence != 'residual'
                or self.supervision == 'gated' or self.readout == 'final_norm')

    def checks(self, choices=CHOICES):
        return super().checks(choices) + [
            *[(name, getattr(self, name) >= 0, 'must be at least 0') for name in ('n_prelude', 'n_coda', 'bptt')],
            ('jacobian_penalty', 0 <= self.jacobian_penalty < math.inf, 'must be a finite number >= 0'),
            ('gate_beta', 0 <= self.gate_beta < math.inf, 'must be a finite number >= 0')]


class ManualAttention(CausalSelfAttention):
    """attention='manual': the fused kernel's math spelled out, softmax(q k^T / sqrt(hs) + causal mask) v. Its
    cached path is its own: in generation (lab/engine.py) kv takes this call's keys and values (B, nh, T, hs) and
    returns all so far (B, nh, L, hs), x then being the newest T of L positions."""

    def forward(self, x, kv=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if kv is not None:
            k, v = kv(k, v)                                           # (B, nh, L, hs), L >= T
        L = k.size(2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))       # (B, nh, T, L)
        seen = torch.ones(T, L, dtype=torch.bool, device=x.device).tril(L - T)
        att = att.masked_fill(~seen, float('-inf'))
        att = F.dropout(F.softmax(att, dim=-1), p=self.dropout if self.training else 0.0)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)      # heads side by side again
        return self.c_proj(y)


class GeluMLP(nn.Module):
    """mlp='gelu', GPT-2's: W2 gelu(W1 x), hidden width 4d."""

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class DesignBlock(Block):
    """One layer with the designs' choices. Sandwich (Huginn's and looped_nanochat's) also normalizes each sum: a
    layer hands on a state of fixed RMS. DeepNorm (DeepLoop's Post-LN) normalizes the sum alone, norm(alpha * x +
    f(x)): DeepNorm's alpha is (2N)^(1/4), DeepLoop squares it for a loop, sqrt(2N), N = n_layer * n_loop."""

    def __init__(self, config):
        # not Block.__init__: the design's norms sit between Block's layers, and every layer is made (its weights
        # drawn from torch's one stream) in the order it runs
        nn.Module.__init__(self)
        self.sandwich = sandwich = config.block == 'sandwich'
        self.deepnorm = config.block == 'deepnorm'
        self.residual_weight = math.sqrt(2 * config.n_layer * config.n_loop)  # deepnorm's alpha
        self.norm_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = ManualAttention(config) if config.attention == 'manual' else CausalSelfAttention(config)
        self.post_attn = RMSNorm(config.n_embd, config.norm_eps) if sandwich else nn.Identity()
        self.norm_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = GeluMLP(config) if config.mlp == 'gelu' else MLP(config)
        self.post_mlp = RMSNorm(config.n_embd, config.norm_eps) if sandwich else nn.Identity()

    def forward(self, x):
        if self.sandwich:
            return self.sandwich_forward(x)
        if self.deepnorm:  # (B, T, C): the sublayers see x itself; the norms come after the sums
            x = self.norm_1(self.residual_weight * x + self.attn(x))
            return self.norm_2(self.residual_weight * x + self.mlp(x))
        return super().forward(x)

    def sandwich_forward(self, x):
        """(B, T, C) -> (B, T, C): norm(x + f(norm(x))) for f = attention, then the MLP."""
        x = self.post_attn(x + self.attn(self.norm_1(x)))
        return self.post_mlp(x + self.mlp(self.norm_2(x)))


class DiagonalInjection(nn.Module):
    """Parcae's injection: pass k runs on decay * h + Delta * B e, per channel, with Delta = softplus(dt_bias) > 0
    and decay = exp(-Delta * exp(A_log)) in (0, 1): whatever training does, the carried part is multiplied by less
    than 1 (the pass may grow it again). At init A_log = 0, decay = sqrt(1/5), B = I."""

    def __init__(self, config):
        super().__init__()
        d = config.n_embd
        self.A_log = nn.Parameter(torch.zeros(d))
        # softplus(log(sqrt(5) - 1)) = log(sqrt(5)), so the decay exp(-Delta) starts at sqrt(1/5)
        self.dt_bias = nn.Parameter(torch.full((d,), math.log(math.sqrt(5) - 1)))
        self.B = nn.Linear(d, d, bias=False)  # the identity, set in DesignedGPT.init_weights

    def coefficients(self):
        """(Delta, decay), each (C,): what e and h are multiplied by, channel by channel."""
        delta = F.softplus(self.dt_bias)
        return delta, torch.exp(-delta * self.A_log.exp())

    def forward(self, h, e):
        delta, decay = self.coefficients()
        return decay * h + delta * self.B(e)                          # (B, T, C)


class DesignedGPT(LoopedGPT):
    """looped.py's LoopedGPT with every design of DesignConfig; at the defaults it computes what LoopedGPT does."""

    def __init__(self, config):
        super().__init__(config)
        # made after the head: under the paper init every weight above draws as it did before these existed
        diagonal, damped = config.injection == 'diagonal', config.recurrence == 'damped'
        self.diagonal = DiagonalInjection(config) if diagonal else None
        self.damping = nn.Parameter(torch.tensor(2.0)) if damped else None  # sigmoid(2) = 0.88
        gated = config.supervision == 'gated'
        self.exit_gate = nn.Linear(config.n_embd, 1) if gated else None  # lambda_k = sigmoid(exit_gate(z_k))
        self.init_weights()

    def make_stack(self):
        c = self.config
        # the ONE stack, registered first: the parameters' order (the optimizer's state, gradient clipping's sum)
        # is the one every committed run was trained in
        self.blocks = nn.ModuleList([DesignBlock(c) for _ in range(c.n_layer)])
        # unshared layers around the loop (none by default): prelude once, coda at every readout
        self.prelude = nn.ModuleList([DesignBlock(c) for _ in range(c.n_prelude)])
        self.coda = nn.ModuleList([DesignBlock(c) for _ in range(c.n_coda)])
        self.adapter = nn.Linear(2 * c.n_embd, c.n_embd, bias=False) if c.injection == 'concat' else None
        return self.blocks

    def init_weights(self):
        # 'paper' (the authors'): LoopedGPT's, PyTorch's defaults. 'gpt2': GPT-2's N(0, 0.02), residual
        # projections scaled by 1/sqrt(2 * unrolled depth), and the head untied (nanochat's choice; nanoGPT draws
        # the same but ties its head to wte). 'paper_small_embed': 'paper' with both embeddings at N(0, 0.02). A
        # redrawn weight has its own generator, seeded by the seed and its name: a new parameter never shifts another's.
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
            key = name.replace('.c_up.', '.c_gate.')  # W3's former name: committed runs draw as they did
            draw = torch.Generator().manual_seed(seed ^ zlib.crc32(key.encode()))
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=draw) * std)
        with torch.no_grad():
            if self.adapter is not None:  # W = [I | 0]: at step 0 'concat' computes what 'none' does
                self.adapter.weight.copy_(torch.eye(c.n_embd, 2 * c.n_embd))
            if self.diagonal is not None:  # Parcae's B = I, whatever the init drew
                self.diagonal.B.weight.copy_(torch.eye(c.n_embd))
            if c.block == 'deepnorm':  # beta = (8N)^(-1/2), DeepNorm's (8N)^(-1/4) squared as alpha is
                for block in [*self.prelude, *self.blocks, *self.coda]:
                    block.attn.c_attn.weight[2 * c.n_embd:].mul_((8 * depth) ** -0.5)  # v's rows
                    # two MLP matrices, as in DeepNorm's FFN (SwiGLU: the linear branch, not silu's)
                    first = block.mlp.c_up if c.mlp == 'swiglu' else block.mlp.c_fc
                    for m in (block.attn.c_proj, first, block.mlp.c_proj):
                        m.weight.mul_((8 * depth) ** -0.5)

    def sampled_depth(self, seed, step):
        """The loop count training step `step` trains at: K, or a drawn one (sampled_depth, below)."""
        return sampled_depth(self.config, seed, step)

    # ---- the seams, in the order a forward pass meets them

    def embed(self, idx):
        """h_0 = e: LoopedGPT's embedding, then the prelude's layers, (B, T) -> (B, T, C)."""
        h = super().embed(idx)
        for block in self.prelude:
            h = block(h)
        return h

    def inject(self, h, e):
        """Input injection of the embedding e into the carried state h, (B, T, C) each: 'add' h + e; 'concat'
        W [h; e] = W_h h + W_e e (W = [I | 0] at init); 'diagonal' Parcae's decay * h + Delta * B e."""
        if self.config.injection == 'add':
            return h + e
        if self.config.injection == 'diagonal':
            return self.diagonal(h, e)
        return self.adapter(torch.cat([h, e], dim=-1))

    def loop_pass(self, h, e, k, n_loop):
        """Pass k of n_loop: truncated backprop's cut, the injection, the stack (LoopedGPT's), the 1/K update."""
        c = self.config
        if c.bptt and k == n_loop - c.bptt + 1 and k > 1:
            h = h.detach()              # truncated backprop: the later losses stop here
        x = h if c.injection == 'none' else self.inject(h, e)         # what pass k runs on
        h = super().loop_pass(x, e, k, n_loop)                        # (B, T, C)
        if c.residual_scale == 'inverse_k':
            h = x + (h - x) / c.n_loop  # the update shrunk by 1/K, K the trained count
        return h

    def carry(self, h):
        if self.damping is not None:
            return torch.sigmoid(self.damping) * h  # 'damped': the next pass starts from sigmoid(a) h_k
        return super().carry(h)

    def exit_input(self, h, k):
        """What the LM head reads of h_k (B, T, C) at loop k: the coda's layers, then the readout."""
        for block in self.coda:
            h = block(h)
        return super().exit_input(h, k)

    def loop_loss(self, h, k, targets, reduction='mean'):
        # gated weighs each token's cross-entropy by its own p_k
        return super().loop_loss(h, k, targets, 'none' if self.exit_gate is not None else reduction)

    def forward(self, idx, targets=None, n_loop=None):
        if targets is None or (self.exit_gate is None and self.config.jacobian_penalty == 0):
            return super().forward(idx, targets, n_loop)
        return self.designed_forward(idx, targets, n_loop)

    def designed_forward(self, idx, targets, n_loop=None):
        """forward in training under gated supervision or the Jacobian penalty: LoopedGPT's, with each loop's gate
        logit taken right after its cross-entropy (the order the committed gate runs were trained in: the gradients
        that reach h_k are summed in the order its uses were made, and float sums depend on it), and STARS's term
        from h_K and e. Gated adds to stats 'exit_prob' and 'gate_logit' (n_loop,), the mean p_k and |gate logit|
        (the last gate has no effect: p_K is the mass left)."""
        K, gated = n_loop or self.config.n_loop, self.exit_gate is not None
        if idx.size(1) > self.config.block_size:
            raise ValueError(f"sequence of length {idx.size(1)} is longer than block_size={self.config.block_size}")
        e = self.embed(idx)
        states, ces, gates = [], [], []
        for k, h in self.loops(e, K):
            states.append(h)
            if k < K:  # as in LoopedGPT.forward: recomputed in backward, not kept
                ce = checkpoint(self.loop_loss, h, k, targets, use_reentrant=False)[1]  # (B * T,)
            else:
                logits, ce = self.loop_loss(h, k, targets)
            ces.append(ce)
            if gated:
                gates.append(self.gate_logit(h, k))                   # (B, T)
        stats = {'hidden_norm': torch.stack([h.detach().float().norm(dim=-1).mean() for h in states]),
                 'ce': torch.stack([ce.detach().mean() for ce in ces])}
        if not gated:  # LoopedGPT's loss
            return logits, self.add_jacobian_penalty(self.training_loss(ces, states), states[-1], e, stats), stats
        loss, p = self.gated_loss(ces, gates)
        stats['exit_prob'] = p.detach().mean(dim=1)                   # (n_loop,): mean p_k
        stats['gate_logit'] = torch.stack(gates).detach().abs().mean(dim=(1, 2))  # its scale
        if self.config.norm_penalty > 0:
            loss = loss + self.penalty_loss(states)
        return logits, self.add_jacobian_penalty(loss, states[-1], e, stats), stats

    # ---- gated supervision and its exit gate (Ouro's)

    def gate_logit(self, h, k):
        """Loop k's exit-gate logit, (B, T, C) -> (B, T): of h_k itself ('raw', as the authors' gate, which sees the
        scale), or of what the head reads ('readout', which may not)."""
        x = h if self.config.gate_input == 'raw' else self.exit_input(h, k)
        return self.exit_gate(x).squeeze(-1).float()

    def exit_distribution(self, gate_logits):
        """Ouro's exit distribution from the gate's logits (n, ...) of loops 1..n: p_k = lambda_k * prod_{j<k}
        (1 - lambda_j) with lambda = sigmoid(logit), and the last loop takes the mass left, so p sums to 1 over k
        for every token. Returns (n, ...)."""
        lam = torch.sigmoid(gate_logits.float())
        left = torch.cumprod(1 - lam, dim=0)                          # prod_{j<=k} (1 - lambda_j)
        before = torch.cat([torch.ones_like(left[:1]), left[:-1]])    # prod_{j<k}
        return torch.cat([(lam * before)[:-1], before[-1:]])

    def gated_loss(self, ces, gate_logits):
        """Gated supervision: sum_k p_k CE_k - beta H(p) per token, averaged over the tokens, from every loop's
        per-token cross-entropy (B * T,) and gate logits (B, T). The entropy keeps the gate from putting all its
        mass on one loop. Every target counts (no ignore_index -1 here, which no dataset of this repository
        produces). Returns (loss, p (n, B * T))."""
        p = self.exit_distribution(torch.stack([g.flatten() for g in gate_logits]))
        entropy = -(p * p.clamp_min(1e-12).log()).sum(0)              # (B * T,)
        loss = (p * torch.stack(ces)).sum(0) - self.config.gate_beta * entropy
        return loss.mean(), p

    # ---- STARS's Jacobian penalty

    def add_jacobian_penalty(self, loss, h, e, stats):
        """loss + w * ||v^T J||^2 at h = h_K, as STARS, when the penalty is on; the estimate goes to
        stats['jacobian']."""
        if self.config.jacobian_penalty > 0 and torch.is_grad_enabled():
            stats['jacobian'] = jac = self.pass_jacobian(h, e)
            loss = loss + self.config.jacobian_penalty * jac ** 2
        return loss

    def pass_jacobian(self, h, e):
        """STARS's one-step estimate of a pass's spectral norm at h (B, T, C): ||v^T J||, v a random unit vector,
        J one pass's Jacobian; h detached: the gradient reaches the weights."""
        x = h.detach().requires_grad_()
        with sdpa_kernel(SDPBackend.MATH):  # the fused attention kernels have no double backward
            out = self.loop_pass(x, e.detach(), 1, 1)                  # one pass from x: (B, T, C)
        v = torch.randn_like(out)
        (vJ,) = torch.autograd.grad(out, x, v / v.norm(), create_graph=True)
        return vJ.float().norm()

    # ---- counting and optimizing

    def flops_per_token(self, n_loop=None):
        """Training FLOPs per token: 6 per use of a matrix's weight (forward and backward) plus attention's 12 *
        layers * d * T (nanoGPT's count); vectors (norm gains, Parcae's decay) are elementwise work, not counted.
        `uses` says how often a token runs each module that holds a matrix; one missing from it is an error, so a
        new design must say. The Jacobian penalty's extra pass is counted as one more pass (its double backward
        costs somewhat more)."""
        c, K = self.config, n_loop or self.config.n_loop
        readouts = 1 if c.supervision == 'terminal' else K
        passes = K + (c.jacobian_penalty > 0)
        uses = {'blocks': passes, 'adapter': passes, 'diagonal': passes, 'prelude': 1,
                'coda': readouts, 'exit_gate': K, 'wte': 0, 'wpe': 0,
                'lm_head': 0}  # lm_head: below, tied or not
        unknown = [n for n, p in self.named_parameters() if p.dim() >= 2 and n.split('.')[0] not in uses]
        if unknown:
            raise ValueError(f"flops_per_token: no count for {', '.join(unknown)}; add its module to uses")
        n_uses = sum(uses[name] * sum(p.numel() for p in m.parameters() if p.dim() >= 2)
                     for name, m in self.named_children() if name in uses)
        layers = passes * c.n_layer + c.n_prelude + readouts * c.n_coda
        head = readouts * c.vocab_size * c.n_embd
        return 6 * n_uses + 6 * head + 12 * layers * c.n_embd * c.block_size

    def configure_optimizers(self, weight_decay, learning_rate, device_type):
        # the authors decay every parameter (LoopedGPT's); GPT-2's recipe (gpt2) only matrices. A design whose
        # source exempts its own parameters lists them here: decay would pull Parcae's B to 0, not to the identity
        params = [p for p in self.parameters() if p.requires_grad]
        exempt = {id(p) for p in (self.diagonal.parameters() if self.diagonal else [])}
        decays = lambda p: id(p) not in exempt and (self.config.init != 'gpt2' or p.dim() >= 2)
        groups = [{'params': [p for p in params if decays(p)], 'weight_decay': weight_decay},
                  {'params': [p for p in params if not decays(p)], 'weight_decay': 0.0}]
        groups = [g for g in groups if g['params']]  # paper init, no diagonal: LoopedGPT's one group
        return torch.optim.AdamW(groups, lr=learning_rate, fused=(device_type == 'cuda'))


def sampled_depth(config, seed, step):
    """The loop count that training step `step` trains at: K, or under 'poisson_lognormal' looped_nanochat's draw
    tau ~ N(ln(K - 1) - sigma^2 / 2, sigma), r = Poisson(e^tau) + 1, sigma = 0.5, clamped to [1, 2K]; r has mean K
    before the clamp. It depends on (seed, step) alone, so every process and a resumed run draw the same r."""
    K = config.n_loop
    if config.depth_sampling == 'fixed' or K == 1:
        return K
    rng, sigma = np.random.default_rng([seed, step]), 0.5
    tau = rng.normal(math.log(K - 1) - sigma ** 2 / 2, sigma)
    return int(min(max(rng.poisson(math.exp(tau)) + 1, 1), 2 * K))


# ---- the designs, one entry each: everything the lab derives a design's flags, names, log and atlas from

# A design field's flag (each DesignConfig field that LoopedConfig lacks): its help in --help's designs group, one
# value off its default (the value the tests train it at, alone; a text field's is one of its CHOICES); for a
# True/False field the words a condition's name says it with (label: ' + <label>' when on, ' + no <label>' when
# off; unset: the field's name); the run folder's tag ('prelude' makes prelude1; unset: '<field>_'), and the
# condition's part, a format string of the value (part; unset: ' + <tag><value>'). Its type, default and choices
# are the field's own.
Flag = namedtuple('Flag', 'help example label tag part', defaults=(None, None, None))
# What a design learns or estimates, logged at every evaluation under key and shown in the eval line by show (a
# format string of the value's numbers, or a function of the value): read(model) reads it off the model (None:
# the design is off); without read, it is the validation forward's stats[key], run when on(model) (grad: that
# forward needs gradients, as STARS's estimate does).
Logged = namedtuple('Logged', 'key show read on grad', defaults=(None, None, False))
# The atlas's prediction for a design, written before its runs (lab/atlas.py sets it beside its measurement): is
# the scale carried from loop to loop (||h_K|| / ||h_1|| > 1.5 under rmsnorm), is ||h_K|| large (> 100) or small
# under the rmsnorm readout and under raw, and why.
Prediction = namedtuple('Prediction', 'carried rmsnorm raw why')
# One design: its python -m lab.train flags; the fields it adds, each with its Flag (a field shared by several
# designs, such as block, belongs to the first); its atlas prediction (None: not in the atlas); what it logs; exact:
# whether at init, with the default's weights, it computes the default's logits and loss bit for bit
# (the design tests check it); pinned: the pinned-math test's cases {name: fields} (None: one case
# named as the design, of its flags' fields; {}: none).
Design = namedtuple('Design', 'flags fields predicted logs exact pinned', defaults=({}, None, (), False, None))


def _decay(model):
    diagonal = getattr(model, 'diagonal', None)  # Parcae's per-channel decay of the carried state
    decay = diagonal.coefficients()[1].detach() if diagonal is not None else None
    return None if decay is None else [decay.mean().item(), decay.min().item(), decay.max().item()]


def _damping(model):  # the factor the carried state is damped by between passes
    damping = getattr(model, 'damping', None)
    return None if damping is None else torch.sigmoid(damping).item()


def _numbers(name, digits):
    return lambda values: f"{name} {' '.join(f'{v:.{digits}f}' for v in values)}"


# In the atlas's order (its tables' rows; a new design goes last), then the designs it does not ask.
DESIGNS = {
    'residual': Design([], predicted=Prediction(True, 'large', 'small', 'pre-norm residual: pass k+1 starts from '
                                                'h_k, scale and all'), exact=True, pinned={}),
    'normed': Design(['--recurrence=normed'], pinned={}, predicted=Prediction(
        False, 'large', 'small', 'RMSNorm between passes removes the carried scale, but one pass can still grow its '
        'output where the readout hides it (the paper grid: 518 at step 200)')),
    'sandwich': Design(['--block=sandwich'], {'block': Flag(
        'each sublayer x + f(norm(x)), sandwich, or deepnorm: norm(a x + f(x))', 'deepnorm')}, Prediction(
        False, 'small', 'small', 'every layer ends in a norm: ||h_k|| = the RMS of its gain times sqrt(d)')),
    'sandwich + normed': Design(['--block=sandwich', '--recurrence=normed'], pinned={}, predicted=Prediction(
        False, 'small', 'small', 'as sandwich; the inter-loop norm has nothing left to remove')),
    'add': Design(['--injection=add'], {'injection': Flag(
        'what a pass runs on: h, h + e, W [h; e], or decay * h + Delta * B e', 'diagonal')}, Prediction(
        True, 'large', 'small', "h + e keeps h's scale and adds e's at every pass")),
    'concat': Design(['--injection=concat'], exact=True, predicted=Prediction(
        True, 'large', 'small', 'W [h; e] starts as the identity on h, so it carries the scale as residual does')),
    'prelude1 + coda1': Design(['--n_prelude=1', '--n_coda=1'], {
        'n_prelude': Flag('unshared layers run once on the embedding, before the loop', 1, tag='prelude'),
        'n_coda': Flag('unshared layers between every h_k and its readout', 1, tag='coda')}, Prediction(
        True, 'large', 'small', 'the core is a pre-norm loop; a pre-norm coda keeps the scale, so raw still sees it'),
        pinned={'prelude coda': {'n_prelude': 1, 'n_coda': 1}}),
    'sampled depth': Design(['--depth_sampling=poisson_lognormal'], {'depth_sampling': Flag(
        'training only: K loops every step, or a drawn count of mean K', 'poisson_lognormal')}, Prediction(
        True, 'large', 'small', 'the loop is unchanged; only the count varies'), exact=True),
    'bptt1': Design(['--bptt=1'], {'bptt': Flag("the last exit's loss reaches the last bptt passes only; 0: all", 1,
                                                tag='bptt')}, Prediction(
        True, 'large', 'small', "the forward pass is unchanged; each pass still has its own readout's gradient"),
        exact=True, pinned={'bptt': {'bptt': 1}}),
    'update / K': Design(['--residual_scale=inverse_k'], {'residual_scale': Flag(
        "inverse_k: each pass's update scaled by 1/K", 'inverse_k')}, Prediction(
        True, 'large', 'small', 'each update is shrunk by 1/K, but the state is still carried and its scale still '
        'invisible to rmsnorm, so the growth is slowed, not stopped')),
    # looped_nanochat's loop at this size: prelude and coda around the core, concat injection, sandwich layers, a
    # norm after every loop, the sampled loop count; its bptt_k = 4 is left out (at K = 4 it would truncate only
    # the steps whose drawn count exceeds 4). Its recipe is not: no zero-initialized output projections, no
    # N(0, 0.001) untied head, no norm after the embedding, no logit cap, no Muon (the init is the atlas's --init)
    'looped_nanochat': Design(['--n_prelude=1', '--n_coda=1', '--injection=concat', '--block=sandwich',
                               '--recurrence=normed', '--depth_sampling=poisson_lognormal'], predicted=Prediction(
        False, 'small', 'small', 'sandwich layers and a norm after every loop'),
        pinned={'nanochat': {'n_prelude': 1, 'n_coda': 1, 'injection': 'concat', 'block': 'sandwich',
                             'recurrence': 'normed', 'init': 'gpt2'}}),
    # The 2026 designs that bound the recurrence (predictions committed before their runs). A bound on
    # what is carried is not a bound on what each pass adds: under gpt2's init residual's own ratio is 1.49, so
    # most of ||h_K|| is grown inside a pass, where a decay between passes cannot reach it
    'diagonal': Design(['--injection=diagonal'], predicted=Prediction(
        False, 'large', 'small', "Parcae's decay (0.447 at init, bounded below 1) shrinks the carried state at every "
        "pass, but each pass's own pre-norm update still grows where rmsnorm hides it"),
        logs=(Logged('decay', 'decay mean {:.3f} min {:.3f} max {:.3f}', _decay),)),
    'damped': Design(['--recurrence=damped'], predicted=Prediction(
        True, 'large', 'small', 'sigmoid(a) = 0.88 carries 88% of the scale from pass to pass and nothing '
        'renormalizes it; residual itself sits at the 1.5 line under gpt2, so there the verdict is a coin flip'),
        logs=(Logged('damping', 'damping {:.3f}', _damping),)),
    'deepnorm': Design(['--block=deepnorm'], predicted=Prediction(
        False, 'small', 'small', 'Post-LN ends every sublayer in a norm: ||h_k|| = sqrt(d) times the RMS of the last '
        'gain, as in sandwich, under any readout')),
    'jacobian': Design(['--jacobian_penalty=0.1'], {'jacobian_penalty': Flag(
        "w in w * ||v^T J||^2, J one pass's Jacobian (STARS)", 0.1, tag='jac')}, Prediction(
        True, 'large', 'small', 'J = I + J_f and J_f shrinks like 1 / ||h||: a large state makes the pass look like '
        'the identity, so the penalty cannot see the scale (and may favour it)'),
        logs=(Logged('jacobian', '||vJ|| {:.3f}', on=lambda m: getattr(m.config, 'jacobian_penalty', 0) > 0,
                     grad=True),)),
    # Parcae's own loop at this size: prelude and coda around a diagonal-injection core. Its small model is prelude
    # 2, core 2, coda 2, a mean recurrence of 8 with the last 4 passes backpropagated; here one layer each around
    # the 2-layer core at K = 4 (its truncation to 4 passes does nothing at K = 4, and its depth sampling is left
    # out since its distribution was not read)
    'parcae': Design(['--n_prelude=1', '--n_coda=1', '--injection=diagonal'], predicted=Prediction(
        False, 'large', 'small', 'as diagonal; a pre-norm coda keeps the scale, so raw still sees it'),
        pinned={'parcae': {'n_prelude': 1, 'n_coda': 1, 'injection': 'diagonal', 'readout': 'raw'}}),
    # not in the atlas: Ouro's gate (its own grid, lab/grid.py's GATE), the initializations, GPT-2's MLP, the
    # attention spelled out
    'gated': Design(['--supervision=gated'], {
        'gate_input': Flag("gated: the exit gate reads h_k itself (the authors') or the readout", 'readout',
                           tag='gate_'),
        'gate_beta': Flag('gated: beta in sum_k p_k CE_k - beta H(p); H <= ln 4 = 1.39 at K = 4', 0.2, tag='beta')},
        logs=(Logged('exit_prob', _numbers('exit p', 3), on=lambda m: getattr(m, 'exit_gate', None) is not None),
              Logged('gate_logit', _numbers('|gate logit|', 1),
                     on=lambda m: getattr(m, 'exit_gate', None) is not None)),
        pinned={'gated': {'supervision': 'gated'},
                'gated readout': {'supervision': 'gated', 'gate_input': 'readout', 'gate_beta': 0.3}}),
    'gpt2 init': Design(['--init=gpt2'], {'init': Flag(
        "the authors', GPT-2's (head untied), or paper with small embeddings", 'gpt2', part=' ({v} init)')},
        pinned={'gpt2': {'init': 'gpt2'}, 'small embed': {'init': 'paper_small_embed'}}),
    'gelu': Design(['--mlp=gelu'], {'mlp': Flag('SwiGLU (the paper) or GELU (GPT-2), hidden width 4d', 'gelu')}),
    'manual attention': Design(['--attention=manual'], {'attention': Flag(
        'fused kernels (sdpa), or the same math spelled out (manual)', 'manual')},
        pinned={'manual': {'attention': 'manual'}}),
}
# every design field's Flag, in DesignConfig's order (--help's)
_FLAGS = {name: flag for d in DESIGNS.values() for name, flag in d.fields.items()}
DESIGN_FLAGS = {f.name: _FLAGS[f.name] for f in fields(DesignConfig)
                if f.name in _FLAGS and f.name not in {f.name for f in fields(LoopedConfig)}}
# the paper's flags that take a design's value too (train.py's --supervision and --recurrence), with theirs
PAPER_FLAG_EXAMPLES = {'supervision': 'gated', 'recurrence': 'damped'}


def design_logs(designs=DESIGNS):
    """What every design logs (Logged), in DESIGNS' order: the log's keys and the eval line's parts."""
    return [log for d in designs.values() for log in d.logs]


def pinned_cases(designs=DESIGNS):
    """The pinned-math test's cases of the designs, {case name: the fields it sets}: each design's pinned,
    or one case named as the design of the fields its flags set."""
    cases = {}
    for name, d in designs.items():
        if d.pinned is None:
            values, defaults = flag_values(d.flags), flag_values([])
            cases[name] = {k: v for k, v in values.items() if v != defaults[k]}
        else:
            cases.update(d.pinned)
    return cases


def design_examples(flags=DESIGN_FLAGS):
    """{flag: one value off its default} for every flag that asks for a design alone: each design flag's
    example, then --supervision=gated and --recurrence=damped."""
    return {**{name: flag.example for name, flag in flags.items()}, **PAPER_FLAG_EXAMPLES}


def design_fields(config=DesignConfig):
    """config's fields that LoopedConfig lacks: the designs' own, each a flag of add_design_flags."""
    paper = {f.name for f in fields(LoopedConfig)}
    return [f for f in fields(config) if f.name not in paper]


def add_design_flags(parser, config=DesignConfig, flags=DESIGN_FLAGS):
    """The designs' flags, one per design field of config (its entry in flags: help), each default the field's
    own; a text field takes its CHOICES, a number its type, a True/False field plumbing/run.py's boolean (--x, --x=1,
    --x=True, --x=False, as train.py's own True/False flags). The paper's --supervision and --recurrence, in
    train.py, also take gated and damped. ValueError for a design field without an entry in flags."""
    missing = [f.name for f in design_fields(config) if f.name not in flags]
    if missing:
        raise ValueError(f"lab/designs.py: give {', '.join(missing)} an entry in DESIGN_FLAGS (help, example)")
    g = parser.add_argument_group("the field's designs", "any of these off its default trains lab/designs.py's "
                                  "DesignedGPT, the extension of looped.py's LoopedGPT")
    for f in design_fields(config):
        kind, help = field_type(config, f.name), flags[f.name].help
        if kind is bool:
            g.add_argument('--' + f.name, type=boolean, nargs='?', const=True, default=f.default, help=help)
        elif kind is str:
            g.add_argument('--' + f.name, choices=CHOICES.get(f.name), default=f.default, help=help)
        else:
            g.add_argument('--' + f.name, type=kind, default=f.default, help=help)
    return g


def field_type(config, name):
    """The type a config field's flag reads its text as: the field's own (bool, int, float, str), the inner one
    of an Optional field (alpha: float, tie_weights: bool). ValueError for a name that is not a field."""
    hints = typing.get_type_hints(config)
    if name not in hints:
        raise ValueError(f"--{name} is not a field of {config.__name__}")
    inner = [t for t in typing.get_args(hints[name]) if t is not type(None)]
    return inner[0] if inner else hints[name]


def flag_values(flags, config=DesignConfig):
    """{field: value} of config's fields: their defaults, but for each flag ('--name=value', or '--name' alone
    for a True/False field) read as train.py's parser reads it: a True/False field by plumbing/run.py's boolean
    (True/False/1/0/yes/no, the bare flag True), any other by its type. ValueError for a flag it cannot read."""
    values = {f.name: f.default for f in fields(config)}
    for flag in flags:
        name, given, text = flag[2:].partition('=')
        kind = field_type(config, name)
        if not given and kind is not bool:
            raise ValueError(f"--{name} needs a value (--{name}=...)")
        try:
            values[name] = (boolean(text) if given else True) if kind is bool else kind(text)
        except Exception as e:  # argparse's ArgumentTypeError (boolean), or int's and float's ValueError
            raise ValueError(f"{flag}: {e}") from None
    return values


def designs_asked(args):
    """Whether train.py's flags ask for a design, and so for DesignedGPT: one of add_design_flags' flags off its
    default, --supervision=gated or --recurrence=damped."""
    return (args.supervision not in PAPER_CHOICES['supervision']
            or args.recurrence not in PAPER_CHOICES['recurrence']
            or any(getattr(args, f.name) != f.default for f in design_fields()))
