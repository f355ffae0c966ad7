"""
Which functions each assignment asks students to write, by file and qualified name.
make_student.py replaces the bodies of exactly these (docstring and signature kept) with a
NotImplementedError, so the reference code in looped.py and the lab carries
no markers of its own. Keep this list and the handout in step.
"""

ASSIGNMENTS = {
    'a1': ('Readouts and scale invariance',
           ['looped.py::RMSNorm.forward', 'looped.py::Readout.forward']),
    'a2': ('The zero radial gradient, in closed form',
           ['lab/diagnose.py::rmsnorm_radial_grad']),
    # the recurrence: loops and what a pass starts from (carry); the designs' seams in lab/designs.py
    # are A8's
    'a3': ('The loop: residual and normed recurrence',
           ['looped.py::LoopedGPT.loops', 'looped.py::LoopedGPT.carry']),
    'a4': ('Dense versus terminal supervision',
           ['looped.py::LoopedGPT.supervision_loss']),
    'a5': ('The norm penalty, and the blind spot in training',
           ['looped.py::LoopedGPT.penalty_loss']),
    'a6': ('The alpha readout',
           ['looped.py::AlphaNorm.forward']),
    'a7': ('Calibrated early exit',
           ['lab/engine.py::exit_passes', 'lab/diagnose.py::exit_depths',
            'lab/diagnose.py::calibrate_exit']),
    # the designs' math lives in lab/designs.py, in functions that only a non-default design calls
    # (injection != 'none', block='sandwich'), so that A3's loop, run under the defaults, never needs A8
    'a8': ("The field's designs",
           ['lab/designs.py::DesignedGPT.inject', 'lab/designs.py::DesignBlock.sandwich_forward']),
}
