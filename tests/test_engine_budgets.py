"""make_private_with_budgets: calibration, the per-record ledger, refusal, checkpoint and resume."""
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pdpfast
from pdpfast.engine import PrivacyBudgetExceeded


def _setup(budgets, seed=0, delta=1e-5, **kwargs):
    g = torch.Generator().manual_seed(1)
    n = len(budgets)
    ds = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    engine = pdpfast.PrivacyEngine(seed=seed)
    if "steps" not in kwargs:
        kwargs.setdefault("epochs", 2)
    model, opt, loader = engine.make_private_with_budgets(
        module=model, optimizer=opt, data_loader=DataLoader(ds, batch_size=10), budgets=budgets, delta=delta, **kwargs)
    return engine, model, opt, loader


def _train(model, opt, loader, steps):
    done = 0
    while done < steps:
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            done += 1
            if done == steps:
                return


@pytest.mark.parametrize("method", ["sample", "scale", "hybrid"])
def test_every_record_accounted_epsilon_stays_within_its_budget(method):
    budgets = np.repeat([0.5, 1.0, 4.0], [30, 40, 30])
    engine, model, opt, loader = _setup(budgets, method=method)
    _train(model, opt, loader, engine.plan.steps)
    eps = engine.epsilons()
    assert eps.shape == budgets.shape
    assert np.all(eps <= budgets)
    assert np.all(eps >= 0.9 * budgets)  # the plan spends the budgets, it does not waste them


def test_a_step_past_the_budget_is_refused():
    budgets = np.full(50, 1.0)
    engine, model, opt, loader = _setup(budgets, steps=7)
    _train(model, opt, loader, 7)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivacyBudgetExceeded):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert np.all(engine.epsilons() <= budgets)


def test_checkpoint_then_resume_continues_the_ledger_and_training_exactly(tmp_path):
    budgets = np.repeat([1.0, 3.0], 40)
    engine, model, opt, loader = _setup(budgets, steps=12)
    _train(model, opt, loader, 12)
    expected_eps, expected_weights = engine.epsilons(), [p.detach().clone() for p in model.parameters()]

    engine, model, opt, loader = _setup(budgets, steps=12)
    _train(model, opt, loader, 5)
    engine.save_checkpoint(tmp_path / "ckpt.pt", model)
    resumed, model2, opt2, loader2 = _setup(budgets, steps=12, seed=0)
    resumed.load_checkpoint(tmp_path / "ckpt.pt", model2)
    assert resumed.steps == 5 and np.array_equal(resumed.epsilons(), engine.epsilons())
    _train(model2, opt2, loader2, 7)
    np.testing.assert_allclose(resumed.epsilons(), expected_eps, rtol=1e-12)
    for a, b in zip(expected_weights, model2.parameters()):
        torch.testing.assert_close(a, b.detach())
    assert not list(tmp_path.glob("*.tmp"))


def test_a_checkpoint_saved_inside_a_draw_is_refused_so_no_resumed_run_skips_it(tmp_path):
    """Before: saved after backward and before step(), it held the optimizer's steps and the loader past
    the draw: a run resumed from it skipped the draw and paired every later draw with the step before's noise."""
    budgets = np.repeat([1.0, 3.0], 40)
    engine, model, opt, loader = _setup(budgets, steps=12)
    _train(model, opt, loader, 3)
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="cannot be saved inside a draw"):
        engine.save_checkpoint(tmp_path / "mid.pt", model)
    assert not (tmp_path / "mid.pt").exists()
    opt.step()
    engine.save_checkpoint(tmp_path / "after.pt", model)
    assert torch.load(tmp_path / "after.pt", weights_only=False)["engine"]["optimizer"]["steps"] == 4


def test_a_resume_bit_identical_for_a_model_with_dropout(tmp_path):
    """Before: the checkpoint kept no random state of torch's, and a model with dropout resumed in
    another process drew other masks (the weights differed by 0.03)."""
    budgets = np.repeat([1.0, 3.0], 40)

    def setup():
        engine, model, opt, loader = _setup(budgets, steps=8)
        model.insert(1, nn.Dropout(0.5))               # (no parameters: added to the private model as is)
        return engine, model, opt, loader

    engine, model, opt, loader = setup()
    _train(model, opt, loader, 8)
    expected = [p.detach().clone() for p in model.parameters()]
    engine, model, opt, loader = setup()
    _train(model, opt, loader, 4)
    engine.save_checkpoint(tmp_path / "c.pt", model)
    torch.manual_seed(1234)                             # as a new process's state would differ
    resumed, model2, opt2, loader2 = setup()
    resumed.load_checkpoint(tmp_path / "c.pt", model2)
    _train(model2, opt2, loader2, 4)
    for a, b in zip(expected, model2.parameters()):
        torch.testing.assert_close(b.detach(), a, rtol=0, atol=0)


@pytest.mark.parametrize("damage, message", [
    ("truncate", "cannot be read \\(truncated, or not a file save_checkpoint wrote\\)"),
    ("no extra", "is not a file save_checkpoint wrote \\(it lacks extra\\)"),
    ("engine not a dict", "is not a file save_checkpoint wrote \\(engine not a dict\\)"),
    ("a list", "holds a list, not a dict"),
    ("rng", "its random states \\(rng\\) are damaged"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file_before_anything_changes(tmp_path, damage, message):
    """Before: a file without "extra" raised KeyError after the weights and the engine were replaced,
    a truncated one a bare OSError."""
    budgets = np.repeat([1.0, 3.0], 40)
    engine, model, opt, loader = _setup(budgets, steps=12)
    _train(model, opt, loader, 2)
    engine.save_checkpoint(tmp_path / "c.pt", model)
    path = tmp_path / "damaged.pt"
    if damage == "truncate":
        path.write_bytes((tmp_path / "c.pt").read_bytes()[:300])
    else:
        checkpoint = torch.load(tmp_path / "c.pt", weights_only=False)
        if damage == "no extra":
            del checkpoint["extra"]
        elif damage == "engine not a dict":
            checkpoint["engine"] = [checkpoint["engine"]]
        elif damage == "a list":
            checkpoint = [checkpoint]
        else:
            checkpoint["rng"] = {"cpu": torch.zeros(3)}
        torch.save(checkpoint, path)
    fresh, model2, *_ = _setup(budgets, steps=12)
    before = [p.detach().clone() for p in model2.parameters()]
    with pytest.raises(ValueError, match=message) as refused:
        fresh.load_checkpoint(path, model2)
    assert "damaged.pt" in str(refused.value)
    assert fresh.steps == 0 and all(torch.equal(a, p) for a, p in zip(before, model2.parameters()))


def test_two_continuations_reseeded_with_their_own_labels_share_no_noise_or_draws(tmp_path):
    """reseed(label) after load_checkpoint: each continuation of one checkpoint draws its own records
    and noise (the same seed and step would add the same noise to both); the same label, the same seeds."""
    budgets = np.repeat([1.0, 3.0], 40)
    engine, model, opt, loader = _setup(budgets, steps=12)
    _train(model, opt, loader, 3)
    engine.save_checkpoint(tmp_path / "c.pt", model)
    seeds = {}
    for label in ("lr=0.1", "lr=0.01", "lr=0.1"):
        fork, model2, opt2, loader2 = _setup(budgets, steps=12)
        fork.load_checkpoint(tmp_path / "c.pt", model2)
        fork.reseed(label)
        pair = (fork.optimizer.seed, fork.data_loader.seed)
        assert pair != (engine.optimizer.seed, engine.data_loader.seed) and all(0 <= s < 2 ** 63 for s in pair)
        assert seeds.setdefault(label, pair) == pair
    assert seeds["lr=0.1"] != seeds["lr=0.01"]
    _train(model, opt, loader, 2)                      # the same label at another step: other seeds
    engine.save_checkpoint(tmp_path / "later.pt", model)
    fork, model2, *_ = _setup(budgets, steps=12)
    fork.load_checkpoint(tmp_path / "later.pt", model2)
    fork.reseed("lr=0.1")
    assert (fork.optimizer.seed, fork.data_loader.seed) != seeds["lr=0.1"]
    for bad, error in (("", ValueError), (3, TypeError)):
        with pytest.raises(error, match="label must be"):
            engine.reseed(bad)
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="reseed\\(\\) inside a draw"):
        engine.reseed("late")


def test_an_older_checkpoint_loaded_into_the_engine_that_went_past_it_is_refused_not_rolled_back(tmp_path):
    """Before: the ledger fell back to the checkpoint's steps (ε 3.6 → 2.6 in the probe) and the steps
    taken again drew the same noise as the released ones, which cancels it between the two."""
    budgets = np.repeat([1.0, 3.0], 40)
    engine, model, opt, loader = _setup(budgets, steps=12)
    _train(model, opt, loader, 4)
    engine.save_checkpoint(tmp_path / "at4.pt", model)
    _train(model, opt, loader, 4)
    spent, weights = engine.epsilons(), [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="written after 4 steps, but this engine has taken 8: loading it would roll "
                                         "the privacy ledger back"):
        engine.load_checkpoint(tmp_path / "at4.pt", model)
    assert engine.steps == 8 and np.array_equal(engine.epsilons(), spent)
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))


def test_a_checkpoint_loaded_inside_a_draw_is_refused_so_no_step_joins_two_draws(tmp_path):
    """Before: with one physical batch of a draw pending, a checkpoint of another seed was accepted and the
    step joined this draw's first row to the rest of the checkpoint's draw (a record clipped twice)."""
    budgets = np.repeat([1.0, 3.0], 20)
    other, model, *_ = _setup(budgets, steps=6, seed=1, physical_batch_size=1)
    other.save_checkpoint(tmp_path / "other.pt", model)
    engine, model, opt, loader = _setup(budgets, steps=6, seed=0, physical_batch_size=1)
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()                                          # the draw has more batches: no step yet
        if engine.steps == 0 and not engine.data_loader.current.is_last:
            break
    with pytest.raises(RuntimeError, match="cannot be loaded inside a draw"):
        engine.load_checkpoint(tmp_path / "other.pt", model)


def test_an_engine_that_took_steps_refuses_another_runs_checkpoint_that_would_drop_them(tmp_path):
    budgets = np.repeat([1.0, 3.0], 20)
    other, model, opt, loader = _setup(budgets, steps=6, seed=1)
    _train(model, opt, loader, 3)
    other.save_checkpoint(tmp_path / "other.pt", model)
    engine, model, opt, loader = _setup(budgets, steps=6, seed=0)
    _train(model, opt, loader, 1)
    with pytest.raises(ValueError, match="taken 1 steps of its own run, and the checkpoint is another run's"):
        engine.load_checkpoint(tmp_path / "other.pt", model)
    assert engine.steps == 1


@pytest.mark.parametrize("change,match", [
    (dict(clipping="per_layer"), "clipping 'flat' \\(checkpoint\\) vs 'per_layer'"),
    (dict(automatic_gamma=0.01), "automatic_gamma None \\(checkpoint\\) vs 0.01"),
    (dict(adaptive_clipping="quantile"), "adaptive_clipping"),
    (dict(noise_schedule="exponential:0.01"), "without a noise schedule, this engine with a noise schedule"),
], ids=["clipping", "automatic", "adaptive", "schedule"])
def test_a_checkpoint_of_other_clipping_settings_is_refused_by_name(tmp_path, change, match):
    """Before: a flat checkpoint loaded into per-layer, automatic or adaptive engines without a word (an
    adaptive one started again from its first bounds); a schedule mismatch named an internal dict."""
    from pdpfast.adaptive import QuantileClipping

    if change.get("adaptive_clipping") == "quantile":
        change = dict(adaptive_clipping=QuantileClipping())
    budgets = np.repeat([1.0, 3.0], 20)
    engine, model, *_ = _setup(budgets, steps=6)
    engine.save_checkpoint(tmp_path / "c.pt", model)
    other, model2, *_ = _setup(budgets, steps=6, **change)
    with pytest.raises(ValueError, match=match):
        other.load_checkpoint(tmp_path / "c.pt", model2)


def test_a_checkpoint_of_another_optimizer_kind_is_refused_by_name(tmp_path):
    """Before: an SGD checkpoint loaded into an Adam run, whose next step failed with KeyError 'betas'."""
    budgets = np.repeat([1.0, 3.0], 20)
    engine, model, *_ = _setup(budgets, steps=6)
    engine.save_checkpoint(tmp_path / "c.pt", model)
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))
    model2 = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    other = pdpfast.PrivacyEngine(seed=0)
    model2, *_ = other.make_private_with_budgets(
        module=model2, optimizer=torch.optim.Adam(model2.parameters()), data_loader=DataLoader(ds, batch_size=10),
        budgets=budgets, delta=1e-5, steps=6)
    with pytest.raises(ValueError, match="another kind than Adam"):
        other.load_checkpoint(tmp_path / "c.pt", model2)


def test_a_per_record_checkpoint_is_refused_by_an_engine_of_other_rates_bounds_or_noise(tmp_path):
    """Without a plan the ε of per-record runs is recomputed from the engine's (q_i, c_i, σ): a σ = 0.5
    checkpoint loaded into a σ = 3 engine reported ε 3.1 for 48.5 spent."""
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(20, 6, generator=g), torch.randint(0, 3, (20,), generator=g))

    def engine_with(sigma):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 3))
        engine = pdpfast.PrivacyEngine(seed=0)
        model, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(ds),
            noise_multiplier=sigma, max_grad_norm=1.0, sample_rates=np.linspace(0.1, 0.5, 20))
        return engine, model, opt, loader

    engine, model, opt, loader = engine_with(0.5)
    _train(model, opt, loader, 3)
    engine.save_checkpoint(tmp_path / "c.pt", model)
    other, model2, *_ = engine_with(3.0)
    with pytest.raises(ValueError, match="other per-record sample rates, clip bounds or noise"):
        other.load_checkpoint(tmp_path / "c.pt", model2)


def test_resume_with_a_different_plan_is_refused(tmp_path):
    engine, model, opt, loader = _setup(np.full(30, 1.0), steps=4)
    engine.save_checkpoint(tmp_path / "c.pt", model)
    other, model2, *_ = _setup(np.full(30, 2.0), steps=4)
    with pytest.raises(ValueError, match="plan"):
        other.load_checkpoint(tmp_path / "c.pt", model2)


@pytest.mark.parametrize("damage", [
    lambda ledger: ledger.update(budgets=ledger["budgets"] * 100),                                    # looser budgets
    lambda ledger: ledger.update(group_of=ledger["group_of"][:20], budgets=ledger["budgets"][:20]),  # fewer records
    lambda ledger: ledger.update(group_rates=ledger["group_rates"] / 2),                             # slower spending
], ids=["other budgets", "fewer records", "lower rates"])
def test_a_checkpoint_whose_ledger_is_not_its_plans_is_refused_and_the_engine_unchanged(tmp_path, damage):
    budgets = np.full(30, 1.0)
    engine, model, opt, loader = _setup(budgets, steps=4)
    _train(model, opt, loader, 2)
    engine.save_checkpoint(tmp_path / "c.pt", model)
    checkpoint = torch.load(tmp_path / "c.pt", weights_only=False)
    damage(checkpoint["engine"]["ledger"])
    torch.save(checkpoint, tmp_path / "damaged.pt")
    resumed, model2, *_ = _setup(budgets, steps=4)
    ledger = resumed.accountant
    with pytest.raises(ValueError, match="ledger does not belong to its plan"):
        resumed.load_checkpoint(tmp_path / "damaged.pt", model2)
    assert resumed.accountant is ledger and ledger.steps_taken == 0 and not resumed.epsilons().any()
    resumed.load_checkpoint(tmp_path / "c.pt", model2)         # the undamaged one resumes
    np.testing.assert_array_equal(resumed.epsilons(), engine.epsilons())


@pytest.mark.parametrize("shift", [-1, 1], ids=["steps behind the ledger", "steps ahead of the ledger"])
def test_a_checkpoint_whose_optimizer_count_is_not_its_ledgers_is_refused(tmp_path, shift):
    """The noise of step t is drawn from (seed, t): an optimizer count behind the ledger would add a
    step's noise twice; one ahead would leave steps unaccounted."""
    budgets = np.full(30, 1.0)
    engine, model, opt, loader = _setup(budgets, steps=6)
    _train(model, opt, loader, 3)
    engine.save_checkpoint(tmp_path / "c.pt", model)
    checkpoint = torch.load(tmp_path / "c.pt", weights_only=False)
    checkpoint["engine"]["optimizer"]["steps"] += shift
    torch.save(checkpoint, tmp_path / "shifted.pt")
    resumed, model2, opt2, _ = _setup(budgets, steps=6)
    with pytest.raises(ValueError, match="optimizer has taken .* steps but its privacy accounting holds 3"):
        resumed.load_checkpoint(tmp_path / "shifted.pt", model2)
    assert resumed.steps == 0 and opt2.steps == 0


def test_a_checkpoint_whose_loader_is_behind_its_steps_is_refused(tmp_path):
    """Draw t is Poisson-sampled from (seed, t): a loader behind the steps taken would repeat draws,
    and the accounting assumes every step's draw is fresh."""
    budgets = np.full(30, 1.0)
    engine, model, opt, loader = _setup(budgets, steps=6)
    _train(model, opt, loader, 3)
    engine.save_checkpoint(tmp_path / "c.pt", model)
    checkpoint = torch.load(tmp_path / "c.pt", weights_only=False)
    checkpoint["engine"]["loader"]["next_step"] = 1
    torch.save(checkpoint, tmp_path / "behind.pt")
    resumed, model2, _, loader2 = _setup(budgets, steps=6)
    with pytest.raises(ValueError, match="loader would draw from step 1 but 3 steps were taken"):
        resumed.load_checkpoint(tmp_path / "behind.pt", model2)
    assert resumed.steps == 0 and loader2.next_step == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(budgets=np.ones(29)), "budgets"),
    (dict(budgets=np.r_[np.ones(29), np.nan]), "budget|epsilon"),
    (dict(budgets=np.r_[np.ones(29), 0.0]), "budget|epsilon"),
    (dict(budgets=np.ones(30), steps=3, epochs=1), "epochs"),
    (dict(budgets=np.ones(30), delta=1.5), "delta"),
    (dict(budgets=np.ones(30), noise_multiplier=1.0), "noise_multiplier"),
])
def test_bad_budget_arguments_are_refused(kwargs, match):
    budgets = kwargs.pop("budgets")
    delta = kwargs.pop("delta", 1e-5)
    kwargs.setdefault("epochs", None if "steps" in kwargs else 1)
    model = nn.Linear(6, 3)
    ds = TensorDataset(torch.randn(30, 6), torch.zeros(30, dtype=torch.long))
    with pytest.raises((ValueError, TypeError), match=match):
        pdpfast.PrivacyEngine().make_private_with_budgets(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(ds, batch_size=5), budgets=budgets, delta=delta, **kwargs)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(delta="1e-5"), TypeError, r"delta must be a number in \(0, 1\), got str"),
    (dict(budgets=["1"] * 30), TypeError, "budgets must be numbers"),
    (dict(budgets=np.ones(30, dtype=bool)), TypeError, "budgets must be numbers"),
    (dict(sample_rate=0.0), ValueError, r"sample_rate must lie in \(0, 1\]"),
    (dict(sample_rate="0.1"), TypeError, "sample_rate must be a number"),
], ids=["delta as text", "budgets as text", "budgets as bools", "sample_rate 0", "sample_rate as text"])
def test_budget_arguments_of_the_wrong_type_or_range_get_the_error_that_names_them(kwargs, error, match):
    args = dict(budgets=np.ones(30), delta=1e-5, epochs=1) | kwargs
    model = nn.Linear(6, 3)
    ds = TensorDataset(torch.randn(30, 6), torch.zeros(30, dtype=torch.long))
    with pytest.raises(error, match=match):
        pdpfast.PrivacyEngine().make_private_with_budgets(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(ds, batch_size=5), **args)


# ---------------------------------------------------------------------------- accountant="pld"
PLD_BUDGETS = np.repeat([1.0, 2.0, 3.0], [40, 35, 25])
PLD_STEPS = 8       # one plan for every test below: PLD calibration is cached, not redone


def test_engine_epsilons_stay_within_budgets_with_pld_plan():
    # The plan is certified by PLD; an RDP ledger reported every group at 1.1-1.6x its budget.
    engine, model, opt, loader = _setup(PLD_BUDGETS, accountant="pld", steps=PLD_STEPS)
    assert engine.plan.accountant == "pld" and engine.accountant.name == "pld"
    _train(model, opt, loader, engine.plan.steps)
    eps = engine.epsilons()
    assert np.all(eps <= PLD_BUDGETS)
    spends = engine.plan.sample_rates < 1.0
    assert np.all(eps[spends] >= 0.98 * PLD_BUDGETS[spends])
    np.testing.assert_allclose(eps, engine.plan.epsilons(), rtol=1e-9)


def test_a_step_past_a_pld_plan_is_refused():
    engine, model, opt, loader = _setup(PLD_BUDGETS, accountant="pld", steps=PLD_STEPS)
    _train(model, opt, loader, PLD_STEPS)
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivacyBudgetExceeded):
        opt.step()
    assert engine.steps == PLD_STEPS and np.all(engine.epsilons() <= PLD_BUDGETS)
    # not only the step count: the PLD ledger itself says one more step overspends
    assert engine.accountant.would_exceed(engine.delta, 1)[engine.plan.sample_rates < 1].all()


def test_checkpoint_then_resume_continues_the_pld_ledger_exactly(tmp_path):
    engine, model, opt, loader = _setup(PLD_BUDGETS, accountant="pld", steps=PLD_STEPS)
    _train(model, opt, loader, 3)
    engine.save_checkpoint(tmp_path / "ckpt.pt", model)
    resumed, model2, opt2, loader2 = _setup(PLD_BUDGETS, accountant="pld", steps=PLD_STEPS)
    resumed.load_checkpoint(tmp_path / "ckpt.pt", model2)
    assert resumed.accountant.steps_taken == 3
    np.testing.assert_array_equal(resumed.epsilons(), engine.epsilons())
    _train(model, opt, loader, PLD_STEPS - 3)
    _train(model2, opt2, loader2, PLD_STEPS - 3)
    np.testing.assert_array_equal(resumed.epsilons(), engine.epsilons())
    assert np.all(resumed.epsilons() <= PLD_BUDGETS)


@pytest.mark.parametrize("saved,resumed", [("rdp", "pld"), ("pld", "rdp")])
def test_resume_with_another_accountant_is_refused(tmp_path, saved, resumed):
    engine, model, opt, loader = _setup(PLD_BUDGETS, accountant=saved, steps=PLD_STEPS)
    _train(model, opt, loader, 1)
    engine.save_checkpoint(tmp_path / "c.pt", model)
    other, model2, *_ = _setup(PLD_BUDGETS, accountant=resumed, steps=PLD_STEPS)
    with pytest.raises(ValueError, match=f"accountant='{saved}'.*accountant='{resumed}'"):
        other.load_checkpoint(tmp_path / "c.pt", model2)
    assert other.steps == 0 and other.accountant.steps_taken == 0


def test_a_pld_checkpoint_with_the_old_rdp_ledger_resumes_with_a_pld_ledger(tmp_path):
    # checkpoints of PLD runs written before the PLD ledger hold an RDP ledger (no accountant name)
    from pdpfast.accounting import IndividualAccountant

    engine, model, opt, loader = _setup(PLD_BUDGETS, accountant="pld", steps=PLD_STEPS)
    _train(model, opt, loader, 3)
    engine.save_checkpoint(tmp_path / "new.pt", model)
    checkpoint = torch.load(tmp_path / "new.pt", weights_only=False)
    old = IndividualAccountant(engine.plan.sample_rates, engine.plan.noise_multipliers, budgets=PLD_BUDGETS).step(3)
    checkpoint["engine"]["ledger"] = {k: v for k, v in old.state_dict().items() if k != "accountant"}
    torch.save(checkpoint, tmp_path / "old.pt")
    resumed, model2, *_ = _setup(PLD_BUDGETS, accountant="pld", steps=PLD_STEPS)
    resumed.load_checkpoint(tmp_path / "old.pt", model2)
    assert resumed.accountant.name == "pld" and resumed.accountant.steps_taken == 3
    np.testing.assert_array_equal(resumed.epsilons(), engine.epsilons())


@pytest.mark.parametrize("method", ["sample", "scale"])
@pytest.mark.parametrize("noise_schedule", [None, "exponential:0.01"])
def test_a_hybrid_weight_given_with_sample_or_scale_is_refused_not_ignored(method, noise_schedule):
    with pytest.raises(ValueError, match=f"hybrid_weight is for method='hybrid'.*method='{method}'"):
        _setup(np.full(40, 2.0), method=method, hybrid_weight=0.3, noise_schedule=noise_schedule)
    engine, *_ = _setup(np.repeat([1.0, 3.0], 20), method="hybrid", hybrid_weight=0.3)   # where it applies
    default, *_ = _setup(np.repeat([1.0, 3.0], 20), method="hybrid")
    half, *_ = _setup(np.repeat([1.0, 3.0], 20), method="hybrid", hybrid_weight=0.5)
    assert default.plan.to_dict() == half.plan.to_dict() != engine.plan.to_dict()    # None means 0.5


def test_a_delta_of_at_least_one_over_n_warns_in_the_python_api_as_the_cli_does():
    from pdpfast._checks import LargeDeltaWarning

    with pytest.warns(LargeDeltaWarning, match=r"delta 0\.05 ≥ 1/N = 1/30: .* publish a few records in the clear"):
        _setup(np.full(30, 2.0), delta=0.05)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", LargeDeltaWarning)
        _setup(np.full(30, 2.0))       # δ = 1e-5


def test_the_default_sample_rate_is_one_over_the_loaders_batches_as_documented():
    """30 records in batches of 4: 8 batches, so q = 1/8, not batch_size / N = 0.133 (the docstring said the
    latter, and the error for a loader without batches named it)."""
    model = nn.Linear(6, 3)
    ds = TensorDataset(torch.randn(30, 6), torch.zeros(30, dtype=torch.long))
    engine = pdpfast.PrivacyEngine(seed=0)
    engine.make_private_with_budgets(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(ds, batch_size=4), budgets=np.ones(30), delta=1e-5,
                                     epochs=1, method="scale")
    np.testing.assert_allclose(engine.plan.sample_rates, 1 / 8)
    doc = pdpfast.PrivacyEngine.make_private_with_budgets.__doc__
    assert "default 1/len(data_loader)" in doc and "default: batch_size / N" not in doc
    with pytest.raises(ValueError, match=r"sample rate 1/len\(data_loader\) is undefined"):
        pdpfast.PrivacyEngine().make_private_with_budgets(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(ds, batch_size=40, drop_last=True), budgets=np.ones(30), delta=1e-5, epochs=1)
