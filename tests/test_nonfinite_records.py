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
    optimizer.step()        # the discarded draw's step: noise only
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


# On a GPU the norms go to the host without stopping it (pdpfast.clipping.DEFERRED_CHECK_DEVICES) and
# are read at a step once there. The same route, run on the CPU: the copy is there at once, or, with
# ``ready`` stubbed, only later (the GPU still busy when the draw's step came).

@pytest.fixture
def deferred(monkeypatch):
    monkeypatch.setattr(pdpfast.clipping, "CHECK_FINITE_ON_CPU", False)
    monkeypatch.setattr(pdpfast.clipping, "DEFERRED_CHECK_DEVICES", ("cpu",))


def _engine_run(x, y, **kwargs):
    model, engine = _model(), pdpfast.PrivacyEngine(seed=0)
    made = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)), noise_multiplier=1.0, max_grad_norm=1.0,
        sample_rates=1.0, loss_reduction="sum", **kwargs)
    model, optimizer, loader = made[0], made[1], made[-1]

    def backward():
        xb, yb = next(iter(loader))
        nn.functional.cross_entropy(model(xb), yb, reduction="sum").backward()
    return model, optimizer, backward, engine


def _late_copies(monkeypatch, late: int):
    """The first ``late`` reads of a deferred copy find it still on its way."""
    calls = [0]
    real = pdpfast.clipping._DeferredCheck.ready

    def ready(self, wait=False):
        calls[0] += 1
        return wait or (calls[0] > late and real(self))
    monkeypatch.setattr(pdpfast.clipping._DeferredCheck, "ready", ready)


@pytest.mark.parametrize("style", ["bk", "per_layer"])
def test_a_gpus_deferred_check_refuses_the_draws_own_step_when_its_norms_are_there(deferred, style):
    """The backward does not wait for the norms; the draw's step reads them and is refused, naming
    the record; zero_grad() discards the draw and training goes on, as where the check is immediate."""
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    x[2, 1] = float("nan")
    model, optimizer, backward, engine = _engine_run(x, y, **STYLES[style])
    before = [p.detach().clone() for p in model.parameters()]
    backward()  # no error: the norms are on their way to the host
    with pytest.raises(FloatingPointError, match=r"the step is refused: 1 record\(s\) \(dataset records \[2\] "
                                                 r"\(0-based; rows \[2\] of the batch\)\) .* Read on the host after "
                                                 "the backward"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    optimizer.zero_grad()
    optimizer.step()   # the discarded draw's step: noise only
    x[2, 1] = 0.0
    backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_deferred_check_read_after_the_draws_step_refuses_the_next_step_once_saying_so(deferred, monkeypatch):
    """The GPU had not finished the draw's backward at its step: the step was applied (the model is
    NaN), and the next step is refused, naming the record and saying what happened."""
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    x[3, 0] = float("inf")
    model, optimizer, backward, engine = _engine_run(x, y)
    checkpoint = [p.detach().clone() for p in model.parameters()]
    _late_copies(monkeypatch, late=1)
    backward()
    optimizer.step()   # the copy not there yet: applied
    assert not all(torch.isfinite(p).all() for p in model.parameters())
    x[3, 0] = 0.0
    backward()
    with pytest.raises(FloatingPointError, match=r"the step is refused: in an earlier draw, 1 record\(s\) \(dataset "
                                                 r"records \[3\].* after that draw's step was applied: the model's "
                                                 "parameters may now be NaN or inf. Restore them from a checkpoint"):
        optimizer.step()
    with torch.no_grad():  # a caller that restores the parameters goes on: the earlier draw's error is raised once
        for p, saved in zip(model.parameters(), checkpoint):
            p.copy_(saved)
    with pytest.raises(FloatingPointError, match="this draw's clipped sums were computed after an earlier draw's "
                                                 "step made the parameters NaN or inf. Call optimizer.zero_grad"):
        optimizer.step()   # the open draw's came from the NaN parameters
    optimizer.zero_grad()
    optimizer.step()   # the discarded draw's step: noise only
    backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_deferred_check_of_a_discarded_draw_is_dropped(deferred, monkeypatch):
    """A draw discarded before its copy was read (zero_grad) released nothing: its check is dropped,
    and the next draw steps."""
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    x[1, 1] = float("nan")
    model, optimizer, backward, engine = _engine_run(x, y)
    _late_copies(monkeypatch, late=1)
    backward()
    optimizer.zero_grad()
    optimizer.step()   # the discarded draw's step: noise only (its copy, there now, is not read)
    x[1, 1] = 0.0
    backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_deferred_checks_wait_for_the_oldest_copy_past_their_bound(deferred, monkeypatch):
    """A GPU is never that far behind, but the queue of copies stays bounded: past
    ``MAX_DEFERRED_CHECKS`` the oldest is waited for and read."""
    monkeypatch.setattr(pdpfast.clipping, "MAX_DEFERRED_CHECKS", 2)
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    model, optimizer, backward, engine = _engine_run(x, y, physical_batch_size=2)
    _late_copies(monkeypatch, late=10 ** 6)
    seen = []
    for _ in range(3):   # three draws of two physical batches each: six copies, never read on time
        backward()
        backward()
        seen.append(len(engine.state._deferred))
        optimizer.step()
    assert seen == [2, 2, 2]


@pytest.mark.parametrize("style", list(STYLES))
def test_a_padding_row_copying_a_nonfinite_record_is_refused_though_that_record_was_not_drawn(style):
    """Privacy: a physical batch is padded with copies of a record (mask 0, bound 0), and 0·NaN is
    NaN: a record that was not drawn turned the clipped sum NaN unseen, since masked rows were left
    out of the check. A padding row is refused as a drawn one is."""
    model = pdpfast.nn.convert(_model())
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 2])
    x[1, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"1 record\(s\) \(rows \[1\] of the batch\)"):
        clipped_gradients(model, lambda out: nn.functional.cross_entropy(out, y, reduction="none"), x,
                          clip_norms=torch.ones(3), mask=torch.tensor([1.0, 0.0, 1.0]), **STYLES[style])


def test_the_functional_api_queues_no_deferred_check(deferred):
    """Only the engine reads deferred checks (at its steps): a bare clipping state queues none."""
    from pdpfast.clipping import ClippingState

    model = pdpfast.nn.convert(_model())
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 2])
    state = ClippingState(model)
    state.attach()
    try:
        state.begin_batch(torch.ones(3))
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        assert state.pending and state._deferred == []
        state.defer_checks = True   # as the engine sets it
        state.end_draw()
        state.begin_batch(torch.ones(3))
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        assert len(state._deferred) == 1
    finally:
        state.detach()


def test_a_full_queue_of_deferred_checks_never_raises_inside_a_backward(deferred, monkeypatch):
    """A draw of many physical batches fills the queue before its step: past its bound the oldest
    copy is read inside a backward. What it finds on a stepped draw is kept for that step (raising
    in the backward left the batch open and training stuck), and the documented recovery works."""
    x, y = torch.randn(10, 4), torch.arange(10) % 3
    x[9, 1] = float("nan")
    model, optimizer, backward, engine = _engine_run(x, y, physical_batch_size=1)
    checkpoint = [p.detach().clone() for p in model.parameters()]
    _late_copies(monkeypatch, late=10 ** 6)   # read only when waited for (the queue's bound)
    for _ in range(10):
        backward()
    optimizer.step()   # applied: its ten copies unread
    x[9, 1] = 0.0
    for _ in range(10):
        backward()     # the bound reads the stepped draw's copies: no error here
    with pytest.raises(FloatingPointError, match=r"in an earlier draw, 1 record\(s\) \(dataset records \[9\]"):
        optimizer.step()
    with torch.no_grad():
        for p, saved in zip(model.parameters(), checkpoint):
            p.copy_(saved)
    optimizer.zero_grad()
    optimizer.step()   # the discarded draw's noise-only step
    for _ in range(10):
        backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_gpu_several_draws_behind_reports_the_first_nonfinite_draw_once(deferred, monkeypatch):
    """The GPU three draws behind: the draws stepped after the NaN one ran on its NaN parameters, so
    their norms are NaN too; after the first draw's error (and a restored checkpoint) they are not
    reported again, naming records that were clean."""
    x, y = torch.randn(8, 4), torch.arange(8) % 3
    model, optimizer, backward, engine = _engine_run(x, y)
    born = {}
    real_init = pdpfast.clipping._DeferredCheck.__init__

    def init(self, *args):
        real_init(self, *args)
        born[id(self)] = optimizer.steps
    monkeypatch.setattr(pdpfast.clipping._DeferredCheck, "__init__", init)
    monkeypatch.setattr(pdpfast.clipping._DeferredCheck, "ready",
                        lambda self, wait=False: wait or optimizer.steps - born[id(self)] >= 3)
    errors = []
    for draw in range(8):
        if draw == 1:
            checkpoint = [p.detach().clone() for p in model.parameters()]
        x[5, 1] = float("nan") if draw == 1 else 0.0
        backward()
        try:
            optimizer.step()
        except FloatingPointError as exc:
            errors.append((draw, str(exc)))
            with torch.no_grad():
                for p, saved in zip(model.parameters(), checkpoint):
                    p.copy_(saved)
            optimizer.zero_grad()
            optimizer.step()
    assert len(errors) == 1 and errors[0][0] == 4 and "dataset records [5]" in errors[0][1], errors
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_checkpoint_waits_for_the_last_draws_norms(deferred, monkeypatch, tmp_path):
    """Nothing reads the last draw's copy at a step: saving a checkpoint waits for it, so a model a
    record turned NaN is not saved as a good one."""
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    x[0, 2] = float("inf")
    model, optimizer, backward, engine = _engine_run(x, y)
    _late_copies(monkeypatch, late=10 ** 6)
    backward()
    optimizer.step()
    with pytest.raises(FloatingPointError, match=r"in an earlier draw, 1 record\(s\) \(dataset records \[0\]"):
        engine.save_checkpoint(tmp_path / "ckpt.pt", model)
    assert not (tmp_path / "ckpt.pt").exists()


def test_a_batch_named_with_records_names_its_nonfinite_record_by_its_dataset_index():
    """``engine.records(idx)``: the error names the record as the loader's batches do, not by its row
    of the hand-built batch (before: rows only)."""
    x, y = torch.randn(12, 4), torch.arange(12) % 3
    x[7, 3] = float("nan")
    model, engine = _model(), pdpfast.PrivacyEngine(seed=0)
    model, optimizer, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
        clip_norms=torch.ones(12))
    idx = torch.tensor([2, 7, 11])
    with pytest.warns(UserWarning, match="Poisson sampling"), engine.records(idx):
        with pytest.raises(FloatingPointError, match=re.escape("dataset records [7] (0-based; rows [1] of the batch)")):
            nn.functional.cross_entropy(model(x[idx]), y[idx], reduction="sum").backward()


def test_a_draw_refused_for_a_nonfinite_record_is_closed_by_a_noise_only_step_not_skipped():
    """Privacy: a step refused for a non-finite record reads the records, so the loader does not let
    the next draw begin until the refused one is closed by zero_grad() and a noise-only step (as any
    discarded draw): which steps are released must not depend on whether such a record was drawn.
    Before, the refusal freed the loader as a refusal by the ledger (which reads no record) does."""
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    x[1, 2] = float("nan")
    model, optimizer, backward, engine = _engine_run(x, y)
    with pytest.raises(FloatingPointError):
        backward()
    with pytest.raises(FloatingPointError, match="the step is refused"):
        optimizer.step()
    optimizer.zero_grad()
    x[1, 2] = 0.0
    with pytest.raises(RuntimeError, match="was not stepped before draw 1 began: every draw ends in optimizer.step"):
        backward()
    steps = optimizer.steps
    optimizer.step()   # noise only, charged like any step
    assert optimizer.steps == steps + 1
    backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_private_step_whose_backward_is_refused_zeroes_its_buffers_before_the_next_draw():
    """``make_step`` sums a draw's physical batches into buffers of its own: a backward refused for
    a non-finite record may have written them, and they were kept for the next draw (marked dirty
    only after a batch returned), which then turned the model NaN after a correct recovery."""
    x, y = torch.randn(8, 4), torch.arange(8) % 3
    model, engine = _model(), pdpfast.PrivacyEngine(seed=0)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
        sample_rates=1.0, loss_reduction="sum", physical_batch_size=2)
    step = engine.make_step(lambda xb, yb: nn.functional.cross_entropy(model(xb), yb, reduction="sum"),
                            cuda_graph=False)
    for xb, yb in loader:   # a clean draw of four physical batches: the buffers exist
        step(xb, yb)
    x[:, 1] = float("nan")   # every record: every physical batch of the next draw is refused
    refused = 0
    for xb, yb in loader:
        with pytest.raises(FloatingPointError):
            step(xb, yb)
        refused += 1
    assert refused == 4
    x[:, 1] = 0.0
    with pytest.raises(FloatingPointError, match="the step is refused"):
        optimizer.step()
    optimizer.zero_grad()
    optimizer.step()   # noise only
    for xb, yb in loader:
        step(xb, yb)
    assert engine.steps == 3 and all(torch.isfinite(p).all() for p in model.parameters())


def test_a_discarded_draw_not_yet_closed_refuses_a_checkpoint_and_a_hand_built_batch(tmp_path):
    """Between zero_grad() and the noise-only step that closes a refused draw, a checkpoint would
    resume past it, and a hand-built batch's step would free the loader from it: both are refused."""
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    x[3, 3] = float("nan")
    model, optimizer, backward, engine = _engine_run(x, y)
    with pytest.raises(FloatingPointError):
        backward()
    with pytest.raises(FloatingPointError):
        optimizer.step()
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match="before Poisson draw 0, discarded by optimizer.zero_grad.., is closed"):
        engine.save_checkpoint(tmp_path / "ckpt.pt", model)
    with pytest.raises(RuntimeError, match="Poisson draw 0 was discarded .zero_grad. and is not closed"), \
            pytest.warns(UserWarning), engine.records(torch.tensor([0, 1])):
        pass
    optimizer.step()
    engine.save_checkpoint(tmp_path / "ckpt.pt", model)


def test_an_earlier_draws_error_read_before_a_one_batch_private_step_keeps_its_draw_open(deferred):
    """``make_step``'s one-batch route reads the deferred checks before the draw's backward: an error
    about an earlier draw refuses the step and, as for the eager route, leaves the draw to be closed
    by a noise-only step, not skipped."""
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    model, engine = _model(), pdpfast.PrivacyEngine(seed=0)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
        sample_rates=1.0, loss_reduction="sum")
    step = engine.make_step(lambda xb, yb: nn.functional.cross_entropy(model(xb), yb, reduction="sum"),
                            cuda_graph=False)
    x[2, 0] = float("nan")
    step(*next(iter(loader)))   # applied (the checks are read before the backward): read at the next step
    x[2, 0] = 0.0
    with pytest.raises(FloatingPointError, match="in an earlier draw"):
        step(*next(iter(loader)))
    with pytest.raises(RuntimeError, match="was not stepped before draw 2 began"):
        step(*next(iter(loader)))
    optimizer.step()   # noise only: closes draw 1
    assert engine.steps == 2
