"""What a nanoGPT user meets in train.py: the warmup-and-cosine schedule, float16 with a GradScaler,
the progress line's figures (loss, tok/s, ETA, MFU), the evaluation's weighting and the best loss, the
habits typed from nanoGPT and the flags' bare forms and helps."""

import math
import os
import re
import warnings

import pytest
import torch

import train
from plumbing import run as data_flags
from looped import LoopedGPT
from conftest import ROOT
from lab import runtime
from lab.configs import NANOGPT_HABITS
from lab.runs import load_checkpoint
from lab.designs import DesignConfig, DesignedGPT

TINY = ['--n_layer=1', '--n_embd=16', '--n_head=2', '--n_loop=2', '--block_size=16', '--batch_size=2',
        '--eval_iters=1']


def flags(small_data, out, *more):
    return ['--dataset', small_data, '--out_dir', str(out), *TINY, *more]


def record_rates(monkeypatch):
    """Wrap AdamW.step: returns the list of the learning rate each optimizer step took."""
    rates, real = [], torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, 'step',
                        lambda self, *a, **k: rates.append(self.param_groups[0]['lr']) or real(self, *a, **k))
    return rates


def nanogpt_cosine(it, lr, min_lr, warmup, decay_iters):
    """nanoGPT's get_lr past its warmup, written out from its definition."""
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


# ---- the schedule

def test_decay_lr_is_nanogpts_cosine_after_this_repositorys_warmup_then_min_lr(small_data, tmp_path, monkeypatch):
    rates = record_rates(monkeypatch)
    train.main(flags(small_data, tmp_path / 'run', '--max_iters=26', '--eval_interval=26', '--log_interval=26',
                     '--learning_rate=0.01', '--decay_lr', '--warmup_iters=5', '--lr_decay_iters=20', '--min_lr=1e-3'))
    assert len(rates) == 26
    assert rates[:5] == pytest.approx([0.01 * (i + 1) / 5 for i in range(5)])  # the ramp of the committed runs
    assert rates[5:] == pytest.approx([nanogpt_cosine(i, 0.01, 1e-3, 5, 20) for i in range(5, 26)])
    assert rates[5] == pytest.approx(0.01) and rates[20:] == pytest.approx([1e-3] * 6)


def test_decay_lr_defaults_are_nanogpts_the_whole_run_to_a_tenth(small_data, tmp_path, monkeypatch):
    rates = record_rates(monkeypatch)
    train.main(flags(small_data, tmp_path / 'run', '--max_iters=10', '--eval_interval=10', '--log_interval=10',
                     '--learning_rate=0.01', '--decay_lr'))
    assert rates == pytest.approx([nanogpt_cosine(i, 0.01, 1e-3, 0, 10) for i in range(10)])


def test_without_decay_lr_the_rate_stays_the_papers_constant(small_data, tmp_path, monkeypatch):
    rates = record_rates(monkeypatch)
    train.main(flags(small_data, tmp_path / 'run', '--max_iters=4', '--eval_interval=4', '--log_interval=4',
                     '--learning_rate=0.01', '--lr_decay_iters=2', '--min_lr=0'))
    assert rates == pytest.approx([0.01] * 4)


def test_a_resumed_run_continues_the_schedule_exactly(small_data, tmp_path, monkeypatch):
    schedule = ['--learning_rate=0.01', '--decay_lr', '--warmup_iters=3', '--lr_decay_iters=16', '--min_lr=1e-4']
    rates = record_rates(monkeypatch)
    train.main(flags(small_data, tmp_path / 'whole', '--max_iters=18', '--eval_interval=6', '--log_interval=6',
                     *schedule))
    whole = list(rates)
    rates.clear()
    train.main(flags(small_data, tmp_path / 'cut', '--max_iters=7', '--eval_interval=6', '--log_interval=6',
                     *schedule))
    # resumed with none of the schedule's flags typed: they come from the checkpoint, as the seed does
    train.main(flags(small_data, tmp_path / 'cut', '--max_iters=18', '--eval_interval=6', '--log_interval=6',
                     '--resume'))
    assert rates == pytest.approx(whole)


def test_a_run_extended_with_decay_lr_decays_over_all_of_it(small_data, tmp_path, monkeypatch):
    rates = record_rates(monkeypatch)
    out = tmp_path / 'run'
    train.main(flags(small_data, out, '--max_iters=4', '--eval_interval=4', '--log_interval=4',
                     '--learning_rate=0.01'))  # constant, as the paper
    rates.clear()
    train.main(flags(small_data, out, '--max_iters=10', '--eval_interval=10', '--log_interval=10', '--resume',
                     '--decay_lr'))
    assert rates == pytest.approx([nanogpt_cosine(i, 0.01, 1e-3, 0, 10) for i in range(4, 10)])


@pytest.mark.parametrize('bad, message', [
    (['--decay_lr', '--warmup_iters=10', '--lr_decay_iters=5'], 'must be greater than --warmup_iters=10'),
    (['--learning_rate=0.01', '--min_lr=0.1'], 'between 0 and --learning_rate'),
    (['--lr_decay_iters=0'], '--lr_decay_iters=0 must be at least 1'),
])
def test_a_bad_schedule_is_one_line_and_touches_nothing(small_data, tmp_path, bad, message):
    out = tmp_path / 'run'
    with pytest.raises(SystemExit) as e:
        train.main(flags(small_data, out, '--max_iters=20', *bad))
    assert message in str(e.value.code) and '\n' not in str(e.value.code)
    assert not out.exists()


# ---- float16 and its GradScaler

def test_float16_off_cuda_is_one_line(small_data, tmp_path):
    with pytest.raises(SystemExit) as e:
        train.main(flags(small_data, tmp_path / 'run', '--max_iters=2', '--dtype=float16', '--device=cpu'))
    assert 'float16 needs CUDA' in str(e.value.code) and '\n' not in str(e.value.code)


@pytest.mark.parametrize('has_bf16, want', [(True, 'bfloat16'), (False, 'float16')])
def test_auto_dtype_on_cuda_is_bf16_where_the_gpu_has_it_and_float16_elsewhere(monkeypatch, has_bf16, want):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda including_emulation=True: has_bf16)
    monkeypatch.setattr(torch.backends.cuda.matmul, 'allow_tf32', torch.backends.cuda.matmul.allow_tf32)
    monkeypatch.setattr(torch.backends.cudnn, 'allow_tf32', torch.backends.cudnn.allow_tf32)
    with warnings.catch_warnings():  # autocast on 'cuda' without a GPU may warn and disable itself
        warnings.simplefilter('ignore')
        rt = runtime.resolve_device('cuda', 'auto', False)
    assert rt.dtype == want


def cpu_scaler(monkeypatch, made, init_scale):
    """A GradScaler that works on this CPU (enabled, growing every step), in place of train.py's."""
    real = torch.amp.GradScaler

    def make(device_type, enabled=True, **others):
        if others:  # not train.py's
            return real(device_type, enabled=enabled, **others)
        made.append(real('cpu', init_scale=init_scale, growth_interval=1))
        return made[-1]
    monkeypatch.setattr(torch.amp, 'GradScaler', make)


def test_the_gradscalers_state_is_saved_and_restored_with_the_checkpoint(small_data, tmp_path, monkeypatch):
    made = []
    cpu_scaler(monkeypatch, made, 1024.0)
    out = tmp_path / 'run'
    train.main(flags(small_data, out, '--max_iters=3', '--eval_interval=3', '--log_interval=3'))
    saved = load_checkpoint(str(out / 'ckpt.pt'))['scaler']
    assert saved['scale'] == made[0].get_scale() == 1024.0 * 2 ** 3  # grown once a step
    cpu_scaler(monkeypatch, made, 8.0)  # a fresh scaler in the resumed process, as a new one would be
    train.main(flags(small_data, out, '--max_iters=4', '--eval_interval=4', '--log_interval=4', '--resume'))
    assert made[1].get_scale() == 1024.0 * 2 ** 4  # continued from the checkpoint's, not from 8


def test_the_scaler_leaves_every_update_as_it_is_without_it(small_data, tmp_path, monkeypatch):
    """Scaling the loss by a power of 2 and unscaling before the clip and the step changes no weight."""
    run = lambda out: train.main(flags(small_data, out, '--max_iters=3', '--eval_interval=3', '--log_interval=3'))
    run(tmp_path / 'plain')
    cpu_scaler(monkeypatch, [], 1024.0)
    run(tmp_path / 'scaled')
    plain, scaled = (load_checkpoint(str(tmp_path / n / 'ckpt.pt'))['model'] for n in ('plain', 'scaled'))
    for name, w in plain.items():
        assert torch.allclose(w, scaled[name], rtol=1e-5, atol=1e-7), name


def test_a_step_the_scaler_skips_is_not_a_divergence(small_data, tmp_path, monkeypatch, capsys):
    made, real = [], LoopedGPT.forward
    cpu_scaler(monkeypatch, made, 1024.0)
    calls = []

    class Overflow(torch.autograd.Function):  # adds 0 to the loss, and an infinite gradient
        @staticmethod
        def forward(ctx, w):
            return w.sum() * 0

        @staticmethod
        def backward(ctx, grad):
            return torch.full((16,), float('inf'))

    def forward(self, idx, targets=None, n_loop=None):  # training step 2's gradients overflow
        logits, loss, stats = real(self, idx, targets, n_loop)
        if self.training and targets is not None:
            calls.append(1)
            if len(calls) == 2:
                loss = loss + Overflow.apply(self.wte.weight[0])  # the loss stays finite
        return logits, loss, stats
    monkeypatch.setattr(LoopedGPT, 'forward', forward)
    out = tmp_path / 'run'
    train.main(flags(small_data, out, '--max_iters=4', '--eval_interval=4', '--log_interval=4'))
    text = capsys.readouterr().out
    assert 'float16 steps skipped 1' in text and 'done: 4 steps' in text
    assert made[0].get_scale() == 1024.0 * 2 ** 3 / 2  # grown at three steps, halved at the skipped one
    assert load_checkpoint(str(out / 'ckpt.pt'))['step'] == 4


# ---- the progress line and the evaluation

def test_the_progress_lines_loss_at_step_1_is_the_objective_trained(small_data, tmp_path, monkeypatch, capsys):
    objectives, real = [], LoopedGPT.forward

    def forward(self, idx, targets=None, n_loop=None):
        out = real(self, idx, targets, n_loop)
        if self.training and targets is not None:
            objectives.append((out[1].item(), out[2]['ce'][-1].item()))
        return out
    monkeypatch.setattr(LoopedGPT, 'forward', forward)
    train.main(flags(small_data, tmp_path / 'run', '--max_iters=1', '--eval_interval=1', '--log_interval=1',
                     '--norm_penalty=0.01'))  # a penalty, so that the objective is not any one exit's loss
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith('step 1/1'))
    objective, ce_K = objectives[0]
    assert abs(objective - ce_K) > 0.01
    assert f"loss {objective:.4f}" in line and f"ce_K {ce_K:.4f}" in line


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_the_progress_lines_clock_tokens_and_eta_by_hand(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(train.time, 'time', clock)
    # 2 processes x 3 micro-steps x batch 4 = 24 sequences of 8 tokens per optimizer step
    progress = train.Progress(10, 24 * 8, 1e6, 'cpu')
    progress.peak = 1e9  # a known peak, so that MFU is a number to check
    clock.now += 4.0  # 20 steps in 4 s
    progress.losses, progress.ces = [torch.tensor(2.0), torch.tensor(3.0)], [torch.tensor(1.0), torch.tensor(1.5)]
    line = progress.line(30, 100, 2.0)
    assert '200 ms/step' in line
    assert '960 tok/s' in line  # 24 * 8 tokens / 0.2 s: every process and micro-step counted
    assert 'MFU 96.0%' in line  # 960 tok/s * 1e6 FLOPs / 1e9
    assert 'ETA 0m14s' in line  # 4 s for 20 steps, 70 to go
    assert 'loss 2.5000' in line and 'ce_K 1.2500' in line and '||h_K|| 2.0' in line
    clock.now += 6.0  # then 20 more in 6 s: the ETA uses every step since the start
    progress.losses, progress.ces = [torch.tensor(1.0)], [torch.tensor(1.0)]
    line = progress.line(50, 100, 2.0)
    assert '300 ms/step' in line and 'ETA 0m12s' in line  # 10 s for 40 steps, 50 to go: 12.5 s
    progress.skips, progress.losses, progress.ces = 2, [], []
    clock.now += 1.0
    assert progress.line(51, 100, 2.0, 3).startswith('step 51/100 | loss skipped | r 3 | ce_r skipped')


def test_an_evaluation_weighs_a_short_last_batch_by_its_size():
    torch.manual_seed(0)
    model = DesignedGPT(DesignConfig(vocab_size=11, block_size=8, n_embd=16, n_head=2, n_layer=1, n_loop=2))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(11, (4, 8), generator=g), torch.randint(11, (4, 8), generator=g)
    batches = [(x[:3], y[:3]), (x[3:], y[3:])]  # 3 sequences, then 1
    ce, norm = train.evaluate(model, batches, 2, torch.autocast('cpu', enabled=False))
    ones = [train.evaluate(model, [(x[i:i + 1], y[i:i + 1])], 2, torch.autocast('cpu', enabled=False))
            for i in range(4)]
    assert ce == pytest.approx([sum(o[0][k] for o in ones) / 4 for k in range(2)], rel=1e-5)
    assert norm == pytest.approx([sum(o[1][k] for o in ones) / 4 for k in range(2)], rel=1e-5)


def test_the_best_validation_loss_is_the_lowest_so_far_not_the_last(small_data, tmp_path, monkeypatch):
    losses = iter([3.0, 2.0, 2.5])

    def evaluate(model, batches, n_loop, ctx):  # the validation loss (at 2K loops) 3.0, 2.0, then 2.5
        return [next(losses) if n_loop > model.config.n_loop else 1.0] * n_loop, [1.0] * n_loop
    monkeypatch.setattr(train, 'evaluate', evaluate)
    out = tmp_path / 'run'
    train.main(flags(small_data, out, '--max_iters=2', '--eval_interval=1', '--log_interval=1'))
    assert load_checkpoint(str(out / 'ckpt.pt'))['best_val_loss'] == 2.0


# ---- nanoGPT's habits, bare booleans, helps, --resume's folder

@pytest.mark.parametrize('habit, ours', [
    (['config/train_shakespeare_char.py'], '--config=NAME'),
    (['--init_from=resume'], '--resume'),
    (['--eval_only=True'], 'python -m lab.diagnose'),
    (['--gradient_accumulation_steps=4'], '--grad_accum'),
    (['--wandb_log=True'], 'log.jsonl'),
    (['--lr=1e-3'], '--learning_rate'),
])
def test_each_nanogpt_habit_is_one_line_naming_this_repositorys_way(habit, ours):
    with pytest.raises(SystemExit) as e:
        train.main(habit)
    err = str(e.value.code)  # sys.exit(message): one line on stderr, exit status 1
    assert err.startswith('train.py: error: ') and ours in err and '\n' not in err, err


def test_every_nanogpt_flag_in_the_usage_table_gets_its_one_line():
    with open(os.path.join(ROOT, 'docs', 'usage.md')) as f:
        table = f.read().split('### From nanoGPT')[1].split('\n\n')[2]
    first = re.findall(r'^\| ([^|]*) \|', table, re.M)  # the nanoGPT column
    named = {flag for cell in first for flag in re.findall(r'`--(\w+)', cell)}
    assert named and named <= set(NANOGPT_HABITS), sorted(named - set(NANOGPT_HABITS))


def test_every_boolean_flag_accepts_the_bare_form():
    parser = train.get_parser()
    booleans = [a.dest for a in parser._actions if a.type in (data_flags.boolean, data_flags.auto_or_boolean)]
    assert {'resume', 'overwrite', 'compile', 'tie_weights', 'decay_lr'} <= set(booleans)
    for name in booleans:
        assert getattr(train.get_parser().parse([f'--{name}'])[0], name) is True, name
        assert getattr(train.get_parser().parse([f'--{name}=False'])[0], name) is False, name


def test_the_compile_flags_error_names_auto():
    with pytest.raises(SystemExit) as e:
        train.get_parser().parse(['--compile=maybe'])[0]
    assert 'expected auto or True/False' in str(e.value.code)


def test_no_help_ends_in_default_none_and_each_unset_default_is_explained(capsys):
    with pytest.raises(SystemExit):
        train.get_parser().parse(['--help'])[0]
    text = capsys.readouterr().out
    assert '(default: None)' not in text
    parser = train.get_parser()
    parser.set_defaults(**data_flags.CONFIGS['laptop'])
    for action in parser._actions:
        if action.default is None and action.option_strings and action.dest != 'help':
            assert re.search(r'unset|default', action.help), f"--{action.dest}'s help does not say what unset means"


def test_resume_in_the_wrong_folder_says_where_it_looked_and_how_to_point_it(small_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train.main(['--dataset', small_data, *TINY, '--max_iters=1', '--eval_interval=1', '--readout=raw'])
    with pytest.raises(SystemExit) as e:  # the raw run is in out/laptop-readout_raw; --resume alone looks in out/laptop
        train.main(['--dataset', small_data, *TINY, '--max_iters=2', '--resume'])
    message = str(e.value.code)
    assert 'looked in out/laptop' in message and '--out_dir' in message and 'out/laptop-readout_raw' in message


# ---- MFU on the GPUs people have

PEAKS = [  # (the name torch reports, dtype, dense peak TFLOP/s)
    ('NVIDIA H100 80GB HBM3', 'bfloat16', 989), ('NVIDIA H100 PCIe', 'bfloat16', 756),
    ('NVIDIA H100 NVL', 'bfloat16', 835), ('NVIDIA H200', 'bfloat16', 989),
    ('NVIDIA A100-SXM4-80GB', 'bfloat16', 312), ('NVIDIA A100-PCIE-40GB', 'float32', 156),
    ('NVIDIA A10G', 'bfloat16', 70), ('NVIDIA A10', 'bfloat16', 125),
    ('NVIDIA L40S', 'bfloat16', 362), ('NVIDIA L40', 'bfloat16', 181), ('NVIDIA L4', 'bfloat16', 121),
    ('Tesla T4', 'float16', 65), ('Tesla T4', 'float32', 8.1), ('Tesla T4', 'bfloat16', None),
    ('Tesla V100-SXM2-16GB', 'float16', 125), ('Tesla V100-PCIE-32GB', 'float16', 112),
    ('NVIDIA GeForce RTX 4090', 'bfloat16', 165), ('NVIDIA GeForce RTX 3090', 'float16', 71),
    ('Some Future GPU', 'bfloat16', None),
]


@pytest.mark.parametrize('name, dtype, tflops', PEAKS)
def test_mfu_knows_each_gpus_peak_in_the_dtype_in_use(monkeypatch, name, dtype, tflops):
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: name)
    peak = runtime.peak_flops('cuda', dtype)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))


def test_every_peak_table_entry_is_tested_and_a_cpu_has_none():
    assert {entry[0] for entry in runtime.PEAK_TFLOPS} <= {
        next(e[0] for e in runtime.PEAK_TFLOPS if e[0].lower() in name.lower()) for name, _, _ in PEAKS
        if any(e[0].lower() in name.lower() for e in runtime.PEAK_TFLOPS)}
    assert runtime.peak_flops('cpu', 'float32') is None
    assert runtime.fmt_mfu(1000, 1e6, None) == 'n/a'
