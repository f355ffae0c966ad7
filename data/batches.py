"""
The batches train.py trains and evaluates on: a dataset's train.bin and val.bin as uint16 arrays,
random training windows drawn from a seeded generator (saved in the checkpoint, for an exact
resume), and fixed evaluation windows, the same at every evaluation. An epoch is the authors'.
"""

import math

import numpy as np
import torch

from data import open_dataset
from data.common import InputError


class Data:
    """train.bin / val.bin as uint16 arrays, random training windows, fixed evaluation windows."""
    def __init__(self, dataset, block_size, batch_size, device, seed):  # dataset: name or folder
        self.folder, self.meta, self.splits, self.identity = open_dataset(dataset)  # all checked
        self.T, self.B, self.device = block_size, batch_size, device
        for split, data in self.splits.items():
            if len(data) <= block_size + 1:
                raise InputError(f"{self.folder}/{split}.bin has {len(data)} tokens, too few for "
                                 f"block_size={block_size}")
        self.gen = torch.Generator().manual_seed(seed)  # saved in the checkpoint, for exact resume

    def _batch(self, data, starts):
        # one fancy-indexing gather of (B, T + 1) windows: 10x faster than stacking B slices
        windows = np.asarray(starts)[:, None] + np.arange(self.T + 1)
        w = torch.from_numpy(data[windows].astype(np.int64))
        x, y = w[:, :-1], w[:, 1:]  # (B, T) each: y is x shifted by one
        if self.device.startswith('cuda'):  # pinned memory: the copy overlaps with the GPU's work
            return (x.pin_memory().to(self.device, non_blocking=True),
                    y.pin_memory().to(self.device, non_blocking=True))
        return x.to(self.device), y.to(self.device)

    def train_batch(self):
        data = self.splits['train']
        starts = torch.randint(len(data) - self.T - 1, (self.B,), generator=self.gen).numpy()
        return self._batch(data, starts)

    def fixed_batches(self, split, n_batches):
        """Up to n_batches batches of windows spread evenly over the split, the same in every
        evaluation; no more windows than fit without overlap (so a tiny split stays cheap)."""
        data = self.splits[split]
        n = max(1, min(n_batches * self.B, (len(data) - 1) // self.T))
        starts = np.linspace(0, len(data) - self.T - 1, n).astype(np.int64).tolist()
        return [self._batch(data, starts[i:i + self.B]) for i in range(0, n, self.B)]


def steps_from_epochs(epochs, n_tokens, block_size, global_batch):
    """(steps, windows per epoch), an epoch being the authors': windows at stride block_size/2"""
    windows = (n_tokens - block_size - 1) // (block_size // 2) + 1
    return math.ceil(epochs * windows / global_batch), windows
