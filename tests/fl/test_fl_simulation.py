"""The in-process simulation: budgets, splits, FedAvg, reproducibility, engine options, CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest
from torch import nn

import pdpfast.fl as fl
from pdpfast.fl.cli import main
from pdpfast.fl.simulation import run_federated

FAST = dict(dataset="breast_cancer", clients=4, rounds=4, local_steps=3, client_rate=0.6)


def test_three_levels_proportions():
    b = fl.sample_budgets("ThreeLevels", 20000, seed=1)
    assert set(np.unique(b)) == {0.1, 1.0, 5.0}
    for level, p in [(0.1, 0.7), (1.0, 0.2), (5.0, 0.1)]:
        assert abs((b == level).mean() - p) < 4.5 * np.sqrt(p * (1 - p) / b.size)


def test_bounded_pareto_shape():
    b = fl.sample_budgets("BoundedPareto", 20000, seed=1)
    assert b.min() >= 0.1 and b.max() <= 10.0
    # Pareto(shape 1, scale 0.1): P(ε > x) = 0.1/x; clipped at 10 (mass 1%)
    for x in (0.2, 0.5, 1.0):
        assert abs((b > x).mean() - 0.1 / x) < 0.01
    assert abs((b == 10.0).mean() - 0.01) < 0.004


def test_bounded_mix_gauss_components():
    b = fl.sample_budgets("BoundedMixGauss", 20000, seed=1)
    assert b.min() >= 0.1 and b.max() <= 10.0
    assert abs((b < 0.5).mean() - 0.7) < 0.02 and abs(((b > 0.5) & (b < 2.5)).mean() - 0.2) < 0.02
    assert abs(np.median(b[b > 2.5]) - 5.0) < 0.05


def test_budgets_are_data_independent_and_seeded():
    np.testing.assert_array_equal(fl.sample_budgets("BoundedPareto", 100, 4),
                                  fl.sample_budgets("BoundedPareto", 100, 4))
    assert not np.array_equal(fl.sample_budgets("BoundedPareto", 100, 4), fl.sample_budgets("BoundedPareto", 100, 5))


def test_splits():
    data = fl.load_federated("digits", 5, "iid")
    sizes = np.bincount(data.client_index)
    assert sizes.max() - sizes.min() <= 1
    label = fl.load_federated("digits", 5, "label")
    y = label.y_train.numpy()
    labels_per_client = [np.unique(y[label.client_index == k]).size for k in range(5)]
    assert max(labels_per_client) <= 4 and min(np.bincount(label.client_index)) > 0
    d = fl.load_federated("breast_cancer", 6, "dirichlet", dirichlet_alpha=0.3, seed=1)
    assert np.bincount(d.client_index, minlength=6).min() > 0
    # standardized with the training set's statistics
    assert np.allclose(data.x_train.mean(0).numpy(), 0, atol=1e-5)


def test_aggregate_is_size_weighted_mean_of_deltas_in_client_order():
    rng = np.random.default_rng(0)
    w = [rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=4).astype(np.float32)]
    ups = [fl.LocalUpdate(k, [rng.normal(size=a.shape).astype(np.float32) for a in w], n)
           for k, n in [(2, 10), (0, 30), (5, 60)]]
    out = fl.aggregate(w, ups)
    for i in range(2):
        want = w[i].astype(np.float64) + sum(u.num_examples * u.delta[i].astype(np.float64) for u in ups) / 100.0
        np.testing.assert_allclose(out[i], want, rtol=1e-6)
        assert out[i].dtype == np.float32
    shuffled = fl.aggregate(w, [ups[2], ups[0], ups[1]])
    assert all(np.array_equal(a, b) for a, b in zip(out, shuffled))
    unchanged = fl.aggregate(w, [])
    assert all(np.array_equal(a, b) for a, b in zip(w, unchanged))


def test_round_without_clients_keeps_the_global_model():
    res = fl.simulate(**(FAST | {"client_rate": 0.15, "rounds": 8}), seed=0, sampling_seed=0)
    empty = np.flatnonzero(~res.sampled.any(axis=1))
    assert empty.size, "λ = 0.15 with 4 clients should leave some round empty"
    for t in empty:             # row t of sampled is round t+1; accuracy[t+1] is after it
        assert res.accuracy[t + 1] == res.accuracy[t] and res.loss[t + 1] == res.loss[t]


def test_same_seeds_same_model_other_public_seed_other_model():
    a, b = (fl.simulate(seed=11, noise_seed=1, sampling_seed=1, **FAST),
            fl.simulate(seed=11, noise_seed=1, sampling_seed=1, **FAST))
    assert all(np.array_equal(x, y) for x, y in zip(a.weights, b.weights))
    np.testing.assert_array_equal(a.epsilon_server, b.epsilon_server)
    c = fl.simulate(seed=12, noise_seed=1, sampling_seed=1, **FAST)
    assert not all(np.array_equal(x, y) for x, y in zip(a.weights, c.weights))


def _run_with_mlp(**config):
    """A 2-layer model (so that per-layer clipping has two groups) through run_federated."""
    data = fl.load_federated("breast_cancer", 3, "iid", seed=0)
    budgets = fl.sample_budgets("ThreeLevels", data.y_train.shape[0], seed=0)
    cfg = fl.FLConfig(rounds=3, local_steps=3, client_rate=1.0, lr=0.2, **config)
    model_fn = lambda: nn.Sequential(nn.Linear(30, 8), nn.Tanh(), nn.Linear(8, 2))  # noqa: E731
    silos = [fl.Silo(k, *data.client_data(k), budgets[data.records_of(k)], config=cfg, model_fn=model_fn,
                     noise_seed=0) for k in range(3)]   # the same noise in every mode
    return run_federated(silos, model_fn, data.x_test, data.y_test, cfg)["weights"]


def test_engine_modes_are_passed_through():
    """Ghost clipping computes the same clipped sums as book-keeping (up to float rounding);
    per-layer clipping splits the sensitivity differently, so it trains another model."""
    bk, ghost, per_layer = _run_with_mlp(mode="bk"), _run_with_mlp(mode="ghost"), _run_with_mlp(clipping="per_layer")
    for x, y in zip(bk, ghost):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
    assert not all(np.allclose(x, y, atol=1e-4) for x, y in zip(bk, per_layer))
    with pytest.raises(ValueError, match="clipping must be one of"):
        fl.FLConfig(clipping="per_sample")
    with pytest.raises(ValueError, match="mode must be one of"):
        fl.FLConfig(mode="opacus")


def test_result_reports_per_client_stats_and_json(tmp_path):
    res = fl.simulate(budgets="ThreeLevels", seed=0, **FAST)
    assert len(res.clients) == 4 and sum(c["records"] for c in res.clients) == res.budgets.size
    for k, c in enumerate(res.clients):
        assert c["rounds_sampled"] == res.sampled[:, k].sum() and c["rounds_contributed"] == res.contributed[:, k].sum()
    res.to_json(tmp_path / "r.json")
    d = json.loads((tmp_path / "r.json").read_text())
    assert {g["budget"] for g in d["budget_groups"]} == {0.1, 1.0, 5.0}
    assert len(d["accuracy"]) == FAST["rounds"] + 1


def test_cli_simulate_prints_table_and_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "fl_small"
    assert main(["simulate", "--dataset", "breast_cancer", "--clients", "4", "--rounds", "3", "--local-steps", "2",
                 "--methods", "rpdp", "minimum", "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "method | final acc" in text and "rpdp" in text and "minimum" in text
    assert json.loads(out.with_suffix(".json").read_text())["rows"][0]["method"] == "rpdp"
    assert out.with_suffix(".png").stat().st_size > 1000


@pytest.mark.parametrize("name,stem", [("run_lr0.05", "run_lr0.05"), ("exp.json", "exp"), ("exp.png", "exp")])
def test_cli_simulate_keeps_a_dotted_out_name_whole(tmp_path, capsys, name, stem):
    """``--out run_lr0.05`` wrote run_lr0.json: runs named exp.v1 and exp.v2 overwrote each other."""
    assert main(["simulate", "--dataset", "breast_cancer", "--clients", "2", "--rounds", "1", "--local-steps", "1",
                 "--methods", "minimum", "--quiet", "--out", str(tmp_path / name)]) == 0
    assert f"wrote {tmp_path / stem}.json and {tmp_path / stem}.png" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{stem}.json", f"{stem}.png"]


def test_cli_simulate_checks_its_out_path_before_the_runs(tmp_path, capsys):
    (tmp_path / "taken.json").mkdir()
    assert main(["simulate", "--methods", "minimum", "--rounds", "1", "--quiet", "--out", str(tmp_path / "taken")]) == 2
    err = capsys.readouterr()
    assert "--out" in err.err and "is a directory" in err.err and "method | final acc" not in err.out


def test_cli_simulate_warns_about_a_delta_of_at_least_one_over_n_in_one_line(tmp_path, capsys):
    assert main(["simulate", "--dataset", "breast_cancer", "--clients", "2", "--rounds", "1", "--local-steps", "1",
                 "--methods", "rpdp", "--quiet", "--delta", "0.01"]) == 0
    err = capsys.readouterr().err
    assert "pdpfast fl simulate: warning: --delta 0.01 ≥ 1/N = 1/" in err and "LargeDeltaWarning" not in err


def test_cli_simulate_refuses_a_method_listed_twice(capsys):
    """``--methods rpdp rpdp`` printed two rows but its JSON, keyed by method, kept one."""
    assert main(["simulate", "--methods", "rpdp", "minimum", "rpdp", "--quiet", "--no-plot"]) == 2
    assert "error: --methods lists rpdp more than once" in capsys.readouterr().err
