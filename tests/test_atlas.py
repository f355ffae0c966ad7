"""lab/atlas.py: the designs' table (each prediction beside its measurement) and figure, from run folders."""

import math
import os

import numpy as np
import pytest

from lab import atlas
from lab import grid
from lab import train  # train.py with the designs: python -m lab.train

TINY = ['--n_layer=1', '--n_embd=16', '--n_head=2', '--n_loop=2', '--block_size=16', '--batch_size=2',
        '--eval_iters=1', '--log_interval=4', '--max_iters=4', '--eval_interval=2']


def summary(norm, ratio, loss=(2.0, 1.9, 2.1)):
    return {'norm': (norm, 0.0), 'ratio': (ratio, 0.0), 'loss': list(loss), 'K': 2, 'seeds': 1, 'step': 200,
            'per_seed': {}}


def test_a_measurement_against_the_prediction_says_yes_or_no():
    # residual is predicted carried, large under rmsnorm, small under raw
    assert [ok for _, ok in atlas.verdicts('residual', {'rmsnorm': summary(900, 2.0), 'raw': summary(8, 1.2)})] == \
        [True, True, True]
    words = atlas.verdicts('residual', {'rmsnorm': summary(50, 1.1), 'raw': summary(300, 3.0)})
    assert words == [('removed', False), ('small', False), ('large', False)]
    text, rows = atlas.tables({'residual': {'rmsnorm': summary(50, 1.1)}}, 3.35, 250)
    assert '| residual | carried | 1.10 ± 0.00 | removed | **no** | large | 50.0 ± 0.0 | small | **no** |' in text
    assert 'not run' in text and len(rows) == 2  # the raw run is missing, and said to be


def test_every_design_is_one_entry_with_flags_prediction_and_reason_under_both_readouts():
    for design, entry in grid.DESIGNS.items():
        assert isinstance(entry.flags, list) and isinstance(entry.carried, bool) and entry.why, design
        assert entry.rmsnorm in ('large', 'small') and entry.raw in ('large', 'small'), design
    assert sorted(grid.ATLAS_DESIGN.values()) == sorted((d, r) for d in grid.DESIGNS for r in grid.ATLAS_READOUTS)


def test_the_atlas_under_another_init_trains_in_the_same_folders_and_reads_its_own_names():
    paper, _ = grid.atlas_grid('paper')
    gpt2, names = grid.atlas_grid('gpt2')
    assert list(gpt2) == list(paper)  # the run folders come from these names
    assert all(flags == paper[name] + ['--init=gpt2'] for name, flags in gpt2.items())
    assert names['per_loop + rmsnorm (gpt2 init) + sandwich'] == ('sandwich', 'rmsnorm')
    assert set(names.values()) == set(grid.ATLAS_DESIGN.values())


def test_the_unigram_loss_by_hand():
    # training counts 0: 2, 1: 1, 2: 0, plus one each -> p = 3/6, 2/6, 1/6; the validation tokens 0, 1, 2, 2
    got = atlas.unigram_loss(np.array([0, 0, 1], dtype=np.uint16), np.array([0, 1, 2, 2], dtype=np.uint16), 3)
    assert got == pytest.approx(-(math.log(3 / 6) + math.log(2 / 6) + 2 * math.log(1 / 6)) / 4)


def test_a_readout_that_did_not_learn_carries_no_verdict():
    unigram = 3.35  # learns: every depth 1..K at or below 3.05; depth 2K does not count
    learned, stuck = summary(900, 2.0, (2.6, 2.5, 3.3)), summary(11, 1.0, (2.6, 3.06, 2.0))
    assert atlas.learns(learned, unigram) and not atlas.learns(stuck, unigram)
    words = atlas.verdicts('residual', {'rmsnorm': stuck, 'raw': learned}, unigram)
    assert words == [('did not learn', None), ('did not learn', None), ('large', False)]
    assert [ok for _, ok in atlas.verdicts('residual', {'rmsnorm': learned, 'raw': summary(8, 1.2, (2.9, 2.8, 2.7))},
                                           unigram)] == [True, True, True]
    text, _ = atlas.tables({'residual': {'rmsnorm': stuck}}, unigram, 250)
    assert '| residual | rmsnorm | 1 | 200 | 2.600 3.060 | 2.000 | **no** |' in text and '3.350 nats' in text
    # Table 3: no power, ratio or loss cost for a readout that did not learn; the other readout keeps its power
    text, _ = atlas.tables({'residual': {'rmsnorm': stuck, 'raw': learned}}, unigram, 250)
    row = next(line for line in text.split('Table 3.')[1].splitlines() if line.startswith('| residual |'))
    assert row == ('| residual | did not learn (rmsnorm) | did not learn | fewer than 3 evaluations | '
                   'did not learn (rmsnorm) | did not learn (rmsnorm) |'), row


def test_the_sharper_verdicts_by_hand():
    steps = [250, 500, 1000]
    fit = lambda b: atlas.fit(steps, [s ** b for s in steps], 250)
    seeds = lambda *v: {seed: {'norm': n, 'loss_K': lk, 'loss_2K': l2, 'fit': fit(b)} for seed, (n, lk, l2, b) in
                        enumerate(v, start=1)}
    got = {'rmsnorm': {**summary(0, 0), 'per_seed': seeds((400, 2.0, 2.4, 0.5), (600, 2.2, 2.3, 0.3))},
           'raw': {**summary(0, 0), 'per_seed': seeds((40, 2.1, 2.6, 0.0), (20, 2.0, 2.2, 0.2))}}
    m = atlas.sharper(got)
    assert m['ratio'] == pytest.approx((20.0, math.sqrt(200)))  # 400/40 and 600/20: mean 20, sample SD sqrt(200)
    assert m['rmsnorm']['b'] == pytest.approx(0.4) and m['rmsnorm']['spread'] == pytest.approx((0.3, 0.5))
    assert m['rmsnorm']['growing'] and not m['raw']['growing']  # raw's first seed has a power of 0
    d = np.array([[-0.1, -0.2], [0.2, 0.1]])  # rmsnorm minus raw at K and 2K, seed by seed (not symmetric in sign)
    assert m['cost']['mean'] == pytest.approx(d.mean(0))
    half = 12.706 * d.std(0, ddof=1) / math.sqrt(2)  # t(0.975, 1 df)
    assert m['cost']['hi'] - m['cost']['mean'] == pytest.approx(half, rel=1e-3)
    one = atlas.sharper({'rmsnorm': {**summary(0, 0), 'per_seed': seeds((400, 2.0, 2.4, 0.5))}})
    lo, hi = one['rmsnorm']['spread']  # one seed: the fit's own interval (an exact law: of width 0); no raw, no ratio
    assert (lo, hi) == pytest.approx((0.5, 0.5)) and one['rmsnorm']['seeds'] == 1 and 'ratio' not in one


def test_the_command_writes_table_and_figure_from_run_folders(small_data, tmp_path, capsys):
    for flags in (['--readout=rmsnorm'], ['--readout=raw'], ['--readout=raw', '--block=sandwich'],
                  ['--readout=raw', '--supervision=terminal']):  # the last is no atlas condition: left out
        train.main(['--dataset', small_data, '--out_dir', str(tmp_path / 'runs' / '-'.join(flags)), *TINY, *flags])
    figs = tmp_path / 'new' / 'figs'
    atlas.main([str(tmp_path / 'runs' / '*'), '--fig_dir', str(figs)])
    text = (figs / 'atlas.md').read_text()
    assert '| residual | carried |' in text and '| sandwich | removed |' in text and 'terminal' not in text
    assert os.path.getsize(figs / 'fig8_atlas.png') > 10_000 and os.path.getsize(figs / 'fig8_atlas.svg') > 1000
    assert len((figs / 'atlas.csv').read_text().splitlines()) == 1 + 3
    atlas.main([str(tmp_path / 'runs' / '*'), '--fig_dir', str(figs / 'one'), '--design=sandwich'])
    text = (figs / 'one' / 'atlas.md').read_text()  # only the design asked for
    assert '| sandwich | removed |' in text and '| residual |' not in text
    with pytest.raises(SystemExit) as e:
        atlas.main([str(tmp_path / 'runs' / '*terminal*'), '--fig_dir', str(figs)])
    assert 'none of the runs is an atlas condition' in str(e.value.code)
    with pytest.raises(SystemExit) as e:  # paper-init runs are no atlas condition of the gpt2 atlas
        atlas.main([str(tmp_path / 'runs' / '*'), '--fig_dir', str(figs), '--init=gpt2'])
    assert 'under --init=gpt2' in str(e.value.code)


def test_one_design_trains_and_reads_back_its_two_readouts_alone(monkeypatch, tmp_path):
    """--design narrows the atlas to the designs named: the runs handed to the grid, and the rows
    read back."""
    assert atlas.get_parser().parse_args([]).design is None  # default: every design
    args = atlas.get_parser().parse_args(['--design=concat', '--design', 'sandwich + normed'])
    assert args.design == ['concat', 'sandwich + normed']
    with pytest.raises(SystemExit):
        atlas.get_parser().parse_args(['--design=no_such_design'])  # not in grid.DESIGNS
    asked = {}

    def run_grid(config, seeds, out_root, extra, grid=None, prog=None):  # what would be trained
        asked.update(grid=grid, seeds=list(seeds))
        return []
    monkeypatch.setattr(atlas, 'run_grid', run_grid)
    with pytest.raises(SystemExit) as e:  # nothing was trained, so there is nothing to read back
        atlas.main(['--design=concat', '--seeds=2', '--fig_dir', str(tmp_path)])
    assert 'condition of --design=concat under --init=paper' in str(e.value.code)
    concat = grid.DESIGNS['concat'].flags
    assert asked == {'seeds': [1, 2], 'grid': {
        'per_loop + rmsnorm + concat': ['--supervision=per_loop', '--readout=rmsnorm', *concat],
        'per_loop + raw + concat': ['--supervision=per_loop', '--readout=raw', *concat]}}
    trained, names = grid.atlas_grid('gpt2', ['residual', 'concat'])
    assert list(trained) == ['per_loop + rmsnorm', 'per_loop + raw', *asked['grid']]  # in DESIGNS
    want = [(d, r) for d in ('residual', 'concat') for r in grid.ATLAS_READOUTS]
    assert sorted(names.values()) == sorted(want)
