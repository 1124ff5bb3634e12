"""The Poisson-subsampled Gaussian mechanism (SGM): its Rényi DP and the conversion to (ε, δ).

The leaf of the accounting package: numpy and scipy only, no state, nothing of pdpfast imported.
Everything above it (``rdp``'s public functions, the grid engine ``_grid``, ``orders``, the ledgers,
calibration, ``rpdp``, ``fl.ledger``) computes one-step RDP and ε through the functions here.

* log A_α for integer orders: the all-positive-terms sum A_α = 1 + Σ_{k≥2} C(α,k)(1−q)^{α−k} q^k
  (e^{(k²−k)/2z²} − 1), accurate to a few ulps even when A_α − 1 is 1e-12 (``log_a_int``).
* log A_α for fractional orders: the two-sided series of Mironov, Talwar & Zhang (2019, §3.3) with
  the Opacus stopping rule (``log_a_frac``, agrees with Opacus / TF Privacy), or the trapezoidal rule
  on A_α = E_{u~N(0,1)}[(1 − q + q·e^{u/z − 1/(2z²)})^α] (``log_a_quadrature``, ``log_a_at``), which
  converges exponentially at a fixed cost where the series' tail decays only polynomially.
* The closed forms q = 0 (0), σ = 0 (∞) and q = 1 (α/(2σ²)) live in ``degenerate_rdp`` alone.
* ``eps_from_rdp``: the conversion of Balle et al. (2020, Thm. 21), minimized over orders.
"""
from __future__ import annotations

import functools
import math
import warnings

import numpy as np
from scipy import special

__all__ = ["OPACUS_ORDERS", "DEFAULT_ORDERS", "QUAD_MAX_NODES", "QUAD_WIDTH", "RDP_ROUNDOFF", "ROWS_CHUNK", "as_orders",
           "check_rdp", "is_integer_order",
           "distinct_rows", "log_a_int", "log_a_frac", "log_a_quadrature", "log_a_at", "degenerate_rdp", "rdp_one_step",
           "rdp_one_step_series", "rdp_at", "eps_from_rdp"]

# Opacus's default grid (RDPAccountant.DEFAULT_ALPHAS) ...
OPACUS_ORDERS: tuple = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
# ... extended to large orders: small individual budgets (ε ≈ 0.05-0.3 at δ = 1e-5) are optimal at
# α in the hundreds, and the optimum must not sit at the edge of the grid.
DEFAULT_ORDERS: tuple = OPACUS_ORDERS + (64, 72, 80, 88, 96, 112, 128, 144, 160, 192, 224, 256, 320, 384,
                                         448, 512)


_CHUNK = 1 << 20            # elements per temporary (P × terms) array
_MAX_SERIES_TERMS = 10 ** 7  # fractional series: more terms than this means no convergence
_SCALAR_TAIL = 16           # finish series with this few elements left in scalar arithmetic
QUAD_WIDTH = 13.0           # quadrature: Gaussian tails beyond 13 std are < e^-84 of the mass
ROWS_CHUNK = 1 << 20        # quadrature: elements per temporary (points × nodes) array
QUAD_MAX_NODES = 1 << 20    # quadrature: a (point, order) needing more nodes (z below ~0.0016·√α) is taken as
                            # log A_α = +inf, an upper bound (no calibration goes there: its floor is z = 0.05)


def as_orders(orders) -> tuple[np.ndarray, bool]:
    """RDP orders as a float64 1-D array, and whether a scalar was given.

    Args:
        orders: one order α or a non-empty 1-D sequence of them, each > 1 (inf allowed).
    Returns:
        (arr, scalar): arr (n,) float64 orders (``orders`` itself when already such an array); scalar
        True when ``orders`` was a scalar.
    Raises:
        TypeError if ``orders`` is not numbers (None, strings numpy would read as numbers, bools);
        ValueError if it is empty or not 1-D, or an order is not > 1 (NaN included).
    """
    raw = orders if isinstance(orders, np.ndarray) else np.asarray(orders)
    if raw.dtype.kind not in "iuf":   # "2" would read as 2.0, True as 1.0, None as NaN
        raise TypeError(f"orders must be numbers (RDP orders α > 1), got {type(orders).__name__} of {raw.dtype}")
    scalar = raw.ndim == 0
    arr = np.atleast_1d(raw.astype(np.float64, copy=False))
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"orders must be a non-empty 1-D sequence, got shape {raw.shape}")
    bad = ~(arr > 1.0)
    if bad.any():
        raise ValueError(f"orders must all be > 1 (finite or inf), got {arr[bad][0]}")
    return arr, scalar


RDP_ROUNDOFF = 1e-9   # RDP values down to −RDP_ROUNDOFF are read as rounding of 0 (and clamped there)


def check_rdp(name: str, rdp, *, allow_nan: bool) -> np.ndarray:
    """RDP values given to a conversion, checked: ρ(α) ≥ 0 always, and a negative value would lower ε
    (−5 at every order gives ε < 0, −inf gives ε = −inf).

    Args:
        name: the argument, as the message names it.
        rdp: RDP values ρ(α) of any shape (+inf allowed).
        allow_nan: whether NaN entries are accepted (a conversion that skips them).
    Returns:
        float64 array of them, values in [−``RDP_ROUNDOFF``, 0) (rounding: ``compute_rdp`` of other
        libraries can give −1e-22) clamped to 0.
    Raises:
        TypeError for values that are not numbers (strings, bools); ValueError for a value below
        −``RDP_ROUNDOFF`` (−inf included) or, unless ``allow_nan``, a NaN.
    """
    raw = rdp if isinstance(rdp, np.ndarray) else np.asarray(rdp)
    if raw.dtype.kind not in "iuf":   # True would read as ρ = 1
        raise TypeError(f"{name} must be numbers (RDP values ≥ 0), got {type(rdp).__name__} of {raw.dtype}")
    arr = raw.astype(np.float64, copy=False)
    low = arr < -RDP_ROUNDOFF
    if low.any():
        raise ValueError(f"{name} must be ≥ 0 (Rényi DP is never negative; a negative value would lower ε), "
                         f"got {int(low.sum())} negative values (e.g. {arr[low][0]})")
    if not allow_nan and np.isnan(arr).any():
        raise ValueError(f"{name} must be ≥ 0 (inf allowed), got NaN")
    return np.maximum(arr, 0.0) if (arr < 0).any() else arr



def is_integer_order(orders: np.ndarray) -> np.ndarray:
    """Which orders are integers (evaluated by the exact finite sum ``log_a_int``).

    Args:
        orders: (n,) float64 RDP orders.
    Returns:
        (n,) bool, True where α is an integer (False for inf).
    """
    return np.array([float(a).is_integer() for a in orders])


def distinct_rows(*cols):
    """The distinct rows of equal-length 1-D columns, and each element's row.

    One lexsort instead of np.unique(axis=0), which is several times slower at 10^6 rows.

    Args:
        cols: k arrays of shape (n,), the columns of n rows (compared exactly: pass ``x + 0.0`` to
            make −0.0 and 0.0 one value).
    Returns:
        (first, ids): first (R,) intp index of the first occurrence of each distinct row, rows in
        lexicographic order (first column most significant); ids (n,) intp each element's row id in
        [0, R). Both empty when n = 0.
    """
    n = cols[0].shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp)
    order = np.lexsort(cols[::-1])
    change = np.zeros(n, dtype=bool)
    change[0] = True
    for c in cols:
        sc = c[order]
        change[1:] |= sc[1:] != sc[:-1]
    ids = np.empty(n, dtype=np.intp)
    ids[order] = np.cumsum(change) - 1
    return order[change], ids



# ----------------------------------------------------------------------------------------------
# log A_α, integer orders
# ----------------------------------------------------------------------------------------------
def _log_expm1(x: np.ndarray) -> np.ndarray:
    """log(e^x − 1) for x > 0 without overflow."""
    x = np.asarray(x, dtype=np.float64)
    big = x > 30.0
    with np.errstate(divide="ignore"):
        small = np.log(np.expm1(np.where(big, 1.0, x)))
    return np.where(big, x + np.log1p(-np.exp(-np.where(big, x, 30.0))), small)


@functools.lru_cache(maxsize=1024)
def _log_binom_int(alpha: int) -> np.ndarray:
    """log C(α, k) for k = 0..α (cached; read-only)."""
    k = np.arange(alpha + 1, dtype=np.float64)
    if alpha <= 1000:       # exact binomials fit in float64: log of them is correct to an ulp
        out = np.log(special.binom(alpha, k))
    else:
        out = special.gammaln(alpha + 1.0) - special.gammaln(k + 1.0) - special.gammaln(alpha - k + 1.0)
    out.flags.writeable = False
    return out


def _padded_log_binom(width: int, alphas) -> np.ndarray:
    """(C, width − 1) log C(α, k) for k = 2..width, −inf for k > α, one row per α ≤ width."""
    out = np.full((len(alphas), width - 1), -np.inf)
    for row, a in enumerate(alphas):
        out[row, :a - 1] = _log_binom_int(int(a))[2:]
    return out


@functools.lru_cache(maxsize=16)
def _log_binom_table(width: int) -> np.ndarray:
    """``_padded_log_binom`` of every α in (width/2, width], built once per width (read-only)."""
    out = _padded_log_binom(width, range(width // 2 + 1, width + 1))
    out.flags.writeable = False
    return out


def _log_binom_rows(width: int, alphas: np.ndarray) -> np.ndarray:
    """``_padded_log_binom`` of orders α in (width/2, width]: from the cached table up to 1024 (4 MiB)."""
    if width <= 1024:
        return _log_binom_table(width)[alphas - (width // 2 + 1)]
    return _padded_log_binom(width, alphas)


def log_a_int(log_q: np.ndarray, log1m_q: np.ndarray, inv_2z2: np.ndarray, alphas: np.ndarray,
              mask: np.ndarray | None = None) -> np.ndarray:
    """log A_α for integer orders α ≥ 2: log(1 + Σ_{k≥2} C(α,k)(1−q)^{α−k} q^k (e^{(k²−k)/2z²} − 1)).

    All the orders in one pass per doubling of α: each (point, order) pair's terms are a row padded
    with zeros (−inf in log) to the next power of two, so a pair's rounding depends on it alone, not
    on which other orders or points share the call.

    Args:
        log_q: (P,) float64 log q, q in (0, 1) the Poisson sample rate (may be (1,)).
        log1m_q: (P,) float64 log(1 − q) (may be (1,)).
        inv_2z2: (P,) float64 1/(2z²), z > 0 the noise multiplier; (1,) when z is shared.
        alphas: (F,) integer orders α ≥ 2 (any numeric dtype).
        mask: (P, F) bool, the (point, order) pairs to evaluate; None: all.
    Returns:
        (P, F) float64 log A_α (P the longest of the inputs); +inf off the mask.
    """
    p = max(log_q.shape[0], log1m_q.shape[0], inv_2z2.shape[0])
    alphas = np.asarray(alphas).astype(np.int64)
    mask = np.ones((p, alphas.shape[0]), dtype=bool) if mask is None else mask
    out = np.full(mask.shape, np.inf)
    width = np.left_shift(1, np.ceil(np.log2(alphas)).astype(np.int64))   # the row's last k: 2, 4, 8, ...
    shared = inv_2z2.shape[0] == 1
    logit = log_q - log1m_q
    for w in np.unique(width):
        cols = np.flatnonzero(width == w)
        rows, at = np.nonzero(mask[:, cols])          # the pairs; ``at`` indexes ``cols``
        if rows.size == 0:
            continue
        k = np.arange(2, w + 1, dtype=np.float64)
        alpha = alphas[cols].astype(np.float64)[:, None]                   # (C, 1)
        valid = k[None, :] <= alpha                                         # (C, K)
        log_coef = _log_binom_rows(int(w), alphas[cols])                     # (C, K), −inf past α
        # a term is log C(α,k) + k·log(q/(1−q)) + bump_k, plus α·log(1 − q) for the whole row
        if shared:
            log_coef = log_coef + _log_expm1((k * k - k) * inv_2z2[0])[None, :]
            log_coef[~valid] = -np.inf     # (a bump of +inf, z → 0, must not meet a padding −inf)
        step = max(1, _CHUNK // k.shape[0])
        for s in range(0, rows.size, step):
            r, c = rows[s:s + step], at[s:s + step]
            one = np.zeros_like(r)
            terms = log_coef[c] + k * logit[r if logit.shape[0] > 1 else one][:, None]
            if not shared:           # a point's bumps, once for all its orders
                points, which = np.unique(r, return_inverse=True)
                with np.errstate(invalid="ignore"):   # padding (−inf) + a bump of +inf (z → 0): reset below
                    terms += _log_expm1((k * k - k)[None, :] * inv_2z2[points, None])[which]
                terms[~valid[c]] = -np.inf
            top = terms.max(axis=1)
            top = np.where(np.isfinite(top), top, 0.0)
            log_b = top + np.log(np.exp(terms - top[:, None]).sum(axis=1)) + \
                alpha[c, 0] * log1m_q[r if log1m_q.shape[0] > 1 else one]
            out[r, cols[c]] = np.logaddexp(0.0, log_b)
    return out


# ----------------------------------------------------------------------------------------------
# log A_α, fractional orders (two-sided series, Mironov et al. 2019 §3.3)
# ----------------------------------------------------------------------------------------------
def _log_sub(log_x: np.ndarray, log_y: np.ndarray) -> np.ndarray:
    """log(e^x − e^y) for x ≥ y, elementwise, with the conventions of Opacus's ``_log_sub``."""
    d = log_x - log_y
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out = np.log(np.expm1(np.minimum(d, 700.0))) + log_y
    out = np.where(d > 700.0, log_x, out)
    out = np.where(np.isneginf(log_y), log_x, out)
    return np.where(d == 0.0, -np.inf, out)


def log_a_frac(log_q: np.ndarray, log1m_q: np.ndarray, sigma: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    """log A_α for fractional α by the two-sided series (Mironov et al. 2019, §3.3; Opacus's stopping rule).

    Args:
        log_q: (P,) float64 log q, q in (0, 1) the Poisson sample rate.
        log1m_q: (P,) float64 log(1 − q).
        sigma: (P,) float64 noise multipliers σ > 0 (noise std / clip norm); any input may be (1,).
        alphas: (F,) float64 fractional orders α > 1.
    Returns:
        (P, F) float64 log A_α; +inf (with a warning) for an order whose series does not converge
        within 10^7 terms.
    """
    p, f = max(log_q.shape[0], sigma.shape[0]), alphas.shape[0]
    log_q, log1m_q, sigma = (np.broadcast_to(a, (p,)) for a in (log_q, log1m_q, sigma))
    z0 = sigma ** 2 * (log1m_q - log_q) + 0.5          # sigma² log(1/q − 1) + 1/2
    # Flattened (record, order) elements; the loop over series index i only touches elements
    # whose series has not stopped yet.
    rec = np.repeat(np.arange(p), f)
    ordr = np.tile(np.arange(f), p)
    log_a0 = np.full(p * f, -np.inf)
    log_a1 = np.full(p * f, -np.inf)
    live = np.arange(p * f)
    i = 0
    while live.size > _SCALAR_TAIL:
        r, o = rec[live], ordr[live]
        coef = special.binom(alphas, i)                  # (F,)
        with np.errstate(divide="ignore"):
            log_coef = np.log(np.abs(coef))[o]
        positive = (coef > 0)[o]
        j = alphas[o] - i
        lq, l1, sg, zz = log_q[r], log1m_q[r], sigma[r], z0[r]
        log_t0 = log_coef + i * lq + j * l1
        log_t1 = log_coef + j * lq + i * l1
        # log(1/2 erfc(x/√2)) = log Φ(−x)
        log_e0 = special.log_ndtr((zz - i) / sg)
        log_e1 = special.log_ndtr((j - zz) / sg)
        inv = 1.0 / (2.0 * sg ** 2)
        log_s0 = log_t0 + (i * i - i) * inv + log_e0
        log_s1 = log_t1 + (j * j - j) * inv + log_e1
        a0, a1 = log_a0[live], log_a1[live]
        log_a0[live] = np.where(positive, np.logaddexp(a0, log_s0), _log_sub(a0, log_s0))
        log_a1[live] = np.where(positive, np.logaddexp(a1, log_s1), _log_sub(a1, log_s1))
        live = live[~(np.maximum(log_s0, log_s1) < -30.0)]
        i += 1
    # The few series left are the slowly converging ones (large q, α near 1: their tails decay
    # only polynomially, thousands of terms): scalar arithmetic is faster there.
    for e in live:
        r, o = rec[e], ordr[e]
        log_a0[e], log_a1[e] = _log_a_frac_tail(float(log_q[r]), float(log1m_q[r]), float(sigma[r]),
                                                float(z0[r]), float(alphas[o]), i, log_a0[e], log_a1[e])
    return np.logaddexp(log_a0, log_a1).reshape(p, f)


def _log_a_frac_tail(log_q, log1m_q, sigma, z0, alpha, start, log_a0, log_a1):
    """Continue one fractional series from term ``start`` (scalar version of the loop above)."""
    inv = 1.0 / (2.0 * sigma ** 2)
    for i in range(start, _MAX_SERIES_TERMS):
        coef = special.binom(alpha, i)
        log_coef = math.log(abs(coef)) if coef != 0 else -math.inf
        j = alpha - i
        log_s0 = log_coef + i * log_q + j * log1m_q + (i * i - i) * inv + special.log_ndtr((z0 - i) / sigma)
        log_s1 = log_coef + j * log_q + i * log1m_q + (j * j - j) * inv + special.log_ndtr((j - z0) / sigma)
        if coef > 0:
            log_a0, log_a1 = np.logaddexp(log_a0, log_s0), np.logaddexp(log_a1, log_s1)
        else:
            log_a0, log_a1 = _log_sub_scalar(log_a0, log_s0), _log_sub_scalar(log_a1, log_s1)
        if max(log_s0, log_s1) < -30.0:
            return log_a0, log_a1
    warnings.warn(f"RDP series for fractional order {alpha} did not converge; that order is excluded", stacklevel=2)
    return math.inf, math.inf


def _log_sub_scalar(log_x: float, log_y: float) -> float:
    if log_y == -math.inf:
        return log_x
    if log_x == log_y:
        return -math.inf
    d = log_x - log_y
    if d > 700.0:
        return log_x
    return math.log(math.expm1(d)) + log_y if d > 0 else math.nan


# ----------------------------------------------------------------------------------------------
# log A_α by the trapezoidal rule
# ----------------------------------------------------------------------------------------------
def _logsumexp_rows(x: np.ndarray) -> np.ndarray:
    """log Σ_j exp(x[:, j]) (plain numpy: scipy's version costs more in overhead than in math here)."""
    m = x.max(axis=1)
    m = np.where(np.isfinite(m), m, 0.0)
    return m + np.log(np.exp(x - m[:, None]).sum(axis=1))


def log_a_quadrature(q: np.ndarray, z: np.ndarray, alphas: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """log A_α by the trapezoidal rule on A_α = E_{u~N(0,1)}[(1 − q + q·e^{u/z − 1/(2z²)})^α].

    Nodes u = −13 + m·h on [−13, α/z + 13] with h = min(0.5, 0.4·z): the integrand is two
    Gaussian bumps (at 0 and α/z) joined smoothly, analytic in a strip of half-width πz. The orders
    share one set of nodes per point, up to α_max's; each order sums the prefix it needs.

    Args:
        q: (P,) float64 Poisson sample rates in (0, 1).
        z: (P,) float64 noise multipliers σ > 0 (noise std / clip norm).
        alphas: (F,) float64 orders α > 1.
        mask: (P, F) bool, the (point, order) pairs to evaluate.
    Returns:
        (P, F) float64 log A_α; +inf off the mask, and where the rule would need more than
        ``QUAD_MAX_NODES`` nodes (an upper bound: z below ~0.0016·√α).
    """
    out = np.full(mask.shape, np.inf)
    # a pair whose rule would need over QUAD_MAX_NODES nodes keeps log A_α = +inf, an upper bound
    mask = mask & (_node_count(z[:, None], alphas[None, :]) <= QUAD_MAX_NODES)
    todo = np.flatnonzero(mask.any(axis=1))
    if todo.size == 0:
        return out
    need = np.where(mask[todo], alphas[None, :], 0.0).max(axis=1)    # each point's largest order
    # points needing similar node counts are processed together (padding ≤ 2×)
    for e, u, base, log_w in _quadrature_chunks(q[todo], z[todo], need, 1):
        e = todo[e]
        gauss = -0.5 * u * u
        # order α_f needs the nodes up to α_f/z + QUAD_WIDTH only (its bump's far tail), as α_max needs
        # those up to α_max/z + QUAD_WIDTH: a low order sums a prefix of the chunk's nodes (the count at
        # the chunk's smallest z, the most any of its points needs)
        prefix = np.minimum(_node_count(z[e].min(), alphas), u.shape[1]).astype(np.int64)
        for f in range(alphas.shape[0]):
            rows = np.flatnonzero(mask[e, f])
            if rows.size:
                n = prefix[f]
                out[e[rows], f] = _logsumexp_rows(gauss[rows, :n] + alphas[f] * base[rows, :n]) + log_w[rows]
    return out


def _node_count(z, alpha):
    """The trapezoidal rule's node count (float64) for order ``alpha`` at noise multipliers ``z``
    (nodes −QUAD_WIDTH + m·h, h = min(0.5, 0.4·z), up to α/z + QUAD_WIDTH)."""
    with np.errstate(over="ignore", divide="ignore"):
        return np.ceil((alpha / z + 2 * QUAD_WIDTH) / np.minimum(0.5, 0.4 * z)) + 1


def _quadrature_chunks(q, z, alpha, buckets_per_octave):
    """The trapezoidal rule's nodes, chunk by chunk: points whose node counts (set by α/z) share one
    of ``buckets_per_octave`` buckets per doubling are processed together. Yields (point indices e,
    nodes u (E, m), log(1 − q + q·e^{u/z − 1/(2z²)}) (E, m), log weight (E,))."""
    h = np.minimum(0.5, 0.4 * z)
    n_nodes = _node_count(z, alpha).astype(np.int64)   # (≤ QUAD_MAX_NODES: the callers keep the rest out)
    bucket = np.ceil(np.log2(n_nodes) * buckets_per_octave).astype(np.int64)
    logit = np.log(q) - np.log1p(-q)
    for b in np.unique(bucket):
        pts = np.flatnonzero(bucket == b)
        n_b = int(n_nodes[pts].max())
        step = max(1, ROWS_CHUNK // n_b)
        for s in range(0, pts.shape[0], step):
            e = pts[s:s + step]
            u = -QUAD_WIDTH + np.arange(n_b) * h[e, None]
            base = np.log1p(-q[e])[:, None] + np.logaddexp(0.0, u / z[e, None] - 0.5 / z[e, None] ** 2
                                                           + logit[e, None])
            yield e, u, base, np.log(h[e] / np.sqrt(2.0 * np.pi))


def log_a_at(q: np.ndarray, z: np.ndarray, alpha: np.ndarray, derivatives: bool = False):
    """log A_α at one order per point by the trapezoidal rule (as ``log_a_quadrature``).

    The α-derivatives come from the same pass: d/dα log A_α is the mean and d²/dα² the variance of
    log(1 − q + q·e^{u/z − 1/(2z²)}) under the integrand's weights.

    Args:
        q: (P,) float64 Poisson sample rates in (0, 1).
        z: (P,) float64 noise multipliers σ > 0 (noise std / clip norm).
        alpha: (P,) float64 orders α > 1, one per point.
        derivatives: also return the first two derivatives in α.
    Returns:
        (P,) float64 log A_α; with ``derivatives``, (log A, d/dα log A, d²/dα² log A), each (P,).
        log A_α = +inf (derivatives NaN) where the rule would need more than ``QUAD_MAX_NODES`` nodes.
    """
    p = q.shape[0]
    out, d1, d2 = np.full(p, np.inf), np.full(p, np.nan), np.full(p, np.nan)
    # a point whose rule would need over QUAD_MAX_NODES nodes keeps log A_α = +inf, an upper bound
    todo = np.flatnonzero(_node_count(z, alpha) <= QUAD_MAX_NODES)
    # similar node counts together (padding ≤ 19%)
    for e, u, base, log_w in _quadrature_chunks(q[todo], z[todo], alpha[todo], 4):
        e = todo[e]
        x = -0.5 * u * u + alpha[e, None] * base
        top = x.max(axis=1)
        w = np.exp(x - top[:, None])
        total = w.sum(axis=1)
        out[e] = top + np.log(total) + log_w
        if derivatives:
            mean = (w * base).sum(axis=1) / total
            d1[e] = mean
            d2[e] = np.maximum((w * (base - mean[:, None]) ** 2).sum(axis=1) / total, 0.0)
    return (out, d1, d2) if derivatives else out


# ----------------------------------------------------------------------------------------------
# RDP of one step
# ----------------------------------------------------------------------------------------------
def degenerate_rdp(q: np.ndarray, z: np.ndarray, alpha: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The closed forms of one step's RDP, the only place they are written: q = 0 spends 0, σ = 0
    (q > 0) spends ∞, q = 1 spends α/(2σ²) (the Gaussian mechanism).

    Args:
        q: (P,) float64 Poisson sample rates in [0, 1].
        z: (P,) float64 noise multipliers σ ≥ 0 (noise std / clip norm).
        alpha: (1, n) float64 orders shared by all points, or (P, n).
    Returns:
        (rdp, general): rdp (P, n) float64, +inf on the rows left to log A_α; general (P,) bool,
        those rows (0 < q < 1 and σ > 0).
    """
    zero = q == 0.0
    no_noise = (z == 0.0) & ~zero
    full = (q == 1.0) & ~no_noise
    out = np.full((q.shape[0], alpha.shape[1]), np.inf)
    out[zero] = 0.0
    if full.any():
        out[full] = (alpha if alpha.shape[0] == 1 else alpha[full]) / (2.0 * z[full, None] ** 2)
    return out, ~(zero | no_noise | full)


def rdp_one_step(q: np.ndarray, z: np.ndarray, orders: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """RDP ρ(α) of one SGM step at the (point, order) pairs selected by ``mask``; +inf elsewhere.

    Integer orders by ``log_a_int``, fractional orders by quadrature (the grid engine's, the ledgers').

    Args:
        q: (P,) float64 Poisson sample rates in [0, 1] (either q or z may be (1,)).
        z: (P,) float64 noise multipliers σ ≥ 0 (noise std / clip norm).
        orders: (n,) float64 RDP orders α > 1.
        mask: (P, n) bool, the pairs to evaluate; None: all.
    Returns:
        (P, n) float64 one-step RDP (+inf off the mask and where σ = 0 < q).
    """
    p = max(q.shape[0], z.shape[0])
    q, z = np.broadcast_to(q, (p,)), np.broadcast_to(z, (p,))
    n = orders.shape[0]
    mask = np.ones((p, n), dtype=bool) if mask is None else mask
    out, general = degenerate_rdp(q, z, orders[None, :])
    general = np.flatnonzero(general)
    if general.size == 0:
        return np.where(mask, out, np.inf)
    qg, zg, mg = q[general], z[general], mask[general]
    log_q, log1m_q = np.log(qg), np.log1p(-qg)
    shared = bool(np.all(zg == zg[0]))
    inv_2z2 = 1.0 / (2.0 * (zg[:1] if shared else zg) ** 2)
    is_int = is_integer_order(orders)
    sub = np.full((general.size, n), np.inf)
    ints = np.flatnonzero(is_int & mg.any(axis=0))
    if ints.size:
        sub[:, ints] = log_a_int(log_q, log1m_q, inv_2z2, orders[ints], mg[:, ints]) / (orders[ints] - 1.0)
    # α = inf spends ρ = inf (as in compute_rdp): it stays inf in ``sub``, never reaches the quadrature
    frac = np.flatnonzero(~is_int & np.isfinite(orders) & mg.any(axis=0))
    if frac.size:
        rows = np.flatnonzero(mg[:, frac].any(axis=1))
        la = log_a_quadrature(qg[rows], zg[rows], orders[frac], mg[np.ix_(rows, frac)])
        sub[np.ix_(rows, frac)] = la / (orders[frac] - 1.0)
    out[general] = np.maximum(sub, 0.0)   # ρ ≥ 0: the quadrature's rounding can give −2e-15
    return np.where(mask, out, np.inf)


def rdp_one_step_series(q: np.ndarray, z: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """RDP ρ(α) of ONE SGM step with fractional orders by the series (Opacus's numbers: ``compute_rdp``).

    Args:
        q: (P,) float64 Poisson sample rates in [0, 1] (either q or z may be (1,)).
        z: (P,) float64 noise multipliers σ ≥ 0 (noise std / clip norm).
        orders: (n,) float64 RDP orders α > 1 (inf gives +inf).
    Returns:
        (P, n) float64 one-step RDP.
    """
    p = max(q.shape[0], z.shape[0])
    q, z = np.broadcast_to(q, (p,)), np.broadcast_to(z, (p,))
    with np.errstate(divide="ignore"):
        out, general = degenerate_rdp(q, z, orders[None, :])
    if general.any():
        out[general] = np.maximum(_rdp_series(q[general], z[general], orders), 0.0)   # ρ ≥ 0 (rounding: −1e-22)
    return out


def rdp_at(q: np.ndarray, z: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """RDP ρ(α_p) of ONE SGM step at order α_p of point p.

    The closed forms of ``degenerate_rdp``; otherwise log A_α/(α − 1) by quadrature.

    Args:
        q: (P,) float64 Poisson sample rates in [0, 1].
        z: (P,) float64 noise multipliers σ ≥ 0 (noise std / clip norm); may be (1,).
        alpha: (P,) float64 orders α > 1, one per point.
    Returns:
        (P,) float64 one-step RDP.
    """
    q = np.asarray(q, dtype=np.float64)
    z = np.broadcast_to(np.asarray(z, dtype=np.float64), q.shape)
    alpha = np.broadcast_to(np.asarray(alpha, dtype=np.float64), q.shape)
    out, general = degenerate_rdp(q, z, alpha[:, None])
    out = out[:, 0]
    general = np.flatnonzero(general)
    if general.size:
        out[general] = np.maximum(log_a_at(q[general], z[general], alpha[general]) / (alpha[general] - 1.0), 0.0)
    return out


def _rdp_series(q: np.ndarray, z: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """0 < q < 1, z > 0: (P,) each. Returns (P, n)."""
    # One shared noise multiplier (the common case in calibration) lets terms that depend only
    # on z be computed once.
    if z.shape[0] > 1 and np.all(z == z[0]):
        z = z[:1]
    log_q, log1m_q = np.log(q), np.log1p(-q)
    inv_2z2 = 1.0 / (2.0 * z ** 2)
    out = np.empty((max(q.shape[0], z.shape[0]), orders.shape[0]))
    is_int = np.array([float(a).is_integer() for a in orders])
    finite = np.isfinite(orders)
    ints = np.flatnonzero(is_int & finite)
    if ints.size:
        out[:, ints] = log_a_int(log_q, log1m_q, inv_2z2, orders[ints]) / (orders[ints] - 1.0)
    frac = np.flatnonzero(~is_int & finite)
    if frac.size:
        step = max(1, _CHUNK // (8 * frac.size))
        p = out.shape[0]
        for s in range(0, p, step):
            e = slice(s, min(p, s + step))
            zz = z if z.shape[0] == 1 else z[e]
            out[e, frac] = log_a_frac(log_q[e], log1m_q[e], zz, orders[frac]) / (orders[frac] - 1.0)
    out[:, ~finite] = np.inf
    return out


# ----------------------------------------------------------------------------------------------
# Conversion to (ε, δ)
# ----------------------------------------------------------------------------------------------
def eps_from_rdp(orders: np.ndarray, rdp: np.ndarray, delta) -> tuple[np.ndarray, np.ndarray]:
    """ε from RDP (Balle et al. 2020, Thm. 21): ε = min_α ρ(α) − (log δ + log α)/(α − 1) + log((α − 1)/α).

    Not clamped at 0 (tiny RDP and large δ can give ε < 0) and δ is not checked.

    Args:
        orders: (n,) float64 RDP orders α > 1 (or (..., n) matching ``rdp``).
        rdp: (..., n) float64 RDP values ρ(α); NaN entries are skipped.
        delta: δ in (0, 1), a scalar or an array broadcastable to rdp.shape[:-1].
    Returns:
        (eps, idx): eps (...) float64 ε (+inf where every entry is NaN); idx (...) intp index of the
        optimal order (-1 there).
    """
    log_delta = np.log(np.asarray(delta, dtype=np.float64))[..., None]
    with np.errstate(invalid="ignore", divide="ignore"):
        eps = rdp - (log_delta + np.log(orders)) / (orders - 1.0) + np.log((orders - 1.0) / orders)
    all_nan = np.all(np.isnan(eps), axis=-1)
    idx = np.argmin(np.where(np.isnan(eps), np.inf, eps), axis=-1)
    best = np.take_along_axis(eps, idx[..., None], axis=-1)[..., 0]
    best = np.where(all_nan, np.inf, best)
    idx = np.where(all_nan, -1, idx)
    return best, idx
