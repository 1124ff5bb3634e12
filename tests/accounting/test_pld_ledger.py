"""The PLD ledger: the per-record ledger for plans certified by privacy loss distributions."""
import numpy as np
import pytest

from pdpfast.accounting import (
    IndividualAccountant,
    PLDIndividualAccountant,
    PrivacyPlan,
    calibrate,
    ledger_for_plan,
    pld,
)

DELTA = 1e-5


def _independent_pld_epsilon(q, z, steps, delta, value_discretization_interval):
    """dp_accounting used directly, without pdpfast: T self-compositions of the Poisson-subsampled
    Gaussian, pessimistic (the library default) discretization."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    accountant = PLDAccountant(value_discretization_interval=value_discretization_interval)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    return accountant.get_epsilon(delta)


@pytest.fixture(scope="module")
def plan():
    budgets = np.repeat([1.0, 2.0, 3.0], [50, 30, 20])
    return calibrate(budgets, delta=DELTA, steps=40, sample_rate=0.05, accountant="pld")


def test_ledger_epsilon_equals_an_independent_dp_accounting_computation(plan):
    ledger = PLDIndividualAccountant(plan.sample_rates, plan.noise_multipliers, budgets=plan.budgets)
    ledger.step(17)
    eps = ledger.epsilons(DELTA)
    for g in plan.groups:
        i = int(np.flatnonzero(plan.budgets == g.epsilon)[0])
        expected = _independent_pld_epsilon(g.sample_rate, g.noise_multiplier, 17, DELTA,
                                             pld.VALUE_DISCRETIZATION)
        assert eps[i] == pytest.approx(expected, rel=1e-9)
        # and the coarser grid we use is on the safe side of the library's default, yet close to it
        fine = _independent_pld_epsilon(g.sample_rate, g.noise_multiplier, 17, DELTA, 1e-4)
        assert fine <= eps[i] <= fine * 1.01


def test_ledger_spends_within_budgets_over_the_whole_plan(plan):
    ledger = ledger_for_plan(plan)
    assert isinstance(ledger, PLDIndividualAccountant) and ledger.name == "pld"
    np.testing.assert_array_equal(ledger.epsilons(DELTA), 0.0)
    for _ in range(plan.steps):
        assert not ledger.would_exceed(DELTA, 1).any()
        ledger.step()
    eps = ledger.epsilons(DELTA)
    assert np.all(eps <= plan.budgets) and np.all(eps >= 0.98 * plan.budgets)
    np.testing.assert_allclose(eps, plan.epsilons(), rtol=1e-9)
    assert ledger.would_exceed(DELTA, 1).all()
    np.testing.assert_array_equal(ledger.remaining(DELTA), plan.budgets - eps)


def test_training_loop_does_not_recompute_pld_every_step(plan, monkeypatch):
    calls = []
    real = pld.pld_epsilon

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(pld, "pld_epsilon", counting)
    ledger = ledger_for_plan(plan)
    for _ in range(plan.steps):
        ledger.would_exceed(DELTA, 1)
        ledger.step()
    # one probe of each group at the plan's horizon covers every step before it
    assert len(calls) == len(plan.groups)


def test_would_exceed_without_a_horizon_is_exact():
    ledger = PLDIndividualAccountant([0.1, 0.1], 1.0, budgets=[3.0, 50.0])
    limit = next(t for t in range(1, 200) if pld.pld_epsilon(0.1, 1.0, t, DELTA) > 3.0)   # 13 steps
    ledger.step(limit - 2)
    assert not ledger.would_exceed(DELTA, 1).any()
    assert ledger.would_exceed(DELTA, 2).tolist() == [True, False]
    ledger.step(1)
    assert ledger.would_exceed(DELTA, 1).tolist() == [True, False]


def test_records_sharing_q_and_z_but_not_budgets_are_judged_by_their_own_budget():
    ledger = PLDIndividualAccountant([1.0, 1.0, 0.2], [4.0, 4.0, 1.0], budgets=[3.0, 100.0, 100.0], horizon=5)
    ledger.step(4)
    eps = ledger.epsilons(DELTA)
    assert eps[0] == eps[1] and eps[0] < 3.0 < pld.pld_epsilon(1.0, 4.0, 50, DELTA)
    over = ledger.would_exceed(DELTA, 46)
    assert over.tolist() == [True, False, False]


def test_state_dict_round_trip_continues_exactly(plan, tmp_path):
    ledger = ledger_for_plan(plan)
    ledger.step(9)
    path = tmp_path / "ledger.npz"
    ledger.save(path)
    again = PLDIndividualAccountant.load(path)
    assert again.steps_taken == 9 and again.horizon == plan.steps
    np.testing.assert_array_equal(again.epsilons(DELTA), ledger.epsilons(DELTA))
    np.testing.assert_array_equal(again.budgets, ledger.budgets)
    again.step(3)
    ledger.step(3)
    np.testing.assert_array_equal(again.epsilons(DELTA), ledger.epsilons(DELTA))


def test_a_ledger_state_of_another_accountant_is_refused(plan):
    rdp = IndividualAccountant(plan.sample_rates, plan.noise_multipliers, budgets=plan.budgets).step(2)
    with pytest.raises(ValueError, match="accountant='rdp'"):
        ledger_for_plan(plan).load_state_dict(rdp.state_dict())
    with pytest.raises(ValueError, match="accountant='pld'"):
        rdp.load_state_dict(ledger_for_plan(plan).state_dict())


def test_rdp_plans_get_the_rdp_ledger():
    plan = calibrate(np.repeat([1.0, 2.0], 10), delta=DELTA, steps=10, sample_rate=0.1)
    ledger = ledger_for_plan(plan)
    assert isinstance(ledger, IndividualAccountant) and ledger.name == "rdp"
    np.testing.assert_array_equal(ledger.budgets, plan.budgets)


def test_what_the_pld_ledger_cannot_do_is_refused_clearly():
    with pytest.raises(ValueError, match="at most"):
        PLDIndividualAccountant(np.linspace(0.01, 0.5, 100), 1.0)
    ledger = PLDIndividualAccountant([0.1, 0.2], 1.0)
    with pytest.raises(ValueError, match="budgets"):
        ledger.would_exceed(DELTA)
    with pytest.raises(NotImplementedError, match="IndividualAccountant"):
        ledger.step(1, record_ids=[0])
    with pytest.raises(ValueError, match="sample_rates"):
        PLDIndividualAccountant([1.5], 1.0)
    with pytest.raises(ValueError, match="n must"):
        ledger.step(0)


def test_pld_noise_search_stops_at_the_floor_when_delta_covers_every_noise_multiplier():
    # δ = 2e-4 ≥ 1 − (1 − q)^T = 1.22e-4: ε is 0 whatever z, and the search used to walk down to
    # z = 0.01 (78 s of PLDs); it now stops at the calibration floor z = 0.05
    z, eps = pld.pld_noise_multiplier_from(0.1286, 2e-4, 1.22e-4, 1, start=3.0)
    assert (z, eps) == (0.05, 0.0)
    plan = calibrate(np.array([0.1286] * 22 + [3.713] * 4), delta=2e-4, steps=1, sample_rate=1.22e-4,
                     method="scale", accountant="pld")
    np.testing.assert_array_equal(plan.group_noise_multipliers, [0.05, 0.05])
    assert np.all(plan.epsilons() <= plan.budgets)
    again = PrivacyPlan.from_json(plan.to_json())          # accounted again from σ, q, c, steps
    np.testing.assert_array_equal(again.epsilons(), plan.epsilons())
