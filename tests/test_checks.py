"""The shared argument checks (``pdpfast._checks``): every entry point refuses the same bad inputs with
messages that name the argument; the right kind of wrong value gives TypeError, the wrong range ValueError."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pdpfast import _checks


@pytest.mark.parametrize("value", [True, np.bool_(False), "1", "1.0", None, [1.0], object()])
def test_a_number_is_not_a_bool_a_string_or_a_list(value):
    for check in (_checks.check_number, _checks.check_positive, _checks.check_nonnegative):
        with pytest.raises(TypeError, match="sigma must be a number"):
            check("sigma", value)


@pytest.mark.parametrize("value", [1, 2.5, np.float32(0.5), np.int64(3)])
def test_numbers_of_every_kind_come_back_as_floats(value):
    for check in (_checks.check_number, _checks.check_positive, _checks.check_nonnegative):
        out = check("x", value)
        assert isinstance(out, float) and out == float(value)


@pytest.mark.parametrize("value", [0, 0.0, -1e-300, -2, math.nan, math.inf])
def test_check_positive_refuses_zero_negatives_and_non_finite(value):
    with pytest.raises(ValueError, match=r"max_grad_norm must be a finite number > 0, got"):
        _checks.check_positive("max_grad_norm", value)


@pytest.mark.parametrize("value", [-1e-300, -1, math.nan, math.inf, -math.inf])
def test_check_nonnegative_refuses_negatives_and_non_finite(value):
    with pytest.raises(ValueError, match=r"noise_multiplier must be a finite number ≥ 0, got"):
        _checks.check_nonnegative("noise_multiplier", value)


def test_check_nonnegative_accepts_zero():
    assert _checks.check_nonnegative("noise_multiplier", 0) == 0.0


@pytest.mark.parametrize("value", [0, 1, "True", None, np.bool_(True)])
def test_a_flag_is_true_or_false_only(value):
    with pytest.raises(TypeError, match="clip_per_sample must be True or False"):
        _checks.check_flag("clip_per_sample", value)
    assert _checks.check_flag("clip_per_sample", True) is True
    assert _checks.check_flag("clip_per_sample", False) is False


@pytest.mark.parametrize("value", [0, -3, 1.5, True, "2"])
def test_check_int_refuses_non_ints_and_values_below_the_minimum(value):
    with pytest.raises(ValueError, match=r"epochs must be an int ≥ 1"):
        _checks.check_int("epochs", value, 1)


def test_check_choice_lists_the_choices():
    with pytest.raises(ValueError, match=r"rule must be one of 'all', 'sampled', got 'some'"):
        _checks.check_choice("rule", "some", ("all", "sampled"))
    _checks.check_choice("rule", "all", ("all", "sampled"))


@pytest.mark.parametrize("value", [0, 1, -0.1, 1.5, math.nan])
def test_delta_lies_strictly_inside_the_unit_interval(value):
    with pytest.raises(ValueError, match="delta"):
        _checks.check_delta("delta", value)


@pytest.mark.parametrize("value", ["1e-5", True, None, [1e-5]])
def test_delta_and_rates_must_be_numbers_not_strings_float_would_read(value):
    with pytest.raises(TypeError, match=r"delta must be a number in \(0, 1\)"):
        _checks.check_delta("delta", value)
    with pytest.raises(TypeError, match=r"sample_rate must be a number in \(0, 1\]"):
        _checks.check_rate("sample_rate", value)
    assert _checks.check_delta("delta", np.float32(1e-5)) == pytest.approx(1e-5)
    assert _checks.check_rate("sample_rate", 1) == 1.0


@pytest.mark.parametrize("values", [["1", "2"], np.array([True, True]), [1.0, None], np.array(["0.5"])])
def test_budgets_must_be_numbers_not_strings_bools_or_objects(values):
    with pytest.raises(TypeError, match="budgets must be numbers"):
        _checks.check_epsilons("budgets", values)
    np.testing.assert_array_equal(_checks.check_epsilons("budgets", [1, 2.5]), [1.0, 2.5])
    np.testing.assert_array_equal(_checks.check_epsilons("budgets", torch.tensor([0.5, 2.0])), [0.5, 2.0])


@pytest.mark.parametrize("value", ["10", True, None])
def test_a_count_given_as_text_or_a_bool_is_a_type_error(value):
    with pytest.raises(TypeError, match="steps must be a positive integer"):
        _checks.check_positive_integer("steps", value)
    assert _checks.check_positive_integer("steps", np.int64(3)) == 3 and _checks.check_positive_integer("n", 2.0) == 2


def test_compute_rdp_refuses_text_where_numbers_belong():
    from pdpfast.accounting import compute_rdp

    for args, name in [(("0.1", 1.0, 10), "q"), ((0.1, "1.0", 10), "noise_multiplier"), ((0.1, 1.0, "10"), "steps")]:
        with pytest.raises(TypeError, match=f"{name} must be numbers"):
            compute_rdp(*args)
    assert compute_rdp(0.1, 1.0, 10).shape == compute_rdp(np.float32(0.1), 1, np.int64(10)).shape


@pytest.mark.parametrize("value", ["0.1", True])
def test_an_interval_check_refuses_text_and_bools_as_type_errors(value):
    with pytest.raises(TypeError, match="client_rate must be a number"):
        _checks.check_in_range("client_rate", value, low=0.0, high=1.0)
    from pdpfast.fl.config import FLConfig

    with pytest.raises(TypeError, match="delta must be a number"):
        FLConfig(delta=value)
    assert _checks.check_in_range("client_rate", np.float32(0.5), low=0.0, high=1.0) == 0.5


@pytest.mark.parametrize("values", ["0.1", True, ["0.1", "0.2", "0.3"], np.array([True, False, True])])
def test_per_record_values_must_be_numbers(values):
    with pytest.raises(TypeError, match="sample_rates must be (a number|numbers)"):
        _checks.as_per_record("sample_rates", values, 3, low=0.0, high=1.0)
    np.testing.assert_array_equal(_checks.as_per_record("sample_rates", np.float32(0.5), 3, low=0.0, high=1.0),
                                  [0.5, 0.5, 0.5])
    np.testing.assert_array_equal(_checks.as_per_record("clip_norms", torch.tensor([1, 2, 3]), 3, low=0.0,
                                                        low_inclusive=False), [1.0, 2.0, 3.0])


# ------------------------------------------------------------- values that would silently change a bound


@pytest.mark.parametrize("loss_scale,error", [(-1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError),
                                              ("3", TypeError), (True, TypeError)])
def test_a_loss_scale_that_would_lift_the_clip_bound_is_refused(loss_scale, error):
    """s·w_i = min(s, c_i/‖g_i‖) with s < 0 is s: one record contributed 38× its bound."""
    from torch import nn

    from pdpfast.clipping import ClippingState
    from pdpfast.nn import convert

    state = ClippingState(convert(nn.Linear(3, 2)))
    with pytest.raises(error, match="loss_scale"):
        state.begin_batch(torch.ones(1), None, loss_scale=loss_scale)
    state.begin_batch(torch.ones(1), None, loss_scale=0.0)  # an empty draw under a mean loss
    assert state.loss_scale == 0.0


@pytest.mark.parametrize("clip_norms,error", [(torch.ones(3, dtype=torch.bool), TypeError), ("1", TypeError),
                                              (["1", "1", "1"], TypeError)])
def test_clip_norms_that_are_not_numbers_are_refused_by_name(clip_norms, error):
    from torch import nn

    from pdpfast.functional import clipped_gradients
    from pdpfast.nn import convert

    model = convert(nn.Linear(3, 2))
    with pytest.raises(error, match="clip_norms"):
        clipped_gradients(model, lambda out: out.sum(1), torch.randn(3, 3), clip_norms=clip_norms)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_batch_no_dp_layer_gradient_reached_has_zero_norms_and_sums_where_its_losses_are(mode):
    from torch import nn

    from pdpfast.functional import clipped_gradients
    from pdpfast.nn import convert

    model = convert(nn.Linear(3, 2)).double()
    free = torch.zeros(4, dtype=torch.float64, requires_grad=True)   # a loss term no DP layer is under
    out = clipped_gradients(model, lambda y: y.detach().sum(1) + free, torch.randn(4, 3, dtype=torch.float64),
                            clip_norms=torch.ones(4), mode=mode)
    assert torch.equal(out.norms, torch.zeros(4)) and out.norms.device == free.device
    assert all(torch.count_nonzero(g) == 0 for g in out.grads.values())


def test_boolean_budgets_are_refused_where_users_give_budgets():
    """True would read as ε = 1: the API, the CLI's files and programs' per-record arrays alike."""
    flags = np.ones(4, dtype=bool)
    with pytest.raises(ValueError, match="not booleans"):
        _checks.check_budgets(flags, 4)
    with pytest.raises(TypeError, match="budgets"):
        _checks.check_positive_per_record("budgets", flags, 4)
    with pytest.raises(TypeError, match="budgets"):
        _checks.check_positive_per_record("budgets", ["2.0"] * 4, 4)
    with pytest.raises(TypeError, match="budgets"):
        _checks.as_budget_vector("budgets", flags)


def test_the_ledger_refuses_per_id_rates_that_are_not_numbers():
    from pdpfast.accounting import IndividualAccountant

    ledger = IndividualAccountant(np.full(4, 0.1), np.full(4, 1.0))
    before = ledger.epsilons(1e-5)
    for rates in ([True, True], ["0.5", "0.5"]):
        with pytest.raises(TypeError, match="sample_rates"):
            ledger.step(record_ids=[0, 1], sample_rates=rates)
    with pytest.raises(ValueError, match="sample_rates") as caught:
        ledger.step(record_ids=[0, 1], sample_rates=[math.nan, 0.5])
    assert "twice" not in str(caught.value)
    np.testing.assert_array_equal(ledger.epsilons(1e-5), before)  # nothing was charged


@pytest.mark.parametrize("seed", ["123", 1.7, True, -1, 2**63, 2**70])
def test_a_seed_that_is_not_a_non_negative_int_is_refused_by_name(seed):
    """A seed fixes every Poisson draw and the noise: "123" failed deep inside, 1.7 ran as 1."""
    import pdpfast
    from pdpfast.data import DPDataLoader

    with pytest.raises(ValueError, match="seed must be an int"):
        pdpfast.PrivacyEngine(seed=seed)
    data = torch.utils.data.TensorDataset(torch.randn(10, 2))
    with pytest.raises(ValueError, match="seed must be an int"):
        DPDataLoader(data, sample_rates=0.5, seed=seed)
    with pytest.raises(ValueError, match="start_step must be an int"):
        DPDataLoader(data, sample_rates=0.5, seed=3, start_step=seed)
    assert DPDataLoader(data, sample_rates=0.5, seed=np.int64(3), start_step=2).next_step == 2


@pytest.mark.parametrize("name", ["steps_per_epoch", "physical_batch_size", "world_size", "rank"])
@pytest.mark.parametrize("value", [True, 2.0, "2", -1])
def test_the_loaders_counts_are_ints_and_bools_floats_or_text_are_refused_by_name(name, value):
    from pdpfast.data import DPDataLoader

    data = torch.utils.data.TensorDataset(torch.randn(10, 2))
    with pytest.raises(ValueError, match=f"{name} must be an int"):
        DPDataLoader(data, sample_rates=0.5, **{name: value})


def test_the_loaders_counts_may_be_numpy_ints_and_come_back_as_python_ints():
    from pdpfast.data import DPDataLoader

    data = torch.utils.data.TensorDataset(torch.randn(10, 2))
    loader = DPDataLoader(data, sample_rates=0.5, steps_per_epoch=np.int64(4), physical_batch_size=np.int32(8),
                          rank=np.int64(1), world_size=np.int64(2))
    assert (loader.steps_per_epoch, loader.physical_batch_size, loader.rank, loader.world_size) == (4, 8, 1, 2)
    assert all(type(v) is int for v in (loader.steps_per_epoch, loader.physical_batch_size, loader.rank))
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size\)"):
        DPDataLoader(data, sample_rates=0.5, rank=2, world_size=2)


def test_counts_elsewhere_accept_numpy_ints_and_refuse_bools():
    from pdpfast.accounting import calibrate

    budgets = np.array([1.0, 2.0, 2.0])
    plan = calibrate(budgets, delta=1e-5, steps=10, sample_rate=0.5, accountant="pld", pld_classes=np.int64(2))
    assert plan.budget_values.tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="pld_classes must be an int"):
        calibrate(budgets, delta=1e-5, steps=10, sample_rate=0.5, accountant="pld", pld_classes=True)


def test_a_model_that_is_not_a_module_is_a_type_error_where_models_are_taken():
    from pdpfast.clipping import ClippingState
    from pdpfast.nn import replace_batchnorm

    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        ClippingState("model")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got int"):
        replace_batchnorm(5)
    with pytest.raises(ValueError, match="max_groups must be an int ≥ 1"):
        replace_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(4)), max_groups=0)


@pytest.mark.parametrize("value", ["yes", "no", 1, None])
def test_switches_given_as_text_or_numbers_are_refused(value):
    """``strict="no"`` would have been truthy and raised; ``progress="no"`` would have drawn bars."""
    from pdpfast.demo import run_demo
    from pdpfast.validators import ModuleValidator

    with pytest.raises(TypeError, match="strict must be True or False"):
        ModuleValidator.validate(torch.nn.Linear(2, 2), strict=value)
    with pytest.raises(TypeError, match="progress must be True or False"):
        run_demo(epochs=1, seeds=(0,), methods=("sample",), progress=value)


@pytest.mark.parametrize("value", ["0.5", True])
def test_numbers_given_as_text_or_bools_are_refused_in_calibration_and_schedules(value):
    """float() read these: "0.5" calibrated a hybrid plan, and a schedule spec's period 50.9 ran as 50."""
    from pdpfast.accounting import calibrate, get_privacy_spent
    from pdpfast.accounting.schedules import ExponentialDecay, as_schedule

    with pytest.raises(TypeError, match="hybrid_weight must be a number"):
        calibrate(np.array([1.0, 2.0]), delta=1e-5, steps=10, sample_rate=0.5, method="hybrid", hybrid_weight=value)
    with pytest.raises(TypeError, match="delta must be a number"):
        get_privacy_spent([2.0, 4.0], [0.5, 1.0], value)
    with pytest.raises(TypeError, match="k must be a number"):
        ExponentialDecay(value)
    with pytest.raises(ValueError, match="period must be a positive integer, got 50.9"):
        as_schedule("step:0.7,50.9")
    with pytest.raises(ValueError, match="noise_schedule 'exponential:x'"):
        as_schedule("exponential:x")
    assert as_schedule("step:0.7,50").period == 50


@pytest.mark.parametrize("shares,message", [(["0.7", "0.7"], r"layer_shares\[0\] must be a number"),
                                            ([True, 0.7], r"layer_shares\[0\] must be a number"),
                                            ({"0": 0.7, "1": "0.7"}, r"layer_shares\['1'\] must be a number"),
                                            (torch.ones(2, dtype=torch.bool), "layer_shares must be real numbers")])
def test_layer_shares_that_are_not_numbers_are_refused_by_name(shares, message):
    from pdpfast.clipping import ClippingState
    from pdpfast.nn import convert

    model = convert(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
    with pytest.raises(TypeError, match=message):
        ClippingState(model, clipping="per_layer", layer_shares=shares)
    half = math.sqrt(0.5)
    for given in ([half, half], np.array([half, half]), torch.tensor([half, half])):
        shares = ClippingState(model, clipping="per_layer", layer_shares=given).shares
        assert shares.tolist() == pytest.approx([half, half])


def test_conflicting_shares_for_tied_layers_are_refused_naming_both_not_one_kept():
    from pdpfast.clipping import ClippingState
    from pdpfast.nn import convert

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.mid = torch.nn.Embedding(11, 6), torch.nn.Linear(6, 6)
            self.head = torch.nn.Linear(6, 11, bias=False)
            self.head.weight = self.emb.weight      # emb and head are one clipping group

        def forward(self, ids):
            return self.head(torch.tanh(self.mid(self.emb(ids))))

    model = convert(Tied())
    with pytest.raises(ValueError, match=r"layer_shares gives 'emb' 0\.1 and 'head' 0\.6, but they share a parameter "
                                         r"and are clipped as one group"):
        ClippingState(model, clipping="per_layer", layer_shares={"emb": 0.1, "head": 0.6, "mid": 0.8})
    shares = ClippingState(model, clipping="per_layer", layer_shares={"emb": 0.6, "head": 0.6, "mid": 0.8}).shares
    assert sorted(shares.tolist()) == pytest.approx([0.6, 0.8])      # the same share twice is one share


@pytest.mark.parametrize("rates,multipliers", [(np.full(3, 0.1), np.ones(5)), (np.full((3, 2), 0.1), 1.0)])
def test_a_ledger_of_mismatched_rates_and_multipliers_names_both_shapes(rates, multipliers):
    from pdpfast.accounting import IndividualAccountant

    with pytest.raises(ValueError, match=r"sample_rates and noise_multipliers must be .* got shapes"):
        IndividualAccountant(rates, multipliers)


def test_check_int_refuses_values_past_int64_so_torch_never_overflows():
    assert _checks.check_int("seed", 2**63 - 1, 0) == 2**63 - 1
    for value in (2**63, 2**70, np.uint64(2**64 - 1)):
        with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63 - 1"):
            _checks.check_int("seed", value, 0)
    with pytest.raises(ValueError, match=r"round must be an int in \[0, 3\]"):
        _checks.check_int("round", 4, 0, 3)


@pytest.mark.parametrize("values,kind", [(["1", "2"], "strings"), (np.array([1 + 1j, 2]), "complex numbers"),
                                         ([1.0, "2"], "strings"), ([{"a": 1}, 1.0], "dict")])
def test_budgets_that_are_strings_or_complex_are_refused_rather_than_converted(values, kind):
    """numpy would read "1" as ε = 1 and drop an imaginary part with only a warning."""
    with pytest.raises(TypeError, match=f"budgets .*{kind}"):
        _checks.check_budgets(values, 2)


def test_missing_budgets_say_they_are_required():
    with pytest.raises(TypeError, match="budgets are required"):
        _checks.check_budgets(None, 3)


def test_a_none_among_budgets_is_reported_as_a_missing_value_at_its_record():
    with pytest.raises(ValueError, match="missing or non-finite value at record 1"):
        _checks.check_budgets([1.0, None, 2.0], 3)


@pytest.mark.parametrize("n", [-1, "3", 3.0])
def test_check_budgets_refuses_a_record_count_that_is_not_an_int(n):
    with pytest.raises(ValueError, match="n \\(the number of records\\) must be an int ≥ 0"):
        _checks.check_budgets([1.0, 2.0, 3.0], n)
