"""
The loader train.py reads its data with (load_data): find a dataset (by name or folder; the
default one is prepared on first use) and read it back with every check; and the batches: the
windows that begin at given positions (get_batch; train.py draws the training ones from its seeded
generator) and the fixed evaluation windows (eval_batches). A checkpoint is only ever read with the
data it was trained on (check_same_data).
"""

import io
import json
import os
import pickle

import numpy as np
import torch

from data.common import FILES, MAX_VOCAB, InputError, PrepareError, file_hash, vocab_hash

HERE = os.path.dirname(os.path.abspath(__file__))
DATASETS = ('shakespeare_char', 'shakespeare', 'wikitext103', 'chains')


def find_dataset(name):
    """The folder of a dataset given by name or path; the default one is prepared on first use (from
    the text that ships with the repository). InputError with a one-line hint when it cannot be
    had."""
    if name in DATASETS:
        folder = os.path.join(HERE, name)
    elif os.path.isdir(name):
        folder = name
    else:
        raise InputError(f"unknown dataset {name!r}: use one of {', '.join(DATASETS)} or a folder "
                         f"with {', '.join(FILES)}")
    missing = [f for f in FILES if not os.path.lexists(os.path.join(folder, f))]
    if missing == ['meta.json'] and os.path.lexists(os.path.join(folder, 'meta.pkl')):
        # a folder prepared elsewhere (nanoGPT) or by an older version of this repository
        missing = []
    if not missing:
        return folder
    if name not in DATASETS:
        raise InputError(f"{folder} lacks {', '.join(missing)}; a folder of your own needs "
                         "train.bin and val.bin (uint16 token ids) and meta.json with its "
                         "vocab_size: see data/common.py write_dataset")
    if name != 'shakespeare_char':
        raise InputError(f"{folder} has no {', '.join(FILES)}; prepare it first: "
                         f"python -m data.{name}.prepare")
    # imported here: only a first run needs the prepare script
    from data.shakespeare_char import prepare
    print(f"{folder} is not prepared yet; preparing it now")
    try:
        prepare.prepare(prepare.get_text(), folder)
    except PrepareError as e:
        raise InputError(f"dataset {name} is not prepared and {e}") from None
    return folder


class PlainUnpickler(pickle.Unpickler):
    """Reads pickles of plain data only (dicts, lists, tuples, strings, numbers, booleans, None):
    those need no class lookup, so any pickle that names a class or a function (the way a pickle
    runs code) is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it names {module}.{name}, and only plain data is read")


def read_meta(folder):
    """The vocabulary of a dataset folder: meta.json, or a foreign meta.pkl read as plain data only.
    ValueError in one line for anything else, or for a meta without an integer vocab_size that
    uint16 ids can address."""
    path = os.path.join(folder, 'meta.json')
    try:
        if os.path.exists(path):
            with open(path, encoding='utf-8') as f:
                meta = json.load(f)
        else:
            path = os.path.join(folder, 'meta.pkl')
            with open(path, 'rb') as f:
                meta = PlainUnpickler(io.BytesIO(f.read())).load()
    except (OSError, ValueError, pickle.UnpicklingError, EOFError) as e:
        raise InputError(f"{path} is unreadable or not plain data ({e}); prepare the dataset "
                         "again") from None
    size = meta.get('vocab_size') if isinstance(meta, dict) else None
    if not (isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= MAX_VOCAB):
        raise InputError(f"{path} needs an integer vocab_size between 1 and {MAX_VOCAB:,} "
                         f"(uint16 ids); it has {size!r}")
    return meta


def read_dataset(folder):
    """(meta, {split: uint16 memmap}, identity) for a prepared folder, after every check: the
    vocabulary is plain data, each split is a non-empty file of whole uint16 ids all below
    vocab_size, and (for folders this repository prepared) each split matches the hash in meta.json.
    identity names the data: its absolute path, the vocabulary's hash and each split's size and
    hash; a checkpoint carries it, so that whoever reads the checkpoint with data can check that it
    is the same data. ValueError in one line otherwise."""
    meta = read_meta(folder)
    splits, files = {}, {}
    for split in ('train', 'val'):
        path = os.path.join(folder, f'{split}.bin')
        if not os.path.isfile(path):
            raise InputError(f"{path} is not a file; prepare the dataset again")
        size = os.path.getsize(path)
        if size == 0 or size % 2:
            raise InputError(f"{path} has {size:,} bytes: {'no' if size == 0 else 'not whole'} "
                             "uint16 token ids")
        data = np.memmap(path, dtype=np.uint16, mode='r')
        files[f'{split}.bin'] = file_hash(data.view(np.uint8))
        expected = meta.get('files', {}).get(f'{split}.bin')
        if expected is not None and expected != files[f'{split}.bin']:
            raise InputError(f"{path} does not match {folder}/meta.json (a prepare interrupted "
                             "between its renames?); prepare the dataset again")
        if int(data.max()) >= meta['vocab_size']:
            raise InputError(f"{path} holds token id {int(data.max())}, outside the vocabulary of "
                             f"{meta['vocab_size']}")
        splits[split] = data
    identity = {'path': os.path.abspath(folder), 'vocab': vocab_hash(meta), 'files': files}
    return meta, splits, identity


def check_same_data(ckpt, meta, identity, name):
    """A checkpoint is only ever continued or read with the data it was trained on: ValueError in
    one line naming both when the data at hand differs. A checkpoint from before data identities
    were recorded is checked against its own copy of the vocabulary."""
    recorded, why = ckpt.get('data'), ''
    if recorded is None:
        why = ('' if vocab_hash(ckpt.get('meta') or {}) == vocab_hash(meta)
               else 'the vocabulary differs')
    elif recorded['vocab'] != identity['vocab']:
        why = 'the vocabulary differs'
    else:
        for split, value in recorded['files'].items():
            here = identity['files'].get(split)
            if here is None:
                why = f"{split} is missing"
            elif here[0] != value[0]:
                why = f"{split} differs in size: {value[0]:,} bytes recorded, {here[0]:,} here"
            elif here != value:
                why = (f"{split} differs in content: the same {value[0]:,} bytes, but the "
                       f"SHA-256 of its first and last MiB is {here[1][:12]}... here, "
                       f"{value[1][:12]}... recorded")
            if why:
                break
    if why:
        trained_on = recorded['path'] if recorded else 'other data'
        raise InputError(f"{name} was trained on {trained_on}, and {identity['path']} is not that "
                         f"data ({why}); use the dataset it was trained on (--dataset), or start a "
                         "new run")


def load_data(dataset, block_size, ckpt=None):
    """(meta, {'train': ..., 'val': ...} uint16 token arrays, identity) of a dataset, given by name
    or folder, every check done: the files (read_dataset), enough tokens in each split for one
    window of block_size + 1 and, given the checkpoint a run continues, that it was trained on
    these data. train.py cuts its batches from the arrays. InputError in one line otherwise."""
    folder = find_dataset(dataset)
    meta, splits, identity = read_dataset(folder)
    for split, tokens in splits.items():
        if len(tokens) <= block_size + 1:
            raise InputError(f"{folder}/{split}.bin has {len(tokens)} tokens, too few for "
                             f"block_size={block_size}")
    if ckpt is not None:
        check_same_data(ckpt, meta, identity, 'the checkpoint being resumed')
    return meta, splits, identity


# ---- the batches: windows of T + 1 tokens, x the first T and y the last T (x shifted by one)

def get_batch(data, starts, T, device):
    """x, y (B, T): the windows of data (a split's uint16 token ids) beginning at starts (B,)."""
    windows = np.asarray(starts)[:, None] + np.arange(T + 1)  # (B, T + 1): one gather, not B slices
    w = torch.from_numpy(data[windows].astype(np.int64))
    x, y = w[:, :-1], w[:, 1:]
    if device.startswith('cuda'):  # pinned memory: the copy overlaps with the GPU's work
        return (x.pin_memory().to(device, non_blocking=True),
                y.pin_memory().to(device, non_blocking=True))
    return x.to(device), y.to(device)


def eval_batches(splits, n_batches, B, T, device):
    """{split: up to n_batches batches}, each split's windows spread evenly over it, the same at
    every evaluation; no more windows than fit without overlap (so a tiny split stays cheap)."""
    batches = {}
    for split, data in splits.items():
        n = max(1, min(n_batches * B, (len(data) - 1) // T))
        starts = np.linspace(0, len(data) - T - 1, n).astype(np.int64)
        batches[split] = [get_batch(data, starts[i:i + B], T, device) for i in range(0, n, B)]
    return batches
