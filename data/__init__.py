"""
The datasets train.py and lab/diagnose.py read: each one a folder under data/ with train.bin and
val.bin (uint16 token ids) and meta.json (the vocabulary, and a hash of each split), written by that
folder's prepare script:

    python -m data.shakespeare_char.prepare      # characters of tiny Shakespeare (the text ships;
                                                 # prepared on first use)
    python -m data.shakespeare.prepare           # the same text in GPT-2 BPE
    python -m data.wikitext103.prepare           # WikiText-103, the paper's word-level tokenizer
                                                 # (downloads 190 MB)
    python -m data.chains.prepare --hops=4       # chained variable assignment: answers that take
                                                 # --hops lookups

Any folder with those three files works too (or with nanoGPT's meta.pkl, read as plain data only):
pass its path as --dataset. The prepare scripts share data/common.py (reading, downloading,
writing); this file only finds a dataset.
"""

import os

from data.common import FILES, InputError, PrepareError, read_dataset

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
    # imported here: the prepare scripts never import this file's names
    from data.shakespeare_char import prepare
    print(f"{folder} is not prepared yet; preparing it now")
    try:
        prepare.prepare(prepare.get_text(), folder)
    except PrepareError as e:
        raise InputError(f"dataset {name} is not prepared and {e}") from None
    return folder


def open_dataset(name):
    """(folder, meta, splits, identity) of a dataset given by name or path: find_dataset's folder,
    and what data/common.py's read_dataset reads there (the vocabulary, the token arrays, a hash of
    each split), every file checked. InputError with a one-line message otherwise."""
    folder = find_dataset(name)
    return (folder, *read_dataset(folder))
