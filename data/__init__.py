"""
The datasets: each one a folder under data/ with train.bin and val.bin (uint16 token ids) and
meta.json (the vocabulary, and a hash of each split), written by that folder's prepare script:

    python -m data.shakespeare_char.prepare      # characters of tiny Shakespeare (the text ships;
                                                 # prepared on first use)
    python -m data.shakespeare.prepare           # the same text in GPT-2 BPE
    python -m data.wikitext103.prepare           # WikiText-103, the paper's word-level tokenizer
                                                 # (downloads 190 MB)
    python -m data.chains.prepare --hops=4       # chained variable assignment: answers that take
                                                 # --hops lookups

Any folder with those three files works too (or with nanoGPT's meta.pkl, read as plain data only):
pass its path as --dataset. data/loader.py finds, checks and batches a dataset (load_data...);
data/common.py holds what the prepare scripts share (downloading, writing).
"""
