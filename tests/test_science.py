"""The paper's claim on a tiny model and a short real training run (tiny Shakespeare, paper init, per-loop CE).

Guards: an RMSNorm or LayerNorm readout lets ||h_K|| run away (and grow loop over loop); a raw readout, a
final-only norm or a norm penalty keeps it at least 5x smaller; inter-loop normalization stops the growth from
compounding across loops (each pass still writes a large state, but every loop's is about the same).
"""

import pytest

import train
from test_train import read_log

SCIENCE = ['--n_layer=1', '--n_embd=64', '--n_head=2', '--n_loop=4', '--block_size=64', '--batch_size=8',
           '--learning_rate=3e-3', '--max_iters=40', '--eval_interval=40', '--eval_iters=2', '--log_interval=40']
K = 4
VARIANTS = {'rmsnorm': [], 'layernorm': ['--readout=layernorm'], 'raw': ['--readout=raw'],
            'final_norm': ['--readout=final_norm'], 'penalty': ['--norm_penalty=0.01'],
            'normed': ['--recurrence=normed']}


@pytest.fixture(scope='module')
def final_norms(shakespeare_data, tmp_path_factory):
    """||h_k|| for k = 1..2K on the validation batches after 40 steps, for each variant."""
    norms = {}
    for name, flags in VARIANTS.items():
        out = tmp_path_factory.mktemp(name)
        train.main(['--dataset', shakespeare_data, '--out_dir', str(out), *SCIENCE, *flags])
        norms[name] = read_log(out)[-1]['hidden_norm']
    print(norms)
    return norms


@pytest.mark.parametrize('blind', ['rmsnorm', 'layernorm'])
@pytest.mark.parametrize('visible', ['raw', 'final_norm', 'penalty'])
def test_scale_visible_loss_keeps_the_norm_5x_smaller(final_norms, blind, visible):
    """A scale-invariant readout lets ||h_K|| run away; making the scale visible to a loss holds it down."""
    assert final_norms[blind][K - 1] >= 5 * final_norms[visible][K - 1], final_norms


def test_residual_loop_grows_the_norm_loop_over_loop(final_norms):
    h = final_norms['rmsnorm']
    assert all(a < b for a, b in zip(h, h[1:])) and h[K - 1] >= 2 * h[0], h  # through 2K: it keeps growing


def test_normed_recurrence_stops_the_norm_compounding(final_norms):
    """The first pass writes as large a state as without the inter-loop norm; after it, nothing compounds:
    every loop up to 2K stays within 25% of loop 1, where the residual loop grows about 4x by loop K."""
    h, blind = final_norms['normed'], final_norms['rmsnorm']
    assert max(h) <= 1.25 * h[0] and min(h) >= 0.8 * h[0], final_norms
    assert blind[K - 1] >= 2.5 * h[K - 1] and blind[-1] >= 5 * h[-1], final_norms
