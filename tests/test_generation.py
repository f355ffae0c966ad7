"""Generation's engine (lab/engine.py: KVCache, next_logprobs, generate): at a fixed depth it samples exactly
the tokens of looped.py's plain LoopedGPT.generate, the cache gives the tokens and logits of recomputing, each
sequence exits at its own loop, a skipped loop's entries are its last run loop's, and no sequence reads
another's cache."""

import pytest
import torch
import torch.nn.functional as F

from lab import engine
from lab.engine import KVCache, generate, next_logits, next_logprobs
from lab.configs import variant_fields
from lab.designs import CHOICES, DesignConfig, DesignedGPT

BASE = dict(vocab_size=11, block_size=32, n_embd=32, n_head=2, n_layer=2, n_loop=3)
# every design generate supports, derived from the config so that a new field is tested with no
# entry here: each other value of a text field (sampled depth at its test depth), and each number
# field that is 0 by default (n_prelude, n_coda, bptt...) set to 1
DESIGNS = [{}, *({name: value} for name, values in CHOICES.items() for value in values[1:]),
           *({f.name: 1} for f in variant_fields() if f.default == 0)]


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return DesignedGPT(DesignConfig(**{**BASE, **kw})).eval()


def prompts(B=2, T=5, seed=1):
    return torch.randint(BASE['vocab_size'], (B, T), generator=torch.Generator().manual_seed(seed))


def recorded(model, monkeypatch, **kw):
    """generate's tokens and depths, and the log-probabilities of every step it took."""
    steps, step = [], engine.next_logprobs

    def spy(self, *a, **k):
        logp, depth = step(self, *a, **k)
        steps.append(logp)
        return logp, depth
    monkeypatch.setattr(engine, 'next_logprobs', spy)
    idx, depth = generate(model, **kw)
    monkeypatch.undo()
    return idx, depth, torch.stack(steps)


@pytest.mark.parametrize('design', DESIGNS, ids=lambda d: '-'.join(f'{k}={v}' for k, v in d.items()) or 'default')
def test_the_engines_cached_generation_samples_the_plain_generates_tokens(design):
    """Sampled (temperature 0.8, top_k 5), fixed depth, the same seed: the engine with its cache and looped.py's
    plain generate, which reruns the whole window for every token, give the same tokens, past the window's
    restarts (48 new tokens, block_size 32), at the trained depth and at twice it."""
    model = tiny(**design)
    for n_loop in (None, 2 * BASE['n_loop']):
        kw = dict(max_new_tokens=48, temperature=0.8, top_k=5, n_loop=n_loop)
        torch.manual_seed(7)
        plain = model.generate(prompts(), **kw)
        torch.manual_seed(7)
        cached, depth = generate(model, prompts(), cache=True, **kw)
        assert torch.equal(cached, plain), f"n_loop={n_loop}: first difference at token " \
            f"{(cached != plain).any(0).nonzero()[0].item()}"
        assert depth.tolist() == [[n_loop or BASE['n_loop']] * 48] * 2


@pytest.mark.parametrize('design', DESIGNS, ids=lambda d: '-'.join(f'{k}={v}' for k, v in d.items()) or 'default')
def test_cached_generation_gives_the_recomputed_tokens_and_logits(design, monkeypatch):
    """Greedy, fp32, no exit rule: 64 new tokens with the cache are recomputing's, step by step to 1e-4 in every
    log-probability, across the window's restarts (block_size 32: the window restarts every 16 tokens)."""
    model = tiny(**design)
    kw = dict(idx=prompts(), max_new_tokens=64, top_k=1)
    cached, depth, logp_cached = recorded(model, monkeypatch, cache=True, **kw)
    recomputed, _, logp_recomputed = recorded(model, monkeypatch, cache=False, **kw)
    assert torch.equal(cached, recomputed)
    assert (logp_cached - logp_recomputed).abs().max().item() < 1e-4
    assert depth.tolist() == [[BASE['n_loop']] * 64] * 2


def test_a_chunk_after_cached_positions_sees_exactly_its_past():
    """A prompt fed through the cache in two chunks (the second attends to the first's cached keys under a causal mask
    offset by their length) gives the last position's logits of one forward pass over all of it."""
    for attention in ('sdpa', 'manual'):
        model, x = tiny(attention=attention), prompts(T=12)
        cache = KVCache(BASE['block_size'])
        next_logprobs(model, x[:, :7], 3, cache=cache)
        logp, _ = next_logprobs(model, x, 3, cache=cache)               # positions 7..11 are new
        full = F.log_softmax(model(x)[0][:, -1], dim=-1)
        assert torch.allclose(logp, full, atol=1e-5), attention


def exit_loops(model, prompt, threshold):
    """Each row's exit loop under the confidence rule at its last position, from the full forward's readouts: (B,)."""
    with torch.no_grad():
        conf = torch.stack([F.softmax(next_logits(model, h, k), -1).max(-1).values
                            for k, h in model.loops(model.embed(prompt), BASE['n_loop'])], 1)  # (B, K)
    passes = conf >= threshold
    return torch.where(passes.any(1), passes.int().argmax(1) + 1, BASE['n_loop'])


def split_threshold(model, prompt):
    """A confidence threshold at which the rows of prompt exit at different loops (one at loop 1), and those loops."""
    with torch.no_grad():
        h = next(model.loops(model.embed(prompt), 1))[1]
        conf = F.softmax(next_logits(model, h, 1), -1).max(-1).values.sort().values  # loop 1, ascending
    t = (conf[-1] + conf[-2]).item() / 2                            # between the two most confident rows
    return t, exit_loops(model, prompt, t)


@pytest.mark.parametrize('cache', [True, False])
def test_each_sequence_of_a_batch_exits_at_its_own_loop(cache):
    """One confident row stops at loop 1 while the others loop on: the depths generate reports are the rows' own
    exits, not the batch's slowest, and each row's token is its own exit loop's (greedy)."""
    model, prompt = tiny(seed=3), prompts(B=6, T=6, seed=2)
    t, want = split_threshold(model, prompt)
    assert len(set(want.tolist())) > 1 and want.min() == 1
    out, depth = generate(model, prompt, 1, top_k=1, exit_rule='confidence', exit_threshold=t, cache=cache)
    assert depth[:, 0].tolist() == want.tolist()
    with torch.no_grad():
        states = dict(model.loops(model.embed(prompt), BASE['n_loop']))
        own = torch.cat([next_logits(model, states[d][b:b + 1], d) for b, d in enumerate(want.tolist())])  # (B, V)
    assert out[:, -1].tolist() == own.argmax(-1).tolist()
    logp, _ = next_logprobs(model, prompt, BASE['n_loop'], 'confidence', t,
                            KVCache(BASE['block_size']) if cache else None)
    assert torch.allclose(logp, F.log_softmax(own, -1), atol=1e-5)  # each row's distribution is its own loop's


def test_a_skipped_loops_cache_entries_are_its_last_run_loops():
    """After a decoded token that exited at loop d, every entry (shared layers and coda) of the loops after d holds
    loop d's keys and values at that position, and the loops up to d hold their own (really computed) ones."""
    model, window = tiny(seed=3, n_coda=1), prompts(B=6, T=7, seed=2)
    cache = KVCache(BASE['block_size'])
    next_logprobs(model, window[:, :-1], BASE['n_loop'], cache=cache)    # the prefill runs every loop
    t, want = split_threshold(model, window)
    _, depth = next_logprobs(model, window, BASE['n_loop'], 'confidence', t, cache)  # the decoded token, position 6
    assert depth.tolist() == want.tolist() and len(set(want.tolist())) > 1
    pos, K = cache.length - 1, BASE['n_loop']                       # the decoded token's position
    for b, d in enumerate(depth.tolist()):
        for kind, i in [('loop', 0), ('loop', 1), ('coda', 0)]:
            at = lambda k: torch.cat(cache.kv[kind, k, i])[:, :, pos][[b, b + window.size(0)]]  # keys, values of row b
            for j in range(d + 1, K + 1):
                assert torch.equal(at(j), at(d)), (b, d, kind, i, j)
            for j in range(2, d + 1):
                assert not torch.equal(at(j), at(j - 1)), (b, d, kind, i, j)


@pytest.mark.parametrize('cache', [True, False])
@pytest.mark.parametrize('rule, threshold', [(None, None), ('kl', 0.005)])
def test_no_sequence_reads_another_sequences_cache(rule, threshold, cache):
    """Three prompts generated together give each prompt's tokens and depths generated alone, with and without an
    exit rule (so with shared entries too)."""
    model, batch = tiny(seed=4, n_coda=1), prompts(B=3, T=6, seed=5)
    kw = dict(max_new_tokens=40, top_k=1, exit_rule=rule, exit_threshold=threshold, cache=cache)
    together, depth = generate(model, batch, **kw)
    for b in range(batch.size(0)):
        alone, depth_alone = generate(model, batch[b:b + 1], **kw)
        assert torch.equal(together[b:b + 1], alone) and torch.equal(depth[b:b + 1], depth_alone), b
    if rule is not None:
        assert len(set(depth.flatten().tolist())) > 1  # the rule did exit early somewhere, so sharing was exercised


def test_a_prefill_runs_every_loop_whatever_the_exit_rule():
    """The prompt's positions get every loop's keys and values even where its last position exits at loop 1: the
    cache after a prefill under an exit rule that always passes holds what a prefill without one holds."""
    model, prompt = tiny(n_coda=1), prompts(T=9)
    full, early = KVCache(BASE['block_size']), KVCache(BASE['block_size'])
    next_logprobs(model, prompt, BASE['n_loop'], cache=full)
    _, depth = next_logprobs(model, prompt, BASE['n_loop'], 'confidence', 0.0, early)
    assert depth.tolist() == [1, 1] and early.length == full.length == 9
    for key, (keys, values) in full.kv.items():
        assert torch.equal(early.kv[key][0][:, :, :9], keys[:, :, :9]), key
        assert torch.equal(early.kv[key][1][:, :, :9], values[:, :, :9]), key


def test_the_plain_generate_reads_only_its_window_of_a_prompt_longer_than_block_size(monkeypatch):
    """A prompt longer than block_size: the first token comes from its last block_size tokens; once that window
    is over full, the next restarts from its newest half (the rule the engine's cache keeps)."""
    model, block = tiny(), BASE['block_size']
    prompt, windows, forward = prompts(B=2, T=block + 3), [], model.forward
    monkeypatch.setattr(model, 'forward', lambda idx, *a, **k: windows.append(idx) or forward(idx, *a, **k))
    out = model.generate(prompt, 2, top_k=1)
    assert torch.equal(out[:, :-2], prompt) and len(windows) == 2
    assert torch.equal(windows[0], prompt[:, -block:])
    assert torch.equal(windows[1], out[:, -(block // 2) - 1:-1])


@pytest.mark.parametrize('rule, threshold', [(None, None), ('confidence', 0.9999), ('kl', 0.005), ('latent', 0.3)])
def test_sample_pys_own_generate_gives_the_engines_recomputed_tokens_and_depths(rule, threshold):
    """sample.py generates with looped.py alone: on looped.py's LoopedGPT, sampled past the window's restarts, its
    recomputing generate gives the tokens and exit loops of the engine's recomputing one for every rule, and at a
    fixed depth the tokens of LoopedGPT.generate."""
    import sample
    from looped import LoopedConfig, LoopedGPT
    torch.manual_seed(0)
    model = LoopedGPT(LoopedConfig(**BASE)).eval()
    kw = dict(max_new_tokens=48, temperature=0.8, top_k=5, exit_rule=rule, exit_threshold=threshold)
    torch.manual_seed(7)
    ours, depth = sample.generate(model, prompts(B=3), **kw)
    torch.manual_seed(7)
    theirs, their_depth = generate(model, prompts(B=3), cache=False, **kw)
    assert torch.equal(ours, theirs) and torch.equal(depth, their_depth)
    if rule is None:
        torch.manual_seed(7)
        assert torch.equal(ours, model.generate(prompts(B=3), 48, temperature=0.8, top_k=5))
        assert depth.unique().tolist() == [BASE['n_loop']]
    else:
        assert len(set(depth.flatten().tolist())) > 1, 'the rule never exited early: pick another threshold'


def test_the_engines_cache_on_looped_pys_plain_model(monkeypatch):
    """A run of `python train.py` loads as looped.py's LoopedGPT, which has no prelude, coda or gate: the
    engine's cached generation gives LoopedGPT.generate's tokens at a fixed depth and recomputing's log-
    probabilities (past the window's restarts), runs every training-free rule, and refuses the gate in one line."""
    from looped import LoopedConfig, LoopedGPT
    torch.manual_seed(0)
    model = LoopedGPT(LoopedConfig(**BASE)).eval()
    torch.manual_seed(7)
    plain = model.generate(prompts(), 40, temperature=0.8, top_k=5)
    torch.manual_seed(7)
    assert torch.equal(generate(model, prompts(), 40, temperature=0.8, top_k=5, cache=True)[0], plain)
    kw = dict(model=model, idx=prompts(), max_new_tokens=40, top_k=1)
    cached, _, logp_cached = recorded(monkeypatch=monkeypatch, cache=True, **kw)
    recomputed, _, logp_recomputed = recorded(monkeypatch=monkeypatch, cache=False, **kw)
    assert torch.equal(cached, recomputed) and (logp_cached - logp_recomputed).abs().max().item() < 1e-4
    for rule, threshold in (('confidence', 0.5), ('kl', 0.005), ('latent', 0.3)):
        _, depth = generate(model, prompts(), 40, top_k=1, exit_rule=rule, exit_threshold=threshold)
        assert depth.shape == (2, 40) and bool(((depth >= 1) & (depth <= BASE['n_loop'])).all()), rule
    with pytest.raises(ValueError, match='no exit gate') as e:
        generate(model, prompts(), 2, exit_rule='gate', exit_threshold=0.5)
    assert '\n' not in str(e.value)
