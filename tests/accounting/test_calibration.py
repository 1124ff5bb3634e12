"""Calibration: every plan is re-accounted independently (Opacus) and must meet the guarantees."""
import json
import time
import warnings

import numpy as np
import pytest
from opacus.accountants.analysis import rdp as opacus_rdp

from pdpfast.accounting import DEFAULT_ORDERS, GroupSummary, PrivacyPlan, calibrate

DELTA = 1e-5
METHODS = ["sample", "scale", "hybrid"]


def reaccount(q, z, steps, delta=DELTA, own_order=None):
    """Independent exact accounting of one record: Opacus's RDP and conversion, same orders (the
    grid and the record's own order, which the plan found off the grid)."""
    orders = list(DEFAULT_ORDERS) + ([] if own_order is None else [float(own_order)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rdp = opacus_rdp.compute_rdp(q=float(q), noise_multiplier=float(z), steps=steps, orders=orders)
        return opacus_rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=delta)[0]


def reaccount_plan(plan, budgets, rng, k=12):
    """(budget, ε, q) for the group of each of up to k records (smallest and largest budgets included)."""
    picks = np.unique(np.r_[np.argmin(budgets), np.argmax(budgets), rng.choice(budgets.size, k, replace=False)])
    z = plan.noise_multiplier * plan.max_grad_norm / plan.clip_norms
    own = plan.group_orders[plan.group_index]
    return [(budgets[i], reaccount(plan.sample_rates[i], z[i], plan.steps, plan.delta, own[i]), plan.sample_rates[i])
            for i in picks]


def budget_sets():
    rng = np.random.default_rng(2024)
    return {
        "three_groups": np.repeat([1.0, 2.0, 3.0], [5000, 3000, 2000]),
        "uniform_distinct": rng.uniform(1.0, 10.0, 3000),
        "lognormal_distinct": np.exp(rng.normal(np.log(2.0), 0.6, 6000)),   # > 4096 distinct: grid path
    }


BUDGETS = budget_sets()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_no_record_exceeds_its_budget(method, name):
    budgets = BUDGETS[name]
    plan = calibrate(budgets, delta=DELTA, steps=500, sample_rate=0.02, method=method)
    assert np.all(plan.epsilons() <= budgets)
    for budget, eps, _ in reaccount_plan(plan, budgets, np.random.default_rng(0)):
        assert eps <= budget


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_no_record_wastes_more_than_one_percent(method, name):
    budgets = BUDGETS[name]
    plan = calibrate(budgets, delta=DELTA, steps=500, sample_rate=0.02, method=method)
    full = plan.sample_rates >= 1.0
    assert np.all((plan.epsilons() >= 0.99 * budgets) | full)
    for budget, eps, q in reaccount_plan(plan, budgets, np.random.default_rng(1)):
        assert eps >= 0.99 * budget or q >= 1.0


@pytest.mark.parametrize("method", ["sample", "hybrid"])
def test_mean_sample_rate_equals_target(method):
    budgets = np.random.default_rng(3).uniform(0.5, 8.0, 5000)
    plan = calibrate(budgets, delta=DELTA, steps=300, sample_rate=0.01, method=method)
    assert plan.sample_rates.mean() == pytest.approx(0.01, rel=1e-9)
    assert plan.expected_batch_size == pytest.approx(50.0, rel=1e-9)


@pytest.mark.parametrize("method", ["scale", "hybrid"])
def test_mean_clip_norm_equals_max_grad_norm(method):
    budgets = np.random.default_rng(4).uniform(0.5, 8.0, 5000)
    plan = calibrate(budgets, delta=DELTA, steps=300, sample_rate=0.01, method=method, max_grad_norm=2.5)
    assert plan.clip_norms.mean() == pytest.approx(2.5, rel=1e-9)
    z = plan.noise_multiplier * 2.5 / plan.clip_norms
    np.testing.assert_allclose(z, plan.noise_multipliers, rtol=1e-12)


def test_sample_keeps_the_reference_clip_and_scale_the_rate():
    budgets = np.repeat([1.0, 4.0], [100, 100])
    sample = calibrate(budgets, delta=DELTA, steps=200, sample_rate=0.05, method="sample", max_grad_norm=0.7)
    scale = calibrate(budgets, delta=DELTA, steps=200, sample_rate=0.05, method="scale", max_grad_norm=0.7)
    np.testing.assert_array_equal(sample.clip_norms, 0.7)
    np.testing.assert_array_equal(scale.sample_rates, 0.05)
    # larger budgets: higher rate (Sample), larger clip bound (Scale)
    assert sample.groups[1].sample_rate > sample.groups[0].sample_rate
    assert scale.groups[1].clip_norm > scale.groups[0].clip_norm


def test_hybrid_endpoints_are_scale_and_sample():
    budgets = np.repeat([1.0, 2.0, 5.0], [300, 300, 400])
    kw = dict(delta=DELTA, steps=400, sample_rate=0.02)
    sample, scale = calibrate(budgets, method="sample", **kw), calibrate(budgets, method="scale", **kw)
    h1 = calibrate(budgets, method="hybrid", hybrid_weight=1.0, **kw)
    h0 = calibrate(budgets, method="hybrid", hybrid_weight=0.0, **kw)
    np.testing.assert_allclose(h1.group_sample_rates, sample.group_sample_rates, rtol=1e-12)
    # λ = 1 re-solves each group's z at Sample's rates: Sample's σ, up to the slack Sample left
    assert np.all(h1.group_noise_multipliers <= sample.noise_multiplier)
    np.testing.assert_allclose(h1.group_noise_multipliers, sample.noise_multiplier, rtol=3e-3)
    np.testing.assert_allclose(h0.group_sample_rates, 0.02, rtol=1e-12)
    np.testing.assert_allclose(h0.group_noise_multipliers, scale.group_noise_multipliers, rtol=1e-6)
    hm = calibrate(budgets, method="hybrid", hybrid_weight=0.5, **kw)
    r = hm.group_sample_rates
    assert np.all((r >= np.minimum(0.02, sample.group_sample_rates) * (1 - 1e-9))
                  & (r <= np.maximum(0.02, sample.group_sample_rates) * (1 + 1e-9)))


def test_sample_rates_may_reach_one():
    budgets = np.r_[np.full(900, 1.0), np.full(100, 200.0)]
    plan = calibrate(budgets, delta=DELTA, steps=100, sample_rate=0.2, method="sample")
    assert plan.groups[1].sample_rate == 1.0
    assert plan.sample_rates.mean() == pytest.approx(0.2, rel=1e-9)
    assert plan.groups[0].guaranteed_epsilon >= 0.99


def test_groups_are_one_frozen_row_per_distinct_budget():
    budgets = np.array([3.0, 1.0, 3.0, 2.0, 1.0, 3.0])
    plan = calibrate(budgets, delta=DELTA, steps=100, sample_rate=0.1, method="scale")
    assert [g.epsilon for g in plan.groups] == [1.0, 2.0, 3.0]
    assert [g.size for g in plan.groups] == [2, 1, 3]
    g = plan.groups[2]
    assert isinstance(g, GroupSummary)
    with pytest.raises(AttributeError):
        g.size = 7
    np.testing.assert_array_equal(plan.clip_norms[budgets == 3.0], g.clip_norm)
    assert g.noise_multiplier == pytest.approx(plan.noise_multiplier * plan.max_grad_norm / g.clip_norm)
    assert g.guaranteed_epsilon <= 3.0
    assert plan.sample_rates.dtype == plan.clip_norms.dtype == np.float64


def test_plan_round_trips_through_json():
    budgets = np.random.default_rng(5).choice([0.5, 1.0, 8.0], 777)
    plan = calibrate(budgets, delta=DELTA, steps=250, sample_rate=0.03, method="hybrid", hybrid_weight=0.3)
    again = PrivacyPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    for name in ("sample_rates", "clip_norms", "budgets"):
        np.testing.assert_array_equal(getattr(again, name), getattr(plan, name))
    np.testing.assert_array_equal(again.epsilons(), plan.epsilons())
    assert (again.method, again.noise_multiplier, again.steps, again.delta) == (
        plan.method, plan.noise_multiplier, plan.steps, plan.delta)
    assert again.groups == plan.groups


def test_summary_is_a_printable_table():
    plan = calibrate(np.random.default_rng(6).uniform(1, 5, 500), delta=DELTA, steps=100, sample_rate=0.05)
    text = plan.summary()
    assert "noise multiplier" in text and "guaranteed_eps" in text and "..." in text
    assert len(text.splitlines()) <= 30


@pytest.mark.parametrize("max_rows,shown", [(1, [0]), (2, [0, -1]), (3, [0, 1, -1]), (4, [0, 1, -2, -1])])
def test_summary_shows_the_first_and_last_groups_around_the_elision(max_rows, shown):
    plan = calibrate(np.repeat([1.0, 2.0, 3.0, 4.0, 5.0], 20), delta=DELTA, steps=100, sample_rate=0.05)
    rows = plan.summary(max_rows=max_rows).splitlines()[4:]
    values = [float(r.split()[0]) for r in rows if not r.strip().startswith("...")]
    assert values == [plan.budget_values[i] for i in shown] and len(rows) == max_rows + 1


@pytest.mark.parametrize("max_rows", [0, -1, 2.5, True])
def test_a_summary_of_no_rows_is_refused(max_rows):
    plan = calibrate(np.repeat([1.0, 2.0], 5), delta=DELTA, steps=10, sample_rate=0.5)
    with pytest.raises(ValueError, match="max_rows must be an int ≥ 1"):
        plan.summary(max_rows=max_rows)


def test_accepts_torch_tensors():
    torch = pytest.importorskip("torch")
    plan = calibrate(torch.tensor([1.0, 2.0, 2.0]), delta=DELTA, steps=50, sample_rate=0.1, method="scale")
    assert plan.num_records == 3


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(budgets=[1.0, -1.0]), ValueError, "budgets"),
    (dict(budgets=[1.0, np.nan]), ValueError, "budgets"),
    (dict(budgets=[1.0, np.inf]), ValueError, "budgets"),
    (dict(budgets=[]), ValueError, "budgets"),
    (dict(budgets=None), TypeError, "budgets"),
    (dict(budgets=[[1.0, 2.0]]), ValueError, "budgets"),
    (dict(delta=0.0), ValueError, "delta"),
    (dict(delta=1.0), ValueError, "delta"),
    (dict(delta="x"), TypeError, "delta"),
    (dict(steps=0), ValueError, "steps"),
    (dict(steps=10.5), ValueError, "steps"),
    (dict(sample_rate=0.0), ValueError, "sample_rate"),
    (dict(sample_rate=1.5), ValueError, "sample_rate"),
    (dict(hybrid_weight=1.5), ValueError, "hybrid_weight"),
    (dict(hybrid_weight=-0.1), ValueError, "hybrid_weight"),
    (dict(method="uniform"), ValueError, "method"),
    (dict(accountant="gdp"), ValueError, "accountant"),
    (dict(max_grad_norm=0.0), ValueError, "max_grad_norm"),
])
def test_bad_input_raises_naming_the_argument(kwargs, exc, match):
    args = dict(budgets=[1.0, 2.0], delta=DELTA, steps=10, sample_rate=0.1)
    args.update(kwargs)
    budgets = args.pop("budgets")
    with pytest.raises(exc, match=match):
        calibrate(budgets, **args)


@pytest.mark.parametrize("method", METHODS)
def test_unmeetable_budget_is_refused_naming_it(method):
    # ε = 0.001 at δ = 1e-5 is below what any RDP order up to 512 can certify
    with pytest.raises(ValueError, match=r"budget epsilon=0\.001"):
        calibrate([0.001, 1.0], delta=DELTA, steps=100, sample_rate=0.01, method=method)


def test_sample_refuses_a_budget_needing_a_rate_below_the_floor():
    # mean 0.1 forces σ so low (for the ε = 50 record) that ε = 0.009 would need q < 1e-12
    with pytest.raises(ValueError, match=r"budget epsilon=0\.009 .*sample rate below"):
        calibrate([0.009, 50.0], delta=DELTA, steps=1000, sample_rate=0.1, method="sample")


@pytest.mark.parametrize("method", ["sample", "hybrid"])
def test_sample_refuses_budgets_too_far_apart_naming_the_spread_not_a_solver_error(method):
    # the ε = 10⁶ record sits at rate 1 wherever ε = 1 has a rate ≥ 1e-12, so the mean rate of the
    # two is ≥ 0.5 against q = 0.1: no plan exists (this used to end in scipy's "f(a) and f(b)
    # must have different signs" after minutes)
    with pytest.raises(ValueError, match=r"budget epsilon=1 cannot be met by IDP-Sample: the budgets are spread too "
                                         r"far \(1 to 1e\+06\).*mean rate is already 0\.5.*use method 'scale'"):
        calibrate([1e6, 1.0], delta=DELTA, steps=100, sample_rate=0.1, method=method)
    with pytest.warns(UserWarning, match="edge of the order grid"):     # ε = 10⁶ needs an order below 1.1
        plan = calibrate([1e6, 1.0], delta=DELTA, steps=100, sample_rate=0.1, method="scale")    # the advice works
    assert (plan.epsilons() <= [1e6, 1.0]).all()


def test_sample_refuses_at_once_when_the_records_at_rate_one_fill_the_mean_and_a_larger_rate_works():
    # half the records (ε = 1000) sit at rate 1 down to a σ where ε = 1 needs a rate below the floor,
    # so their rate alone fills q = 0.5: no plan exists (the search used to probe for minutes)
    budgets = np.array([1000.0, 1.0] * 5)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"budget epsilon=1 cannot be met by IDP-Sample: the budgets are spread too "
                                         r"far.*budgets ≥ 1000 sit at rate 1.*alone fill the mean rate.*use method "
                                         r"'scale'.*or a larger sample rate"):
        calibrate(budgets, delta=DELTA, steps=5, sample_rate=0.5, method="sample")
    assert time.perf_counter() - start < 30
    budgets = np.array([100.0, 1.0] * 5)
    with pytest.raises(ValueError, match=r"spread too far.*or a larger sample rate"):
        calibrate(budgets, delta=DELTA, steps=5, sample_rate=0.5, method="sample")
    plan = calibrate(budgets, delta=DELTA, steps=5, sample_rate=0.55, method="sample")  # the advice works
    assert plan.sample_rates.mean() == pytest.approx(0.55, rel=1e-9) and np.all(plan.epsilons() <= budgets)


@pytest.mark.parametrize("budgets,sample_rate,steps", [([1000.0, 1.0], 0.6, 100), ([30.0, 1.0], 0.5, 1000)])
def test_sample_finds_the_plan_of_budgets_far_apart_where_one_exists(budgets, sample_rate, steps):
    # the ε = 1000 records sit at rate 1 and fill 0.5 of the mean; ε = 1 gets the rest (0.2) at
    # σ ≈ 8, far above where the search starts: its fallback stepped σ by 1% from below and ran
    # out of probes after minutes, refusing a plan that exists
    budgets = np.array(budgets * 5)
    plan = calibrate(budgets, delta=DELTA, steps=steps, sample_rate=sample_rate, method="sample")
    assert plan.sample_rates.mean() == pytest.approx(sample_rate, rel=1e-9)
    assert np.all(plan.epsilons() <= budgets) and plan.group_epsilons[0] >= 0.998


@pytest.mark.parametrize("method", ["sample", "scale"])
def test_a_hybrid_weight_given_with_sample_or_scale_is_refused_not_ignored(method):
    with pytest.raises(ValueError, match=f"hybrid_weight is for method='hybrid'.*method='{method}'"):
        calibrate([1.0, 2.0], delta=DELTA, steps=10, sample_rate=0.5, method=method, hybrid_weight=0.5)
    kw = dict(delta=DELTA, steps=50, sample_rate=0.1)
    assert (calibrate([1.0, 2.0], method="hybrid", **kw).to_dict()
            == calibrate([1.0, 2.0], method="hybrid", hybrid_weight=0.5, **kw).to_dict())   # None means 0.5


def test_sample_uncaps_large_budgets_to_meet_the_mean():
    # half the records could take q = 1 but the mean is 0.5: they end just below 1, budget used
    budgets = np.r_[np.full(10, 0.5), np.full(10, 50.0)]
    plan = calibrate(budgets, delta=DELTA, steps=1000, sample_rate=0.5, method="sample")
    assert plan.sample_rates.mean() == pytest.approx(0.5, rel=1e-9)
    assert np.all(plan.epsilons() <= budgets) and np.all(plan.epsilons() >= 0.99 * budgets)


def test_one_budget_gives_uniform_rates_for_every_method():
    for method in METHODS:
        plan = calibrate(np.full(10, 2.0), delta=DELTA, steps=100, sample_rate=0.05, method=method)
        np.testing.assert_allclose(plan.sample_rates, 0.05, rtol=1e-12)
        np.testing.assert_allclose(plan.clip_norms, 1.0, rtol=1e-12)
        assert 0.99 * 2.0 <= plan.epsilons()[0] <= 2.0


@pytest.mark.parametrize("method", METHODS)
def test_calibrates_100k_distinct_budgets_quickly(method):
    budgets = np.random.default_rng(7).uniform(1.0, 10.0, 100_000)
    t0 = time.perf_counter()
    plan = calibrate(budgets, delta=DELTA, steps=1000, sample_rate=0.01, method=method)
    assert time.perf_counter() - t0 < 10.0
    assert np.all(plan.epsilons() <= budgets)


# ---------------------------------------------------------------------------- PLD accountant
@pytest.fixture(scope="module")
def pld_plans():
    budgets = np.repeat([1.0, 3.0], [60, 40])
    kw = dict(delta=DELTA, steps=30, sample_rate=0.05)
    return budgets, {m: calibrate(budgets, method=m, accountant="pld", **kw) for m in METHODS}


@pytest.mark.parametrize("method", METHODS)
def test_pld_plan_meets_budgets_and_beats_rdp_on_the_same_plan(pld_plans, method):
    from pdpfast.accounting import pld

    budgets, plans = pld_plans
    plan = plans[method]
    assert plan.accountant == "pld"
    eps_pld = pld.epsilons(plan.sample_rates, plan.noise_multipliers, plan.steps, plan.delta)
    assert np.all(eps_pld <= budgets) and np.all(eps_pld >= 0.99 * budgets)
    for g in plan.groups:
        rdp_eps = reaccount(g.sample_rate, g.noise_multiplier, plan.steps)
        assert g.guaranteed_epsilon <= rdp_eps
    rdp_plan = calibrate(budgets, method=method, delta=DELTA, steps=30, sample_rate=0.05)
    assert plan.noise_multiplier < rdp_plan.noise_multiplier      # tighter accounting, less noise


def test_pld_serves_any_number_of_distinct_budgets_from_classes_below_them():
    """1000 distinct budgets: PLD classes, each budget served by the largest class value below it;
    every record's PLD ε ≤ its own budget, and the engine's PLD ledger accepts the plan."""
    from pdpfast.accounting import ledger_for_plan, pld

    budgets = np.random.default_rng(0).uniform(2.0, 2.04, 1000)
    plan = calibrate(budgets, delta=DELTA, steps=20, sample_rate=0.05, method="scale", accountant="pld")
    assert plan.accountant == "pld" and len(plan.budget_values) <= 5  # a 2% span: a few 0.5% classes
    eps = pld.epsilons(plan.sample_rates, plan.noise_multipliers, plan.steps, plan.delta)
    assert np.all(eps <= budgets) and np.all(eps >= 0.99 * (1 - 0.005) * budgets)
    assert np.all(ledger_for_plan(plan, budgets).epsilons(DELTA) <= budgets)


def test_budget_classes_lose_at_most_the_target_or_say_so():
    from pdpfast.accounting.calibration.pld import bin_budgets_down

    values = np.sort(np.random.default_rng(1).uniform(0.5, 8.0, 10_000))
    classes, class_of, loss = bin_budgets_down(values, max_classes=10_000)
    assert loss <= 0.005 and np.all(classes[class_of] <= values) and classes[0] == values[0]
    classes, class_of, loss = bin_budgets_down(values, max_classes=64)
    assert len(classes) <= 64 and np.all(classes[class_of] <= values) and 0.005 < loss < 0.05
    with pytest.warns(UserWarning, match="pld_classes"):
        calibrate(np.linspace(1, 3, 100), delta=DELTA, steps=20, sample_rate=0.05, method="scale",
                  accountant="pld", pld_classes=2)


def test_optimum_at_the_edge_of_the_order_grid_is_reported():
    with pytest.warns(UserWarning, match="edge of the order grid"):
        plan = calibrate([0.01, 1.0], delta=DELTA, steps=100, sample_rate=0.01, method="scale")
    assert plan.at_order_edge.tolist() == [True, False]
    assert plan.group_orders[0] == DEFAULT_ORDERS[-1]
    assert np.all(plan.epsilons() <= [0.01, 1.0])


@pytest.mark.parametrize("method", METHODS)
def test_extreme_settings_keep_the_guarantees(method):
    # δ = 1e-3 makes the conversion negative at tiny rates; T = 10, q = 0.5 is far from the usual regime
    budgets = np.random.default_rng(8).uniform(0.5, 10.0, 5000)
    plan = calibrate(budgets, delta=1e-3, steps=10, sample_rate=0.5, method=method)
    used = plan.epsilons() / budgets
    assert np.all(used <= 1.0) and np.all((used >= 0.99) | (plan.sample_rates >= 1.0))
    for budget, eps, _q in reaccount_plan(plan, budgets, np.random.default_rng(2), k=4):
        assert eps <= budget


def test_sample_finds_a_plan_that_exists_when_budgets_are_far_apart():
    """Budgets 0.01 and 100 at q = 0.9: the plan (σ ≈ 3168, rates 0.8 and 1) exists, though on the
    way to it the search probes noise levels where ε = 0.01 has no rate at all; it must not refuse."""
    budgets = np.array([0.01] * 5 + [100.0] * 5)
    plan = calibrate(budgets, delta=1e-5, steps=100, sample_rate=0.9, method="sample")
    assert plan.sample_rates.mean() == pytest.approx(0.9, rel=1e-9)
    assert (plan.epsilons() <= budgets).all()
    assert plan.epsilons()[:5].min() >= 0.99 * 0.01


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_scale_sampling_does_not_reveal_budgets(accountant):
    """IDP Scale: every record is drawn at the same rate whatever its budget (no budget leakage
    through sampling, Kaiser et al.); only the clip bounds differ. Sample's rates do depend on it."""
    budgets = np.random.default_rng(0).choice([0.5, 1.0, 2.0, 8.0], size=400)
    scale = calibrate(budgets, delta=1e-5, steps=200, sample_rate=0.05, method="scale", accountant=accountant)
    assert np.all(scale.sample_rates == scale.sample_rates[0])
    assert len(np.unique(scale.clip_norms)) == 4
    sample = calibrate(budgets, delta=1e-5, steps=200, sample_rate=0.05, method="sample", accountant=accountant)
    assert len(np.unique(sample.sample_rates)) == 4


def test_a_plan_whose_records_would_almost_surely_never_be_drawn_warns_naming_them():
    # IDP-Sample meets ε = 0.3 beside ε = 3 by a rate near 1e-4: private, but over 100 steps those
    # records are drawn at all in under 1% of trainings, which a user should be told
    budgets = np.r_[np.full(10, 0.3), np.full(990, 3.0)]
    with pytest.warns(UserWarning, match=r"10 record\(s\) in 1 budget group\(s\) are drawn at all with probability "
                                         r"below 1% in 100 steps \(epsilon=0\.3: sample rate .*almost surely not "
                                         r"train the model"):
        plan = calibrate(budgets, delta=DELTA, steps=100, sample_rate=0.05, method="sample")
    q = plan.group_sample_rates
    assert 1 - (1 - q[0]) ** 100 < 0.01 <= 1 - (1 - q[1]) ** 100
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # a short run (each record drawn about once) or ε = 0.5 beside ε = 3 (drawn with probability ~0.2): no warning
        calibrate(budgets, delta=DELTA, steps=20, sample_rate=0.05, method="scale")
        calibrate(np.r_[np.full(10, 0.5), np.full(990, 3.0)], delta=DELTA, steps=100, sample_rate=0.05,
                  method="sample")


class _TooManyEvaluations(AssertionError):
    pass


def test_sample_calibration_with_budgets_three_orders_apart_finishes_in_seconds(monkeypatch):
    """{1000, 1} at q = 0.6 in one step: the plan (σ ≈ 1.83, rates 1 and 0.2) exists. The search's
    surrogate extrapolated ε = 1 far below its curve (at σ = 0.05 no rate ≥ 1e-12 meets it) to a rate
    near 1, so its bracket walked down below the noise floor, where each ε curve costs quadrature at
    1/z² nodes: 160 curves, 43 s. Counted, not timed: a budget of curves (each ≤ ~0.3 s) fails fast."""
    from pdpfast.accounting import _grid

    calls, real = [0], _grid.eps_curve

    def counted(*args, **kwargs):
        calls[0] += 1
        if calls[0] > 40:
            raise _TooManyEvaluations("more than 40 ε curves for one Sample calibration")
        return real(*args, **kwargs)

    monkeypatch.setattr(_grid, "eps_curve", counted)
    budgets = np.repeat([1000.0, 1.0], 50)
    plan = calibrate(budgets, delta=DELTA, steps=1, sample_rate=0.6, method="sample")
    assert plan.sample_rates.mean() == pytest.approx(0.6, rel=1e-9)
    assert np.all(plan.epsilons() <= budgets)
    assert plan.group_epsilons[0] >= 0.998          # the ε = 1 group spends its budget
    assert plan.group_sample_rates[1] == 1.0


def test_sample_search_that_its_surrogate_cannot_bracket_ends_in_a_plan_not_a_scipy_error():
    """{0.01, 1, 1000} at q = 0.9, δ = 0.01, one step: the plan exists (σ ≈ 26, ε = 1 and 1000 at
    rate 1, ε = 0.01 at ≈ 0.67). ε is clamped at 0 over most of the surrogate's rate grid there, so
    the surrogate undershot from below at every probe (mean 0.877, 0.884, 0.888, ...) and then
    widened its bracket past σ_hi until scipy's brentq raised "f(a) and f(b) must have different
    signs" (and before the curve fix the search ran for minutes)."""
    budgets = np.repeat([0.01, 1.0, 1000.0], [30, 40, 30])
    plan = calibrate(budgets, delta=0.01, steps=1, sample_rate=0.9, method="sample")
    assert plan.sample_rates.mean() == pytest.approx(0.9, rel=1e-9)
    assert np.all(plan.epsilons() <= budgets)
    assert plan.group_epsilons[0] >= 0.998 * 0.01


def test_two_thousand_budgets_at_a_large_delta_calibrate_without_an_internal_error_or_numpy_warnings():
    """2,000 distinct budgets in [0.01, 1000] at δ = 0.01: a rate kept from the search was certified
    again at its order 6e-16 above budget·(1 − 1e-7), and the final check called that an internal
    error (the guarantee has 1e-7 to spare: it now allows 1e-12 of rounding). ε = 0 at the smallest
    rates sent numpy's "divide by zero in log" to the user."""
    budgets = np.geomspace(1e-2, 1e3, 2000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        plan = calibrate(budgets, delta=0.01, steps=1000, sample_rate=0.6, method="sample")
    assert plan.sample_rates.mean() == pytest.approx(0.6, rel=1e-9)
    assert np.all(plan.epsilons() <= budgets)
