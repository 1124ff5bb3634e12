"""Per-record ledger: composition, subsets, budgets, crash-safe persistence."""
import os

import numpy as np
import pytest

from pdpfast.accounting import (
    DEFAULT_ORDERS,
    IndividualAccountant,
    PLDIndividualAccountant,
    calibrate,
    compute_rdp,
    get_privacy_spent,
    ledger_for_plan,
)


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


def _would_exceed_by_full_evaluation(acc, delta, n):
    """What ``would_exceed`` answered before it bounded ε from an anchor: every row evaluated."""
    return acc._group_eps(delta, extra_steps=n)[0][acc.group_of] > acc.budgets


@pytest.mark.parametrize("seed", range(4))
def test_would_exceed_answers_as_a_full_evaluation_every_step_while_records_reach_their_budgets(seed):
    """``would_exceed`` evaluates exactly only the records an anchored upper bound does not clear;
    its answer must still equal the full evaluation bit for bit: on budgets set to the ledger's own ε
    at some step (equality, the rounding edge), through rate changes, subsets, δ changes and n > 1."""
    rng = np.random.default_rng(seed)
    n_records, delta = 400, 1e-5
    q = rng.choice([0.01, 0.03, 0.1], n_records) * rng.uniform(0.5, 1.5, n_records)
    z = rng.uniform(0.6, 3.0, n_records)
    probe = IndividualAccountant(q, z).step(60)
    # a few records at (or a hair around) their ε at step 60: fewer than a quarter ever run out, as in
    # training, where the engine stops at the first (past a quarter, every row is evaluated anyway)
    budgets = probe.epsilons(delta) * rng.choice([0.999999, 1.0, 1.0 + 1e-15, 1.3, 6.0], n_records,
                                                 p=[0.04, 0.04, 0.04, 0.08, 0.8])
    acc = IndividualAccountant(q, z, budgets=budgets, record_orders=np.where(rng.random(n_records) < 0.2, 7.5, np.nan))
    anchors, tangents = [], acc._tangents
    acc._tangents = lambda *a: anchors.append(1) or tangents(*a)
    flipped = 0
    for t in range(300):
        if t == 150:
            acc.set_rates(sample_rates=q * 0.8)
        if t % 97 == 50:
            acc.step(1, record_ids=rng.choice(n_records, 50, replace=False))
            continue
        for d, n in ((delta, 1), (delta, 1 + t % 3), (2 * delta if t % 40 == 0 else delta, 1)):
            got = acc.would_exceed(d, n)
            np.testing.assert_array_equal(got, _would_exceed_by_full_evaluation(acc, d, n))
        flipped += int(got.sum())
        acc.step()
    assert 0 < flipped, "no record reached its budget: the test checked nothing near the edge"
    assert len(anchors) < 40, "nearly every call evaluated every row: the bound was never used"


def test_would_exceed_after_a_restored_state_answers_as_a_full_evaluation():
    rng = np.random.default_rng(5)
    acc = IndividualAccountant(rng.uniform(0.01, 0.1, 50), rng.uniform(0.8, 2.0, 50), budgets=rng.uniform(1, 3, 50))
    acc.step(20)
    acc.would_exceed(1e-5)                                  # anchors at step 20
    state = acc.state_dict()
    acc.step(30)
    acc.load_state_dict(state)                              # back to step 20 with the same rows
    for _ in range(40):
        np.testing.assert_array_equal(acc.would_exceed(1e-5), _would_exceed_by_full_evaluation(acc, 1e-5, 1))
        acc.step()


def test_many_distinct_rates_are_accounted_in_chunks_as_the_cached_path_accounts_few(monkeypatch):
    """Past a quarter of the pair cache the one-step RDP is computed in chunks and not cached (a dict
    of 10^6 rows took gigabytes); the numbers must not change."""
    from pdpfast.accounting import ledger

    rng = np.random.default_rng(3)
    q, z = rng.uniform(0.001, 0.2, 50), rng.uniform(0.7, 3.0, 50)
    cached = IndividualAccountant(q, z).step(7)
    monkeypatch.setattr(ledger, "_PAIR_CACHE_SIZE", 8)
    monkeypatch.setattr(ledger, "_PAIR_CHUNK", 3)
    chunked = IndividualAccountant(q, z).step(7)
    assert not chunked.__dict__.get("_pair_cache")
    np.testing.assert_array_equal(chunked.rdp(), cached.rdp())
    np.testing.assert_array_equal(chunked.epsilons(1e-5), cached.epsilons(1e-5))


def test_a_noise_schedule_does_not_fill_the_pair_cache_with_pairs_that_never_come_back(monkeypatch):
    """Each step of a schedule brings new multipliers, so its (q, z) pairs are computed and not cached
    (the cache grew to its cap, ~95 MiB, holding nothing a later step asked for); pairs that recur are
    still cached, and the numbers are those of the path that caches nothing."""
    from pdpfast.accounting import ledger

    rng = np.random.default_rng(4)
    q, z = rng.uniform(0.001, 0.2, 40), rng.choice([0.8, 1.3, 2.1], 40)
    runs = []
    for cache_size in (0, ledger._PAIR_CACHE_SIZE):   # 0: every call takes the uncached, chunked path
        monkeypatch.setattr(ledger, "_PAIR_CACHE_SIZE", cache_size)
        acc, sizes = IndividualAccountant(q, z), []
        for t in range(30):
            acc.set_rates(noise_multipliers=z * 0.98 ** t)
            acc.step()
            sizes.append(len(acc.__dict__.get("_pair_cache", {})))
        acc.set_rates(noise_multipliers=z * 0.98 ** 3)  # pairs of step 3 again: not kept, computed again
        acc.step()
        runs.append((acc, sizes))
    (uncached, _), (cached, sizes) = runs
    assert sizes == [40] * 30   # the first step's 40 pairs (the cache was empty), none after
    np.testing.assert_array_equal(cached.rdp(), uncached.rdp())
    np.testing.assert_array_equal(cached.epsilons(1e-5), uncached.epsilons(1e-5))
    # pairs that recur (rates set back to the first step's) are served from the cache: nothing computed
    monkeypatch.setattr(ledger, "rdp_one_step", lambda *args: pytest.fail("a cached pair was computed again"))
    cached.set_rates(noise_multipliers=z)
    cached.step()
    assert len(cached._pair_cache) == 40


def test_new_rates_given_row_by_row_keep_the_rows_and_the_numbers_of_a_split():
    """A noise schedule sets every record's z each step; when each row's members get one value the
    ledger keeps its rows (no sort of N records) and must account exactly as splitting would."""
    rng = np.random.default_rng(4)
    q, z = rng.choice([0.01, 0.05], 300), rng.choice([1.0, 2.0], 300)
    fast, split = IndividualAccountant(q, z), IndividualAccountant(q, z)
    split._update_rates = lambda sr, nm, ids: IndividualAccountant._update_rates(split, sr, nm, np.arange(300))
    for t in range(1, 6):
        for ledger in (fast, split):
            ledger.set_rates(noise_multipliers=z * (1 + 0.1 * t))
            ledger.step(2)
        assert fast.group_rdp.shape[0] == 4
        np.testing.assert_array_equal(fast.epsilons(1e-5), split.epsilons(1e-5))
        np.testing.assert_array_equal(fast.noise_multipliers, z * (1 + 0.1 * t))
    fast.set_rates(noise_multipliers=rng.uniform(1, 2, 300))     # members of a row now differ: split
    assert fast.group_rdp.shape[0] > 4


@pytest.mark.parametrize("seed", range(3))
def test_exceeding_names_exactly_the_records_a_full_evaluation_flags_when_rows_share_records_of_unequal_budgets(seed):
    """A row's bound is compared with its tightest member's budget first, and only the members of rows it
    does not clear are looked at: the records named must still be those of a full evaluation, bit for bit,
    when a row's members have different budgets (a calibrated plan's rows serve a range of budgets)."""
    rng = np.random.default_rng(seed)
    n_records, delta = 3000, 1e-5
    q = rng.choice([0.01, 0.03, 0.1], n_records)
    z = rng.choice([0.8, 1.5, 3.0], n_records)
    probe = IndividualAccountant(q, z).step(80)
    budgets = probe.epsilons(delta) * rng.choice([0.999999, 1.0, 1.0 + 1e-15, 1.2, 5.0], n_records,
                                                 p=[0.01, 0.01, 0.01, 0.07, 0.9])
    acc = IndividualAccountant(q, z, budgets=budgets)
    assert acc.group_rates.shape[0] == 9
    flagged = 0
    for t in range(200):
        if t == 120:
            acc.step(1, record_ids=rng.choice(n_records, 300, replace=False))   # splits rows
            continue
        for n in (1, 1 + t % 4):
            full = np.flatnonzero(_would_exceed_by_full_evaluation(acc, delta, n))
            got = acc.exceeding(delta, n)
            assert got.dtype == np.int64
            np.testing.assert_array_equal(got, full)
            np.testing.assert_array_equal(acc.would_exceed(delta, n), _would_exceed_by_full_evaluation(acc, delta, n))
        flagged += full.size
        acc.step()
    assert flagged, "no record reached its budget: the test checked nothing near the edge"


def test_a_training_step_with_every_record_clear_of_its_budget_looks_at_no_record(monkeypatch):
    """The engine's check before every step costs O(rows), not O(records): once anchored, a step whose
    rows all clear their tightest budget gathers no per-record array (at 10^7 records the (N,) gather
    took 30 ms a step)."""
    from pdpfast.accounting.ledger import IndividualAccountant as Ledger

    rng = np.random.default_rng(0)
    plan = calibrate(rng.choice([1.0, 2.0, 3.0], 20_000), delta=1e-6, steps=200, sample_rate=0.01)
    acc = ledger_for_plan(plan)
    acc.exceeding(1e-6)                                   # the first call evaluates every row and anchors
    looked_at = []
    members_of = Ledger._members_of
    monkeypatch.setattr(Ledger, "_members_of", lambda self, rows: looked_at.append(
        members_of(self, rows).size) or members_of(self, rows))
    for _ in range(50):
        assert acc.exceeding(1e-6).size == 0
        acc.step()
    assert sum(looked_at) == 0


def test_a_ledgers_budgets_cannot_change_in_place_behind_its_row_summaries():
    """The ledger keeps the tightest budget of each row; a budget changed in place would leave it stale,
    so the ledger holds a read-only copy (the caller's array stays its own)."""
    budgets = np.array([1.0, 2.0, 3.0])
    acc = IndividualAccountant([0.1, 0.1, 0.2], 1.0, budgets=budgets)
    budgets[0] = 0.01                                     # the caller's array: not the ledger's
    assert acc.budgets[0] == 1.0
    with pytest.raises(ValueError, match="read-only"):
        acc.budgets[0] = 0.01
    restored = IndividualAccountant.__new__(IndividualAccountant)
    restored.load_state_dict(acc.state_dict())
    with pytest.raises(ValueError, match="read-only"):
        restored.budgets[0] = 0.01


@pytest.mark.parametrize("distinct_rows", [5, 70_000])   # 16-bit row keys (radix sort) and wider ones
def test_member_index_lists_each_rows_records_in_order_with_their_tightest_budget(distinct_rows):
    rng = np.random.default_rng(distinct_rows)
    n = 90_000
    q = rng.choice(np.linspace(0.01, 0.2, distinct_rows), n)
    q[:distinct_rows] = np.linspace(0.01, 0.2, distinct_rows)     # every value present
    budgets = rng.uniform(1.0, 3.0, n)
    acc = IndividualAccountant(q, 1.0, budgets=budgets)
    ids, starts, smallest = acc._members()
    assert starts[-1] == n and np.array_equal(ids, np.argsort(acc.group_of, kind="stable"))
    rows = acc.group_rates.shape[0]
    assert rows == distinct_rows
    for g in rng.choice(rows, min(rows, 20), replace=False):
        members = ids[starts[g]:starts[g + 1]]
        assert np.array_equal(members, np.flatnonzero(acc.group_of == g))
        assert smallest[g] == budgets[members].min()
    some = np.sort(rng.choice(rows, min(rows, 7) - 1, replace=False))
    assert np.array_equal(acc._members_of(some), np.concatenate([np.flatnonzero(acc.group_of == g) for g in some]))
    assert acc._members_of(some[:0]).size == 0


def _exceeding_by_stepping_a_copy(ledger, delta, n):
    """The records over budget after n more steps, found the slow way: a copy without caches steps n times."""
    import copy

    twin = copy.deepcopy(ledger)
    for cache in ("_anchor", "_member_index", "_certified"):
        twin.__dict__.pop(cache, None)
    if isinstance(twin, PLDIndividualAccountant):
        twin._certified = {}
    twin.step(n)
    return np.flatnonzero(twin.epsilons(delta) > twin.budgets)


@pytest.mark.parametrize("seed", range(2))
def test_exceeding_equals_stepping_a_copy_across_random_histories_of_both_ledgers(seed):
    """Random histories, each call of ``exceeding`` checked against a copy stepped for real: full and
    partial steps, rates changed for some records (rows split), every row's multiplier at once, and an
    older state loaded into the same object after its rows changed (its row caches must not survive),
    for the RDP ledger and the PLD ledger (with and without a horizon)."""
    rng = np.random.default_rng(seed)
    checks = 0
    for trial in range(6):
        n_records, groups = int(rng.integers(1, 50)), int(rng.integers(1, 5))
        g = rng.integers(0, groups, n_records)
        q = rng.choice([0.01, 0.05, 0.2, 0.5], groups)[g]
        z = rng.choice([0.6, 1.0, 2.0], groups)[g]
        budgets = rng.uniform(0.2, 3.0, n_records)
        pld = trial % 3 == 2
        ledger = (PLDIndividualAccountant(q, z, budgets=budgets, horizon=[None, 40][trial % 2]) if pld
                  else IndividualAccountant(q, z, budgets=budgets))
        older = None
        for _ in range(15):
            n = int(rng.choice([1, 1, 2, 5]))
            np.testing.assert_array_equal(ledger.exceeding(1e-5, n), _exceeding_by_stepping_a_copy(ledger, 1e-5, n))
            checks += 1
            r = rng.random()
            if r < 0.5 or pld and r < 0.8:
                ledger.step(int(rng.integers(1, 4)))
            elif r < 0.62:
                ledger.step(1, record_ids=rng.choice(n_records, int(rng.integers(1, n_records + 1)), replace=False))
            elif r < 0.72:
                ids = rng.choice(n_records, int(rng.integers(1, n_records + 1)), replace=False)
                ledger.set_rates(noise_multipliers=float(rng.choice([0.8, 1.2, 3.0])), record_ids=ids)
            elif r < 0.8:
                ledger.set_group_noise(ledger.group_noise * float(rng.choice([0.9, 1.1])))
            elif older is not None and r < 0.9:
                ledger.load_state_dict(older)
            else:
                older = ledger.state_dict()
    assert checks == 90
