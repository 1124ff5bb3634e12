"""rPDP-FL accounting and Simulation-CurveFitting."""
import numpy as np
import pytest

from pdpfast.accounting import DEFAULT_ORDERS, _grid, compute_rdp, get_privacy_spent, rpdp

SETTING = dict(noise_multiplier=1.2, delta=1e-5, local_steps=20, rounds=50, client_rate=0.5)


def _reference(q, threat, conversion, s=SETTING):
    """The paper's formulas written out directly on the Opacus-identical series."""
    orders = np.array(DEFAULT_ORDERS)
    rho_local = s["local_steps"] * compute_rdp(q, s["noise_multiplier"], 1, orders)
    lam = s["client_rate"]
    if threat == "server":
        rho = lam * s["rounds"] * rho_local
    else:
        with np.errstate(over="ignore"):
            rho = s["rounds"] * np.log(1 - lam + lam * np.exp((orders - 1) * rho_local)) / (orders - 1)
    if conversion == "improved":
        return get_privacy_spent(orders, rho, s["delta"])[0]
    return float(np.min(rho + np.log(1 / s["delta"]) / (orders - 1)))


@pytest.mark.filterwarnings("ignore:Optimal order")
@pytest.mark.parametrize("threat", ["clients", "server"])
@pytest.mark.parametrize("conversion", ["standard", "improved"])
def test_epsilon_matches_the_paper_formulas(threat, conversion):
    qs = np.array([0.003, 0.02, 0.1, 0.4])
    eps = rpdp.epsilon(qs, threat=threat, conversion=conversion, **SETTING)
    assert eps.shape == (4,)
    for q, e in zip(qs, eps):
        assert e == pytest.approx(_reference(q, threat, conversion), rel=1e-9)
    assert np.all(np.diff(eps) > 0)


def test_improved_conversion_is_tighter_and_client_sampling_amplifies():
    q = 0.05
    std = rpdp.epsilon(q, conversion="standard", **SETTING)
    imp = rpdp.epsilon(q, conversion="improved", **SETTING)
    assert isinstance(std, float) and imp < std
    # less client participation, less privacy loss; λ = 1 recovers plain composition of T·τ steps
    full = rpdp.epsilon(q, **{**SETTING, "client_rate": 1.0})
    assert rpdp.epsilon(q, **SETTING) < full
    orders = np.array(DEFAULT_ORDERS)
    plain = np.min(compute_rdp(q, 1.2, 20 * 50, orders) + np.log(1e5) / (orders - 1))
    assert full == pytest.approx(plain, rel=1e-9)


def test_the_clients_figure_is_the_exact_rdp_over_the_client_sampling_and_the_servers_its_expectation():
    """T·ρ^{τ,λ} = log E[e^{(α−1)·K·ρ^τ}]/(α−1) with K ~ Binomial(T, λ), the rounds the client takes
    part in: the RDP of (K, its updates), which the server sees. The "server" figure λ·T·ρ^τ is
    E[K]·ρ^τ, below it by Jensen: a plan for the expected rounds, whose guarantee is the ledger's."""
    from scipy import stats

    orders = np.array(DEFAULT_ORDERS)
    t, lam = SETTING["rounds"], SETTING["client_rate"]
    rho_local = SETTING["local_steps"] * compute_rdp(0.05, SETTING["noise_multiplier"], 1, orders)
    k = np.arange(t + 1)
    log_pk = stats.binom.logpmf(k, t, lam)
    mixture = np.logaddexp.reduce(log_pk[:, None] + (orders - 1) * k[:, None] * rho_local, axis=0) / (orders - 1)
    np.testing.assert_allclose(t * rpdp.client_sampled_rdp(rho_local, orders, lam), mixture, rtol=1e-9)
    assert np.all(lam * t * rho_local <= mixture)
    assert rpdp.epsilon(0.05, threat="server", **SETTING) < rpdp.epsilon(0.05, threat="clients", **SETTING)


def test_scf_fits_and_inverts():
    est = rpdp.fit_scf(**SETTING)
    assert est.r2 > 0.95
    eps = np.linspace(est.eps_grid[0] * 1.05, est.eps_max * 0.95, 20)
    q = est.inverse(eps)
    assert np.all((q >= 0) & (q <= 1)) and np.all(np.diff(q) >= 0)
    assert est.inverse(est.eps_max * 2) == 1.0
    # a 3-parameter fit of a curve spanning decades: good in R², loose at the low end
    span = est.eps_grid.max() - est.eps_grid.min()
    assert np.max(np.abs(est.predict(est.q_grid) - est.eps_grid)) < 0.1 * span


@pytest.mark.parametrize("threat", ["clients", "server"])
def test_no_record_exceeds_its_budget_and_none_wastes_more_than_one_percent(threat):
    rng = np.random.default_rng(0)
    est = rpdp.fit_scf(threat=threat, **SETTING)
    budgets = rng.uniform(est.eps_grid[0] * 1.2, est.eps_max * 1.1, 300)
    q = rpdp.sample_rates(budgets, threat=threat, estimator=est, **SETTING)
    eps = rpdp.epsilon(q, threat=threat, **SETTING)
    assert np.all(eps <= budgets)
    assert np.all((eps >= 0.99 * budgets) | (q == 1.0))
    # the fit alone is only a starting point: its inverse is off by more than the exact one
    raw = rpdp.epsilon(est.inverse(budgets), threat=threat, **SETTING)
    assert np.max(np.abs(raw / budgets - 1)) > np.max(np.abs(eps / budgets - 1))


def test_many_budgets_use_the_exact_grid():
    budgets = np.random.default_rng(1).uniform(2.0, 6.0, 5000)
    q = rpdp.sample_rates(budgets, **SETTING)
    eps = rpdp.epsilon(q, **SETTING)
    assert np.all(eps <= budgets) and np.all((eps >= 0.99 * budgets) | (q == 1.0))


# σ = 3 over few steps: near its floor ε(q) is a staircase (a plateau log(1/δ)/(α − 1) per large order,
# then a rise where a 0.1% step in q raises ε by 3%) that a grid spaced by the coarse slope steps over
STAIRCASE = dict(noise_multiplier=3.0, delta=1e-4, local_steps=1, rounds=3, client_rate=1.0)


def _staircase_budgets_and_their_rates():
    floor = rpdp.epsilon(_grid.Q_FLOOR, **STAIRCASE)
    budgets = np.geomspace(floor * 1.001, rpdp.epsilon(1.0, **STAIRCASE) * 1.2, 6000)
    assert np.unique(budgets).size > _grid.REFINE_MAX          # the grid path, not the per-budget root
    q = rpdp.sample_rates(budgets, **STAIRCASE)
    return budgets, q, rpdp.epsilon(q, **STAIRCASE)


def test_every_record_gets_99_to_100_percent_of_its_budget_on_the_grid_path_even_near_the_floor():
    budgets, q, eps = _staircase_budgets_and_their_rates()
    assert np.all(eps <= budgets)
    assert np.all((eps >= 0.99 * budgets) | (q == 1.0))


def test_a_record_in_a_grid_cell_left_wider_than_the_ratio_is_refined_to_its_exact_root(monkeypatch):
    monkeypatch.setattr(_grid, "_close_gaps", lambda points, eps, idx, *rest: (points, eps, idx))
    budgets, q, eps = _staircase_budgets_and_their_rates()
    assert np.all(eps <= budgets)
    assert np.all((eps >= 0.99 * budgets) | (q == 1.0))


def test_unreachable_budget_is_refused():
    with pytest.raises(ValueError, match="budget epsilon=0.001"):
        rpdp.sample_rates([0.001, 3.0], **SETTING)


@pytest.mark.parametrize("override, match", [
    (dict(threat="everyone"), "threat"), (dict(conversion="fancy"), "conversion"),
    (dict(client_rate=0.0), "client_rate"), (dict(local_steps=0), "local_steps"),
    (dict(rounds=1.5), "rounds"), (dict(delta=2.0), "delta"), (dict(noise_multiplier=0.0), "noise_multiplier"),
])
def test_bad_input_raises_naming_the_argument(override, match):
    with pytest.raises(ValueError, match=match):
        rpdp.epsilon(0.1, **{**SETTING, **override})
