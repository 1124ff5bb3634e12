"""Bad input gives a clear ValueError naming the argument."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import pdpfast.fl as fl
from pdpfast.fl.cli import main

SMALL = dict(dataset="breast_cancer", clients=3, rounds=1, local_steps=1)


@pytest.mark.parametrize("client_rate", [0.0, -0.2, 1.5, float("nan")])
def test_client_rate_outside_unit_interval(client_rate):
    with pytest.raises(ValueError, match=r"client_rate must lie in \(0, 1\]"):
        fl.FLConfig(client_rate=client_rate)
    with pytest.raises(ValueError, match="client_rate"):
        fl.simulate(client_rate=client_rate, **SMALL)


@pytest.mark.parametrize("client_rate", ["half", "0.5", True])
def test_client_rate_that_is_not_a_number(client_rate):
    with pytest.raises(TypeError, match="client_rate must be a number"):
        fl.FLConfig(client_rate=client_rate)
    with pytest.raises(TypeError, match="client_rate"):
        fl.simulate(client_rate=client_rate, **SMALL)


def test_budgets_of_wrong_length():
    data = fl.load_federated("breast_cancer", 3, "iid")
    n = data.y_train.shape[0]
    with pytest.raises(ValueError, match=rf"budgets must have one value per training record \({n}\)"):
        fl.simulate(budgets=np.ones(n - 1), **SMALL)
    per_client = [np.ones(data.records_of(k).shape[0]) for k in range(3)]
    per_client[2] = per_client[2][:-3]
    with pytest.raises(ValueError, match=r"budgets\[2\] has .* client 2 holds"):
        fl.simulate(budgets=per_client, **SMALL)
    with pytest.raises(ValueError, match="budgets has 2 per-client arrays but there are 3 clients"):
        fl.simulate(budgets=per_client[:2], **SMALL)
    x, y = data.client_data(0)
    with pytest.raises(ValueError, match=r"budgets of client 0 must have one value per record"):
        fl.Silo(0, x, y, np.ones(len(y) + 1), config=fl.FLConfig(), model_fn=fl.model_factory("breast_cancer"))


@pytest.mark.parametrize("bad", [0.0, -1.0, np.nan, np.inf])
def test_budgets_not_positive_finite(bad):
    n = fl.load_federated("breast_cancer", 3, "iid").y_train.shape[0]
    budgets = np.ones(n)
    budgets[5] = bad
    with pytest.raises(ValueError, match="budgets must be finite and > 0"):
        fl.simulate(budgets=budgets, **SMALL)


def test_client_with_no_data():
    empty_x, empty_y = torch.zeros(0, 30), torch.zeros(0, dtype=torch.int64)
    with pytest.raises(ValueError, match="client 3 has no data"):
        fl.Silo(3, empty_x, empty_y, np.zeros(0), config=fl.FLConfig(), model_fn=fl.model_factory("breast_cancer"))
    with pytest.raises(ValueError, match="no data"):
        fl.partition(np.array([0, 1, 0, 1]), 5, "iid")
    with pytest.raises(ValueError, match=r"split='dirichlet' leaves client\(s\) .* with no data"):
        fl.partition(np.repeat([0, 1], 6), 10, "dirichlet", dirichlet_alpha=0.01)


def test_unknown_budget_distribution():
    with pytest.raises(ValueError, match="budgets must be one of 'ThreeLevels', 'BoundedPareto', 'BoundedMixGauss'"):
        fl.simulate(budgets="Uniform", **SMALL)
    with pytest.raises(ValueError, match="budgets must be one of"):
        fl.sample_budgets("threelevels", 10)


@pytest.mark.parametrize("kwargs, name", [
    ({"method": "fedprox"}, "method"), ({"split": "shards"}, "split"), ({"dataset": "mnist"}, "dataset"),
    ({"rounds": 0}, "rounds"), ({"local_steps": 2.5}, "local_steps"), ({"noise_multiplier": 0}, "noise_multiplier"),
    ({"delta": 1.0}, "delta"), ({"threat": "everyone"}, "threat"), ({"clients": 0}, "clients"),
])
def test_other_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        fl.simulate(**(SMALL | kwargs))


def test_unreachable_budget_is_reported():
    with pytest.raises(ValueError, match="below the smallest reachable epsilon"):
        fl.simulate(budgets="ThreeLevels", noise_multiplier=0.5, **SMALL)


def test_cli_reports_errors_with_exit_code_2(capsys):
    assert main(["simulate", "--client-rate", "0", "--rounds", "1", "--quiet", "--no-plot"]) == 2
    assert "--client-rate must lie in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan"), float("inf")])
@pytest.mark.parametrize("split", ["iid", "dirichlet"])
def test_a_dirichlet_alpha_out_of_range_is_refused_whatever_the_split(split, alpha):
    """α used to be read only by the dirichlet split: with another split a bad one passed unnoticed."""
    with pytest.raises(ValueError, match="dirichlet_alpha must be a finite number > 0"):
        fl.partition(np.repeat([0, 1], 6), 2, split, dirichlet_alpha=alpha)
