"""lab/cost.py: the cost grid's cells, its tables' numbers on hand-built logs whose answers are known, and its
precision measurement on a real checkpoint."""

from dataclasses import asdict
import json
import math
import os

import pytest

from lab import cost
from lab.grid import COST, COST_SEEDS, load_run
from lab.designs import DesignConfig


def fake_run(root, cell, seed, losses, norm=100.0, turn=2.0):
    """A finished run folder of one cell of the grid: validation losses at depths 1..2K at its last step."""
    flags = dict(a[2:].split('=', 1) for a in COST[cell] if not a.startswith(('--max_iters', '--eval', '--log')))
    model = asdict(DesignConfig(n_layer=int(flags['n_layer']), n_loop=int(flags.get('n_loop', 4)),
                                readout=flags['readout'], norm_penalty=float(flags.get('norm_penalty', 0))))
    K = model['n_loop']
    folder = root / f"{cell.replace(' + ', '-')}-seed{seed}"
    folder.mkdir()
    config = {'seed': seed, 'max_iters': 1000, 'learning_rate': float(flags['learning_rate']), 'model': model}
    record = {'step': 1000, 'train_loss': losses[K - 1], 'val_loss': losses, 'hidden_norm': [norm] * (2 * K),
              'elapsed_s': 1.0, 'turn': [turn] * (2 * K)}
    (folder / 'log.jsonl').write_text(json.dumps({'config': config}) + '\n' + json.dumps(record) + '\n')
    return load_run(str(folder))


def test_the_grid_is_the_43_runs_of_its_cells():
    assert len(COST) == 13 and sum(COST_SEEDS.values()) == 43
    assert COST_SEEDS['L4-lr1e-3-K4 + rmsnorm'] == COST_SEEDS['L4-lr1e-3-K4 + raw'] == 5
    for name, flags in COST.items():
        assert '--max_iters=1000' in flags and '--eval_interval=100' in flags, name


def test_a_runs_cell_is_read_back_from_its_log(tmp_path):
    run = fake_run(tmp_path, 'L4-lr1e-3-K4 + rmsnorm + pen0.01', 1, [2.0] * 8)
    assert cost.cell_of(run) == 'L4-lr1e-3-K4 + rmsnorm + pen0.01'
    assert cost.cell_of(fake_run(tmp_path, 'L2-lr3e-3-K4 + raw', 2, [2.0] * 8)) == 'L2-lr3e-3-K4 + raw'


def test_the_cost_its_interactions_and_the_useful_loops_match_a_hand_computation(tmp_path):
    """Costs per seed (rmsnorm - raw at depth 4): L2 3e-3 -0.05, L2 1e-3 0.00, L4 3e-3 +0.05 and L4 1e-3
    +0.10 + 0.01 * seed, so the stack's change is +0.10 + 0.005 * seed, the rate's +0.05 + 0.005 * seed."""
    costs = {(2, '3e-3'): lambda s: -0.05, (2, '1e-3'): lambda s: 0.0, (4, '3e-3'): lambda s: 0.05,
             (4, '1e-3'): lambda s: 0.10 + 0.01 * s}
    runs = []
    for (L, lr), c in costs.items():
        for s in (1, 2, 3):
            raw = [2.3, 2.2, 2.1, 2.0, 2.0, 2.0, 2.0, 2.0]  # gains 0.1 at loops 2..4: 3 useful loops
            rms = [2.0, 2.01, 2.0 - 0.005, 2.0 + c(s)] + [2.0] * 4  # gains -0.01, +0.015, ...: at most 1 useful
            runs += [fake_run(tmp_path, f"L{L}-lr{lr}-K4 + raw", s, raw),
                     fake_run(tmp_path, f"L{L}-lr{lr}-K4 + rmsnorm", s, rms, norm=500.0, turn=1.5)]
    cells, notes = cost.by_cell(runs)
    assert not notes
    rows = cost.cost_rows(cells)
    assert [round(r['mean'], 6) for r in rows] == [-0.05, 0.0, 0.05, 0.12]
    assert rows[3]['sd'] == pytest.approx(0.01) and rows[3]['seeds'] == [1, 2, 3]
    depth, rate, both = cost.interaction_rows(cells)
    assert depth['mean'] == pytest.approx(0.11) and depth['sd'] == pytest.approx(0.005)
    assert rate['mean'] == pytest.approx(0.06) and both['mean'] == pytest.approx(0.02)  # 0.01 * seed
    text = cost.mechanism_table(cells)
    raw_row = next(line for line in text.splitlines() if line.startswith('| L4-lr1e-3-K4 + raw |'))
    assert '+0.100 +0.100 +0.100' in raw_row and raw_row.rstrip(' |').endswith('3.0 ± 0.0')
    rms_row = next(line for line in text.splitlines() if line.startswith('| L2-lr3e-3-K4 + rmsnorm |'))
    assert '500.0 ± 0.0' in rms_row and '1.5 1.5 1.5 1.5' in rms_row
    path = cost.figure(runs, str(tmp_path / 'fig_cost.png'))
    assert os.path.getsize(path) > 10_000 and os.path.exists(str(tmp_path / 'fig_cost.svg'))


def test_a_run_short_of_the_last_step_is_left_out_with_a_note(tmp_path):
    run = fake_run(tmp_path, 'L2-lr3e-3-K4 + raw', 1, [2.0] * 8)
    run['records'][-1]['step'] = 500
    cells, notes = cost.by_cell([run])
    assert not cells and 'at step 500 of 1000: left out' in notes[0]


def test_precision_json_is_measured_once_from_a_finished_checkpoint(small_data, tmp_path):
    import train
    out = tmp_path / 'run'
    train.main(['--dataset', small_data, '--out_dir', str(out), '--n_layer=1', '--n_embd=16', '--n_head=2',
                '--n_loop=2', '--block_size=16', '--batch_size=2', '--max_iters=2', '--eval_iters=1'])
    cost.measure_precision(str(out))
    with open(out / 'precision.json') as f:
        record = json.load(f)
    assert record['step'] == 2 and record['depths'] == [2, 4]
    assert all(len(record[m]) == 2 and all(map(math.isfinite, record[m])) for m in ('float32', 'bf16_state',
                                                                                 'bf16_autocast'))
    before = os.path.getmtime(out / 'precision.json')
    cost.measure_precision(str(out))  # a second call leaves it alone
    assert os.path.getmtime(out / 'precision.json') == before


def test_a_run_committed_finished_is_not_trained_again(tmp_path):
    """A fresh clone resumes the grid from its committed logs: a run whose committed log is finished is reused
    from there (a training attempt here would fail at once on its bad --device, so the test cannot hang)."""
    from lab.grid import run_grid
    committed = tmp_path / 'committed'
    committed.mkdir()
    fake_run(committed, 'L2-lr3e-3-K4 + raw', 1, [2.0] * 8)
    folders = run_grid('laptop', [1], str(tmp_path / 'out'), ['--device=nonsense'], names=['L2-lr3e-3-K4 + raw'],
                       grid=COST, prog='test', max_seed=COST_SEEDS, finished_in=str(committed))
    assert folders == [str(committed / 'L2-lr3e-3-K4-raw-seed1')] and not (tmp_path / 'out').exists()


def test_the_logged_turn_is_the_angle_between_consecutive_states_by_hand():
    import torch
    from contextlib import nullcontext
    from train import state_turn
    from lab.designs import DesignedGPT
    torch.manual_seed(0)
    model = DesignedGPT(DesignConfig(vocab_size=11, block_size=8, n_embd=16, n_head=2, n_layer=1, n_loop=3)).eval()
    x = torch.randint(11, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        states = [model.embed(x)] + [h for _, h in model.loops(model.embed(x), 6)]
        cos = [torch.nn.functional.cosine_similarity(a, b, dim=-1) for a, b in zip(states, states[1:])]
        want = [torch.rad2deg(torch.acos(c.clamp(-1, 1))).mean().item() for c in cos]
        got = state_turn(model, x, 6, nullcontext())
    assert len(got) == 6 and got == pytest.approx(want, abs=1e-3)
    assert got[0] > got[-1]  # the first pass turns the embedding most


def test_precision_in_float32_is_the_models_own_loss_at_k_and_2k():
    import torch
    from lab.diagnose import precision_losses
    from lab.designs import DesignedGPT
    torch.manual_seed(0)
    model = DesignedGPT(DesignConfig(vocab_size=11, block_size=8, n_embd=16, n_head=2, n_layer=1, n_loop=2)).eval()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(11, (6, 8), generator=g), torch.randint(11, (6, 8), generator=g)
    got = precision_losses(model, x, y, 2, batch_size=4)  # batches of 4 and 2 windows: weighted by their size
    with torch.no_grad():
        ce = model(x, y, n_loop=4)[2]['ce']
    assert got['float32'] == pytest.approx([ce[1].item(), ce[3].item()], rel=1e-5)
    for mode in ('bf16_state', 'bf16_autocast'):
        assert got[mode] != got['float32'] and got[mode] == pytest.approx(got['float32'], abs=0.05), mode


def test_one_pair_shows_its_difference_and_no_verdict(tmp_path):
    runs = [fake_run(tmp_path, 'L2-lr3e-3-K4 + rmsnorm', 1, [2.0, 2.0, 2.0, 1.9] + [2.0] * 4),
            fake_run(tmp_path, 'L2-lr3e-3-K4 + raw', 1, [2.0, 2.0, 2.0, 2.0] + [2.0] * 4)]
    cells, _ = cost.by_cell(runs)
    row = cost.cost_rows(cells)[0]
    assert row['n'] == 1 and row['mean'] == pytest.approx(-0.1) and math.isnan(row['lo'])
    text = cost.family_table(cost.cost_rows(cells), 'rmsnorm - raw')
    assert '| 2 layers, lr 3e-3: rmsnorm - raw at depth 4 | 1 | -0.100 | n/a |' in text
    assert 'no verdict: one pair' in text and 'lower' not in text.split('\n')[2].split('|')[8]


def test_holm_counts_every_declared_comparison_even_one_not_yet_measured():
    """A family's m is the comparisons declared: with one of two measured, its p is doubled, and the one pair left
    gets no verdict (not 'not resolved')."""
    measured = cost.comparison_row('a', [1, 2, 3], [0.10, 0.12, 0.11], 'higher')
    waiting = cost.comparison_row('b', [1], [0.3], 'higher')
    alone = dict(measured)
    cost.family_table([alone], 'x')
    cost.family_table([measured, waiting], 'x')
    assert measured['p_holm'] == pytest.approx(min(1.0, 2 * alone['p_holm']))
    assert waiting['verdict'] == 'no verdict: one pair'


def test_the_single_run_predictions_are_counted_run_by_run_with_their_misses_named(tmp_path):
    """Hand-built runs whose every check is known: raw seed 2 misses the turn (4.0 degrees at loop 2) and the
    norm (40); seed 1's dose falls at every step and closes (2.20 - 2.05) / (2.20 - 2.00) = 75% of the gap,
    seed 2's closes (2.20 - 2.15) / (2.20 - 2.00) = 25%."""
    c = 'L4-lr1e-3-K4 + '
    runs = [fake_run(tmp_path, c + 'rmsnorm', 1, [2.2] * 8, norm=500.0, turn=1.5),
            fake_run(tmp_path, c + 'raw', 1, [2.3, 2.2, 2.1, 2.0] + [2.0] * 4, norm=10.0, turn=8.0),
            fake_run(tmp_path, c + 'raw', 2, [2.3, 2.29, 2.1, 2.0] + [2.0] * 4, norm=40.0),
            fake_run(tmp_path, c + 'rmsnorm', 2, [2.2] * 8, norm=500.0, turn=1.5),
            fake_run(tmp_path, 'L4-lr1e-3-K1 + raw', 1, [2.15, 2.2])]
    runs[2]['records'][-1]['turn'] = [85.0, 4.0, 9.0, 9.0] + [9.0] * 4  # its smallest later turn: 4.0
    for seed, doses in ((1, ((150.0, 2.15), (50.0, 2.10), (10.0, 2.05))),
                        (2, ((150.0, 2.18), (50.0, 2.16), (10.0, 2.15)))):
        for lam, (norm, loss) in zip(('0.001', '0.01', '0.1'), doses):
            runs.append(fake_run(tmp_path, f"{c}rmsnorm + pen{lam}", seed, [loss] * 8, norm=norm))
    precision = {'rmsnorm': {'float32': [2.2, 2.5], 'bf16_state': [2.2, 2.51], 'bf16_autocast': [2.2, 2.49]},
                 'raw': {'float32': [2.0, 2.3], 'bf16_state': [2.0, 2.305], 'bf16_autocast': [2.0, 2.3]}}
    for run in runs[:2]:
        with open(os.path.join(run['folder'], 'precision.json'), 'w') as f:
            json.dump(precision[run['config']['model']['readout']], f)
    cells, _ = cost.by_cell(runs)
    lines = cost.mechanism_checks(cells).splitlines()
    assert lines[0].endswith('met in 4 of 4 runs')  # useful loops: rmsnorm 0 and 0, raw 3 and 2
    assert lines[1].endswith('met in 3 of 4 runs; missed by L4-lr1e-3-K4 + raw seed 2 (4.0 deg)')
    assert lines[2].endswith('met in 3 of 4 runs; missed by L4-lr1e-3-K4 + raw seed 2 (40.0)')
    assert lines[3].endswith('met in 2 of 2 seeds')
    assert lines[4].endswith('met in 1 of 2 seeds; missed by seed 2 (2.200 > 2.180 > 2.160 > 2.150, 25% of the gap)')
    assert lines[5].endswith('met in 1 of 1 seeds')  # 2.00 - 2.15 = -0.15
    assert lines[6].endswith('met in 1 of 1 pairs')  # 0.01 and 0.01 against 0.005 and 0
    runs[5]['records'][-1]['hidden_norm'] = [80.0] * 8  # lambda 0.001 at 80: under 100, and under 0.01's
    runs[6]['records'][-1]['hidden_norm'] = [90.0] * 8  # 90, so the dose no longer falls at every step
    lines = cost.mechanism_checks(cost.by_cell(runs)[0]).splitlines()
    assert lines[3].endswith('missed by seed 1 (500.0 > 80.0 > 90.0 > 10.0)')


def test_a_shift_inside_the_margin_that_differs_from_zero_reports_both_facts():
    """A tiny, consistent shift (+0.001 in every pair) is equivalent within the margin and also higher than 0:
    the row says both, not only the equivalence that is tested first."""
    shift = cost.comparison_row('shift', [1, 2, 3, 4], [0.0010, 0.0011, 0.0009, 0.0010], 'x')
    noise = cost.comparison_row('noise', [1, 2, 3, 4], [0.001, -0.001, 0.0005, -0.0005], 'x')
    cost.family_table([shift, noise], 'd')
    assert shift['verdict'] == 'equivalent within +-0.02, and higher than 0'
    assert noise['verdict'] == 'equivalent within +-0.02'


def test_the_cost_course_table_averages_each_step_over_the_pairs(tmp_path):
    """Two pairs of the 4-layer 1e-3 cell with records at steps 100 and 1,000: the costs are -0.3 and +0.1 at
    step 100 and +0.1 and +0.2 at 1,000, so the table shows -0.100 and +0.150; a step no run logged is left out."""
    runs = []
    for seed, (early, late) in ((1, (-0.3, 0.1)), (2, (0.1, 0.2))):
        raw = fake_run(tmp_path, 'L4-lr1e-3-K4 + raw', seed, [2.0] * 8)
        rms = fake_run(tmp_path, 'L4-lr1e-3-K4 + rmsnorm', seed, [2.0] * 3 + [2.0 + late] + [2.0] * 4)
        first = dict(rms['records'][-1], step=100, val_loss=[2.0] * 3 + [2.0 + early] + [2.0] * 4,
                     train_loss=2.0 + 2 * early)
        rms['records'].insert(0, first)
        raw['records'].insert(0, dict(raw['records'][-1], step=100))
        runs += [raw, rms]
    cells, _ = cost.by_cell(runs)
    rows = [line for line in cost.course_table(cells).splitlines() if line.startswith('| 4 layers')]
    assert rows == ['| 4 layers, lr 1e-3 | 100 | 2 | 1.900 | 2.000 | -0.100 | -0.200 |',
                    '| 4 layers, lr 1e-3 | 1000 | 2 | 2.150 | 2.000 | +0.150 | +0.150 |']
