"""
Character-level tiny Shakespeare: writes train.bin / val.bin (uint16 token ids) and meta.pkl (the vocabulary).

    python -m data.shakespeare_char.prepare                               # downloads the text
    python -m data.shakespeare_char.prepare --input=tinyshakespeare.txt   # offline, from a local copy

Running it again rewrites the same files. Expected for the classic file: vocab 65, 1,003,854 train and
111,540 val characters (a 90/10 split).
"""

import argparse
import os
import sys
import urllib.request

from data import PrepareError, read_text, write_dataset

URL = 'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt'
EXPECTED_BYTES = 1_115_394
HERE = os.path.dirname(os.path.abspath(__file__))


def get_text(input_path=None):
    """The corpus as a string: from input_path, else from an earlier download, else from the network."""
    cache_path = os.path.join(HERE, 'input.txt')
    if input_path is not None:
        if not os.path.isfile(input_path):
            raise PrepareError(f"input file {input_path} does not exist")
        return read_text(input_path)
    if not os.path.exists(cache_path):
        print(f"downloading {URL}")
        tmp = cache_path + '.tmp'
        try:
            with urllib.request.urlopen(URL, timeout=15) as r:
                if r.status != 200:
                    raise PrepareError(f"download failed with HTTP status {r.status}")
                data = r.read()
        except OSError as e:  # URLError, timeouts and refused connections are all OSErrors
            raise PrepareError(f"could not download {URL} ({getattr(e, 'reason', e)}); pass a local copy "
                               f"instead: python -m data.shakespeare_char.prepare --input=PATH") from None
        if len(data) != EXPECTED_BYTES:
            raise PrepareError(f"downloaded {len(data):,} bytes, expected {EXPECTED_BYTES:,}; not keeping it")
        with open(tmp, 'wb') as f:  # write then rename: an interrupted download never looks complete
            f.write(data)
        os.replace(tmp, cache_path)
    return read_text(cache_path)


def prepare(text, out_dir):
    """Character vocabulary, 90/10 split, uint16 files. Returns (vocab_size, n_train, n_val)."""
    if len(text) < 100:
        raise PrepareError(f"the text has only {len(text)} characters; need at least 100")
    chars = sorted(set(text))
    if len(chars) > 65536:  # checked before any encoding: uint16 ids cannot hold more
        raise PrepareError(f"the text has {len(chars):,} distinct characters; uint16 ids allow at most 65,536")
    stoi = {ch: i for i, ch in enumerate(chars)}
    n = int(0.9 * len(text))
    meta = {'vocab_size': len(chars), 'itos': dict(enumerate(chars)), 'stoi': stoi, 'tokenizer': 'char'}
    write_dataset(out_dir, [stoi[c] for c in text[:n]], [stoi[c] for c in text[n:]], meta)
    return len(chars), n, len(text) - n


def get_parser(doc=__doc__, default_out_dir=HERE):
    """The flags both Shakespeare prepare scripts take."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--input', default=None, help='local copy of the text (default: download it)')
    parser.add_argument('--out_dir', default=default_out_dir, help='where train.bin, val.bin and meta.pkl go')
    return parser


def main(argv=None):
    args = get_parser().parse_args(argv)
    try:
        text = get_text(args.input)
        vocab, n_train, n_val = prepare(text, args.out_dir)
    except PrepareError as e:
        sys.exit(f"prepare.py: error: {e}")
    print(f"{len(text):,} characters, vocab {vocab}: {n_train:,} train / {n_val:,} val -> {args.out_dir}")
    if len(text) == EXPECTED_BYTES:
        print("matches the classic file: expected vocab 65, 1,003,854 train / 111,540 val")
    else:
        print(f"note: not the classic {EXPECTED_BYTES:,}-character file, so the counts differ from the README's")


if __name__ == '__main__':
    main()
