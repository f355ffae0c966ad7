"""
Sentences of the reference files that answer a written question, or point at a file the student copy leaves out,
and what the student copy says instead. make_student.py applies them to the copy only: the reference files stay
as they are. This list lives in the key because each entry quotes the answer it removes.

Each entry is (file, the reference text, its replacement in the copy[, required]). make_student.py refuses to
write a copy when a required reference text is not found exactly once (the source changed under it): an answer
would otherwise ship unnoticed. An optional one (required False) may be absent. Whitespace inside a docstring counts, so
quote it as the file has it.
"""

REDACTIONS = [
    # A2 Q1 asks for the derivation: the docstring keeps the result and loses the intermediate gradient
    ('lab/diagnose.py',
     '        dL/dh = weight * grad_y / r - h * S / (d * r^3),   so   <dL/dh, h> = (S / r) * eps / r^2,\n',
     '        <dL/dh, h> = (S / r) * eps / r^2,\n'),
    # A4 Q1 asks through which path terminal supervision reaches the early loops
    ('lab/diagnose.py',
     "    # 'own CE': loop k's cross-entropy through its readout alone; 'training': the whole objective, which also\n"
     "    # reaches h_k through the later loops\n",
     "    # 'own CE': loop k's cross-entropy through its readout alone; 'training': the whole objective\n"),
    # A4 Q3 and A5 Q1 ask what the runs show
    ('train.py',
     '    python train.py --readout=rmsnorm --norm_penalty=0  '
     '# the blind spot: ||h_K|| ~930\n'
     '    python train.py --readout=raw                       '
     '# the loss sees the scale: ||h_K|| small\n',
     '    python train.py --readout=rmsnorm --norm_penalty=0  '
     '# the scale-invariant readout, no penalty\n'
     '    python train.py --readout=raw                       # no norm before the head\n'),
    # pointers at sections of the project README, which the copy replaces with the student README: optional
    # (False), since no answer ships if one disappears from the source; the instructor check finds any new one
    ('looped.py', ' (README: "Where this differs from the paper").', '.', False),
    ('looped.py', ' (docs/results.md: "Where this differs from the paper").', '.', False),
    ('sample.py', "# out/laptop, the run of the README's main command", '# out/laptop, the default run of train.py',
     False),
    ('data/shakespeare_char/prepare.py', 'so the counts differ from the README\'s")',
     'so the counts differ from the classic file\'s")', False),
    # pointers at the project's test suite and docs, which the copy leaves out
    ('lab/engine.py', ' (tests/test_generation.py pins\nit) while', '\nwhile', False),
    ('lab/designs.py', ' (tests/test_designs.py), so', ', so', False),
    ('lab/designs.py', ' Adding a design: docs/usage.md, "Adding a design".\n', '\n'),
    # A8 Q1 asks for the student's own predictions before the repository's, which sit in DESIGNS, below the two
    # functions A8 has the student write in the same file: the copy says where they start and to stop there
    ('lab/designs.py', '\nDESIGNS = {\n',
     "\n# A8 (assignments/README.md): each design's predicted= entry from here on is the repository's own prediction\n"
     "# for written question 1. Write your predictions before you read on.\nDESIGNS = {\n"),
    # A7 has the student write the exit rules (lab/engine.py exit_passes): looped.py's generate, which sample.py
    # calls, spells them out, so the copy's generate calls the student's exit_passes instead
    ('looped.py',
     "            passes = k == n_loop\n"
     "            if rule == 'confidence':\n"
     "                passes = passes | (logp_k.max(dim=-1).values.exp() >= threshold)\n"
     "            elif rule == 'latent':\n"
     "                change = (z - z_prev).norm(dim=-1) / z_prev.norm(dim=-1).clamp_min(1e-12)\n"
     "                passes = passes | (change <= threshold)\n"
     "            elif rule == 'kl' and k > 1:\n"
     "                passes = passes | ((logp_k.exp() * (logp_k - logp_prev)).sum(dim=-1) <= threshold)\n",
     "            from lab.engine import exit_passes  # A7: the rules are the ones you write there\n"
     "            passes = (k == n_loop) | exit_passes(rule, threshold, logp_k, logp_prev, z, z_prev)\n"),
]
