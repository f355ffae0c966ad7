"""Run train.py's main() (through python -m lab.train's, so designs train too) under torchrun, watching from outside
train.py: this process's first training batches are saved to $WEIGHTS_DIR/rank<R>-batches.pt as they are drawn, and its
final weights to $WEIGHTS_DIR/rank<R>.pt once main() returns, so that a test can compare what every process trained on
and every parameter tensor it ended with, instead of trusting train.py's report.

    WEIGHTS_DIR=/tmp/w torchrun --standalone --nproc_per_node=2 tests/ddp_worker.py --device=cpu ...

Both hooks are torch's, not train.py's: the model is the one handed to DistributedDataParallel, and a training
batch is the (B, T) token tensor that an nn.Embedding reads in training mode with gradients on (evaluation runs in
eval mode; the position embedding reads a 1-D tensor).
"""

import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lab import train  # noqa: E402  (after the path; lab.train: train.py's main, designs too)

OUT, RANK = os.environ['WEIGHTS_DIR'], os.environ['RANK']
KEPT_BATCHES = 2
models, batches = [], []
wrap, embed = DistributedDataParallel.__init__, torch.nn.Embedding.forward


def recorded_wrap(self, module, *args, **kwargs):
    """The model train.py builds, remembered so that its weights can be saved once main() returns."""
    models.append(module)
    wrap(self, module, *args, **kwargs)


def recorded_embed(self, idx):
    """Each of the first training batches' tokens, saved at once (a run that fails later still leaves them)."""
    if self.training and torch.is_grad_enabled() and idx.dim() == 2 and len(batches) < KEPT_BATCHES:
        batches.append(idx.detach().cpu().clone())
        torch.save(batches, os.path.join(OUT, f'rank{RANK}-batches.pt'))
    return embed(self, idx)


DistributedDataParallel.__init__ = recorded_wrap
torch.nn.Embedding.forward = recorded_embed
train.main(sys.argv[1:])
weights = {name: t.detach().cpu().clone() for name, t in models[-1].state_dict().items()}
torch.save(weights, os.path.join(OUT, f'rank{RANK}.pt'))
