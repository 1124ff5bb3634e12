"""A privacy plan read from a file is checked as one built in memory: a damaged or hand-edited plan
(a NaN σ, a rate above 1, a guaranteed ε above its budget, …) is refused before anything trains on
it or audits with it."""
import copy
import dataclasses

import numpy as np
import pytest

from pdpfast.accounting import PrivacyPlan, calibrate
from pdpfast.accounting.schedules import ScheduledPlan, TimeDecay, calibrate_scheduled

DELTA = 1e-5


@pytest.fixture(scope="module")
def plan_dict():
    return calibrate(np.repeat([1.0, 2.0, 4.0], [10, 6, 4]), delta=DELTA, steps=20, sample_rate=0.1).to_dict()


def _set(path, value):
    def damage(d):
        *outer, last = path
        for key in outer:
            d = d[key]
        if isinstance(last, tuple):  # (key, index): one element of a list
            d[last[0]][last[1]] = value
        else:
            d[last] = value
    return damage


DAMAGE = [
    ("a NaN noise multiplier", _set(["noise_multiplier"], float("nan")), "noise_multiplier must be finite"),
    ("a negative noise multiplier", _set(["noise_multiplier"], -1.0), "noise_multiplier must be finite and >= 0"),
    ("a clip norm C of 0", _set(["max_grad_norm"], 0.0), "max_grad_norm must be finite and > 0"),
    ("no steps", _set(["steps"], 0), "steps must be >= 1"),
    ("a delta of 1", _set(["delta"], 1.0), r"delta must lie in \(0, 1\)"),
    ("a NaN budget", _set(["groups", ("epsilon", 1)], float("nan")), "budgets .* must be finite and > 0"),
    ("a rate above 1", _set(["groups", ("sample_rate", 0)], 1.5), r"sample rates must lie in \[0, 1\]"),
    ("a negative clip norm", _set(["groups", ("clip_norm", 2)], -1.0), "clip norms must be finite and > 0"),
    ("a guarantee above its budget", _set(["groups", ("guaranteed_epsilon", 0)], 1.5),
     "guaranteed epsilon must be finite, >= 0 and within its budget"),
    ("a group missing its rate", lambda d: d["groups"]["sample_rate"].pop(),
     "sample_rates must have one value per group"),
    ("a record in no group", _set([("group_index", 0)], 7), "group_index out of range"),
    ("sizes that do not count the records", _set(["groups", ("size", 0)], 3), "group sizes do not match"),
    ("an RDP order of 1", _set([("orders", 0)], 1.0), "RDP orders must all be > 1"),
    ("a group order below 1", _set([("group_orders", 1)], 0.5), "group_orders must be one RDP order > 1"),
]


@pytest.mark.parametrize("what,damage,message", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_damaged_plan_is_refused_naming_what_is_wrong(plan_dict, what, damage, message):
    d = copy.deepcopy(plan_dict)
    damage(d)
    with pytest.raises(ValueError, match=message):
        PrivacyPlan.from_dict(d)


def test_an_undamaged_plan_round_trips_and_keeps_its_guarantee(plan_dict):
    plan = PrivacyPlan.from_json(PrivacyPlan.from_dict(plan_dict).to_json())
    assert plan.to_dict() == plan_dict
    assert (plan.epsilons() <= plan.budgets).all()


def test_a_damaged_noise_schedule_is_refused():
    plan = calibrate_scheduled(np.repeat([1.0, 2.0], 5), delta=DELTA, steps=8, sample_rate=0.2,
                               noise_schedule=TimeDecay(0.05))
    d = plan.to_dict()
    assert ScheduledPlan.from_dict(d).noise_factors.tolist() == plan.noise_factors.tolist()
    for bad in (d["noise_factors"][:-1], [0.0] + d["noise_factors"][1:], [float("nan")] * 8):
        with pytest.raises(ValueError, match="noise_factors must be 8 finite values > 0"):
            ScheduledPlan.from_dict(d | {"noise_factors": bad})


def test_a_scheduled_plan_needs_its_noise_factors():
    plan = calibrate_scheduled(np.repeat([1.0, 2.0], 5), delta=DELTA, steps=8, sample_rate=0.2,
                               noise_schedule=TimeDecay(0.05))
    d = plan.to_dict()
    for missing in ({k: v for k, v in d.items() if k != "noise_factors"}, d | {"noise_factors": None}):
        with pytest.raises(ValueError, match="no noise_factors.*PrivacyPlan.from_dict"):
            ScheduledPlan.from_dict(missing)
    with pytest.raises(ValueError, match="ScheduledPlan needs noise_factors"):
        dataclasses.replace(plan, noise_factors=None)


def test_a_scheduled_plan_read_as_a_constant_plan_is_refused_not_stripped_of_its_schedule():
    plan = calibrate_scheduled(np.repeat([1.0, 2.0], 5), delta=DELTA, steps=8, sample_rate=0.2,
                               noise_schedule=TimeDecay(0.05))
    with pytest.raises(ValueError, match="noise_factors.*ScheduledPlan.from_dict"):
        PrivacyPlan.from_json(plan.to_json())
    assert ScheduledPlan.from_json(plan.to_json()).to_dict() == plan.to_dict()


def _plans():
    budgets = np.repeat([1.0, 2.0, 4.0], [10, 6, 4])
    yield "rdp", calibrate(budgets, delta=DELTA, steps=20, sample_rate=0.1, method="hybrid")
    yield "pld", calibrate(budgets, delta=DELTA, steps=20, sample_rate=0.1, method="scale", accountant="pld")
    yield "scheduled", calibrate_scheduled(budgets, delta=DELTA, steps=8, sample_rate=0.2,
                                           noise_schedule=TimeDecay(0.05))


@pytest.mark.parametrize("kind,plan", list(_plans()), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("change", [_set(("noise_multiplier",), 0.0), _set(("noise_multiplier",), 0.5),
                                    _set(("steps",), 2000), _set(("groups", ("sample_rate", 0)), 1.0),
                                    _set(("groups", ("clip_norm", 2)), 50.0)],
                         ids=["no-noise", "less-noise", "more-steps", "rate-1", "larger-clip"])
def test_a_plan_whose_settings_changed_after_calibration_is_refused_on_load(kind, plan, change):
    """Its stored guarantees would otherwise still read ≤ the budgets (``epsilons()``) while training
    with its settings spends more: every group is accounted again from σ, C, q, c, T and δ on load."""
    cls = type(plan)
    assert cls.from_dict(plan.to_dict()).epsilons().tolist() == plan.epsilons().tolist()  # unchanged: loads
    d = copy.deepcopy(plan.to_dict())
    change(d)
    # (a scheduled plan's extra steps are caught first: it holds one noise factor per step)
    with pytest.raises(ValueError, match="changed after calibration|noise_factors must be 2000 finite values"):
        cls.from_dict(d)


def test_a_plan_that_is_not_a_dict_is_a_type_error():
    with pytest.raises(TypeError, match="plan dict"):
        PrivacyPlan.from_dict(None)
    with pytest.raises(TypeError, match="plan dict"):
        PrivacyPlan.from_json("[1, 2]")


def test_a_plan_of_many_distinct_budgets_loads_although_its_ledger_certifies_a_little_less():
    """With many distinct budgets the ledger may certify a group at a slightly lower ε than
    calibration stated (here by up to ~7e-6 relative): harmless, so the check is one-sided."""
    budgets = np.random.default_rng(0).uniform(1, 10, 1000)
    plan = calibrate(budgets, delta=DELTA, steps=1000, sample_rate=0.01, method="hybrid")
    assert (plan._group_epsilons_again() < plan.group_epsilons).any()
    assert PrivacyPlan.from_json(plan.to_json()).epsilons().tolist() == plan.epsilons().tolist()


def test_each_group_is_re_accounted_at_its_worst_record_and_an_empty_group_keeps_its_stored_guarantee(plan_dict):
    from pdpfast.accounting.ledger import ledger_for_plan

    d = copy.deepcopy(plan_dict)
    for key, value in (("epsilon", 8.0), ("size", 0), ("sample_rate", 0.5), ("clip_norm", 1.0),
                       ("guaranteed_epsilon", 7.5)):
        d["groups"][key].append(value)  # a group no record is in
    d["group_orders"].append(d["group_orders"][0])
    plan = PrivacyPlan.from_dict(d)
    ledger = ledger_for_plan(plan)
    ledger.step(plan.steps)
    spent = ledger.epsilons(DELTA)
    by_hand = [spent[plan.group_index == k].max() for k in range(3)] + [7.5]
    np.testing.assert_array_equal(plan._group_epsilons_again(), by_hand)
