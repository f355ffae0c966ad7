"""
Tiny Shakespeare with the GPT-2 BPE (tiktoken): train.bin / val.bin (uint16 token ids) and
meta.json.

    python -m data.shakespeare.prepare                        # from data/shakespeare_char/input.txt
                                                              # (ships)
    python -m data.shakespeare.prepare --input=my_text.txt    # any UTF-8 text of your own instead

tiktoken fetches its BPE files once; offline, point TIKTOKEN_CACHE_DIR at a folder that holds them.
Expected for the classic file: 301,966 train / 36,059 val tokens.
"""

import os
import sys

from data.common import PrepareError, write_dataset
# the text and its download live with the character-level dataset; reuse that script's loader
from data.shakespeare_char.prepare import get_text
from data.shakespeare_char.prepare import get_parser as char_parser

HERE = os.path.dirname(os.path.abspath(__file__))


def get_parser():
    return char_parser(__doc__, HERE)  # the same flags as the character-level script


def main(argv=None):
    args = get_parser().parse_args(argv)
    try:
        text = get_text(args.input)
    except PrepareError as e:
        sys.exit(f"prepare.py: error: {e}")
    import tiktoken
    try:
        enc = tiktoken.get_encoding('gpt2')
    except Exception as e:  # no network and no cache: say how to fix it in one line
        sys.exit(f"prepare.py: error: could not load the GPT-2 BPE ({type(e).__name__}); "
                 "set TIKTOKEN_CACHE_DIR to a folder holding tiktoken's gpt2 files")
    n = int(0.9 * len(text))
    train_ids, val_ids = enc.encode_ordinary(text[:n]), enc.encode_ordinary(text[n:])
    try:
        write_dataset(args.out_dir, train_ids, val_ids,
                      {'vocab_size': enc.n_vocab, 'tokenizer': 'gpt2'})
    except PrepareError as e:
        sys.exit(f"prepare.py: error: {e}")
    print(f"{len(text):,} characters -> {len(train_ids):,} train / {len(val_ids):,} val GPT-2 "
          f"tokens (vocab {enc.n_vocab}) -> {args.out_dir}")


if __name__ == '__main__':
    main()
