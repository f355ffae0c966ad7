"""
Character-level tiny Shakespeare: writes train.bin / val.bin (uint16 token ids) and meta.json (the
vocabulary).

    python -m data.shakespeare_char.prepare                        # from input.txt, which ships
                                                                   # with the repository
    python -m data.shakespeare_char.prepare --input=my_text.txt    # any UTF-8 text of your own
                                                                   # instead

The text (the classic 1,115,394-byte char-rnn file, public domain) is
data/shakespeare_char/input.txt; it is checked (size and SHA-256) before use. Only when that copy
has been deleted is it downloaded again, checked the same way. Running the script again rewrites the
same files. Expected for the classic file: vocab 65, 1,003,854 train and 111,540 val characters (a
90/10 split).
"""

import argparse
import hashlib
import os
import sys

from data.common import PrepareError, download, read_text, write_dataset

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, 'input.txt')
URLS = ['https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt']
EXPECTED_BYTES = 1_115_394
EXPECTED_SHA256 = '86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed'


def check_classic(path):
    """PrepareError unless path holds exactly the classic text (its size, then its SHA-256)."""
    size = os.path.getsize(path)
    if size != EXPECTED_BYTES:
        raise PrepareError(f"{path} has {size:,} bytes, the classic text {EXPECTED_BYTES:,}")
    with open(path, 'rb') as f:
        if hashlib.sha256(f.read()).hexdigest() != EXPECTED_SHA256:
            raise PrepareError(f"{path} has the classic size but not its SHA-256 "
                               "(edited or damaged)")


def get_text(input_path=None):
    """The corpus as a string: input_path if given (any text), else the shipped input.txt after its
    check; that copy is downloaded again only if it has been deleted."""
    if input_path is not None:
        if not os.path.isfile(input_path):
            raise PrepareError(f"input file {input_path} does not exist")
        return read_text(input_path)
    if not os.path.exists(TEXT):
        print(f"{TEXT} is missing (it ships with the repository; git checkout restores it); "
              "downloading it")
        try:
            download(URLS, TEXT, check_classic, timeout=15)
        except PrepareError as e:
            raise PrepareError(f"{e}; restore it with: git checkout {os.path.relpath(TEXT)}, or "
                               "pass a copy with --input=PATH") from None
    try:
        check_classic(TEXT)
    except PrepareError as e:
        raise PrepareError(f"{e}; restore it with: git checkout {os.path.relpath(TEXT)}") from None
    return read_text(TEXT)


def prepare(text, out_dir):
    """Character vocabulary, 90/10 split, uint16 files. Returns (vocab_size, n_train, n_val)."""
    if len(text) < 100:
        raise PrepareError(f"the text has only {len(text)} characters; need at least 100")
    chars = sorted(set(text))
    if len(chars) > 65536:  # checked before any encoding: uint16 ids cannot hold more
        raise PrepareError(f"the text has {len(chars):,} distinct characters; uint16 ids allow at "
                           "most 65,536")
    stoi = {ch: i for i, ch in enumerate(chars)}
    n = int(0.9 * len(text))
    # itos[i]: the character of id i
    meta = {'vocab_size': len(chars), 'itos': chars, 'tokenizer': 'char'}
    write_dataset(out_dir, [stoi[c] for c in text[:n]], [stoi[c] for c in text[n:]], meta)
    return len(chars), n, len(text) - n


def get_parser(doc=__doc__, default_out_dir=HERE):
    """The flags both Shakespeare prepare scripts take."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--input', default=None,
                        help='a text of your own (default: the shipped input.txt)')
    parser.add_argument('--out_dir', default=default_out_dir,
                        help='where train.bin, val.bin and meta.json go')
    return parser


def main(argv=None):
    args = get_parser().parse_args(argv)
    try:
        text = get_text(args.input)
        vocab, n_train, n_val = prepare(text, args.out_dir)
    except PrepareError as e:
        sys.exit(f"prepare.py: error: {e}")
    print(f"{len(text):,} characters, vocab {vocab}: {n_train:,} train / {n_val:,} val -> "
          f"{args.out_dir}")
    try:
        check_classic(args.input or TEXT)
        print("the classic file (size and SHA-256 checked): expected vocab 65, 1,003,854 train / "
              "111,540 val")
    except PrepareError:
        print(f"note: {args.input} is not the classic file, so the counts differ from the README's")


if __name__ == '__main__':
    main()
