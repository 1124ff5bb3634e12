"""PrivacyEngine, DPDataLoader and DPOptimizer: the DP-SGD step of DESIGN.md §1."""
import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pdpfast
from pdpfast.data import DPDataLoader
from pdpfast.functional import clipped_gradients
from pdpfast.optimizer import DPOptimizer


def _data(n=60, d=5, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g))


def _mlp(d=5, classes=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 8), nn.ReLU(inplace=True), nn.Linear(8, classes))


def _private(n=60, sample_rates=0.2, clip_norms=None, noise=0.0, **kw):
    ds = _data(n)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = pdpfast.PrivacyEngine(seed=3)
    out = engine.make_private(module=model, optimizer=opt, data_loader=DataLoader(ds, batch_size=8),
                              noise_multiplier=noise, max_grad_norm=1.0, sample_rates=sample_rates,
                              clip_norms=clip_norms, **kw)
    return (engine, ds, *out)


def test_per_record_sampling_frequencies_match_sample_rates():
    n, steps = 40, 3000
    q = np.linspace(0.0, 1.0, n)
    loader = DPDataLoader(_data(n), q, steps_per_epoch=steps, seed=7)
    counts = np.zeros(n)
    for _ in loader:
        counts[loader.current.indices.numpy()] += 1
    sd = np.sqrt(steps * q * (1 - q))
    assert np.all(np.abs(counts - steps * q) <= 5 * sd + 1e-9)
    assert counts[0] == 0 and counts[-1] == steps


def test_poisson_sampling_gives_random_batch_sizes_never_fixed():
    loader = DPDataLoader(_data(200), 0.1, steps_per_epoch=200, seed=1)
    sizes = [len(batch[0]) for batch in loader]
    assert len(set(sizes)) > 5
    assert abs(np.mean(sizes) - 20) < 3 * np.sqrt(200 * 0.1 * 0.9 / 200) + 1.0


def test_poisson_draw_is_never_truncated_by_physical_batch_capacity():
    q = np.full(50, 0.5)
    whole = DPDataLoader(_data(50), q, steps_per_epoch=20, seed=5)
    split = DPDataLoader(_data(50), q, steps_per_epoch=20, seed=5, physical_batch_size=4)
    drawn = {}
    for _ in whole:
        drawn[whole.current.step] = whole.current.indices.tolist()
    seen: dict[int, list] = {}
    for xb, _ in split:
        b = split.current
        assert len(xb) == 4 and b.mask is not None and b.mask.shape == (4,)
        seen.setdefault(b.step, []).extend(b.indices[b.mask.bool()].tolist())
    assert seen == drawn


def test_empty_draw_yields_empty_batch_and_still_steps_with_noise():
    engine, ds, model, opt, loader = _private(sample_rates=1e-9, noise=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    for xb, yb in loader:
        assert xb.shape == (0, 5)
        nn.functional.cross_entropy(model(xb), yb, reduction="sum").backward()
        opt.step()
        opt.zero_grad()
        break
    assert engine.steps == 1
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(5, 6, num_layers=2, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):  # x (B, 4, 5)
        return self.head(self.gru(x)[0][:, -1])


def _instance_norm_cnn():
    return nn.Sequential(nn.Conv1d(4, 4, 3), nn.InstanceNorm1d(4, affine=True), nn.Flatten(), nn.Linear(12, 3))


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("build", [_Recurrent, _instance_norm_cnn], ids=["gru", "instance-norm"])
def test_empty_draw_through_recurrent_and_instance_norm_layers_still_steps_with_noise(build, clipping):
    """Layers whose torch forward rejects (InstanceNorm) or whose private forward once mis-shaped
    (the recurrent layers' input projection) an empty batch: an empty draw still takes its step."""
    torch.manual_seed(0)
    model = build()
    ds = TensorDataset(torch.randn(30, 4, 5), torch.randint(0, 3, (30,)))
    engine = pdpfast.PrivacyEngine(seed=3)
    model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                             data_loader=DataLoader(ds, batch_size=8), noise_multiplier=1.0,
                                             max_grad_norm=1.0, sample_rates=1e-9, clipping=clipping)
    before = [p.detach().clone() for p in model.parameters()]
    xb, yb = next(iter(loader))
    assert xb.shape == (0, 4, 5)
    nn.functional.cross_entropy(model(xb), yb, reduction="sum").backward()
    opt.step()
    assert engine.steps == 1
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_normalization_uses_expected_batch_size_not_realized():
    n = 60
    q = np.where(np.arange(n) % 2 == 0, 0.3, 0.1)
    c = np.where(np.arange(n) % 3 == 0, 0.05, 0.2)
    engine, ds, model, opt, loader = _private(n, sample_rates=q, clip_norms=c, loss_reduction="sum")
    for p in model.parameters():
        p.requires_grad_(True)
    for xb, yb in loader:
        idx = loader.current.indices
        if len(idx) < 2:
            continue
        # expected: the clipped sum of exactly these records, divided by Σ q_i
        reference = _mlp()
        reference.load_state_dict(model.state_dict())
        pdpfast.nn.convert(reference)
        expected = clipped_gradients(reference, lambda out: nn.functional.cross_entropy(out, yb, reduction="none"),
                                     xb, clip_norms=torch.from_numpy(c)[idx])
        nn.functional.cross_entropy(model(xb), yb, reduction="sum").backward()
        opt.original_optimizer.param_groups[0]["lr"] = 0.0
        opt.step()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, expected.grads[name] / q.sum(), rtol=1e-5, atol=1e-7)
        break
    assert engine.expected_batch_size == pytest.approx(q.sum())


def test_mean_loss_reduction_gives_the_same_step_as_sum():
    grads = {}
    for reduction in ("mean", "sum"):
        engine, ds, model, opt, loader = _private(loss_reduction=reduction, clip_norms=0.3)
        for xb, yb in loader:
            nn.functional.cross_entropy(model(xb), yb, reduction=reduction).backward()
            grads[reduction] = [p.grad.clone() for p in model.parameters()]
            break
    for a, b in zip(grads["mean"], grads["sum"]):
        torch.testing.assert_close(a, b)


def test_noise_std_equals_sigma_C_over_expected_batch_size():
    p = nn.Parameter(torch.zeros(200_000))
    opt = DPOptimizer(torch.optim.SGD([p], lr=0.0), noise_multiplier=1.7, max_grad_norm=0.6,
                      expected_batch_size=12.5, seed=0)
    opt.step()      # no gradient: noise alone (a gradient no clipping state wrote would be refused)
    assert p.grad.std().item() == pytest.approx(1.7 * 0.6 / 12.5, rel=0.01)
    assert abs(p.grad.mean().item()) < 5 * 1.7 * 0.6 / 12.5 / np.sqrt(p.numel())


def test_a_gradient_from_a_non_private_backward_before_make_private_is_discarded_not_released():
    # a warm-up loop that zeroes at the top of each iteration leaves its last gradient in .grad; the
    # clipping state adds into .grad, so the first private step released it unclipped (5086 ≫ C)
    def released(warm_up: bool):
        model, ds = _mlp(), _data(60)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        if warm_up:
            x, y = ds.tensors
            nn.functional.cross_entropy(model(x * 100), y, reduction="sum").backward()
        before = [p.detach().clone() for p in model.parameters()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, opt, loader = pdpfast.PrivacyEngine(seed=3).make_private(
                module=model, optimizer=opt, data_loader=DataLoader(ds, batch_size=8), noise_multiplier=0.0,
                max_grad_norm=1.0)
        x, y = next(iter(loader))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        messages = [str(w.message) for w in caught if "made private" in str(w.message)]
        return [b - p.detach() for p, b in zip(model.parameters(), before)], messages

    clean, quiet = released(False)
    stale, told = released(True)
    for a, b in zip(clean, stale):
        torch.testing.assert_close(a, b)         # the same update: the warm-up gradient is not in it
    assert not quiet and len(told) == 1 and re.search(r"4 trainable parameter\(s\) \(e\.g\. '0\.weight'\) held a "
                                                      r"nonzero gradient .*discarded", told[0])


def test_a_dp_optimizer_on_its_own_refuses_gradients_no_clipping_state_wrote():
    # Opacus's low-level API wraps an optimizer in DPOptimizer directly; here nothing would have clipped
    # the gradient, so noising it would release an unclipped update (norm ~100 against a bound of 1)
    model = nn.Linear(6, 3)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=1.0,
                      expected_batch_size=8.0, seed=0)
    before = model.weight.detach().clone()
    nn.functional.cross_entropy(model(torch.randn(8, 6) * 100), torch.randint(0, 3, (8,)), reduction="sum").backward()
    with pytest.raises(RuntimeError, match=r"gradient of a parameter of shape \(3, 6\) was not written by a pdpfast "
                                           r"clipping state .*released unclipped.*make_private"):
        opt.step()
    assert torch.equal(model.weight, before) and opt.steps == 0
    state = pdpfast.clipping.ClippingState(pdpfast.nn.convert(model))       # the same optimizer, clipped: it steps
    with pytest.warns(UserWarning, match="held a nonzero gradient from before"):
        state.attach()      # the refused gradient is still in .grad: attaching discards it, so it is never released
    try:
        state.begin_batch(torch.ones(8, dtype=torch.float64))
        loss = nn.functional.cross_entropy(model(torch.randn(8, 6) * 100), torch.randint(0, 3, (8,)), reduction="sum")
        loss.backward()
        opt.step()
        assert opt.steps == 1 and (model.weight - before).norm() <= 1.0 + 1e-6      # Σ of 8 clipped / 8
    finally:
        state.detach()
    with pytest.raises(RuntimeError, match="released unclipped"):       # detached: refused again
        opt.zero_grad()
        model.weight.grad = torch.ones_like(model.weight)
        opt.step()


def test_noise_is_reproducible_from_seed_and_step():
    def draw(seed, steps):
        p = nn.Parameter(torch.zeros(100))
        opt = DPOptimizer(torch.optim.SGD([p], lr=1.0), noise_multiplier=1.0, max_grad_norm=1.0,
                          expected_batch_size=1.0, seed=seed)
        for _ in range(steps):
            opt.zero_grad()
            opt.step()
        return p.detach().clone()

    torch.testing.assert_close(draw(4, 3), draw(4, 3))
    assert not torch.equal(draw(4, 3), draw(5, 3))


def test_an_optimizer_state_with_negative_steps_is_refused_and_the_optimizer_unchanged():
    p = nn.Parameter(torch.zeros(4))
    opt = DPOptimizer(torch.optim.SGD([p], lr=1.0, momentum=0.9), noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=1.0, seed=3)
    opt.zero_grad()
    opt.step()
    state = opt.state_dict()
    with pytest.raises(ValueError, match="steps must be >= 0, got -1"):
        opt.load_state_dict(state | {"steps": -1, "seed": 9})
    assert opt.steps == 1 and opt.seed == 3
    opt.load_state_dict(state)
    assert opt.steps == 1


@pytest.mark.parametrize("mode,clipping", [("bk", "flat"), ("ghost", "flat"), ("bk", "per_layer")])
def test_physical_batches_with_masks_give_the_same_step_as_one_batch(mode, clipping):
    grads = {}
    for capacity in (None, 3):
        kw = dict(mode=mode, clipping=clipping, physical_batch_size=capacity, clip_norms=0.2)
        if mode == "ghost":
            kw["criterion"] = nn.CrossEntropyLoss(reduction="sum")
        engine, ds, model, opt, *rest = _private(loss_reduction="sum", **kw)
        crit, loader = (rest if mode == "ghost" else (None, rest[0]))
        opt.original_optimizer.param_groups[0]["lr"] = 0.0
        for xb, yb in loader:
            out = model(xb)
            loss = crit(out, yb) if crit else nn.functional.cross_entropy(out, yb, reduction="sum")
            loss.backward()
            opt.step()
            if loader.current.is_last:
                grads[capacity] = [p.grad.clone() for p in model.parameters()]
                break
            opt.zero_grad()
    for a, b in zip(grads[None], grads[3]):
        torch.testing.assert_close(a, b)


def test_ghost_mode_refuses_a_plain_backward():
    engine, ds, model, opt, crit, loader = _private(mode="ghost", criterion=nn.CrossEntropyLoss())
    xb, yb = next(iter(loader))
    with pytest.raises(RuntimeError, match="criterion"):
        nn.functional.cross_entropy(model(xb), yb).backward()


def test_ghost_mode_refuses_token_losses_flattened_over_the_batch_saying_how_to_pass_them():
    """logits.view(-1, V) gives B·T losses in an order the criterion cannot check (a (T, B) flattening
    would mix records), so they are refused, not reshaped; (B, V, T) logits give (B, T) losses."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 11))
    ids = torch.randint(0, 11, (40, 5))
    engine = pdpfast.PrivacyEngine(seed=3)
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(ids), batch_size=8), noise_multiplier=0.0, max_grad_norm=1.0,
        sample_rates=0.5, mode="ghost", criterion=nn.CrossEntropyLoss())
    (xb,) = next(batch for batch in loader if len(batch[0]) >= 2)
    logits = model(xb)
    with pytest.raises(ValueError, match=rf"returned {5 * len(xb)} losses for a batch of {len(xb)} records: .*"
                                         r"criterion\(logits.transpose\(1, 2\), labels\)"):
        crit(logits.reshape(-1, 11), xb.reshape(-1))
    crit(logits.transpose(1, 2), xb).backward()  # (B, T) losses, one mean per record
    opt.step()
    assert engine.steps == 1


def test_training_loop_learns_digits():
    from pdpfast.demo import load_digits_split

    x_tr, y_tr, x_te, y_te = load_digits_split()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    n = len(x_tr)
    q = np.where(np.arange(n) % 3 == 0, 0.02, 0.06)
    c = np.where(np.arange(n) % 2 == 0, 0.5, 1.0)
    engine = pdpfast.PrivacyEngine(seed=0)
    model, opt, loader = engine.make_private(module=model, optimizer=opt,
                                             data_loader=DataLoader(TensorDataset(x_tr, y_tr), batch_size=64),
                                             noise_multiplier=0.5, max_grad_norm=1.0, sample_rates=q, clip_norms=c)
    for _ in range(6):
        for xb, yb in loader:
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
    model.eval()
    acc = (model(x_te).argmax(1) == y_te).float().mean().item()
    assert acc > 0.8


def test_lr_scheduler_and_optimizer_built_before_make_private_work():
    engine, ds, model, opt, loader = _private(noise=0.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for xb, yb in loader:
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        break
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert isinstance(opt, torch.optim.Optimizer)


@pytest.mark.parametrize("kwargs,match", [
    (dict(sample_rates=1.5), "sample_rates"),
    (dict(sample_rates=np.full(59, 0.1)), "sample_rates"),
    (dict(sample_rates=np.full(60, np.nan)), "sample_rates"),
    (dict(clip_norms=np.zeros(60)), "clip_norms"),
    (dict(clip_norms=np.full(60, np.nan)), "clip_norms"),
    (dict(clip_norms=np.ones(61)), "clip_norms"),
    (dict(noise=-1.0), "noise_multiplier"),
    (dict(mode="ghost"), "criterion"),
    (dict(mode="fast"), "mode"),
    (dict(clipping="global"), "clipping"),
    (dict(loss_reduction="avg"), "loss_reduction"),
    (dict(physical_batch_size=0), "physical_batch_size"),
])
def test_bad_arguments_are_refused_with_a_clear_error(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _private(**kwargs)


def test_batchnorm_model_is_refused_with_groupnorm_advice():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"1 \(BatchNorm2d\).*GroupNorm|GroupNorm.*1 \(BatchNorm2d\)"):
        pdpfast.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1),
            data_loader=DataLoader(_data(), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0)


def test_iterating_the_private_loader_leaves_torch_global_rng_alone():
    loader = DPDataLoader(_data(30), 0.3, steps_per_epoch=3, seed=2)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    for _ in loader:
        pass
    torch.testing.assert_close(torch.rand(3), expected)


def test_arguments_refused_late_used_to_leave_the_model_converted():
    """A refusal leaves the model and the engine as they were, so the user can fix the call and retry."""
    from torch import nn as tnn

    import pdpfast

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3, 4)), batch_size=4)
    seq_first = tnn.Sequential(tnn.LSTM(4, 5))
    engine = pdpfast.PrivacyEngine()
    with pytest.raises(ValueError, match=r"batch_first=False: 0 \(LSTM\)"):
        engine.make_private(module=seq_first, optimizer=torch.optim.SGD(seq_first.parameters(), lr=0.1),
                            data_loader=data, noise_multiplier=1.0, max_grad_norm=1.0)
    assert type(seq_first[0]) is tnn.LSTM and engine.state is None
    model = tnn.Sequential(tnn.Flatten(), tnn.Linear(12, 2))
    with pytest.raises(TypeError, match="adaptive_clipping must be a QuantileClipping"):
        engine.make_private_with_budgets(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         data_loader=data, budgets=np.full(8, 2.0), delta=1e-5, epochs=1,
                                         adaptive_clipping="quantile")
    assert type(model[1]) is tnn.Linear and engine.state is None


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_of_per_record_rates_is_the_worst_records_and_the_ledger_is_kept_between_calls(accountant):
    """get_epsilon with per-record rates and bounds steps one kept ledger on from call to call (its
    one-step RDP per distinct pair is the cost); the ε must be that of a fresh ledger at every call."""
    from pdpfast.accounting.ledger import IndividualAccountant, PLDIndividualAccountant

    rates, bounds = np.repeat([0.05, 0.1, 0.3], 20), np.tile([0.5, 1.5], 30)   # 6 distinct (q, z)
    model, ds = _mlp(), _data(60)
    engine = pdpfast.PrivacyEngine(accountant=accountant, seed=3)
    model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                             data_loader=DataLoader(ds, batch_size=8), noise_multiplier=1.0,
                                             max_grad_norm=1.0, sample_rates=rates, clip_norms=bounds)
    ledger_type = {"rdp": IndividualAccountant, "pld": PLDIndividualAccountant}[accountant]
    kept = None
    for step, (x, y) in enumerate(loader):
        if step == 3:
            break
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        fresh = ledger_type(rates, 1.0 / bounds).step(engine.steps).epsilons(1e-5).max()
        assert engine.get_epsilon(1e-5) == pytest.approx(fresh, rel=1e-12)
        assert kept is None or engine._epsilon_ledger[3] is kept
        kept = engine._epsilon_ledger[3]
    engine.sample_rates = rates / 2                         # other rates: a new ledger, their ε
    assert engine.get_epsilon(1e-5) < fresh and engine._epsilon_ledger[3] is not kept


def _fresh(n=60):
    model = _mlp()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_data(n), batch_size=8)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(mode="foo"), ValueError, "mode"),
    (dict(clipping="foo"), ValueError, "clipping"),
    (dict(clipping="per_layer", mode="ghost", criterion=nn.CrossEntropyLoss()), ValueError, "per_layer"),
    (dict(layer_shares=[0.6, 0.8]), ValueError, "layer_shares"),                   # without per_layer
    (dict(clipping="per_layer", layer_shares=[5.0]), ValueError, "layer_shares"),  # needs the converted groups
    (dict(clipping="per_layer", layer_shares={"9": 1.0}), ValueError, "layer_shares"),
    (dict(clipping="per_layer", layer_shares=[0.6, 0.6]), ValueError, "layer_shares"),
    (dict(automatic_gamma=-1.0), ValueError, "automatic_gamma"),
    (dict(automatic_gamma="1"), TypeError, "automatic_gamma"),
    (dict(steps_per_epoch=0), ValueError, "steps_per_epoch"),
])
def test_make_private_refuses_clipping_settings_before_converting_the_model(kwargs, error, match):
    """Before: ClippingState refused these after convert() had swapped the layers in place."""
    model, optimizer, loader = _fresh()
    engine = pdpfast.PrivacyEngine(seed=0)
    with pytest.raises(error, match=match):
        engine.make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                            max_grad_norm=1.0, **kwargs)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]             # still torch's own classes
    assert engine.state is None and engine.optimizer is None and not model._forward_pre_hooks
    engine.make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                        max_grad_norm=1.0)                                          # the fixed call works


def test_make_private_with_budgets_refused_by_make_private_leaves_no_plan_behind():
    model, optimizer, loader = _fresh()
    engine = pdpfast.PrivacyEngine(seed=0)
    with pytest.raises(ValueError, match="mode"):
        engine.make_private_with_budgets(module=model, optimizer=optimizer, data_loader=loader,
                                         budgets=np.full(60, 2.0), delta=1e-5, epochs=1, mode="foo")
    assert engine.plan is None and engine.state is None and type(model[0]) is nn.Linear


def test_make_private_refuses_a_loader_over_an_empty_dataset_by_name():
    model, optimizer, _ = _fresh()
    empty = DataLoader(TensorDataset(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long)), batch_size=8)
    for make in ("make_private", "make_private_with_budgets"):
        engine = pdpfast.PrivacyEngine(seed=0)
        extra = dict(noise_multiplier=1.0, max_grad_norm=1.0) if make == "make_private" else dict(
            budgets=np.ones(0), delta=1e-5, epochs=1)
        with pytest.raises(ValueError, match="dataset is empty"):
            getattr(engine, make)(module=model, optimizer=optimizer, data_loader=empty, **extra)
    assert type(model[0]) is nn.Linear


def test_make_private_refuses_per_record_bounds_without_poisson_sampling():
    """Before: accepted, then the first forward failed with a message about the loader make_private returned."""
    model, optimizer, loader = _fresh()
    engine = pdpfast.PrivacyEngine(seed=0)
    with pytest.raises(ValueError, match="clip_norms .*poisson_sampling=False"):
        engine.make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                            max_grad_norm=1.0, poisson_sampling=False, clip_norms=np.linspace(0.1, 1.0, 60))
    assert type(model[0]) is nn.Linear and engine.state is None


def test_make_private_warns_that_a_criterion_is_not_read_in_bk_mode_and_accepts_it_as_opacus_does():
    model, optimizer, loader = _fresh()
    with pytest.warns(UserWarning, match="criterion is used in mode='ghost' only.*not read"):
        out = pdpfast.PrivacyEngine(seed=0).make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                         noise_multiplier=1.0, max_grad_norm=1.0,
                                                         criterion=nn.CrossEntropyLoss())
    assert len(out) == 3


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(mode="ghost", criterion=nn.CrossEntropyLoss(reduction="sum")), ValueError,
     "reduction='sum' and loss_reduction='mean'"),
    (dict(mode="ghost", criterion=nn.CrossEntropyLoss(), loss_reduction="sum"), ValueError,
     "reduction='mean' and loss_reduction='sum'"),
    (dict(mode="ghost", criterion=lambda out, y: out.sum()), TypeError, "criterion"),
])
def test_make_private_refuses_a_ghost_criterion_whose_reduction_it_would_override(kwargs, error, match):
    model, optimizer, loader = _fresh()
    with pytest.raises(error, match=match):
        pdpfast.PrivacyEngine(seed=0).make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0, **kwargs)
    assert type(model[0]) is nn.Linear


def test_make_private_ghost_mode_accepts_a_criterion_whose_reduction_matches():
    model, optimizer, loader = _fresh()
    out = pdpfast.PrivacyEngine(seed=0).make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        mode="ghost", criterion=nn.CrossEntropyLoss(reduction="sum"), loss_reduction="sum")
    assert len(out) == 4


@pytest.mark.parametrize("seed", [2 ** 63, 2 ** 70])
def test_seeds_too_large_for_torch_are_refused_by_name(seed):
    """Before: torch's "Overflow when unpacking long long" at make_private or at the first draw."""
    with pytest.raises(ValueError, match="seed must be an int in"):
        pdpfast.PrivacyEngine(seed=seed)
    with pytest.raises(ValueError, match="seed must be an int in"):
        DPDataLoader(_data(10), 0.5, seed=seed)
    with pytest.raises(ValueError, match="start_step must be an int in"):
        DPDataLoader(_data(10), 0.5, seed=1, start_step=seed)
    assert DPDataLoader(_data(10), 0.5, seed=2 ** 63 - 1).seed == 2 ** 63 - 1


@pytest.mark.parametrize("seed", ["123", 1.7, True, -1, 2 ** 63])
def test_dp_optimizer_refuses_the_seeds_dp_data_loader_refuses(seed):
    """Before: int(seed), so 1.7 ran as 1 and -1 as a negative seed."""
    sgd = torch.optim.SGD(_mlp().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="seed must be an int"):
        DPOptimizer(sgd, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4.0, seed=seed)
    assert DPOptimizer(sgd, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4.0,
                       seed=np.int64(5)).seed == 5


def test_dp_optimizer_takes_the_opacus_arguments_it_honors_with_their_meaning():
    """Opacus's DPOptimizer(loss_reduction="mean", generator=, secure_mode=False) run here (before: Python's
    "unexpected keyword argument"); a generator seeds the noise as make_private's noise_generator does."""
    def optimizer(**kwargs):
        return DPOptimizer(torch.optim.SGD(_mlp().parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                           expected_batch_size=8, **kwargs)

    assert optimizer(loss_reduction="mean", secure_mode=False).expected_batch_size == 8
    seeded = optimizer(generator=torch.Generator().manual_seed(5)).seed
    assert seeded == optimizer(generator=torch.Generator().manual_seed(5)).seed
    assert seeded == pdpfast.optimizer.noise_seed_from(torch.Generator().manual_seed(5))
    assert seeded != optimizer(generator=torch.Generator().manual_seed(6)).seed


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(loss_reduction="sum"), ValueError, r"loss_reduction='sum' is not offered .*multiply the learning rate"),
    (dict(loss_reduction="avg"), ValueError, "loss_reduction must be one of 'mean', got 'avg'"),
    (dict(secure_mode=True), ValueError, "secure_mode=True is not supported"),
    (dict(generator=3), TypeError, "generator must be a torch.Generator, got int"),
    (dict(generator=torch.Generator(), seed=1), ValueError, "give seed or generator, not both"),
])
def test_dp_optimizer_refuses_the_opacus_arguments_it_cannot_honor_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        DPOptimizer(torch.optim.SGD(_mlp().parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                    expected_batch_size=8, **kwargs)


def test_data_parallel_over_several_devices_is_refused_since_its_copies_of_a_dp_layer_hold_no_parameters():
    """nn.DataParallel over several devices copies the model at every forward; a copy's layers keep their
    parameters outside ``_parameters``, so a DP layer there could not clip them per sample. make_private
    refuses the wrapper, and a DP layer run inside such a copy (a model wrapped after make_private) raises
    rather than computing without its parameters. Over one device (or none) DataParallel calls the model
    itself, which trains as usual."""
    model = nn.DataParallel(_mlp())
    model.device_ids = [0, 1]   # what DataParallel keeps on a machine with two GPUs
    with pytest.raises(ValueError, match="DataParallel over several devices is not supported.*DistributedDataParallel"):
        pdpfast.PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                             data_loader=DataLoader(_data(), batch_size=8), noise_multiplier=1.0,
                                             max_grad_norm=1.0)

    engine, ds, model, opt, loader = _private()
    first = model[0]
    copy = first._replicate_for_data_parallel()  # as torch.nn.parallel.replicate makes it, before it sets
    copy.weight, copy.bias = first.weight * 1.0, first.bias * 1.0   # the broadcast parameters as attributes
    x, y = next(iter(loader))
    with pytest.raises(RuntimeError, match="DataParallel over several devices is not supported"):
        copy(x)

    engine, ds, model, opt, loader = _private()
    wrapped = nn.DataParallel(model)  # no GPU here: no device, no copies
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in loader:
        nn.functional.cross_entropy(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


class _Token(nn.Module):
    """A learned token put before every sequence: a batch-broadcast parameter (registered below)."""

    def __init__(self):
        super().__init__()
        self.token = nn.Parameter(torch.zeros(1, 1, 4))

    def forward(self, x):
        return torch.cat([self.token.expand(x.shape[0], -1, -1), x], 1)


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.token, self.rnn, self.head = _Token(), nn.LSTM(4, 3, batch_first=True), nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.rnn(self.token(x))[0][:, -1])


def test_a_data_parallel_copy_of_a_recurrent_layer_or_a_broadcast_host_is_refused_by_name():
    """The layers that run their parameters through private forwards of their own (a recurrent layer's
    gate projections, a host's batch-broadcast parameters) refuse nn.DataParallel's copy as the others
    do, not with torch's error or a KeyError."""
    pdpfast.nn.register_broadcast_host(_Token, "token")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 5, 4, generator=g), torch.randint(0, 2, (40,), generator=g))
    torch.manual_seed(0)
    engine = pdpfast.PrivacyEngine(seed=3)
    model = _Recurrent()
    model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                             data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0,
                                             max_grad_norm=1.0)
    x, _ = next(iter(loader))
    for layer in (model.rnn, model.token):
        copy = layer._replicate_for_data_parallel()
        for name, p in layer._parameters.items():   # the broadcast parameters, as replicate sets them
            setattr(copy, name, p * 1.0)
        with pytest.raises(RuntimeError, match="DataParallel over several devices is not supported"):
            copy(x)
