"""bench.py: per-loop supervision must not cost K copies of the logits (GPT-2-sized vocabulary, CPU)."""

import re
import subprocess
import sys

from conftest import ROOT

SMALL = ['--vocab_size=50257', '--n_embd=64', '--n_layer=1', '--n_head=2', '--batch_size=4', '--block_size=64',
         '--steps=3', '--warmup=2']


def peak_mib(supervision):
    # one process per configuration: the CPU measure is the process's peak resident memory
    r = subprocess.run([sys.executable, 'bench.py', *SMALL, f'--supervision={supervision}'], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert 'tok/s' in line and 'MFU n/a' in line
    return float(re.search(r'peak memory ([\d,]+) MiB', line).group(1).replace(',', ''))


def test_per_loop_peak_memory_within_25_percent_of_terminal():
    per_loop, terminal = peak_mib('per_loop'), peak_mib('terminal')
    assert terminal > 40  # the measure sees at least one (4, 64, 50257) fp32 set of logits (49 MiB)
    assert per_loop <= 1.25 * terminal, (per_loop, terminal)
