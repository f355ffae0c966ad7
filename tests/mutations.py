"""
Mutation check of the core: does the test suite fail when the code is wrong?

    python tests/mutations.py              # every breakage below (a few minutes on 2 cores)
    python tests/mutations.py --only=kl    # the breakages with a word starting 'kl' (any case): the KL rule
    python tests/mutations.py --only='add injects e at pass 1 only'   # one breakage, by its whole name
    python tests/mutations.py --list       # what would run

Each breakage is one realistic one-line mistake (a student's, or a careless refactor's), written into a scratch
copy of the repository; the tests that should notice it are run there with pytest, and the breakage is caught
when they fail. The real files are never edited. A breakage whose line is not found exactly once stops the
command (the list must follow the code), and so does a mutated file that no longer compiles (a syntax error
would be "caught" for the wrong reason). It prints one table row per breakage and exits 1 if any survived.

Why a hand-written list and not a mutation-testing tool (mutmut, cosmic-ray): those generate thousands of
operator flips and run the whole suite for each; on 2 cores that is hours, and most of their mutants are not
mistakes anyone makes. Each line here names the behaviour it breaks and the tests meant to guard it, which is
also documentation of what the suite protects.
"""

import argparse
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W = 'tests/test_wiring.py::'
G = 'tests/test_generation.py::'
B = 'tests/test_bounded_designs.py::'
N = 'tests/test_nanogpt_user.py::'
T = 'tests/test_behaviours.py::'

# (name, file, the line as it is, the line as broken, the tests that must fail)
MUTATIONS = [
    # ---- declaring a design once: the init, the FLOPs and the names that derive from a field
    ('gpt2 init drawn from the global stream', 'lab/designs.py', 'draw = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))',
     'draw = None', ['tests/test_registry.py::test_init_draws_every_other_weight_the_same_when_a_parameter_is_added']),
    ('paper_small_embed redraws the whole model', 'lab/designs.py', "elif c.init == 'paper_small_embed' and name in ('wte.weight', 'wpe.weight'):",
     "elif c.init == 'paper_small_embed' and p.dim() >= 2:", ['tests/test_registry.py::test_paper_small_embed_is_the_paper_init_but_for_the_embeddings']),
    ('flops ignore an unknown parameter', 'lab/designs.py', '        if unknown:\n', '        if False:\n',
     ['tests/test_registry.py::test_flops_per_token_refuses_a_parameter_it_has_no_count_for']),
    ('flops count the coda once', 'lab/designs.py', "'coda': readouts, 'exit_gate': K,", "'coda': 1, 'exit_gate': K,",
     ['tests/test_registry.py::test_flops_per_token_counts_each_module_by_hand']),
    ('a choice field named by its value alone', 'lab/runs.py',
     "return TAGS.get(f.name, f.name + '_') + _value(value)",
     "return TAGS.get(f.name, '') + _value(value)",
     ['tests/test_registry.py::test_a_choice_field_names_its_run_by_field_and_a_tag_works_on_any_field']),
    ('a tag on a text field formatted as a number', 'lab/runs.py', 'return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)',
     'return f"{v:g}" if not isinstance(v, bool) else str(v)', ['tests/test_registry.py::test_a_choice_field_names_its_run_by_field_and_a_tag_works_on_any_field']),
    ('the paper penalty named with its value', 'lab/runs.py',
     '    if (f.name, value) in NAMED:',
     '    if False:',
     ['tests/test_registry.py::test_run_names_and_condition_names_of_the_existing_variants']),
    ('a non-finite loss named at the wrong step', 'train.py', 'at step {step - len(values) + 1 + i}',
     'at step {step}', ['tests/test_train.py::test_nan_loss_stops_and_keeps_last_checkpoint']),
    # ---- the field's designs (lab/designs.py's injection, prelude/coda, block, depth_sampling, bptt, latent exit)
    ('concat adapter starts at zero', 'lab/designs.py', 'self.adapter.weight.copy_(torch.eye(c.n_embd, 2 * c.n_embd))',
     'self.adapter.weight.zero_()', ['tests/test_designs.py::test_concat_at_init_computes_what_none_does']),
    ('add injects e at pass 1 only', 'lab/designs.py',
     "x = h if c.injection == 'none' else self.inject(h, e)",
     "x = h if c.injection == 'none' or k > 1 else self.inject(h, e)",
     ['tests/test_designs.py::test_add_adds_e_at_every_pass_not_once']),
    ('coda skipped at the readout', 'lab/designs.py', '        for i, block in enumerate(self.coda):', '        for i, block in enumerate(self.coda[:0]):',
     ['tests/test_designs.py::test_the_prelude_runs_once_and_the_coda_at_every_readout']),
    ('prelude skipped', 'lab/designs.py', '        for i, block in enumerate(self.prelude):', '        for i, block in enumerate(self.prelude[:0]):',
     ['tests/test_designs.py::test_the_prelude_runs_once_and_the_coda_at_every_readout']),
    ('sandwich without its last norm', 'lab/designs.py',
     'self.post_mlp = RMSNorm(config.n_embd, config.norm_eps) if sandwich else nn.Identity()', 'self.post_mlp = nn.Identity()',
     ['tests/test_designs.py::test_a_sandwich_block_hands_on_the_rms_of_its_last_gain_whatever_the_input_scale']),
    ('sandwich without its attention norm', 'lab/designs.py', 'x = self.post_attn(x + self.attn(self.norm_1(x), kv))',
     'x = x + self.attn(self.norm_1(x), kv)', ['tests/test_designs.py::test_a_sandwich_block_normalizes_both_sublayer_sums_by_hand']),
    # ---- the seams: lab/designs.py's DesignedGPT overrides a method of looped.py's LoopedGPT and must keep its part
    ('the pass runs on h, not the injected state', 'lab/designs.py', 'h = super().loop_pass(x, e, k, n_loop, cache)',
     'h = super().loop_pass(h, e, k, n_loop, cache)',
     ['tests/test_designs.py::test_add_adds_e_at_every_pass_not_once',
      B + 'test_the_diagonal_injection_runs_at_every_pass_on_the_carried_state']),
    ("a design's carry drops the inter-loop norm", 'lab/designs.py', '        return super().carry(h)', '        return h',
     ['tests/test_model.py::test_normed_recurrence_starts_each_pass_at_the_gain']),
    ('tie_weights left unresolved', 'lab/designs.py', '        if self.tie_weights is None:\n', '        if False:\n',
     [W + 'test_weight_tying_under_each_init']),
    ("the designs' init never run", 'lab/designs.py', '        self.init_weights()', '        pass',
     ['tests/test_registry.py::test_gpt2_init_draws_depend_on_the_seed_and_have_gpt2s_scale',
      'tests/test_designs.py::test_concat_at_init_computes_what_none_does']),
    ("a design's loss drops the norm penalty", 'lab/designs.py',
     'return logits, self.add_jacobian_penalty(self.training_loss(ces, states), states[-1], e, stats), stats',
     'return logits, self.add_jacobian_penalty(self.supervision_loss(ces), states[-1], e, stats), stats',
     ['tests/test_designs.py::test_the_jacobian_penalty_keeps_the_norm_penalty']),
    ('gated loss drops the norm penalty', 'lab/designs.py',
     '        if self.config.norm_penalty > 0:\n            loss = loss + self.penalty_loss(states)', '        pass',
     ['tests/test_gate.py::test_the_norm_penalty_adds_to_the_gated_loss']),
    ('gated loss drops the jacobian penalty', 'lab/designs.py',
     'return logits, self.add_jacobian_penalty(loss, states[-1], e, stats), stats', 'return logits, loss, stats',
     ['tests/test_gate.py::test_the_jacobian_penalty_adds_to_the_gated_loss_at_h_K']),
    ('gated jacobian estimated at h_1, not h_K', 'lab/designs.py',
     'return logits, self.add_jacobian_penalty(loss, states[-1], e, stats), stats',
     'return logits, self.add_jacobian_penalty(loss, states[0], e, stats), stats',
     ['tests/test_gate.py::test_the_jacobian_penalty_adds_to_the_gated_loss_at_h_K']),
    ('the attention choice ignored', 'lab/designs.py',
     "self.attn = ManualAttention(config) if config.attention == 'manual' else CausalSelfAttention(config)",
     'self.attn = CausalSelfAttention(config)', ['tests/test_model.py::test_manual_attention_never_calls_the_fused_kernel']),
    ('manual attention after cached keys attends causally from 0', 'lab/designs.py',
     'seen = torch.ones(T, L, dtype=torch.bool, device=x.device).tril(L - T)',
     'seen = torch.ones(T, L, dtype=torch.bool, device=x.device).tril()',
     [G + 'test_a_chunk_after_cached_positions_sees_exactly_its_past']),
    ('jacobian estimated at h_1, not h_K', 'lab/designs.py',
     'return logits, self.add_jacobian_penalty(self.training_loss(ces, states), states[-1], e, stats), stats',
     'return logits, self.add_jacobian_penalty(self.training_loss(ces, states), states[0], e, stats), stats',
     [B + 'test_the_jacobian_is_estimated_at_the_last_loops_state']),
    ("the prelude's embedding forgets the cache", 'lab/designs.py', 'h = super().embed(idx, cache)', 'h = super().embed(idx)',
     [G + 'test_cached_generation_gives_the_recomputed_tokens_and_logits']),
    ('one coda cache entry for every loop', 'lab/designs.py', "h = block(h, cache and cache.layer('coda', k, i))",
     "h = block(h, cache and cache.layer('coda', 1, i))", [G + 'test_a_skipped_loops_cache_entries_are_its_last_run_loops']),
    ("the paper model's stack has a layer per loop", 'looped.py',
     'return nn.ModuleList([Block(self.config) for _ in range(self.config.n_layer)])',
     'return nn.ModuleList([Block(self.config) for _ in range(self.config.n_loop)])',
     ['tests/test_designs.py::test_the_paper_model_is_the_designed_model_at_its_defaults']),
    ("the paper model trains without weight decay", 'looped.py',
     "return torch.optim.AdamW([{'params': params, 'weight_decay': weight_decay}],",
     "return torch.optim.AdamW([{'params': params, 'weight_decay': 0.0}],",
     ['tests/test_designs.py::test_the_paper_model_is_the_designed_model_at_its_defaults']),
    # ---- the 2026 bounded designs (lab/designs.py's diagonal injection, damped recurrence, deepnorm, Jacobian penalty)
    ('diagonal decay not bounded by the exponential', 'lab/designs.py', 'return delta, torch.exp(-delta * self.A_log.exp())',
     'return delta, 1 - delta * self.A_log.exp()', [B + 'test_the_diagonal_decay_stays_in_0_1_whatever_its_parameters']),
    ('diagonal injection forgets Delta on e', 'lab/designs.py', 'return decay * h + delta * self.B(e)',
     'return decay * h + self.B(e)', [B + 'test_the_diagonal_injection_at_init_is_0447_h_plus_0805_e_per_channel']),
    ('diagonal B left as the init drew it', 'lab/designs.py', 'self.diagonal.B.weight.copy_(torch.eye(c.n_embd))',
     'pass', [B + 'test_the_diagonal_injection_at_init_is_0447_h_plus_0805_e_per_channel']),
    ('diagonal parameters decayed', 'lab/designs.py',
     'exempt = {id(p) for p in (self.diagonal.parameters() if self.diagonal else [])}', 'exempt = set()',
     [B + 'test_the_diagonal_injections_parameters_take_no_weight_decay']),
    ('damping applied to the read-out state', 'lab/designs.py',
     '        return h\n\n    def carry(self, h):\n        if self.damping is not None:\n            return torch.sigmoid(self.damping) * h',
     '        return h if self.damping is None else torch.sigmoid(self.damping) * h\n\n    def carry(self, h):\n'
     '        if self.damping is not None:\n            return h', [B + 'test_a_damped_pass_2_starts_from_sigmoid_2_times_h_1_and_h_1_is_read_out_undamped']),
    ('damping never applied', 'lab/designs.py', "return torch.sigmoid(self.damping) * h  # 'damped'", "return h  # 'damped'",
     [B + 'test_a_damped_pass_2_starts_from_sigmoid_2_times_h_1_and_h_1_is_read_out_undamped']),
    ('deepnorm normalizes the sublayer input too', 'lab/designs.py', 'x = self.norm_1(self.residual_weight * x + self.attn(x, kv))',
     'x = self.norm_1(self.residual_weight * x + self.attn(self.norm_1(x), kv))',
     [B + 'test_a_deepnorm_block_is_post_ln_with_alpha_sqrt_2n_by_hand']),
    ('deepnorm alpha with the fourth root', 'lab/designs.py', 'self.residual_weight = math.sqrt(2 * config.n_layer * config.n_loop)',
     'self.residual_weight = (2 * config.n_layer * config.n_loop) ** 0.25',
     [B + 'test_a_deepnorm_block_is_post_ln_with_alpha_sqrt_2n_by_hand']),
    ('deepnorm beta on q and k too', 'lab/designs.py', 'block.attn.c_attn.weight[2 * c.n_embd:].mul_((8 * depth) ** -0.5)',
     'block.attn.c_attn.weight.mul_((8 * depth) ** -0.5)', [B + 'test_deepnorm_shrinks_the_value_output_and_mlp_weights_by_beta']),
    ('jacobian estimate with an unnormalized v', 'lab/designs.py',
     '(vJ,) = torch.autograd.grad(out, x, v / v.norm(), create_graph=True)',
     '(vJ,) = torch.autograd.grad(out, x, v, create_graph=True)',
     [B + 'test_the_jacobian_estimate_is_v_times_the_passs_full_jacobian']),
    ('jacobian penalty without its square', 'lab/designs.py', 'loss = loss + self.config.jacobian_penalty * jac ** 2',
     'loss = loss + self.config.jacobian_penalty * jac',
     [B + 'test_the_jacobian_penalty_adds_w_times_the_squared_estimate_and_reaches_the_stack']),
    ('jacobian penalty with no graph to the weights', 'lab/designs.py',
     '(vJ,) = torch.autograd.grad(out, x, v / v.norm(), create_graph=True)',
     '(vJ,) = torch.autograd.grad(out, x, v / v.norm(), create_graph=False)',
     [B + 'test_the_jacobian_penalty_adds_w_times_the_squared_estimate_and_reaches_the_stack']),
    ('design quantity left out of the eval line', 'lab/report.py',
     "for key, form in designs.items() if key in record)", "for key, form in designs.items() if key == 'alpha')",
     [B + 'test_each_designs_quantity_is_logged_and_shown_at_every_evaluation']),
    # ---- gated supervision and the gate's exit rule (lab/designs.py, lab/engine.py)
    ('exit distribution leaves the last loop only its own lambda', 'lab/designs.py',
     'return torch.cat([(lam * before)[:-1], before[-1:]])', 'return lam * before',
     ['tests/test_gate.py::test_the_exit_distribution_sums_to_1_and_the_last_loop_takes_what_is_left']),
    ('gate entropy rewarded the wrong way', 'lab/designs.py',
     'loss = (p * torch.stack(ces)).sum(0) - self.config.gate_beta * entropy',
     'loss = (p * torch.stack(ces)).sum(0) + self.config.gate_beta * entropy',
     ['tests/test_gate.py::test_the_entropy_bonus_is_beta_times_the_exit_distributions_entropy']),
    ('gated cross-entropies averaged before weighting', 'lab/designs.py',
     "return super().loop_loss(h, k, targets, 'none' if self.exit_gate is not None else reduction)",
     'return super().loop_loss(h, k, targets, reduction)',
     ['tests/test_gate.py::test_with_beta_0_and_the_gate_exiting_at_K_the_loss_is_terminal_supervisions']),
    ('raw gate reads the readout', 'lab/designs.py',
     "x = h if self.config.gate_input == 'raw' else self.exit_input(h, k, cache)",
     'x = self.exit_input(h, k, cache)', ['tests/test_gate.py::test_a_raw_gate_sees_the_scale_and_a_gate_on_the_readout_does_not']),
    ('gate rule forgets the earlier loops', 'lab/engine.py',
     'stay = stay * (1 - torch.sigmoid(next_gate(model, h, k, cache)))',
     'stay = 1 - torch.sigmoid(next_gate(model, h, k, cache))',
     ['tests/test_gate.py::test_each_sequence_exits_where_its_own_cumulative_exit_probability_reaches_the_threshold']),
    ('exit distribution left out of the eval line', 'lab/report.py', "    if 'exit_prob' in record:",
     '    if False:', ['tests/test_gate.py::test_gated_training_shows_the_exit_distribution_in_the_eval_line']),
    ('matched-depth kl score forgets the previous loop', 'lab/diagnose.py', "h_prev, prev = h, logp", "h_prev = h",
     ['tests/test_diagnose.py::test_a_windows_kl_score_is_minus_its_mean_kl_to_the_loop_before']),
    ('gate score forgets the earlier loops', 'lab/diagnose.py',
     'stay = stay * (1 - torch.sigmoid(model.gate_logit(h, k)))', 'stay = 1 - torch.sigmoid(model.gate_logit(h, k))',
     ['tests/test_gate.py::test_a_windows_gate_score_is_its_mean_cumulative_exit_probability']),
    ('gate alignment forgets the weight in the cosine', 'lab/diagnose.py',
     'cos = (z @ w) / (z.norm(dim=-1) * w.norm()).clamp_min(1e-12)', 'cos = (z @ w) / z.norm(dim=-1).clamp_min(1e-12)',
     ['tests/test_gate.py::test_the_gate_alignment_splits_each_logit_into_weight_norm_state_norm_and_cosine']),
    ('matched depth pairs the gate with its own rule', 'lab/matched_depth.py',
     "for r in ([s] if s in theirs else theirs)]", "for r in ([s] if s in theirs else ['max_prob'])]",
     ['tests/test_gate.py::test_matched_depth_pairs_the_gate_with_each_of_the_references_rules']),
    ('older logs read back without the schedule flags', 'lab/grid.py',
     "NEWER_FLAGS = {'warmup_iters': 0, 'decay_lr': False, 'lr_decay_iters': None, 'min_lr': None}",
     "NEWER_FLAGS = {'warmup_iters': 0}",
     ['tests/test_tables.py::test_every_committed_log_reads_back_with_every_flag_train_py_has_today']),
    ('the default reference ignores the runs\' init', 'lab/stats.py', "return under_init[0] if REFERENCE not in names",
     "return under_init[0] if False",
     ['tests/test_plot.py::test_the_default_reference_is_per_loop_rmsnorm_under_the_runs_own_init']),
    ('table drops the exit probability', 'lab/paper.py', "loop_means(last, 'exit_prob', K, '.3f')", "''",
     ['tests/test_gate.py::test_the_gate_against_the_rules_in_its_own_runs_and_its_table']),
    # ---- what a nanoGPT user reads and types (tests/test_nanogpt_user.py): the schedule, float16, every printed figure
    ('cosine decay is linear', 'train.py', 'return args.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - args.min_lr)',
     'return args.min_lr + (1 - progress) * (lr - args.min_lr)',
     [N + 'test_decay_lr_is_nanogpts_cosine_after_this_repositorys_warmup_then_min_lr']),
    ('decay ignores the warmup', 'train.py', 'progress = (step - warmup) / (args.lr_decay_iters - warmup)',
     'progress = step / args.lr_decay_iters', [N + 'test_decay_lr_is_nanogpts_cosine_after_this_repositorys_warmup_then_min_lr']),
    ('resume forgets the schedule', 'train.py',
     "'learning_rate', 'warmup_iters', 'decay_lr', 'lr_decay_iters',\n                 'min_lr'):",
     "):", [N + 'test_a_resumed_run_continues_the_schedule_exactly']),
    ('clipping the scaled gradients', 'train.py', '            r.scaler.unscale_(r.optimizer)  #', '            pass  #',
     [N + 'test_the_scaler_leaves_every_update_as_it_is_without_it']),
    ('scaler state not restored', 'train.py', "        r.scaler.load_state_dict(ckpt['scaler'])", '        pass',
     [N + 'test_the_gradscalers_state_is_saved_and_restored_with_the_checkpoint']),
    ('a skipped float16 step not counted', 'train.py', '            progress.skips += 1', '            pass',
     [N + 'test_a_step_the_scaler_skips_is_not_a_divergence']),
    ('progress loss is the last exit', 'train.py', '            progress.losses.append(lossf)',
     "            progress.losses.append(stats['ce'][-1])", [N + 'test_the_progress_lines_loss_at_step_1_is_the_objective_trained']),
    ('ETA from the last interval alone', 'train.py', 'eta = (now - self.t_start) / (step - self.step_start) * (max_iters - step)',
     'eta = dt * (max_iters - step)', [N + 'test_the_progress_lines_clock_tokens_and_eta_by_hand']),
    ('tok/s forgets accumulation and processes', 'train.py',
     'progress = Progress(r.step, r.global_batch * r.config.block_size,',
     'progress = Progress(r.step, args.batch_size * r.config.block_size,',
     [N + 'test_the_progress_lines_clock_tokens_and_eta_by_hand',
      'tests/test_handout_behaviours.py::test_tok_s_counts_every_micro_step_and_process']),
    ('evaluation averages batches as equals', 'train.py',
     "ce, norm = ce + len(x) * stats['ce'].float(), norm + len(x) * stats['hidden_norm'].float()",
     "ce, norm = ce + 4 * stats['ce'].float(), norm + 4 * stats['hidden_norm'].float()",
     [N + 'test_an_evaluation_weighs_a_short_last_batch_by_its_size']),
    ('best validation loss is the last', 'train.py', "r.best_val_loss = min(r.best_val_loss, record['val_loss'][K - 1])",
     "r.best_val_loss = record['val_loss'][K - 1]", [N + 'test_the_best_validation_loss_is_the_lowest_so_far_not_the_last']),
    ('a nanoGPT habit left to argparse', 'train.py', "            if arg.startswith('--') and name in HABITS:", '            if False:',
     [N + 'test_each_nanogpt_habit_is_one_line_naming_this_repositorys_way']),
    ('an H100 PCIe counted as an SXM', 'lab/runtime.py', "('H100 PCIe', 756, 756, 378), ('H100 NVL', 835, 835, 418), ('H100', 989, 989, 495),",
     "('H100', 989, 989, 495), ('H100 PCIe', 756, 756, 378), ('H100 NVL', 835, 835, 418),",
     [N + 'test_mfu_knows_each_gpus_peak_in_the_dtype_in_use']),
    ('auto dtype never float16', 'train.py', "torch.cuda.is_bf16_supported(including_emulation=False) else 'float16'",
     "torch.cuda.is_bf16_supported(including_emulation=False) else 'float32'",
     [N + 'test_auto_dtype_on_cuda_is_bf16_where_the_gpu_has_it_and_float16_elsewhere']),
    ('per-loop readouts kept for backward (bench)', 'looped.py',
     'ce = checkpoint(self.loop_loss, h, k, targets, use_reentrant=False)[1]',
     'ce = self.loop_loss(h, k, targets)[1]',
     ['tests/test_bench.py::test_per_loop_keeps_within_25_percent_of_terminals_memory_for_backward']),
    # ---- the atlas's and the course's derived numbers (lab/atlas.py, lab/norm_course.py), each against a hand computation
    ('atlas: unigram from the validation split itself', 'lab/atlas.py',
     'counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=vocab_size) + 1.0',
     'counts = np.bincount(np.asarray(val, dtype=np.int64), minlength=vocab_size) + 1.0', ['tests/test_atlas.py::test_the_unigram_loss_by_hand']),
    ('atlas: learns judged at depth 2K too', 'lab/atlas.py',
     "return bool(np.all(np.asarray(summary['loss'][:summary['K']]) <= unigram - LEARNS))",
     "return bool(np.all(np.asarray(summary['loss']) <= unigram - LEARNS))",
     ['tests/test_atlas.py::test_a_readout_that_did_not_learn_carries_no_verdict']),
    ('atlas: ratio not paired by seed', 'lab/atlas.py', "ratio = np.array([a[s]['norm'] / b[s]['norm'] for s in seeds])",
     "ratio = np.array([a[s]['norm'] / b[seeds[0]]['norm'] for s in seeds])", ['tests/test_atlas.py::test_the_sharper_verdicts_by_hand']),
    ('atlas: still growing if any seed grows', 'lab/atlas.py', "'growing': all(f['lo'] > 0 for f in fits),",
     "'growing': any(f['lo'] > 0 for f in fits),", ['tests/test_atlas.py::test_the_sharper_verdicts_by_hand']),
    ('atlas: loss cost raw minus rmsnorm', 'lab/atlas.py',
     "out['cost'] = paired_stats([[a[s]['loss_K'] - b[s]['loss_K'], a[s]['loss_2K'] - b[s]['loss_2K']] for s in seeds])",
     "out['cost'] = paired_stats([[b[s]['loss_K'] - a[s]['loss_K'], a[s]['loss_2K'] - b[s]['loss_2K']] for s in seeds])",
     ['tests/test_atlas.py::test_the_sharper_verdicts_by_hand']),
    ('atlas: table 3 verdicts for a readout that did not learn', 'lab/atlas.py',
     'm, taught = sharper(got), {r: r not in got or learns(got[r], unigram) for r in READOUTS}',
     'm, taught = sharper(got), {r: True for r in READOUTS}', ['tests/test_atlas.py::test_a_readout_that_did_not_learn_carries_no_verdict']),
    ('course: the paper width rms divided by d', 'lab/norm_course.py',
     "row['paper_rms'] = (v / math.sqrt(m['n_embd']), lo / math.sqrt(m['n_embd']), hi / math.sqrt(m['n_embd']))",
     "row['paper_rms'] = (v / m['n_embd'], lo / m['n_embd'], hi / m['n_embd'])",
     ['tests/test_course.py::test_the_extrapolated_step_and_rms_at_the_papers_width_by_hand']),
    ('course: tokens per step without the batch', 'lab/norm_course.py',
     "tokens_per_step = c['batch_size'] * (c.get('grad_accum') or 1) * m['block_size']",
     "tokens_per_step = (c.get('grad_accum') or 1) * m['block_size']",
     ['tests/test_course.py::test_the_extrapolated_step_and_rms_at_the_papers_width_by_hand']),
    ("course: seed spread over each seed's own steps", 'lab/norm_course.py',
     "fit(m['steps'], m['norms'], after, until)", "fit(m['steps'], m['norms'], after)",
     ['tests/test_course.py::test_the_power_across_seeds_is_fitted_over_the_steps_every_seed_reached']),
    ('course: seed spread from the first seed', 'lab/norm_course.py',
     'out.append((label, len(fits), b.mean(), b.min(), b.max(), ', 'out.append((label, len(fits), b[0], b.min(), b.max(), ',
     ['tests/test_course.py::test_the_power_across_seeds_by_hand']),
    # ---- the committed tables against their committed logs (tests/test_tables.py): slips no hand-made case shows
    ('course: the early peak leaves out step 500', 'lab/norm_course.py',
     'early = [v for s, v in zip(steps, norms) if 0 < s <= 500]', 'early = [v for s, v in zip(steps, norms) if 0 < s < 500]',
     ['tests/test_tables.py::test_every_table_under_figures_is_rebuilt_from_its_committed_logs[figures/laptop_10k]']),
    ('atlas: the CSV loss column drops depth 2K', 'lab/atlas.py', "' '.join(f\"{v:.4f}\" for v in s['loss']),",
     "' '.join(f\"{v:.4f}\" for v in s['loss'][:-1]),", ['tests/test_tables.py::test_every_table_under_figures_is_rebuilt_from_its_committed_logs[figures/atlas]']),
    ('sampled depth not clamped at 2K', 'lab/designs.py', 'return int(min(max(rng.poisson(math.exp(tau)) + 1, 1), 2 * K))',
     'return int(max(rng.poisson(math.exp(tau)) + 1, 1))', ['tests/test_designs.py::test_sampled_depths_have_the_distributions_mean_and_range']),
    ('sampled depth centred on K, not K - 1', 'lab/designs.py', 'tau = rng.normal(math.log(K - 1) - sigma ** 2 / 2, sigma)',
     'tau = rng.normal(math.log(K) - sigma ** 2 / 2, sigma)', ['tests/test_designs.py::test_sampled_depths_have_the_distributions_mean_and_range']),
    ('sampled depth drawn from fresh entropy', 'lab/designs.py', 'rng, sigma = np.random.default_rng([seed, step]), 0.5',
     'rng, sigma = np.random.default_rng(), 0.5', ['tests/test_designs.py::test_sampled_depths_are_the_same_in_another_process',
                                       'tests/test_designs.py::test_sampled_depth_trains_at_the_drawn_count_and_resumes_the_same_sequence']),
    ('training ignores the drawn depth', 'train.py', '_, loss, stats = model(x, y, n_loop=n_loop)',
     '_, loss, stats = model(x, y)', ['tests/test_designs.py::test_training_uses_the_drawn_loop_count']),
    ('bptt detaches one pass early', 'lab/designs.py',
     'if c.bptt and k == n_loop - c.bptt + 1 and k > 1:',
     'if c.bptt and k == n_loop - c.bptt and k > 1:',
     ['tests/test_designs.py::test_bptt_cuts_the_gradient_through_the_carried_state_before_the_last_b_passes']),
    ('bptt detaches at every pass', 'lab/designs.py',
     'if c.bptt and k == n_loop - c.bptt + 1 and k > 1:',
     'if c.bptt and k > 1:',
     ['tests/test_designs.py::test_bptt_cuts_the_gradient_through_the_carried_state_before_the_last_b_passes']),
    ('latent change not relative', 'lab/engine.py',
     'return (h - h_prev).norm(dim=-1) / h_prev.norm(dim=-1).clamp_min(1e-12)',
     'return (h - h_prev).norm(dim=-1)',
     ['tests/test_designs.py::test_the_latent_rule_on_hand_made_states']),
    ('rows dropped mid-loop keep all of e', 'lab/diagnose.py',
     '            return h[~done], e[~done]',
     '            return h[~done], e',
     ['tests/test_designs.py::test_the_exit_benchmark_drops_exited_rows_of_e_too']),
    ('a config field without a train.py flag', 'lab/designs.py', '    for f in design_fields(config):\n',
     '    for f in design_fields(config)[:-1]:\n', ['tests/test_designs.py::test_every_config_field_is_a_flag_that_reaches_the_model_and_the_checkpoint']),
    ("a grid reads a boolean flag's 'False' as True", 'lab/designs.py',
     "values[name] = (boolean(text) if given else True) if kind is bool else kind(text)",
     "values[name] = kind(text) if given else True",
     ['tests/test_design_flags.py::test_a_false_boolean_flag_names_the_default_condition_not_the_true_one']),
    ('warmup off by one step', 'train.py', 'return lr * ((step + 1) / warmup)',
     'return lr * (step / warmup)',
     ['tests/test_designs.py::test_warmup_raises_the_learning_rate_linearly_then_holds_it']),
    ('inverse_k scaling by 1/n_layer', 'lab/designs.py',
     'h = x + (h - x) / c.n_loop',
     'h = x + (h - x) / c.n_layer',
     ['tests/test_designs.py::test_inverse_k_residual_scale_divides_each_pass_update_by_k']),
    ('next-token logits of a coda model from the last position alone', 'lab/engine.py',
     'x = model.exit_input(h if coda else h[:, -1:, :], k, cache)[:, -1, :]',
     'x = model.exit_input(h[:, -1:, :], k, cache)[:, -1, :]',
     [G + 'test_the_engines_cached_generation_samples_the_plain_generates_tokens[n_coda=1]']),
    ("forward's next-token logits of a coda model from the last position alone", 'looped.py',
     'return self.lm_head(self.exit_input(h, K)[:, -1:, :]), None, stats',
     'return self.lm_head(self.exit_input(h[:, -1:, :], K)), None, stats',
     ['tests/test_designs.py::test_the_prelude_runs_once_and_the_coda_at_every_readout']),
    ('a resumed run draws its depths from the default seed', 'train.py', "for name in ('dataset', 'seed', 'learning_rate',",
     "for name in ('dataset', 'learning_rate',",
     ['tests/test_designs.py::test_sampled_depth_trains_at_the_drawn_count_and_resumes_the_same_sequence']),
    # ---- generation controls
    ('generate ignores top_k', 'looped.py',
     '    if top_k is not None:',
     '    if False:',
     ['tests/test_designs.py::test_generate_samples_only_among_the_top_k']),
    ('generate ignores the temperature', 'looped.py', 'logits = logp / max(temperature, 1e-8)', 'logits = logp.clone()',
     ['tests/test_designs.py::test_generate_temperature_sharpens_and_flattens']),
    ('generate does not crop the context', 'lab/engine.py',
     'start, depths = max(0, idx.size(1) - block), []',
     'start, depths = 0, []',
     ['tests/test_designs.py::test_generate_crops_the_context_at_block_size']),
    ('generate compares h_1 with nothing', 'lab/engine.py',
     'logp, logp_prev, h_prev = None, None, e[:, -1, :]',
     'logp, logp_prev, h_prev = None, None, None',
     ['tests/test_designs.py::test_generate_stops_looping_where_each_exit_rule_says']),
    # ---- the KV cache per loop: exact where nothing is skipped, exits per sequence, sharing, rows kept apart
    ('cached positions restart at 0', 'looped.py', 't0 = 0 if cache is None else cache.length', 't0 = 0',
     [G + 'test_cached_generation_gives_the_recomputed_tokens_and_logits']),
    ('one cache entry for every loop', 'looped.py',
     "h = block(h, cache and cache.layer('loop', k, i))",
     "h = block(h, cache and cache.layer('loop', 1, i))",
     ['tests/test_generation.py::test_cached_generation_gives_the_recomputed_tokens_and_logits']),
    ('a chunk after cached keys attends causally from 0', 'looped.py',
     'return torch.ones(T, L, dtype=torch.bool, device=self.c_proj.weight.device).tril(L - T)',
     'return torch.ones(T, L, dtype=torch.bool, device=self.c_proj.weight.device).tril()',
     [G + 'test_a_chunk_after_cached_positions_sees_exactly_its_past']),
    ('the window restart keeps the full cache', 'lab/engine.py',
     'start, cache = idx.size(1) - block // 2, cache and KVCache(block)',
     'start = idx.size(1) - block // 2',
     ['tests/test_generation.py::test_cached_generation_gives_the_recomputed_tokens_and_logits']),
    ('the engine samples from another distribution than generate', 'lab/engine.py',
     'idx = torch.cat((idx, sample(logp, temperature, top_k)), dim=1)',
     'idx = torch.cat((idx, sample(logp, 1.0, top_k)), dim=1)',
     ['tests/test_generation.py::test_the_engines_cached_generation_samples_the_plain_generates_tokens']),
    ('the plain generate restarts its window elsewhere', 'looped.py',
     'start = idx.size(1) - block // 2',
     'start = idx.size(1) - block',
     ['tests/test_generation.py::test_the_engines_cached_generation_samples_the_plain_generates_tokens']),
    ('the batch exits together', 'lab/engine.py',
     'stops = passes & ~done',
     'stops = passes.all() & ~done',
     ['tests/test_generation.py::test_each_sequence_of_a_batch_exits_at_its_own_loop']),
    ('a stopped row takes the last loop', 'lab/engine.py',
     'logp = logp_k if logp is None else torch.where(stops[:, None], logp_k, logp)',
     'logp = logp_k',
     ['tests/test_generation.py::test_each_sequence_of_a_batch_exits_at_its_own_loop']),
    ('skipped loops not shared', 'lab/engine.py',
     '            cache.share(depth, n_loop)',
     '            pass',
     ['tests/test_generation.py::test_a_skipped_loops_cache_entries_are_its_last_run_loops']),
    ('sharing overwrites every row', 'lab/engine.py',
     'to[skipped, :, t] = fro[skipped, :, t]',
     'to[:, :, t] = fro[:, :, t]',
     ['tests/test_generation.py::test_a_skipped_loops_cache_entries_are_its_last_run_loops', 'tests/test_generation.py::test_no_sequence_reads_another_sequences_cache']),
    ('a prefill stops at the exit', 'lab/engine.py',
     'if done.all() and not (cache is not None and prefill):',
     'if done.all():',
     ['tests/test_generation.py::test_a_prefill_runs_every_loop_whatever_the_exit_rule']),
    # ---- readouts
    ('rmsnorm without eps', 'looped.py', 'torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)',
     'torch.rsqrt(xf.pow(2).mean(-1, keepdim=True))', ['tests/test_model.py::test_rmsnorm_keeps_its_epsilon_inside_the_root']),
    ('rmsnorm gain ignored', 'looped.py',
     'return (xf * rms_inv * self.weight).type_as(x)',
     'return (xf * rms_inv).type_as(x)',
     ['tests/test_model.py']),
    ('rmsnorm readout becomes raw', 'looped.py', "elif self.kind in ('rmsnorm', 'final_norm'):",
     "elif self.kind in ('final_norm',):", ['tests/test_model.py::test_readout_scale_invariance']),
    ('final_norm normalizes at every loop', 'looped.py', "if self.kind == 'final_norm' and k < self.n_loop:",
     "if self.kind == 'final_norm' and k < 1:", ['tests/test_model.py::test_readout_module_final_norm_rule']),
    ('alpha exponent flipped', 'looped.py', 'torch.exp((1 - self.alpha()) * (self.log_s_ref - s.log()))',
     'torch.exp(self.alpha() * (self.log_s_ref - s.log()))', ['tests/test_model.py']),
    # ---- recurrence and the inter-loop norm
    ('inter-loop norm never applied', 'looped.py', 'return h if self.inter_norm is None else self.inter_norm(h)', 'return h',
     ['tests/test_model.py']),
    ('norm before pass 1', 'looped.py',
     '        h = e\n        for k in range(1, n_loop + 1):',
     '        h = self.carry(e)\n        for k in range(1, n_loop + 1):',
     ['tests/test_model.py']),
    ('yield after the inter-loop norm', 'looped.py',
     '            yield k, h\n            h = self.carry(h)',
     '            h = self.carry(h)\n            yield k, h',
     ['tests/test_model.py']),
    ('shared stack applied once per loop, not its layers', 'looped.py',
     '        for i, block in enumerate(self.blocks):',
     '        for i, block in enumerate(self.blocks[:1]):',
     ['tests/test_model.py']),
    # ---- losses and the penalty
    ('per-loop loss summed, not averaged', 'looped.py', '            return torch.stack(ces).mean()',
     '            return torch.stack(ces).sum()', ['tests/test_model.py::test_per_loop_and_terminal_losses']),
    ('terminal loss on the first loop', 'looped.py', '        return ces[-1]', '        return ces[0]',
     ['tests/test_model.py::test_per_loop_and_terminal_losses']),
    ('penalty as squared L2 norm, not mean square', 'looped.py', 'torch.stack([h.float().pow(2).mean() for h in states])',
     'torch.stack([h.float().pow(2).sum(-1).mean() for h in states])', ['tests/test_model.py']),
    ('penalty detached', 'looped.py', 'torch.stack([h.float().pow(2).mean() for h in states])',
     'torch.stack([h.detach().float().pow(2).mean() for h in states])', ['tests/test_model.py']),
    ('norm logged after the readout norm', 'looped.py',      "stats = {'hidden_norm': torch.stack([h.detach().float().norm(dim=-1).mean()\n                                             for h in states]),",
     "stats = {'hidden_norm': torch.stack([self.readout(h, k).detach().float().norm(dim=-1).mean()\n"
     "                                             for k, h in enumerate(states, 1)]),", ['tests/test_model.py']),
    # ---- memory: checkpointed readouts, compiled head loss
    ('per-loop readouts not checkpointed', 'looped.py',
     'ce = checkpoint(self.loop_loss, h, k, targets, use_reentrant=False)[1]',
     'ce = self.loop_loss(h, k, targets)[1]',
     ['tests/test_model.py::test_per_loop_readouts_are_recomputed_in_backward_not_kept']),
    ('checkpointed readout recomputed at the wrong loop', 'looped.py',
     'ce = checkpoint(self.loop_loss, h, k, targets, use_reentrant=False)[1]',
     'ce = checkpoint(self.loop_loss, h, K, targets, use_reentrant=False)[1]',
     ['tests/test_model.py::test_checkpointed_readouts_give_the_same_gradients']),
    ('head loss left uncompiled', 'lab/runtime.py', '    model.head_loss = torch.compile(model.head_loss)', '    pass',
     ['tests/test_gpu_path.py::test_compiled_head_loss_never_writes_float32_logits']),
    ('fused AdamW never used', 'lab/designs.py', "fused=(device_type == 'cuda')", 'fused=False',
     ['tests/test_gpu_path.py::test_fused_adamw_on_cpu_matches_the_default']),
    ('dropout on the attention projection', 'looped.py', '        return self.c_proj(y)',
     '        return F.dropout(self.c_proj(y), self.dropout, self.training)', ['tests/test_model.py']),
    ('attention not causal', 'looped.py',
     'is_causal=True)',
     'is_causal=False)',
     ['tests/test_model.py::test_sdpa_matches_manual_attention']),
    # ---- early exit and its calibration
    ('KL exit rule reversed', 'lab/engine.py',
     'return (logp.exp() * (logp - logp_prev)).sum(dim=-1) <= threshold',
     'return (logp_prev.exp() * (logp_prev - logp)).sum(dim=-1) <= threshold',
     ['tests/test_model.py']),
    ('calibration skips loop-1 thresholds', 'lab/diagnose.py', "signal = pmax[:, :K] if rule == 'confidence'",
     "signal = pmax[:, 1:K] if rule == 'confidence'", ['tests/test_diagnose.py']),
    ("radial gradient 'training' column from the loop's own loss", 'lab/diagnose.py',
     '    total = torch.autograd.grad(objective, states)', '    total = [g_h for g_h, _ in direct]', ['tests/test_diagnose.py']),
    ('sample.py ignores --n_loop', 'sample.py', 'n_loop=n_loop, exit_rule=exit_rule', 'n_loop=None, exit_rule=exit_rule',
     ['tests/test_train.py::test_sample_prints_text_at_other_loop_counts']),
    # ---- training: resume, the lock, log repair, divergence
    ('resume forgets the batch order', 'train.py', "    r.data.gen.set_state(ckpt['rng']['batches'].cpu())",
     '    pass', ['tests/test_train.py::test_resume_continues_the_same_curve']),
    ('no lock on out_dir', 'lab/train.py', '        self.lock = lock_folder(args.out_dir)', '        self.lock = None',
     ['tests/test_train.py::test_a_lock_held_by_a_live_process_refuses_the_run_and_names_its_pid']),
    ('log repair keeps records past the checkpoint', 'data/run_folder.py',
     "kept = [r for r in records[1:] if r['step'] <= ckpt['last_eval_step']]", 'kept = [r for r in records[1:]]', ['tests/test_faults.py::test_resume_drops_records_past_the_checkpoint']),
    ('log repair does not restore a lost record', 'data/run_folder.py',
     "    if ckpt.get('record') and (not kept or kept[-1]['step'] < ckpt['last_eval_step']):", '    if False:',
     ['tests/test_faults.py::test_resume_repairs_a_cut_line_and_restores_a_lost_record']),
    ('a folder mixing two runs is resumed', 'data/run_folder.py', "    if records[0].get('run_id') != ckpt.get('run_id'):", '    if False:',
     ['tests/test_faults.py::test_resume_refuses_a_folder_that_mixes_two_runs']),
    ('NaN training loss not stopped', 'train.py', '        if not math.isfinite(v):', '        if False:',
     ['tests/test_train.py::test_nan_loss_stops_and_keeps_last_checkpoint']),
    ('evaluation stops at K instead of 2K', 'train.py', 'evaluate(r.raw_model, val_batches, 2 * K, r.ctx)',
     'evaluate(r.raw_model, val_batches, K, r.ctx)', ['tests/test_train.py::test_smoke_run_writes_log_and_checkpoint']),
    ('Ctrl-C exits without saving', 'train.py', '        if stop:\n            save(r)', '        if stop:\n            pass',
     ['tests/test_train.py::test_ctrl_c_saves_and_resumes']),
    ('a signal kills instead of saving', 'train.py', '        self.old = {s: signal.signal(s, self.handle)',
     '        self.old = {s: signal.signal(s, signal.getsignal(s))', ['tests/test_train.py::test_ctrl_c_saves_and_resumes']),
    ('the log written before the checkpoint', 'train.py',
     "            if r.step > 0:\n                save(r)  # the checkpoint first: the log never runs ahead of it\n"
     "            if r.rank == 0:\n                log_record(os.path.join(args.out_dir, 'log.jsonl'), record)",
     "            if r.rank == 0:\n                log_record(os.path.join(args.out_dir, 'log.jsonl'), record)\n"
     "            if r.step > 0:\n                save(r)",
     ['tests/test_faults.py::test_a_full_disk_at_a_save_is_one_line_and_keeps_the_previous_checkpoint']),
    # ---- bench --suite's own checks
    ('bench compares eager with eager', 'lab/bench.py', "model, opt, _, _ = build(rt, V, B, compile, supervision='per_loop', **dims)",
     "model, opt, _, _ = build(rt, V, B, False, supervision='per_loop', **dims)",
     ['tests/test_bench.py::test_suite_on_a_cpu_prints_the_table_and_writes_json']),
    ('bench blind-spot pair silently not measured', 'lab/bench.py',
     "pair = [f'--config={config}', f'--max_iters={pair_steps}'", "pair = ['--dataset=nowhere', f'--config={config}', f'--max_iters={pair_steps}'",
     ['tests/test_bench.py::test_suite_on_a_cpu_prints_the_table_and_writes_json']),
    ('generation tokens/s count one sequence of the batch', 'lab/bench.py',
     'cached, recomputed = B * new / best[True, new], B * n / best[False, n]',
     'cached, recomputed = new / best[True, new], n / best[False, n]',
     ['tests/test_bench.py::test_generation_tokens_per_second_count_every_sequence_of_the_batch']),
    # ---- data preparation
    ('token ids past the vocabulary accepted', 'data/common.py',
     "if ids.size == 0 or ids.min() < 0 or ids.max() >= meta['vocab_size']:", 'if ids.size == 0:',
     ['tests/test_faults.py::test_write_dataset_refuses_ids_outside_the_vocabulary']),
    # ---- trust nothing that is loaded
    ('checkpoints loaded with weights_only=False', 'data/run_folder.py', 'torch.load(path, map_location=device, weights_only=True)',
     'torch.load(path, map_location=device, weights_only=False)', ['tests/test_trust.py::test_a_crafted_checkpoint_runs_nothing_anywhere']),
    ('meta.pkl unpickled without restriction', 'data/common.py', '                meta = PlainUnpickler(io.BytesIO(f.read())).load()',
     '                meta = pickle.load(f)', ['tests/test_trust.py::test_a_crafted_meta_pkl_runs_nothing']),
    ('planted links in a run folder not refused', 'data/run_folder.py', '        if os.path.islink(os.path.join(out_dir, name)):',
     '        if False:', ['tests/test_trust.py']),
    ('temporaries opened the ordinary way (following links)', 'data/common.py',
     "    if os.path.lexists(path):\n        os.remove(path)\n    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, 'O_NOFOLLOW', 0) | getattr(os, 'O_BINARY', 0)\n    return os.fdopen(os.open(path, flags, 0o644), 'wb')",
     "    return open(path, 'wb')", ['tests/test_trust.py']),
    ('resume on other data not refused', 'train.py',
     "        check_same_data(ckpt, data.meta, data.identity, os.path.join(args.out_dir, 'ckpt.pt'))", '        pass', ['tests/test_trust.py::test_resume_stays_on_the_runs_dataset_and_refuses_another']),
    ('resume falls back to the default dataset', 'train.py', "        if name not in given:\n            setattr(args, name,",
     "        if name == 'seed' and name not in given:\n            setattr(args, name,",
     ['tests/test_trust.py::test_resume_stays_on_the_runs_dataset_and_refuses_another']),
    ('splits not checked against meta.json', 'data/common.py', "        if expected is not None and expected != files[f'{split}.bin']:",
     '        if False:', ['tests/test_trust.py::test_a_kill_between_the_renames_of_a_prepare_is_refused_not_trained_on']),
    ('nan gradient clip accepted', 'train.py', "('grad_clip', finite(a.grad_clip) and a.grad_clip >= 0,",
     "('grad_clip', True,", ['tests/test_trust.py::test_train_flags_that_would_change_what_is_trained_are_refused']),
    ('download keeps an unverified file', 'data/common.py', '            verify(tmp)\n', '            pass\n',
     ['tests/test_download.py']),
    ('download sends no User-Agent', 'data/common.py', "headers={'User-Agent': USER_AGENT}", 'headers={}',
     ['tests/test_download.py']),
    ('shipped corpus not checksummed', 'data/shakespeare_char/prepare.py',
     'if hashlib.sha256(f.read()).hexdigest() != EXPECTED_SHA256:', 'if False:', ['tests/test_download.py']),
    ('char split 80/20 instead of 90/10', 'data/shakespeare_char/prepare.py', '    n = int(0.9 * len(text))',
     '    n = int(0.8 * len(text))', ['tests/test_download.py', 'tests/test_train.py::test_prepare_char_on_a_local_file']),
    # ---- the training step and the model's wiring: each has a test of its own in tests/test_wiring.py
    ('targets are the inputs, not the next tokens', 'train.py', 'x, y = w[:, :-1], w[:, 1:]',
     'x, y = w[:, :-1], w[:, :-1]', [W + 'test_batch_targets_are_the_next_tokens_of_the_inputs']),
    ('gradient accumulation sums the micro-steps', 'train.py', 'r.scaler.scale(loss / r.micro_steps).backward()',
     'r.scaler.scale(loss).backward()',
     [W + 'test_gradient_accumulation_gives_the_gradient_of_one_large_batch']),
    ('gradient clipped at 1.0 whatever --grad_clip says', 'train.py',
     'clip_grad_norm_(model.parameters(), args.grad_clip)', 'clip_grad_norm_(model.parameters(), 1.0)',
     [W + 'test_gradient_clipping_clips_to_the_flag']),
    ('paper init trains without weight decay', 'lab/designs.py', "groups = [{'params': [p for p in params if decays(p)], 'weight_decay': weight_decay},",
     "groups = [{'params': [p for p in params if decays(p)], 'weight_decay': 0.0},", [W + 'test_optimizer_parameter_groups_under_each_init']),
    ('gpt2 init decays the norm gains too', 'lab/designs.py', "(self.config.init != 'gpt2' or p.dim() >= 2)",
     "(self.config.init != 'gpt2' or p.dim() >= 1)", [W + 'test_optimizer_parameter_groups_under_each_init']),
    ('no position embedding', 'looped.py', 'return self.drop(self.wte(idx) + self.wpe(pos))',
     'return self.drop(self.wte(idx))', [W + 'test_embedding_is_token_plus_position']),
    ('head never tied to the embedding', 'looped.py', '            self.lm_head.weight = self.wte.weight',
     '            pass', [W + 'test_weight_tying_under_each_init']),
    ('tied under every init', 'lab/designs.py',
     "self.tie_weights = self.init != 'gpt2'",
     'self.tie_weights = True',
     ['tests/test_wiring.py::test_weight_tying_under_each_init']),
    ('layernorm readout is an RMSNorm', 'looped.py',
     'self.norm = nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=False)',
     'self.norm = RMSNorm(config.n_embd, config.norm_eps)', [W + 'test_each_readout_kind_is_told_apart_from_every_other']),
    ('SwiGLU gated through gelu', 'looped.py', 'u = F.silu(self.c_fc(x)) * self.c_gate(x)',
     'u = F.gelu(self.c_fc(x)) * self.c_gate(x)', [W + 'test_mlp_activation_under_each_choice']),
    ('GELU MLP uses relu', 'lab/designs.py', 'return self.drop(self.c_proj(F.gelu(self.c_fc(x))))',
     'return self.drop(self.c_proj(F.relu(self.c_fc(x))))',
     [W + 'test_mlp_activation_under_each_choice']),
    ('evaluation with dropout on', 'train.py', '    model.eval()\n    ce, norm, n = 0.0, 0.0, 0',
     '    ce, norm, n = 0.0, 0.0, 0', [W + 'test_evaluate_turns_dropout_off_and_back_on']),
    ('evaluation leaves dropout off', 'train.py', '    model.train()\n    return (ce / n)', '    return (ce / n)',
     [W + 'test_evaluate_turns_dropout_off_and_back_on']),
    ('validation loss read from the training split', 'train.py', "data.fixed_batches('val', args.eval_iters)",
     "data.fixed_batches('train', args.eval_iters)", [W + 'test_evaluation_reads_the_validation_split']),
    ('paired standard error with the population std', 'lab/stats.py', 'se = d.std(axis=0, ddof=1) / math.sqrt(n)',
     'se = d.std(axis=0, ddof=0) / math.sqrt(n)', [W + 'test_paired_standard_error_is_the_sample_std_over_root_n']),
    ('matched depth read at the nearest threshold, not between two', 'lab/matched_depth.py',
     '    out = np.interp(grid, depths, losses)',
     '    out = losses[np.abs(depths[None, :] - grid[:, None]).argmin(axis=1)].astype(float)',
     ['tests/test_matched_depth.py::test_read_at_interpolates_between_neighbouring_thresholds_and_never_extrapolates']),
    ('matched-depth pairs not paired by seed', 'lab/matched_depth.py',
     "curves[ref['folder']][ref_score][:len(grid)]", "curves[entry['pairs'][0][2]['folder']][ref_score][:len(grid)]",
     ['tests/test_matched_depth.py::test_pairs_are_compared_seed_by_seed_at_each_depth']),
    # ---- writers and run folders (tests/test_writers.py)
    ('writers expect their folders to exist', 'data/common.py', "    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)\n    try:",
     '    try:', ['tests/test_writers.py::test_diagnose_writes_its_figure_into_folders_it_creates']),
    ('a log without a checkpoint is a run to keep', 'data/run_folder.py',
     "    has_records = os.path.exists(log) and len(open(log, 'rb').read().strip().split(b'\\n')) > 1",
     '    has_records = os.path.exists(log)', ['tests/test_writers.py::test_a_run_killed_before_its_first_save_is_no_dead_end']),
    # ---- behaviours that a breakage once left untested, and the cost grid's statistics
    ('gate on the readout skips the coda\'s other positions', 'lab/engine.py',
     'return model.gate_logit(h if coda else h[:, -1:, :], k, cache)[:, -1]',
     'return model.gate_logit(h[:, -1:, :], k, cache)[:, -1]',
     ['tests/test_gate.py::test_each_sequence_exits_where_its_own_cumulative_exit_probability_reaches_the_threshold']),
    ('blocks compiled under the Jacobian penalty', 'lab/runtime.py',
     "jacobian = getattr(model.config, 'jacobian_penalty', 0) > 0",
     'jacobian = False',
     ['tests/test_gpu_path.py::test_compiled_regions_train_with_the_jacobian_penalty_as_eager_does']),
    ('plain generate keeps the whole window once it is over full', 'looped.py',
     'start = idx.size(1) - block // 2', 'start = idx.size(1) - block',
     ['tests/test_generation.py::test_the_plain_generate_reads_only_its_window_of_a_prompt_longer_than_block_size']),
    ('decay min and max swapped in the log', 'lab/report.py',
     "values['decay'] = [decay.mean().item(), decay.min().item(), decay.max().item()]",
     "values['decay'] = [decay.mean().item(), decay.max().item(), decay.min().item()]",
     [B + 'test_the_decays_mean_min_and_max_are_logged_and_shown_in_their_places']),
    ('the prelude registered before the stack', 'lab/designs.py',
     '        self.blocks = nn.ModuleList([DesignBlock(c) for _ in range(c.n_layer)])',
     '        self.prelude = nn.ModuleList()\n        self.blocks = nn.ModuleList([DesignBlock(c) for _ in range(c.n_layer)])',
     ['tests/test_designs.py::test_parameters_are_registered_in_the_order_the_committed_runs_trained_in']),
    ('Holm counts only the comparisons tested so far', 'lab/stats.py', 'adjusted, running, m = np.full(len(p), np.nan), 0.0, len(p)',
     'adjusted, running, m = np.full(len(p), np.nan), 0.0, len(tested)',
     ['tests/test_stats.py::test_holm_adjusts_a_family_as_computed_by_hand']),
    ('a cost family filtered to its measured comparisons before Holm', 'lab/cost.py', '    family_verdicts(rows, MARGIN, ALPHA)',
     '    family_verdicts([r for r in rows if r[\'n\'] > 1], MARGIN, ALPHA)',
     ['tests/test_cost.py::test_holm_counts_every_declared_comparison_even_one_not_yet_measured']),
    ('Holm without the step-down factor', 'lab/stats.py', 'running = max(running, min(1.0, (m - rank) * p[i]))',
     'running = max(running, min(1.0, m * p[i]))',
     ['tests/test_stats.py::test_holm_adjusts_a_family_as_computed_by_hand']),
    ('TOST takes the smaller one-sided p', 'lab/stats.py', 'return p_value(mean / se, df), max(below, above)',
     'return p_value(mean / se, df), min(below, above)',
     ['tests/test_stats.py::test_tost_and_the_two_sided_p_match_the_t_distribution_by_hand']),
    ('verdicts left unadjusted', 'lab/stats.py', 'elif p < alpha:', "elif test['p'] < alpha:",
     ['tests/test_stats.py::test_family_verdicts_use_the_one_vocabulary_after_holm']),
    ('tables spread with the population std', 'lab/stats.py',
     'return values.std(axis=axis, ddof=1) if values.shape[axis] > 1',
     'return values.std(axis=axis, ddof=0) if values.shape[axis] > 1',
     ['tests/test_atlas.py::test_the_sharper_verdicts_by_hand']),
    ('table numbers rounded twice', 'lab/stats.py', '    text = format(v, f)\n',
     '    text = format(round(v, 4), f)\n', ['tests/test_stats.py::test_a_table_number_is_rounded_once']),
    ('a committed finished run trained again', 'lab/grid.py',
     "        if committed and not os.path.exists(os.path.join(folder, 'log.jsonl')) and finished(committed, cmd):",
     '        if False:', ['tests/test_cost.py::test_a_run_committed_finished_is_not_trained_again']),
    ('the logged turn measured from the embedding at every loop', 'train.py',
     '            h_prev = h\n    model.train()\n    return turns', '    model.train()\n    return turns', ['tests/test_cost.py::test_the_logged_turn_is_the_angle_between_consecutive_states_by_hand']),
    ('precision read at the wrong depth', 'lab/diagnose.py', 'if k in (K, 2 * K):', 'if k in (K - 1, 2 * K):',
     ['tests/test_cost.py::test_precision_in_float32_is_the_models_own_loss_at_k_and_2k']),
    ('the penalty gap closed measured against the wrong end', 'lab/cost.py',
     '        closed = (L[0] - L[3]) / (L[0] - loss_at(cells[raw][seed], 4))',
     '        closed = (L[0] - L[3]) / (L[3] - loss_at(cells[raw][seed], 4))',
     ['tests/test_cost.py::test_the_single_run_predictions_are_counted_run_by_run_with_their_misses_named']),
    ('a useful loop counted at the first exit', 'lab/cost.py',
     '            n = sum(loss[k - 1] - loss[k] > MARGIN for k in range(1, 4))',
     '            n = sum(loss[k - 1] - loss[k] >= 0 for k in range(1, 4))',
     ['tests/test_cost.py::test_the_single_run_predictions_are_counted_run_by_run_with_their_misses_named']),
    ('the raw turn checked at its largest', 'lab/cost.py',
     '        worst = max(later) if rms else min(later)', '        worst = max(later)',
     ['tests/test_cost.py::test_the_single_run_predictions_are_counted_run_by_run_with_their_misses_named']),
    # ---- a run seen from outside train.py (tests/test_behaviours.py): torchrun's batches and unused parameters,
    # the progress line's mean loss and its clock, the configs' refusals
    ('dropout of 1 accepted', 'looped.py', "('dropout', 0.0 <= self.dropout < 1.0,", "('dropout', 0.0 <= self.dropout <= 1.0,",
     [T + 'test_an_impossible_dropout_or_gate_beta_is_refused_in_one_line_and_harms_no_run']),
    ('a negative gate_beta accepted', 'lab/designs.py', "('gate_beta', 0 <= self.gate_beta < math.inf,",
     "('gate_beta', -math.inf < self.gate_beta < math.inf,",
     [T + 'test_an_impossible_dropout_or_gate_beta_is_refused_in_one_line_and_harms_no_run']),
    ('DDP never told that a parameter may go unused', 'lab/designs.py',
     "        return (self.depth_sampling != 'fixed' or self.bptt > 0 or self.recurrence != 'residual'",
     "        return False and (self.depth_sampling != 'fixed' or self.bptt > 0 or self.recurrence != 'residual'",
     [T + 'test_under_torchrun_a_step_that_leaves_a_parameter_without_a_gradient_trains']),
    ("DDP not told that normed recurrence's norm may go unused", 'train.py',
     "return config.recurrence == 'normed' or config.readout == 'final_norm'", "return config.readout == 'final_norm'",
     [T + 'test_under_torchrun_one_normed_loop_leaves_the_inter_loop_norm_without_a_gradient_and_trains']),
    ('every process draws the same batches', 'train.py', 'args.seed + rank)', 'args.seed)',
     [T + 'test_under_torchrun_each_process_trains_on_its_own_batches']),
    ('progress loss summed over micro-steps', 'train.py', 'lossf = lossf + loss.detach() / r.micro_steps',
     'lossf = lossf + loss.detach()', [T + 'test_under_grad_accum_the_progress_loss_is_the_mean_over_micro_steps_not_the_sum']),
    ('progress loss summed over processes', 'train.py', 'return shared[0] / r.world, shared[1] / r.world, shared[2].item() > 0',
     'return shared[0], shared[1] / r.world, shared[2].item() > 0', [T + 'test_under_torchrun_the_progress_loss_is_the_mean_over_processes_not_the_sum']),
    ('ms/step counts the evaluation', 'train.py', 'progress.t_last += time.time() - t_eval', 'pass',
     [T + 'test_progress_ms_per_step_leaves_the_evaluation_out']),
]


def scratch_copy(dest):
    """The working tree without git, outputs, caches or prepared data (the tests prepare their own)."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns('.git', 'out', '__pycache__', '.pytest_cache', '*.bin',
                                                              '*.pkl', '*.pt', '*.zip'))


def run_one(copy, name, path, old, new, tests, timeout):
    """Apply one breakage in the copy, run its tests, restore the file. Returns (caught, seconds, note)."""
    target = os.path.join(copy, path)
    with open(target) as f:
        source = f.read()
    if source.count(old) != 1:
        sys.exit(f"mutations.py: error: {name!r}: the line to break occurs {source.count(old)} times in {path}, "
                 f"not once; update the list to follow the code")
    try:
        with open(target, 'w') as f:
            f.write(source.replace(old, new))
        py_compile.compile(target, doraise=True)
        t0 = time.time()
        try:
            r = subprocess.run([sys.executable, '-m', 'pytest', '-x', '-q', '-p', 'no:cacheprovider', *tests], cwd=copy,
                               capture_output=True, text=True, timeout=timeout)
            caught, note = r.returncode != 0, r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ''
            if r.returncode in (4, 5):  # pytest's usage error / no tests collected: the list names a wrong test
                sys.exit(f"mutations.py: error: {name!r}: pytest could not run {tests}: {note}")
        except subprocess.TimeoutExpired:
            caught, note = False, f'timed out after {timeout} s (a test that hangs is not a test that fails)'
        return caught, time.time() - t0, note
    except py_compile.PyCompileError as e:
        sys.exit(f"mutations.py: error: {name!r} does not compile: {e.msg}")
    finally:
        with open(target, 'w') as f:
            f.write(source)


def choose(only):
    """The breakages --only picks: the one whose whole name it is (any case), else every one with a word in its
    name that starts with it (any case: --only=kl picks the KL rule, not 'meta.pkl')."""
    exact = [m for m in MUTATIONS if m[0].lower() == only.strip().lower()]
    return exact or [m for m in MUTATIONS if re.search(r'\b' + re.escape(only), m[0], re.IGNORECASE)]


def get_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--only', default='', help='run the breakages with a word in their name that starts with this '
                                              "text (any case; --only=loop picks every name with 'loop', 'loops'...); "
                                              "a breakage's whole name, quoted, picks that one alone "
                                              "(--only='add injects e at pass 1 only'; --list shows the names)")
    p.add_argument('--list', action='store_true', help='list the breakages and their tests, run nothing')
    p.add_argument('--timeout', type=int, default=180, help='seconds one breakage\'s tests may take')
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    chosen = choose(args.only)
    if not chosen:
        sys.exit(f"mutations.py: error: no breakage name has a word starting with {args.only!r}")
    if args.list:
        for name, path, _, _, tests in chosen:
            print(f"{name:55s} {path:32s} {' '.join(tests)}")
        return
    rows, t_start = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, 'repo')
        scratch_copy(copy)
        for i, (name, path, old, new, tests) in enumerate(chosen, 1):
            caught, seconds, note = run_one(copy, name, path, old, new, tests, args.timeout)
            rows.append((name, tests, caught, seconds))
            eta = (time.time() - t_start) / i * (len(chosen) - i)
            print(f"[{i}/{len(chosen)}, ETA {eta / 60:.0f} min] {'caught' if caught else 'NOT CAUGHT'}: {name} "
                  f"({seconds:.0f} s; {note})", flush=True)
    print('\n| breakage | tests run | caught | seconds |\n|---|---|---|---|')
    for name, tests, caught, seconds in rows:
        print(f"| {name} | {', '.join(t.replace('tests/', '') for t in tests)} | {'yes' if caught else '**no**'} | {seconds:.0f} |")
    n_caught = sum(caught for _, _, caught, _ in rows)
    print(f"\n{n_caught} of {len(rows)} breakages caught by tests/, in {(time.time() - t_start) / 60:.1f} min")
    sys.exit(0 if n_caught == len(rows) else 1)


if __name__ == '__main__':
    main()
