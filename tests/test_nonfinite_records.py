"""Privacy property: one record whose per-sample gradient is not finite (a NaN or inf input, a log of
0, an overflow) does not turn the model NaN. Its clip weight, and so the clipped sum, would be NaN:
a change one record makes to the whole update, which no noise hides. On the CPU, where the check
costs no host synchronisation, its backward is refused with the records named, a step on the draw
is refused, and ``zero_grad()`` discards the draw so training goes on."""
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pdpfast
from pdpfast.functional import clipped_gradients

STYLES = {"bk": dict(mode="bk", clipping="flat"), "per_layer": dict(mode="bk", clipping="per_layer"),
          "ghost": dict(mode="ghost", clipping="flat")}


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("style", list(STYLES))
def test_a_record_whose_gradient_is_not_finite_is_refused_by_row(style, bad, dtype):
    model = pdpfast.nn.convert(_model(dtype))
    x = torch.randn(3, 4).to(dtype)
    x[1, 0] = bad
    y = torch.tensor([0, 1, 2])
    with pytest.raises(FloatingPointError, match=r"1 record\(s\) \(rows \[1\] of the batch\) have .*NaN or inf"):
        clipped_gradients(model, lambda out: nn.functional.cross_entropy(out.float(), y, reduction="none"), x,
                          clip_norms=torch.ones(3), **STYLES[style])


@pytest.mark.parametrize("style", list(STYLES))
def test_a_nonfinite_record_leaves_the_model_finite_and_training_goes_on(style):
    model = _model()
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    x[2, 1] = float("nan")
    engine = pdpfast.PrivacyEngine(seed=0)
    kwargs = dict(criterion=nn.CrossEntropyLoss(reduction="sum")) if style == "ghost" else {}
    made = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=1.0,
                               max_grad_norm=1.0, sample_rates=1.0, loss_reduction="sum", **STYLES[style], **kwargs)
    model, optimizer, loader = made[0], made[1], made[-1]
    criterion = made[2] if style == "ghost" else nn.CrossEntropyLoss(reduction="sum")
    before = [p.detach().clone() for p in model.parameters()]
    xb, yb = next(iter(loader))
    with pytest.raises(FloatingPointError, match=r"rows \[2\]"):
        criterion(model(xb), yb).backward()
    with pytest.raises(FloatingPointError, match="the step is refused"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    optimizer.zero_grad()
    x[2, 1] = 0.0           # the data mended (the loader's dataset holds x): the next draw steps
    xb, yb = next(iter(loader))
    criterion(model(xb), yb).backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_the_engine_names_the_nonfinite_record_by_its_index_in_the_dataset():
    """Before: "rows [1]" of a physical batch, which the user cannot map back to the data."""
    model = _model()
    x, y = torch.randn(8, 4), torch.arange(8) % 3
    x[5, 0] = float("nan")
    made = pdpfast.PrivacyEngine(seed=0).make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
        sample_rates=1.0, loss_reduction="sum", physical_batch_size=4)
    model, loader = made[0], made[-1]
    batches, refused = iter(loader), 0
    for _ in range(2):   # the draw of all 8 records in two physical batches of 4
        xb, yb = next(batches)
        loss = nn.functional.cross_entropy(model(xb), yb, reduction="sum")
        row = torch.isnan(xb).any(1).nonzero().flatten().tolist()
        if row:
            named = re.escape(f"dataset records [5] (0-based; rows {row} of the batch)")
            with pytest.raises(FloatingPointError, match=named):
                loss.backward()
            refused += 1
        else:
            loss.backward()
    assert refused == 1
