"""Run train.py's main() under torchrun, then save this process's final weights to $WEIGHTS_DIR/rank<R>.pt, so
that a test can compare every parameter tensor of every process itself instead of trusting train.py's report.

    WEIGHTS_DIR=/tmp/w torchrun --standalone --nproc_per_node=2 tests/ddp_worker.py --device=cpu ...
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402  (after the path: this file runs as a script from anywhere)

models = []


class Recorded(train.DesignedGPT):
    """The model train.py builds, remembered so that its weights can be saved once main() returns."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        models.append(self)


train.DesignedGPT = Recorded
train.main(sys.argv[1:])
weights = {name: t.detach().cpu().clone() for name, t in models[-1].state_dict().items()}
torch.save(weights, os.path.join(os.environ['WEIGHTS_DIR'], f"rank{os.environ['RANK']}.pt"))
