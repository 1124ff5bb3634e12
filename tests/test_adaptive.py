"""Adaptive DP-SGD with individual budgets: quantile clipping and noise schedules in the engine."""
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pdpfast
from pdpfast.accounting import compute_rdp, get_privacy_spent
from pdpfast.accounting import schedules as S
from pdpfast.accounting.rdp import DEFAULT_ORDERS
from pdpfast.adaptive import GeometricQuantileTracker, QuantileClipping, pair_noise_multiplier, split_noise

DELTA = 1e-5


@pytest.mark.parametrize("target", [0.3, 0.5, 0.9])
def test_quantile_estimate_converges_to_the_target_quantile(target):
    """A synthetic stream of log-normal norms, batches of 200, noised centered counts: the bound
    ends where a fraction ≈ γ of the norms lies below it."""
    rng = np.random.default_rng(1)
    tracker = GeometricQuantileTracker([0.01], target, 0.2)
    for _ in range(600):
        norms = rng.lognormal(mean=1.0, sigma=0.8, size=200)
        count = np.sum((norms <= tracker.bounds[0]) - 0.5) + rng.normal(scale=2.0)
        tracker.update([count], [200.0])
    late = []
    for _ in range(200):
        norms = rng.lognormal(mean=1.0, sigma=0.8, size=200)
        count = np.sum((norms <= tracker.bounds[0]) - 0.5) + rng.normal(scale=2.0)
        late.append(tracker.update([count], [200.0])[0])
    true_quantile = np.exp(1.0 + 0.8 * __import__("scipy").stats.norm.ppf(target))
    assert abs(np.median(late) / true_quantile - 1) < 0.1


def test_split_noise_pairs_to_the_planned_multiplier():
    z = np.array([0.7, 1.3, 4.0])
    for share, sens in ((0.01, 0.5), (0.3, 0.5 * np.sqrt(3))):
        zg, sc = split_noise(z, share, sens)
        np.testing.assert_allclose(pair_noise_multiplier(zg, sc, sens), z, rtol=1e-12)
    # Andrew et al.'s formula with a sensitivity-1/2 count: (z_grad^-2 + (2σ_b)^-2)^-1/2
    assert pair_noise_multiplier(1.2, 5.0) == pytest.approx((1.2 ** -2 + 10.0 ** -2) ** -0.5)


@pytest.mark.parametrize("kwargs, err, name", [
    (dict(target_quantile=1.0), ValueError, "target_quantile"), (dict(learning_rate=0), ValueError, "learning_rate"),
    (dict(count_share=1.0), ValueError, "count_share"), (dict(count_share="a"), TypeError, "count_share"),
    (dict(per_group=1), TypeError, "per_group")])
def test_bad_quantile_settings_raise_naming_the_argument(kwargs, err, name):
    with pytest.raises(err, match=name):
        QuantileClipping(**kwargs)


# ---------------------------------------------------------------------------------------------- engine
N = 240


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 7, generator=g)
    y = (x[:, 0] + 0.3 * torch.randn(N, generator=g) > 0).long()
    return TensorDataset(x, y)


def _budgets():
    return np.repeat([0.8, 2.0, 4.0], [80, 100, 60])[np.random.default_rng(3).permutation(N)]


def _engine(*, method="scale", clipping="flat", mode="bk", adaptive=None, schedule=None, steps=25, seed=0,
            automatic_gamma=None, budgets=None):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = pdpfast.PrivacyEngine(seed=seed)
    criterion = nn.CrossEntropyLoss(reduction="sum")
    out = engine.make_private_with_budgets(
        module=model, optimizer=opt, data_loader=DataLoader(_data(), batch_size=40),
        budgets=_budgets() if budgets is None else budgets,
        delta=DELTA, steps=steps, method=method, clipping=clipping, mode=mode, loss_reduction="sum",
        criterion=criterion if mode == "ghost" else None, adaptive_clipping=adaptive, noise_schedule=schedule,
        automatic_gamma=automatic_gamma)
    if mode == "ghost":
        model, opt, criterion, loader = out
    else:
        model, opt, loader = out
    return engine, model, opt, loader, criterion


def _train(engine, model, opt, loader, criterion, steps=None):
    steps = engine.plan.steps if steps is None else steps
    while engine.steps < steps:
        for x, y in loader:
            criterion(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if engine.steps >= steps:
                return


def test_ledger_of_a_scheduled_run_equals_an_independent_composition_of_its_steps():
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    schedule = S.ExponentialDecay(0.03)
    engine, *rest = _engine(method="hybrid", schedule=schedule, steps=20)
    _train(engine, *rest, steps=13)
    plan = engine.plan
    sigmas = [engine.adaptive.history[t]["noise_std"] / plan.max_grad_norm for t in range(13)]
    np.testing.assert_allclose(sigmas, plan.noise_multiplier * schedule.factors(13), rtol=1e-12)
    spent = engine.epsilons()
    for g, budget in enumerate(plan.budget_values):
        q, z = plan.group_sample_rates[g], plan.group_noise_multipliers[g]
        # pdpfast's own RDP, one step at a time
        rdp = sum(compute_rdp(q, z * h, 1, DEFAULT_ORDERS) for h in schedule.factors(13))
        mine = get_privacy_spent(DEFAULT_ORDERS, rdp, DELTA)[0]
        # Google's dp_accounting, one event per step
        acc = RdpAccountant(orders=list(DEFAULT_ORDERS))
        for h in schedule.factors(13):
            acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z * h)))
        ledger = spent[plan.budgets == budget]
        np.testing.assert_allclose(ledger, mine, rtol=1e-9)
        # dp_accounting converts RDP to ε its own way: compare the composed RDP itself (its only
        # record of it is the accountant's _rdp), and its ε within its looser conversion
        # (integer orders: both exact; fractional ones: dp_accounting uses an upper bound)
        ours, integer = engine.accountant.rdp()[plan.budgets == budget][0], np.mod(DEFAULT_ORDERS, 1) == 0
        np.testing.assert_allclose(ours[integer], acc._rdp[integer], rtol=1e-6)
        assert np.all(acc._rdp[~integer] >= ours[~integer] * (1 - 1e-6))
        assert acc.get_epsilon(DELTA) >= ledger[0] * (1 - 1e-9)


def test_a_scheduled_runs_ledger_is_charged_as_if_every_records_multiplier_were_set_each_step(monkeypatch):
    """Each step's z_i·h(t) reaches the ledger row by row (O(rows), not a pass over the records), and must
    charge exactly what setting every record's multiplier would: the same ε bit for bit."""
    from pdpfast.accounting import ledger_for_plan

    engine, *rest = _engine(method="sample", schedule=S.ExponentialDecay(0.03), steps=20)
    monkeypatch.setattr(engine.accountant, "set_rates", lambda **kw: pytest.fail("a pass over every record"))
    _train(engine, *rest, steps=12)
    by_record = ledger_for_plan(engine.plan)
    for t in range(12):
        by_record.set_rates(noise_multipliers=engine.plan.noise_multipliers * engine.adaptive._factor(t))
        by_record.step()
    by_record.set_rates(noise_multipliers=engine.plan.noise_multipliers * engine.adaptive._factor(12))
    assert engine.accountant.group_rates.shape[0] == by_record.group_rates.shape[0] == 3
    np.testing.assert_array_equal(engine.accountant.noise_multipliers, by_record.noise_multipliers)
    np.testing.assert_array_equal(engine.epsilons(), by_record.epsilons(engine.delta))
    np.testing.assert_array_equal(engine.accountant.exceeding(engine.delta, 8), by_record.exceeding(engine.delta, 8))


def test_scheduled_run_spends_its_budgets_and_refuses_the_step_after():
    engine, *rest = _engine(method="sample", schedule="step:0.6,8", steps=20)
    _train(engine, *rest)
    spent = engine.epsilons()
    assert np.all(spent <= engine.budgets)
    assert np.all(spent >= engine.budgets * (1 - 1e-3))
    model, opt, loader, criterion = rest
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    with pytest.raises(pdpfast.engine.PrivacyBudgetExceeded):
        opt.step()


def _pair_epsilons(engine):
    """ε of every group recomputed from what the run actually did: per step the gradient
    multiplier noise_std / c_g(t) and the count noise, paired (Andrew et al. Thm. 1) and composed."""
    ad, plan = engine.adaptive, engine.plan
    sens = ad.count_sensitivity
    out = []
    for g in range(plan.budget_values.shape[0]):
        # the grid and the group's own order, at which the plan certified it
        orders = list(DEFAULT_ORDERS) + ([] if plan.group_orders is None else [float(plan.group_orders[g])])
        rdp = 0.0
        for rec in ad.history:
            z_grad = rec["noise_std"] / rec["clip_norms"][g]
            count_std = rec["count_std"][g] if ad.clipping.per_group else rec["count_std"][0]
            z = pair_noise_multiplier(z_grad, count_std, sens)
            rdp = rdp + compute_rdp(plan.group_sample_rates[g], z, 1, orders)
        out.append(get_privacy_spent(orders, rdp, DELTA)[0])
    return np.array(out)


@pytest.mark.parametrize("per_group", [False, True])
@pytest.mark.parametrize("clipping, mode, method, gamma", [
    ("flat", "bk", "scale", None), ("per_layer", "bk", "hybrid", None), ("flat", "ghost", "sample", None),
    ("flat", "bk", "scale", 0.01)])
def test_every_group_epsilon_within_budget_including_the_adaptive_counts(per_group, clipping, mode, method, gamma):
    adaptive = QuantileClipping(target_quantile=0.6, learning_rate=0.5, count_share=0.05, per_group=per_group)
    engine, *rest = _engine(method=method, clipping=clipping, mode=mode, adaptive=adaptive,
                            schedule="exponential:0.02" if per_group else None, automatic_gamma=gamma)
    _train(engine, *rest)
    bounds = np.array([rec["clip_norms"] for rec in engine.adaptive.history])
    assert not np.allclose(bounds[-1], bounds[0])            # the bounds did move
    eps = _pair_epsilons(engine)
    assert np.all(eps <= engine.plan.budget_values * (1 + 1e-9))
    ledger = engine.epsilons()
    for g, b in enumerate(engine.plan.budget_values):
        assert np.all(ledger[engine.plan.budgets == b] <= b)
        assert eps[g] <= ledger[engine.plan.budgets == b].max() * (1 + 1e-9)   # the ledger never under-charges
    if not per_group:   # bounds move together: Scale's ratios kept; the shared count is noised for the
        # group with the largest multiplier, which pays exactly its plan (the others a little less)
        np.testing.assert_allclose(bounds[-1] / bounds[0], bounds[-1, 0] / bounds[0, 0], rtol=1e-9)
        top = np.argmax(engine.plan.group_noise_multipliers)
        np.testing.assert_allclose(eps[top], engine.plan.group_epsilons[top], rtol=1e-6)


def test_counts_are_the_unclipped_members_of_each_group():
    """After one backward the counts are Σ(1[‖g_i‖ ≤ c_i] − ½) per group and layer, against the
    per-sample gradients of a micro-batched oracle."""
    adaptive = QuantileClipping(per_group=True)
    engine, model, opt, loader, criterion = _engine(clipping="per_layer", adaptive=adaptive)
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    counts = engine.adaptive._counts.copy()
    rows = engine.adaptive._rows.numpy()
    state = engine.state
    # oracle: per-sample gradients of each layer
    ref = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 2))
    ref.load_state_dict({k: v for k, v in model.state_dict().items()})
    norms = np.zeros((2, x.shape[0]))
    for i in range(x.shape[0]):
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        norms[0, i] = torch.cat([ref[0].weight.grad.flatten(), ref[0].bias.grad]).norm().item()
        norms[1, i] = torch.cat([ref[2].weight.grad.flatten(), ref[2].bias.grad]).norm().item()
    np.testing.assert_allclose(state.last_group_norms.numpy(), norms, rtol=1e-5)
    bits = (norms <= state.clip_norms.numpy()) - 0.5
    want = np.zeros_like(counts)
    np.add.at(want, rows, bits.T)
    np.testing.assert_allclose(counts, want)


@pytest.mark.parametrize("automatic_gamma", [None, 0.05])
def test_per_layer_bounds_per_group_clip_each_layer_to_its_own_bound(automatic_gamma, oracle):
    """(K, B) bounds in begin_batch: group k's clipped sum is Σ_i w_{k,i} g_{k,i}, its weights from row
    k, for every parameter of every group (against the float64 oracle's per-sample gradients)."""
    import copy

    from pdpfast.clipping import ClippingState

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    state = ClippingState(model, clipping="per_layer", automatic_gamma=automatic_gamma)
    state.keep_group_norms = True
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    bounds = torch.tensor([[0.05, 1e3, 0.2, 0.01], [1e3, 0.03, 0.1, 0.02]], dtype=torch.float64)
    with state.attached():
        state.begin_batch(bounds)
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        group_norms = state.last_group_norms
    loss = lambda out, t: nn.functional.cross_entropy(out, t, reduction="none")  # noqa: E731
    per_sample = oracle.per_sample_grads(reference, loss, (x,), (y,))
    groups = oracle.groups(reference)
    assert group_norms.shape == (len(groups), 4)
    for k, group in enumerate(groups):
        norms = torch.sqrt(sum(per_sample[n].flatten(1).pow(2).sum(1) for n in group.param_names))
        oracle.assert_close(group_norms[k], norms, f"norms of group {group.name}")
        w = oracle._weights(norms, bounds[k], None, automatic_gamma)
        for name in group.param_names:
            oracle.assert_close(model.get_parameter(name).grad, torch.tensordot(w, per_sample[name], dims=1), name)


def test_bad_engine_inputs_raise_naming_the_argument():
    with pytest.raises(TypeError, match="adaptive_clipping"):
        _engine(adaptive="quantile")
    with pytest.raises(ValueError, match="noise_schedule"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 2))
        pdpfast.PrivacyEngine().make_private_with_budgets(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=40), budgets=_budgets(), delta=DELTA, steps=10,
            accountant="pld", noise_schedule="exponential:0.01")


def _whole_and_resumed(tmp_path, adaptive, schedule, steps):
    """(engine, model) of an uninterrupted run of ``steps``, then of one checkpointed halfway and resumed
    in a fresh engine."""
    def run(stop_at=None, resume=None):
        engine, model, opt, loader, criterion = _engine(adaptive=adaptive, schedule=schedule, steps=steps)
        if resume is not None:
            engine.load_checkpoint(resume, model)
        _train(engine, model, opt, loader, criterion, steps=stop_at)
        return engine, model

    whole, whole_model = run()
    half, half_model = run(stop_at=steps // 2)
    half.save_checkpoint(tmp_path / "half.pt", half_model)
    return (whole, whole_model, *run(resume=tmp_path / "half.pt"))


@pytest.mark.parametrize("schedule", [None, "exponential:0.02"])
def test_a_resumed_adaptive_run_continues_exactly(tmp_path, schedule):
    """Checkpoint after 6 of 12 steps, resume in a fresh engine: the clip bounds, the noise, the
    ledger and the weights end exactly where the uninterrupted run ends."""
    from pdpfast.adaptive import QuantileClipping

    whole, whole_model, resumed, resumed_model = _whole_and_resumed(tmp_path, QuantileClipping(0.5), schedule, 12)
    assert resumed.steps == whole.steps == 12
    np.testing.assert_array_equal(resumed.epsilons(), whole.epsilons())
    for (name, a), (_, b) in zip(whole_model.named_parameters(), resumed_model.named_parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("bad", [np.nan, 0.0, "short"], ids=["NaN bound", "zero bound", "wrong shape"])
def test_a_checkpoint_with_damaged_adaptive_bounds_is_refused_before_the_engine_changes(tmp_path, bad):
    from pdpfast.adaptive import QuantileClipping

    engine, model, opt, loader, criterion = _engine(adaptive=QuantileClipping(0.5), steps=12)
    _train(engine, model, opt, loader, criterion, steps=3)
    engine.save_checkpoint(tmp_path / "c.pt", model)
    checkpoint = torch.load(tmp_path / "c.pt", weights_only=False)
    bounds = checkpoint["engine"]["adaptive"]["bounds"]
    checkpoint["engine"]["adaptive"]["bounds"] = bounds[:-1] if bad == "short" else np.full_like(bounds, bad)
    torch.save(checkpoint, tmp_path / "damaged.pt")
    fresh, model2, *_ = _engine(adaptive=QuantileClipping(0.5), steps=12)
    with pytest.raises(ValueError, match="adaptive clipping state: bounds"):
        fresh.load_checkpoint(tmp_path / "damaged.pt", model2)
    assert fresh.steps == 0 and not fresh.epsilons().any()          # nothing restored, not even the ledger
    fresh.load_checkpoint(tmp_path / "c.pt", model2)
    np.testing.assert_array_equal(fresh.adaptive.bounds, engine.adaptive.bounds)


def test_demo_adaptive_command_writes_its_results(tmp_path):
    import json

    from pdpfast.cli import main

    out = tmp_path / "adaptive"
    assert main(["demo", "--adaptive", "--epochs", "1", "--seeds", "1", "--methods", "scale", "--quiet",
                 "--out", str(out)]) == 0
    assert (out / "adaptive.png").stat().st_size > 0 and json.loads((out / "adaptive.json").read_text())


@pytest.mark.parametrize("call,name", [
    (lambda: split_noise(1.0, 0.01, count_sensitivity=0), "count_sensitivity"),      # the count unnoised
    (lambda: split_noise(-1.0, 0.1), "noise_multiplier"),
    (lambda: split_noise([1.0, np.nan], 0.1), "noise_multiplier"),
    (lambda: pair_noise_multiplier(-2.0, 1.0), "grad_noise_multiplier"),
    (lambda: pair_noise_multiplier(1.0, -1.0), "count_std"),
    (lambda: pair_noise_multiplier(1.0, 1.0, count_sensitivity=-0.5), "count_sensitivity"),
    (lambda: GeometricQuantileTracker(np.ones(2), 0.5, 0.2).update(np.zeros(2), 0.0), "expected_count"),
    (lambda: GeometricQuantileTracker(np.ones(2), 0.5, 0.2).update(np.zeros(2), np.inf), "expected_count"),
    (lambda: GeometricQuantileTracker(np.ones(2), 0.5, 0.2).update([np.nan, 0.0], 10.0), "noisy_centered_count"),
    (lambda: GeometricQuantileTracker(np.ones(2), 0.5, 0.2).update([np.inf, 0.0], 10.0), "noisy_centered_count"),
    (lambda: GeometricQuantileTracker([], 0.5, 0.2), "bounds is empty")])
def test_noise_splits_and_bound_updates_refuse_what_would_release_a_count_unnoised_or_nan_bounds(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("count", [np.zeros(3), np.zeros((2, 2))], ids=["too long", "would grow the bounds"])
def test_bound_updates_refuse_counts_that_do_not_fit_the_bounds_and_keep_them(count):
    """Before: (2, 2) counts silently turned the (2,) bounds into (2, 2); (3,) a numpy broadcast error."""
    tracker = GeometricQuantileTracker(np.ones(2), 0.5, 0.2)
    with pytest.raises(ValueError, match=r"noisy_centered_count must have the bounds' shape \(2,\)"):
        tracker.update(count, 10.0)
    np.testing.assert_array_equal(tracker.bounds, np.ones(2))
    assert tracker.update(0.0, 10.0).shape == (2,)  # one count for every bound still broadcasts


@pytest.mark.parametrize("rate,count", [(1e3, 0.0), (50.0, -40.0)], ids=["overflow", "underflow"])
def test_a_bound_update_that_would_leave_the_float32_range_is_refused_and_the_bounds_kept(rate, count):
    """Before: lr 1e3 took a bound to 9e72 and then 0 (an opaque error from the clipping kernels), lr 50 to
    1e-150 (no error, training stalled)."""
    tracker = GeometricQuantileTracker(np.ones(2), 0.999 if count == 0.0 else 0.5, rate)
    for _ in range(6):
        try:
            tracker.update(count, 10.0)
        except ValueError as error:
            assert "use a smaller learning_rate" in str(error)
            assert ((tracker.bounds >= 1e-30) & (tracker.bounds <= 1e30)).all()
            return
    pytest.fail(f"bounds reached {tracker.bounds} without an error")


def test_a_named_batch_is_clipped_to_the_adaptive_bounds_the_noise_follows():
    """records() opened its batch at the plan's first bounds while the noise followed the adaptive ones:
    with the bounds shrunk 10⁴-fold, a named record's noise multiplier fell 10⁴-fold below its plan's."""
    engine, model, opt, loader, criterion = _engine(adaptive=QuantileClipping(0.5, learning_rate=1.0), steps=12)
    _train(engine, model, opt, loader, criterion, steps=6)          # the bounds move
    data = _data()
    idx = torch.arange(0, N, 7)
    with pytest.warns(UserWarning, match="did not draw"), engine.records(idx):
        criterion(model(data.tensors[0][idx]), data.tensors[1][idx]).backward()
    np.testing.assert_allclose(engine.state.clip_norms.numpy(), engine.adaptive.batch_clip_norms(idx).numpy())
    assert not np.allclose(engine.state.clip_norms.numpy(), engine.clip_norms[idx.numpy()])
    rows = engine.adaptive._rows.numpy()
    np.testing.assert_array_equal(rows, engine.adaptive.group_of[idx.numpy()])   # counted in the records' groups
    assert engine.adaptive._counts.sum() != 0.0
    used = engine.state.clip_norms.numpy().copy()
    opt.step()
    effective = opt.noise_std / used          # the step's noise std over each row's bound
    assert np.all(effective >= engine.plan.noise_multipliers[idx.numpy()] * (1 - 1e-9))


def test_a_refused_step_drops_its_draws_counts_so_no_release_holds_two_draws():
    """A step a pre-step hook refuses closes its draw unreleased; its unclipped-record counts used to
    stay and be released with the next draw's (a record in both counted twice)."""
    engine, model, opt, loader, criterion = _engine(adaptive=QuantileClipping(0.5), steps=4)
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    assert np.abs(engine.adaptive._counts).sum() > 0
    opt.pre_step_hooks.insert(0, lambda optimizer: (_ for _ in ()).throw(RuntimeError("refused")))
    with pytest.raises(RuntimeError, match="refused"):
        opt.step()
    np.testing.assert_array_equal(engine.adaptive._counts, 0.0)
    assert engine.steps == 0


def test_a_batch_discarded_by_zero_grad_drops_its_counts_so_no_release_holds_a_record_twice():
    """records() → backward → zero_grad() → records() → backward → step(): the discarded batch's
    counts stayed and were released with the next one's (each record of both counted twice, a
    sensitivity of 1 where the count's noise was sized for ½)."""
    engine, model, opt, loader, criterion = _engine(adaptive=QuantileClipping(0.5, per_group=False), steps=4)
    x, y = loader.dataset.tensors if hasattr(loader, "dataset") else _data().tensors
    idx = torch.arange(20)
    with engine.records(idx):
        criterion(model(x[idx]), y[idx]).backward()
    one_batch = engine.adaptive._counts.copy()
    assert np.abs(one_batch).sum() > 0
    opt.zero_grad()
    np.testing.assert_array_equal(engine.adaptive._counts, 0.0)
    with engine.records(idx):
        criterion(model(x[idx]), y[idx]).backward()
    np.testing.assert_array_equal(engine.adaptive._counts, one_batch)    # this batch's, once
    opt.step()
    assert engine.steps == 1 and len(engine.adaptive.history) == 1


def test_a_bound_update_refused_after_its_step_leaves_the_run_consistent():
    """The tracker refuses bounds outside [1e-30, 1e30] after the step was released and charged: its
    counts used to stay (released again with the next draw's), the history to miss the step and the
    ledger to charge the next step at this one's multiplier under a schedule."""
    engine, model, opt, loader, criterion = _engine(
        adaptive=QuantileClipping(0.5, learning_rate=1000.0, count_share=0.5), schedule="step:0.5,1", steps=4,
        method="sample")
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    with pytest.raises(ValueError, match="clip bounds would leave"):
        opt.step()
    assert engine.steps == 1
    np.testing.assert_array_equal(engine.adaptive._counts, 0.0)
    np.testing.assert_array_equal(engine.adaptive.bounds, engine.adaptive.initial_bounds)   # kept
    assert [h["step"] for h in engine.adaptive.history] == [0]
    # the next step is charged at its own multipliers z_i·h(1), not this one's z_i·h(0) = 2 z_i·h(1)
    np.testing.assert_allclose(engine.accountant.noise_multipliers,
                               engine.plan.noise_multipliers * engine.adaptive._factor(1), rtol=1e-12)


@pytest.mark.parametrize("per_group", [False, True])
def test_a_resumed_runs_history_still_holds_every_step_from_the_first(tmp_path, per_group):
    """The checkpoint kept the bounds and the seed, not the history: a resumed run's history[0] was the
    resumed step's."""
    whole, _, resumed, _ = _whole_and_resumed(tmp_path, QuantileClipping(0.5, per_group=per_group),
                                              "exponential:0.02", 8)
    assert len(resumed.adaptive.history) == len(whole.adaptive.history) == 8
    for a, b in zip(whole.adaptive.history, resumed.adaptive.history):
        assert a.keys() == b.keys() and a["step"] == b["step"] and a["noise_std"] == b["noise_std"]
        np.testing.assert_array_equal(a["clip_norms"], b["clip_norms"])
        np.testing.assert_array_equal(a["count_std"], b["count_std"])


def test_a_checkpoint_with_a_damaged_adaptive_history_is_refused_before_the_engine_changes(tmp_path):
    engine, model, opt, loader, criterion = _engine(adaptive=QuantileClipping(0.5), steps=12)
    _train(engine, model, opt, loader, criterion, steps=3)
    engine.save_checkpoint(tmp_path / "c.pt", model)
    checkpoint = torch.load(tmp_path / "c.pt", weights_only=False)
    checkpoint["engine"]["adaptive"]["history"]["bounds"].pop()
    torch.save(checkpoint, tmp_path / "damaged.pt")
    fresh, model2, *_ = _engine(adaptive=QuantileClipping(0.5), steps=12)
    with pytest.raises(ValueError, match="adaptive history: .* one entry per step"):
        fresh.load_checkpoint(tmp_path / "damaged.pt", model2)
    assert fresh.steps == 0 and len(fresh.adaptive.history) == 0


@pytest.mark.parametrize("value", [np.ones(2), None, "1"], ids=["array", "None", "string"])
def test_a_schedule_function_returning_no_number_is_refused_naming_the_schedule_and_step(value):
    """Before: an array or None gave float()'s bare TypeError, and the string "1" was taken."""
    with pytest.raises(TypeError, match=r"noise_schedule\(0\) must be a number"):
        S.as_schedule(lambda t: value).factors(5)


@pytest.mark.parametrize("name, value", [("adaptive_clipping", QuantileClipping(0.5)),
                                         ("noise_schedule", "exponential:0.01")])
def test_make_private_given_an_argument_of_the_budgets_entry_point_says_where_it_belongs(name, value):
    model = nn.Linear(7, 2)
    with pytest.raises(TypeError, match=f"unexpected keyword argument.*'{name}'.*make_private_with_budgets"):
        pdpfast.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=40), noise_multiplier=1.0, max_grad_norm=1.0, **{name: value})


def test_bounds_given_as_strings_are_refused_by_name():
    with pytest.raises(TypeError, match="bounds must be numbers"):
        GeometricQuantileTracker(["1", "2"], 0.5, 0.2)


@pytest.mark.parametrize("kwargs,name", [(dict(factors=[1.0, -1.0]), "factors"), (dict(factors=[]), "factors"),
                                         (dict(factors=[1.0, np.nan]), "factors"), (dict(seed=-1), "seed"),
                                         (dict(seed=1.5), "seed")])
def test_adaptive_training_refuses_bad_factors_and_seeds_at_once_not_at_a_later_step(kwargs, name):
    from pdpfast.adaptive import AdaptiveTraining

    engine = _engine(adaptive=QuantileClipping())[0]
    with pytest.raises(ValueError, match=name):
        AdaptiveTraining(engine, engine.plan, clipping=QuantileClipping(), **kwargs)
    with pytest.raises(ValueError, match="seed"):
        engine.adaptive.load_state_dict(engine.adaptive.state_dict() | {"seed": -5})


def test_the_adaptive_plot_of_no_runs_is_refused_naming_runs(tmp_path):
    """It used to fail with a ZeroDivisionError."""
    from pdpfast.demo_adaptive import save_adaptive_plot

    with pytest.raises(ValueError, match="runs is empty"):
        save_adaptive_plot([], tmp_path / "a.png")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("kwargs,name", [(dict(methods=("pdp",)), "methods: unknown pdp"),
                                         (dict(methods=()), "methods must not be empty"),
                                         (dict(variants=()), "variants must not be empty"),
                                         (dict(variants=("fixed", "fixed")), "variants must name each once"),
                                         (dict(variants="fixed"), "variants must be a sequence"),
                                         (dict(seeds=(1.5,)), r"seeds\[0\] must be an int")])
def test_the_adaptive_demo_refuses_bad_choices_before_the_first_run(kwargs, name, monkeypatch):
    import pdpfast.demo_adaptive as demo_adaptive

    def trains(*args, **kw):
        raise AssertionError("a training run started")

    monkeypatch.setattr(demo_adaptive, "train_variant", trains)
    with pytest.raises((TypeError, ValueError), match=name):
        demo_adaptive.run_adaptive_demo(**(dict(epochs=1, seeds=(0,), progress=False) | kwargs))


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("per_group", [None, False, True])   # None: a noise schedule and fixed bounds
def test_adaptive_history_gives_every_steps_bounds_and_keeps_only_what_sets_them(per_group, clipping):
    """``history[t]`` holds the bounds and noise step t used (read here at each step, before the bounds'
    update), while the history keeps per step only what sets the bounds: nothing for fixed bounds and
    K factors for bounds that move together, not G numbers, with G here one privacy group per record
    (per-group bounds are G numbers a step by nature; their groups here are three, as a group of one
    record's noised count would throw its bound out of range)."""
    adaptive = None if per_group is None else QuantileClipping(target_quantile=0.6, learning_rate=0.5,
                                                               count_share=0.05, per_group=per_group)
    # every budget distinct, G = N groups; three groups for per-group bounds
    budgets = _budgets() if per_group else np.random.default_rng(5).uniform(1.0, 4.0, N)
    engine, *rest = _engine(method="scale", clipping=clipping, adaptive=adaptive, schedule="exponential:0.02",
                            steps=12, budgets=budgets)
    ad = engine.adaptive
    seen = []
    engine.optimizer.post_step_hooks.insert(0, lambda opt: seen.append((ad.group_clip_norms, opt.noise_std)))
    _train(engine, *rest)
    history = ad.history
    assert len(history) == len(seen) == 12 and ad.num_groups == (3 if per_group else N)
    for t, (record, (norms, noise_std)) in enumerate(zip(history, seen)):
        assert record["step"] == t and record["noise_std"] == noise_std
        np.testing.assert_array_equal(record["clip_norms"], norms)
        assert ("count_std" in record) == (adaptive is not None)
    if adaptive is not None:
        assert not np.array_equal(history[0]["clip_norms"], history[-1]["clip_norms"])   # the bounds moved
        assert history[-1]["count_std"].shape == ((3,) if per_group else (1,))
    K = ad.num_layers
    kept = [b for b in history._bounds if b is not None]
    if per_group is None:
        assert kept == []
    elif not per_group:
        assert all(b.shape == (K,) for b in kept) and len(kept) == 12
    assert [r["step"] for r in history[-3:]] == [9, 10, 11] and history[-1]["step"] == 11
    with pytest.raises(IndexError):
        history[12]
