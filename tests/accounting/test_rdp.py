"""RDP of the subsampled Gaussian and its conversion, against Opacus, dp-accounting and mpmath."""
import warnings

import mpmath
import numpy as np
import pytest
from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
from dp_accounting.rdp import RdpAccountant
from opacus.accountants.analysis import rdp as opacus_rdp

from pdpfast.accounting import DEFAULT_ORDERS, _grid, compute_rdp, get_noise_multiplier, get_privacy_spent
from pdpfast.accounting.rdp import OPACUS_ORDERS

# Opacus evaluates log Σ_k terms directly, so its own rounding error is ~1e-16 absolute per step in
# log A_α (more for α near 1: ρ = log A/(α − 1)); pdpfast is accurate to a few ulps. Relative 1e-10
# agreement holds wherever Opacus itself is that accurate; elsewhere the gap is Opacus's error.
RTOL = 1e-10


def _atol(steps, orders):
    return 1e-14 * steps / np.minimum(np.asarray(orders) - 1.0, 1.0)


def _opacus(q, z, steps, orders):
    return np.asarray(opacus_rdp.compute_rdp(q=q, noise_multiplier=z, steps=steps, orders=list(orders)))


def _random_cases(seed, n):
    rng = np.random.default_rng(seed)
    for k in range(n):
        if k % 5 == 4:
            q = float(rng.uniform(0.2, 0.95))          # large rates: long fractional series tails
        else:
            q = float(10 ** rng.uniform(-5, -0.5))
        z = float(10 ** rng.uniform(-0.3, 1.2))
        steps = int(rng.integers(1, 20000))
        yield q, z, steps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_opacus_on_random_inputs(seed):
    orders = np.array(OPACUS_ORDERS)
    for q, z, steps in _random_cases(seed, 20):
        ours = compute_rdp(q, z, steps, orders)
        ref = _opacus(q, z, steps, orders)
        np.testing.assert_array_less(np.abs(ours - ref), RTOL * np.abs(ref) + _atol(steps, orders) + 1e-300,
                                     err_msg=f"q={q} z={z} T={steps}")


def test_matches_opacus_relative_where_opacus_is_accurate():
    # moderate rates: log A_α is not tiny, so both sides carry ~1e-16 relative error. Orders in
    # (1, 1.5) are left out: there the series sums thousands of terms and ρ = log A/(α − 1)
    # amplifies their rounding ten-fold (both Opacus and this port are ~1e-9 off the exact value).
    rng = np.random.default_rng(11)
    orders = np.array([a for a in OPACUS_ORDERS if a >= 1.5])
    for _ in range(10):
        q, z, steps = float(10 ** rng.uniform(-2, -0.5)), float(rng.uniform(0.5, 3)), int(rng.integers(1, 5000))
        np.testing.assert_allclose(compute_rdp(q, z, steps, orders), _opacus(q, z, steps, orders), rtol=RTOL)


def test_extended_orders_match_opacus():
    orders = [64, 128, 256, 512, 2.5, 7.3]
    for q, z in [(0.001, 0.8), (0.02, 1.5), (0.3, 4.0)]:
        np.testing.assert_allclose(compute_rdp(q, z, 100, orders), _opacus(q, z, 100, orders), rtol=RTOL,
                                   atol=1e-12)


def test_is_more_accurate_than_cancellation_allows():
    """Tiny q: A_α − 1 ≈ 1e-12; pdpfast stays at full relative precision (mpmath reference)."""
    mpmath.mp.dps = 50
    for q, z, alpha in [(1e-6, 1.0, 2), (3e-5, 2.0, 5), (1e-4, 0.7, 32)]:
        qm, zm = mpmath.mpf(q), mpmath.mpf(z)
        a = sum(mpmath.binomial(alpha, k) * (1 - qm) ** (alpha - k) * qm ** k * mpmath.exp((k * k - k) / (2 * zm * zm))
                for k in range(alpha + 1))
        exact = float(mpmath.log(a) / (alpha - 1))
        assert compute_rdp(q, z, 1, [alpha])[0] == pytest.approx(exact, rel=1e-12)


def test_broadcasts_over_rates_and_noise():
    rng = np.random.default_rng(3)
    q = 10 ** rng.uniform(-4, -1, size=(4, 1))
    z = rng.uniform(0.6, 3.0, size=(1, 3))
    out = compute_rdp(q, z, 50, [1.5, 2, 8, 32])
    assert out.shape == (4, 3, 4)
    for i in range(4):
        for j in range(3):
            np.testing.assert_allclose(out[i, j], compute_rdp(float(q[i, 0]), float(z[0, j]), 50, [1.5, 2, 8, 32]),
                                       rtol=1e-14)
    assert compute_rdp(0.01, 1.0, 10, 4.0).shape == ()


def test_special_cases():
    orders = np.array([1.5, 2.0, 10.0, 64.0])
    np.testing.assert_array_equal(compute_rdp(0.0, 1.3, 100, orders), 0.0)
    np.testing.assert_allclose(compute_rdp(1.0, 1.3, 7, orders), 7 * orders / (2 * 1.3 ** 2), rtol=1e-15)
    assert np.all(np.isinf(compute_rdp(0.5, 0.0, 1, orders)))
    np.testing.assert_array_equal(compute_rdp(0.5, 1.0, 0, orders), 0.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(q=1.5, noise_multiplier=1.0, steps=1, orders=[2]), "q"),
    (dict(q=0.1, noise_multiplier=-1.0, steps=1, orders=[2]), "noise_multiplier"),
    (dict(q=0.1, noise_multiplier=1.0, steps=-1, orders=[2]), "steps"),
    (dict(q=0.1, noise_multiplier=1.0, steps=1, orders=[0.5, 2]), "orders"),
])
def test_compute_rdp_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_rdp(**kwargs)


def test_integer_orders_match_dp_accounting_and_fractional_stay_below_it():
    # dp-accounting's fractional series adds |terms| (an upper bound); integer orders are exact
    for q, z, steps in [(0.01, 1.1, 1000), (0.2, 2.0, 50), (0.001, 0.7, 10000)]:
        acc = RdpAccountant(orders=list(DEFAULT_ORDERS))
        acc.compose(SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(z)), steps))
        theirs = np.asarray(acc._rdp)
        ours = compute_rdp(q, z, steps)
        is_int = np.array([float(a).is_integer() for a in DEFAULT_ORDERS])
        np.testing.assert_allclose(ours[is_int], theirs[is_int], rtol=1e-10, atol=1e-13 * steps)
        assert np.all(ours[~is_int] <= theirs[~is_int] * (1 + 1e-10) + 1e-13 * steps)
        eps, _ = get_privacy_spent(DEFAULT_ORDERS, ours, 1e-5)
        theirs_eps = acc.get_epsilon(1e-5)
        assert theirs_eps * (1 - 1e-2) <= eps <= theirs_eps * (1 + 1e-12)
        int_orders = np.array(DEFAULT_ORDERS)[is_int]
        ours_int, _ = get_privacy_spent(int_orders, ours[is_int], 1e-5)
        acc_int = RdpAccountant(orders=list(int_orders))
        acc_int.compose(SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(z)), steps))
        assert ours_int == pytest.approx(acc_int.get_epsilon(1e-5), rel=1e-10)


def test_quadrature_engine_matches_series():
    """Calibration evaluates fractional orders by quadrature; it must agree with the series."""
    rng = np.random.default_rng(5)
    q = 10 ** rng.uniform(-4, -0.3, 40)
    z = 10 ** rng.uniform(-0.3, 1.0, 40)
    orders = np.array(DEFAULT_ORDERS)
    fast = _grid.rdp_one_step(q, z, orders)
    series = compute_rdp(q, z, 1, orders)
    np.testing.assert_array_less(np.abs(fast - series), 1e-10 * series + 1e-12 / np.minimum(orders - 1, 1))


def test_orders_the_quadrature_cannot_reach_are_charged_infinity_not_a_crash():
    """Below z ≈ 0.0016·√α the trapezoidal rule would need over a million nodes (at z·h = 4e-11, a
    steep noise schedule's last step, the count overflowed int64 and the calibration died in numpy):
    those fractional orders get ρ = +inf, an upper bound, and the integer orders stay exact."""
    from pdpfast.accounting import orders as own_orders
    from pdpfast.accounting import sgm

    q, z = np.array([0.1, 0.5, 0.01, 0.2]), np.array([1e-170, 1e-3, 4e-11, 0.5])
    orders = np.array(DEFAULT_ORDERS)
    is_int = sgm.is_integer_order(orders)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # 1/(2z²) overflows at z = 1e-170: ρ = inf, as it is
        rdp = sgm.rdp_one_step(q, z, orders)
        series = sgm.rdp_one_step_series(q, z, orders[is_int])
    assert not np.isnan(rdp).any()
    unreachable = sgm.QUAD_MAX_NODES < np.ceil((orders / z[:, None] + 2 * sgm.QUAD_WIDTH) / (0.4 * z[:, None]))
    assert unreachable[:3, ~is_int].all() and not unreachable[3].any()
    assert np.isinf(rdp[:3, ~is_int]).all() and np.isfinite(rdp[3]).all()
    np.testing.assert_array_equal(rdp[:, is_int], series)    # the integer orders: the exact sum, one code path
    assert np.isfinite(rdp[1:, is_int]).all()
    # one order per point (the ledgers' own orders) likewise
    at = sgm.rdp_at(q[1:], z[1:], np.array([1.5, 2.5, 1.5]))
    assert np.isinf(at[:2]).all() and np.isfinite(at[2])
    eps, alpha = own_orders.optimal_orders(q[1:3], z[1:3], 10, 1e-5, np.full(2, 2.0), np.full(2, 1.1), np.full(2, 9.0))
    assert np.all(eps > 1e10) and not np.isnan(eps).any()


def test_get_privacy_spent_matches_opacus():
    rng = np.random.default_rng(7)
    orders = np.array(DEFAULT_ORDERS)
    rows = []
    for _ in range(6):
        q, z, steps = float(10 ** rng.uniform(-3, -1)), float(rng.uniform(0.7, 4)), int(rng.integers(10, 5000))
        rows.append(compute_rdp(q, z, steps, orders))
    rdp = np.stack(rows)
    eps, best = get_privacy_spent(orders, rdp, 1e-5)
    assert eps.shape == best.shape == (6,)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in range(6):
            e, o = opacus_rdp.get_privacy_spent(orders=list(orders), rdp=list(rdp[k]), delta=1e-5)
            assert eps[k] == pytest.approx(e, rel=1e-14)
            assert best[k] == o
    e1, o1 = get_privacy_spent(orders, rdp[0], 1e-5)
    assert isinstance(e1, float) and e1 == eps[0] and o1 == best[0]


def test_get_privacy_spent_warns_at_the_edge_of_the_grid():
    orders = [2.0, 3.0, 4.0]
    with pytest.warns(UserWarning, match="largest alpha"):
        get_privacy_spent(orders, compute_rdp(1e-4, 5.0, 10, orders), 1e-5)


def test_get_privacy_spent_rejects_bad_delta_and_shapes():
    with pytest.raises(ValueError, match="delta"):
        get_privacy_spent([2, 3], [0.1, 0.2], 1.5)
    with pytest.raises(ValueError, match="same length"):
        get_privacy_spent([2, 3], [0.1, 0.2, 0.3], 1e-5)


def test_all_nan_rdp_gives_infinite_epsilon():
    eps, order = get_privacy_spent([2, 3], [np.nan, np.nan], 1e-5)
    assert eps == np.inf and np.isnan(order)


def test_windowed_orders_find_the_all_orders_optimum():
    """Calibration curves evaluate most points on a window of orders; the minimum must not change."""
    orders = np.array(DEFAULT_ORDERS)
    rng = np.random.default_rng(9)
    for _ in range(3):
        z, steps = float(rng.uniform(0.6, 3.0)), int(rng.integers(10, 5000))
        q = np.geomspace(1e-5, 1.0, 300)
        eps_curve, idx_curve = _grid.eps_curve(q, np.array([z]), steps, 1e-5, orders)
        eps_full, idx_full = _grid.eps_masked(q, np.array([z]), steps, 1e-5, orders)
        np.testing.assert_array_equal(eps_curve, eps_full)
        np.testing.assert_array_equal(idx_curve, idx_full)


@pytest.mark.parametrize("budget, delta", [(0.005, 1e-5), (1.0, 1e-300)])
def test_a_budget_only_larger_orders_can_meet_is_refused_with_a_suggestion_to_pass_them(budget, delta):
    with pytest.raises(ValueError, match=r"largest RDP order, 512, is what limits it.*pass orders= with larger orders"):
        get_noise_multiplier(budget, delta, sample_rate=0.01, steps=1000)
    wide = list(DEFAULT_ORDERS) + [1024, 2048, 4096]
    assert get_noise_multiplier(budget, delta, sample_rate=0.01, steps=1000, orders=wide) < 1e6
