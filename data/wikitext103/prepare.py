"""
WikiText-103 (raw) for the paper-scale configurations: train.bin / val.bin (uint16 token ids) and meta.pkl.

    python -m data.wikitext103.prepare                                   # downloads the 190 MB zip once
    python -m data.wikitext103.prepare --input=path/to/wikitext-103-raw  # a folder with wiki.{train,valid}.raw
    python -m data.wikitext103.prepare --tokenizer=gpt2                  # GPT-2 BPE instead (tiktoken)

The default tokenizer is the paper's word-level one: a regex splits the text into runs of whitespace, runs of
word characters, and single punctuation marks; the vocabulary is the 20,000 most frequent tokens that occur at
least twice in the training split, plus <unk> (id 0) for everything else. It is what makes the paper's models
44M and 129M parameters; the script prints the parameter counts both configurations get from its vocabulary
(so it imports the model, and with it torch). The download itself uses urllib and zipfile.
"""

import argparse
import collections
import os
import re
import sys
import time
import urllib.request
import zipfile

import numpy as np

from data import PrepareError, read_text, write_dataset

HERE = os.path.dirname(os.path.abspath(__file__))
URL = 'https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-raw-v1.zip'
PATTERN = r'\s+|\w+|[^\w\s]'  # whitespace runs, word runs, single punctuation marks
VOCAB = 20_000
SPLITS = {'train': 'wiki.train.raw', 'val': 'wiki.valid.raw'}


def read_splits(input_path):
    """{'train': text, 'val': text} from a folder holding the .raw files, or from the zip (downloaded if needed)."""
    if input_path is not None and os.path.isdir(input_path):
        paths = {s: os.path.join(input_path, name) for s, name in SPLITS.items()}
        missing = [p for p in paths.values() if not os.path.exists(p)]
        if missing:
            sys.exit(f"prepare.py: error: {input_path} lacks {', '.join(map(os.path.basename, missing))}")
        try:
            return {s: read_text(p) for s, p in paths.items()}
        except PrepareError as e:
            sys.exit(f"prepare.py: error: {e}")
    zip_path = input_path or os.path.join(HERE, 'wikitext-103-raw-v1.zip')
    if not os.path.exists(zip_path):
        print(f"downloading {URL} (about 190 MB)")
        try:
            with urllib.request.urlopen(URL, timeout=30) as r, open(zip_path + '.tmp', 'wb') as f:
                while chunk := r.read(1 << 20):
                    f.write(chunk)
        except OSError as e:
            sys.exit(f"prepare.py: error: could not download {URL} ({getattr(e, 'reason', e)}); pass the zip or "
                     f"the unpacked folder with --input=PATH")
        os.replace(zip_path + '.tmp', zip_path)  # a broken download never looks complete
    try:
        with zipfile.ZipFile(zip_path) as z:
            names = {os.path.basename(n): n for n in z.namelist()}
            return {s: z.read(names[name]).decode('utf-8') for s, name in SPLITS.items()}
    except (zipfile.BadZipFile, KeyError, UnicodeDecodeError) as e:
        sys.exit(f"prepare.py: error: {zip_path} is not the WikiText-103 raw zip ({e}); delete it and run again")


def word_tokenizer(train_text):
    """(encode, itos): the regex tokenizer with the paper's vocabulary rule, built from the training split."""
    counts = collections.Counter(re.findall(PATTERN, train_text))
    itos = ['<unk>'] + [tok for tok, n in counts.most_common(VOCAB) if n >= 2]
    stoi = {tok: i for i, tok in enumerate(itos)}
    return (lambda text: [stoi.get(tok, 0) for tok in re.findall(PATTERN, text)]), itos


def get_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--input', default=None, help='the zip, or a folder with wiki.train.raw and wiki.valid.raw')
    p.add_argument('--tokenizer', default='word', choices=['word', 'gpt2'])
    p.add_argument('--out_dir', default=HERE, help='where train.bin, val.bin and meta.pkl go')
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    t0 = time.time()
    texts = read_splits(args.input)
    print(f"read {', '.join(f'{s} {len(t):,} characters' for s, t in texts.items())}")
    if args.tokenizer == 'word':
        encode, itos = word_tokenizer(texts['train'])
        meta = {'vocab_size': len(itos), 'tokenizer': 'word', 'pattern': PATTERN, 'itos': itos}
    else:
        import tiktoken
        enc = tiktoken.get_encoding('gpt2')
        encode = enc.encode_ordinary
        meta = {'vocab_size': enc.n_vocab, 'tokenizer': 'gpt2'}
    ids = {}
    for split, text in texts.items():
        ids[split] = np.asarray(encode(text), dtype=np.int64)
        unk = f", {np.mean(ids[split] == 0):.2%} <unk>" if args.tokenizer == 'word' else ''
        print(f"{split}: {len(ids[split]):,} tokens{unk}")
    try:
        write_dataset(args.out_dir, ids['train'], ids['val'], meta)
    except PrepareError as e:
        sys.exit(f"prepare.py: error: {e}")
    from looped import LoopedGPT
    from train import model_config, parse_args
    for name in ('paper_44m', 'paper_129m'):
        with_vocab = LoopedGPT(model_config(parse_args([f'--config={name}']), meta['vocab_size']))
        print(f"{name} with this vocabulary ({meta['vocab_size']:,}): {with_vocab.num_params():,} parameters")
    print(f"done in {time.time() - t0:.0f} s -> {args.out_dir}")


if __name__ == '__main__':
    main()
