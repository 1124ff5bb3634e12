"""rPDP-FL: record-level personalized DP in cross-silo federated learning (DESIGN.md §3.3).

Liu, Lou, Xiong, Liu, Meng, "Cross-silo Federated Learning with Record-level Personalized
Differential Privacy", CCS 2024. Each of T rounds samples every client with probability λ; a
sampled client runs τ local DP-SGD steps, record j sampled at rate q_j with noise multiplier σ.

* local RDP after τ steps: ρ^τ(α) = τ·ρ_SGM(α; q, σ)
* threat "clients" (other clients / third parties see global models): client-level subsampling
  amplifies, ρ^{τ,λ}(α) ≤ log(1 − λ + λ·exp((α−1)ρ^τ(α)))/(α−1), and ρ_FL = T·ρ^{τ,λ};
* threat "server" (an honest-but-curious server sees client updates): ρ_FL = λ·T·ρ^τ, the paper's
  figure. It is ε after the *expected* number of rounds, λT, and not a bound over the client
  sampling: the server knows the number K ~ Binomial(T, λ) of rounds a client took part in, and a
  record's ε after K > λT rounds is higher. The guarantee under this threat is the federated
  ledger's (``fl.ledger``: it charges ρ^τ for the rounds that happened and drops a record before
  it would exceed its budget). A bound that holds before the run is T·ρ^{τ,λ}, the "clients"
  figure: it is the exact RDP of (K, updates) (log E[e^{(α−1)Kρ^τ}]/(α−1)), ≥ λ·T·ρ^τ by Jensen;
* conversion "standard" (the paper's): ε = min_α ρ_FL(α) + log(1/δ)/(α−1); "improved": Balle et
  al. (2020), as ``rdp.get_privacy_spent``.

Simulation-CurveFitting (SCF) fits ε*(q) ≈ exp(a·q + b) + c on a grid and inverts it; the fit
can overshoot, so ``sample_rates`` re-accounts every record exactly and corrects q (never over
budget, never more than 1% under unless q = 1).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from scipy import optimize

from .._checks import (
    as_float_array,
    check_choice,
    check_delta,
    check_epsilons,
    check_int,
    check_positive,
    check_positive_integer,
    check_rate,
)
from . import _grid
from .sgm import DEFAULT_ORDERS, as_orders, check_rdp, eps_from_rdp, rdp_one_step

__all__ = ["SCFEstimator", "client_sampled_rdp", "epsilon", "fit_scf", "rdp_to_epsilon", "sample_rates"]


def client_sampled_rdp(rho_local: np.ndarray, orders: np.ndarray, client_rate: float) -> np.ndarray:
    """RDP after client-level Poisson sampling at rate λ of a client whose local RDP is ρ^τ:
    ρ^{τ,λ}(α) = log(1 − λ + λ·e^{(α−1)ρ^τ(α)})/(α−1) (Liu et al. 2024).

    The one place this privacy-critical bound is written (the rPDP-FL accountant and the federated
    ledger both call it). log1p(λ·expm1 x) is exact for small x = (α−1)ρ^τ, logaddexp for large.

    Args:
        rho_local: (..., n) float64 local RDP ρ^τ(α) ≥ 0 (may be +inf; not NaN).
        orders: (n,) float64 RDP orders α > 1.
        client_rate: λ in (0, 1], the Poisson rate at which the client is sampled.
    Returns:
        (..., n) float64 amplified RDP ρ^{τ,λ}(α).
    Raises:
        TypeError for values that are not numbers (a bool or a string λ included); ValueError for λ
        outside (0, 1] (λ = 2 gave a wrong bound, NaN a NaN one), a negative or NaN local RDP, an order
        ≤ 1, or rho_local whose last axis is not one value per order.
    """
    lam = check_rate("client_rate", client_rate)
    orders = as_orders(orders)[0]
    rho_local = check_rdp("rho_local", rho_local, allow_nan=False)
    if rho_local.ndim == 0 or rho_local.shape[-1] != orders.shape[0]:
        raise ValueError(f"rho_local must have one value per order on its last axis ({orders.shape[0]}), got shape "
                         f"{rho_local.shape}")
    x = (orders - 1.0) * rho_local
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        small = np.log1p(lam * np.expm1(np.minimum(x, 30.0)))
        large = np.logaddexp(np.log1p(-lam) if lam < 1 else -np.inf, np.log(lam) + x)
    return np.where(x < 30.0, small, large) / (orders - 1.0)


def rdp_to_epsilon(orders: np.ndarray, rdp: np.ndarray, delta: float, conversion: str):
    """(ε, optimal order index) per row of rdp, minimized over orders.

    "standard" (the paper's): ε = ρ(α) + log(1/δ)/(α − 1); "improved" (Balle et al. 2020, as
    ``rdp.get_privacy_spent``): ε = ρ(α) − (log δ + log α)/(α − 1) + log((α − 1)/α).

    Args:
        orders: (n,) float64 RDP orders α > 1.
        rdp: (P, n) float64 RDP values ≥ 0, not NaN (any leading shape (..., n)).
        delta: δ in (0, 1).
        conversion: "standard" or "improved".
    Returns:
        (eps, idx): eps (P,) float64 ε (not clamped at 0); idx (P,) intp index of the optimal order.
    Raises:
        TypeError for values that are not numbers; ValueError for δ outside (0, 1) (δ = 2 gave ε < 0,
        δ = 0 a ZeroDivisionError), a negative or NaN RDP value (it would lower ε, or make it NaN), an
        order ≤ 1, rdp whose last axis is not one value per order, or an unknown conversion.
    """
    delta = check_delta("delta", delta)
    check_choice("conversion", conversion, _CONVERSIONS)
    orders = as_orders(orders)[0]
    rdp = check_rdp("rdp", rdp, allow_nan=False)
    if rdp.ndim == 0 or rdp.shape[-1] != orders.shape[0]:
        raise ValueError(f"rdp must have one value per order on its last axis ({orders.shape[0]}), got shape "
                         f"{rdp.shape}")
    if conversion == "improved":
        return eps_from_rdp(orders, rdp, delta)
    eps = rdp + np.log(1.0 / delta) / (orders - 1.0)
    idx = np.argmin(eps, axis=-1)
    return np.take_along_axis(eps, idx[..., None], axis=-1)[..., 0], idx

_THREATS = ("clients", "server")
_CONVERSIONS = ("standard", "improved")


@dataclass(frozen=True)
class _Setting:
    noise_multiplier: float
    delta: float
    local_steps: int
    rounds: int
    client_rate: float
    threat: str
    conversion: str
    orders: np.ndarray


def _setting(noise_multiplier, delta, local_steps, rounds, client_rate, threat, conversion, orders) -> _Setting:
    z = check_positive("noise_multiplier", noise_multiplier)   # not None, a bool or "1.0"
    lam = check_rate("client_rate", client_rate)
    if threat not in _THREATS:
        raise ValueError(f"threat must be one of {_THREATS}, got {threat!r}")
    if conversion not in _CONVERSIONS:
        raise ValueError(f"conversion must be one of {_CONVERSIONS}, got {conversion!r}")
    return _Setting(z, check_delta("delta", delta), check_positive_integer("local_steps", local_steps),
                    check_positive_integer("rounds", rounds), lam, threat, conversion,
                    as_orders(DEFAULT_ORDERS if orders is None else orders)[0])


def _eps(q: np.ndarray, s: _Setting):
    """(ε (P,), optimal order index (P,)) for sampling rates q (P,)."""
    orders = s.orders
    rho_local = s.local_steps * rdp_one_step(q, np.array([s.noise_multiplier]), orders)   # ρ^τ(α)
    if s.threat == "server":
        rho_fl = s.client_rate * s.rounds * rho_local
    else:
        rho_fl = s.rounds * client_sampled_rdp(rho_local, orders, s.client_rate)
    return rdp_to_epsilon(orders, rho_fl, s.delta, s.conversion)


def epsilon(q, *, noise_multiplier, delta, local_steps, rounds, client_rate, threat="clients",
            conversion="standard", orders=None):
    """ε of each record of an rPDP-FL run, vectorized over q.

    Args:
        q: record sampling rate(s) in [0, 1] (scalar or array; an empty array gives an empty result).
        noise_multiplier: σ > 0 of local DP-SGD (noise std / clip norm).
        delta: δ in (0, 1).
        local_steps: τ, local DP-SGD steps per round (positive int).
        rounds: T, the number of rounds (positive int).
        client_rate: λ in (0, 1], the server's Poisson rate over clients.
        threat: "clients" (ρ_FL = T·ρ^{τ,λ}) or "server" (ρ_FL = λ·T·ρ^τ: ε after the expected λT
            rounds of the client, not a bound over the client sampling; see the module docstring).
        conversion: "standard" (ε = min_α ρ + log(1/δ)/(α−1), the paper's) or "improved".
        orders: RDP orders α > 1 (default ``DEFAULT_ORDERS``).
    Returns:
        ε with the shape of q (float for a scalar).
    Raises:
        TypeError for an argument that is not a number (None, a bool, a string such as "0.1");
        ValueError naming a bad argument (q outside [0, 1], σ, λ, threat, conversion, ...).
    """
    s = _setting(noise_multiplier, delta, local_steps, rounds, client_rate, threat, conversion, orders)
    qa = as_float_array("q", q)
    if np.any(~np.isfinite(qa)) or np.any((qa < 0) | (qa > 1)):
        raise ValueError("q must lie in [0, 1]")
    if qa.size == 0:
        return np.zeros(qa.shape)
    flat, inverse = np.unique(qa.ravel(), return_inverse=True)
    out = _eps(flat, s)[0][inverse].reshape(qa.shape)
    return float(out) if qa.ndim == 0 else out


@dataclass(frozen=True)
class SCFEstimator:
    """ε*(q) ≈ exp(a·q + b) + c fitted on ``q_grid`` (Simulation-CurveFitting, ``fit_scf``).

    Attributes:
        a, b, c: the fitted coefficients (floats).
        r2: the fit's coefficient of determination R² on the grid.
        eps_max: ε*(1), exactly accounted (the grid's last point).
        q_grid: (K,) float64 sample rates the fit was made on (0.01..1).
        eps_grid: (K,) float64 their exact ε*.
    """

    a: float
    b: float
    c: float
    r2: float
    eps_max: float
    q_grid: np.ndarray
    eps_grid: np.ndarray

    def predict(self, q):
        """The fitted ε*(q) = exp(a·q + b) + c (an approximation, not an accounting).

        Args:
            q: sample rate(s) in [0, 1], a scalar or an array.
        Returns:
            float64 ε with the shape of q (a numpy scalar for a scalar).
        Raises:
            TypeError for values that are not numbers; ValueError for a q outside [0, 1].
        """
        qa = as_float_array("q", q)
        if not np.all(np.isfinite(qa) & (qa >= 0) & (qa <= 1)):
            raise ValueError("q must lie in [0, 1]")
        return np.exp(self.a * qa + self.b) + self.c

    def inverse(self, eps):
        """q = (ln(ε − c) − b)/a clipped to [0, 1] (may overshoot: see ``sample_rates``).

        Args:
            eps: budget(s) ε, a scalar or an array.
        Returns:
            q with the shape of eps (a float for a scalar): 1 where ε ≥ ``eps_max``, 0 where ε ≤ c.
        Raises:
            TypeError for values that are not numbers; ValueError for a NaN budget.
        """
        e = as_float_array("eps", eps)
        if np.isnan(e).any():
            raise ValueError("eps must not be NaN")
        with np.errstate(invalid="ignore", divide="ignore"):
            q = (np.log(e - self.c) - self.b) / self.a
        q = np.where(e - self.c <= 0, 0.0, q)
        q = np.where(e >= self.eps_max, 1.0, np.clip(q, 0.0, 1.0))
        return float(q) if e.ndim == 0 else q


def fit_scf(*, noise_multiplier, delta, local_steps, rounds, client_rate, threat="clients", conversion="standard",
            orders=None, grid_size=100) -> SCFEstimator:
    """Simulation-CurveFitting: exact ε*(q) on q = 0.01..1 (``grid_size`` points), then a
    least-squares fit of exp(a·q + b) + c.

    Args:
        noise_multiplier, delta, local_steps, rounds, client_rate, threat, conversion, orders: the
            setting, as in ``epsilon``.
        grid_size: the number of grid points, an int ≥ 3 (the fit has three coefficients).
    Returns:
        the :class:`SCFEstimator`; when the fit does not converge it warns and keeps the initial guess.
    Raises:
        ValueError naming a bad argument of the setting or ``grid_size``.
    """
    s = _setting(noise_multiplier, delta, local_steps, rounds, client_rate, threat, conversion, orders)
    grid = np.linspace(0.01, 1.0, check_int("grid_size", grid_size, 3))
    eps = _eps(grid, s)[0]
    model = lambda q, a, b, c: np.exp(a * q + b) + c   # noqa: E731
    lo = float(eps[0])
    hi = float(eps[-1])
    a0 = max(1e-3, np.log(max(hi - lo, 1e-12) / max(eps[len(eps) // 2] - lo, 1e-12)) / 0.5)
    p0 = (a0, np.log(max(hi - lo, 1e-12)) - a0, lo - 1e-3)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optimize.OptimizeWarning)
            (a, b, c), _ = optimize.curve_fit(model, grid, eps, p0=p0, maxfev=20000)
    except RuntimeError as err:   # no convergence: a fit is only a starting point, keep p0
        warnings.warn(f"SCF fit did not converge ({err}); using the initial guess", stacklevel=2)
        a, b, c = p0
    pred = model(grid, a, b, c)
    r2 = 1.0 - float(np.sum((eps - pred) ** 2) / max(np.sum((eps - eps.mean()) ** 2), 1e-300))
    return SCFEstimator(float(a), float(b), float(c), r2, hi, grid, eps)


def sample_rates(budgets, *, noise_multiplier, delta, local_steps, rounds, client_rate, threat="clients",
                 conversion="standard", orders=None, estimator: SCFEstimator | None = None):
    """Per-record sampling rates for budgets ε_j: SCF inverse, then exact re-accounting.

    Up to 4096 distinct budgets are refined to the exact root from the SCF inverse; more are read off
    an exact grid whose consecutive ε differ by ≤ 0.1% (split where ε rises steeply), with no fit.

    Args:
        budgets: (N,) ε_j > 0 (any shape).
        noise_multiplier, delta, local_steps, rounds, client_rate, threat, conversion, orders: the
            setting, as in ``epsilon``.
        estimator: an :class:`SCFEstimator` of this setting to start from (None: fit one when it is used).
    Returns:
        float64 q_j in [0, 1] with the shape of ``budgets``: ε(q_j) ≤ ε_j exactly, and ≥ 0.99·ε_j
        unless q_j = 1.
    Raises:
        TypeError for an ``estimator`` that is not an :class:`SCFEstimator`; ValueError naming a budget
        below ε(q → 0) (unreachable for this σ, τ, T, λ), or a bad argument.
    """
    s = _setting(noise_multiplier, delta, local_steps, rounds, client_rate, threat, conversion, orders)
    if estimator is not None and not isinstance(estimator, SCFEstimator):
        raise TypeError(f"estimator must be an SCFEstimator (fit_scf's result) or None, got {type(estimator).__name__}")
    arr = check_epsilons("budgets", budgets).ravel()
    values, inverse = np.unique(arr, return_inverse=True)
    floor_eps = float(_eps(np.array([_grid.Q_FLOOR]), s)[0][0])
    if values[0] * (1 - _grid.MARGIN) < floor_eps:
        raise ValueError(f"budget epsilon={values[0]:.6g} is below the smallest reachable epsilon "
                         f"{floor_eps:.6g} (sample rate {_grid.Q_FLOOR:g}) for this setting")
    goal = values * (1 - _grid.MARGIN)
    eps1 = float(_eps(np.array([1.0]), s)[0][0])
    full = goal >= eps1
    q = np.ones(values.shape[0])
    part = np.flatnonzero(~full)
    if part.size > _grid.REFINE_MAX:      # many budgets: read off an exact grid (no fit needed)
        q[part] = _grid_rates(values[part], s)
    elif part.size:
        if estimator is None:
            with warnings.catch_warnings():  # a fit that did not converge is only a worse starting point here
                warnings.filterwarnings("ignore", message="SCF fit did not converge")
                estimator = fit_scf(noise_multiplier=s.noise_multiplier, delta=s.delta, local_steps=s.local_steps,
                                    rounds=s.rounds, client_rate=s.client_rate, threat=s.threat,
                                    conversion=s.conversion, orders=s.orders)
        est = estimator
        q[part] = _exact_rates(values[part], est.inverse(values[part]), s)
    return q[inverse].reshape(np.shape(budgets))


def remembered(store: dict, key: tuple, rates: np.ndarray, compute, max_entries: int) -> list:
    """Per-rate results of a public setting, remembered in ``store[key]``: the clients of a
    federation with many distinct budgets read their rates off (nearly) the same exact grid, so
    what a setting gives each grid rate is computed once for all of them.

    Args:
        store: the memo, {key: {rate: result}} (at most 8 settings, each of at most ``max_entries``
            rates; past that it starts again). key: the setting, hashable. rates: (P,) float64.
        compute: (M,) float64 rates → M results, one per rate, in order.
    Returns:
        the P results, in the order of ``rates``.
    """
    if key not in store and len(store) >= 8:
        store.clear()
    memo = store.setdefault(key, {})
    if len(memo) > max_entries:
        memo.clear()
    values = rates.tolist()
    missing = [q for q in values if q not in memo]
    if missing:
        memo.update(zip(missing, compute(np.array(missing, dtype=np.float64))))
    return [memo[q] for q in values]


_GRID_MEMO: dict = {}   # setting → {q: ε(q)} of the exact grids


def _grid_eps(qs: np.ndarray, s: _Setting) -> np.ndarray:
    """ε(q) of grid points, remembered per setting (the costly part of a federation client's setup)."""
    key = (s.noise_multiplier, s.delta, s.local_steps, s.rounds, s.client_rate, s.threat, s.conversion,
           s.orders.tobytes())
    return np.array(remembered(_GRID_MEMO, key, qs, lambda m: _eps(m, s)[0].tolist(), 1 << 17))


_GRID_RATIO = 1.001   # consecutive ε of the exact grid differ by at most this factor


def _grid_rates(targets, s: _Setting):
    """Largest grid q with ε(q) ≤ target·(1 − MARGIN), for many targets: an exact grid whose
    consecutive ε differ by ≤ ``_GRID_RATIO`` (each record gets ≥ 99.9% of its budget), read off
    downwards.

    Near the floor ε(q) is a staircase: a plateau log(1/δ)/(α − 1) per large order α, then a steep
    rise where that order's RDP takes off (a 0.1% step in q can raise ε by 3%). The coarse
    elasticity of ``fine_points`` misses such rises, so cells wider than the ratio are split until
    they meet it (``_close_gaps``); a record whose cell still does not is refined to the exact root
    from that cell's bracket.
    """
    goal = targets * (1 - _grid.MARGIN)
    grid = np.geomspace(_grid.Q_FLOOR, 1.0, 64)
    e = np.maximum.accumulate(_grid_eps(grid, s))
    a = max(0, int(np.searchsorted(e, goal.min(), side="right")) - 1)
    b = min(63, int(np.searchsorted(e, goal.max(), side="left")))
    floor = 0.5 * goal.min()

    def on_grid(qs, lo, hi):   # the remembered exact ε; order windows are not used here
        return _grid_eps(qs, s), np.zeros(qs.shape[0], dtype=np.intp)

    fine = _grid.fine_points(grid, e, a, b, _GRID_RATIO, floor)
    fine, fe, _ = _grid._close_gaps(fine, *on_grid(fine, None, None), on_grid, _GRID_RATIO, floor)
    fe = np.maximum.accumulate(fe)
    j = np.maximum(np.searchsorted(fe, goal, side="right") - 1, 0)
    q = fine[j]
    nxt = np.minimum(j + 1, fine.shape[0] - 1)
    todo = np.flatnonzero((j < fine.shape[0] - 1) & (fe[nxt] > fe[j] * _GRID_RATIO))
    if todo.size:
        k, k1 = j[todo], nxt[todo]
        idx = np.zeros(todo.size, dtype=np.intp)
        q[todo] = _grid.refine(lambda qs, lo, hi, which: _eps(qs, s), fine[k], fine[k1], fe[k], idx, idx, fe[k1],
                               targets[todo], rtol=1e-6)[0]
    return q


def _exact_rates(targets, guess, s: _Setting):
    """Largest q with ε(q) ≤ target·(1 − MARGIN), from SCF guesses: bracket, then refine."""
    goal = targets * (1 - _grid.MARGIN)

    def evaluate(qs, lo=None, hi=None, which=None):
        return _eps(qs, s)

    q0 = np.clip(guess, _grid.Q_FLOOR, 1.0)
    e0, i0 = evaluate(q0)
    safe = np.where(e0 <= goal, q0, np.nan)
    unsafe = np.where(e0 > goal, q0, np.nan)
    es, eu = np.where(e0 <= goal, e0, np.nan), np.where(e0 > goal, e0, np.nan)
    factor = 1.05
    for _ in range(200):
        down = np.flatnonzero(np.isnan(safe))
        up = np.flatnonzero(np.isnan(unsafe) & (safe < 1.0))
        if down.size == 0 and up.size == 0:
            break
        sel = np.r_[down, up]
        qt = np.r_[np.maximum(unsafe[down] / factor, _grid.Q_FLOOR), np.minimum(safe[up] * factor, 1.0)]
        et = evaluate(qt)[0]
        ok = et <= goal[sel]
        safe[sel[ok]], es[sel[ok]] = qt[ok], et[ok]
        unsafe[sel[~ok]], eu[sel[~ok]] = qt[~ok], et[~ok]
        factor = min(4.0, factor ** 2)
    out = safe.copy()
    todo = np.flatnonzero(~np.isnan(unsafe))
    if todo.size:
        idx = np.zeros(todo.size, dtype=np.intp)
        out[todo] = _grid.refine(evaluate, safe[todo], unsafe[todo], es[todo], idx, idx, eu[todo], targets[todo],
                                 rtol=1e-6)[0]
    return out
