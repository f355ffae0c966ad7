"""
WikiText-103 (raw) for the paper-scale configurations: train.bin / val.bin (uint16 token ids) and
meta.json.

    python -m data.wikitext103.prepare                                   # downloads the 190 MB zip
                                                                         # once
    python -m data.wikitext103.prepare --url=https://my.mirror/wt103.zip # your own source first
    python -m data.wikitext103.prepare --input=path/to/wikitext-103-raw  # a folder with
                                                                         # wiki.{train,valid}.raw
    python -m data.wikitext103.prepare --tokenizer=gpt2                  # GPT-2 BPE instead
                                                                         # (tiktoken)

The zip is fetched from the first source in SOURCES that works (the --url ones before them),
streamed to a .tmp file and kept only after it passes its checks: it opens, every member's CRC is
right, and wiki.train.raw and wiki.valid.raw are in it. Their line and token counts are then printed
beside the published ones. The original address (an S3 bucket of research.metamind.io) has refused
every request since 2024.

The default tokenizer is the paper's word-level one: a regex splits the text into runs of
whitespace, runs of word characters, and single punctuation marks; the vocabulary is the 20,000 most
frequent tokens that occur at least twice in the training split, plus <unk> (id 0) for everything
else. It is what makes the paper's models 44M and 129M parameters; the script prints the parameter
counts both configurations get from its vocabulary (so it imports looped.py's model, and with it
torch).
"""

import argparse
import collections
import os
import re
import sys
import time
import zipfile

import numpy as np

from data.common import PrepareError, download, read_text, write_dataset

HERE = os.path.dirname(os.path.abspath(__file__))
ZIP_NAME = 'wikitext-103-raw-v1.zip'
# Tried in order. The first is the dataset author's own mirror (it refuses Python's default
# User-Agent, so download() sends a browser's); the second a copy of the same zip on the Hugging
# Face Hub (it redirects to a CDN).
SOURCES = ['https://wikitext.smerity.com/wikitext-103-raw-v1.zip',
           'https://huggingface.co/datasets/mattdangerw/wikitext-103-raw/resolve/main/wikitext-103-raw-v1.zip']
PATTERN = r'\s+|\w+|[^\w\s]'  # whitespace runs, word runs, single punctuation marks
VOCAB = 20_000
SPLITS = {'train': 'wiki.train.raw', 'val': 'wiki.valid.raw'}
# The published sizes (WikiText paper, Merity et al. 2016, and the dataset's line counts): tokens
# are the whitespace-separated words plus one end-of-line token per line, as the paper counts them.
PUBLISHED = {'train': {'lines': 1_801_350, 'tokens': 103_227_021},
             'val': {'lines': 3_760, 'tokens': 217_646}}
# The shapes of train.py's two paper configurations (--config=paper_44m, paper_129m): the parameter
# count they get from the vocabulary is printed at the end
PAPER_SHAPES = {'paper_44m': dict(n_layer=8, n_embd=512, n_head=8, n_loop=4, block_size=256),
                'paper_129m': dict(n_layer=12, n_embd=768, n_head=12, n_loop=4, block_size=256)}


def check_zip(path):
    """PrepareError unless path is a zip whose members all pass their CRC check and which holds both
    splits."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()  # reads every member and checks its CRC
            names = {os.path.basename(n) for n in z.namelist()}
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise PrepareError(f"not a readable zip ({e})") from None
    if bad is not None:
        raise PrepareError(f"member {bad} fails its CRC check")
    missing = [n for n in SPLITS.values() if n not in names]
    if missing:
        raise PrepareError(f"the zip lacks {', '.join(missing)}")


def read_splits(input_path, out_dir, urls, timeout):
    """{'train': text, 'val': text} from a folder holding the .raw files, from a zip, or from the
    first source that works (the zip is kept in out_dir, so a second run downloads nothing unless
    --url asks for it)."""
    if input_path is not None and os.path.isdir(input_path):
        paths = {s: os.path.join(input_path, name) for s, name in SPLITS.items()}
        missing = [p for p in paths.values() if not os.path.exists(p)]
        if missing:
            raise PrepareError(f"{input_path} lacks {', '.join(map(os.path.basename, missing))}")
        return {s: read_text(p) for s, p in paths.items()}
    zip_path = input_path or os.path.join(out_dir, ZIP_NAME)
    if input_path is None and (urls or not os.path.exists(zip_path)):
        os.makedirs(out_dir, exist_ok=True)
        try:
            used = download(urls + SOURCES, zip_path, check_zip, timeout)
        except PrepareError as e:
            raise PrepareError(f"{e}. With the zip or the unpacked folder at hand, pass it with "
                               "--input=PATH") from None
        print(f"using {used} -> {zip_path}")
    elif not os.path.exists(zip_path):
        raise PrepareError(f"input {zip_path} does not exist")
    check_zip(zip_path)
    with zipfile.ZipFile(zip_path) as z:
        names = {os.path.basename(n): n for n in z.namelist()}
        try:
            return {s: z.read(names[name]).decode('utf-8') for s, name in SPLITS.items()}
        except UnicodeDecodeError:
            raise PrepareError(f"{zip_path} holds splits that are not UTF-8 text") from None


def compare_with_published(texts):
    """Print each split's lines and tokens beside the published counts, with a note where they
    differ."""
    for split, text in texts.items():
        got = {'lines': text.count('\n'), 'tokens': len(text.split()) + text.count('\n')}
        want = PUBLISHED[split]
        same = got == want
        print(f"{SPLITS[split]}: {got['lines']:,} lines, {got['tokens']:,} tokens; published "
              f"{want['lines']:,} lines, {want['tokens']:,} tokens"
              + ('' if same else ' (note: differs: not the published WikiText-103?)'))


def word_tokenizer(train_text):
    """(encode, itos): the regex tokenizer with the paper's vocabulary rule, built from the training
    split."""
    counts = collections.Counter(re.findall(PATTERN, train_text))
    itos = ['<unk>'] + [tok for tok, n in counts.most_common(VOCAB) if n >= 2]
    stoi = {tok: i for i, tok in enumerate(itos)}
    return (lambda text: [stoi.get(tok, 0) for tok in re.findall(PATTERN, text)]), itos


def get_parser():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--input', default=None,
                   help='the zip, or a folder with wiki.train.raw and wiki.valid.raw')
    p.add_argument('--tokenizer', default='word', choices=['word', 'gpt2'])
    p.add_argument('--out_dir', default=HERE,
                   help='where train.bin, val.bin and meta.json (and the zip) go')
    p.add_argument('--url', action='append', default=[],
                   help='a source of the zip to try before the built-in ones '
                   '(repeatable; always downloads)')
    p.add_argument('--timeout', type=float, default=30,
                   help='seconds a source may stay silent before it is given up')
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    t0 = time.time()
    try:
        texts = read_splits(args.input, args.out_dir, args.url, args.timeout)
    except PrepareError as e:
        sys.exit(f"prepare.py: error: {e}")
    print(f"read {', '.join(f'{s} {len(t):,} characters' for s, t in texts.items())}")
    compare_with_published(texts)
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
    from looped import LoopedConfig, LoopedGPT  # here: the counts are all that needs torch
    for name, shape in PAPER_SHAPES.items():
        with_vocab = LoopedGPT(LoopedConfig(vocab_size=meta['vocab_size'], **shape))
        print(f"{name} with this vocabulary ({meta['vocab_size']:,}): "
              f"{with_vocab.num_params():,} parameters")
    print(f"done in {time.time() - t0:.0f} s -> {args.out_dir}")


if __name__ == '__main__':
    main()
