"""PDP-SGD driver (pdpfast.pdp_sgd): budgets never exceeded, data-independent rounds, resume."""
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pdpfast.pdp_sgd import PDPSGD, train_pdp_sgd

DELTA = 1e-5


def _problem(n=160, seed=0, features=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g) if features is None else features
    dataset = TensorDataset(x, torch.randint(0, 3, (n,), generator=g))
    budgets = np.exp(np.random.default_rng(3).normal(0.3, 0.7, n))     # n distinct budgets in ~[0.2, 8]
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, dataset, budgets


@pytest.mark.filterwarnings("ignore:the optimal RDP order")   # adaptive τ can be tiny: valid but loose
@pytest.mark.parametrize("rule", ["all", "sampled"])
@pytest.mark.parametrize("loss", ["fixed", "adaptive"])
def test_no_record_accumulated_epsilon_exceeds_its_budget(rule, loss):
    model, dataset, budgets = _problem()
    rounds = 4
    result = train_pdp_sgd(model, dataset, budgets, delta=DELTA, rounds=rounds, steps_per_round=4, sample_rate=0.2,
                           rule=rule, loss=loss, seed=1)
    assert np.all(result.epsilons <= budgets)                       # charged round guarantees
    assert np.all(result.ledger_epsilons <= result.epsilons + 1e-12)  # what the engines' ledgers spent, amplified
    assert np.all(result.remaining >= 0) and np.allclose(result.epsilons + result.remaining, budgets)
    assert np.all(result.deltas <= len(result.rounds) * DELTA + 1e-18)
    for r in result.rounds:
        assert r.engine_epsilon <= r.threshold                       # each round is (τ_R, δ)-DP on its subset
    if rule == "all" and loss == "fixed":             # every record is charged every round it has budget left
        assert len(result.rounds) >= 2 and result.epsilons.sum() > 0.5 * budgets.sum()


def test_rounds_depend_only_on_budgets_and_seed_not_on_the_data():
    first = _problem(seed=0)
    other = _problem(seed=0, features=torch.randn(160, 5) * 10)
    runs = []
    for model, dataset, budgets in (first, other):
        driver = PDPSGD(model, dataset, budgets, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), delta=DELTA,
                        rounds=3, epochs_per_round=1.0, expected_batch_size=16, seed=7)
        kept = []
        original = driver._begin_round

        def spy():
            started = original()
            if started:
                kept.append(driver.current["kept"].copy())
            return started

        driver._begin_round = spy
        runs.append((driver.run(), kept))
    (a, kept_a), (b, kept_b) = runs
    assert [r.threshold for r in a.rounds] == [r.threshold for r in b.rounds]
    assert [r.steps for r in a.rounds] == [r.steps for r in b.rounds]
    assert all(np.array_equal(x, y) for x, y in zip(kept_a, kept_b))
    np.testing.assert_array_equal(a.epsilons, b.epsilons)


def test_one_round_is_dp_sgd_plus_sampling():
    model, dataset, budgets = _problem()
    result = train_pdp_sgd(model, dataset, budgets, delta=DELTA, rounds=1, steps_per_round=3, sample_rate=0.3)
    (r,) = result.rounds
    np.testing.assert_allclose(result.epsilons, np.minimum(budgets, r.threshold))
    assert r.subset_size < len(budgets)


def test_driver_state_round_trips_mid_round_and_continues_exactly(tmp_path):
    def driver_for(model, dataset, budgets):
        return PDPSGD(model, dataset, budgets, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                      delta=DELTA, rounds=3, steps_per_round=5, sample_rate=0.25, seed=2)

    whole = driver_for(*_problem())
    expected = whole.run()
    model, dataset, budgets = _problem()
    part = driver_for(model, dataset, budgets)
    part.run(max_steps=7)                     # stops inside round 2
    assert part.steps == 7 and not part.finished
    part.save_checkpoint(tmp_path / "pdp.pt", note="x")
    model2, dataset2, budgets2 = _problem(seed=5)  # other initial weights: the checkpoint must overwrite them
    resumed = driver_for(model2, dataset, budgets)
    assert resumed.load_checkpoint_state(torch.load(tmp_path / "pdp.pt", weights_only=False))["note"] == "x"
    assert resumed.steps == 7
    result = resumed.run()
    assert resumed.finished
    np.testing.assert_array_equal(result.epsilons, expected.epsilons)
    np.testing.assert_allclose(result.ledger_epsilons, expected.ledger_epsilons, rtol=1e-12)
    np.testing.assert_array_equal(result.deltas, expected.deltas)
    for a, b in zip(whole.model.parameters(), model2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("damage,match", [
    (lambda s: s.update(remaining=s["budgets"] * 2), r"remaining budget must lie in \[0, its budget\]"),
    (lambda s: s["remaining"].__setitem__(0, np.nan), r"remaining budget must lie in \[0, its budget\]"),
    (lambda s: s.update(spent_delta=-np.ones_like(s["spent_delta"])), "spent_delta and ledger_eps must be finite"),
    (lambda s: s.update(ledger_eps=s["ledger_eps"][:3]), "one value per record"),
], ids=["remaining above budget", "NaN remaining", "negative delta spent", "short ledger"])
def test_a_driver_state_that_would_let_records_overspend_is_refused_and_the_driver_unchanged(damage, match):
    model, dataset, budgets = _problem()
    driver = PDPSGD(model, dataset, budgets, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), delta=DELTA,
                    rounds=2, steps_per_round=3, sample_rate=0.25, seed=2)
    driver.run(max_steps=4)
    before = (driver.remaining.copy(), driver.spent_delta.copy(), driver.ledger_eps.copy())
    state = driver.state_dict()
    damage(state)
    with pytest.raises(ValueError, match=match):
        driver.load_state_dict(state)
    for now, then in zip((driver.remaining, driver.spent_delta, driver.ledger_eps), before):
        np.testing.assert_array_equal(now, then)
    assert (driver.remaining < driver.budgets).any()             # the run spent something to protect


@pytest.mark.parametrize("kwargs,match", [
    (dict(rule="some"), "rule"), (dict(loss="l2"), "loss"), (dict(rounds=0), "rounds"),
    (dict(sample_rate=None), "exactly one"), (dict(expected_batch_size=10), "exactly one"),
    (dict(delta=0.0), "delta"), (dict(steps_per_round=None), "exactly one"),
])
def test_bad_driver_arguments_are_refused(kwargs, match):
    model, dataset, budgets = _problem(n=20)
    args = dict(delta=DELTA, rounds=2, steps_per_round=2, sample_rate=0.5) | kwargs
    with pytest.raises(ValueError, match=match):
        PDPSGD(model, dataset, budgets, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **args)
    with pytest.raises(ValueError, match="budget"):
        PDPSGD(model, dataset, np.r_[budgets[:-1], np.nan], optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
               delta=DELTA, rounds=2, steps_per_round=2, sample_rate=0.5)
