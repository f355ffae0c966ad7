"""A7 grader: looped.exit_passes, diagnose.exit_depths and diagnose.calibrate_exit on cases with known answers.
PYTEST_DONT_REWRITE"""

import math

import numpy as np
import pytest
import torch

from diagnose import calibrate_exit, exit_depths
from looped import exit_passes


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
        f"confidence rule: calibrate_exit reported perplexity {ppl:.5g}, but exiting there costs nothing: it is " \
        f"depth K's, exp(mean CE) = {full:.5g} (the exponential of the mean cross-entropy of the exit loops)"
    depths = exit_depths('confidence', t, pmax, kl, 3)
    assert (depths == np.where(easy, 1, 3)).all(), \
        f"the calibrated confidence threshold {t:.4g} does not exit the easy tokens at 1 and the hard at 3"
    # the KL rule can only exit from loop 2 on: the easy half at 2, the hard half at 3
    t, loops, ppl = calibrate_exit('kl', ce, pmax, kl, 3)
    assert loops == pytest.approx(2.5), \
        f"KL rule: calibration chose mean loops {loops:.4g}; the known answer is 2.5 (the KL rule cannot exit at " \
        f"loop 1, so the easy half exits at 2 and the hard half at 3): search thresholds over the KL of loops 2..K"
    assert ppl == pytest.approx(full), f"KL rule: reported perplexity {ppl:.5g}, expected depth K's {full:.5g}"


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
        f"calibrate_exit reported perplexity {ppl:.5g}, above the tolerance's {(1 + tolerance) * full:.5g}"
