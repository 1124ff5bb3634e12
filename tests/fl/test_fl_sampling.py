"""Statistical checks of the two Poisson samplings: clients per round (λ) and records per step (q_j)."""
from __future__ import annotations

import numpy as np
import pytest

import pdpfast.fl as fl
from pdpfast.fl.simulation import initial_weights

Z = 4.5   # two-sided z bound per check: false alarms ~1e-5 per check


@pytest.mark.parametrize("client_rate", [0.1, 0.35, 0.8])
def test_client_sampling_frequency_matches_client_rate(client_rate):
    rounds, M = 3000, 8
    draws = np.stack([fl.sampled_clients(7, t, M, client_rate) for t in range(1, rounds + 1)])
    sd = np.sqrt(client_rate * (1 - client_rate) / rounds)
    assert np.all(np.abs(draws.mean(0) - client_rate) < Z * sd)
    # independent across clients: the number sampled per round is Binomial(M, λ)
    counts = draws.sum(1)
    assert abs(counts.var() - M * client_rate * (1 - client_rate)) < 0.15 * M * client_rate * (1 - client_rate)
    # a round may sample no client at all (never padded up to a fixed fraction)
    empty = (counts == 0).mean()
    p0 = (1 - client_rate) ** M
    assert abs(empty - p0) < Z * np.sqrt(p0 * (1 - p0) / rounds) + 1e-12


def test_client_sampling_rate_one_samples_everyone_and_is_reproducible():
    assert fl.sampled_clients(0, 5, 6, 1.0).all()
    np.testing.assert_array_equal(fl.sampled_clients(3, 9, 50, 0.3), fl.sampled_clients(3, 9, 50, 0.3))
    assert not np.array_equal(fl.sampled_clients(3, 9, 50, 0.3), fl.sampled_clients(3, 10, 50, 0.3))


def test_record_sampling_frequency_matches_sample_rates():
    """Over R rounds of τ local steps, record j is drawn ~ Binomial(R·τ, q_j) times."""
    data = fl.load_federated("breast_cancer", 1, "iid", seed=0)
    n = data.y_train.shape[0]
    budgets = fl.sample_budgets("BoundedMixGauss", n, seed=2)
    config = fl.FLConfig(rounds=30, local_steps=10, client_rate=1.0, noise_multiplier=4.0, lr=0.01)
    # a fixed seed of the record draws: drawn afresh (the default), the bounds below failed for 1 seed in 40
    # tried (counts of rates < 0.05 over 300 draws are far from normal in their tails)
    silo = fl.build_silo(data, budgets, config, 0, noise_seed=11)
    weights = initial_weights(fl.model_factory("breast_cancer"), 0)
    for t in range(1, config.rounds + 1):
        assert silo.fit(weights, t) is not None
    assert silo.ledger.active.all()          # the planned rounds never exhaust a budget
    trials = config.rounds * config.local_steps
    q = silo.sample_rates
    assert q.min() < 0.05 and q.max() > 0.2  # the budgets give genuinely different rates
    z = (silo.draw_counts - trials * q) / np.sqrt(trials * q * (1 - q))
    assert np.abs(z).max() < 5.0
    # in aggregate, per budget component (pooled counts are far more sensitive)
    for lo, hi in [(0, 0.5), (0.5, 3), (3, 11)]:
        sel = (budgets >= lo) & (budgets < hi)
        expected = trials * q[sel].sum()
        assert abs(silo.draw_counts[sel].sum() - expected) < Z * np.sqrt(trials * (q[sel] * (1 - q[sel])).sum())
