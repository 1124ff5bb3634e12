"""The shared training loop (pdpfast.loop): what it cannot run is refused by name before any step."""
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pdpfast.engine import PrivacyBudgetExceeded
from pdpfast.loop import Task, evaluate, private_engine, private_steps

N = 32


def _data(n=N):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))


def _run(steps=6, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3))
    return private_engine("sample", model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), np.ones(N),
                          delta=1e-5, steps=steps, sample_rate=0.25, batch_size=8, **kwargs)


def _steps(run, **kwargs):
    private_steps(run.engine, run.model, run.optimizer, kwargs.pop("loader", run.loader), Task(), run.criterion,
                  **kwargs)


@pytest.mark.parametrize("kwargs,name", [(dict(kind="regression"), "kind"), (dict(family="bart"), "family"),
                                         (dict(pad_id=-1), "pad_id"), (dict(pad_id=0.5), "pad_id")])
def test_a_task_of_unknown_kind_or_family_is_refused_by_name(kwargs, name):
    """Before: accepted; kind="regression" then trained as classification, family="bart" as plain."""
    with pytest.raises(ValueError, match=f"{name} must be"):
        Task(**kwargs)


def test_a_task_given_as_a_string_is_refused_by_name():
    """Before: AttributeError 'str' object has no attribute 'criterion' / 'evaluate'."""
    with pytest.raises(TypeError, match="task must be a pdpfast.loop.Task"):
        _run(task="lm")
    with pytest.raises(TypeError, match="task must be a pdpfast.loop.Task"):
        evaluate(nn.Linear(5, 3), _data(), task="lm")
    run = _run()
    with pytest.raises(TypeError, match="task must be a pdpfast.loop.Task"):
        private_steps(run.engine, run.model, run.optimizer, run.loader, "lm", run.criterion, until=1)


def test_evaluating_an_empty_dataset_is_refused_rather_than_reported_as_accuracy_0():
    empty = TensorDataset(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="dataset is empty"):
        evaluate(nn.Linear(5, 3), empty)
    with pytest.raises(ValueError, match="batch_size must be an int"):
        Task().evaluate(nn.Linear(5, 3), _data(), batch_size=0)


def test_a_loader_that_yields_no_batch_is_an_error_not_a_hang():
    run = _run()
    with pytest.raises(ValueError, match="loader yielded no batch"):
        _steps(run, loader=[], until=3)


@pytest.mark.parametrize("until,error", [(7.5, ValueError), (0, ValueError), (-3, ValueError), ("9", TypeError),
                                         (True, TypeError)])
def test_until_must_be_a_positive_integer(until, error):
    """Before: 7.5 ran 8 steps, -3 none, "9" a TypeError from comparing int and str."""
    run = _run()
    with pytest.raises(error, match="until must be a positive integer"):
        _steps(run, until=until)
    assert run.engine.steps == 0


def test_until_past_the_plan_is_refused_before_any_step():
    """Before: the plan's steps ran, then PrivacyBudgetExceeded left the batch open."""
    run = _run(steps=6)
    with pytest.raises(ValueError, match=r"until \(7\) is past the plan's 6 steps"):
        _steps(run, until=7)
    assert run.engine.steps == 0
    _steps(run, until=6)
    assert run.engine.steps == 6


def test_a_refused_step_discards_its_draw_so_the_next_run_starts_a_fresh_one():
    """A step the engine refuses (a pre-step hook raising PrivacyBudgetExceeded, as the ledger does) leaves
    no open batch behind: before, the next call failed with "a new Poisson draw began before optimizer.step()"."""
    run = _run(steps=6)

    def refuse_once(optimizer):
        if optimizer.steps == 2 and not refused:
            refused.append(True)
            raise PrivacyBudgetExceeded("refused once")

    refused = []
    run.optimizer.pre_step_hooks.append(refuse_once)
    with pytest.raises(PrivacyBudgetExceeded, match="refused once"):
        _steps(run, until=4)
    assert run.engine.steps == 2
    _steps(run, until=4)
    assert run.engine.steps == 4


@pytest.mark.parametrize("autocast,error", [("bf16", TypeError), (torch.float32, ValueError),
                                            (torch.int8, ValueError)])
def test_autocast_must_be_a_low_precision_dtype(autocast, error):
    """Before: "bf16" failed inside torch.autocast, after the loader had opened a batch."""
    run = _run()
    with pytest.raises(error, match="autocast must be"):
        _steps(run, until=1, autocast=autocast)


def test_on_step_must_be_callable():
    run = _run()
    with pytest.raises(TypeError, match="on_step must be callable"):
        _steps(run, until=1, on_step=5)
    assert run.engine.steps == 0
