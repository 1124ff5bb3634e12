"""The clients of a federation share the setting-only work of their setup (the exact grid their
rates are read off, one round's RDP per rate); remembering it must not change a number."""
import numpy as np

from pdpfast.accounting import rpdp
from pdpfast.fl import ledger as fl_ledger
from pdpfast.fl.ledger import FederatedLedger, round_rdp

SETTING = dict(noise_multiplier=1.5, delta=1e-4, local_steps=5, rounds=20, client_rate=0.5)


def test_rates_read_off_a_remembered_grid_are_the_rates_of_a_fresh_one(monkeypatch):
    rng = np.random.default_rng(0)
    budgets = [rng.uniform(1, 8, 5000), rng.uniform(1, 8, 5000)]   # > REFINE_MAX: the grid path
    rpdp._GRID_MEMO.clear()
    remembered = [rpdp.sample_rates(b, **SETTING) for b in budgets]
    assert len(next(iter(rpdp._GRID_MEMO.values()))) > 64
    monkeypatch.setattr(rpdp, "_grid_eps", lambda qs, s: rpdp._eps(qs, s)[0])   # no memo
    for b, q in zip(budgets, remembered):
        np.testing.assert_array_equal(q, rpdp.sample_rates(b, **SETTING))


def test_a_ledger_of_remembered_round_rdp_accounts_as_a_fresh_one():
    rng = np.random.default_rng(1)
    kw = dict(noise_multiplier=1.5, local_steps=5, client_rate=0.5, delta=1e-4)
    fl_ledger._ROUND_MEMO.clear()
    for _ in range(2):   # the second ledger reads every row from the memo
        q = rng.choice(np.geomspace(1e-3, 0.5, 40), 300)
        ledger = FederatedLedger(q, np.full(300, 5.0), **kw)
        fresh = round_rdp(np.unique(q), noise_multiplier=1.5, local_steps=5, client_rate=0.5)
        for threat in ("clients", "server"):
            np.testing.assert_array_equal(ledger._round_rdp[threat], fresh[threat])
    empty = FederatedLedger(np.zeros(0), np.zeros(0) + 1.0, **kw)
    assert empty._round_rdp["clients"].shape == (0, empty.orders.shape[0])
