"""The paper's claim on a tiny model and a short real training run (tiny Shakespeare, paper init, per-loop CE).

Guards: an RMSNorm or LayerNorm readout lets ||h_K|| run away (and grow loop over loop); a raw readout, a
final-only norm or a norm penalty keeps it at least 5x smaller; inter-loop normalization keeps every loop's
norm at the same level.
"""

import pytest

import train
from test_train import read_log

SCIENCE = ['--n_layer=1', '--n_embd=64', '--n_head=2', '--n_loop=4', '--block_size=64', '--batch_size=8',
           '--learning_rate=3e-3', '--max_iters=40', '--eval_interval=40', '--eval_iters=2', '--log_interval=40']
VARIANTS = {'rmsnorm': [], 'layernorm': ['--readout=layernorm'], 'raw': ['--readout=raw'],
            'final_norm': ['--readout=final_norm'], 'penalty': ['--norm_penalty=0.01'], 'normed': ['--recurrence=normed']}


@pytest.fixture(scope='module')
def final_norms(shakespeare_data, tmp_path_factory):
    """||h_k|| for k = 1..K on the validation batches after 40 steps, for each variant."""
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
    assert final_norms[blind][-1] >= 5 * final_norms[visible][-1], final_norms


def test_residual_loop_grows_the_norm_loop_over_loop(final_norms):
    h = final_norms['rmsnorm']
    assert all(a < b for a, b in zip(h, h[1:])) and h[-1] >= 2 * h[0], h


def test_normed_recurrence_holds_the_norm_across_loops(final_norms):
    h = final_norms['normed']
    assert max(h) <= 2 * min(h) and final_norms['rmsnorm'][-1] >= 5 * h[-1], final_norms
