"""lab/interaction.py's reading side on hand-built logs whose answers are known: the interaction seed by seed and
its mean, a seed short of one run left out, the verdict words, the norms, the readings on the convergence grid's
own runs, and the command that writes table.md and the figure."""

from dataclasses import asdict
import json
import os

import pytest

from lab import converge, interaction
from lab.designs import DesignConfig
from lab.grid import load_run
from lab.interaction import K1_RAW, K1_RMS, K4_RAW, K4_RMS, PENALIZED, cell

# I_s of each seed; seed 6's run of K = 1 raw is never written, so its large I must not reach the mean
I_S = {1: 0.08, 2: -0.02, 3: 0.01, 4: 0.07, 5: 0.01, 6: 0.5}
NORMS = {K4_RMS: 1000.0, K4_RAW: 10.0, K1_RMS: 650.0, K1_RAW: 10.0, PENALIZED: 30.0}


def write_run(root, name, seed, loss, last_step=3000, norm=10.0):
    """A run folder of cell name (read back from its config, as lab.converge.cell_of does) whose loss at depth K
    at its last evaluation is loss; evaluations at step 1,500 (0.3 higher) and at last_step, of a run asked
    for 3,000 steps."""
    lr, rest = name.split('-lr')[1].split('-K')
    n_loop, readout = int(rest[0]), rest.split(' + ')[1]
    penalty = float(name.split('pen')[1]) if 'pen' in name else 0.0
    folder = root / f"{name.replace(' + ', '-')}-seed{seed}"
    folder.mkdir()
    model = asdict(DesignConfig(n_layer=4, n_loop=n_loop, readout=readout, norm_penalty=penalty))
    config = {'seed': seed, 'max_iters': 3000, 'learning_rate': float(lr), 'decay_lr': True, 'model': model}
    records = []
    for step, at_k in ((1500, loss + 0.3), (last_step, loss)):
        depths = [at_k + (0.1 + 0.1 * (loss - 2)) * (n_loop - 1 - i) for i in range(n_loop)]  # gains vary
        records.append({'step': step, 'train_loss': at_k, 'val_loss': depths + depths, 'elapsed_s': 1.0,
                        'hidden_norm': [norm] * (2 * n_loop), 'turn': [5.0 + seed] * (2 * n_loop)})
    lines = [json.dumps({'config': config})] + [json.dumps(r) for r in records]
    (folder / 'log.jsonl').write_text('\n'.join(lines) + '\n')
    return load_run(str(folder))


def grid(root, values=I_S, skip=((K1_RAW, 6),)):
    """Every run of the interaction and its best-rate twin: seed s's rmsnorm - raw is d1 = 0.09 + 0.002 s at
    K = 1 and d1 + values[s] at K = 4; the penalty takes 0.05 + 0.002 s off K = 4 rmsnorm (seeds 1-3); raw at
    lr 2e-3 is 0.01 lower at K = 4 and 0.02 lower at K = 1 than at 3e-3, so I at the best rates is I_s - 0.01."""
    runs = []
    for s, i in values.items():
        d1, raw4, raw1 = 0.09 + 0.002 * s, 2.0 + 0.001 * s, 2.2 - 0.001 * s
        loss = {K4_RAW: raw4, K4_RMS: raw4 + d1 + i, K1_RAW: raw1, K1_RMS: raw1 + d1}
        if s <= 3:
            loss.update({PENALIZED: raw4 + d1 + i - 0.05 - 0.002 * s, cell('2e-3', 'raw'): raw4 - 0.01,
                         cell('2e-3', 'raw', 1): raw1 - 0.02})
        runs += [write_run(root, name, s, x, norm=NORMS.get(name, 10.0)) for name, x in loss.items()
                 if (name, s) not in skip]
    return runs


def cells_runs(cells):
    """The runs of {cell: {seed: run}}, as tables() reads them."""
    return [run for runs in cells.values() for run in runs.values()]


def checks(cells):
    families = [interaction.interaction_rows(cells), interaction.readout_rows(cells),
                interaction.best_rate_rows(cells)]
    return {key: (word, found) for key, word, found in interaction.prediction_checks(cells, families)}, families


def test_the_interaction_is_each_seeds_difference_of_differences_and_a_seed_short_of_a_run_is_left_out(tmp_path):
    cells, notes = converge.by_cell(grid(tmp_path))
    assert not notes
    gaps, missing = interaction.readout_gaps(cells)
    assert sorted(gaps) == [1, 2, 3, 4, 5] and missing == {6: [K1_RAW]}
    assert gaps[2] == pytest.approx((0.094 - 0.02, 0.094))
    seeds, values = interaction.interaction(cells)
    assert seeds == [1, 2, 3, 4, 5] and values == pytest.approx([I_S[s] for s in seeds])
    (row,) = interaction.interaction_rows(cells)
    assert row['mean'] == pytest.approx(0.03) and row['n'] == 5  # seed 6 (I = 0.5) would make it 0.108
    table = interaction.tables(cells_runs(cells))
    assert '| I at lr 3e-3: (rmsnorm - raw at K = 4) - (rmsnorm - raw at K = 1) | 1 2 3 4 5 | +0.030 |' in table
    assert 'seed 6, without L4-cos-lr3e-3-K1 + raw' in table
    assert '| 2 | +0.074 | +0.094 | -0.020 |' in table


def test_the_families_and_the_checks_match_a_hand_computation(tmp_path):
    cells, _ = converge.by_cell(grid(tmp_path))
    found, (_, (k1, k4, pen), (best,)) = checks(cells)
    assert k1['seeds'] == [1, 2, 3, 4, 5] and k1['mean'] == pytest.approx(0.096)
    assert k4['seeds'] == [1, 2, 3, 4, 5, 6]  # K = 4 needs no K = 1 run: seed 6 is in
    assert pen['seeds'] == [1, 2, 3] and pen['mean'] == pytest.approx(-0.054) and pen['verdict'] == 'lower'
    assert best['seeds'] == [1, 2, 3] and best['mean'] == pytest.approx(0.07 / 3 - 0.01)
    assert found['interaction'][0] == 'met' and 'provisional: 5 of the 6 seeds' in found['interaction'][1]
    assert found['readout at K = 1'][0] == 'met' and found['penalty 0.01'][0] == 'met'
    assert found['norms'][0] == 'met'
    # seed 6's K = 4 gap (+0.602) pulls the K = 4 mean out of the predicted +0.08 to +0.16
    assert found['readout at K = 4'][0] == 'missed'
    text = interaction.checks_text(list((k, w, f) for k, (w, f) in found.items()))
    assert 'Met: 5; missed: 1; not measured yet: 0 (of 6 predictions).' in text


@pytest.mark.parametrize('values, word', [
    ({s: 0.2 + 0.001 * s for s in range(1, 7)}, 'higher'),
    ({s: -0.2 + 0.001 * s for s in range(1, 7)}, 'lower'),
    ({s: 0.001 * (s - 3.5) for s in range(1, 7)}, 'equivalent within +-0.02'),
    ({1: 0.1, 2: -0.15, 3: 0.05, 4: -0.1, 5: 0.2, 6: -0.2}, 'not resolved'),  # mean -0.017
])
def test_the_verdict_words_are_lab_costs(tmp_path, values, word):
    cells, _ = converge.by_cell(grid(tmp_path, values, skip=()))
    found, ((row,), _, _) = checks(cells)
    assert row['verdict'] == word and row['seeds'] == [1, 2, 3, 4, 5, 6]
    # the prediction is 'not resolved' with a mean between 0 and +0.06: none of these four meets it
    assert found['interaction'][0] == 'missed'
    assert f"| {word} |" in interaction.tables(cells_runs(cells))


def test_a_seed_with_too_few_runs_leaves_its_prediction_not_measured(tmp_path):
    cells, _ = converge.by_cell(grid(tmp_path, {1: 0.02, 2: 0.03}, skip=((K1_RAW, 2), (PENALIZED, 1))))
    found, _ = checks(cells)
    assert found['interaction'][0] == 'not measured yet' and found['penalty 0.01'][0] == 'not measured yet'
    assert found['norms'][0] == 'not measured yet'  # K = 1 raw and the penalty have one seed each
    assert found['readout at K = 4'][0] in ('met', 'missed')


def test_the_norms_are_read_at_depth_k_and_set_beside_their_ranges(tmp_path):
    runs = grid(tmp_path)
    runs.append(write_run(tmp_path, K1_RAW, 6, 2.2, norm=46.0))  # seed 6 completes: the mean 16 is out of 7-15
    cells, _ = converge.by_cell(runs)
    table = interaction.norm_table(cells)
    assert '| L4-cos-lr3e-3-K4 + rmsnorm | 6 | 1000.0 ± 0.0 | 850-1,150 | yes |' in table
    assert '| L4-cos-lr3e-3-K1 + raw | 6 | 16.0 ± 14.7 | 7-15 | no |' in table
    found, _ = checks(cells)
    assert found['norms'][0] == 'missed'


def test_the_readings_use_the_convergence_grids_own_runs_alone(tmp_path):
    cells, _ = converge.by_cell(grid(tmp_path))
    own = interaction.convergence_cells(cells)
    assert sorted(own[K4_RMS]) == [1, 2, 3] and sorted(own[K1_RAW]) == []  # seeds 4-6 and K = 1 raw: this grid's
    table = interaction.accounts_table(own)
    assert '| 100 | 6 | 3 |' in table and '| 1500 | 6 | 3 |' in table  # 3 pairs, 2 evaluations each
    text = interaction.readings_text(cells)
    assert text.startswith('Readings, not tests') and '- rmsnorm runs alone: Spearman' in text


def test_the_command_writes_the_table_and_the_figure_and_names_a_run_not_finished(tmp_path):
    root = tmp_path / 'runs'
    root.mkdir()
    grid(root)
    write_run(root, PENALIZED, 4, 2.0, last_step=1500)  # still training: left out and named
    out = tmp_path / 'figs'
    interaction.main([str(root / '*'), f'--fig_dir={out}'])
    text = (out / 'table.md').read_text()
    assert '## Every prediction, checked' in text and '## Readings' in text
    assert 'Not finished (left out): L4-cos-lr3e-3-K4-rmsnorm-pen0.01-seed4 at step 1500 of 3000' in text
    assert '| lr 3e-3: rmsnorm + penalty 0.01 - rmsnorm at K = 4, depth 4 | 1 2 3 |' in text
    for name in ('fig_interaction.png', 'fig_interaction.svg'):
        assert os.path.getsize(out / name) > 10_000, name


def test_the_course_table_is_each_steps_interaction_and_the_training_loss_row_reads_train_loss(tmp_path):
    """At step 1,500 every hand-built run is 0.3 above its step-3,000 loss, so each gap and I are step 3,000's;
    the training-loss row reads train_loss (here the depth-K loss plus 0.01 under rmsnorm at K = 4 only, which
    adds 0.01 to its K = 4 gap and to I); the split rows take seeds 1-3 and 4-5 (seed 6 lacks a run)."""
    runs = grid(tmp_path)
    for run in runs:
        if run['K'] == 4 and run['config']['model']['readout'] == 'rmsnorm' and not run['config']['model'][
                'norm_penalty']:
            for record in run['records']:
                record['train_loss'] += 0.01
    cells, _ = converge.by_cell(runs)
    assert interaction.common_steps(cells) == [1500, 3000]
    mean = lambda seeds: sum(I_S[s] for s in seeds) / len(seeds)
    lines = interaction.course_table(cells).splitlines()
    rows = {tuple(cols[:3]): cols for cols in ([c.strip() for c in line.strip('|').split('|')] for line in lines[2:])}
    assert rows[('1,500', 'validation', '1 2 3 4 5')][-1].startswith(f"{mean([1, 2, 3, 4, 5]):+.3f} [")
    assert rows[('3,000', 'training (fixed batches)', '1 2 3 4 5')][-1].startswith(
        f"{mean([1, 2, 3, 4, 5]) + 0.01:+.3f} [")
    assert rows[('3,000', 'validation', '4 5')][-1].startswith(f"{mean([4, 5]):+.3f} [")
    assert rows[('3,000', 'validation', '1 2 3')][-1].startswith(f"{mean([1, 2, 3]):+.3f} [")


def test_the_penalty_reading_is_its_gap_to_raw_at_k4(tmp_path):
    """Seed s's rmsnorm + penalty sits 0.05 + 0.002 s below K = 4 rmsnorm, which sits d1 + I_s above raw
    (d1 = 0.09 + 0.002 s): the penalty's gap to raw is 0.04 + I_s, seeds 1-3."""
    cells, _ = converge.by_cell(grid(tmp_path))
    text = interaction.penalty_reading(cells)
    assert f"- rmsnorm + penalty 0.01 - raw at K = 4, each at its depth K, at step 3,000: " \
           f"{0.04 + sum(I_S[s] for s in (1, 2, 3)) / 3:+.3f} [" in text
    # raw at K = 4 is 2.0 + 0.001 s, at K = 1 2.2 - 0.001 s: K = 4 - K = 1 is -0.2 + 0.002 s over seeds 1-5
    assert f"- raw: K = 4 - K = 1, each at its depth K, at step 3,000: {-0.2 + 0.002 * 3:+.3f} [" in text
