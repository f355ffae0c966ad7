"""Helpers the graders share: tiny models, batches, short training runs on the real text, and comparisons that
fail with a sentence instead of a dump of tensors. Every assert in the graders carries its own message, and each
grader's docstring holds pytest's PYTEST_DONT_REWRITE marker, which switches off the assertion introspection that
would print whole tensors next to it."""

import json
import os

import pytest
import torch

from looped import LoopedConfig, LoopedGPT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    """Every grader imports this fixture, so torch runs on one thread inside each grader module. On a shared machine
    torch's default (one thread per core) makes the threads of several jobs fight over the same cores: the seven
    graders took 67 s that way against 8.5 s pinned. One thread also makes a grader's timing and its floating-point
    sums the same on every machine. The previous count is restored after the module, so other tests run in the
    same pytest process keep torch's default. Module-scoped and autouse, so it is in place before any other
    module-scoped fixture (A5's training runs). It is imported rather than put in a conftest.py here, because two
    conftest.py files clash when the repository's own suite and the graders run in one pytest command."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TINY = dict(vocab_size=11, block_size=16, n_embd=32, n_head=4, n_layer=2, n_loop=3)


def tiny(seed=0, **kw):
    """A 2-layer, d=32 looped model with K=3 (looped.py's, the paper's), seeded so that two calls give the same
    weights."""
    torch.manual_seed(seed)
    return LoopedGPT(LoopedConfig(**{**TINY, **kw}))


def designed(seed=0, **kw):
    """tiny with the field's designs (lab/designs.py's DesignedGPT, whose fields kw may set): A8's model."""
    from lab.designs import DesignConfig, DesignedGPT
    torch.manual_seed(seed)
    return DesignedGPT(DesignConfig(**{**TINY, **kw}))


def batch(B=2, T=16, V=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(V, (B, T), generator=g), torch.randint(V, (B, T), generator=g)


def max_error(got, expected):
    """(largest absolute difference, largest relative difference) between two tensors, as floats, in float64."""
    got, expected = got.detach().double(), expected.detach().double()
    diff = (got - expected).abs()
    return diff.max().item(), (diff / expected.abs().clamp_min(1e-300)).max().item()


def distinct(a, b):
    """a and b as strings with just enough significant digits (4 to 17) to tell them apart, so that a failure
    never reads "got -1.25591 where -1.25591 is expected"."""
    for digits in range(4, 18):
        sa, sb = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if sa != sb:
            return sa, sb
    return repr(a), repr(b)


def not_a_tensor(value):
    """A few words on a value that should have been a tensor: what it is, and for None the usual cause."""
    if value is None:
        return "None (the function returned nothing: a case with no return statement, e.g. an if/elif chain that " \
               "leaves a case out)"
    if isinstance(value, (tuple, list)):  # e.g. (output, something else): name the parts, never print tensors
        parts = ', '.join(type(v).__name__ for v in value[:4]) + (', ...' if len(value) > 4 else '')
        return f"a {type(value).__name__} of {len(value)} ({parts}), not a tensor"
    text = repr(value)
    return f"a {type(value).__name__} ({text if len(text) <= 60 else text[:57] + '...'}), not a tensor"


def check_close(got, expected, what, rtol=1e-5, atol=1e-6, hint=''):
    """Fail with one readable sentence (the largest error, never the tensors) unless got matches expected
    elementwise within atol + rtol * |expected|; shapes and dtypes are checked first. got that is not a tensor (None
    from a function that ends without a return for some case, a float from .item(), a tuple) fails with a sentence
    that names what it is, not with an AttributeError here."""
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: got {not_a_tensor(got)}, where a tensor of shape {tuple(expected.shape)} is "
                             f"expected. {hint}".rstrip())
    assert tuple(got.shape) == tuple(expected.shape), \
        f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}. {hint}".rstrip()
    if not torch.isfinite(got).all():
        bad = (~torch.isfinite(got)).sum().item()
        raise AssertionError(f"{what}: {bad} of {got.numel()} values are nan or inf. {hint}".rstrip())
    diff = (got.detach().double() - expected.detach().double()).abs()
    limit = atol + rtol * expected.detach().double().abs()
    if not (diff <= limit).all():
        i = (diff - limit).argmax()
        a, r = max_error(got, expected)
        g, e = distinct(got.detach().flatten()[i].item(), expected.detach().flatten()[i].item())
        raise AssertionError(
            f"{what}: off by up to {a:.3g} (relative {r:.3g}); allowed atol={atol:g} + rtol={rtol:g}; e.g. got "
            f"{g} where {e} is expected. {hint}".rstrip())


def penalty_of(model, states):
    """model.penalty_loss(states), checked first for the two mistakes that would otherwise surface as torch's own
    error in a later line (an AttributeError at .item(), or "element 0 of tensors does not require grad" at
    .backward()): it must return a tensor, also at lambda = 0, and at lambda > 0 that tensor must carry the
    gradient of the states that require one."""
    got = model.penalty_loss(states)
    lam = model.config.norm_penalty
    if not isinstance(got, torch.Tensor):
        if lam == 0:
            raise AssertionError(f"penalty_loss returned a {type(got).__name__} at lambda = 0: return a tensor, "
                                 f"also at lambda = 0 (torch.zeros(()), or lambda times the mean as for any "
                                 f"other lambda)")
        raise AssertionError(f"penalty_loss returned a {type(got).__name__}, not a tensor: the penalty must stay "
                             f"in the autograd graph: do not .detach() or .item() it")
    if lam != 0 and any(h.requires_grad for h in states) and not got.requires_grad:
        raise AssertionError("penalty_loss returned a tensor with no gradient to the states: the penalty must "
                             "stay in the autograd graph: do not .detach() or .item() it (nor the states)")
    return got


def corpus_text():
    """The real tiny Shakespeare text, data/shakespeare_char/input.txt, which ships with the repository. A grader
    that needs it fails (never skips) without it, so nothing passes unseen."""
    from data.shakespeare_char import prepare
    try:
        return prepare.get_text()
    except prepare.PrepareError as e:
        pytest.fail(f"this grader trains on the real tiny Shakespeare text: {e}")


# 40 steps of a 1-layer, d=64, K=4 model on tiny Shakespeare: about 2 s each on 2 CPU cores
SHORT_RUN = ['--n_layer=1', '--n_embd=64', '--n_head=2', '--n_loop=4', '--block_size=64', '--batch_size=8',
             '--learning_rate=3e-3', '--max_iters=40', '--eval_interval=40', '--eval_iters=2', '--log_interval=40']


def short_run(tmp_path_factory, *flags):
    """||h_k|| for k = 1..K (validation, after 40 steps) of a train.py run with these flags."""
    import train
    from data.shakespeare_char import prepare
    data = tmp_path_factory.getbasetemp() / 'grading_corpus'
    if not (data / 'train.bin').exists():
        prepare.prepare(corpus_text(), str(data))
    out = tmp_path_factory.mktemp('run')
    train.main(['--dataset', str(data), '--out_dir', str(out), *SHORT_RUN, *flags])
    with open(out / 'log.jsonl') as f:
        record = [json.loads(line) for line in f][-1]
    return record['hidden_norm'][:4]


def generated_both_ways(model, prompt, n_new, n_loop, seed=7):
    """n_new tokens after prompt, drawn twice with the same seed: by model.generate (looped.py:
    every token from the whole window rerun) and by lab.engine.generate with its KV cache (a new
    token runs over its own position; the earlier ones are cached). Returns (plain tokens, cached
    tokens, the depths the engine reports, and per step the largest difference between the two
    log-probability vectors the tokens were drawn from)."""
    import torch.nn.functional as F
    from lab import engine
    plain_logp, cached_logp = [], []

    def forward(*args, **kw):  # model.generate calls the model once per token
        logits, loss, stats = type(model).forward(model, *args, **kw)
        plain_logp.append(F.log_softmax(logits[:, -1, :].float(), dim=-1))
        return logits, loss, stats
    model.forward = forward
    try:
        torch.manual_seed(seed)
        plain = model.generate(prompt, n_new, n_loop=n_loop)
    finally:
        del model.forward
    step = engine.next_logprobs

    def next_logprobs(*args, **kw):  # the engine draws each token from what this returns
        logp, depth = step(*args, **kw)
        cached_logp.append(logp)
        return logp, depth
    engine.next_logprobs = next_logprobs
    try:
        torch.manual_seed(seed)
        cached, depth = engine.generate(model, prompt, n_new, n_loop=n_loop, cache=True)
    finally:
        engine.next_logprobs = step
    diffs = [(a - b).abs().max().item() for a, b in zip(plain_logp, cached_logp)]
    return plain, cached, depth, diffs
