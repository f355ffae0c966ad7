"""
The named configurations train.py's --config takes, as nanoGPT's config/ files: each one's values
replace train.py's defaults, unless a flag typed on the command line gives its own.
"""

CONFIGS = {  # --config=NAME: {flag: value}
    'laptop': {},  # the defaults: a 2-core CPU trains it in about 2 minutes and sees the blind spot
    'laptop_long': dict(n_embd=64, max_iters=2000, eval_iters=4, log_interval=100),
    'laptop_deep': dict(n_layer=4, max_iters=1500, eval_iters=4, log_interval=100,
                        learning_rate=1e-3),
    'laptop_10k': dict(max_iters=10000, eval_interval=250, log_interval=100),
    'gpu_char': dict(n_layer=4, n_embd=256, block_size=256, batch_size=32, dropout=0.1,
                     max_iters=3000, eval_interval=250, eval_iters=20, log_interval=50,
                     learning_rate=3e-4),
    # the authors' recipe: 4 epochs of WikiText-103 (python -m data.wikitext103.prepare), AdamW 3e-4
    'paper_44m': dict(n_layer=8, n_embd=512, n_head=8, block_size=256, batch_size=64, dropout=0.1,
                      max_iters=None, epochs=4, eval_interval=1000, eval_iters=20, log_interval=50,
                      learning_rate=3e-4, dataset='wikitext103'),
    'paper_129m': dict(n_layer=12, n_embd=768, n_head=12, block_size=256, batch_size=32,
                       dropout=0.1, max_iters=None, epochs=4, eval_interval=1000, eval_iters=20,
                       log_interval=50, learning_rate=3e-4, dataset='wikitext103'),
}
