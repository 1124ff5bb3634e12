"""The lifecycle of a private batch: every way of driving the API keeps each record within its clip
bound and charges every draw (issue: privacy safety first).

A draw opens its batch, ``optimizer.step()`` closes it; a second backward into it, a second draw
before the step, or a forward with no open batch is refused with a message that says what to do.
"""
import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pdpfast
from pdpfast.clipping import ClippingState, Phase
from pdpfast.functional import clipped_gradients

STYLES = [dict(mode="bk", clipping="flat"), dict(mode="bk", clipping="per_layer"), dict(mode="ghost", clipping="flat")]
STYLE_IDS = ["bk", "per_layer", "ghost"]


def _engine(n=1, d=4, sample_rates=1.0, clip=1.0, physical_batch_size=None, seed=0, clip_norms=None, **style):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * 10  # large gradients: every record is clipped
    y = torch.randint(0, 3, (n,), generator=g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = pdpfast.PrivacyEngine(seed=seed)
    kwargs = dict(criterion=nn.CrossEntropyLoss(reduction="sum")) if style.get("mode") == "ghost" else {}
    out = engine.make_private(module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=1),
                              noise_multiplier=0.0, max_grad_norm=clip, sample_rates=sample_rates,
                              clip_norms=clip_norms, loss_reduction="sum", physical_batch_size=physical_batch_size,
                              **style, **kwargs)
    if style.get("mode") == "ghost":
        model, opt, criterion, loader = out
    else:
        model, opt, loader = out
        criterion = nn.CrossEntropyLoss(reduction="sum")
    return engine, model, opt, criterion, loader


def _grad_norm(model) -> float:
    return float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None)))


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_second_backward_never_exceeds_clip_bound(style):
    engine, model, opt, criterion, loader = _engine(**style)
    x, y = next(iter(loader))
    loss = criterion(model(x), y)
    if style["mode"] == "ghost":
        loss.backward()
        with pytest.raises(RuntimeError, match="already computed"):
            loss.backward()
    else:
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="second contribution"):
            loss.backward()
    assert _grad_norm(model) <= 1.0 * (1 + 1e-6)


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_second_forward_backward_on_the_same_batch_is_refused(style):
    engine, model, opt, criterion, loader = _engine(**style)
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    with pytest.raises(RuntimeError, match="already computed"):
        model(x)
    assert _grad_norm(model) <= 1.0 * (1 + 1e-6)


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_two_losses_of_one_batch_added_are_clipped_once(style):
    """The supported way to combine two passes over one batch: add the losses, backward once."""
    if style["mode"] == "ghost":
        pytest.skip("ghost mode takes the wrapped criterion's per-sample losses")
    engine, model, opt, criterion, loader = _engine(**style)
    x, y = next(iter(loader))
    (criterion(model(x), y) + criterion(model(x * 2), y)).backward()
    assert _grad_norm(model) <= 1.0 * (1 + 1e-6)


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_every_draw_is_charged_gradient_accumulation_over_draws_is_refused(style):
    """Stepping every second draw would charge one step for two draws: refused at the second."""
    engine, model, opt, criterion, loader = _engine(n=6, sample_rates=0.5, **style)
    with pytest.raises(RuntimeError, match="physical_batch_size"):
        for i, (x, y) in enumerate(loader):
            criterion(model(x), y).backward()
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()
    assert engine.steps == 0


def test_a_skipped_draw_is_refused_since_which_steps_are_released_would_depend_on_who_was_drawn():
    """Before: a draw left unused (`continue` on an empty batch, a common Opacus-era idiom) was neither
    stepped nor charged, so the released steps were those whose draws were not empty."""
    engine, model, opt, criterion, loader = _engine(n=6, sample_rates=0.5)
    it = iter(loader)
    next(it)  # drawn, never used
    with pytest.raises(RuntimeError, match="Poisson draw 0 was not stepped before draw 1 began: every draw ends in "
                                           "optimizer.step\\(\\), an empty one too"):
        next(it)
    assert engine.steps == 0
    opt.zero_grad()
    opt.step()                  # the remedy the message names: a noise-only step, charged
    assert engine.steps == 1
    x, y = next(iter(loader))
    assert loader.current.step == 1     # the draw refused at its start was not given out: offered again
    criterion(model(x), y).backward()
    opt.step()
    assert engine.steps == 2


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_forward_without_an_open_batch_is_refused(style):
    """With per-record bounds, a batch built by hand after the loader's batch was stepped has no
    known records or bounds (it must name them: ``engine.records``)."""
    engine, model, opt, criterion, loader = _engine(n=4, sample_rates=1.0, clip_norms=[0.5, 1.0, 1.0, 2.0], **style)
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="needs an open batch"):
        model(torch.randn_like(x))


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_hand_built_batch_with_one_bound_for_all_records_is_clipped_to_it(style):
    """With the same bound c for every record (Opacus's setting), a hand-built batch opens itself:
    each of its rows is clipped to c, whatever its records are."""
    engine, model, opt, criterion, loader = _engine(n=4, sample_rates=1.0, clip=0.01, **style)
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    x = torch.randn_like(x) * 100
    with pytest.warns(UserWarning, match="Poisson sampling"):
        criterion(model(x), y).backward()
    assert _grad_norm(model) <= x.shape[0] * 0.01 * (1 + 1e-6)


def test_stale_batch_context_is_never_reused_for_a_hand_built_batch():
    """The issue's attack: records with c = 0.01, then a hand-built batch of the same size."""
    engine, model, opt, criterion, loader = _engine(n=4, sample_rates=1.0, clip=0.01,
                                                    clip_norms=[0.01, 0.01, 0.01, 0.02])
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    opt.step()
    with pytest.raises(RuntimeError):
        criterion(model(torch.randn_like(x) * 100), y).backward()
    with pytest.raises(RuntimeError):
        opt.zero_grad()
        criterion(model(torch.randn_like(x) * 100), y).backward()


def test_forward_in_eval_mode_or_without_grad_needs_no_batch():
    """Evaluation computes the layers as they are, without opening or needing a batch."""
    engine, model, opt, criterion, loader = _engine(n=4)
    x = torch.randn(3, 4)
    with torch.no_grad():
        first, last = model[0], model[2]
        expected = nn.functional.linear(torch.tanh(nn.functional.linear(x, first.weight, first.bias)),
                                        last.weight, last.bias)
    model.eval()
    out = model(x)
    torch.testing.assert_close(out.detach(), expected)
    model.train()
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)
    assert engine.state.phase is Phase.IDLE


def test_zero_grad_between_physical_batches_keeps_the_draw():
    """zero_grad() at the top of the loop must not drop the first physical batches of a draw."""
    kwargs = dict(n=8, sample_rates=1.0, seed=1)
    engine, model, opt, criterion, loader = _engine(physical_batch_size=3, **kwargs)
    for x, y in loader:
        opt.zero_grad()
        criterion(model(x), y).backward()
        if loader.current.is_last:
            break
    split = {n: p.grad.clone() for n, p in model.named_parameters()}
    engine2, model2, opt2, criterion2, loader2 = _engine(**kwargs)
    x, y = next(iter(loader2))
    criterion2(model2(x), y).backward()
    for n, p in model2.named_parameters():
        torch.testing.assert_close(split[n], p.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_a_draw_left_part_way_goes_on_where_it_stopped_and_no_batch_is_replayed(style):
    """Before: a second pass began again at the first physical batch of the draw it left, whose rows
    then added to the pending sums twice (a record at 2·c_i in one step)."""
    kwargs = dict(n=6, sample_rates=1.0, seed=1, **style)
    engine, model, opt, criterion, loader = _engine(physical_batch_size=2, **kwargs)
    rows = []
    for x, y in loader:                 # a break, an exception, a retry loop: the draw is left part-way
        rows += loader.current.indices.tolist()
        criterion(model(x), y).backward()
        break
    for x, y in loader:
        rows += loader.current.indices.tolist()
        criterion(model(x), y).backward()
        if loader.current.is_last:
            break
    assert sorted(rows) == list(range(6))      # each record once: nothing replayed, nothing dropped
    split = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    assert engine.steps == 1
    _, whole_model, _, whole_criterion, whole_loader = _engine(**kwargs)
    x, y = next(iter(whole_loader))
    whole_criterion(whole_model(x), y).backward()
    for n, p in whole_model.named_parameters():
        torch.testing.assert_close(split[n], p.grad, rtol=1e-5, atol=1e-6)


class _Scaled(nn.Module):
    """A model with a parameter outside its DP layers, frozen when it is made private."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        self.temp = nn.Parameter(torch.ones(()), requires_grad=False)

    def forward(self, x):
        return self.net(x) * self.temp


def _scaled_engine(**style):
    model = _Scaled()
    kwargs = dict(criterion=nn.CrossEntropyLoss(reduction="sum")) if style.get("mode") == "ghost" else {}
    out = pdpfast.PrivacyEngine(seed=0).make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(torch.randn(4, 4) * 10, torch.randint(0, 3, (4,))), batch_size=4),
        noise_multiplier=0.0, max_grad_norm=1.0, sample_rates=1.0, loss_reduction="sum", **style, **kwargs)
    return model, out


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_a_parameter_unfrozen_after_make_private_never_reaches_a_step_unclipped(style):
    """Before: it had no guard (guards go on the parameters trainable at make_private) and its plain
    autograd gradient was noised and stepped."""
    model, out = _scaled_engine(**style)
    model.temp.requires_grad_(True)
    with pytest.raises(RuntimeError, match="parameter temp was frozen when the model was made private"):
        next(iter(out.data_loader))
    model.temp.requires_grad_(False)    # frozen again: training goes on
    x, y = next(iter(out.data_loader))
    model.temp.requires_grad_(True)     # unfrozen inside the draw: refused at the step, before any update
    criterion = out[2] if style["mode"] == "ghost" else nn.CrossEntropyLoss(reduction="sum")
    criterion(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="parameter temp was frozen"):
        out.optimizer.step()
    assert out.optimizer.steps == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_a_dp_layer_unfrozen_after_make_private_is_refused_by_name(style):
    """Before: flat clipping let its weight, used through F.linear, step unclipped; per-layer clipping
    failed in the backward with a TypeError (the layer has no clipping group)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].requires_grad_(False)
    kwargs = dict(criterion=nn.CrossEntropyLoss(reduction="sum")) if style.get("mode") == "ghost" else {}
    out = pdpfast.PrivacyEngine(seed=0).make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(torch.randn(4, 4), torch.randint(0, 3, (4,))), batch_size=4),
        noise_multiplier=0.0, max_grad_norm=1.0, loss_reduction="sum", **style, **kwargs)
    model[0].requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"parameter 0\.weight was frozen when the model was made private"):
        next(iter(out.data_loader))


def test_a_parameter_added_to_the_optimizer_after_make_private_is_refused_at_the_step():
    engine, model, opt, criterion, loader = _engine(n=4)
    bias = nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [bias]})
    x, y = next(iter(loader))
    criterion(model(x) + bias, y).backward()
    with pytest.raises(RuntimeError, match="the optimizer updates a parameter of shape \\(3,\\) that the engine "
                                           "does not clip"):
        opt.step()
    assert engine.steps == 0 and torch.equal(bias, torch.zeros(3))


def test_the_optimizer_given_to_make_private_cannot_step_the_clipped_sum_without_noise():
    """Before: a reference kept to the torch optimizer (a trainer, a scheduler) stepped the clipped
    sum with no noise and no charge; only the next draw was refused."""
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = pdpfast.PrivacyEngine(seed=0)
    _, opt, loader = engine.make_private(
        module=model, optimizer=sgd, noise_multiplier=5.0, max_grad_norm=1.0,
        data_loader=DataLoader(TensorDataset(torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)),
                               batch_size=4))
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="SGD.step\\(\\) was called on the optimizer given to make_private"):
        sgd.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and engine.steps == 0
    opt.step()                                  # the private step goes through the same optimizer
    assert engine.steps == 1 and not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    engine.detach()                             # without DP again: the optimizer is the user's
    nn.functional.cross_entropy(model(x), y).backward()
    sgd.step()


@pytest.mark.parametrize("name", ["noise_multiplier", "max_grad_norm"])
def test_the_noise_of_a_private_optimizer_cannot_be_changed_by_hand_since_no_accountant_would_see_it(name):
    """Before: optimizer.noise_multiplier ×0.01 (as Opacus's noise schedulers do) cut the noise 100-fold
    with the reported ε unchanged; max_grad_norm changed the noise and not the clip bounds."""
    engine, model, opt, criterion, loader = _engine(n=4)
    noise_std = opt.noise_std
    with pytest.raises(AttributeError, match=f"optimizer.{name} cannot be set") as error:
        setattr(opt, name, 0.01)
    assert "make_private_with_budgets" in str(error.value)
    assert opt.noise_std == noise_std


def test_zero_grad_after_backward_discards_the_draw_and_closes_the_batch():
    engine, model, opt, criterion, loader = _engine(n=4)
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    opt.zero_grad()
    assert engine.state.phase is Phase.IDLE and not engine.state.pending
    assert all(p.grad is None for p in model.parameters())


class _SequenceFirst(nn.Module):
    batch_first = False

    def forward(self, x):
        return x.transpose(0, 1)


def test_modules_that_are_not_batch_first_are_refused():
    model = pdpfast.nn.convert(nn.Sequential(_SequenceFirst(), nn.Linear(4, 2)))
    with pytest.raises(ValueError, match="batch_first=False"):
        ClippingState(model)


def test_input_that_is_not_batch_first_is_refused():
    model = pdpfast.nn.convert(nn.Sequential(nn.Linear(4, 2)))
    with pytest.raises(ValueError, match="batch-first") as refused:
        clipped_gradients(model, lambda out: out.sum((0, 2)), torch.randn(7, 3, 4), clip_norms=torch.ones(3))
    assert "flattened" not in str(refused.value)


class _TokensFlattened(nn.Module):
    """A block that routes every token of the batch on its own, as a mixture-of-experts block does."""

    def __init__(self):
        super().__init__()
        self.expert = nn.Linear(4, 4)

    def forward(self, x):
        return self.expert(x.reshape(-1, x.shape[-1])).view(x.shape)


def test_a_layer_fed_the_batch_flattened_with_its_positions_is_refused_saying_so():
    model = pdpfast.nn.convert(_TokensFlattened())
    with pytest.raises(ValueError, match=r"expert got an input of shape \(15, 4\) but the batch has 3 samples; .* "
                                         r"15 rows = 3 × 5 is usually the batch flattened with its positions"):
        clipped_gradients(model, lambda out: out.sum((1, 2)), torch.randn(3, 5, 4), clip_norms=torch.ones(3))


class _PositionsOfTheWholeBatch(nn.Module):
    """nanoGPT's learned positions: ``wpe(torch.arange(T))``, broadcast over the batch afterwards."""

    def __init__(self, batched: bool):
        super().__init__()
        self.wte, self.wpe, self.batched = nn.Embedding(11, 4), nn.Embedding(16, 4), batched

    def forward(self, ids):
        positions = torch.arange(ids.shape[1])
        return self.wte(ids) + self.wpe(positions[None] if self.batched else positions)


def test_positions_of_the_whole_batch_given_1d_are_refused_with_the_1_by_t_form_that_is_exact():
    """A 1-D (T,) input with T ≠ B is refused saying what it usually is and how to write it; the
    (1, T) form is broadcast over the batch and each record's gradient is its own (the float64
    per-sample oracle: one record at a time)."""
    ids = torch.randint(0, 11, (3, 5))
    with pytest.raises(ValueError, match=r"wpe got an input of shape \(5,\) but the batch has 3 samples; .*; a 1-D "
                                         r"input of 5 rows is usually positions .*torch.arange\(T\)\[None\]"):
        clipped_gradients(pdpfast.nn.convert(_PositionsOfTheWholeBatch(batched=False)),
                          lambda out: out.sum((1, 2)), ids, clip_norms=torch.ones(3))
    torch.manual_seed(0)
    model = _PositionsOfTheWholeBatch(batched=True).double()
    coef = torch.randn(3, 5, 4, dtype=torch.float64)
    result = clipped_gradients(pdpfast.nn.convert(copy.deepcopy(model)), lambda out: (out * coef).sum((1, 2)), ids,
                               clip_norms=torch.full((3,), 1e30))
    for i in range(3):  # unclipped: each record's norm is its own gradient's
        one = copy.deepcopy(model)
        (one(ids[i:i + 1]) * coef[i:i + 1]).sum().backward()
        expected = torch.sqrt(sum(p.grad.pow(2).sum() for p in one.parameters()))
        torch.testing.assert_close(result.norms[i], expected)


# ------------------------------------------------------------------ low precision


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_clipped_contribution_stays_within_bound(style, dtype):
    """A model in bf16/fp16: each record's rounded contribution is ≤ c_i (bounds keep a rounding
    margin), over many random records."""
    torch.manual_seed(0)
    worst = 0.0
    for _trial in range(20):
        model = pdpfast.nn.convert(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype))
        x = (torch.randn(1, 16) * 10).to(dtype)
        y = torch.randint(0, 4, (1,))
        c = float(torch.rand(()) * 0.5 + 0.01)
        losses = lambda out: nn.functional.cross_entropy(out.float(), y, reduction="none")  # noqa: E731
        result = clipped_gradients(model, losses, x, clip_norms=torch.tensor([c]), **style)
        norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in result.grads.values())))
        worst = max(worst, norm / c)
    assert worst <= 1.0
    assert worst > 0.9  # the margin costs little signal


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_contribution_stays_within_bound_when_positions_cancel(style, dtype):
    """A record whose gradient is a sum over positions that nearly cancel (o = [1, -1 + eps] on equal
    inputs): its clipped contribution Σ_t round(w·o_t)·a_t is rounded term by term, relative to
    |w·o_t| and not to the small sum, so a fixed margin of a few units of roundoff does not cover it
    (it measured up to 1.9x c_i in bf16 and fp16). The rule's rounding bound u·Σ_t ‖o_t‖‖a_t‖ does."""
    eps = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)  # -1 + eps is exact in the dtype
    weights = torch.tensor([1.0, -1.0 + eps], dtype=dtype)
    worst = 0.0
    for c in torch.linspace(0.05 * eps, 0.99 * eps, 40).tolist():  # every record is clipped
        lin = nn.Linear(1, 1, bias=False)
        nn.init.ones_(lin.weight)
        model = pdpfast.nn.convert(lin.to(dtype))
        losses = lambda out: (out[..., 0].float() * weights.float()).sum(1)  # noqa: E731
        result = clipped_gradients(model, losses, torch.ones(1, 2, 1, dtype=dtype), clip_norms=torch.tensor([c]),
                                   **style)
        worst = max(worst, float(torch.sqrt(sum(g.double().pow(2).sum() for g in result.grads.values()))) / c)
    assert worst <= 1.0


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_autocast_bf16_trains_and_stays_within_bound(style):
    engine, model, opt, criterion, loader = _engine(n=4, sample_rates=1.0, **style)
    x, y = next(iter(loader))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    loss = criterion(out.float(), y)
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
    # four records, each within c = 1 after rounding
    assert _grad_norm(model) <= 4.0


@pytest.mark.parametrize("unscale_first", [False, True], ids=["scaler.step", "unscale_-then-step"])
@pytest.mark.parametrize("style", STYLES[:2], ids=STYLE_IDS[:2])  # ghost's criterion returns no tensor to scale
def test_a_grad_scaler_is_refused_before_a_record_could_exceed_its_bound(style, unscale_first):
    """torch.amp.GradScaler scales every per-sample gradient by S before the clipping, and its unscale_
    divides the clipped sum by S before the noise. Before, a record contributed min(‖g_i‖, c_i / S):
    c_i / 65536 at the default S (training stalled, silently), 4·c_i at S = 0.25, beyond what the noise
    covers. scaler.step(optimizer) is refused; nothing is released or charged."""
    engine, model, opt, criterion, loader = _engine(**style)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=0.25)
    x, y = next(iter(loader))
    scaler.scale(criterion(model(x), y)).backward()
    if unscale_first:
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"GradScaler.*torch\.bfloat16"):
        scaler.step(opt)
    assert opt.steps == 0 and engine.accountant.history == []
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.zero_grad()
    x, y = next(iter(loader))  # the same loop without the scaler steps
    criterion(model(x), y).backward()
    opt.step()
    assert opt.steps == 1 and len(engine.accountant.history) == 1


def test_a_grad_scaler_cannot_scale_a_ghost_mode_loss_and_says_why():
    """Ghost mode's criterion returns a DPLoss, not a tensor: an enabled GradScaler's scale(loss) is
    refused there with pdpfast's reason (it was torch's "outputs must be a Tensor"), before any backward;
    a disabled one passes the loss through and the step is taken."""
    ghost = STYLES[STYLE_IDS.index("ghost")]
    engine, model, opt, criterion, loader = _engine(**ghost)
    x, y = next(iter(loader))
    loss = criterion(model(x), y)
    with pytest.raises(TypeError, match=r"GradScaler.*loss scaling is not supported.*torch\.bfloat16"):
        torch.amp.GradScaler("cpu", init_scale=0.25).scale(loss)
    torch.amp.GradScaler("cpu", enabled=False).scale(loss).backward()
    opt.step()
    assert opt.steps == 1 and len(engine.accountant.history) == 1


def test_a_disabled_grad_scaler_gives_the_step_of_a_loop_without_one():
    grads = []
    for scaler in (None, torch.amp.GradScaler("cpu", enabled=False)):
        engine, model, opt, criterion, loader = _engine(n=4)
        x, y = next(iter(loader))
        loss = criterion(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        assert opt.steps == 1
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("change", ["clip_grad_norm_", "scaled in place", "replaced"])
@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_clipped_sums_changed_between_backward_and_step_are_refused(style, change):
    """``.grad`` holds Σ_i w_i g_i, each record within c_i, and the step's noise is calibrated to it.
    Before, ``p.grad.mul_(4)`` released a record at 4× its bound, and ``clip_grad_norm_`` (a no-op in
    Opacus, which overwrites ``.grad`` at the step) shrank the signal against the same noise (digits,
    ``clip_grad_norm_(params, 1.0)`` after each backward: test accuracy 0.93 → 0.67). Dropping the draw
    (zero_grad, then step) still works."""
    engine, model, opt, criterion, loader = _engine(**style)
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    weight = model[0].weight
    if change == "clip_grad_norm_":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    elif change == "scaled in place":
        weight.grad.mul_(4)
    else:
        weight.grad = weight.grad * 4
    with pytest.raises(RuntimeError, match=r"0\.weight was (changed in place|replaced) between the backward and "
                                           r"optimizer\.step\(\)"):
        opt.step()
    assert opt.steps == 0
    opt.zero_grad()
    opt.step()
    assert opt.steps == 1 and engine.state.phase is Phase.IDLE


def test_clipped_sums_changed_between_the_physical_batches_of_a_draw_are_refused():
    engine, model, opt, criterion, loader = _engine(n=6, physical_batch_size=2)
    batches = iter(loader)
    x, y = next(batches)
    criterion(model(x), y).backward()
    opt.step()  # not the draw's last batch: no step yet
    model[2].bias.grad.mul_(3)
    with pytest.raises(RuntimeError, match=r"2\.bias was changed in place"):
        next(batches)


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_tied_weights_under_autocast_stay_within_bound(style):
    """A tied embedding and LM head under bf16 autocast: the head's per-sample gradients come in
    bf16, the embedding's in fp32, and their sum (formed where the dtypes differ, in place where
    they agree) still keeps each record's contribution within c_i."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.emb(ids)))

    torch.manual_seed(0)
    worst = 0.0
    for _trial in range(10):
        model = pdpfast.nn.convert(Tied())
        ids, targets = torch.randint(0, 50, (1, 6)), torch.randint(0, 50, (1, 6))
        c = float(torch.rand(()) * 0.5 + 0.01)
        losses = lambda out: nn.functional.cross_entropy(  # noqa: E731
            out.float().transpose(1, 2), targets, reduction="none").sum(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            result = clipped_gradients(model, losses, ids, clip_norms=torch.tensor([c]), **style)
        norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in result.grads.values())))
        worst = max(worst, norm / c)
    assert worst <= 1.0
    assert worst > 0.9


def test_engine_batches_and_steps_stay_in_step_over_an_epoch():
    """An ordinary loop (zero_grad first, as many scripts write it) runs a whole epoch."""
    engine, model, opt, criterion, loader = _engine(n=20, sample_rates=0.3)
    for x, y in loader:
        opt.zero_grad()
        criterion(model(x), y).backward()
        opt.step()
    assert engine.steps == len(loader)
    assert np.isfinite([p.detach().sum().item() for p in model.parameters()]).all()


# A DP layer call's backward is a pre-hook on the node that computed its output (pdpfast.nn.layers.LayerCall):
# it must keep what save_for_backward gave the Function it replaced, whether pdpfast._C registered it
# (csrc/hooks.cpp) or torch's register_prehook did (without the extension).

@pytest.fixture(params=["C++", "register_prehook"])
def hook_route(request, monkeypatch):
    from pdpfast.nn import layers
    if request.param == "C++":
        if layers._ADD_CALL_HOOK is None:
            pytest.skip("pdpfast._C was not built")
    else:
        monkeypatch.setattr(layers, "_ADD_CALL_HOOK", None)
    return request.param


def _hooked_model_grads(n: int, clipping: str, rate: float = 1.0) -> list[torch.Tensor]:
    """One step's clipped sums of a model whose layers take every kind of backward: the first layer's
    Function (its input needs no gradient), hooks on linear and LayerNorm nodes, a layer called twice,
    and a layer whose output does not reach the loss (its hook never fires)."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(n, 4, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)
    torch.manual_seed(5)
    model = nn.ModuleDict(dict(first=nn.Linear(4, 8), norm=nn.LayerNorm(8), twice=nn.Linear(8, 8),
                               unused=nn.Linear(8, 2), head=nn.Linear(8, 3)))

    def forward(inputs):
        h = torch.tanh(model["norm"](model["first"](inputs)))
        model["unused"](h)  # recorded, never reached by the backward
        return model["head"](model["twice"](torch.tanh(model["twice"](h))))

    engine = pdpfast.PrivacyEngine(seed=0)
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=n), noise_multiplier=0.0, max_grad_norm=0.5,
        sample_rates=rate, clip_norms=torch.linspace(0.2, 1.0, n), loss_reduction="sum", clipping=clipping)
    xb, yb = next(iter(loader))
    assert len(xb) == (0 if rate < 1 else n)
    nn.functional.cross_entropy(forward(xb), yb, reduction="sum").backward()
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_a_layer_calls_hook_registered_from_cpp_or_by_torch_gives_the_same_clipped_sums(clipping, monkeypatch):
    """The two ways of attaching a call's backward run the same ops: the same bits, on a model with
    every kind of call (including one whose output the loss never reaches), and on an empty batch."""
    from pdpfast.nn import layers
    if layers._ADD_CALL_HOOK is None:
        pytest.skip("pdpfast._C was not built")
    assert layers.call_hook_route() == "C++ (pdpfast._C)"  # (what pdpfast info reports)
    for n, rate in ((1, 1.0), (6, 1.0), (6, 1e-9)):  # (an empty Poisson draw at 1e-9)
        cpp = _hooked_model_grads(n, clipping, rate)
        monkeypatch.setattr(layers, "_ADD_CALL_HOOK", None)
        torch_route = _hooked_model_grads(n, clipping, rate)
        monkeypatch.undo()
        assert len(cpp) == len(torch_route) == 10
        for a, b in zip(cpp, torch_route):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b)
        # the unused layer gets no clipped sum from a backward that never reached it; the others do
        assert cpp[6] is None and cpp[7] is None
        assert all(g is not None for i, g in enumerate(cpp) if i not in (6, 7))
        assert any(bool(g.abs().sum() > 0) for g in cpp if g is not None) is (rate == 1.0)


def _linear_layer(kind: str, d: int) -> nn.Module:
    """A layer mapping d → 5 features: nn.Linear (with its bias frozen, its weight frozen, or none) or
    Hugging Face's Conv1D (weight stored (d, 5))."""
    if kind == "Conv1D":
        return pytest.importorskip("transformers.pytorch_utils").Conv1D(5, d)
    layer = nn.Linear(d, 5, bias=kind != "no bias")
    if kind == "frozen bias":
        layer.bias.requires_grad_(False)
    if kind == "frozen weight":
        layer.weight.requires_grad_(False)
    return layer


def _linear_call_step(kind: str, shape: tuple, first: bool, clipping: str, autocast: bool = False):
    """(the layer's output, every parameter's clipped sum) of one step whose layer of ``kind`` takes
    inputs of ``shape`` (B, ..., d), as the model's first layer (its input needs no gradient) or after
    another."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(*shape, generator=g) * 3
    y = torch.randint(0, 3, (shape[0],), generator=g)
    torch.manual_seed(7)
    d = shape[-1]
    model = nn.ModuleDict(dict(pre=nn.Linear(d, d), layer=_linear_layer(kind, d), head=nn.Linear(5, 3)))
    engine = pdpfast.PrivacyEngine(seed=0)
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=shape[0]), noise_multiplier=0.0, max_grad_norm=0.5,
        sample_rates=1.0, clip_norms=torch.linspace(0.2, 1.0, shape[0]), loss_reduction="sum", clipping=clipping)
    xb, yb = next(iter(loader))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model["layer"](xb if first else torch.tanh(model["pre"](xb)))
        logits = model["head"](torch.tanh(out.reshape(shape[0], -1, 5).mean(1)))
    nn.functional.cross_entropy(logits.float(), yb, reduction="sum").backward()
    return out.detach().clone(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _assert_same_bits(a, b) -> None:
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert out_a.shape == out_b.shape and torch.equal(out_a, out_b)
    assert [g is None for g in grads_a] == [g is None for g in grads_b]
    for ga, gb in zip(grads_a, grads_b):
        if ga is not None:
            assert torch.equal(ga, gb)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("kind", ["Linear", "no bias", "frozen bias", "frozen weight", "Conv1D"])
def test_a_linear_layers_call_in_one_cpp_call_gives_the_python_routes_output_and_clipped_sums(kind, clipping,
                                                                                               monkeypatch):
    """``pdpfast._C.linear_call`` (the GEMM on detached parameters, the backward's hook, the view) runs
    the Python route's ops: the same bits for 2-, 3- and 4-D inputs, one record or several, the
    layer first in the model (the Function route) or after another, and under bf16 autocast."""
    from pdpfast.nn import layers
    if layers._LINEAR_CALL is None or layers._ADD_CALL_HOOK is None:
        pytest.skip("pdpfast._C was not built")
    fast, calls = layers._LINEAR_CALL, []

    def counted(*args):
        calls.append(args[0].shape)
        return fast(*args)

    for shape in ((1, 6), (4, 6), (4, 3, 6), (2, 2, 3, 6)):
        for first, autocast in ((False, False), (True, False), (False, True)):
            monkeypatch.setattr(layers, "_LINEAR_CALL", counted)
            before = len(calls)
            cpp = _linear_call_step(kind, shape, first, clipping, autocast)
            # the layer's call, and the pre and head layers' unless the layer is first (pre not called)
            assert len(calls) - before == (2 if first else 3)
            monkeypatch.setattr(layers, "_LINEAR_CALL", None)
            python = _linear_call_step(kind, shape, first, clipping, autocast)
            _assert_same_bits(cpp, python)
            trained = [g for g in cpp[1] if g is not None]
            assert trained and any(bool(g.abs().sum() > 0) for g in trained)


def test_a_linear_layer_under_a_torch_function_mode_takes_the_python_route_the_mode_sees():
    """A ``TorchFunctionMode`` (a FLOP counter, a tracer, ``with torch.device(...)``) sees F.linear
    from the Python route; the C++ call would bypass it, so it is not taken there. Same results."""
    from torch.overrides import TorchFunctionMode

    from pdpfast.nn import layers
    if layers._LINEAR_CALL is None:
        pytest.skip("pdpfast._C was not built")
    seen = []

    class Seen(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    plain = _linear_call_step("Linear", (4, 3, 6), False, "flat")
    with Seen():
        watched = _linear_call_step("Linear", (4, 3, 6), False, "flat")
    assert seen.count("linear") == 3  # pre, layer, head: every DP linear call's GEMM
    _assert_same_bits(plain, watched)


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_layer_input_modified_in_place_after_its_forward_is_refused(style, hook_route):
    """Per-sample gradients from a modified input would be wrong: the backward says which layer."""
    engine, model, opt, criterion, loader = _engine(**style)
    x, y = next(iter(loader))
    h = model[1](model[0](x))   # model[2]'s input, modified after model[2]'s forward
    out = model[2](h)
    h.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified in place after its forward"):
        if style["mode"] == "ghost":
            criterion(out, y).backward()
        else:
            nn.functional.cross_entropy(out, y, reduction="sum").backward()


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_layer_inputs_are_released_by_the_backward_while_the_loss_lives(style, hook_route):
    """A loss kept after backward (to print it, say) keeps its graph; the layers' inputs must not
    stay alive with it, as saved tensors do not."""
    import gc
    import weakref

    engine, model, opt, criterion, loader = _engine(**style)
    x, y = next(iter(loader))
    h = model[1](model[0](x))
    alive = weakref.ref(h)
    loss = criterion(model[2](h), y)
    del h
    loss.backward()
    gc.collect()
    graph = loss.per_sample if style["mode"] == "ghost" else loss  # ghost mode's loss wraps per-sample losses
    assert alive() is None and graph.grad_fn is not None
    opt.step()


def test_backward_through_a_released_graph_after_a_new_batch_is_refused():
    """retain_graph=True keeps autograd's graph, not the layer inputs: a backward of an old batch's
    graph in the next batch is refused, never computed from another batch's state."""
    engine, model, opt, criterion, loader = _engine(**STYLES[0])
    x, y = next(iter(loader))
    loss = criterion(model(x), y)
    loss.backward(retain_graph=True)
    opt.step()
    next(iter(loader))  # the next draw opens its batch
    with pytest.raises(RuntimeError, match="second backward through the same graph"):
        loss.backward()
