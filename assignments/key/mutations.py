"""
The mutation suite (instructors only; make_student.py leaves assignments/key/ out of the student copy, because
every mutation quotes a line of the reference solution). Each entry is a known wrong implementation of one
assignment: a line (or block) of the reference code and its wrong replacement. Each is written into a scratch
copy of the repository, and the assignment's grader must fail on it; the reference itself must pass.

    python assignments/key/mutations.py                 # every mutation; prints one JSON line each, then a summary
    python assignments/key/mutations.py --only=a3,a7    # just these assignments

The graders run in this one process (pytest.main, with every module of the scratch copy re-imported each time),
so torch is imported once; the 116 mutations, with --stubs, in the two halves the instructor check runs side by
side, took 54 s and 78 s on a 2-core machine that ran several other jobs (load average 6 to 7).
tests/test_course_kit.py runs it and requires every mutation to be caught by a failing test (not by an import
or collection error), and every entry that names a hint to be caught with that hint in the first failure.
"""

import argparse
import glob
import importlib
import json
import os
import shutil
import sys
import tempfile
import time

sys.dont_write_bytecode = True  # a mutated file must never be read back from a stale .pyc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (assignment, file, what the mistake is, reference text, wrong text[, the hint its grader must give]): where a
# hint is given, the first failure's message must contain it (the grader names the mistake in its own words)
MUTATIONS = [
    # ---- A1: RMSNorm.forward, Readout.forward ----
    ('a1', 'looped.py', 'eps outside the square root',
     'torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)',
     '1 / (xf.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)'),
    ('a1', 'looped.py', 'no upcast: squares computed in the input dtype',
     'xf = x.to(torch.promote_types(x.dtype, torch.float32))', 'xf = x'),
    ('a1', 'looped.py', '.float() upcast, which lowers a float64 input',
     'xf = x.to(torch.promote_types(x.dtype, torch.float32))', 'xf = x.float()'),
    ('a1', 'looped.py', 'the gain forgotten',
     'return (xf * rms_inv * self.weight).type_as(x)', 'return (xf * rms_inv).type_as(x)'),
    ('a1', 'looped.py', 'sum of squares instead of the mean',
     'torch.rsqrt(xf.pow(2).mean(-1, keepdim=True)', 'torch.rsqrt(xf.pow(2).sum(-1, keepdim=True)'),
    ('a1', 'looped.py', 'the output left in float32 (no cast back)',
     'return (xf * rms_inv * self.weight).type_as(x)', 'return xf * rms_inv * self.weight'),
    ('a1', 'looped.py', 'final_norm normalizes from K - 1 on (off by one)',
     "if self.kind == 'final_norm' and k < self.n_loop:", "if self.kind == 'final_norm' and k < self.n_loop - 1:"),
    ('a1', 'looped.py', 'final_norm normalizes only at exactly K, not beyond',
     "if self.kind == 'final_norm' and k < self.n_loop:", "if self.kind == 'final_norm' and k != self.n_loop:"),
    ('a1', 'looped.py', 'final_norm normalizes at every loop (the k < K rule left out)',
     "if self.kind == 'final_norm' and k < self.n_loop:", "if False:"),
    ('a1', 'looped.py', 'the mean of squares over all dimensions instead of per token',
     'torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)', 'torch.rsqrt(xf.pow(2).mean() + self.eps)'),
    # ---- A2: rmsnorm_radial_grad ----
    ('a2', 'lab/diagnose.py', 'returns zeros (the "it is zero" answer)',
     'return S / r2.sqrt() * eps / r2', 'return torch.zeros_like(S)'),
    ('a2', 'lab/diagnose.py', 'r instead of r^2 in the eps factor',
     'return S / r2.sqrt() * eps / r2', 'return S / r2.sqrt() * eps / r2.sqrt()'),
    ('a2', 'lab/diagnose.py', 'sum of squares instead of the mean in r^2',
     'r2 = h.pow(2).mean(-1) + eps', 'r2 = h.pow(2).sum(-1) + eps'),
    ('a2', 'lab/diagnose.py', 'the gain left out of S',
     'S = (weight * grad_y * h).sum(-1)', 'S = (grad_y * h).sum(-1)'),
    ('a2', 'lab/diagnose.py', 'r^2 instead of r in the first factor',
     'return S / r2.sqrt() * eps / r2', 'return S / r2 * eps / r2'),
    ('a2', 'lab/diagnose.py', 'eps dropped from r^2',
     'r2 = h.pow(2).mean(-1) + eps', 'r2 = h.pow(2).mean(-1)'),
    # ---- A3: LoopedGPT.loops, LoopedGPT.carry ----
    ('a3', 'looped.py', 'a list instead of a generator (all passes run before the first is used)',
     '''        h = e
        for k in range(1, n_loop + 1):''',
     '''        return list(self._all_passes(e, n_loop))

    def _all_passes(self, e, n_loop):
        h = e
        for k in range(1, n_loop + 1):'''),
    ('a3', 'looped.py', 'the carried state yielded (the normed state is read out and penalized)',
     '            yield k, h\n', '            yield k, self.carry(h)\n'),
    ('a3', 'looped.py', 'a carry before pass 1 too (an inter-loop norm of the embedding)',
     '            if k > 1:\n', '            if k >= 1:\n'),
    ('a3', 'looped.py', 'yield, then carry: a carry after the last pass too (an inter-loop norm nothing uses)',
     '''            if k > 1:
                h = self.carry(h)                     # what pass k starts from: no carry before 1
            h = self.loop_pass(h, e, k, n_loop)       # (B, T, C): the stack, once
            yield k, h
''',
     '''            h = self.loop_pass(h, e, k, n_loop)       # (B, T, C): the stack, once
            yield k, h
            h = self.carry(h)
'''),
    ('a3', 'looped.py', 'no carry before pass 2 (the first carry one pass late)',
     '            if k > 1:\n', '            if k > 2:\n'),
    ('a3', 'looped.py', "loops normalizes by itself instead of calling carry (a design's carry never runs)",
     'h = self.carry(h)', 'h = h if self.inter_norm is None else self.inter_norm(h)'),
    ('a3', 'looped.py', 'carry never called (normed recurrence carries the state unnormalized)',
     'h = self.carry(h)', 'h = h'),
    ('a3', 'looped.py', 'loops detaches what it hands carry (the loss stays right)',
     'h = self.carry(h)', 'h = self.carry(h.detach())'),
    ('a3', 'looped.py', 'every pass starts from e (the state is never carried)',
     'h = self.loop_pass(h, e, k, n_loop)', 'h = self.loop_pass(e, e, k, n_loop)'),
    ('a3', 'looped.py', 'carry that never normalizes under normed recurrence',
     'return h if self.inter_norm is None else self.inter_norm(h)', 'return h'),
    ('a3', 'looped.py', 'carry detaches the normed state',
     'return h if self.inter_norm is None else self.inter_norm(h)',
     'return h if self.inter_norm is None else self.inter_norm(h.detach())'),
    ('a3', 'looped.py', 'carry detaches the residual state (the loss stays right)',
     'return h if self.inter_norm is None else self.inter_norm(h)',
     'return h.detach() if self.inter_norm is None else self.inter_norm(h)'),
    ('a3', 'looped.py', "carry normalizes without the norm's gain",
     'return h if self.inter_norm is None else self.inter_norm(h)',
     'return h if self.inter_norm is None else h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)'),
    ('a3', 'looped.py', 'stops at the trained K',
     'for k in range(1, n_loop + 1):', 'for k in range(1, min(n_loop, self.config.n_loop) + 1):'),
    ('a3', 'looped.py', 'loops hands loop_pass one pass index (truncated backprop would never cut)',
     'self.loop_pass(h, e, k, n_loop)', 'self.loop_pass(h, e, 1, n_loop)'),
    ('a3', 'looped.py', 'a 0-based pass index (truncated backprop would cut one pass late)',
     'self.loop_pass(h, e, k, n_loop)', 'self.loop_pass(h, e, k - 1, n_loop)'),
    ('a3', 'looped.py', 'loop_pass told the trained K, not the loops asked for',
     'self.loop_pass(h, e, k, n_loop)', 'self.loop_pass(h, e, k, self.config.n_loop)'),
    ('a3', 'looped.py', "loop_pass handed the carried state as e (an injection would add h to itself)",
     'self.loop_pass(h, e, k, n_loop)', 'self.loop_pass(h, h, k, n_loop)'),
    # ---- A4: LoopedGPT.supervision_loss ----
    ('a4', 'looped.py', 'sum instead of mean',
     'return torch.stack(ces).mean()', 'return torch.stack(ces).sum()'),
    ('a4', 'looped.py', 'detached mean (right value, no gradient)',
     'return torch.stack(ces).mean()',
     'return torch.tensor(sum(c.item() for c in ces) / len(ces), requires_grad=True)'),
    ('a4', 'looped.py', 'terminal supervision on the first loop',
     '''            return torch.stack(ces).mean()
        return ces[-1]''', '''            return torch.stack(ces).mean()
        return ces[0]'''),
    ('a4', 'looped.py', 'the mean whatever the supervision',
     "if self.config.supervision == 'per_loop':\n            return torch.stack(ces).mean()",
     "if True:\n            return torch.stack(ces).mean()"),
    ('a4', 'looped.py', 'the mean over loops 1..K-1 (the last loop left out)',
     'return torch.stack(ces).mean()', 'return torch.stack(ces[:-1]).mean()'),
    ('a4', 'looped.py', 'terminal loss detached',
     '''            return torch.stack(ces).mean()
        return ces[-1]''', '''            return torch.stack(ces).mean()
        return ces[-1].detach().requires_grad_()'''),
    # ---- A5: LoopedGPT.penalty_loss ----
    ('a5', 'looped.py', 'squared L2 norm instead of the mean square',
     '[h.float().pow(2).mean() for h in states]', '[h.float().pow(2).sum() for h in states]'),
    ('a5', 'looped.py', 'sum over loops instead of the mean',
     'return self.config.norm_penalty * mean_squares.mean()',
     'return self.config.norm_penalty * mean_squares.sum()'),
    ('a5', 'looped.py', 'the RMS instead of the mean square',
     '[h.float().pow(2).mean() for h in states]',
     '[h.float().pow(2).mean().sqrt() for h in states]'),
    ('a5', 'looped.py', 'lambda left out',
     'return self.config.norm_penalty * mean_squares.mean()', 'return mean_squares.mean()'),
    ('a5', 'looped.py', 'the states detached',
     '[h.float().pow(2).mean() for h in states]', '[h.detach().float().pow(2).mean() for h in states]',
     'the penalty must stay in the autograd graph'),
    ('a5', 'looped.py', 'the penalty detached',
     'return self.config.norm_penalty * mean_squares.mean()',
     'return self.config.norm_penalty * mean_squares.mean().detach()',
     'the penalty must stay in the autograd graph'),
    ('a5', 'looped.py', 'the penalty returned as a float (.item())',
     'return self.config.norm_penalty * mean_squares.mean()',
     'return self.config.norm_penalty * mean_squares.mean().item()',
     'the penalty must stay in the autograd graph'),
    ('a5', 'looped.py', 'a float returned at lambda = 0',
     '        return self.config.norm_penalty * mean_squares.mean()',
     '''        if self.config.norm_penalty == 0:
            return 0.0
        return self.config.norm_penalty * mean_squares.mean()''',
     'return a tensor, also at lambda = 0'),
    ('a5', 'looped.py', 'only the last state penalized',
     'return self.config.norm_penalty * mean_squares.mean()',
     'return self.config.norm_penalty * mean_squares[-1:].mean()'),
    ('a5', 'looped.py', 'the mean absolute value instead of the mean square',
     '[h.float().pow(2).mean() for h in states]', '[h.float().abs().mean() for h in states]'),
    # ---- A6: AlphaNorm.forward ----
    ('a6', 'looped.py', 's not clamped at eps',
     's = hf.pow(2).mean(-1, keepdim=True).clamp_min(self.eps ** 2).sqrt()',
     's = hf.pow(2).mean(-1, keepdim=True).sqrt()'),
    ('a6', 'looped.py', 's clamped after the square root (a zero state: finite output, nan gradient)',
     's = hf.pow(2).mean(-1, keepdim=True).clamp_min(self.eps ** 2).sqrt()',
     's = hf.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(self.eps)', 'clamp the mean of squares'),
    ('a6', 'looped.py', '.float() upcast, which lowers a float64 input',
     'hf = h.to(torch.promote_types(h.dtype, torch.float32))', 'hf = h.float()'),
    ('a6', 'looped.py', 'alpha and 1 - alpha swapped',
     'torch.exp((1 - self.alpha()) * (self.log_s_ref - s.log()))',
     'torch.exp(self.alpha() * (self.log_s_ref - s.log()))'),
    ('a6', 'looped.py', 's_ref left out',
     'torch.exp((1 - self.alpha()) * (self.log_s_ref - s.log()))', 'torch.exp((1 - self.alpha()) * (-s.log()))'),
    ('a6', 'looped.py', 'alpha detached',
     'torch.exp((1 - self.alpha()) * (self.log_s_ref - s.log()))',
     'torch.exp((1 - self.alpha().detach()) * (self.log_s_ref - s.log()))'),
    ('a6', 'looped.py', 's as the L2 norm instead of the RMS',
     's = hf.pow(2).mean(-1, keepdim=True).clamp_min(self.eps ** 2).sqrt()',
     's = hf.pow(2).sum(-1, keepdim=True).clamp_min(self.eps ** 2).sqrt()'),
    ('a6', 'looped.py', 's_ref detached (log s_ref never learns)',
     'torch.exp((1 - self.alpha()) * (self.log_s_ref - s.log()))',
     'torch.exp((1 - self.alpha()) * (self.log_s_ref.detach() - s.log()))'),
    ('a6', 'looped.py', 's as the mean absolute value instead of the RMS',
     's = hf.pow(2).mean(-1, keepdim=True).clamp_min(self.eps ** 2).sqrt()',
     's = hf.abs().mean(-1, keepdim=True).clamp_min(self.eps)'),
    # ---- A7: exit_passes, exit_depths, calibrate_exit ----
    ('a7', 'lab/engine.py', 'the latent rule with a strict <',
     'return latent_change(h, h_prev) <= threshold', 'return latent_change(h, h_prev) < threshold'),
    ('a7', 'lab/diagnose.py', 'exit_depths reads the KL column under the latent rule',
     '        kl = latent\n', '        kl = kl\n'),
    ('a7', 'lab/engine.py', 'KL reversed: KL(p_{k-1} || p_k)',
     'return (logp.exp() * (logp - logp_prev)).sum(dim=-1) <= threshold',
     'return (logp_prev.exp() * (logp_prev - logp)).sum(dim=-1) <= threshold'),
    ('a7', 'lab/engine.py', 'the KL rule passes at loop 1',
     'return torch.zeros(logp.shape[:-1], dtype=torch.bool, device=logp.device)',
     'return torch.ones(logp.shape[:-1], dtype=torch.bool, device=logp.device)'),
    ('a7', 'lab/engine.py', 'confidence read from the first token instead of the top one',
     'return logp.max(dim=-1).values.exp() >= threshold', 'return logp[..., 0].exp() >= threshold'),
    ('a7', 'lab/engine.py', 'a strict > in the confidence rule',
     'return logp.max(dim=-1).values.exp() >= threshold', 'return logp.max(dim=-1).values.exp() > threshold'),
    ('a7', 'lab/diagnose.py', 'the last loop does not always answer',
     '    passes[:, K - 1] = True  # the last loop always answers\n', ''),
    ('a7', 'lab/diagnose.py', 'exit depths counted from 0',
     'return passes.argmax(axis=1) + 1', 'return passes.argmax(axis=1)'),
    ('a7', 'lab/diagnose.py', 'the tolerance applied to cross-entropy instead of perplexity',
     'if ppl <= full * (1 + tolerance) and d.mean() < best[1]:',
     'if math.log(ppl) <= math.log(full) * (1 + tolerance) and d.mean() < best[1]:'),
    ('a7', 'lab/diagnose.py', 'perplexity as the mean of per-token perplexities',
     'ppl = math.exp(ce[np.arange(len(d)), d - 1].mean())', 'ppl = float(np.exp(ce[np.arange(len(d)), d - 1]).mean())'),
    ('a7', 'lab/diagnose.py', 'the tolerance ignored',
     'if ppl <= full * (1 + tolerance) and d.mean() < best[1]:', 'if d.mean() < best[1]:'),
    ('a7', 'lab/engine.py', 'the confidence rule on the top log-probability (no exp)',
     'return logp.max(dim=-1).values.exp() >= threshold', 'return logp.max(dim=-1).values >= threshold'),
    ('a7', 'lab/diagnose.py', 'a strict > in exit_depths (a top probability equal to the threshold does not exit)',
     "passes = pmax[:, :K] >= threshold if", "passes = pmax[:, :K] > threshold if"),
    ('a7', 'lab/diagnose.py', 'a strict < in exit_depths (a KL equal to the threshold does not exit)',
     "else kl[:, :K] <= threshold", "else kl[:, :K] < threshold"),
    ('a7', 'lab/diagnose.py', 'confidence candidates from loops 1..K-1 (loop K left out)',
     "signal = pmax[:, :K] if rule == 'confidence' else kl[:, 1:K]",
     "signal = pmax[:, :K - 1] if rule == 'confidence' else kl[:, 1:K]"),
    ('a7', 'lab/diagnose.py', 'confidence candidates from every column, not only the first K',
     "signal = pmax[:, :K] if rule == 'confidence' else kl[:, 1:K]",
     "signal = pmax if rule == 'confidence' else kl[:, 1:K]"),
    ('a7', 'lab/diagnose.py', "KL candidates with loop 1's infinite KL in the pool",
     "signal = pmax[:, :K] if rule == 'confidence' else kl[:, 1:K]",
     "signal = pmax[:, :K] if rule == 'confidence' else kl[:, :K]"),
    ('a7', 'lab/diagnose.py', 'KL candidates from loops 2..K-1 (loop K left out)',
     "signal = pmax[:, :K] if rule == 'confidence' else kl[:, 1:K]",
     "signal = pmax[:, :K] if rule == 'confidence' else kl[:, 1:K - 1]"),
    ('a7', 'lab/diagnose.py', '101 candidate levels instead of 201',
     'candidates = np.unique(np.quantile(signal, np.linspace(0, 1, 201)))',
     'candidates = np.unique(np.quantile(signal, np.linspace(0, 1, 101)))'),
    ('a7', 'lab/diagnose.py', 'every distinct signal value as a candidate instead of the quantiles',
     'candidates = np.unique(np.quantile(signal, np.linspace(0, 1, 201)))', 'candidates = np.unique(signal)'),
    ('a7', 'lab/diagnose.py', 'the largest threshold wins a tie in mean loops',
     'if ppl <= full * (1 + tolerance) and d.mean() < best[1]:',
     'if ppl <= full * (1 + tolerance) and d.mean() <= best[1] and d.mean() < K:'),
    ('a7', 'lab/diagnose.py', "the KL rule's never-exit threshold +inf (which exits every token at loop 2)",
     "best = (math.inf if rule == 'confidence' else -math.inf, float(K), full)",
     "best = (math.inf, float(K), full)"),
    ('a7', 'lab/diagnose.py', "the confidence rule's never-exit threshold 1.0 (a top probability of 1 still exits)",
     "best = (math.inf if rule == 'confidence' else -math.inf, float(K), full)",
     "best = (1.0 if rule == 'confidence' else -math.inf, float(K), full)"),
    ('a7', 'lab/engine.py', "the latent rule divides the change by the new state's norm ||h_k||",
     'return latent_change(h, h_prev) <= threshold',
     'return (h - h_prev).norm(dim=-1) / h.norm(dim=-1) <= threshold'),
    ('a7', 'lab/engine.py', 'the latent rule divides the change by the mean of the two norms',
     'return latent_change(h, h_prev) <= threshold',
     'return 2 * (h - h_prev).norm(dim=-1) / (h.norm(dim=-1) + h_prev.norm(dim=-1)) <= threshold'),
    ('a7', 'lab/engine.py', "the latent rule on the change of the norms, not the change's norm",
     'return latent_change(h, h_prev) <= threshold',
     'return (h.norm(dim=-1) - h_prev.norm(dim=-1)).abs() / h_prev.norm(dim=-1) <= threshold'),
    ('a7', 'lab/engine.py', 'the KL rule without the p_k weights (a plain sum of log-ratios)',
     'return (logp.exp() * (logp - logp_prev)).sum(dim=-1) <= threshold',
     'return (logp - logp_prev).sum(dim=-1) <= threshold'),
    ('a7', 'lab/engine.py', 'the KL rule averaged over the vocabulary instead of summed',
     'return (logp.exp() * (logp - logp_prev)).sum(dim=-1) <= threshold',
     'return (logp.exp() * (logp - logp_prev)).mean(dim=-1) <= threshold'),
    ('a7', 'lab/diagnose.py', "latent candidates from loops 2..K (the KL rule's pool)",
     'signal = latent[:, :K]', 'signal = latent[:, 1:K]'),
    ('a7', 'lab/diagnose.py', 'latent candidates from every column, not only the first K',
     'signal = latent[:, :K]', 'signal = latent'),
    ('a7', 'lab/diagnose.py', "the latent rule's never-exit threshold +inf (which exits every token at loop 1)",
     "best = (math.inf if rule == 'confidence' else -math.inf, float(K), full)",
     "best = (-math.inf if rule == 'kl' else math.inf, float(K), full)"),
    ('a7', 'lab/engine.py', 'exit_passes returns floats, not bools (generation cannot use them)',
     'return logp.max(dim=-1).values.exp() >= threshold',
     'return (logp.max(dim=-1).values.exp() >= threshold).float()'),
    ('a7', 'lab/engine.py', 'the KL rule subtracts in place (what generation samples from changes)',
     'return (logp.exp() * (logp - logp_prev)).sum(dim=-1) <= threshold',
     'return (logp.exp() * logp.sub_(logp_prev)).sum(dim=-1) <= threshold'),
    # ---- A8: DesignedGPT.inject, DesignBlock.sandwich_forward (lab/designs.py) ----
    ('a8', 'lab/designs.py', "add returns h alone (no injection: pass 1 runs on e, not 2e)",
     '            return h + e\n', '            return h\n'),
    ('a8', 'lab/designs.py', 'add returns the mean (h + e) / 2',
     '            return h + e\n', '            return (h + e) / 2\n'),
    ('a8', 'lab/designs.py', 'add replaces the state by e',
     '            return h + e\n', '            return e\n'),
    ('a8', 'lab/designs.py', 'add with e detached (the embedding learns nothing through the injection)',
     '            return h + e\n', '            return h + e.detach()\n'),
    ('a8', 'lab/designs.py', 'concat with h and e swapped, W [e; h] (at initialization the pass runs on e)',
     'self.adapter(torch.cat([h, e], dim=-1))', 'self.adapter(torch.cat([e, h], dim=-1))'),
    ('a8', 'lab/designs.py', 'concat of h with itself (e never gets in)',
     'self.adapter(torch.cat([h, e], dim=-1))', 'self.adapter(torch.cat([h, h], dim=-1))'),
    ('a8', 'lab/designs.py', 'concat with a residual around the adapter, h + W [h; e] (2h at initialization)',
     'self.adapter(torch.cat([h, e], dim=-1))', 'h + self.adapter(torch.cat([h, e], dim=-1))'),
    ('a8', 'lab/designs.py', "concat through the adapter's first half only, W_h h",
     'self.adapter(torch.cat([h, e], dim=-1))', 'F.linear(h, self.adapter.weight[:, :h.size(-1)])'),
    ('a8', 'lab/designs.py', 'concat with e detached',
     'self.adapter(torch.cat([h, e], dim=-1))', 'self.adapter(torch.cat([h, e.detach()], dim=-1))'),
    ('a8', 'lab/designs.py', 'concat with the adapter detached (W never learns)',
     'self.adapter(torch.cat([h, e], dim=-1))', 'F.linear(torch.cat([h, e], dim=-1), self.adapter.weight.detach())'),
    ('a8', 'lab/designs.py', 'concat as h + e (the adapter left out)',
     'self.adapter(torch.cat([h, e], dim=-1))', '(h + e)'),
    ('a8', 'lab/designs.py', "inject without the diagonal case (add and concat only: under 'diagonal' it falls through "
     "to the adapter, which a diagonal model does not have, and the full atlas's four diagonal runs fail)",
     "        if self.config.injection == 'diagonal':\n            return self.diagonal(h, e)\n", ''),
    ('a8', 'lab/designs.py', "inject without the diagonal case, ending in an elif (under 'diagonal' it "
     "returns None)",
     "        if self.config.injection == 'diagonal':\n            return self.diagonal(h, e)\n"
     "        return self.adapter(torch.cat([h, e], dim=-1))\n",
     "        if self.config.injection == 'concat':\n"
     "            return self.adapter(torch.cat([h, e], dim=-1))\n", 'got None'),
    ('a8', 'lab/designs.py', 'diagonal with h and e swapped, decay * e + Delta * B h',
     'return self.diagonal(h, e)', 'return self.diagonal(e, h)'),
    ('a8', 'lab/designs.py', "diagonal as add, h + e (Parcae's decay and Delta * B left out)",
     'return self.diagonal(h, e)', 'return h + e'),
    ('a8', 'lab/designs.py', "sandwich without post_attn (the attention's sum not normalized)",
     'x = self.post_attn(x + self.attn(self.norm_1(x)))', 'x = x + self.attn(self.norm_1(x))'),
    ('a8', 'lab/designs.py', "sandwich without post_mlp (the layer does not end in a norm)",
     'return self.post_mlp(x + self.mlp(self.norm_2(x)))', 'return x + self.mlp(self.norm_2(x))'),
    ('a8', 'lab/designs.py', 'sandwich with the two post-norms swapped',
     """        x = self.post_attn(x + self.attn(self.norm_1(x)))
        return self.post_mlp(x + self.mlp(self.norm_2(x)))""",
     """        x = self.post_mlp(x + self.attn(self.norm_1(x)))
        return self.post_attn(x + self.mlp(self.norm_2(x)))"""),
    ('a8', 'lab/designs.py', 'sandwich with the two pre-norms swapped',
     """        x = self.post_attn(x + self.attn(self.norm_1(x)))
        return self.post_mlp(x + self.mlp(self.norm_2(x)))""",
     """        x = self.post_attn(x + self.attn(self.norm_2(x)))
        return self.post_mlp(x + self.mlp(self.norm_1(x)))"""),
    ('a8', 'lab/designs.py', 'post-norm instead of sandwich: norm(x + f(x)), no norm before the sublayer',
     """        x = self.post_attn(x + self.attn(self.norm_1(x)))
        return self.post_mlp(x + self.mlp(self.norm_2(x)))""",
     """        x = self.post_attn(x + self.attn(x))
        return self.post_mlp(x + self.mlp(x))"""),
    ('a8', 'lab/designs.py', 'the residual left out: norm(f(norm(x)))',
     'x = self.post_attn(x + self.attn(self.norm_1(x)))', 'x = self.post_attn(self.attn(self.norm_1(x)))'),
    ('a8', 'lab/designs.py', "the MLP reads the block's input (the two sublayers in parallel)",
     """        x = self.post_attn(x + self.attn(self.norm_1(x)))
        return self.post_mlp(x + self.mlp(self.norm_2(x)))""",
     """        y = self.post_attn(x + self.attn(self.norm_1(x)))
        return self.post_mlp(y + self.mlp(self.norm_2(x)))"""),
    ('a8', 'lab/designs.py', 'the MLP before the attention',
     """        x = self.post_attn(x + self.attn(self.norm_1(x)))
        return self.post_mlp(x + self.mlp(self.norm_2(x)))""",
     """        x = self.post_attn(x + self.mlp(self.norm_1(x)))
        return self.post_mlp(x + self.attn(self.norm_2(x)))"""),
]


def grader(root, assignment):
    (path,) = glob.glob(os.path.join(root, 'assignments', 'tests', f'test_{assignment}_*.py'))
    return os.path.relpath(path, root)


def scratch_copy(dst):
    """The repository's working tree without history, run output, figures or prepared data (the text stays)."""
    skip = shutil.ignore_patterns('.git', 'out', 'figures', '__pycache__', '.pytest_cache', '*.bin', '*.pkl', '*.pt')
    shutil.copytree(ROOT, dst, ignore=skip)
    return dst


class Outcome:
    """A pytest plugin that counts what happened: failed tests (setup or call) and collection errors."""

    def __init__(self):
        self.passed, self.failed, self.errors, self.first = 0, 0, 0, ''
        self.messages = []  # every failure's text
        self.failed_files = set()  # the grader files of the failed tests: which assignment's grader failed

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors += 1
            self.first = self.first or str(report.longrepr)[-300:]

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed += 1
            self.failed_files.add(report.nodeid.split('::')[0])
            self.messages.append(str(report.longrepr))
            if not self.first:
                crash = getattr(report.longrepr, 'reprcrash', None)
                self.first = f"{report.nodeid.split('::')[-1]}: {crash.message if crash else report.longrepr}"
        elif report.when == 'call' and report.passed:
            self.passed += 1


def run_grader(root, assignment, stop_at_first=True):
    """Run one grader of the copy at root in this process, with every module of the copy imported afresh."""
    import pytest
    for name, mod in list(sys.modules.items()):
        if os.path.abspath(getattr(mod, '__file__', None) or os.sep).startswith(root + os.sep):
            del sys.modules[name]
    importlib.invalidate_caches()
    outcome = Outcome()
    cwd = os.getcwd()
    os.chdir(root)
    sys.path.insert(0, root)
    try:
        # Each pytest.main ends with five full garbage collections (the unraisable-exception plugin) and rewrites
        # every assert it imports; switched off, the whole suite takes a fifth of the time. The graders' asserts
        # carry their own messages (tests/test_course_kit.py checks), so plain asserts lose nothing.
        args = ['-q', '-p', 'no:cacheprovider', '-p', 'no:unraisableexception', '-p', 'no:threadexception',
                '--assert=plain', '--tb=no', '--no-header', '-o', 'console_output_style=classic',
                grader(root, assignment)] + (['-x'] if stop_at_first else [])
        with open(os.devnull, 'w') as quiet:
            stdout, sys.stdout = sys.stdout, quiet
            try:
                pytest.main(args, plugins=[outcome])
            finally:
                sys.stdout = stdout
    finally:
        sys.path.remove(root)
        os.chdir(cwd)
    return outcome


def get_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda msg: sys.exit(f"mutations.py: error: {msg}")
    p.add_argument('--only', default=None, help='comma-separated assignments, e.g. a3,a7')
    p.add_argument('--stubs', action='store_true',
                   help="also strip each assignment as make_student.py does: every test of its grader must fail "
                        "with the assignment's NotImplementedError (no grader passes vacuously)")
    return p


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    chosen = sorted({m[0] for m in MUTATIONS})
    if args.only:
        only = [a.strip() for a in args.only.split(',') if a.strip()]
        unknown = sorted(set(only) - set(chosen))
        if unknown:
            p.error(f"no mutations for {', '.join(unknown)}: use {', '.join(chosen)}")
        chosen = only
    start = time.time()
    with tempfile.TemporaryDirectory(prefix='mutations-') as tmp:
        root = os.path.realpath(scratch_copy(os.path.join(tmp, 'repo')))
        originals = {}
        for a in chosen:  # the reference must pass every grader, or a "caught" mutation proves nothing
            control = run_grader(root, a, stop_at_first=False)
            print(json.dumps({'control': a, 'passed': control.passed, 'failed': control.failed,
                              'errors': control.errors, 'first': control.first}), flush=True)
            if control.failed or control.errors or not control.passed:
                sys.exit(f"mutations.py: error: the reference fails its own {a} grader: {control.first}")
        if args.stubs:
            sys.path.insert(0, os.path.join(ROOT, 'assignments'))
            from make_student import stub_marker, stub_source
            from stubs import ASSIGNMENTS
            for a in chosen:
                by_file = {}
                for target in ASSIGNMENTS[a][1]:
                    path, qualname = target.split('::')
                    by_file.setdefault(path, []).append(qualname)
                texts = {}
                for path, qualnames in by_file.items():
                    with open(os.path.join(root, path), encoding='utf-8') as f:
                        texts[path] = f.read()
                    stubbed = texts[path]
                    for qualname in qualnames:
                        stubbed = stub_source(stubbed, [qualname], stub_marker(a))
                    with open(os.path.join(root, path), 'w', encoding='utf-8') as f:
                        f.write(stubbed)
                try:
                    got = run_grader(root, a, stop_at_first=False)
                finally:
                    for path, text in texts.items():
                        with open(os.path.join(root, path), 'w', encoding='utf-8') as f:
                            f.write(text)
                marker = f"NotImplementedError: {stub_marker(a)}"
                print(json.dumps({'stubbed': a, 'passed': got.passed, 'failed': got.failed, 'errors': got.errors,
                                  'all_not_implemented': bool(got.messages)
                                  and all(marker in m for m in got.messages)}),
                      flush=True)
        tried = caught = 0
        for a, path, what, old, new, *hint in MUTATIONS:
            if a not in chosen:
                continue
            file = os.path.join(root, path)
            if path not in originals:
                with open(file, encoding='utf-8') as f:
                    originals[path] = f.read()
            text = originals[path]
            if text.count(old) != 1:
                sys.exit(f"mutations.py: error: the {a} mutation '{what}' expects its reference text once in {path}, "
                         f"found it {text.count(old)} times: update MUTATIONS to match the reference code")
            with open(file, 'w', encoding='utf-8') as f:
                f.write(text.replace(old, new))
            try:
                got = run_grader(root, a)
            finally:
                with open(file, 'w', encoding='utf-8') as f:
                    f.write(text)
            tried += 1
            hit = got.failed > 0 and got.errors == 0 and got.failed_files == {grader(root, a)}  # its own grader
            caught += hit
            record = {'assignment': a, 'mutation': what, 'caught': hit, 'failed': got.failed, 'errors': got.errors,
                      'failed_in': sorted(got.failed_files), 'first': got.first}
            if hint:  # the hint the grader must give for this mistake, and whether its first failure gave it
                record.update(hint=hint[0], hint_given=hint[0] in got.first)
            print(json.dumps(record), flush=True)
    print(f"mutation suite: {tried} tried, {caught} caught ({time.time() - start:.0f} s)")
    return 0 if caught == tried else 1


if __name__ == '__main__':
    sys.exit(main())
