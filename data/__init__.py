"""
The datasets train.py and diagnose.py read: each one a folder under data/ with train.bin and val.bin (uint16
token ids) and meta.pkl (the vocabulary), written by that folder's prepare script:

    python -m data.shakespeare_char.prepare      # characters of tiny Shakespeare (prepared on first use)
    python -m data.shakespeare.prepare           # the same text in GPT-2 BPE
    python -m data.wikitext103.prepare           # WikiText-103, the paper's word-level tokenizer

Any folder with those three files works too: pass its path as --dataset.
"""

import os
import pickle

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DATASETS = ('shakespeare_char', 'shakespeare', 'wikitext103')
FILES = ('train.bin', 'val.bin', 'meta.pkl')


class PrepareError(Exception):
    """A prepare script's failure, with a one-line explanation for the user."""


def read_text(path):
    """The UTF-8 text of a file; PrepareError in one line for a missing, unreadable or binary file."""
    try:
        with open(path, encoding='utf-8') as f:
            return f.read()
    except UnicodeDecodeError:
        raise PrepareError(f"{path} is not UTF-8 text (a binary file?)") from None
    except OSError as e:
        raise PrepareError(f"cannot read {path} ({e.strerror})") from None


def write_dataset(out_dir, train_ids, val_ids, meta):
    """Write train.bin, val.bin (uint16) and meta.pkl into out_dir. Everything is checked first, then all three
    files are written beside the old ones (*.tmp) and only then renamed into place: a failure at any point (a
    vocabulary too large for uint16, a full disk, a read-only folder) leaves a prepared dataset as it was."""
    if meta['vocab_size'] > 65536:
        raise PrepareError(f"a vocabulary of {meta['vocab_size']:,} does not fit uint16 token ids (at most 65,536)")
    arrays = {'train.bin': np.asarray(train_ids), 'val.bin': np.asarray(val_ids)}
    for name, ids in arrays.items():
        if ids.size == 0 or ids.min() < 0 or ids.max() >= meta['vocab_size']:
            raise PrepareError(f"{name}: token ids must be in 0..{meta['vocab_size'] - 1} and there must be some")
    written = []
    try:
        os.makedirs(out_dir, exist_ok=True)
        for name, ids in arrays.items():
            written.append(os.path.join(out_dir, name + '.tmp'))
            ids.astype(np.uint16).tofile(written[-1])
        written.append(os.path.join(out_dir, 'meta.pkl.tmp'))
        with open(written[-1], 'wb') as f:
            pickle.dump(meta, f)
    except OSError as e:
        for tmp in written:
            if os.path.exists(tmp):
                os.remove(tmp)
        raise PrepareError(f"cannot write to {out_dir} ({e.strerror}); nothing there was changed") from None
    for tmp in written:
        os.replace(tmp, tmp[:-len('.tmp')])


def find_dataset(name):
    """The folder of a dataset given by name or path; the default one is prepared on first use.
    ValueError with a one-line hint when it cannot be had."""
    if name in DATASETS:
        folder = os.path.join(HERE, name)
    elif os.path.isdir(name):
        folder = name
    else:
        raise ValueError(f"unknown dataset {name!r}: use one of {', '.join(DATASETS)} or a folder with "
                         f"{', '.join(FILES)}")
    if all(os.path.exists(os.path.join(folder, f)) for f in FILES):
        return folder
    if name not in DATASETS:
        raise ValueError(f"{folder} lacks {', '.join(f for f in FILES if not os.path.exists(os.path.join(folder, f)))}; "
                         "a folder of your own needs train.bin and val.bin (uint16 token ids) and meta.pkl with its "
                         "vocab_size: see data/shakespeare_char/prepare.py for one way to write them")
    if name != 'shakespeare_char':
        raise ValueError(f"{folder} has no {', '.join(FILES)}; prepare it first: python -m data.{name}.prepare")
    from data.shakespeare_char import prepare  # only the 1 MB default is fetched without being asked
    print(f"{folder} is not prepared yet; preparing it now")
    try:
        prepare.prepare(prepare.get_text(), folder)
    except PrepareError as e:
        raise ValueError(f"dataset {name} is not prepared and {e}") from None
    return folder
