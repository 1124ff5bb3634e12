"""get_noise_multiplier / get_sample_rate: safe side always, tight, vectorized."""
import warnings

import numpy as np
import pytest
from opacus.accountants.analysis import rdp as opacus_rdp
from opacus.accountants.utils import get_noise_multiplier as opacus_noise

from pdpfast.accounting import DEFAULT_ORDERS, get_noise_multiplier, get_sample_rate
from pdpfast.accounting.rdp import OPACUS_ORDERS


def _opacus_eps(q, z, steps, orders=DEFAULT_ORDERS):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rdp = opacus_rdp.compute_rdp(q=q, noise_multiplier=z, steps=steps, orders=list(orders))
        return opacus_rdp.get_privacy_spent(orders=list(orders), rdp=rdp, delta=1e-5)[0]


@pytest.mark.filterwarnings("ignore:Optimal order")
@pytest.mark.parametrize("q, steps, sigma", [(512 / 60000, 9375, 3.425), (1024 / 73257, 2146, 2.747),
                                             (1024 / 50000, 1465, 3.293)])
def test_reference_noise_multipliers(q, steps, sigma):
    ours = get_noise_multiplier(1.0, 1e-5, q, steps, orders=OPACUS_ORDERS)
    assert ours == pytest.approx(sigma, rel=5e-3)
    assert _opacus_eps(q, ours, steps, OPACUS_ORDERS) <= 1.0
    # Opacus's bisection stops within 0.01 in ε on the safe side: never below the exact root
    assert ours <= opacus_noise(target_epsilon=1.0, target_delta=1e-5, sample_rate=q, steps=steps)


def test_noise_multiplier_is_the_smallest_safe_one():
    rng = np.random.default_rng(0)
    for _ in range(4):
        eps, q, steps = float(rng.uniform(0.3, 8)), float(10 ** rng.uniform(-3, -1)), int(rng.integers(10, 3000))
        z = get_noise_multiplier(eps, 1e-5, q, steps)
        assert _opacus_eps(q, z, steps) <= eps
        assert _opacus_eps(q, z * (1 - 1e-6), steps) > eps * (1 - 1e-6)


def test_sample_rate_is_the_largest_safe_one():
    rng = np.random.default_rng(1)
    budgets = rng.uniform(0.5, 20, 6)
    q = get_sample_rate(budgets, 1e-5, 1.0, 1000)
    for e, r in zip(budgets, q):
        assert _opacus_eps(r, 1.0, 1000) <= e
        if r < 1:
            assert _opacus_eps(min(1.0, r * (1 + 1e-6)), 1.0, 1000) > e * (1 - 1e-6)


def test_sample_rate_is_one_when_even_full_batches_fit():
    assert get_sample_rate(1e4, 1e-5, 2.0, 10) == 1.0


def test_vectorized_over_many_budgets_never_overshoots():
    rng = np.random.default_rng(2)
    budgets = rng.uniform(1, 10, 20_000)            # > 4096 distinct: the exact-grid path
    q = get_sample_rate(budgets, 1e-5, 1.0, 1000)
    z = get_noise_multiplier(budgets, 1e-5, 0.01, 1000)
    assert q.shape == z.shape == budgets.shape
    pick = rng.choice(budgets.size, 12, replace=False)
    for i in pick:
        e_q, e_z = _opacus_eps(q[i], 1.0, 1000), _opacus_eps(0.01, z[i], 1000)
        assert e_q <= budgets[i] and e_q >= 0.995 * budgets[i]
        assert e_z <= budgets[i] and e_z >= 0.995 * budgets[i]
    # monotone in the budget
    order = np.argsort(budgets)
    assert np.all(np.diff(q[order]) >= 0) and np.all(np.diff(z[order]) <= 0)


def test_scalar_in_scalar_out_and_shape_kept():
    assert isinstance(get_noise_multiplier(2.0, 1e-5, 0.01, 100), float)
    assert get_sample_rate(np.full((2, 3), 2.0), 1e-5, 1.0, 100).shape == (2, 3)


@pytest.mark.parametrize("args, match", [
    ((0.0, 1e-5, 0.01, 100), "target_epsilon"),
    ((np.nan, 1e-5, 0.01, 100), "target_epsilon"),
    ((1.0, 1.0, 0.01, 100), "target_delta"),
    ((1.0, 1e-5, 0.0, 100), "sample_rate"),
    ((1.0, 1e-5, 0.01, 0), "steps"),
    ((1.0, 1e-5, 0.01, 2.5), "steps"),
])
def test_noise_multiplier_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        get_noise_multiplier(*args)


def test_noise_multiplier_rejects_unknown_accountant():
    with pytest.raises(ValueError, match="accountant"):
        get_noise_multiplier(1.0, 1e-5, 0.01, 100, accountant="prv")


def test_unreachable_budget_is_refused_with_the_budget_named():
    with pytest.raises(ValueError, match="target_epsilon=0.001"):
        get_sample_rate(0.001, 1e-5, 1.0, 100)
    with pytest.raises(ValueError, match="noise_multiplier"):
        get_sample_rate(1.0, 1e-5, -1.0, 100)
