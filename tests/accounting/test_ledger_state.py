"""Loading a ledger state: both ledgers check what they read, alike, and a refused state leaves the
ledger as it was. A ledger restored from a damaged checkpoint must not under-report spending or
compare ε against budgets that can never be exceeded (a NaN budget: ε > NaN is always False)."""
import numpy as np
import pytest

from pdpfast.accounting import IndividualAccountant, PLDIndividualAccountant

DELTA = 1e-5
LEDGERS = {"rdp": IndividualAccountant, "pld": PLDIndividualAccountant}


def _ledger(kind):
    rng = np.random.default_rng(7)
    q = rng.choice([0.02, 0.05], 12)
    return LEDGERS[kind](q, 2.0, budgets=rng.uniform(1.0, 3.0, 12)).step(5)


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=a[k].dtype.kind == "f") for k in a)


def _refused_and_unchanged(ledger, damage, message) -> dict:
    """Load ``ledger``'s own state, damaged: it must be refused with ``message`` and leave the ledger
    as it was. Returns the damaged state."""
    before = ledger.state_dict()
    state = ledger.state_dict()
    damage(state)
    with pytest.raises(ValueError, match=message):
        ledger.load_state_dict(state)
    assert _same_state(ledger.state_dict(), before)
    return state


# (what is damaged, how, the message's words): one entry each ledger writes
RECORD_DAMAGE = [
    ("budgets of another length", lambda s: s.update(budgets=s["budgets"][:-1]), "budgets do not match"),
    ("a NaN budget", lambda s: s["budgets"].__setitem__(3, np.nan), "budgets must be finite"),
    ("a budget of 0", lambda s: s["budgets"].__setitem__(0, 0.0), "budgets must be > 0"),
    ("a sampling rate above 1", lambda s: s["group_rates"].__setitem__(0, 1.5), r"sample_rates must lie in \[0, 1\]"),
    ("a negative noise multiplier", lambda s: s["group_noise"].__setitem__(0, -1.0), "noise_multipliers must be >= 0"),
    ("rates and noise of other lengths", lambda s: s.update(group_noise=s["group_noise"][:1].repeat(5)),
     "group_rates and group_noise do not match"),
    ("a record's group past the groups", lambda s: s["group_of"].__setitem__(0, 99), "group_of out of range"),
    ("group_of of two dims", lambda s: s.update(group_of=s["group_of"].reshape(3, 4)), "group_of must be 1-D"),
    ("negative steps", lambda s: s.update(steps_taken=np.int64(-2)), "steps_taken must be >= 0"),
    ("another format", lambda s: s.update(format_version=np.int64(99)), "unsupported ledger format_version"),
    # a count cast to int dropped its fraction: 4.9 steps loaded as 4 (under-reported), group 1.5 as row 1
    ("fractional steps", lambda s: s.update(steps_taken=np.float64(4.9)), "steps_taken must hold whole numbers"),
    ("steps as text", lambda s: s.update(steps_taken=np.str_("4")), "steps_taken must hold whole numbers"),
    ("steps as a bool", lambda s: s.update(steps_taken=np.bool_(True)), "steps_taken must hold whole numbers"),
    ("a fractional group index", lambda s: s.update(group_of=s["group_of"] + 0.5), "group_of must hold whole numbers"),
    ("has_budgets as text", lambda s: s.update(has_budgets=np.str_("no")), "has_budgets must be True or False"),
    ("has_budgets as 0/1", lambda s: s.update(has_budgets=np.int64(1)), "has_budgets must be True or False"),
    ("a format_version as text", lambda s: s.update(format_version=np.str_("1")),
     "format_version must hold whole numbers"),
]


@pytest.mark.parametrize("kind", sorted(LEDGERS))
@pytest.mark.parametrize("what,damage,message", RECORD_DAMAGE, ids=[d[0] for d in RECORD_DAMAGE])
def test_a_damaged_ledger_state_is_refused_and_the_ledger_is_unchanged(kind, what, damage, message):
    state = _refused_and_unchanged(_ledger(kind), damage, message)
    fresh = LEDGERS[kind].__new__(LEDGERS[kind])
    with pytest.raises(ValueError, match=message):
        fresh.load_state_dict(state)


RDP_DAMAGE = [
    ("negative accumulated RDP", lambda s: s.update(group_rdp=-s["group_rdp"]), "accumulated RDP must be >= 0"),
    ("NaN accumulated RDP", lambda s: s["group_rdp"].__setitem__((0, 0), np.nan), "accumulated RDP must be >= 0"),
    ("RDP of another order count", lambda s: s.update(group_rdp=s["group_rdp"][:, 1:]), "group_rdp has shape"),
    ("an order of 1", lambda s: s["orders"].__setitem__(0, 1.0), "orders must all be > 1"),
    ("an own order of 0.5", lambda s: s.update(group_own_order=np.full_like(s["group_own_order"], 0.5)),
     "group_own_order must be finite and > 1"),
]


@pytest.mark.parametrize("what,damage,message", RDP_DAMAGE, ids=[d[0] for d in RDP_DAMAGE])
def test_a_damaged_rdp_history_is_refused_and_the_ledger_is_unchanged(what, damage, message):
    _refused_and_unchanged(_ledger("rdp"), damage, message)


PLD_DAMAGE = [
    ("a negative horizon", lambda s: s.update(horizon=np.int64(-1)), "horizon must be >= 0"),
    ("a zero discretization", lambda s: s.update(value_discretization_interval=np.float64(0.0)),
     "value_discretization_interval must be finite and > 0"),
    ("a fractional horizon", lambda s: s.update(horizon=np.float64(2.5)), "horizon must hold whole numbers"),
    ("an infinite noise multiplier", lambda s: s["group_noise"].__setitem__(0, np.inf),
     "noise_multipliers must be finite for the PLD ledger"),
]


@pytest.mark.parametrize("what,damage,message", PLD_DAMAGE, ids=[d[0] for d in PLD_DAMAGE])
def test_a_damaged_pld_setting_is_refused_and_the_ledger_is_unchanged(what, damage, message):
    _refused_and_unchanged(_ledger("pld"), damage, message)


def test_whole_counts_stored_as_floats_still_load():
    """A state that went through a float format (JSON) keeps whole counts: 5.0 steps are 5 steps."""
    ledger = _ledger("pld")
    state = ledger.state_dict() | {"steps_taken": np.float64(5.0), "horizon": np.float64(0.0)}
    again = PLDIndividualAccountant.__new__(PLDIndividualAccountant)
    again.load_state_dict(state)
    assert again.steps_taken == 5 and again.horizon is None
    np.testing.assert_array_equal(again.epsilons(DELTA), ledger.epsilons(DELTA))


@pytest.mark.parametrize("kind", sorted(LEDGERS))
def test_a_state_missing_entries_is_refused_naming_every_missing_key_not_a_key_error(kind):
    ledger = _ledger(kind)
    before = ledger.state_dict()
    state = {k: v for k, v in ledger.state_dict().items() if k not in ("steps_taken", "group_of")}
    with pytest.raises(ValueError, match=f"ledger state lacks group_of, steps_taken: not a state_dict.. of a "
                                         f"{LEDGERS[kind].__name__}"):
        ledger.load_state_dict(state)
    assert _same_state(ledger.state_dict(), before)
    own = "horizon" if kind == "pld" else "group_rdp"
    with pytest.raises(ValueError, match=f"ledger state lacks {own}"):
        ledger.load_state_dict({k: v for k, v in ledger.state_dict().items() if k != own})


@pytest.mark.parametrize("kind", sorted(LEDGERS))
@pytest.mark.parametrize("state", [None, [1, 2], "ledger.npz"], ids=["None", "list", "str"])
def test_a_state_that_is_not_a_dict_is_a_type_error(kind, state):
    ledger = _ledger(kind)
    before = ledger.state_dict()
    with pytest.raises(TypeError, match="ledger state must be a dict"):
        ledger.load_state_dict(state)
    assert _same_state(ledger.state_dict(), before)


@pytest.mark.parametrize("kind", sorted(LEDGERS))
def test_loading_an_empty_file_names_the_missing_entries(kind, tmp_path):
    np.savez(tmp_path / "empty.npz")
    with pytest.raises(ValueError, match="ledger state lacks format_version, group_of"):
        LEDGERS[kind].load(tmp_path / "empty.npz")


@pytest.mark.parametrize("kind", sorted(LEDGERS))
def test_a_loaded_ledger_reports_and_refuses_as_the_saved_one(kind, tmp_path):
    ledger = _ledger(kind)
    path = tmp_path / "ledger.npz"
    ledger.save(path)
    again = LEDGERS[kind].load(path)
    np.testing.assert_array_equal(again.epsilons(DELTA), ledger.epsilons(DELTA))
    np.testing.assert_array_equal(again.remaining(DELTA), ledger.remaining(DELTA))
    np.testing.assert_array_equal(again.would_exceed(DELTA, 400), ledger.would_exceed(DELTA, 400))
    assert again.would_exceed(DELTA, 400).any() and not again.would_exceed(DELTA, 1).any()


@pytest.mark.parametrize("kind", sorted(LEDGERS))
def test_remaining_without_budgets_names_the_ledger(kind):
    with pytest.raises(ValueError, match=f"remaining needs budgets .*{LEDGERS[kind].__name__}"):
        LEDGERS[kind](0.1, 1.0).remaining(DELTA)


@pytest.mark.parametrize("entry", [(float("nan"), 0.1, 3), (-1.0, 0.1, 3), (1.0, 1.5, 3), (1.0, 0.1, 0)],
                         ids=["NaN noise", "negative noise", "rate above 1", "no steps"])
def test_a_uniform_accountant_history_that_cannot_be_steps_is_refused_and_kept(entry):
    from pdpfast.accounting.history import RDPAccountant

    accountant = RDPAccountant()
    accountant.step(noise_multiplier=1.0, sample_rate=0.1)
    state = accountant.state_dict()
    before = accountant.get_epsilon(DELTA)
    state["history"].append(list(entry))
    with pytest.raises(ValueError, match="cannot be a step"):
        accountant.load_state_dict(state)
    assert accountant.history == [(1.0, 0.1, 1)] and accountant.get_epsilon(DELTA) == before
    state["history"].pop()
    accountant.load_state_dict(state)
    assert accountant.get_epsilon(DELTA) == before
