"""lab/bench.py: per-loop supervision must not cost K copies of the logits (GPT-2-sized vocabulary, CPU), and the
suite runs on a CPU in under a minute."""

from dataclasses import asdict
import json
import os
import re
import subprocess
import sys

import torch

from conftest import ROOT
from lab import bench
from lab.runtime import resolve_device
from lab.designs import DesignConfig, DesignedGPT

SMALL = ['--vocab_size=50257', '--n_embd=64', '--n_layer=1', '--n_head=2', '--batch_size=4', '--block_size=64',
         '--steps=1', '--warmup=1']


def saved_mib(supervision, n_loop=4):
    """What one training forward keeps for its backward (lab.bench's 'saved for backward', measured here in this
    process): the measure of "K copies of the logits", exact and the same in every run. The process's peak
    resident memory, which this test read before, also holds what the allocator kept from other work and varied
    from run to run (per_loop 236-260 MiB against terminal 207-220 on an idle machine), so it failed at random."""
    torch.manual_seed(0)
    model = DesignedGPT(DesignConfig(vocab_size=50257, n_embd=64, n_layer=1, n_head=2, block_size=64,
                                   n_loop=n_loop, supervision=supervision))
    x, y = torch.randint(50257, (2, 4, 64))
    return bench.saved_for_backward_mib(model, resolve_device('cpu', 'float32', False), x, y)


def test_the_bench_line_prints_what_is_saved_for_backward(capsys):
    bench.main([*SMALL, '--supervision=per_loop'])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert 'tok/s' in line and 'MFU n/a' in line and 'peak memory' in line
    printed = float(re.search(r'saved for backward ([\d,.]+) MiB', line).group(1).replace(',', ''))
    assert abs(printed - saved_mib('per_loop')) < 0.1


def test_per_loop_keeps_within_25_percent_of_terminals_memory_for_backward():
    per_loop, terminal, one_loop = saved_mib('per_loop'), saved_mib('terminal'), saved_mib('per_loop', 1)
    assert terminal > 40  # the measure sees at least one (4, 64, 50257) fp32 set of logits (49 MiB)
    assert per_loop <= 1.25 * terminal, (per_loop, terminal)
    # terminal reads out every loop too (for the log), so it shares per_loop's readouts: against one loop,
    # K = 4 loops may not keep 3 more sets of logits either
    assert per_loop <= 1.25 * one_loop, (per_loop, one_loop)


def test_suite_on_a_cpu_prints_the_table_and_writes_json(tmp_path):
    # as the docs type it (python -m lab.bench --suite), from a folder with no out/ yet: the default --json is
    # out/bench_suite.json, under the folder it runs from; the repository is found on PYTHONPATH
    env = {**os.environ, 'PYTHONPATH': ROOT + os.pathsep + os.environ.get('PYTHONPATH', '')}
    r = subprocess.run([sys.executable, '-m', 'lab.bench', '--suite'], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '| measure | configuration | result | goal |' in r.stdout and 'not measured here:' in r.stdout
    with open(tmp_path / 'out' / 'bench_suite.json') as f:
        suite = json.load(f)
    got = {row['measure']: row['result'] for row in suite['rows']}
    assert got['recompiles after warm-up'].startswith('0 ')  # no new graph for evaluation at 2K after warm-up
    compared = got['compiled vs eager loss']
    assert float(compared.split()[2]) <= 1e-2
    assert '3 of 3 regions compiled' in compared, compared  # the compiled side really is compiled (2 blocks + head)
    # the default dataset ships with the repository, so the blind-spot pair is always measured
    assert 'blind spot' in got, suite['not_measured']
    rms, raw = (float(v.replace(',', '')) for v in got['blind spot'].split(' (')[0].split(' / '))
    assert rms > 5 * raw
    assert any('peak memory' in s for s in suite['not_measured'])


def test_full_depth_score_reads_generates_windows():
    """Greedy text that generate made at full depth is, token for token, the full-depth model's own greedy choice
    when full_depth_score reads it back (past block_size, so through the window's restarts), and its loss is the
    negative log of those top probabilities."""
    import torch
    from lab.bench import full_depth_score
    from lab.engine import generate, next_logprobs
    from lab.designs import DesignConfig, DesignedGPT
    torch.manual_seed(0)
    model = DesignedGPT(DesignConfig(vocab_size=11, block_size=16, n_embd=32, n_head=2, n_layer=1, n_loop=3)).eval()
    prompt = torch.randint(11, (3, 5), generator=torch.Generator().manual_seed(1))
    idx, _ = generate(model, prompt, 60, top_k=1, cache=False)
    loss, agree = full_depth_score(model, idx, 5, 3)
    assert agree == 1.0
    logps, start = [], 0
    for t in range(5, idx.size(1)):  # the window as generate's docstring states it, recomputed without a cache
        if t - start > 16:
            start = t - 8
        logps.append(next_logprobs(model, idx[:, start:t], 3)[0].max(-1).values)
    assert abs(loss + torch.stack(logps).mean().item()) < 1e-5


def test_generate_benchmark_runs_and_refuses_an_exit_without_a_checkpoint():
    r = subprocess.run([sys.executable, '-m', 'lab.bench', '--generate', '--n_embd=32', '--n_layer=1',
                        '--block_size=16', '--recompute_cap=4'], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert '| batch | new tokens | cached tok/s | recomputed tok/s | speed-up |' in r.stdout
    assert r.stdout.count('(first 4)') == 4
    r = subprocess.run([sys.executable, '-m', 'lab.bench', '--generate', '--exit=kl', '--exit_threshold=0.1'],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stderr.strip().endswith('--exit needs --ckpt: what sharing costs is measured on a '
                                                            'trained model')


def test_generation_tokens_per_second_count_every_sequence_of_the_batch(monkeypatch):
    """The timing table's arithmetic, with the clock replaced: tokens/s is batch x new tokens / seconds, for
    the batch that was really generated (8 sequences, not one of them), and the speed-up is their ratio."""
    from lab import bench
    from lab.designs import DesignConfig, DesignedGPT
    model = DesignedGPT(DesignConfig(vocab_size=11, block_size=16, n_embd=16, n_head=2, n_layer=1, n_loop=2))
    seen = []

    def clock(model, prompt, new, cache):  # 1 ms a token per sequence cached, 4 ms recomputing
        seen.append(prompt.size(0))
        return (0.001 if cache else 0.004) * new
    monkeypatch.setattr(bench, 'timed_generate', clock)
    rows = bench.generation_speed(model, 'cpu', cap=0)
    assert set(seen) == {1, 8}
    assert [row[:2] for row in rows] == [[1, 256], [1, 1024], [8, 256], [8, 1024]]
    for batch, new, cached, recomputed, ratio in rows:
        assert cached == f"{batch * 1000:,}" and recomputed == f"{batch * 250:,}" and ratio == '4.0x'


def test_compare_times_this_checkout_against_another_and_refuses_a_folder_without_a_model(tmp_path, capsys,
                                                                                          monkeypatch):
    """python -m lab.compare against this checkout itself, on a tiny checkpoint: one row per measure, each
    with both times and two ratios; a folder with no looped.py is one line and exit 1."""
    import pytest
    import torch
    from lab import compare
    from lab.designs import DesignConfig, DesignedGPT
    config = DesignConfig(vocab_size=11, block_size=16, n_embd=16, n_head=2, n_layer=1, n_loop=2)
    torch.save({'model': DesignedGPT(config).state_dict(), 'config': asdict(config), 'step': 0},
               tmp_path / 'ckpt.pt')
    monkeypatch.chdir(ROOT)
    compare.main(['--against=.', f'--ckpt={tmp_path}', '--rounds=2', '--gen_rounds=2', '--tokens=8'])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith('| ') and 'ms' in line]
    assert [row.split(' | ')[0] for row in rows] == ['| cached generation, batch 1 (ms a token)',
                                                     '| cached generation, batch 8 (ms a token)',
                                                     '| training step (ms)']
    assert all(len(row.strip(' |').split(' | ')) == 5 for row in rows)
    with pytest.raises(SystemExit) as stop:  # fail(): one line, exit status 1 at the top level
        compare.main([f'--against={tmp_path}'])
    message = str(stop.value.code)
    assert message.startswith('python -m lab.compare: error:') and 'no looped.py' in message
    assert '\n' not in message
