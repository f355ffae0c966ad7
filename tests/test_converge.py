"""lab/converge.py: the runs it trains and in which order, and every number of its tables on hand-built logs
whose answers are known: the converged cost, the best rates, the controls, the course and the two accounts."""

from dataclasses import asdict
import json
import os

import pytest

from lab import converge
from lab.designs import DesignConfig
from lab.grid import load_run

STEPS = range(100, 3001, 100)
# the level of each rate's losses, the same under both readouts: 2e-3 ends lowest for both
LEVEL = {'5e-4': 0.3, '1e-3': 0.2, '2e-3': 0.0, '3e-3': 0.1, '5e-3': 0.15}


def u(step, seed):
    """The cost rmsnorm - raw at depth K of every hand-built pair: below 0 until step 500, then rising."""
    return 0.2 * (step - 500) / 1000 + 0.001 * seed


def write_run(root, name, seed, records, lr, readout, n_loop=4, cosine=True, max_iters=None, **model):
    """A run folder whose log holds records; asked for max_iters steps (default: its last record's, finished)."""
    folder = root / f"{name.replace(' + ', '-')}-seed{seed}"
    folder.mkdir()
    config = {'seed': seed, 'max_iters': max_iters or records[-1]['step'], 'learning_rate': float(lr),
              'decay_lr': cosine,
              'model': asdict(DesignConfig(n_layer=4, n_loop=n_loop, readout=readout, **model))}
    lines = [json.dumps({'config': config})] + [json.dumps(r) for r in records]
    (folder / 'log.jsonl').write_text('\n'.join(lines) + '\n')
    return load_run(str(folder))


def record(step, losses, train_loss, turn):
    K = len(losses) // 2
    return {'step': step, 'train_loss': train_loss, 'val_loss': losses, 'hidden_norm': [10.0] * (2 * K),
            'elapsed_s': 1.0, 'turn': [turn] * (2 * K)}


def convergence_pair(root, lr, seed):
    """raw: 2.3 2.2 2.1 2.0 (+ the rate's level); rmsnorm: a first-exit gap of 0.75 u and a gain deficit of
    0.25 u on top, so its cost at depth K is u, three quarters of it the first exit's."""
    raw, rms = [], []
    for step in STEPS:
        base = [x + LEVEL[lr] for x in (2.3, 2.2, 2.1, 2.0)]
        c = u(step, seed)
        raw.append(record(step, base + base, base[3] - 0.1, turn=10.0))
        gap = 0.75 * c
        mine = [base[0] + gap, base[1] + gap, base[2] + gap, base[3] + c]
        rms.append(record(step, mine + mine, mine[3] - 0.1 + 2 * c, turn=1.0))
    return [write_run(root, converge.cell(lr, 'raw'), seed, raw, lr, 'raw'),
            write_run(root, converge.cell(lr, 'rmsnorm'), seed, rms, lr, 'rmsnorm')]


def one_loop(root, lr, readout, seed, loss):
    records = [record(step, [loss, loss], loss, turn=5.0) for step in STEPS]
    return write_run(root, converge.cell(lr, readout, 1), seed, records, lr, readout, n_loop=1)


def control(root, name, seed, loss, readout, **model):
    return write_run(root, name, seed, [record(1000, [loss] * 8, loss, 2.0)], '1e-3', readout, cosine=False,
                     **model)


def all_runs(root):
    runs = []
    for seed in (1, 2, 3):
        for lr in converge.CHECKED:
            runs += convergence_pair(root, lr, seed)
    for lr in ('5e-4', '2e-3', '5e-3'):
        runs += convergence_pair(root, lr, 1)
    for seed in (2, 3):
        runs += convergence_pair(root, '2e-3', seed)
    for seed in (1, 2, 3):
        raw_k4, rms_k4 = 2.0, 2.0 + u(3000, seed)
        runs += [one_loop(root, '2e-3', 'raw', seed, raw_k4 + 0.1 + 0.001 * seed),
                 one_loop(root, '2e-3', 'rmsnorm', seed, rms_k4 + 0.05 - 0.01 * seed)]
        # the cost grid's 4-layer 1e-3 runs and the two controls beside them
        runs += [control(root, 'L4-lr1e-3-K4 + raw', seed, 2.0, 'raw'),
                 control(root, 'L4-lr1e-3-K4 + rmsnorm', seed, 2.15, 'rmsnorm'),
                 control(root, 'L4-lr1e-3-K4 + raw + pen0.1', seed, 2.06 + 0.001 * seed, 'raw', norm_penalty=0.1),
                 control(root, 'L4-lr1e-3-K4 + rmsnorm + normed', seed, 2.10 - 0.01 * seed, 'rmsnorm',
                         recurrence='normed')]
    return runs


def test_the_runs_are_trained_convergence_check_first_then_controls_sweep_and_best_rates():
    order = converge.jobs()
    assert order[:4] == [(converge.cell(lr, ro), 1) for lr in ('1e-3', '3e-3') for ro in ('rmsnorm', 'raw')]
    assert len(order) == 12 + 6 + 6 and all(name in converge.GRID for name, _ in order)
    later = converge.jobs({'rmsnorm': '5e-3', 'raw': '3e-3'})[len(order):]
    # rmsnorm's best is new: seeds 2 and 3 there; raw's is the checked 3e-3: none; one-loop runs for both
    assert later[:2] == [(converge.cell('5e-3', 'rmsnorm'), 2), (converge.cell('5e-3', 'rmsnorm'), 3)]
    assert sorted(later[2:]) == sorted((converge.cell(lr, ro, 1), s) for s in (1, 2, 3)
                                       for lr, ro in (('5e-3', 'rmsnorm'), ('3e-3', 'raw')))
    for name in converge.GRID:
        if name.startswith('L4-cos'):
            flags = converge.GRID[name]
            assert {'--max_iters=3000', '--warmup_iters=100', '--decay_lr=True'} <= set(flags), name


def test_a_cells_name_is_read_back_from_its_log(tmp_path):
    runs = {converge.cell_of(r) for r in all_runs(tmp_path)}
    assert {'L4-cos-lr2e-3-K1 + rmsnorm', 'L4-lr1e-3-K4 + raw + pen0.1', 'L4-lr1e-3-K4 + rmsnorm + normed',
            'L4-cos-lr5e-3-K4 + raw'} <= runs
    assert runs <= set(converge.GRID) | {'L4-lr1e-3-K4 + raw', 'L4-lr1e-3-K4 + rmsnorm'}


def test_the_best_rate_is_the_lowest_seed_one_run_and_none_until_the_sweep_is_complete(tmp_path):
    runs = all_runs(tmp_path)
    assert converge.best_rates(runs) == {'rmsnorm': '2e-3', 'raw': '2e-3'}
    partial = [r for r in runs if not (r['config']['learning_rate'] == 5e-3 and r['config']['seed'] == 1)]
    assert converge.best_rates(partial) is None


def test_every_family_matches_a_hand_computation(tmp_path):
    runs = all_runs(tmp_path)
    cells, notes = converge.by_cell(runs)
    assert not notes
    conv = converge.converged_rows(cells)
    # u(3000, seed) = 0.5 + 0.001 * seed
    assert conv[0]['mean'] == pytest.approx(0.502) and conv[0]['sd'] == pytest.approx(0.001)
    assert conv[0]['seeds'] == [1, 2, 3]
    best, k4_raw, k4_rms = converge.best_rows(cells)
    assert best['label'].startswith('rmsnorm at lr 2e-3 - raw at lr 2e-3') and best['mean'] == pytest.approx(0.502)
    assert k4_raw['mean'] == pytest.approx(-0.102) and k4_raw['sd'] == pytest.approx(0.001)
    assert k4_rms['mean'] == pytest.approx(-0.05 + 0.02) and k4_rms['sd'] == pytest.approx(0.01)
    pen, normed, normed_raw = converge.control_rows(cells)
    assert pen['mean'] == pytest.approx(0.062) and pen['sd'] == pytest.approx(0.001)
    assert normed['mean'] == pytest.approx(-0.07) and normed_raw['mean'] == pytest.approx(0.08)
    table = converge.tables(runs)
    assert '| lr 1e-3: rmsnorm - raw at depth 4, step 3,000 | 1 2 3 | +0.502 | 0.001 |' in table


def test_the_course_and_the_two_accounts_match_a_hand_computation(tmp_path):
    cells, _ = converge.by_cell(all_runs(tmp_path))
    points = converge.course(cells, '1e-3')
    step, cost, gap = points[0]
    assert step == 100 and cost == pytest.approx([u(100, s) for s in (1, 2, 3)])
    assert gap == pytest.approx([3 * u(100, s) for s in (1, 2, 3)])  # its training loss: u + 2 u above raw
    acc = converge.accounts(cells)
    # every pair's cost is u: three quarters first-exit gap, a quarter gain deficit, both exactly proportional
    assert acc['first exit'] == pytest.approx((0.75, 1.0)) and acc['wasted loops'] == pytest.approx((0.25, 1.0))
    assert acc['points'] == 30 * (3 * 2 + 3 + 2)  # 30 evaluations of 11 pairs
    assert acc['holds'] == {'wasted loops': False, 'first exit': True} and acc['pairs'] == 11
    # with fewer pairs than planned the accounts are provisional, and their prediction not yet checked
    few = {name: runs for name, runs in cells.items() if '1e-3' in name and 'cos' in name}
    assert 'Provisional: 3 of the 9 pairs' in converge.accounts_text(converge.accounts(few))
    late = converge.accounts(cells, first_step=500)
    assert late['points'] == 26 * 11 and late['first exit'] == pytest.approx((0.75, 1.0))
    families = [converge.converged_rows(cells), converge.best_rows(cells), converge.control_rows(cells)]
    checks = converge.prediction_checks(cells, families, acc)
    lines = dict(line[2:].split(': ', 1) for line in checks.splitlines())
    assert acc['turn'] < 0.5 and lines['accounts'].startswith('met.')
    # the prediction names the turn too: a turn that predicts loop 2's gain (Spearman >= 0.5) misses it
    turned = converge.prediction_checks(cells, families, dict(acc, turn=0.9))
    assert '- accounts: missed.' in turned and 'Spearman +0.90' in turned
    # at the last step the split reads the same three quarters and a quarter; a single pair has no interval
    split = converge.split_table(cells)
    assert '| lr 5e-4 | 1 | +0.501 (one pair) | +0.376 (one pair) | +0.125 (one pair) | +0.175, +0.300 |' in split
    assert '| lr 1e-3 | 3 | +0.502 [+0.500, +0.504] | +0.377 [+0.375, +0.378] |' in split
    # u < 0 at step 100 and first above 0 at step 500: the course crosses 0 before step 1,000
    assert lines['course'].startswith('met.') and 'first above 0 at step 500' in lines['course']
    assert lines['converged cost lr 1e-3'].startswith('missed.')  # +0.502 is above the predicted +0.148
    assert lines['control raw + penalty 0.1'].startswith('met.')


def test_a_run_short_of_its_last_step_is_left_out_of_its_cell_and_named(tmp_path):
    """A run still training (its last evaluation before max_iters) would mix training lengths in a mean: it is
    left out of its cell, and the table names it."""
    runs = all_runs(tmp_path)
    for readout in converge.READOUTS:  # seed 4 of both readouts at 1e-3, stopped at step 1,500 of 3,000
        records = [record(step, [9.0] * 8, 9.0, turn=1.0) for step in range(100, 1501, 100)]
        runs.append(write_run(tmp_path, converge.cell('1e-3', readout), 4, records, '1e-3', readout,
                              max_iters=3000))
    cells, notes = converge.by_cell(runs)
    assert 4 not in cells[converge.cell('1e-3', 'rmsnorm')] and 4 not in cells[converge.cell('1e-3', 'raw')]
    assert converge.converged_rows(cells)[0]['seeds'] == [1, 2, 3]
    assert notes == [f"L4-cos-lr1e-3-K4-{ro}-seed4 at step 1500 of 3000" for ro in ('rmsnorm', 'raw')]
    assert ('Not finished (left out): L4-cos-lr1e-3-K4-rmsnorm-seed4 at step 1500 of 3000; '
            'L4-cos-lr1e-3-K4-raw-seed4 at step 1500 of 3000') in converge.tables(runs)


def deficit_pair(root, seed, turn_sign):
    """An rmsnorm/raw pair at lr 1e-3 whose cost u is a quarter first-exit gap and three quarters gain deficit
    (the wasted-loops account's share 0.75, r 1); loop 2's gain g rises with the step (and is 0.00005 larger
    under rmsnorm, so that no two gains tie), and its turn is g times turn_sign: +1, the turn predicts the
    gain (Spearman +1); -1, it predicts its opposite (Spearman -1)."""
    raw, rms = [], []
    for step in STEPS:
        c = u(step, seed)
        g = 0.05 + step / 30000 + 0.0001 * seed
        base = [2.3, 2.3 - g, 2.2 - g, 2.1 - g]
        raw.append(record(step, base + base, base[3], turn=turn_sign * g))
        mine = [base[0] + 0.25 * c, base[1] + 0.25 * c - 0.00005, base[2] + 0.25 * c, base[3] + c]
        rms.append(record(step, mine + mine, mine[3], turn=turn_sign * (g + 0.00005)))
    return [write_run(root, converge.cell('1e-3', 'raw'), seed, raw, '1e-3', 'raw'),
            write_run(root, converge.cell('1e-3', 'rmsnorm'), seed, rms, '1e-3', 'rmsnorm')]


@pytest.mark.parametrize('turn_sign, holds', [(-1, False), (1, True)])
def test_the_wasted_loops_account_needs_the_turn_to_predict_the_gain(tmp_path, turn_sign, holds):
    """The gain deficit carrying the cost is not enough: the account's mechanism (a state each later loop turns
    little) needs loop 2's turn to predict its gain, Spearman >= 0.5."""
    cells, _ = converge.by_cell([r for seed in (1, 2, 3) for r in deficit_pair(tmp_path, seed, turn_sign)])
    acc = converge.accounts(cells)
    share, r = acc['wasted loops']
    assert share == pytest.approx(0.75) and r == pytest.approx(1.0)
    assert acc['turn'] == pytest.approx(float(turn_sign))
    assert acc['holds']['wasted loops'] is holds and acc['holds']['first exit'] is False


def test_the_tables_and_figures_are_written_from_run_folders(tmp_path):
    root = tmp_path / 'runs'
    root.mkdir()
    all_runs(root)
    out = tmp_path / 'figs'
    converge.main([str(root / '*'), '--cost_runs=', f'--fig_dir={out}'])
    text = (out / 'table.md').read_text()
    assert '## Every prediction, checked' in text and 'Not finished' not in text
    for name in ('fig_course.png', 'fig_rates.png', 'fig_course.svg'):
        assert os.path.getsize(out / name) > 10_000, name


def test_a_bad_part_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        converge.main(['--run', '--part=3/2'])
    assert e.value.code != 0
