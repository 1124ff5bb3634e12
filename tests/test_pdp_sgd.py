"""PDP-SGD driver (pdpfast.pdp_sgd): every setting refused by name before any round charges the budgets."""
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pdpfast.pdp_sgd import PDPSGD, train_pdp_sgd

DELTA = 1e-5
N = 20


def _problem():
    g = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(N, 3, generator=g), torch.randint(0, 2, (N,), generator=g))
    budgets = np.r_[np.full(N // 2, 1.0), np.full(N // 2, 3.0)]
    torch.manual_seed(0)
    return nn.Linear(3, 2), dataset, budgets


def _driver(**kwargs):
    model, dataset, budgets = _problem()
    args = dict(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), delta=DELTA, rounds=2, steps_per_round=2,
                sample_rate=0.3) | kwargs
    return PDPSGD(model, args.pop("dataset", dataset), args.pop("budgets", budgets), **args)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(max_grad_norm=-1.0), ValueError, "max_grad_norm"),
    (dict(max_grad_norm=math.nan), ValueError, "max_grad_norm"),
    (dict(max_grad_norm=True), TypeError, "max_grad_norm"),
    (dict(mode="foo"), ValueError, "mode"),
    (dict(clipping="foo"), ValueError, "clipping"),
    (dict(clipping="per_layer", mode="ghost"), ValueError, "per_layer"),
    (dict(physical_batch_size=0), ValueError, "physical_batch_size"),
    (dict(physical_batch_size=2.5), ValueError, "physical_batch_size"),
    (dict(w1=-1.0), ValueError, "w1"),
    (dict(w2=math.nan), ValueError, "w2"),
    (dict(w1="0.5"), TypeError, "w1"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=1.5), ValueError, "seed"),
    (dict(seed=True), ValueError, "seed"),
    (dict(seed="1"), ValueError, "seed"),
    (dict(seed=2 ** 70), ValueError, "seed"),
    (dict(task="foo"), TypeError, "task"),
    (dict(optimizer="sgd"), TypeError, "optimizer"),
    (dict(optimizer=torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1)), ValueError, "optimizer"),
    (dict(min_remaining=math.nan), ValueError, "min_remaining"),
    (dict(min_remaining=-1.0), ValueError, "min_remaining"),
    (dict(min_remaining=3.0), ValueError, "min_remaining"),
    (dict(budgets=["1"] * N), TypeError, "budgets"),
    (dict(dataset=None), TypeError, "dataset"),
    (dict(rounds=None), ValueError, "rounds"),
])
def test_pdp_sgd_refuses_bad_settings_before_charging_any_budget(kwargs, error, match):
    """Before: these passed the constructor and failed inside run() after round 0 was charged (e.g.
    max_grad_norm=-1 left every remaining budget at 0 with nothing trained)."""
    model, dataset, budgets = _problem()
    args = dict(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), delta=DELTA, rounds=2, steps_per_round=2,
                sample_rate=0.3) | kwargs
    given = args.pop("budgets", budgets)
    with pytest.raises(error, match=match):
        PDPSGD(model, args.pop("dataset", dataset), given, **args)
    assert type(model) is nn.Linear and not model._forward_pre_hooks    # no engine touched the model
    np.testing.assert_array_equal(budgets, np.r_[np.full(N // 2, 1.0), np.full(N // 2, 3.0)])


def test_pdp_sgd_refuses_a_model_the_engine_cannot_make_private_before_charging():
    dataset = _problem()[1]
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="BatchNorm"):
        PDPSGD(model, dataset, np.ones(N), optimizer=torch.optim.SGD(model.parameters(), lr=0.1), delta=DELTA,
               rounds=1, steps_per_round=1, sample_rate=0.5)
    assert type(model[0]) is nn.Linear                                # nothing was converted


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(max_steps=-1), ValueError, "max_steps"),
    (dict(max_steps="x"), ValueError, "max_steps"),
    (dict(max_steps=True), ValueError, "max_steps"),
    (dict(on_step=5), TypeError, "on_step"),
])
def test_pdp_sgd_run_refuses_bad_arguments_before_charging_any_budget(kwargs, error, match):
    driver = _driver()
    with pytest.raises(error, match=match):
        driver.run(**kwargs)
    np.testing.assert_array_equal(driver.remaining, driver.budgets)     # round 0 was not charged
    assert driver.round == 0 and driver.current is None and driver.steps == 0


def test_pdp_sgd_run_max_steps_zero_is_a_valid_pause():
    driver = _driver()
    driver.run(max_steps=0)
    assert driver.steps == 0 and not driver.finished


def _damaged(damage):
    driver = _driver()
    driver.run(max_steps=1)                                           # a round in progress, budgets charged
    state = driver.state_dict()
    damage(state)
    return driver, state


@pytest.mark.parametrize("damage,error,match", [
    (lambda s: s.pop("config"), ValueError, "missing config"),
    (lambda s: s.pop("remaining"), ValueError, "missing remaining"),
    (lambda s: s.update(round=-5), ValueError, "round"),
    (lambda s: s.update(round=3), ValueError, "round"),
    (lambda s: s.update(completed_steps=-3), ValueError, "completed_steps"),
    (lambda s: s.update(finished="no"), TypeError, "finished"),
    (lambda s: s.update(current={"x": 1}), ValueError, "current"),
    (lambda s: s["current"].update(kept=np.array([N + 5])), ValueError, "kept"),
    (lambda s: s["current"].update(probabilities=np.full(N, 2.0)), ValueError, "probabilities"),
    (lambda s: s.update(history=[{"x": 1}]), ValueError, "history"),
], ids=["no config", "no remaining", "negative round", "round past the last", "negative steps", "finished 'no'",
        "current garbage", "kept out of range", "probabilities above 1", "history garbage"])
def test_pdp_sgd_refuses_a_damaged_state_by_name_and_stays_unchanged(damage, error, match):
    driver, state = _damaged(damage)
    before = (driver.remaining.copy(), driver.round, driver.completed_steps, driver.steps, driver.finished)
    with pytest.raises(error, match=match):
        driver.load_state_dict(state)
    assert (driver.remaining.tolist(), driver.round, driver.completed_steps, driver.steps, driver.finished) == (
        before[0].tolist(), *before[1:])


def test_pdp_sgd_refuses_a_state_that_is_not_a_dict():
    with pytest.raises(TypeError, match="state"):
        _driver().load_state_dict(None)


def test_pdp_sgd_state_round_trips_after_the_checks():
    driver, state = _damaged(lambda s: None)
    other = _driver()
    other.load_state_dict(state)
    assert other.steps == driver.steps and other.round == driver.round
    np.testing.assert_array_equal(other.remaining, driver.remaining)


def test_pdp_sgd_seed_is_secret_by_default_and_a_resumed_run_goes_on_with_its_own():
    """Before: seed 0 by default, so anyone could recompute every round's subset, draws and noise (a re-run
    on both neighbouring datasets matched the released model bit for bit)."""
    first, second = _driver(), _driver()
    assert first.seed != second.seed
    first.run(max_steps=1)
    second.load_state_dict(first.state_dict())
    assert second.seed == first.seed
    given = _driver(seed=5)
    with pytest.raises(ValueError, match="settings differ .*seed"):
        given.load_state_dict(first.state_dict())


def test_pdp_sgd_refuses_an_older_state_so_no_step_is_released_twice_with_the_same_noise():
    """Before: run 6 steps, load the step-3 state, run on: steps 3-5 were released again with the same
    draws and noise on other weights, and the ledger counted 10 steps for 13 released."""
    driver = _driver(rounds=3, steps_per_round=3, seed=1)
    driver.run(max_steps=2)
    older = driver.state_dict()
    driver.run(max_steps=3)
    assert driver.steps == 5
    with pytest.raises(ValueError, match="saved after 2 steps and this run has taken 5"):
        driver.load_state_dict(older)
    assert driver.steps == 5
    fresh = _driver(rounds=3, steps_per_round=3, seed=1)
    fresh.load_state_dict(older)                          # a new run resumes from it
    assert fresh.steps == 2


def test_pdp_sgd_state_dict_is_a_snapshot_that_later_steps_leave_alone():
    """Before: the round in progress was shared, and the ledger adopted the loaded arrays, so later steps
    added into a state kept in memory (its RDP grew, its step count did not)."""
    driver = _driver(rounds=2, steps_per_round=4, seed=2)
    driver.run(max_steps=1)
    driver.run(max_steps=1)             # the round engine is rebuilt from the saved round state
    state = driver.state_dict()
    kept = {k: np.array(v, copy=True) for k, v in state["current"]["engine"]["ledger"].items()
            if isinstance(v, np.ndarray)}
    driver.run(max_steps=1)
    for key, value in kept.items():
        np.testing.assert_array_equal(state["current"]["engine"]["ledger"][key], value, err_msg=key)
    resumed = _driver(rounds=2, steps_per_round=4, seed=2)
    resumed.load_state_dict(state)
    resumed.run(max_steps=1)            # the kept state still resumes (it used to exceed the budget at once)
    assert resumed.steps == 3


def test_train_pdp_sgd_refuses_lr_that_its_given_optimizer_would_ignore():
    model, dataset, budgets = _problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="lr"):
        train_pdp_sgd(model, dataset, budgets, delta=DELTA, rounds=1, steps_per_round=1, sample_rate=0.3,
                      optimizer=optimizer, lr=999)
    with pytest.raises(ValueError, match="lr"):
        train_pdp_sgd(model, dataset, budgets, delta=DELTA, rounds=1, steps_per_round=1, sample_rate=0.3, lr=-1.0)
    assert optimizer.param_groups[0]["lr"] == 0.1


def _tiny(n=4):
    torch.manual_seed(0)
    return nn.Linear(3, 2), TensorDataset(torch.randn(n, 3), torch.randint(0, 2, (n,)))


def test_a_leftover_budget_no_round_can_meet_is_left_out_with_a_warning_not_a_crash():
    """Before: round 1's threshold was record 3's leftover 0.005, which no noise meets over 3 steps at
    δ = 1e-5; run() raised mid-run (advising an orders= that PDPSGD does not take) and returned nothing."""
    model, data = _tiny()
    driver = PDPSGD(model, data, [1.0, 1.0, 1.0, 1.005], optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    delta=1e-5, rounds=2, steps_per_round=3, sample_rate=0.5, seed=0)
    with pytest.warns(UserWarning, match=r"1 record\(s\) with a remaining budget of at most 0.005 take no further"):
        result = driver.run()
    assert driver.finished and len(result.rounds) == 1
    np.testing.assert_allclose(result.remaining, [0.0, 0.0, 0.0, 0.005], atol=1e-12)
    assert np.all(result.epsilons <= driver.budgets) and np.all(result.ledger_epsilons <= result.epsilons + 1e-12)


def test_the_harmonic_loss_plans_every_round_of_continuous_budgets():
    """Before: "harmonic" (τ = the smallest remaining budget) met a leftover of 0.002 in round 2 and raised."""
    from pdpfast.accounting import pdp

    budgets = np.random.default_rng(0).uniform(1, 3, 100)
    plans = pdp.schedule(budgets, 4, delta=1e-5, steps_per_round=100, sample_rate=0.05, loss="harmonic")
    assert 1 <= len(plans) <= 4
    spent = sum(np.asarray(p.epsilons) for p in plans)
    assert np.all(spent <= budgets + 1e-12)


def test_budgets_above_709_give_finite_probabilities_thresholds_and_ledger():
    """Before: e^ε overflowed: π = inf/inf = NaN, the threshold a NaN candidate, the ledger ε inf."""
    from pdpfast.accounting import pdp

    np.testing.assert_allclose(pdp.sampling_probabilities([720.0, 730.0], 740.0), np.exp([-20.0, -10.0]), rtol=1e-12)
    assert np.all(np.isfinite(pdp.threshold_losses([800.0, 900.0, 1000.0], [800.0, 900.0, 1000.0])))
    assert pdp.select_threshold([800.0, 900.0, 1000.0]) == 800.0
    model, data = _tiny(3)
    result = train_pdp_sgd(model, data, [1000.0] * 3, delta=1e-5, rounds=1, steps_per_round=2, sample_rate=0.5, lr=0.1)
    assert np.all(np.isfinite(result.ledger_epsilons)) and np.all(result.ledger_epsilons <= result.epsilons)


def test_the_small_probability_and_amplification_formulas_are_unchanged_in_the_usual_range():
    from pdpfast.accounting import pdp

    eps = np.random.default_rng(1).uniform(0.01, 8.0, 200)
    expected = np.where(eps < 5, np.expm1(eps) / np.expm1(5.0), 1.0)
    np.testing.assert_allclose(pdp.sampling_probabilities(eps, 5.0), expected, rtol=1e-12)
    for e in (0.3, 1.0, 4.0, 30.0):
        p = np.r_[0.0, np.random.default_rng(2).uniform(0, 1, 20), 1.0]
        np.testing.assert_allclose(pdp.amplified_epsilon(p, e), np.log1p(p * np.expm1(e)), rtol=1e-12, atol=1e-15)


def test_records_at_or_below_min_remaining_never_train_and_are_reported_as_charged_nothing():
    """Before: their ε read as their whole budget (0.5, 1.0), though they were never in a subset."""
    model, data = _tiny()
    with pytest.warns(UserWarning, match=r"2 record\(s\) have a budget at or below min_remaining=1.5"):
        result = train_pdp_sgd(model, data, [0.5, 1.0, 2.0, 4.0], delta=1e-5, rounds=3, steps_per_round=3,
                               sample_rate=0.5, lr=0.1, min_remaining=1.5)
    np.testing.assert_array_equal(result.epsilons[:2], [0.0, 0.0])
    np.testing.assert_array_equal(result.remaining[:2], [0.5, 1.0])
    assert np.all(result.epsilons[2:] > 0)
