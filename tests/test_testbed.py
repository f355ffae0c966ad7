"""lab/testbed.py's reading side on hand-built run folders (a log and an answers.json each) whose answers are
known: the loops-help family, the checks of its predictions, and the tables by depth and by hop count."""

from dataclasses import asdict
import json

import pytest

from lab import testbed
from lab.designs import DesignConfig
from lab.grid import load_run

ACC = {4: {1: 0.52, 2: 0.50, 3: 0.51}, 1: {1: 0.50, 2: 0.49, 3: 0.52}}   # answer accuracy at depth K
CE = {4: {1: 0.70, 2: 0.72, 3: 0.71}, 1: {1: 0.95, 2: 0.90, 3: 1.00}}   # answer loss at depth K


def write_run(root, k, seed):
    folder = root / f"chains-K{k}-seed{seed}"
    folder.mkdir()
    model = asdict(DesignConfig(n_layer=2, n_embd=64, n_loop=k, readout='raw'))
    config = {'seed': seed, 'max_iters': 3000, 'learning_rate': 3e-3, 'decay_lr': True, 'model': model}
    record = {'step': 3000, 'train_loss': 1.0, 'val_loss': [1.0] * 2 * k, 'hidden_norm': [5.0] * 2 * k,
              'elapsed_s': 1.0, 'turn': [1.0] * 2 * k}
    (folder / 'log.jsonl').write_text(json.dumps({'config': config}) + '\n' + json.dumps(record) + '\n')
    depths = 2 * k
    acc = [ACC[k][seed] - 0.01 * (k - d) if d < k else ACC[k][seed] for d in range(1, depths + 1)]
    answers = {'step': 3000, 'depths': list(range(1, depths + 1)), 'answer_acc': acc,
               'answer_ce': [CE[k][seed]] * depths, 'token_ce': [1.5 - 0.1 * (k == 4)] * depths, 'n_answers': 100,
               'by_hops': {'1': [60, acc], '2': [40, [a - 0.02 for a in acc]]}}
    (folder / 'answers.json').write_text(json.dumps(answers))
    return load_run(str(folder))


def built(tmp_path):
    return [write_run(tmp_path, k, s) for s in (1, 2, 3) for k in (4, 1)]


def test_the_family_and_its_checks_match_a_hand_computation(tmp_path):
    cells, notes = testbed.by_cell(built(tmp_path))
    assert not notes and set(cells) == {testbed.cell(4), testbed.cell(1)}
    loss, acc = testbed.family(cells)
    assert loss['mean'] == pytest.approx((-0.25 - 0.18 - 0.29) / 3) and acc['mean'] == pytest.approx(0.02 / 3)
    testbed.family_table([loss, acc], '')
    found = {k: (w, m) for k, w, m in testbed.checks([loss, acc], cells)}
    assert found['answer loss'][0] == 'met' and found['answer accuracy'][0] == 'met' and found['chance'][0] == 'met'
    assert found['all-token loss'] == ('a reading', 'seed 1: -0.100, seed 2: -0.100, seed 3: -0.100')


def test_the_tables_give_each_depth_and_hop_count(tmp_path):
    text = testbed.tables(built(tmp_path))
    assert '| chains-L2-d64-K4 + raw | 3 | 4 | 0.510 ± 0.010 | 0.710 ± 0.010 | 1.400 ± 0.000 |' in text
    assert '| chains-L2-d64-K4 + raw | 3 | 1 | 0.480 ± 0.010 |' in text  # 0.03 below depth K at depth 1
    assert '| chains-L2-d64-K1 + raw | 0.503 | 0.483 |' in text
