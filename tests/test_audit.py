"""The one-run privacy audit (``pdpfast.audit``, ``pdpfast audit``).

Named after what they guard: a training without clipping or without noise is caught (its lower
bound exceeds the ε it claims, in every group); correct training stays below its certified ε;
the bound itself agrees with the binomial tail when δ = 0 and is monotone where it should be.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.stats import binom

from pdpfast import audit
from pdpfast.cli import main

SMALL = dict(canaries_count=1500, quiet=True)


@pytest.fixture(scope="module")
def correct_run():
    return audit.run_audit(methods=("sample", "scale", "hybrid", "dpsgd"), **SMALL)


def test_correct_training_stays_below_its_certified_epsilon(correct_run):
    for row in correct_run["rows"]:
        assert row["epsilon_lower_bound"] <= row["certified_epsilon"], row
        assert row["certified_epsilon"] <= row["group_budget"]


@pytest.mark.parametrize("broken", ["no-clipping", "no-noise"])
def test_broken_training_is_caught_in_every_group(broken):
    result = audit.run_audit(methods=("hybrid",), broken=broken, **SMALL)
    for row in result["rows"]:
        assert row["epsilon_lower_bound"] > row["group_budget"], row


def test_non_private_training_is_caught():
    (row,) = audit.run_audit(methods=("non-private",), **SMALL)["rows"]
    assert row["group_budget"] is None and row["epsilon_lower_bound"] > 3.0


def test_pure_dp_p_value_is_the_binomial_tail():
    for r, v, eps in [(100, 70, 0.5), (40, 40, 2.0), (200, 90, 1.0)]:
        q = math.exp(eps) / (1 + math.exp(eps))
        assert audit.p_value(1000, r, v, eps, 0.0) == pytest.approx(binom.sf(v - 1, r, q), rel=1e-12)


def test_lower_bound_solves_the_test_and_grows_with_correct_guesses():
    m, r, delta = 1000, 200, 1e-5
    bounds = [audit.epsilon_lower_bound(m, r, v, delta) for v in (100, 130, 160, 190, 200)]
    assert bounds[0] == 0.0 and all(a < b for a, b in zip(bounds[1:], bounds[2:]))
    for v, eps in zip((130, 160, 190), bounds[1:4]):
        assert audit.p_value(m, r, v, eps, delta) <= 0.05 < audit.p_value(m, r, v, eps + 1e-6, delta)
    assert audit.p_value(m, r, 190, 1.0, 1e-3) > audit.p_value(m, r, 190, 1.0, 0.0)  # δ only weakens the test


def test_guessing_uses_the_extremes_of_the_scores():
    rng = np.random.default_rng(0)
    included = rng.random(400) < 0.5
    scores = included + 0.01 * rng.normal(size=400)  # perfectly separable
    bound, correct, guesses = audit.guess_and_bound(scores, included, 1e-5)
    assert correct == guesses >= 160 and bound > 3  # as many guesses as the smaller side allows


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="canaries_count"):
        audit.run_audit(canaries_count=2, quiet=True)
    with pytest.raises(ValueError, match="confidence"):
        audit.run_audit(confidence=1.5, quiet=True)
    with pytest.raises(ValueError, match="0 ≤ v ≤ r ≤ m"):
        audit.p_value(10, 20, 5, 1.0, 0.0)


def test_cli_writes_the_json_and_the_plot(tmp_path, capsys):
    out = tmp_path / "audit"
    assert main(["audit", "--methods", "sample", "nonprivate", "--canaries", "600", "--epochs", "3", "--quiet",
                 "--out", str(out)]) == 0
    result = json.loads((out / "audit.json").read_text())
    assert result["delta"] == 1e-5 and (out / "audit.png").stat().st_size > 0
    keys = {"method", "group_budget", "epsilon_lower_bound", "canaries", "correct", "guesses", "confidence"}
    assert all(keys <= set(r) for r in result["rows"])
    assert [r["method"] for r in result["rows"]] == ["sample"] * 3 + ["non-private"]
    assert "| sample | 1 |" in capsys.readouterr().out
    assert main(["audit", "--methods", "fast"]) != 0


def test_the_scorer_reads_the_dirac_canaries_as_the_dense_forward_does():
    """The scorer forms the first layer's output of canary i from W's column i alone; its gradient
    directions must be those of the dense forward over (m, features + m) inputs."""
    import torch

    torch.manual_seed(0)
    x, y, _, _ = audit.canaries(40, 6, 10, 3, 10.0, seed=1)
    model = audit.audit_model(x.shape[1], hidden=16)
    columns = torch.arange(6, 46)
    scorer = audit._Scorer(model, x, y, columns)
    hidden = model[0](x).detach().requires_grad_(True)
    (delta,) = torch.autograd.grad(torch.nn.functional.cross_entropy(model[1:](hidden), y, reduction="sum"), hidden)
    delta = delta.double()
    torch.testing.assert_close(scorer.directions, delta / delta.norm(dim=1, keepdim=True))
    x[0, 0] = 1.0  # a canary that is not Dirac
    with pytest.raises(ValueError, match="Dirac"):
        audit._Scorer(model, x, y, columns)


def test_the_audit_table_does_not_depend_on_the_threads_and_the_setting_is_restored():
    import torch

    before = torch.get_num_threads()
    runs = [audit.run_audit(methods=("sample",), canaries_count=600, epochs=2, quiet=True, threads=t)["rows"]
            for t in (1, 2)]
    assert runs[0] == runs[1]
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("kwargs,name", [(dict(delta=-1.0), "delta"), (dict(delta=1.0), "delta"),
                                         (dict(delta=float("nan")), "delta"), (dict(epsilon=float("nan")), "epsilon"),
                                         (dict(epsilon=-1.0), "epsilon"), (dict(epsilon=float("inf")), "epsilon"),
                                         (dict(m=10.5), "m")])
def test_p_value_refuses_a_hypothesis_outside_what_theorem_3_covers(kwargs, name):
    """δ = −1 used to be read as 0 (a bound inflated past what the test shows), ε = NaN gave p = 1."""
    args = dict(m=10, r=4, v=3, epsilon=1.0, delta=1e-5) | kwargs
    with pytest.raises(ValueError, match=f"^{name} must"):
        audit.p_value(**args)


@pytest.mark.parametrize("significance", [0.0, 1.0, -1.0, float("nan")])
def test_the_lower_bound_refuses_a_significance_outside_0_1(significance):
    """At significance 1 every ε is "rejected": the bound came out as 128 whatever the guesses."""
    with pytest.raises(ValueError, match="significance must lie in"):
        audit.epsilon_lower_bound(100, 100, 100, 1e-5, significance)


@pytest.mark.parametrize("scores,included,kwargs,name", [
    (np.zeros(10), np.zeros(8, bool), {}, "scores and included"),          # used to fail with an IndexError
    (np.arange(10.0), np.array([1, 0] * 5), {}, "included"),                # 0/1 read as indices
    (np.zeros(0), np.zeros(0, bool), {}, "scores"),
    (np.zeros(1), np.zeros(1, bool), {}, "scores"),
    (np.arange(10.0), np.array([True, False] * 5), dict(confidence=1.5), "confidence"),
    (np.arange(10.0), np.array([True, False] * 5), dict(fractions=()), "fractions"),  # ZeroDivisionError
    (np.arange(10.0), np.array([True, False] * 5), dict(fractions=(2.0,)), "fractions"),
    (np.arange(10.0), np.array([True, False] * 5), dict(delta=-1e-5), "delta"),
    (np.r_[np.arange(8.0), np.nan, np.nan], np.array([True, False] * 5), {}, "scores must be finite"),  # NaN: any rank
    (np.full(10, np.inf), np.array([True, False] * 5), {}, "scores must be finite")])
def test_guessing_refuses_inputs_that_would_give_no_bound_or_a_wrong_one(scores, included, kwargs, name):
    with pytest.raises((TypeError, ValueError), match=name):
        audit.guess_and_bound(scores, included, **({"delta": 1e-5} | kwargs))


@pytest.mark.parametrize("kwargs,name", [
    (dict(canary_scale=0.0), "canary_scale"), (dict(canary_scale=-5.0), "canary_scale"),
    (dict(canary_scale=float("nan")), "canary_scale"),                     # all three "passed" with bounds 0
    (dict(methods=("sample", "bogus")), "methods"),                        # sample used to train first
    (dict(methods=()), "methods"), (dict(methods=("sample", "sample")), "methods"), (dict(methods="sample"), "methods"),
    (dict(group_epsilons=()), "group_epsilons"), (dict(group_epsilons=2.0), "group_epsilons"),
    (dict(group_epsilons=(1.0, -1.0)), "group_epsilons"), (dict(group_epsilons=("1", "2")), "group_epsilons"),
    (dict(group_epsilons=(1.0, True)), "group_epsilons"), (dict(group_epsilons=(1.0, float("nan"))), "group_epsilons"),
    (dict(seed=2 ** 40), "seed"),                                          # scikit-learn's error, not naming seed
    (dict(broken="nonoise"), "broken")])
def test_an_audit_refuses_bad_settings_before_it_trains_anything(kwargs, name, monkeypatch):
    def trains(*args, **kw):
        raise AssertionError("a training run started")

    monkeypatch.setattr(audit, "audit_method", trains)
    with pytest.raises((TypeError, ValueError), match=name):
        audit.run_audit(**(dict(canaries_count=30, quiet=True) | kwargs))


def test_an_audit_batch_above_the_records_caps_q_at_1_with_a_warning_as_train_does():
    """It used to fail after loading with "steps must be a positive integer, got 0"."""
    with pytest.warns(UserWarning, match="batch_size 100000 exceeds the 1467 training records"):
        result = audit.run_audit(methods=("sample",), canaries_count=30, epochs=1, batch_size=100000, quiet=True)
    assert [r["group_budget"] for r in result["rows"]] == [1.0, 2.0, 3.0]


def test_canaries_at_scale_zero_are_refused_since_they_are_no_canaries():
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        audit.canaries(4, 3, 2, 1, 0.0, seed=0)


@pytest.mark.parametrize("call", [lambda: audit.format_table({}), lambda: audit.plot({}, "x.png")])
def test_a_result_that_is_not_an_audit_is_refused_naming_result(call):
    with pytest.raises(ValueError, match="result must be what run_audit returns"):
        call()


def test_the_audit_plot_is_written_in_the_format_its_suffix_names(tmp_path):
    result = {"rows": [{"method": "sample", "group_budget": 1.0, "epsilon_lower_bound": 0.1}], "confidence": 0.95}
    audit.plot(result, tmp_path / "a.pdf")
    assert (tmp_path / "a.pdf").read_bytes()[:5] == b"%PDF-"
    with pytest.raises(ValueError, match="path .* has suffix '.xyz'"):
        audit.plot(result, tmp_path / "a.xyz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pdf"]
