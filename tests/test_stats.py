"""Paired statistics (stats.py) on hand-computed cases."""

import numpy as np
import pytest

from toolcollapse.stats import compare_arms, discordant, mcnemar, paired_bootstrap, verdict


def test_mcnemar_exact_on_small_tables():
    assert mcnemar(0, 5) == pytest.approx(2 / 32)  # all 5 discordant pairs one way: 2 * (1/2)^5
    assert mcnemar(1, 9) == pytest.approx(2 * (1 + 10) / 1024)
    assert mcnemar(5, 5) == 1.0 and mcnemar(0, 0) == 1.0
    assert mcnemar(9, 1) == mcnemar(1, 9)


def test_discordant_tasks_compare_the_per_task_means_over_seeds():
    a = np.array([[1, 1, 0, 0], [1, 0, 0, 1]])  # per task 1, .5, 0, .5
    start = np.array([1, 0, 1, 0])
    assert discordant(a, start) == (2, 1)  # tasks 1 and 3 above, task 2 below; task 0 tied
    many = np.repeat(np.array([[1, 0, 0, 0]]), 3, axis=0)
    assert discordant(many, np.zeros(4)) == (1, 0)  # three seeds of one gained task are one task, not three


def test_bootstrap_interval_of_a_sure_difference_is_a_point():
    diff, low, high = paired_bootstrap(np.ones(50), np.zeros(50), n_boot=500)
    assert (diff, low, high) == (1.0, 1.0, 1.0)


def test_bootstrap_interval_matches_the_binomial_error_on_one_seed():
    a = np.zeros(400)
    a[:80] = 1  # 20 %
    diff, low, high = paired_bootstrap(a, np.zeros(400), n_boot=4000)
    se = np.sqrt(0.2 * 0.8 / 400)  # 0.02
    assert diff == pytest.approx(0.2)
    assert low == pytest.approx(0.2 - 1.96 * se, abs=0.006) and high == pytest.approx(0.2 + 1.96 * se, abs=0.006)


def test_pairing_narrows_the_interval_where_arms_share_most_outcomes():
    """b solves 40 % of 200 tasks; a solves the same tasks and 6 more: +3 points. Paired, every resample keeps the
    shared tasks shared, so the interval lies above zero; an unpaired 2-sample interval would span +-9 points."""
    b = np.zeros(200)
    b[:80] = 1
    a = b.copy()
    a[80:86] = 1
    d = compare_arms(a, b, n_boot=4000)
    assert d.diff == pytest.approx(0.03) and d.low > 0 and verdict(d.low, d.high) == "yes"
    assert (d.gained, d.lost) == (6, 0) and d.p_value == pytest.approx(2 / 64)


def test_a_verdict_turns_undecided_when_the_interval_spans_zero():
    b = np.zeros(200)
    b[:80] = 1
    a = b.copy()
    a[80:86] = 1
    a[:3] = 0  # now +6 / -3 tasks: +1.5 points, which 200 tasks cannot tell from zero
    d = compare_arms(a, b, n_boot=4000)
    assert d.low < 0 < d.high and verdict(d.low, d.high) == "undecided"
    assert verdict(-0.05, -0.01) == "no" and verdict(0.01, 0.05) == "yes"


def test_seed_spread_widens_the_interval():
    rng = np.random.default_rng(0)
    base = (rng.random(300) < 0.3).astype(float)
    steady = np.stack([base, base, base])
    spread = np.stack([base, np.where(rng.random(300) < 0.5, 1.0, base), base * 0])  # seeds far apart
    one = compare_arms(steady, base, n_boot=2000)
    many = compare_arms(spread, base, n_boot=2000)
    assert (one.high - one.low) < 0.01  # identical seeds, identical to b: no noise at all
    assert (many.high - many.low) > 0.1


def test_sampled_fractions_compare_task_by_task():
    a = np.array([[0.25, 0.5, 1.0, 0.0]])
    d = compare_arms(a, np.zeros(4), n_boot=500)
    assert (d.gained, d.lost) == (3, 0) and d.p_value == pytest.approx(2 / 8) and d.diff == pytest.approx(0.4375)


def test_arms_on_other_tasks_are_refused():
    with pytest.raises(ValueError, match="same tasks"):
        paired_bootstrap(np.ones(3), np.ones(4))
