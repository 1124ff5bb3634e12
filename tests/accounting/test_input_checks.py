"""The accounting functions refuse values that would give a wrong ε (a negative RDP, a truncated step count,
a δ outside (0, 1), a mask broadcast to every record), naming the argument: TypeError for the wrong kind
of value (a bool, a string, None), ValueError for the wrong range or shape."""
import math

import numpy as np
import pytest

from pdpfast.accounting import (
    IndividualAccountant,
    PLDIndividualAccountant,
    calibrate,
    compute_rdp,
    get_noise_multiplier,
    get_privacy_spent,
    get_sample_rate,
    ledger_for_plan,
    pdp,
    pld,
    rdp,
    rpdp,
)
from pdpfast.accounting.sgm import rdp_one_step

DELTA = 1e-5
ORDERS = [2.0, 4.0, 8.0]
BUDGETS = np.array([0.5, 1.0, 2.0, 4.0])


# ---------------------------------------------------------------------------------------------- get_privacy_spent
@pytest.mark.parametrize("rdp_values", [[-5.0, -5.0, -5.0], [-np.inf, 0.2, 0.4], [0.1, -1e-3, 0.4]],
                         ids=["all negative", "minus inf", "one negative"])
def test_negative_rdp_is_refused_not_turned_into_a_negative_epsilon(rdp_values):
    given = np.array(rdp_values)
    with pytest.raises(ValueError, match="rdp must be ≥ 0"):
        get_privacy_spent(ORDERS, given, DELTA)
    np.testing.assert_array_equal(given, rdp_values)


@pytest.mark.filterwarnings("ignore:Optimal order")
def test_rdp_rounding_below_zero_reads_as_zero():
    """Other libraries' RDP of a tiny step can come out as −1e-22: that is 0, not an error."""
    assert get_privacy_spent(ORDERS, [-1e-15, 0.2, 0.4], DELTA) == get_privacy_spent(ORDERS, [0.0, 0.2, 0.4], DELTA)


@pytest.mark.parametrize("orders", [[0.5, 4, 8], [1.0, 4, 8], [-1.0, 4, 8], [np.nan, 4, 8]],
                         ids=["0.5", "1", "-1", "NaN"])
def test_invalid_orders_are_refused_not_skipped(orders):
    with pytest.raises(ValueError, match="orders must all be > 1"):
        get_privacy_spent(orders, [0.1, 0.2, 0.4], DELTA)


@pytest.mark.parametrize("orders, rdp_values, name", [
    (["2", "4", "8"], [0.1, 0.2, 0.4], "orders"),
    ([True, True, True], [0.1, 0.2, 0.4], "orders"),
    (ORDERS, [True, False, True], "rdp"),
    (ORDERS, ["0.1", "0.2", "0.4"], "rdp"),
])
def test_orders_and_rdp_given_as_text_or_bools_are_type_errors(orders, rdp_values, name):
    with pytest.raises(TypeError, match=f"{name} must be numbers"):
        get_privacy_spent(orders, rdp_values, DELTA)


def test_get_privacy_spent_of_nothing_names_the_orders():
    with pytest.raises(ValueError, match="orders must be a non-empty 1-D sequence"):
        get_privacy_spent([], [], DELTA)


def test_rdp_the_package_computes_is_never_negative():
    """The quadrature and the series round tiny RDP to −2e-15; the values are clamped at 0, so a ledger of
    such records saves a state its own load accepts (it refuses negative RDP)."""
    q = np.geomspace(1e-6, 0.5, 40)
    assert (compute_rdp(q, 1e3, 1) >= 0).all()
    assert (rdp_one_step(q, np.array([10.0]), np.array([1.5, 2.0, 2.5, 64.0])) >= 0).all()
    ledger = IndividualAccountant(q, 10.0).step(3)
    assert (ledger.group_rdp >= 0).all()
    IndividualAccountant.__new__(IndividualAccountant).load_state_dict(ledger.state_dict())


# ---------------------------------------------------------------------------------------------- pdp charging
@pytest.mark.parametrize("spent, error, match", [
    (np.nan, ValueError, "spent_delta must be finite and >= 0"),
    (-1.0, ValueError, "spent_delta must be finite and >= 0"),
    (np.array([0.0, 0.0, np.inf, 0.0]), ValueError, "spent_delta must be finite and >= 0"),
    (True, TypeError, "spent_delta must be numbers"),
    ("0", TypeError, "spent_delta must be numbers"),
    (np.zeros(2), ValueError, r"spent_delta must be a number or one δ_i per record \(4,\)"),
    (np.zeros(1), ValueError, r"spent_delta must be a number or one δ_i per record \(4,\)"),
])
def test_a_spent_delta_that_is_not_finite_nonnegative_numbers_per_record_is_refused(spent, error, match):
    remaining = BUDGETS.copy()
    with pytest.raises(error, match=match):
        pdp.charge_delta(spent, remaining, 1.0, DELTA)
    np.testing.assert_array_equal(remaining, BUDGETS)


@pytest.mark.parametrize("charge", ["charge", "charge_delta"])
@pytest.mark.parametrize("sampled", [[False], np.zeros(3, dtype=bool)], ids=["one value", "three values"])
def test_a_sampled_mask_of_another_length_is_refused_not_broadcast_to_every_record(charge, sampled):
    """charge_delta(sampled=[False]) charged nobody δ: one value was broadcast to all four records."""
    args = (0.0, BUDGETS, 1.0, DELTA) if charge == "charge_delta" else (BUDGETS, 1.0)
    with pytest.raises(ValueError, match=r"sampled must have one value per record \(4,\)"):
        getattr(pdp, charge)(*args, sampled=sampled, rule="sampled")


@pytest.mark.parametrize("charge", ["charge", "charge_delta"])
@pytest.mark.parametrize("sampled", [["False", "", "", ""], [0.5, 1.0, 0.0, 2.0], [1, 0, 0, 1]],
                         ids=["strings", "floats", "ints"])
def test_a_sampled_mask_must_be_bools_not_strings_or_numbers(charge, sampled):
    """np.asarray(["False"], dtype=bool) is True: the record not sampled was charged."""
    args = (0.0, BUDGETS, 1.0, DELTA) if charge == "charge_delta" else (BUDGETS, 1.0)
    with pytest.raises(TypeError, match="sampled must be a bool array"):
        getattr(pdp, charge)(*args, sampled=sampled, rule="sampled")


def test_sampled_under_rule_all_is_checked_but_every_record_pays():
    """Rule "all" charges every record whatever was drawn (a caller passes its draw under either rule)."""
    nobody = np.zeros(4, dtype=bool)
    np.testing.assert_array_equal(pdp.charge(BUDGETS, 1.0, sampled=nobody), pdp.charge(BUDGETS, 1.0))
    np.testing.assert_array_equal(pdp.charge_delta(0.0, BUDGETS, 1.0, DELTA, sampled=nobody),
                                  pdp.charge_delta(0.0, BUDGETS, 1.0, DELTA))
    assert (pdp.charge_delta(0.0, BUDGETS, 1.0, DELTA, sampled=nobody) > 0).all()
    with pytest.raises(ValueError, match="sampled must have one value per record"):
        pdp.charge(BUDGETS, 1.0, sampled=[False])
    with pytest.raises(ValueError, match="rule must be one of"):
        pdp.charge_delta(0.0, BUDGETS, 1.0, DELTA, rule="some")


@pytest.mark.parametrize("threshold, error", [(True, TypeError), ("2", TypeError), (None, TypeError),
                                              (np.array([2.0]), TypeError), (0.0, ValueError), (np.nan, ValueError)])
def test_a_threshold_must_be_one_finite_positive_number(threshold, error):
    with pytest.raises(error, match="threshold must be a"):
        pdp.sampling_probabilities(BUDGETS, threshold)
    with pytest.raises(error, match="threshold must be a"):
        pdp.charge(BUDGETS, threshold)
    if threshold is not None:   # round_plan reads None as "choose one"
        with pytest.raises(error, match="threshold must be a"):
            pdp.round_plan(BUDGETS, delta=DELTA, steps=10, sample_rate=0.1, threshold=threshold)


def test_round_plan_checks_loss_and_weights_when_a_threshold_is_given():
    with pytest.raises(ValueError, match="loss must be one of"):
        pdp.round_plan(BUDGETS, delta=DELTA, steps=10, sample_rate=0.1, threshold=1.0, loss="x")
    with pytest.raises(ValueError, match="w1 must be a finite number ≥ 0"):
        pdp.round_plan(BUDGETS, delta=DELTA, steps=10, sample_rate=0.1, threshold=1.0, w1=-1.0)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(resolution=-5), ValueError, "resolution must be an int ≥ 1"),
    (dict(resolution=2.7), ValueError, "resolution must be an int ≥ 1"),
    (dict(resolution=True), ValueError, "resolution must be an int ≥ 1"),
    (dict(resolution=np.nan), ValueError, "resolution must be an int ≥ 1"),
    (dict(w1="0.5"), TypeError, "w1 must be a number"),
    (dict(w1=None), TypeError, "w1 must be a number"),
    (dict(w1=True), TypeError, "w1 must be a number"),
    (dict(w2=-1.0), ValueError, "w2 must be a finite number ≥ 0"),
])
def test_select_threshold_names_a_bad_resolution_or_weight(kwargs, error, match):
    with pytest.raises(error, match=match):
        pdp.select_threshold(BUDGETS, **kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(taus=[0.0]), ValueError, "taus must be finite and > 0"),
    (dict(taus=[-1.0]), ValueError, "taus must be finite and > 0"),
    (dict(taus=["a"]), TypeError, "taus must be numbers"),
    (dict(taus=[1.0], w1=np.nan), ValueError, "w1 must be a finite number ≥ 0"),
    (dict(taus=[1.0], w1=-1.0), ValueError, "w1 must be a finite number ≥ 0"),
    (dict(taus=[1.0], w1="a"), TypeError, "w1 must be a number"),
])
def test_threshold_losses_refuse_thresholds_that_are_not_positive_and_bad_weights(kwargs, error, match):
    with pytest.raises(error, match=match):
        pdp.threshold_losses(BUDGETS, **kwargs)


# ---------------------------------------------------------------------------------------------- pld
@pytest.mark.parametrize("call, match", [
    (lambda: pld.pld_epsilon(0.1, 1.0, 2.9, DELTA), "steps must be a positive integer, got 2.9"),
    (lambda: pld.pld_epsilon(0.1, 1.0, 0, DELTA), "steps must be a positive integer, got 0"),
    (lambda: pld.pld_epsilon_composed([(1.0, 0.1, 2.5)], DELTA), r"history\[0\] steps must be a whole number"),
    (lambda: pld.pld_epsilon_composed([(1.0, 0.1, 3), (1.0, 0.1, -5)], DELTA),
     r"history\[1\] steps must be a whole number >= 0, got -5"),
    (lambda: pld.epsilons([0.1], 1.0, 2.5, DELTA), "steps must be a positive integer"),
])
def test_pld_step_counts_must_be_whole_not_truncated_or_dropped(call, match):
    """2.9 steps were accounted as 2 (int()), and a history entry of −5 steps was dropped: ε under-counted."""
    with pytest.raises(ValueError, match=match):
        call()


def test_a_history_entry_of_zero_steps_adds_nothing():
    assert pld.pld_epsilon_composed([(1.0, 0.1, 0)], DELTA) == 0.0
    assert pld.pld_epsilon_composed([(1.0, 0.1, 0), (1.0, 0.1, 3)], DELTA) == pld.pld_epsilon(0.1, 1.0, 3, DELTA)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(delta=np.nan), ValueError, r"delta must lie in \(0, 1\)"),
    (dict(delta=1.5), ValueError, r"delta must lie in \(0, 1\)"),
    (dict(delta=0.0), ValueError, r"delta must lie in \(0, 1\)"),
    (dict(q=True), TypeError, "q must be a number"),
    (dict(q="0.1"), TypeError, "q must be a number"),
    (dict(q=1.5), ValueError, r"q must lie in \[0, 1\]"),
    (dict(z=np.nan), ValueError, "z must be a finite number ≥ 0"),
    (dict(z=np.inf), ValueError, "z must be a finite number ≥ 0"),
    (dict(value_discretization_interval=0.0), ValueError, "value_discretization_interval must be a finite number > 0"),
    (dict(value_discretization_interval=True), TypeError, "value_discretization_interval must be a number"),
    (dict(value_discretization_interval=1e6), ValueError, "value_discretization_interval=1e\\+06 is too coarse"),
])
def test_pld_epsilon_names_a_bad_rate_noise_delta_or_discretization(kwargs, error, match):
    args = dict(q=0.1, z=1.0, steps=10, delta=DELTA) | kwargs
    with pytest.raises(error, match=match):
        pld.pld_epsilon(**args)


@pytest.mark.parametrize("call, error, match", [
    (lambda: pld.pld_noise_multiplier(0.0, DELTA, 0.1, 10), ValueError, "target_epsilon must be a finite number > 0"),
    (lambda: pld.pld_noise_multiplier(1.0, 0.0, 0.1, 10), ValueError, r"delta must lie in \(0, 1\)"),
    (lambda: pld.pld_noise_multiplier(1.0, DELTA, 0.0, 10), ValueError, r"sample_rate must lie in \(0, 1\]"),
    (lambda: pld.pld_noise_multiplier(1.0, DELTA, True, 10), TypeError, "sample_rate must be a number"),
    (lambda: pld.pld_noise_multiplier(1.0, DELTA, 0.1, 2.5), ValueError, "steps must be a positive integer"),
    (lambda: pld.pld_sample_rate(1.0, DELTA, -1.0, 10), ValueError, "noise_multiplier must be a finite number > 0"),
    (lambda: pld.pld_sample_rate(1.0, DELTA, "1.0", 10), TypeError, "noise_multiplier must be a number"),
    (lambda: pld.pld_sample_rate_from(1.0, DELTA, 1.0, 10, 0.1, growth=1.0), ValueError, "growth must lie in"),
    (lambda: pld.epsilons([0.1, 0.2], [1.0, 2.0, 3.0], 10, DELTA), ValueError,
     "noise_multipliers .* must broadcast to sample_rates"),
    (lambda: pld.epsilons([0.1], 1.0, 10, DELTA, max_pairs=1.5), ValueError, "max_pairs must be an int ≥ 1"),
])
def test_pld_inversions_and_epsilons_name_a_bad_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------------------------------------- δ "not checked"
@pytest.mark.parametrize("delta", [0.0, 2.0, -1.0, np.nan])
def test_rdp_epsilon_refuses_a_delta_outside_the_unit_interval(delta):
    """δ = 2 gave ε = −10.2."""
    with pytest.raises(ValueError, match=r"delta must lie in \(0, 1\)"):
        rdp.epsilon(0.1, 1.0, 10, delta)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(delta=2.0), ValueError, r"delta must lie in \(0, 1\)"),
    (dict(delta=0.0), ValueError, r"delta must lie in \(0, 1\)"),
    (dict(delta=np.nan), ValueError, r"delta must lie in \(0, 1\)"),
    (dict(rdp=np.array([[-9.0, -9.0, -9.0]])), ValueError, "rdp must be ≥ 0"),
    (dict(rdp=np.array([[np.nan, 0.2, 0.4]])), ValueError, "rdp must be ≥ 0 .inf allowed., got NaN"),
    (dict(rdp=np.array([[0.1, 0.2]])), ValueError, r"rdp must have one value per order on its last axis \(3\)"),
    (dict(conversion="x"), ValueError, "conversion must be one of 'standard', 'improved'"),
])
def test_rdp_to_epsilon_refuses_a_bad_delta_negative_rdp_or_unknown_conversion(kwargs, error, match):
    args = dict(orders=np.array(ORDERS), rdp=np.array([[0.1, 0.2, 0.4]]), delta=DELTA, conversion="standard") | kwargs
    with pytest.raises(error, match=match):
        rpdp.rdp_to_epsilon(**args)


@pytest.mark.parametrize("client_rate, error", [(2.0, ValueError), (-1.0, ValueError), (0.0, ValueError),
                                                (np.nan, ValueError), (True, TypeError), ("0.5", TypeError)])
def test_client_sampled_rdp_refuses_a_client_rate_outside_zero_one(client_rate, error):
    """λ = 2 gave a wrong amplified bound, λ = −1 a negative one, NaN a NaN one."""
    with pytest.raises(error, match="client_rate must"):
        rpdp.client_sampled_rdp(np.array([0.1, 0.2, 0.4]), np.array(ORDERS), client_rate)


def test_client_sampled_rdp_refuses_negative_local_rdp_and_reads_lists():
    with pytest.raises(ValueError, match="rho_local must be ≥ 0"):
        rpdp.client_sampled_rdp(np.array([-0.1, 0.2, 0.4]), np.array(ORDERS), 0.5)
    with pytest.raises(ValueError, match="orders must all be > 1"):
        rpdp.client_sampled_rdp(np.array([0.1, 0.2, 0.4]), np.array([0.5, 4.0, 8.0]), 0.5)
    np.testing.assert_array_equal(rpdp.client_sampled_rdp([0.1, 0.2, 0.4], ORDERS, 0.5),
                                  rpdp.client_sampled_rdp(np.array([0.1, 0.2, 0.4]), np.array(ORDERS), 0.5))


# ---------------------------------------------------------------------------------------------- rdp functions
def test_compute_rdp_reads_none_orders_as_the_default_orders():
    np.testing.assert_array_equal(compute_rdp(0.1, 1.0, 10, None), compute_rdp(0.1, 1.0, 10))
    assert rdp.epsilon(0.1, 1.0, 10, DELTA, orders=None) == rdp.epsilon(0.1, 1.0, 10, DELTA)


@pytest.mark.parametrize("steps, error, match", [
    (1.5, ValueError, "steps must be a finite whole number >= 0, got 1.5"),
    ([1, 2], ValueError, r"steps must be one whole number of steps ≥ 0, got shape \(2,\)"),
    (True, TypeError, "steps must be numbers"),
])
def test_compute_rdp_steps_must_be_one_whole_number(steps, error, match):
    with pytest.raises(error, match=match):
        compute_rdp(0.1, 1.0, steps, ORDERS)
    assert compute_rdp(0.1, 1.0, 2.0, ORDERS) == pytest.approx(compute_rdp(0.1, 1.0, 2, ORDERS))


def test_compute_rdp_names_q_and_noise_of_shapes_that_do_not_broadcast():
    with pytest.raises(ValueError, match=r"q and noise_multiplier must be broadcastable .* \(2,\) and \(3,\)"):
        compute_rdp([0.1, 0.2], [1.0, 2.0, 3.0], 10)


def test_orders_given_to_the_pld_accountant_are_refused_not_ignored():
    with pytest.raises(ValueError, match="orders are RDP orders: accountant='pld' uses none"):
        get_noise_multiplier(1.0, DELTA, 0.01, 10, accountant="pld", orders=[0.5])
    with pytest.raises(ValueError, match="accountant must be one of"):
        get_noise_multiplier(1.0, DELTA, 0.01, 10, accountant="RDP")


@pytest.mark.parametrize("value, error", [(None, TypeError), (True, TypeError), ("1.0", TypeError),
                                          (0.0, ValueError), (np.inf, ValueError)])
def test_noise_multipliers_given_as_none_bools_or_text_are_type_errors(value, error):
    with pytest.raises(error, match="noise_multiplier must be a"):
        get_sample_rate(1.0, DELTA, value, 100)
    setting = dict(delta=DELTA, local_steps=5, rounds=10, client_rate=0.5)
    with pytest.raises(error, match="noise_multiplier must be a"):
        rpdp.epsilon(0.1, noise_multiplier=value, **setting)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(q=True), TypeError, "q must be numbers"),
    (dict(q="0.1"), TypeError, "q must be numbers"),
    (dict(client_rate=None), TypeError, "client_rate must be a number"),
    (dict(client_rate=True), TypeError, "client_rate must be a number"),
    (dict(client_rate="0.5"), TypeError, "client_rate must be a number"),
])
def test_rpdp_epsilon_refuses_rates_given_as_bools_or_text(kwargs, error, match):
    args = dict(q=0.1, noise_multiplier=1.0, delta=DELTA, local_steps=5, rounds=10, client_rate=0.5) | kwargs
    q = args.pop("q")
    with pytest.raises(error, match=match):
        rpdp.epsilon(q, **args)


def test_rpdp_epsilon_of_no_rates_is_empty():
    out = rpdp.epsilon(np.array([]), noise_multiplier=1.0, delta=DELTA, local_steps=5, rounds=10, client_rate=0.5)
    assert isinstance(out, np.ndarray) and out.shape == (0,)


@pytest.mark.parametrize("grid_size", [0, 2, -3, 2.5, "x"])
def test_fit_scf_needs_a_grid_of_at_least_three_points(grid_size):
    with pytest.raises(ValueError, match="grid_size must be an int ≥ 3"):
        rpdp.fit_scf(noise_multiplier=1.0, delta=DELTA, local_steps=5, rounds=10, client_rate=0.5,
                     grid_size=grid_size)


def test_sample_rates_refuse_an_estimator_that_is_not_one():
    with pytest.raises(TypeError, match="estimator must be an SCFEstimator"):
        rpdp.sample_rates([5.0], noise_multiplier=1.0, delta=DELTA, local_steps=5, rounds=10, client_rate=0.5,
                          estimator="x")


# ---------------------------------------------------------------------------------------------- ledgers
def test_an_infinite_order_is_accounted_not_a_crash():
    """as_orders allows α = inf (ρ = inf there, never the optimum); step() failed inside the quadrature."""
    q, z = np.array([0.1, 0.2, 0.3]), np.array([1.0, 1.0, 2.0])
    with_inf = IndividualAccountant(q, z, orders=[2.0, 8.0, np.inf]).step(3)
    without = IndividualAccountant(q, z, orders=[2.0, 8.0]).step(3)
    np.testing.assert_array_equal(with_inf.epsilons(DELTA), without.epsilons(DELTA))
    assert np.isinf(with_inf.group_rdp[:, 2]).all()


@pytest.mark.parametrize("record_orders, error, match", [
    ([2.0, 3.0], ValueError, r"record_orders must be a number or one order per record \(3\), got shape \(2,\)"),
    ("x", TypeError, "record_orders must be numbers"),
    (True, TypeError, "record_orders must be numbers"),
])
def test_record_orders_of_another_length_or_kind_are_refused(record_orders, error, match):
    with pytest.raises(error, match=match):
        IndividualAccountant([0.1, 0.2, 0.3], 1.0, record_orders=record_orders)


def test_two_dimensional_record_ids_are_refused_and_the_ledger_is_unchanged():
    ledger = IndividualAccountant([0.1, 0.2, 0.3], 1.0).step(2)
    before = ledger.epsilons(DELTA)
    with pytest.raises(ValueError, match="record_ids must be one id or a 1-D sequence of ids"):
        ledger.step(record_ids=[[0, 1]])
    with pytest.raises(ValueError, match="sample_rates must be a scalar or one value per entry of record_ids"):
        ledger.step(record_ids=[0, 1], sample_rates=[[0.1], [0.2]])
    assert ledger.steps_taken == 2
    np.testing.assert_array_equal(ledger.epsilons(DELTA), before)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(noise_multipliers=np.inf), ValueError, "noise_multipliers must be finite for the PLD ledger"),
    (dict(value_discretization_interval=True), TypeError, "value_discretization_interval must be a number"),
    (dict(value_discretization_interval="0.001"), TypeError, "value_discretization_interval must be a number"),
    (dict(value_discretization_interval=0.0), ValueError, "value_discretization_interval must be a finite number"),
    (dict(max_pairs=np.nan), ValueError, "max_pairs must be an int ≥ 1"),
    (dict(max_pairs=1.5), ValueError, "max_pairs must be an int ≥ 1"),
    (dict(max_pairs=True), ValueError, "max_pairs must be an int ≥ 1"),
    (dict(max_pairs="2"), ValueError, "max_pairs must be an int ≥ 1"),
])
def test_pld_ledger_options_are_checked_when_it_is_built(kwargs, error, match):
    args = dict(sample_rates=[0.1, 0.2], noise_multipliers=1.0) | kwargs
    with pytest.raises(error, match=match):
        PLDIndividualAccountant(**args)


def test_a_pld_discretization_too_coarse_is_named_not_an_overflow():
    ledger = PLDIndividualAccountant(0.1, 1.0, value_discretization_interval=1e6).step(10)
    with pytest.raises(ValueError, match="value_discretization_interval=1e\\+06 is too coarse"):
        ledger.epsilons(DELTA)


@pytest.mark.parametrize("plan", [None, "rdp", {}], ids=["None", "str", "dict"])
def test_ledger_for_something_that_is_not_a_plan_is_a_type_error(plan):
    with pytest.raises(TypeError, match="plan must be a PrivacyPlan"):
        ledger_for_plan(plan)


def test_a_real_plan_still_gets_its_ledger():
    plan = calibrate(np.repeat([1.0, 2.0], 5), delta=DELTA, steps=10, sample_rate=0.1)
    ledger = ledger_for_plan(plan).step(10)
    assert (ledger.epsilons(DELTA) <= plan.budgets * (1 + 1e-9)).all() and not math.isnan(ledger.epsilons(DELTA)[0])
