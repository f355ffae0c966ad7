"""A7 grader: exit_passes (lab/engine.py), diagnose.exit_depths and diagnose.calibrate_exit on cases
with known answers, and exit_passes inside generation (lab.engine.generate, with its KV cache and
without). PYTEST_DONT_REWRITE"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lab import engine
from lab.diagnose import calibrate_exit, exit_depths
from lab.engine import exit_passes
from grading import distinct, tiny, one_thread  # noqa: F401 (one_thread: autouse)
from looped import sample

LEVELS = np.linspace(0, 1, 201)  # the handout's candidate levels: 0, 0.005, ..., 1


def logp(*probs):
    return torch.log(torch.tensor(probs, dtype=torch.float64))


def test_confidence_rule_reads_the_top_probability():
    lp = torch.stack([logp(0.9, 0.05, 0.05), logp(0.5, 0.3, 0.2), logp(1 / 3, 1 / 3, 1 / 3), logp(0.05, 0.05, 0.9)])
    for t, want in ((0.5, [True, True, False, True]), (0.9, [True, False, False, True])):
        got = exit_passes('confidence', t, lp, None).tolist()
        assert got == want, (
            f"confidence rule at threshold {t} on top probabilities 0.9, 0.5, 1/3 and 0.9 (the last at another "
            f"position): got {got}, expected {want}. It passes when the largest probability is >= the threshold.")


def test_kl_rule_compares_with_the_previous_loop_in_the_right_direction():
    """KL(p_k || p_{k-1}), never at loop 1. For p = (0.9, 0.1), q = (0.6, 0.4): KL(p || q) = 0.2263 but
    KL(q || p) = 0.3112, so a threshold of 0.25 tells the two directions apart."""
    p, q = logp(0.9, 0.1)[None], logp(0.6, 0.4)[None]
    got = exit_passes('kl', 1e9, p, None).tolist()
    assert got == [False], f"KL rule at loop 1 (logp_prev is None) gave {got}: it never passes there, whatever the " \
        "threshold (there is nothing to compare with)"
    for this, prev, want, case in ((p, q, [True], 'KL(p || q) = 0.226'), (q, p, [False], 'KL(q || p) = 0.311'),
                                   (p, p, [True], 'KL(p || p) = 0')):
        t = 0.0 if this is prev else 0.25
        got = exit_passes('kl', t, this, prev).tolist()
        assert got == want, (
            f"KL rule, threshold {t}, {case} (this loop first, previous loop second): got {got}, expected {want}. "
            f"The rule is KL(p_k || p_{{k-1}}) = sum p_k (log p_k - log p_{{k-1}}) <= threshold; check the direction.")


def test_exit_depths_on_known_signals():
    pmax = np.array([[0.9, 0.9, 0.9], [0.2, 0.7, 0.9], [0.1, 0.2, 0.3]])
    kl = np.array([[math.inf, 0.5, 0.01], [math.inf, 0.01, 0.0], [math.inf, 2.0, 1.0]])
    for rule, t, K, want in (('confidence', 0.6, 3, [1, 2, 3]), ('kl', 0.1, 3, [3, 2, 3]),
                             ('confidence', 0.6, 2, [1, 2, 2])):
        got = [int(d) for d in exit_depths(rule, t, pmax, kl, K)]
        assert got == want, (
            f"exit_depths('{rule}', {t}, K={K}) on the hand-made signals gave {got}, expected {want}: depths count "
            f"from 1, the first passing loop wins, a token that never passes exits at K (the last loop always "
            f"answers), and only the first K columns count.")


def test_a_threshold_equal_to_a_signal_value_exits():
    """The handout's tie rule: a token passes at a loop whose signal equals the threshold (top probability >= t,
    KL <= t), in exit_depths as in exit_passes."""
    pmax = np.array([[0.25, 0.5, 0.75], [0.5, 0.75, 0.75]])
    kl = np.array([[math.inf, 0.125, 0.0625], [math.inf, 0.25, 0.125]])
    for rule, t, want in (('confidence', 0.5, [2, 1]), ('confidence', 0.75, [3, 2]), ('kl', 0.125, [2, 3]),
                          ('kl', 0.25, [2, 2])):
        got = [int(d) for d in exit_depths(rule, t, pmax, kl, 3)]
        assert got == want, (
            f"exit_depths('{rule}', {t}) where some signals equal the threshold exactly: got depths {got}, expected "
            f"{want}. A signal equal to the threshold passes: top probability >= t, KL <= t.")


def test_the_latent_rule_on_hand_made_states():
    """The latent rule: ||h_k - h_{k-1}|| / ||h_{k-1}|| <= threshold per token, a tie passes, no h_prev no exit;
    in exit_depths on its own column, which is finite at loop 1."""
    h_prev = torch.tensor([[3.0, 4.0], [1.0, 0.0]])                 # norms 5 and 1
    h = h_prev + torch.tensor([[0.5, 0.0], [0.0, 0.25]])            # relative changes 0.1 and 0.25
    lp = torch.zeros(2, 4).log_softmax(-1)
    for t, want in ((0.1, [True, False]), (0.25, [True, True]), (0.05, [False, False])):
        got = exit_passes('latent', t, lp, None, h, h_prev).tolist()
        assert got == want, (
            f"latent rule, threshold {t}: got {got}, expected {want}. The rule is ||h_k - h_(k-1)|| / ||h_(k-1)|| "
            f"<= threshold, per token (over the last dimension); a change equal to the threshold passes.")
    got = exit_passes('latent', 1e9, lp, None, h, None).tolist()
    assert got == [False, False], f"latent rule with h_prev=None (nothing to compare with): got {got}, expected no exit"
    pmax, kl = np.full((3, 3), 0.1), np.full((3, 3), math.inf)
    latent = np.array([[0.05, 0.5, 0.5], [0.5, 0.05, 0.01], [0.5, 0.5, 0.5]])
    got = [int(d) for d in exit_depths('latent', 0.05, pmax, kl, 3, latent)]
    assert got == [1, 2, 3], (f"exit_depths('latent', 0.05) on a hand-made latent column gave {got}, "
                              f"expected [1, 2, 3]: the latent rule reads its own column (the latent argument), "
                              f"and can pass at loop 1.")


def test_the_latent_rule_divides_by_the_previous_states_norm():
    """The change is measured against the state it left, ||h_k - h_(k-1)|| / ||h_(k-1)||, not against the new state
    ||h_k|| (nor their mean). A state that doubles changes by 1 relative to where it was, 0.5 relative to where it
    went; one that halves, by 0.5 and 1: at a threshold of 0.5 the two denominators give opposite answers."""
    h_prev = torch.tensor([[1.0, 0.0], [2.0, 0.0]])
    h = torch.tensor([[2.0, 0.0], [1.0, 0.0]])                      # doubled, halved: change 1 in both
    lp = torch.zeros(2, 4).log_softmax(-1)
    got = exit_passes('latent', 0.5, lp, None, h, h_prev).tolist()
    assert got == [False, True], (
        f"latent rule, threshold 0.5, a state that doubles (1 -> 2) and one that halves (2 -> 1): got {got}, expected "
        f"[False, True]. Divide the change by the previous state's norm ||h_(k-1)|| (relative changes 1 and 0.5)"
        + (", not by the new state's ||h_k||." if got == [True, False] else "."))


def test_the_kl_rule_is_the_p_k_weighted_sum_over_the_vocabulary():
    """KL(p || q) = sum_v p_v (log p_v - log q_v): each log-ratio weighted by p_k's own probability, summed (not
    averaged) over the vocabulary. For p = (0.5, 0.5), q = (0.9, 0.1): KL = 0.511, while the unweighted sum of
    log-ratios is 1.022 and the mean over the two entries 0.255, so thresholds 0.4 and 0.75 tell all three apart."""
    p, q = logp(0.5, 0.5)[None], logp(0.9, 0.1)[None]
    for t, want in ((0.4, [False]), (0.75, [True])):
        got = exit_passes('kl', t, p, q).tolist()
        assert got == want, (
            f"KL rule, threshold {t}, p_k = (0.5, 0.5) after p_(k-1) = (0.9, 0.1), KL = 0.511: got {got}, expected "
            f"{want}. The rule is sum_v p_k,v (log p_k,v - log p_(k-1),v) <= threshold: weight each log-ratio by "
            f"p_k and sum it over the vocabulary.")


def synthetic(n=200, K=3, seed=0):
    """Half the tokens are easy: confident (p = 0.95) and already right at loop 1. The other half are hard: unsure
    (p = 0.3) until the last loop and much worse early. Calibration must exit the easy half at loop 1 and keep the
    hard half to K: mean loops (1 + K) / 2 for the confidence rule, perplexity exactly depth K's. The mean
    cross-entropy at depth K is about 3.5 nats (perplexity about 33), as for a small character model: a tolerance
    of 1% on cross-entropy would then allow a 3.5% rise in perplexity, so applying it to the wrong one shows."""
    rng = np.random.default_rng(seed)
    easy = np.arange(n) < n // 2
    ce = np.empty((n, K))
    ce[:, K - 1] = rng.uniform(3.0, 4.0, n)
    for k in range(K - 1):
        ce[:, k] = np.where(easy, ce[:, K - 1], ce[:, K - 1] + 3.0)
    pmax = np.where(easy[:, None], 0.95, 0.3) * np.ones((n, K))
    pmax[:, K - 1] = 0.6
    kl = np.where(easy[:, None], 1e-4, 1.0) * np.ones((n, K))
    kl[:, 0] = math.inf
    return ce, pmax, kl, easy


def test_calibration_finds_the_known_operating_point():
    ce, pmax, kl, easy = synthetic()
    full = math.exp(ce[:, 2].mean())
    t, loops, ppl = calibrate_exit('confidence', ce, pmax, kl, 3)
    assert loops == pytest.approx(2.0), \
        f"confidence rule: calibration chose mean loops {loops:.4g}; the known answer is (1 + K) / 2 = 2 (the easy " \
        f"half exits at loop 1 for free, the hard half needs K). Pick, among thresholds within the tolerance, the " \
        f"one with the fewest mean loops."
    assert ppl == pytest.approx(full), \
        "confidence rule: calibrate_exit reported perplexity {}, but exiting there costs nothing: it is depth K's, " \
        "exp(mean CE) = {} (the exponential of the mean cross-entropy of the exit loops)".format(*distinct(ppl, full))
    depths = exit_depths('confidence', t, pmax, kl, 3)
    assert (depths == np.where(easy, 1, 3)).all(), \
        f"the calibrated confidence threshold {t:.4g} does not exit the easy tokens at 1 and the hard at 3"
    # the KL rule can only exit from loop 2 on: the easy half at 2, the hard half at 3
    t, loops, ppl = calibrate_exit('kl', ce, pmax, kl, 3)
    assert loops == pytest.approx(2.5), \
        f"KL rule: calibration chose mean loops {loops:.4g}; the known answer is 2.5 (the KL rule cannot exit at " \
        f"loop 1, so the easy half exits at 2 and the hard half at 3): search thresholds over the KL of loops 2..K"
    assert ppl == pytest.approx(full), "KL rule: reported perplexity {}, expected depth K's {}".format(
        *distinct(ppl, full))


@pytest.mark.parametrize('cost, tolerance, allowed', [
    (0.05, 0.01, False), (0.05, 0.10, True), (0.02, 0.01, False), (0.02, 0.03, True), (0.005, 0.01, True)])
def test_calibration_respects_the_tolerance(cost, tolerance, allowed):
    """If exiting the easy tokens at loop 1 raises perplexity by `cost`, a tolerance below it forbids the exit and
    one above allows it. The tolerance is on perplexity (exp of the mean cross-entropy), not on cross-entropy:
    at 3.5 nats, 1% on cross-entropy would allow a 3.5% perplexity rise, and a 2% cost would slip through."""
    ce, pmax, kl, easy = synthetic()
    ce[easy, 0] += math.log(1 + cost) * 2  # easy tokens now lose at loop 1 (the mean over all tokens rises by cost)
    full = math.exp(ce[:, 2].mean())
    t, loops, ppl = calibrate_exit('confidence', ce, pmax, kl, 3, tolerance=tolerance)
    want = 2.0 if allowed else 3.0
    assert loops == pytest.approx(want), (
        f"an exit at loop 1 that costs {cost:.1%} perplexity, tolerance {tolerance:.1%}: calibration chose mean "
        f"loops {loops:.4g}, expected {want:g} ({'allowed' if allowed else 'forbidden'}). Accept a threshold when "
        f"its perplexity exp(mean CE) <= (1 + tolerance) * depth K's perplexity; the tolerance is on perplexity, "
        f"not on cross-entropy.")
    assert ppl <= (1 + tolerance) * full * (1 + 1e-9), \
        "calibrate_exit reported perplexity {}, above the tolerance's {}: the perplexity it returns must be the " \
        "chosen threshold's own".format(*distinct(ppl, (1 + tolerance) * full))


def candidates(signal, threshold_above=None, at_least=None):
    """The handout's candidate thresholds for a signal (the distinct values of numpy's quantiles at the 201 levels
    0, 0.005, ..., 1), and the smallest of them above (or at least) a value."""
    with np.errstate(invalid='ignore'):  # a signal with inf in it (a wrong pool) gives inf - inf = nan here
        c = np.unique(np.quantile(signal, LEVELS))
    return c[c > threshold_above].min() if threshold_above is not None else c[c >= at_least].min()


def confidence_case():
    """99 easy tokens, right at loop 1 with top probability in [0.6, 0.9], and one hard token whose early exit
    costs 50 nats, top probability 0.55 at loop 1 and 0.5 at loop 2. Every threshold in (0.55, 0.6] gives the
    fewest mean loops, 1.02; the answer is the smallest candidate above 0.55. It is a quantile between two
    signal values, and which one depends on every part of the rule: the loops pooled (1..K, here with a fifth
    column beyond K that must not count), the 201 levels, and the smallest threshold winning a tie."""
    rng = np.random.default_rng(7)
    n, K = 100, 3
    pmax = np.stack([rng.uniform(0.6, 0.9, n), rng.uniform(0.3, 0.99, n), rng.uniform(0.3, 0.99, n),
                     rng.uniform(0.56, 0.6, n)], axis=1)
    pmax[0, :3] = 0.55, 0.5, 0.97
    ce = np.repeat(rng.uniform(3.0, 4.0, n)[:, None], K + 1, axis=1)
    ce[0, :2] += 50.0
    kl = np.ones((n, K + 1))
    kl[:, 0] = math.inf
    return ce, pmax, kl, K


def kl_case():
    """One token is free to exit at loop 2 (KL 0.001 there); every other token's exit before K costs 50 nats and
    their KL at loop 2 is 0.5 or more. Every threshold in [0.001, 0.5) gives the fewest mean loops, 2.99; the
    answer is the smallest candidate at or above 0.001. Half the tokens have a KL below 0.001 at loop K (which
    never decides an exit, the last loop always answers, but is part of the pool 2..K), so 0.001 is not itself
    a candidate and the answer is a quantile between two signal values: the pool (loops 2..K; loop 1 is inf;
    the column beyond K must not count), the 201 levels and the tie rule each change it."""
    rng = np.random.default_rng(8)
    n, K = 100, 3
    low = np.arange(n) < n // 2
    kl = np.stack([np.full(n, math.inf), rng.uniform(0.5, 1.0, n),
                   np.where(low, rng.uniform(1e-5, 1e-4, n), rng.uniform(0.01, 0.4, n)), rng.uniform(0, 1e-3, n)],
                  axis=1)
    kl[0, 1] = 0.001
    ce = np.repeat(rng.uniform(3.0, 4.0, n)[:, None], K + 1, axis=1)
    ce[1:, :2] += 50.0
    pmax = np.full((n, K + 1), 0.5)
    return ce, pmax, kl, K


def first_above(values, b, inclusive=False):
    """The smallest of values above b (or at least b)."""
    values = np.unique(values)
    return values[values >= b].min() if inclusive else values[values > b].min()


def which_mistake(got, variants):
    """The name of the variant whose threshold got equals, for a failure message that says what to fix."""
    names = [name for name, value in variants.items() if value == pytest.approx(got, rel=1e-12, abs=1e-15)]
    return f" Your threshold is the one {names[0]} gives." if names else ""


def test_confidence_candidates_are_the_201_quantiles_of_loops_1_to_K_and_the_smallest_wins_a_tie():
    ce, pmax, kl, K = confidence_case()
    t, loops, ppl = calibrate_exit('confidence', ce, pmax, kl, K)
    assert loops == pytest.approx(1.02), \
        "confidence rule, 99 free exits at loop 1 and one costly one: mean loops {}, expected {}".format(
            *distinct(loops, 1.02))
    want = candidates(pmax[:, :K], threshold_above=0.55)
    every = np.unique(np.quantile(pmax[:, :K], LEVELS))
    variants = {'loops 1..K-1 only (leaving out loop K)': candidates(pmax[:, :K - 1], threshold_above=0.55),
                'every column of pmax (not only the first K)': candidates(pmax, threshold_above=0.55),
                '101 levels instead of 201': first_above(np.quantile(pmax[:, :K], np.linspace(0, 1, 101)), 0.55),
                'every distinct signal value instead of quantiles': first_above(pmax[:, :K], 0.55),
                'the largest threshold winning a tie': every[(every > 0.55) & (every <= pmax[1:, 0].min())].max()}
    assert all(v != pytest.approx(want, rel=1e-9) for v in variants.values()), \
        "the grader's own case no longer tells every mistake apart (a fault of the grader, not of your code)"
    assert t == pytest.approx(want, rel=1e-12), (
        "confidence rule: calibrate_exit returned the threshold {}, expected {}: the smallest candidate that "
        "reaches the fewest mean loops within the tolerance. The candidates are the distinct values of "
        "np.quantile(top probabilities of loops 1..K of every token, np.linspace(0, 1, 201)).".format(
            *distinct(t, want)) + which_mistake(t, variants))
    full = math.exp(ce[:, K - 1].mean())
    assert ppl == pytest.approx(full, rel=1e-9), \
        "confidence rule: the reported perplexity is {}, expected {} (the free exits cost nothing)".format(
            *distinct(ppl, full))


def test_kl_candidates_are_the_201_quantiles_of_loops_2_to_K_and_the_smallest_wins_a_tie():
    ce, pmax, kl, K = kl_case()
    t, loops, ppl = calibrate_exit('kl', ce, pmax, kl, K)
    assert loops == pytest.approx(2.99), \
        "KL rule, one free exit at loop 2 and 99 costly ones: mean loops {}, expected {}".format(
            *distinct(loops, 2.99))
    want = candidates(kl[:, 1:K], at_least=0.001)
    every = np.unique(np.quantile(kl[:, 1:K], LEVELS))
    variants = {'loops 2..K-1 only (leaving out loop K)': candidates(kl[:, 1:K - 1], at_least=0.001),
                'loops 1..K (with loop 1, whose KL is inf)': candidates(kl[:, :K], at_least=0.001),
                'every column of kl (not only the first K)': candidates(kl[:, 1:], at_least=0.001),
                '101 levels instead of 201': first_above(np.quantile(kl[:, 1:K], np.linspace(0, 1, 101)), 0.001,
                                                         inclusive=True),
                'every distinct signal value instead of quantiles': 0.001,
                'the largest threshold winning a tie': every[every < 0.5].max()}
    assert all(v != pytest.approx(want, rel=1e-9) for v in variants.values()), \
        "the grader's own case no longer tells every mistake apart (a fault of the grader, not of your code)"
    assert t == pytest.approx(want, rel=1e-12), (
        "KL rule: calibrate_exit returned the threshold {}, expected {}: the smallest candidate that reaches the "
        "fewest mean loops within the tolerance. The candidates are the distinct values of np.quantile(KL of "
        "loops 2..K of every token, np.linspace(0, 1, 201)); loop 1's KL is inf and is not among them.".format(
            *distinct(t, want)) + which_mistake(t, variants))
    full = math.exp(ce[:, K - 1].mean())
    assert ppl == pytest.approx(full, rel=1e-9), \
        "KL rule: the reported perplexity is {}, expected {} (the one free exit costs nothing)".format(
            *distinct(ppl, full))


def latent_case():
    """99 easy tokens, right at loop 1 with a relative change there in [0.01, 0.05]; one hard token whose early exit
    costs 50 nats, change 0.06 at loop 1 and 0.5 at loop 2. Every threshold in [the easy tokens' largest change,
    0.06) gives the fewest mean loops, 1.02: the answer is the smallest candidate at or above that change. The
    latent column is finite from loop 1 on (h_1 is compared with h_0), so the pool is loops 1..K, unlike the KL
    rule's 2..K; a fifth column beyond K must not count."""
    rng = np.random.default_rng(10)
    n, K = 100, 3
    latent = np.stack([rng.uniform(0.01, 0.05, n), rng.uniform(0.2, 0.9, n), rng.uniform(0.001, 0.3, n),
                       rng.uniform(0, 1e-3, n)], axis=1)
    latent[0, :3] = 0.06, 0.5, 0.001
    ce = np.repeat(rng.uniform(3.0, 4.0, n)[:, None], K + 1, axis=1)
    ce[0, :2] += 50.0
    pmax, kl = np.full((n, K + 1), 0.5), np.ones((n, K + 1))
    kl[:, 0] = math.inf
    return ce, pmax, kl, latent, K


def test_latent_candidates_are_the_201_quantiles_of_loops_1_to_K_and_the_smallest_wins_a_tie():
    ce, pmax, kl, latent, K = latent_case()
    t, loops, ppl = calibrate_exit('latent', ce, pmax, kl, K, latent=latent)
    assert loops == pytest.approx(1.02), \
        "latent rule, 99 free exits at loop 1 and one costly one: mean loops {}, expected {}".format(
            *distinct(loops, 1.02))
    easy_max = latent[1:, 0].max()
    want = candidates(latent[:, :K], at_least=easy_max)
    variants = {'loops 2..K only (the KL rule\'s pool)': candidates(latent[:, 1:K], at_least=easy_max),
                'every column of latent (not only the first K)': candidates(latent, at_least=easy_max),
                'the KL column instead of the latent one': 1.0}
    assert all(v != pytest.approx(want, rel=1e-9) for v in variants.values()), \
        "the grader's own case no longer tells every mistake apart (a fault of the grader, not of your code)"
    assert t == pytest.approx(want, rel=1e-12), (
        "latent rule: calibrate_exit returned the threshold {}, expected {}: the smallest candidate that reaches the "
        "fewest mean loops within the tolerance. The candidates are the distinct values of np.quantile(latent "
        "changes of loops 1..K of every token, np.linspace(0, 1, 201)): loop 1's change is finite and counts.".format(
            *distinct(t, want)) + which_mistake(t, variants))


@pytest.mark.parametrize('rule, never', [('confidence', math.inf), ('kl', -math.inf), ('latent', -math.inf)])
def test_when_no_threshold_exits_early_calibration_returns_the_never_exit_value(rule, never):
    """Every early exit costs 50 nats, so no candidate gives fewer than K mean loops within the tolerance: the
    answer is (never-exit threshold, K, depth K's perplexity), the threshold being inf for the confidence rule
    and -inf for the KL and latent rules (no top probability reaches inf, no KL or change is at or below -inf)."""
    rng = np.random.default_rng(9)
    n, K = 50, 3
    pmax = rng.uniform(0.2, 0.9, (n, K))
    kl = rng.uniform(0.01, 1.0, (n, K))
    kl[:, 0] = math.inf
    ce = np.repeat(rng.uniform(3.0, 4.0, n)[:, None], K, axis=1)
    ce[:, :K - 1] += 50.0
    latent = rng.uniform(0.01, 1.0, (n, K))
    t, loops, ppl = calibrate_exit(rule, ce, pmax, kl, K, latent=latent)
    full = math.exp(ce[:, K - 1].mean())
    assert t == never, (
        f"{rule} rule, no early exit within the tolerance: calibrate_exit returned the threshold {t!r}, expected "
        f"{never!r}, the handout's never-exit value for this rule"
        + (f" (+inf under the {rule} rule would exit every token early)" if rule != 'confidence' and t == math.inf
           else ""))
    assert loops == K and ppl == pytest.approx(full, rel=1e-12), \
        f"{rule} rule, no early exit within the tolerance: got mean loops {loops!r} and perplexity {ppl!r}, " \
        f"expected K = {K} and depth K's perplexity {full!r}"
    depths = exit_depths(rule, t, pmax, kl, K, latent)
    assert (depths == K).all(), f"{rule} rule: the never-exit threshold {t!r} still exits some tokens before K"


# ---- exit_passes inside generation ----

K_GEN = 4  # the generation tests' model: grading.tiny with K = 4 loops


def prompt_batch(B=6, T=8, seed=2):
    return torch.randint(11, (B, T), generator=torch.Generator().manual_seed(seed))


def last_position_by_hand(model, prompt):
    """The last position's log-probabilities (B, K, V) at every loop and its states (B, K + 1, C),
    h_0 = e first, from the plain loop over the whole prompt (no cache, no exit)."""
    with torch.no_grad():
        e = model.embed(prompt)
        logps, states = [], [e[:, -1]]
        for k, h in model.loops(e, K_GEN):
            logits = model.lm_head(model.exit_input(h[:, -1:], k))             # (B, 1, V)
            logps.append(F.log_softmax(logits[:, -1].float(), -1))
            states.append(h[:, -1])
    return torch.stack(logps, 1).double(), torch.stack(states, 1).double()


def rule_by_hand(rule, logps, states):
    """Each loop's signal (B, K) and whether a smaller value exits ('kl', 'latent') or a larger
    one ('confidence'), computed here; the KL has no value at loop 1 (nan)."""
    if rule == 'confidence':
        return logps.exp().max(-1).values, False
    if rule == 'kl':
        kl = (logps[:, 1:].exp() * (logps[:, 1:] - logps[:, :-1])).sum(-1)
        return torch.cat([torch.full_like(kl[:, :1], math.nan), kl], 1), True
    change = (states[:, 1:] - states[:, :-1]).norm(dim=-1) / states[:, :-1].norm(dim=-1)
    return change, True


def split_by_hand(rule, model, prompt):
    """A threshold halfway between two signal values of loops 1..K-1 (so that no signal equals
    it), chosen so that some rows exit early and some run all K loops, with each row's exit loop
    and its log-probabilities there, all by hand."""
    logps, states = last_position_by_hand(model, prompt)
    signal, smaller = rule_by_hand(rule, logps, states)
    pool = signal[:, :K_GEN - 1].flatten()
    pool = pool[~pool.isnan()].sort().values
    mid = len(pool) // 2
    t = (pool[mid - 1] + pool[mid]).item() / 2
    passes = (signal <= t if smaller else signal >= t) & ~signal.isnan()
    passes[:, K_GEN - 1] = True  # the last loop always answers
    depth = passes.int().argmax(1) + 1
    return t, depth, logps[torch.arange(len(depth)), depth - 1]


def generated(model, prompt, n, rule, t, cache):
    """lab.engine.generate's tokens and depths, failing with a sentence if it cannot use what
    exit_passes returns."""
    try:
        return engine.generate(model, prompt, n, exit_rule=rule, exit_threshold=t, cache=cache)
    except RuntimeError as err:  # NotImplementedError too: torch's, for an op on the wrong dtype
        if 'assignments/README.md' in str(err):
            raise  # the unwritten stub
        raise AssertionError(
            f"generation under the {rule} rule could not use what exit_passes returned ({err}): "
            f"return a bool tensor with one entry per row, as generation combines it with & and "
            f"~") from None


@pytest.mark.parametrize('rule', ['confidence', 'kl', 'latent'])
def test_generation_exits_each_row_where_the_rule_first_passes(rule):
    """lab.engine.generate with a KV cache, one new token: each row exits at the first loop whose
    readout passes the rule, computed here by hand from the plain loop (K when none does), and
    samples its token from that loop's distribution (the same seed draws the same token)."""
    model = tiny(n_loop=K_GEN).eval()
    prompt = prompt_batch()
    t, want, logp = split_by_hand(rule, model, prompt)
    assert 1 < len(set(want.tolist())), f"the grader's threshold exits no row early ({rule})"
    torch.manual_seed(5)
    out, depth = generated(model, prompt, 1, rule, t, True)
    assert depth[:, 0].tolist() == want.tolist(), (
        f"{rule} rule at threshold {t:.6g}: generation exited the rows at loops "
        f"{depth[:, 0].tolist()}, and by hand they exit at {want.tolist()} (the first loop whose "
        f"readout passes, K = {K_GEN} when none does): check exit_passes on a batch of rows, "
        f"(B, V) log-probabilities and (B, C) states")
    torch.manual_seed(5)
    expected = sample(logp.float())[:, 0]
    assert out[:, -1].tolist() == expected.tolist(), (
        f"{rule} rule: generation exited at the right loops but sampled other tokens than each "
        f"row's exit loop's distribution gives with the same seed: exit_passes must not change "
        f"the log-probabilities or states it is given (no in-place operations on them)")


@pytest.mark.parametrize('rule', ['confidence', 'kl', 'latent'])
def test_cached_generation_under_a_rule_gives_its_recomputes_tokens_and_depths(rule):
    """24 new tokens under each rule (the window restarts at block_size 16): with the KV cache
    and with every window recomputed (cache=False), the same seed gives the same tokens and the
    same exit loop for every token, and the rule exits early somewhere."""
    model = tiny(n_loop=K_GEN).eval()
    prompt = prompt_batch(B=3)
    t, _, _ = split_by_hand(rule, model, prompt)
    torch.manual_seed(6)
    cached, depth_cached = generated(model, prompt, 24, rule, t, True)
    torch.manual_seed(6)
    plain, depth_plain = generated(model, prompt, 24, rule, t, False)
    assert torch.equal(cached, plain) and torch.equal(depth_cached, depth_plain), (
        f"{rule} rule: generation with the KV cache and without it gave different tokens or exit "
        f"loops for the same seed: exit_passes must depend on its arguments only")
    assert depth_cached.min().item() < K_GEN, f"the {rule} rule never exited early here"
