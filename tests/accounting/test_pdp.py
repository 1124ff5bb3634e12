"""PDP-SGD: threshold selection, sampling probabilities, per-round plans and charging."""
import numpy as np
import pytest

from pdpfast.accounting import get_noise_multiplier, pdp
from pdpfast.accounting.rdp import epsilon as rdp_epsilon


def _naive_losses(budgets, tau, w1=0.7, w2=0.3):
    pi = np.where(budgets < tau, np.expm1(budgets) / np.expm1(tau), 1.0)
    waste_u = np.sum(np.where(budgets < tau, budgets * (1 - pi), 0.0))
    waste_s = np.sum(np.where(budgets > tau, budgets - tau, 0.0))
    fixed = w1 * waste_u + w2 * waste_s
    adaptive = 2 * waste_u * waste_s / (waste_u + waste_s) if waste_u + waste_s > 0 else 0.0
    return fixed, adaptive


def test_sampling_probabilities_follow_jorgensen():
    budgets = np.array([0.5, 1.0, 2.0, 3.0])
    pi = pdp.sampling_probabilities(budgets, 2.0)
    np.testing.assert_allclose(pi, [np.expm1(0.5) / np.expm1(2.0), np.expm1(1.0) / np.expm1(2.0), 1.0, 1.0])


def test_threshold_losses_match_a_direct_computation():
    rng = np.random.default_rng(0)
    budgets = rng.choice([0.5, 1.0, 2.0, 4.0], 200) * rng.uniform(0.9, 1.1, 200)
    taus = np.linspace(budgets.min(), budgets.max(), 17)
    fixed = pdp.threshold_losses(budgets, taus, "fixed")
    adaptive = pdp.threshold_losses(budgets, taus, "adaptive")
    for k, tau in enumerate(taus):
        f, a = _naive_losses(budgets, tau)
        assert fixed[k] == pytest.approx(f, rel=1e-9, abs=1e-9)
        assert adaptive[k] == pytest.approx(a, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("loss", ["fixed", "adaptive"])
def test_select_threshold_minimizes_the_loss(loss):
    rng = np.random.default_rng(1)
    budgets = np.r_[rng.uniform(0.5, 1.0, 70), rng.uniform(2.0, 3.0, 30)]
    tau = pdp.select_threshold(budgets, loss=loss)
    assert budgets.min() <= tau <= budgets.max()
    grid = np.linspace(budgets.min(), budgets.max(), 4001)
    best = min(_naive_losses(budgets, t)[0 if loss == "fixed" else 1] for t in grid)
    assert _naive_losses(budgets, tau)[0 if loss == "fixed" else 1] <= best + 1e-6


def test_round_plan_calibrates_noise_for_the_threshold():
    budgets = np.array([0.5, 1.0, 3.0, 3.0])
    plan = pdp.round_plan(budgets, delta=1e-5, steps=200, sample_rate=0.05, threshold=2.0)
    assert plan.noise_multiplier == pytest.approx(get_noise_multiplier(2.0, 1e-5, 0.05, 200))
    assert rdp_epsilon(0.05, plan.noise_multiplier, 200, 1e-5) <= 2.0
    np.testing.assert_allclose(plan.epsilons, [0.5, 1.0, 2.0, 2.0])
    np.testing.assert_allclose(plan.deltas, np.r_[plan.probabilities[:2] * 1e-5, 1e-5, 1e-5])


def test_charge_all_charges_every_record_its_round_guarantee():
    remaining = np.array([0.5, 1.0, 3.0, 5.0])
    after = pdp.charge(remaining, 2.0)
    np.testing.assert_allclose(after, [0.0, 0.0, 1.0, 3.0])
    # independent of who was sampled
    np.testing.assert_array_equal(after, pdp.charge(remaining, 2.0, sampled=[True, False, True, False]))


def test_charge_sampled_is_the_papers_rule():
    remaining = np.array([0.5, 1.0, 3.0, 5.0])
    after = pdp.charge(remaining, 2.0, sampled=[True, False, False, True], rule="sampled")
    np.testing.assert_allclose(after, [0.0, 1.0, 3.0, 3.0])
    with pytest.raises(ValueError, match="sampled"):
        pdp.charge(remaining, 2.0, rule="sampled")
    with pytest.raises(ValueError, match="rule"):
        pdp.charge(remaining, 2.0, rule="some")


def test_delta_after_k_rounds_is_at_most_k_delta():
    budgets = np.random.default_rng(2).uniform(0.5, 6.0, 500)
    rounds = pdp.schedule(budgets, 4, delta=1e-5, steps_per_round=50, sample_rate=0.05)
    assert 1 <= len(rounds) <= 4
    remaining, spent_delta, spent_eps = budgets.copy(), np.zeros(500), np.zeros(500)
    for r in rounds:
        spent_delta = pdp.charge_delta(spent_delta, remaining, r.threshold, 1e-5)
        spent_eps += r.epsilons
        remaining = pdp.charge(remaining, r.threshold)
    assert np.all(spent_delta <= len(rounds) * 1e-5 * (1 + 1e-12))
    assert np.all(spent_eps <= budgets * (1 + 1e-12))
    np.testing.assert_allclose(spent_eps + remaining, budgets)


def test_one_round_is_dp_sgd_plus_sampling():
    budgets = np.array([1.0, 1.0, 4.0])
    (only,) = pdp.schedule(budgets, 1, delta=1e-5, steps_per_round=10, sample_rate=0.1, loss="fixed")
    assert only.threshold == pdp.select_threshold(budgets)


def test_bad_input():
    with pytest.raises(ValueError, match="budgets"):
        pdp.select_threshold([1.0, -2.0])
    with pytest.raises(ValueError, match="loss"):
        pdp.select_threshold([1.0, 2.0], loss="median")
    with pytest.raises(ValueError, match="threshold"):
        pdp.sampling_probabilities([1.0], 0.0)
    with pytest.raises(ValueError, match="remaining"):
        pdp.round_plan([0.0, 0.0], delta=1e-5, steps=10, sample_rate=0.1)
