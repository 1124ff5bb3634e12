"""Opacus 1.6 compatibility of ``PrivacyEngine`` (issue 13, item 1).

An ordinary Opacus script runs unchanged with ``from pdpfast import PrivacyEngine``; its ε agrees with
Opacus's RDP accountant for the same (q, σ, steps) (to 1e-9 relative: the same series and conversion),
and a step's noiseless gradient is the exactly clipped sum that Opacus and a float64 per-sample oracle
give. Opacus is used only as an oracle here.
"""
import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

import pdpfast
from pdpfast.clipping import Phase
from pdpfast.validators import ModuleValidator, UnsupportedModuleError

opacus = pytest.importorskip("opacus")

EPS_RTOL = 1e-9  # same RDP series and the same improved (ε, δ) conversion as Opacus


def _dataset(n=64, d=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g) * 3, torch.randint(0, classes, (n,), generator=g))


def _model(d=6, classes=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, classes))


def _opacus_script(PrivacyEngine, *, engine_kwargs=None, epochs=2, with_epsilon=False, poisson_sampling=True,
                   seed=0):
    """An ordinary Opacus 1.6 training script, parametrized only by the PrivacyEngine class."""
    model = _model(seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data_loader = DataLoader(_dataset(), batch_size=8)
    criterion = nn.CrossEntropyLoss()
    privacy_engine = PrivacyEngine(**(engine_kwargs or {}))
    if with_epsilon:
        model, optimizer, data_loader = privacy_engine.make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=data_loader, target_epsilon=3.0, target_delta=1e-5,
            epochs=epochs, max_grad_norm=1.0, poisson_sampling=poisson_sampling)
    else:
        model, optimizer, data_loader = privacy_engine.make_private(
            module=model, optimizer=optimizer, data_loader=data_loader, noise_multiplier=1.1, max_grad_norm=1.0,
            poisson_sampling=poisson_sampling)
    for _ in range(epochs):
        for x, y in data_loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
    return privacy_engine, optimizer, privacy_engine.get_epsilon(1e-5)


def _opacus_rdp_epsilon(noise_multiplier, sample_rate, steps, delta):
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(noise_multiplier, sample_rate, steps)]
    return accountant.get_epsilon(delta)


# ------------------------------------------------------------------ the script, unchanged


def test_opacus_script_runs_unchanged_and_epsilon_matches_opacus_rdp():
    engine, optimizer, eps = _opacus_script(pdpfast.PrivacyEngine)
    q, steps = 1 / 8, 2 * 8
    assert engine.steps == steps
    assert engine.accountant.history == [(1.1, q, steps)]
    assert len(engine.accountant) == 1 and engine.accountant.mechanism() == "rdp"
    np.testing.assert_allclose(eps, _opacus_rdp_epsilon(1.1, q, steps, 1e-5), rtol=EPS_RTOL)
    # and the same script under Opacus (its RDP accountant) takes as many steps and reports that ε
    op_engine, _, op_eps = _opacus_script(opacus.PrivacyEngine, engine_kwargs=dict(accountant="rdp"))
    assert sum(n for *_, n in op_engine.accountant.history) == steps
    np.testing.assert_allclose(eps, op_eps, rtol=EPS_RTOL)


def test_make_private_with_epsilon_runs_unchanged_and_spends_at_most_the_target():
    engine, optimizer, eps = _opacus_script(pdpfast.PrivacyEngine, with_epsilon=True)
    assert 3.0 - 1e-3 < eps <= 3.0 * (1 + 1e-9)   # σ is the root of ε(σ) = target: ε ends at the target
    op_engine, op_optimizer, op_eps = _opacus_script(opacus.PrivacyEngine, with_epsilon=True,
                                                     engine_kwargs=dict(accountant="rdp"))
    # Opacus bisects to within its tolerance (0.01) below the target: its σ is slightly larger
    assert op_eps <= eps + 1e-9
    assert op_optimizer.noise_multiplier >= optimizer.noise_multiplier
    np.testing.assert_allclose(optimizer.noise_multiplier, op_optimizer.noise_multiplier, rtol=0.02)


def test_prv_accountant_name_is_accounted_by_pld_close_to_opacus_prv():
    engine, _, eps = _opacus_script(pdpfast.PrivacyEngine, engine_kwargs=dict(accountant="prv"))
    assert engine.accountant.mechanism() == "pld"
    _, _, op_eps = _opacus_script(opacus.PrivacyEngine, engine_kwargs=dict(accountant="prv"))
    rdp_eps = _opacus_rdp_epsilon(1.1, 1 / 8, 16, 1e-5)
    assert eps < rdp_eps                      # tighter than RDP, as PRV is
    np.testing.assert_allclose(eps, op_eps, rtol=0.01)


def test_user_loop_without_poisson_sampling_warns_once_and_accounts_like_opacus():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, _, eps = _opacus_script(pdpfast.PrivacyEngine, poisson_sampling=False)
    poisson = [w for w in caught if "Poisson sampling" in str(w.message)]
    assert len(poisson) == 1
    assert engine.steps == 16 and engine.data_loader is None
    np.testing.assert_allclose(eps, _opacus_rdp_epsilon(1.1, 1 / 8, 16, 1e-5), rtol=EPS_RTOL)


# ------------------------------------------------------------------ exactly clipped gradients


def _oracle_clipped_sum(model, x, y, clip, loss_fn=nn.functional.cross_entropy):
    """Σ_i min(1, c/(‖g_i‖+1e-6)) g_i in float64, per-sample gradients by vmap(grad)."""
    ref = copy.deepcopy(model).double()
    params = {k: v.detach() for k, v in ref.named_parameters()}

    def loss(p, xi, yi):
        return loss_fn(functional_call(ref, p, (xi[None],)), yi[None])

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x.double(), y)
    norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
    w = (clip / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.einsum("b,b...->...", w, v) for k, v in g.items()}


def _one_step(PrivacyEngine, model, x, y, engine_kwargs=None, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x) // 4)
    engine = PrivacyEngine(**(engine_kwargs or {}))
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=0.0, max_grad_norm=0.5, poisson_sampling=False,
                                                   **kwargs)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x[:9]), y[:9]).backward()   # a batch of the user's own
    optimizer.step()
    return {k.removeprefix("_module."): (before[k] - v.detach()) for k, v in model.named_parameters()}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_noiseless_step_on_a_user_batch_is_the_clipped_sum_of_opacus_and_of_the_oracle():
    ds = _dataset(n=64)
    x, y = ds.tensors
    oracle = _oracle_clipped_sum(_model(), x[:9], y[:9], 0.5)
    ours = _one_step(pdpfast.PrivacyEngine, _model(), x, y)
    theirs = _one_step(opacus.PrivacyEngine, _model(), x, y)
    expected_batch_size = 64 / 4  # Σ q_i = N / len(loader); Opacus: int(N / len(loader)), equal here
    for name, step in ours.items():
        torch.testing.assert_close(step.double(), oracle[name] / expected_batch_size, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(step, theirs[name], rtol=1e-5, atol=1e-7)


def test_noiseless_step_of_a_poisson_draw_is_the_clipped_sum_of_its_records():
    x, y = _dataset(n=40).tensors
    model = _model()
    reference = copy.deepcopy(model)
    engine = pdpfast.PrivacyEngine(seed=4)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=10), noise_multiplier=0.0, max_grad_norm=0.3,
        poisson_sampling=True)
    xb, yb = next(iter(loader))
    drawn = loader.current.indices
    assert len(drawn) > 0
    nn.functional.cross_entropy(model(xb), yb).backward()
    oracle = _oracle_clipped_sum(reference, x[drawn], y[drawn], 0.3)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close((before[name] - p.detach()).double(), oracle[name] / 10.0, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ lifecycle of user batches


def _uniform(poisson_sampling=False, **kwargs):
    x, y = _dataset(n=32).tensors
    model = _model()
    engine = pdpfast.PrivacyEngine(seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=poisson_sampling, **kwargs)
    return engine, model, optimizer, x, y


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_user_batch_keeps_the_lifecycle_one_backward_then_step():
    engine, model, optimizer, x, y = _uniform()
    loss = nn.functional.cross_entropy(model(x[:5]), y[:5])
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second contribution"):
        loss.backward()
    with pytest.raises(RuntimeError, match="already computed"):
        model(x[:5])
    optimizer.step()
    assert engine.state.phase is Phase.IDLE and engine.steps == 1
    nn.functional.cross_entropy(model(x[5:9]), y[5:9]).backward()   # the next batch opens itself
    optimizer.step()
    assert engine.steps == 2


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_second_forward_into_a_user_batch_is_refused():
    """Two forwards before one backward would clip row i of both together as if they were one record."""
    engine, model, optimizer, x, y = _uniform()
    model(x[:4])
    with pytest.raises(RuntimeError, match="second forward"):
        model(x[4:8])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_forward_that_raised_or_batch_discarded_by_zero_grad_lets_the_next_forward_open():
    engine, model, optimizer, x, y = _uniform()
    with pytest.raises(RuntimeError):
        model(x[:4, :3])                          # wrong feature size: the forward raises midway
    nn.functional.cross_entropy(model(x[:4]), y[:4])   # not refused
    optimizer.zero_grad()                         # discards the unused batch
    nn.functional.cross_entropy(model(x[4:8]), y[4:8]).backward()
    optimizer.step()
    assert engine.steps == 1


class _KeywordModel(nn.Module):
    """Called like a Hugging Face model: keyword tensors only, one of them a dict."""

    def __init__(self):
        super().__init__()
        self.body = _model()

    def forward(self, *, inputs):
        return self.body(inputs["features"])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_user_batch_size_is_read_from_keyword_and_nested_inputs():
    x, y = _dataset(n=32).tensors
    model = _KeywordModel()
    reference = copy.deepcopy(model.body)
    engine = pdpfast.PrivacyEngine()
    model, optimizer, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=0.0, max_grad_norm=0.5,
        poisson_sampling=False, loss_reduction="sum")
    nn.functional.cross_entropy(model(inputs={"features": x[:7]}), y[:7], reduction="sum").backward()
    assert engine.state.batch_size == 7
    oracle = _oracle_clipped_sum(reference, x[:7], y[:7], 0.5)
    for name, p in model.body.named_parameters():
        torch.testing.assert_close(p.grad.double(), oracle[name], rtol=1e-5, atol=1e-7)


def test_eval_and_no_grad_forwards_open_nothing():
    engine, model, optimizer, x, y = _uniform()
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    assert engine.state.phase is Phase.IDLE


# ------------------------------------------------------------------ per-record bounds: name the records


def _per_record(clip_norms, noise_multiplier=0.0):
    x, y = _dataset(n=32).tensors
    model = _model()
    reference = copy.deepcopy(model)
    engine = pdpfast.PrivacyEngine(seed=2)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=noise_multiplier,
        max_grad_norm=1.0, clip_norms=clip_norms)
    return engine, model, reference, optimizer, x, y


def test_per_record_bounds_refuse_a_hand_built_batch_that_names_no_records():
    clip = np.linspace(0.01, 1.0, 32)
    engine, model, _, optimizer, x, y = _per_record(clip)
    with pytest.raises(RuntimeError, match="records"):
        model(x[:4])
    assert engine.state.phase is Phase.IDLE


def test_named_records_are_clipped_to_their_own_bounds():
    clip = np.linspace(0.01, 1.0, 32)
    engine, model, reference, optimizer, x, y = _per_record(clip)
    idx = torch.tensor([3, 17, 0, 30, 9])
    with pytest.warns(UserWarning, match="Poisson sampling"):
        with engine.records(idx):
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    ref = copy.deepcopy(reference).double()
    params = {k: v.detach() for k, v in ref.named_parameters()}

    def loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(ref, p, (xi[None],)), yi[None])

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x[idx].double(), y[idx])
    norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
    w = (torch.tensor(clip[idx.numpy()]) / (norms + 1e-6)).clamp(max=1.0)
    for name, v in g.items():
        # the mean loss's gradient is scaled back to per-sample losses: grad = Σ_i w_i g_i
        torch.testing.assert_close(grads[name].double(), torch.einsum("b,b...->...", w, v), rtol=1e-5, atol=1e-7)
    optimizer.step()
    assert engine.steps == 1 and engine.state.phase is Phase.IDLE
    with pytest.raises(RuntimeError, match="records"):
        model(x[:4])                              # the step closed the named batch


@pytest.mark.parametrize("indices, error, match", [
    ([1, 1, 2], ValueError, "twice"),
    ([0, 32], ValueError, r"\[0, 32\)"),
    ([-1], ValueError, r"\[0, 32\)"),
    ([[0, 1]], TypeError, "1-D"),
    ([0.5, 1.0], TypeError, "ints"),
])
def test_records_refuses_bad_indices(indices, error, match):
    engine, *_ = _per_record(np.linspace(0.1, 1.0, 32))
    with pytest.raises(error, match=match):
        with engine.records(indices):
            pass


def test_records_closes_its_batch_when_the_block_raises_before_backward():
    engine, model, _, optimizer, x, y = _per_record(np.linspace(0.1, 1.0, 32))
    with pytest.warns(UserWarning), pytest.raises(KeyError):
        with engine.records([0, 1]):
            model(x[:2])
            raise KeyError("the user's code failed")
    assert engine.state.phase is Phase.IDLE and engine.steps == 0


def test_records_refuses_a_new_batch_before_the_step():
    engine, model, _, optimizer, x, y = _per_record(np.linspace(0.1, 1.0, 32))
    with pytest.warns(UserWarning):
        with engine.records([0, 1]):
            nn.functional.cross_entropy(model(x[:2]), y[:2]).backward()
    with pytest.raises(RuntimeError, match="optimizer.step"):
        with engine.records([2, 3]):
            pass


def test_budgets_run_never_opens_a_batch_by_itself():
    """Individual budgets are spent through per-record rates: a hand-built batch names its records."""
    x, y = _dataset(n=32).tensors
    model = _model()
    engine = pdpfast.PrivacyEngine(seed=0)
    budgets = np.where(np.arange(32) < 16, 1.0, 4.0)
    model, optimizer, loader = engine.make_private_with_budgets(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8), budgets=budgets, delta=1e-5, epochs=1)
    with pytest.raises(RuntimeError, match="records"):
        model(x[:4])
    xb, yb = next(iter(loader))
    nn.functional.cross_entropy(model(xb), yb).backward()
    optimizer.step()
    eps = engine.get_epsilon(1e-5)
    assert eps == pytest.approx(engine.epsilons().max()) and eps <= 4.0


def test_per_record_make_private_reports_the_largest_record_epsilon():
    from pdpfast.accounting.rdp import epsilon

    engine, model, _, optimizer, x, y = _per_record(np.where(np.arange(32) < 16, 0.5, 1.0), noise_multiplier=1.0)
    assert engine.accountant is None
    with pytest.warns(UserWarning):
        for start in (0, 4):
            with engine.records(range(start, start + 4)):
                nn.functional.cross_entropy(model(x[start:start + 4]), y[start:start + 4]).backward()
            optimizer.step()
    # records with c = 1 have z = σ; those with c = 0.5 have z = 2σ: the largest ε is at z = σ
    np.testing.assert_allclose(engine.get_epsilon(1e-5), float(epsilon(1 / 4, 1.0, 2, 1e-5)), rtol=1e-9)


# ------------------------------------------------------------------ accountant, checkpoints, API


def test_accountant_history_merges_equal_steps_and_survives_a_checkpoint():
    engine, model, optimizer, x, y = _uniform(poisson_sampling=True)
    for xb, yb in engine.data_loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
    assert engine.accountant.history == [(1.0, 0.25, 4)]
    state = engine.state_dict()
    other, *_ = _uniform(poisson_sampling=True)
    other.load_state_dict(state)
    assert other.accountant.history == [(1.0, 0.25, 4)]
    assert other.get_epsilon(1e-5) == engine.get_epsilon(1e-5)


def test_ghost_grad_sample_mode_returns_the_criterion_like_opacus():
    x, y = _dataset(n=32).tensors
    model = _model()
    engine = pdpfast.PrivacyEngine(seed=0)
    out = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0,
                              max_grad_norm=1.0, criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost")
    assert len(out) == 4 and engine.mode == "ghost"
    model, optimizer, criterion, loader = out
    xb, yb = next(iter(loader))
    criterion(model(xb), yb).backward()
    optimizer.step()
    assert engine.steps == 1


def test_wrap_model_false_returns_hooks_whose_cleanup_detaches():
    x, y = _dataset(n=32).tensors
    model = _model()
    engine = pdpfast.PrivacyEngine()
    hooks, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
        wrap_model=False)
    hooks.cleanup()
    model(x).sum().backward()   # plain torch again
    assert all(p.grad is not None for p in model.parameters())


def _make(engine=None, **overrides):
    x, y = _dataset(n=32).tensors
    model = _model()
    kwargs = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0,
                  max_grad_norm=1.0)
    kwargs.update(overrides)
    return (engine or pdpfast.PrivacyEngine()).make_private(**kwargs)


@pytest.mark.parametrize("overrides, error, match", [
    (dict(poisson_sampling="yes"), TypeError, "poisson_sampling"),
    (dict(max_grad_norm=[1.0, 2.0]), TypeError, "max_grad_norm"),
    (dict(max_grad_norm=0.0), ValueError, "max_grad_norm"),
    (dict(noise_multiplier=-1.0), ValueError, "noise_multiplier"),
    (dict(noise_multiplier="1"), TypeError, "noise_multiplier"),
    (dict(clipping="adaptive"), ValueError, "adaptive"),
    (dict(grad_sample_mode="magic"), ValueError, "grad_sample_mode"),
    (dict(batch_first=False), ValueError, "batch_first"),
    (dict(rand_on_empty=True), ValueError, "rand_on_empty"),
    (dict(noise_generator=3), TypeError, "noise_generator"),
    (dict(poisson_sampling=False, sample_rates=0.5), ValueError, "sample_rates"),
    (dict(optimizer=torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)), ValueError, "optimizer"),
    (dict(loss_reduction="avg"), ValueError, "loss_reduction"),
])
def test_bad_make_private_arguments_are_named(overrides, error, match):
    with pytest.raises(error, match=match):
        _make(**overrides)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(accountant="gdp"), ValueError, "gdp"),
    (dict(accountant="moments"), ValueError, "accountant"),
    (dict(secure_mode=True), ValueError, "secure_mode"),
])
def test_bad_engine_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        pdpfast.PrivacyEngine(**kwargs)


@pytest.mark.parametrize("overrides, error, match", [
    (dict(epochs=0), ValueError, "epochs"),
    (dict(target_epsilon=-1.0), ValueError, "target_epsilon"),
    (dict(target_delta=2.0), ValueError, "target_delta"),
    (dict(noise_multiplier=1.0), TypeError, "noise_multiplier"),
])
def test_bad_make_private_with_epsilon_arguments_are_named(overrides, error, match):
    x, y = _dataset(n=32).tensors
    model = _model()
    kwargs = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  data_loader=DataLoader(TensorDataset(x, y), batch_size=8), target_epsilon=2.0, target_delta=1e-5,
                  epochs=1, max_grad_norm=1.0)
    kwargs.update(overrides)
    with pytest.raises(error, match=match):
        pdpfast.PrivacyEngine().make_private_with_epsilon(**kwargs)


def test_get_epsilon_refuses_a_bad_delta_and_is_zero_before_training():
    engine = pdpfast.PrivacyEngine()
    assert engine.get_epsilon(1e-5) == 0.0
    with pytest.raises(ValueError, match="delta"):
        engine.get_epsilon(1.5)


def test_every_keyword_of_opacus_dp_optimizer_is_one_of_pdpfasts():
    """So an Opacus low-level script gets pdpfast's answer for each (honored, or refused by name), not
    Python's "unexpected keyword argument"."""
    import inspect

    ours = inspect.signature(pdpfast.DPOptimizer.__init__).parameters
    theirs = inspect.signature(opacus.optimizers.DPOptimizer.__init__).parameters
    assert [name for name, p in theirs.items() if p.kind is p.KEYWORD_ONLY and name not in ours] == []


def test_noise_generator_makes_the_noise_reproducible():
    def noisy_step(seed):
        x, y = _dataset(n=32).tensors
        model = _model()
        engine = pdpfast.PrivacyEngine()
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=False, noise_generator=torch.Generator().manual_seed(seed))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
        optimizer.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(noisy_step(5), noisy_step(5))
    assert not torch.equal(noisy_step(5), noisy_step(6))


# ------------------------------------------------------------------ validator


def _cnn(norm=nn.BatchNorm2d):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 48, 3), norm(48), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(48, 10))


def test_validator_agrees_with_opacus_on_batchnorm_and_fix_makes_the_model_trainable():
    from opacus.validators import ModuleValidator as OpacusValidator

    model = _cnn()
    ours, theirs = ModuleValidator.validate(model), OpacusValidator.validate(model)
    assert len(ours) == len(theirs) == 1 and "BatchNorm" in str(ours[0])
    assert isinstance(ours[0], UnsupportedModuleError)
    with pytest.raises(UnsupportedModuleError, match="BatchNorm"):
        ModuleValidator.validate(model, strict=True)
    fixed = ModuleValidator.fix(model)
    assert isinstance(model[1], nn.BatchNorm2d)          # the original is untouched
    assert isinstance(fixed[1], nn.GroupNorm) and fixed[1].num_channels == 48
    assert ModuleValidator.is_valid(fixed) and OpacusValidator.is_valid(OpacusValidator.fix(model))
    engine = pdpfast.PrivacyEngine()
    assert not engine.is_compatible(module=model, optimizer=None, data_loader=None)
    assert engine.is_compatible(module=fixed, optimizer=None, data_loader=None)
    with pytest.raises(UnsupportedModuleError):
        engine.validate(module=model, optimizer=None, data_loader=None)
    compatible = pdpfast.PrivacyEngine.get_compatible_module(model)
    assert ModuleValidator.is_valid(compatible)


def test_validator_names_unsupported_layers_and_sequence_first_modules():
    model = nn.Sequential(nn.Linear(4, 4), nn.LSTM(4, 4), nn.Bilinear(4, 4, 2))
    errors = [str(e) for e in ModuleValidator.validate(model)]
    assert any("Bilinear" in e for e in errors)
    assert any("batch_first=False" in e for e in errors)
    fixed_instance = ModuleValidator.fix(nn.Sequential(nn.Conv1d(2, 4, 3), nn.InstanceNorm1d(4, affine=True,
                                                                                             track_running_stats=True)))
    assert not fixed_instance[1].track_running_stats and ModuleValidator.is_valid(fixed_instance)


def test_make_private_with_epsilon_under_pld_ends_at_the_target_by_pld():
    engine, optimizer, eps = _opacus_script(pdpfast.PrivacyEngine, with_epsilon=True,
                                            engine_kwargs=dict(accountant="pld"))
    assert engine.accountant.mechanism() == "pld"
    assert 3.0 * (1 - 1e-3) < eps <= 3.0
    rdp = _opacus_rdp_epsilon(optimizer.noise_multiplier, 1 / 8, 16, 1e-5)
    assert rdp > eps   # the same σ costs more under RDP: PLD let the engine add less noise


def test_opacus_batch_memory_manager_is_refused_pointing_to_physical_batch_size():
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    model = _model()
    _, optimizer, loader = pdpfast.PrivacyEngine(seed=0).make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_dataset(), batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0)
    assert not hasattr(loader, "batch_sampler")     # a sampler's absence still reads as absence
    with pytest.raises(AttributeError, match=r"draws its own Poisson batches.*BatchMemoryManager is not needed.*"
                                             r"physical_batch_size="):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=optimizer):
            pass
