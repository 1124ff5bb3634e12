"""Per-record ledger: composition, subsets, budgets, crash-safe persistence."""
import os

import numpy as np
import pytest

from pdpfast.accounting import DEFAULT_ORDERS, IndividualAccountant, calibrate, compute_rdp, get_privacy_spent


def _eps(q, z, steps, delta=1e-5):
    return get_privacy_spent(DEFAULT_ORDERS, compute_rdp(q, z, steps), delta)[0] if steps else 0.0


def test_matches_direct_accounting_for_groups():
    q = np.array([0.01, 0.01, 0.05, 0.05, 0.2])
    z = np.array([1.0, 2.0, 1.0, 1.0, 3.0])
    acc = IndividualAccountant(q, z)
    assert acc.group_rdp.shape[0] == 4
    acc.step(30).step(20)
    eps = acc.epsilons(1e-5)
    for i in range(5):
        assert eps[i] == pytest.approx(_eps(q[i], z[i], 50), rel=1e-9)


def test_changing_rates_and_dropping_records():
    acc = IndividualAccountant(np.full(4, 0.02), 1.1)
    acc.step(10)
    acc.step(10, sample_rates=[0.02, 0.02, 0.0, 0.05])        # record 2 drops out, record 3 speeds up
    acc.step(5, record_ids=[0, 3])                              # only records 0 and 3 take part
    orders = np.array(DEFAULT_ORDERS)
    rdp = lambda q, n: compute_rdp(q, 1.1, n, orders)            # noqa: E731
    expected = [rdp(0.02, 25), rdp(0.02, 20), rdp(0.02, 10), rdp(0.02, 10) + rdp(0.05, 15)]
    for i in range(4):
        assert acc.epsilons(1e-5)[i] == pytest.approx(get_privacy_spent(orders, expected[i], 1e-5)[0], rel=1e-9)
    np.testing.assert_array_equal(acc.sample_rates, [0.02, 0.02, 0.0, 0.05])


def test_no_steps_no_spending():
    acc = IndividualAccountant([0.1, 0.2], 1.0)
    np.testing.assert_array_equal(acc.epsilons(1e-5), 0.0)


def test_would_exceed_flags_exactly_the_records_over_budget():
    plan = calibrate(np.repeat([1.0, 2.0], 50), delta=1e-5, steps=100, sample_rate=0.05)
    # the plan certifies each group at its own RDP order: the ledger must account at it too
    acc = IndividualAccountant(plan.sample_rates, plan.noise_multipliers, budgets=plan.budgets,
                               record_orders=plan.group_orders[plan.group_index])
    acc.step(99)
    assert not acc.would_exceed(1e-5, 1).any()            # the plan's last step still fits
    assert acc.would_exceed(1e-5, 30).all()
    acc.step(1)
    np.testing.assert_allclose(acc.epsilons(1e-5), plan.epsilons(), rtol=1e-9)
    assert np.all(acc.remaining(1e-5) >= 0)
    with pytest.raises(ValueError, match="budgets"):
        IndividualAccountant(0.1, 1.0).would_exceed(1e-5)


def test_save_and_load_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    acc = IndividualAccountant(rng.choice([0.01, 0.02], 1000), rng.choice([1.0, 1.5], 1000),
                               budgets=rng.uniform(1, 3, 1000))
    acc.step(7).step(3, record_ids=np.arange(0, 1000, 2))
    path = tmp_path / "ledger.npz"
    acc.save(path)
    again = IndividualAccountant.load(path)
    np.testing.assert_array_equal(again.epsilons(1e-5), acc.epsilons(1e-5))
    np.testing.assert_array_equal(again.budgets, acc.budgets)
    assert again.steps_taken == acc.steps_taken == 10
    again.step(1)
    acc.step(1)
    np.testing.assert_array_equal(again.epsilons(1e-5), acc.epsilons(1e-5))


def test_save_never_leaves_a_half_written_file(tmp_path, monkeypatch):
    acc = IndividualAccountant([0.1, 0.2], 1.0)
    path = tmp_path / "ledger.npz"
    acc.step(5)
    acc.save(path)
    before = path.read_bytes()
    acc.step(5)

    def crash(*args, **kwargs):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        acc.save(path)
    assert path.read_bytes() == before                     # old ledger intact, never rolled back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.npz"]    # no temp file left
    monkeypatch.undo()
    acc.save(path)
    assert IndividualAccountant.load(path).steps_taken == 10


def test_a_million_records():
    n = 1_000_000
    rng = np.random.default_rng(1)
    acc = IndividualAccountant(rng.choice([0.005, 0.01, 0.02], n), 1.0, budgets=np.full(n, 3.0))
    acc.step(100)
    acc.step(10, record_ids=np.arange(0, n, 3))
    eps = acc.epsilons(1e-5)
    assert eps.shape == (n,) and np.all(eps > 0)
    assert acc.would_exceed(1e-5, 1).dtype == bool


def test_bad_input():
    with pytest.raises(ValueError, match="sample_rates"):
        IndividualAccountant([1.5], 1.0)
    with pytest.raises(ValueError, match="noise_multipliers"):
        IndividualAccountant([0.5], -1.0)
    acc = IndividualAccountant([0.5, 0.5], 1.0)
    with pytest.raises(ValueError, match="record_ids"):
        acc.step(1, record_ids=[5])
    with pytest.raises(ValueError, match="n must"):
        acc.step(0)


def test_per_record_rates_follow_record_ids_in_the_order_given():
    """A rate given for record 5 is charged to record 5, whatever order the ids come in: charging it
    to another record would under-account the record whose rate is larger."""
    rng = np.random.default_rng(7)
    ids = rng.permutation(8)[:5]                                # unsorted on purpose
    rates = rng.uniform(0.01, 0.3, size=5)
    acc = IndividualAccountant(np.full(8, 0.02), 1.1)
    acc.step(20, sample_rates=rates, record_ids=ids)
    eps = acc.epsilons(1e-5)
    for i, q in zip(ids, rates):
        assert eps[i] == pytest.approx(_eps(q, 1.1, 20), rel=1e-9)
    for i in set(range(8)) - set(ids.tolist()):
        assert eps[i] == 0.0                                    # the others took no part
    acc.set_rates(noise_multipliers=[3.0, 0.8], record_ids=[6, 1])
    assert acc.noise_multipliers[6] == 3.0 and acc.noise_multipliers[1] == 0.8


def test_a_record_named_twice_must_carry_one_rate():
    acc = IndividualAccountant(np.full(4, 0.02), 1.1)
    with pytest.raises(ValueError, match="twice with different sample_rates"):
        acc.step(1, sample_rates=[0.1, 0.2, 0.3], record_ids=[2, 0, 2])
    with pytest.raises(ValueError, match=r"one value per entry of record_ids \(3\)"):
        acc.step(1, sample_rates=[0.1, 0.2], record_ids=[2, 0, 2])
    acc.step(1, sample_rates=[0.1, 0.2, 0.1], record_ids=[2, 0, 2])   # the same rate twice is fine
    np.testing.assert_array_equal(acc.sample_rates, [0.2, 0.02, 0.1, 0.02])


def test_record_ids_that_are_not_integers_are_refused_so_a_mask_never_charges_records_0_and_1():
    acc = IndividualAccountant(np.full(4, 0.1), 1.0, budgets=np.ones(4))
    mask = np.array([False, False, True, True])
    for ids in (mask, [0.5, 2.0]):
        with pytest.raises(TypeError, match="record_ids must be integer record indices.*np.flatnonzero"):
            acc.step(record_ids=ids)
    assert acc.steps_taken == 0 and not acc.epsilons(1e-5).any()
    acc.step(record_ids=np.flatnonzero(mask))
    eps = acc.epsilons(1e-5)
    assert eps[0] == eps[1] == 0 and eps[2] == eps[3] > 0


def test_a_step_no_record_takes_part_in_charges_nothing():
    acc = IndividualAccountant(np.full(3, 0.1), 1.0, budgets=np.ones(3)).step(2)
    before = acc.epsilons(1e-5)
    acc.step(record_ids=[])
    np.testing.assert_array_equal(acc.epsilons(1e-5), before)
    assert acc.steps_taken == 3


def test_rates_of_another_length_than_the_records_are_refused_naming_the_argument():
    acc = IndividualAccountant(np.full(4, 0.1), 1.0)
    with pytest.raises(ValueError, match=r"sample_rates must be a scalar or one value per record \(4\), got shape"):
        acc.step(sample_rates=[0.1] * 3)
    with pytest.raises(ValueError, match=r"noise_multipliers must be a scalar or one value per record \(4\)"):
        acc.set_rates(noise_multipliers=np.ones((2, 2)))
    assert acc.steps_taken == 0


@pytest.mark.parametrize("kwargs", [dict(sample_rates=["0.1", "0.1"]), dict(noise_multipliers=True)],
                         ids=["rates as text", "noise as a bool"])
def test_a_ledger_of_values_that_are_not_numbers_is_a_type_error(kwargs):
    args = dict(sample_rates=[0.1, 0.1], noise_multipliers=1.0) | kwargs
    with pytest.raises(TypeError, match=f"{next(iter(kwargs))} must be numbers"):
        IndividualAccountant(**args)
    with pytest.raises(TypeError, match="sample_rates must be numbers"):
        IndividualAccountant([0.1, 0.1], 1.0).set_rates(sample_rates=["0.2", "0.2"])
