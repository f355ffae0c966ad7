"""A7 grader: looped.exit_passes, diagnose.exit_depths and diagnose.calibrate_exit on cases with known answers."""

import math

import numpy as np
import pytest
import torch

from diagnose import calibrate_exit, exit_depths
from looped import exit_passes


def logp(*probs):
    return torch.log(torch.tensor(probs, dtype=torch.float64))


def test_confidence_rule_reads_the_top_probability():
    lp = torch.stack([logp(0.9, 0.05, 0.05), logp(0.5, 0.3, 0.2), logp(1 / 3, 1 / 3, 1 / 3)])
    assert exit_passes('confidence', 0.5, lp, None).tolist() == [True, True, False]
    assert exit_passes('confidence', 0.9, lp, None).tolist() == [True, False, False]


def test_kl_rule_compares_with_the_previous_loop_in_the_right_direction():
    """KL(p_k || p_{k-1}), never at loop 1. For p = (0.9, 0.1), q = (0.6, 0.4): KL(p || q) = 0.2263 but
    KL(q || p) = 0.3112, so a threshold of 0.25 tells the two directions apart."""
    p, q = logp(0.9, 0.1)[None], logp(0.6, 0.4)[None]
    assert exit_passes('kl', 1e9, p, None).tolist() == [False]  # loop 1: nothing to compare with
    assert exit_passes('kl', 0.25, p, q).tolist() == [True]     # p is this loop, q the previous one
    assert exit_passes('kl', 0.25, q, p).tolist() == [False]
    assert exit_passes('kl', 0.0, p, p).tolist() == [True]


def test_exit_depths_on_known_signals():
    pmax = np.array([[0.9, 0.9, 0.9], [0.2, 0.7, 0.9], [0.1, 0.2, 0.3]])
    kl = np.array([[math.inf, 0.5, 0.01], [math.inf, 0.01, 0.0], [math.inf, 2.0, 1.0]])
    assert exit_depths('confidence', 0.6, pmax, kl, 3).tolist() == [1, 2, 3]  # the last loop always answers
    assert exit_depths('kl', 0.1, pmax, kl, 3).tolist() == [3, 2, 3]
    assert exit_depths('confidence', 0.6, pmax, kl, 2).tolist() == [1, 2, 2]   # K = 2: nothing past loop 2


def synthetic(n=200, K=3, seed=0):
    """Half the tokens are easy: confident (p = 0.95) and already right at loop 1. The other half are hard: unsure
    (p = 0.3) until the last loop and much worse early. Calibration must exit the easy half at loop 1 and keep the
    hard half to K: mean loops (1 + K) / 2, perplexity exactly depth K's."""
    rng = np.random.default_rng(seed)
    easy = np.arange(n) < n // 2
    ce = np.empty((n, K))
    ce[:, K - 1] = rng.uniform(0.5, 1.5, n)
    for k in range(K - 1):
        ce[:, k] = np.where(easy, ce[:, K - 1], ce[:, K - 1] + 3.0)
    pmax = np.where(easy[:, None], 0.95, 0.3) * np.ones((n, K))
    pmax[:, K - 1] = 0.6
    kl = np.where(easy[:, None], 1e-4, 1.0) * np.ones((n, K))
    kl[:, 0] = math.inf
    return ce, pmax, kl, easy


def test_calibration_finds_the_known_operating_point():
    ce, pmax, kl, easy = synthetic()
    t, loops, ppl = calibrate_exit('confidence', ce, pmax, kl, 3)
    assert loops == pytest.approx(2.0) and ppl == pytest.approx(math.exp(ce[:, 2].mean()))
    assert (exit_depths('confidence', t, pmax, kl, 3) == np.where(easy, 1, 3)).all()
    # the KL rule can only exit from loop 2 on: the easy half at 2, the hard half at 3
    t, loops, ppl = calibrate_exit('kl', ce, pmax, kl, 3)
    assert loops == pytest.approx(2.5) and ppl == pytest.approx(math.exp(ce[:, 2].mean()))


def test_calibration_respects_the_tolerance():
    """If exiting the easy tokens early costs 5% perplexity, a 1% tolerance forbids it and 10% allows it."""
    ce, pmax, kl, easy = synthetic()
    ce[easy, 0] += math.log(1.05) * 2  # easy tokens now lose at loop 1 (the mean over all tokens rises 5%)
    assert calibrate_exit('confidence', ce, pmax, kl, 3, tolerance=0.01)[1] == pytest.approx(3.0)
    t, loops, ppl = calibrate_exit('confidence', ce, pmax, kl, 3, tolerance=0.10)
    assert loops == pytest.approx(2.0) and ppl <= 1.10 * math.exp(ce[:, 2].mean())
