"""The README demo's log, evaluation for evaluation: the default run (python train.py --readout=rmsnorm
--norm_penalty=0), cut to 20 steps and one evaluation batch so that it fits the suite, gives every logged number
of the log that tests/data/demo_log.json keeps from train.py before the handout's rework (the validation loss
and ||h_k|| at every depth, the training loss, the turn at every loop). One thread: sums run in one order."""

import json
import os
import subprocess
import sys

from conftest import ROOT


def test_the_default_run_logs_what_it_logged_before_the_rework(tmp_path):
    with open(os.path.join(ROOT, 'tests', 'data', 'demo_log.json')) as f:
        reference = json.load(f)
    argv = reference['command'].split()[2:]  # after OMP_NUM_THREADS=1 python
    r = subprocess.run([sys.executable, *argv, f'--out_dir={tmp_path / "run"}'], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stderr[-2000:]
    with open(tmp_path / 'run' / 'log.jsonl') as f:
        records = [json.loads(line) for line in f.read().splitlines()[1:]]
    for got in records:
        got.pop('elapsed_s')
    assert records == reference['records']
