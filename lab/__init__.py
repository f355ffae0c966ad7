"""
The lab: everything around the model that the paper's measurements need. The model is looped.py and the training
loop train.py, at the repository's root; the tools here run from the root as `python -m lab.<tool>`.

    train          training a design: train.py's flags, data, loop and checkpoints with DesignedGPT
                   (python -m lab.train <train.py's flags> <design flags>)
    sample         sampling a design run's checkpoint, with the designs' own exits (python -m lab.sample)
    paper          the paper's paired tables, the crossover's paired gap and the early-exit benchmark,
                   from plot_norms.py's run folders (python -m lab.paper)
    designs        the field's looped designs, an extension of looped.py's model: DesignConfig, DesignedGPT, and
                   their train.py flags (add_design_flags; any of them on, train.py trains DesignedGPT)
    configs        the variant fields that name runs and conditions (train.py's named configurations and
                   nanoGPT's habits, from plumbing/, read here under the lab's names)
    engine         generation: the KV cache per layer and loop, per-sequence early exit, the exit rules
    runs           loading a checkpoint as the class that trained it, the names of runs
    runtime        device, dtype and compile for the lab's tools (resolve_device), MFU, timing
    grid           the grids of conditions, training them, reading their logs
    stats          paired statistics across seeds
    report         the tables, CSV files and figures every tool writes, their shared flags and one-line errors;
                   what a design learned, in train.py's log and eval line
    diagnose       measurements of a trained model (python -m lab.diagnose)
    matched_depth  the exit rules at matched depth (python -m lab.matched_depth)
    atlas          the field's designs under rmsnorm and raw (python -m lab.atlas)
    verdicts       every earlier loss verdict restated with Holm and TOST (python -m lab.verdicts)
    cost           where the blind spot costs: the cost grid's predictions and tables (python -m lab.cost)
    converge       cost or delay: the cost at convergence and at each readout's best rate (python -m lab.converge)
    interaction    whose cost: the readout x loops interaction at the convergence recipe (python -m lab.interaction)
    one_pass       why rmsnorm costs with one pass: the head, the stack's scale, the endpoint, the rate
                   (python -m lab.one_pass)
    answers        the answer tokens' loss and accuracy by exit depth, on a task with answers (python -m lab.answers)
    testbed        do the loops help on chained assignment (data/chains)? K = 4 against K = 1 (python -m lab.testbed)
    norm_course    the norm's course over long training (python -m lab.norm_course)
    bench          the training step's speed (python -m lab.bench)
    compare        this checkout's step and generation timed against another's (python -m lab.compare)
"""
