"""The captured private step (``pdpfast.graphs``): on the CPU, its eager path against the ordinary
loop, the host lifecycle around its bodies, and bodies that never synchronise with the host (what a
CUDA graph capture needs). The capture itself is checked on CUDA in ``tests/test_cuda.py``."""
import copy
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pdpfast
from pdpfast.clipping import Phase
from pdpfast.engine import PrivacyBudgetExceeded
from pdpfast.graphs import PrivateStep, no_host_sync
from pdpfast.ops.noise import (
    add_noise_reference_,
    release_pinned,
    seed_and_step_tensor,
    step_seed,
    step_seed_tensor,
    take_pinned,
)

N = 60


def _data(seed=1, features=6, classes=3):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(N, features, generator=g, dtype=torch.float64),
                         torch.randint(0, classes, (N,), generator=g))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3)).double()


def _engine(model, *, physical_batch_size=4, clipping="flat", steps=6, method="hybrid", optimizer=None, **kwargs):
    budgets = np.repeat([1.0, 2.0, 4.0], N // 3)
    opt = optimizer(model) if optimizer else torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    engine = pdpfast.PrivacyEngine(seed=3)
    model, opt, loader = engine.make_private_with_budgets(
        module=model, optimizer=opt, data_loader=DataLoader(_data(), batch_size=12), budgets=budgets, delta=1e-5,
        steps=steps, method=method, physical_batch_size=physical_batch_size, clipping=clipping, **kwargs)
    return engine, model, opt, loader


def _loss(model):
    return lambda x, y: nn.functional.cross_entropy(model(x), y)


def _ordinary(model, opt, loader, draws):
    losses = []
    while True:
        for x, y in loader:
            loss = _loss(model)(x, y)
            loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
            if opt.steps == draws and loader.current.is_last:
                return losses


def _stepped(step, opt, loader, draws):
    losses = []
    while True:
        for batch in loader:
            losses.append(step(*batch))
            if opt.steps == draws and loader.current.is_last:
                return losses


@pytest.mark.parametrize("clipping,kwargs", [("flat", {}), ("per_layer", {}), ("flat", {"automatic_gamma": 0.01}),
                                             ("flat", {"physical_batch_size": None}),
                                             ("flat", {"physical_batch_size": 8}),
                                             ("per_layer", {"physical_batch_size": 8}),
                                             ("flat", {"physical_batch_size": 16})],
                         ids=["bk", "per-layer", "automatic", "no-physical-batch", "bk-mixed-draws",
                              "per-layer-mixed-draws", "one-batch-draws"])
def test_private_step_equals_the_ordinary_loop(clipping, kwargs):
    """Same weights, losses, last norms, step count and ledger as forward/backward/step/zero_grad,
    over draws split into several physical batches of masked rows (accumulate and update bodies),
    draws of one physical batch (the whole-step body), and both in one run."""
    pbs = kwargs.pop("physical_batch_size", 4)
    a_engine, a_model, a_opt, a_loader = _engine(_mlp(), clipping=clipping, physical_batch_size=pbs, **kwargs)
    b_engine, b_model, b_opt, b_loader = _engine(_mlp(), clipping=clipping, physical_batch_size=pbs, **kwargs)
    expected = _ordinary(a_model, a_opt, a_loader, 5)
    step = b_engine.make_step(_loss(b_model))
    assert not step.cuda_graph
    got = _stepped(step, b_opt, b_loader, 5)
    whole = sum(s.whole_runs for s in step._signatures.values())
    accumulated = sum(s.accumulate_runs for s in step._signatures.values())
    assert whole + accumulated == len(got) == len(expected)
    if pbs in (4, 8):
        assert accumulated > 0  # draws spanned several physical batches
    if pbs in (8, 16, None):
        assert whole > 0  # draws of one physical batch
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), rtol=0, atol=0)
    for p, q in zip(b_model.parameters(), a_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-13, atol=1e-13)
        assert p.grad is None  # between draws, as after zero_grad()
    torch.testing.assert_close(b_engine.state.last_norms, a_engine.state.last_norms, rtol=1e-13, atol=0)
    assert b_opt.steps == a_opt.steps == 5
    np.testing.assert_array_equal(b_engine.epsilons(), a_engine.epsilons())
    if pbs == 16:
        assert step._grads is None  # no gradient buffer outlives a step when every draw is one batch


def test_an_eager_private_step_keeps_a_bounded_number_of_input_signatures_and_still_equals_the_loop():
    """An eager step keyed every call anew (here by a non-tensor argument, as a step counter passed to
    the loss would be) keeps only its most recently used signatures, even inside a draw of several
    physical batches, and steps exactly as the ordinary loop."""
    from pdpfast import graphs

    a_engine, a_model, a_opt, a_loader = _engine(_mlp(), physical_batch_size=4, steps=12)
    b_engine, b_model, b_opt, b_loader = _engine(_mlp(), physical_batch_size=4, steps=12)
    expected = _ordinary(a_model, a_opt, a_loader, 10)
    loss = _loss(b_model)
    step = b_engine.make_step(lambda x, y, call: loss(x, y))
    calls, sizes = 0, []
    while b_opt.steps < 10 or not b_loader.current.is_last:
        for x, y in b_loader:
            step(x, y, calls)
            calls += 1
            sizes.append(len(step._signatures))
            if b_opt.steps == 10 and b_loader.current.is_last:
                break
    assert calls == len(expected) > graphs._EAGER_SIGNATURES
    assert max(sizes) == graphs._EAGER_SIGNATURES
    assert list(step._signatures)[-1][1][-1] == ("value", calls - 1)  # the last call's is kept
    for p, q in zip(b_model.parameters(), a_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(b_engine.epsilons(), a_engine.epsilons())


def test_private_step_returns_fresh_losses_and_accumulates_a_draws_physical_batches():
    engine, model, opt, loader = _engine(_mlp(), physical_batch_size=2)
    step = engine.make_step(_loss(model))
    batches = iter(loader)
    first = step(*next(batches))
    assert not loader.current.is_last  # a draw of several batches: no optimizer step yet
    assert opt.steps == 0 and any(p.grad.abs().sum() > 0 for p in model.parameters())
    value = first.clone()
    while not loader.current.is_last:
        step(*next(batches))
    assert opt.steps == 1
    assert torch.equal(first, value)  # a returned loss is not overwritten by later steps
    assert all(p.grad is None for p in model.parameters())  # between draws, as after zero_grad()
    assert all(torch.count_nonzero(g) == 0 for g in step._grads)  # the step zeroed the sums it keeps


def test_private_step_refuses_a_step_past_the_budget():
    engine, model, opt, loader = _engine(_mlp(), steps=3)
    step = engine.make_step(_loss(model))
    with pytest.raises(PrivacyBudgetExceeded):
        _stepped(step, opt, loader, 4)
    assert opt.steps == 3
    assert np.all(engine.epsilons() <= engine.budgets)


def test_private_step_never_carries_a_discarded_draws_sums_into_the_next():
    """A draw of several batches whose step is refused (a pre-step hook, as the ledger's) and then
    discarded (zero_grad) leaves its sums in the step's gradient buffers; the next draw starts from
    zero all the same: the private step ends where the ordinary loop does."""
    models = []
    for private_step in (True, False):
        refused = []

        def refuse_once(optimizer, refused=refused):
            if optimizer.steps == 1 and not refused:
                refused.append(True)
                raise PrivacyBudgetExceeded("refused once")

        engine, model, opt, loader = _engine(_mlp(), steps=3, physical_batch_size=2)
        opt.pre_step_hooks.append(refuse_once)
        step = engine.make_step(_loss(model)) if private_step else None
        run = (lambda: _stepped(step, opt, loader, 3)) if private_step else (lambda: _ordinary(model, opt, loader, 3))
        with pytest.raises(PrivacyBudgetExceeded, match="refused once"):
            run()
        if private_step:
            assert any(torch.count_nonzero(g) > 0 for g in step._grads)
        opt.zero_grad()  # the refused draw is discarded
        run()
        assert opt.steps == 3
        models.append(model)
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_private_step_is_made_between_draws():
    engine, model, opt, loader = _engine(_mlp(), physical_batch_size=2)
    batches = iter(loader)
    _loss(model)(*next(batches)).backward()
    assert not loader.current.is_last
    with pytest.raises(RuntimeError, match="between draws"):
        engine.make_step(_loss(model))


def test_private_step_continues_exactly_after_a_checkpoint(tmp_path):
    a_engine, a_model, a_opt, a_loader = _engine(_mlp(), steps=8)
    _stepped(a_engine.make_step(_loss(a_model)), a_opt, a_loader, 6)
    b_engine, b_model, b_opt, b_loader = _engine(_mlp(), steps=8)
    step = b_engine.make_step(_loss(b_model))
    _stepped(step, b_opt, b_loader, 3)
    b_engine.save_checkpoint(tmp_path / "ckpt.pt", b_model)
    c_engine, c_model, c_opt, c_loader = _engine(_mlp(), steps=8)
    c_engine.load_checkpoint(tmp_path / "ckpt.pt", c_model)
    _stepped(c_engine.make_step(_loss(c_model)), c_opt, c_loader, 6)
    for p, q in zip(c_model.parameters(), a_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(c_engine.epsilons(), a_engine.epsilons())


def _transformer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.Embedding(11, 16), nn.TransformerEncoder(layer, 2), nn.Flatten(), nn.Linear(16 * 5, 3))


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(inplace=True),
                         nn.Conv2d(8, 8, 3, stride=2, padding="valid", padding_mode="zeros"), nn.GroupNorm(4, 8),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))


def _tied_gpt():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=11, n_positions=8, n_embd=16, n_layer=2, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=11, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=8, num_labels=3)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


_MODELS = {
    "mlp": (_mlp, lambda g: torch.randn(4, 6, generator=g, dtype=torch.float64), nn.functional.cross_entropy),
    "transformer": (_transformer, lambda g: torch.randint(0, 11, (4, 5), generator=g), nn.functional.cross_entropy),
    "groupnorm-cnn": (_cnn, lambda g: torch.randn(4, 3, 8, 8, generator=g), nn.functional.cross_entropy),
    "gpt2-tied": (_tied_gpt, lambda g: torch.randint(0, 11, (4, 6), generator=g),
                  lambda out, y: nn.functional.cross_entropy(out.logits.flatten(0, 1), y.repeat_interleave(6) % 11)),
    "bert": (_bert, lambda g: torch.randint(0, 11, (4, 6), generator=g),
             lambda out, y: nn.functional.cross_entropy(out.logits, y)),
}


@pytest.mark.parametrize("name", list(_MODELS))
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_private_step_bodies_never_synchronise_with_the_host(name, clipping):
    """Nothing in forward, backward, clipping, noise or the optimizer step reads a tensor's value on
    the host (``.item()``, ``bool(t)``, ``nonzero``...): a CUDA graph capture would fail there. The
    bodies run under ``no_host_sync``, which raises on every such call."""
    make, inputs, criterion = _MODELS[name]
    model = make()
    g = torch.Generator().manual_seed(5)
    x = inputs(g)
    y = torch.randint(0, 3, (4,), generator=g)
    pdpfast.nn.convert(model)
    state = pdpfast.clipping.ClippingState(model, clipping=clipping)
    state.attach()
    opt = pdpfast.optimizer.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4.0, seed=0)
    step = PrivateStep(state, opt, lambda x, y: criterion(model(x), y), cuda_graph=False)
    step.body_guard = no_host_sync
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        state.begin_batch(torch.rand(4, dtype=torch.float64) + 0.5, torch.tensor([1.0, 1.0, 0.0, 1.0]), loss_scale=4)
        loss = step(x, y)
        assert torch.isfinite(loss)
    assert opt.steps == 2
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    state.detach()


_SYNCS = {
    "torch.unique": lambda x: torch.unique(x),
    "boolean-mask read": lambda x: x[x > 2],
    "boolean-mask write": lambda x: x.__setitem__(x > 2, 0.0),
    "nonzero": lambda x: torch.nonzero(x),
    "repeat_interleave by a tensor": lambda x: x.repeat_interleave(torch.ones(6, dtype=torch.long)),
    "repeat_interleave by a tensor along a dim": lambda x: x.repeat_interleave(torch.ones(6, dtype=torch.long), 0),
    "repeat_interleave of counts": lambda x: torch.repeat_interleave(torch.tensor([1, 2])),
    "item": lambda x: x.sum().item(),
    "bool": lambda x: bool(x.sum() > 0),
}
_NO_SYNCS = {
    "torch.where": lambda x: torch.where(x > 2, x, 0.0),
    "masked_fill": lambda x: x.masked_fill(x > 2, 0.0),
    "integer index": lambda x: x[torch.tensor([1, 4])],
    "repeat_interleave by an int": lambda x: x.repeat_interleave(2),
    "repeat_interleave by an int along a dim": lambda x: x.repeat_interleave(2, 0),
    "repeat_interleave with its output size": lambda x: x.repeat_interleave(torch.full((6,), 2), output_size=12),
    "sort and searchsorted": lambda x: torch.searchsorted(x.sort().values, x),
}


@pytest.mark.parametrize("name", list(_SYNCS))
def test_no_host_sync_refuses_what_reads_a_device_value_below_the_tensor_methods(name):
    """torch.unique and mask indexing reach the host inside aten, not through Tensor.item: the
    guard sees them at the dispatcher."""
    with no_host_sync(), pytest.raises(RuntimeError, match="synchronises with the host"):
        _SYNCS[name](torch.arange(6.0))


@pytest.mark.parametrize("name", list(_NO_SYNCS))
def test_no_host_sync_lets_static_shape_operations_run(name):
    x = torch.arange(6.0)
    expected = _NO_SYNCS[name](x)
    with no_host_sync():
        out = _NO_SYNCS[name](x)
    torch.testing.assert_close(out, expected)


def test_no_host_sync_catches_a_synchronising_loss():
    model = _mlp()
    engine, model, opt, loader = _engine(model)

    def loss_fn(x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        if loss > 10:  # branching on a value: a host synchronisation
            loss = loss * 0.5
        return loss

    step = engine.make_step(loss_fn)
    step.body_guard = no_host_sync
    with pytest.raises(RuntimeError, match="synchronises with the host"):
        step(*next(iter(loader)))


def test_private_step_refuses_what_it_cannot_capture():
    engine, model, opt, loader = _engine(_mlp())
    with pytest.raises(ValueError, match="CUDA device"):
        engine.make_step(_loss(model), cuda_graph=True)
    with pytest.raises(ValueError, match="warmup"):
        engine.make_step(_loss(model), warmup=0)
    with pytest.raises(TypeError, match="loss_fn"):
        engine.make_step(None)
    step = engine.make_step(_loss(model))
    with pytest.raises(RuntimeError, match="needs an open batch"):
        step(*loader.dataset[:4])  # no batch of the loader is open
    x, y = next(iter(loader))
    step(x, y)
    if not loader.current.is_last:
        with pytest.raises(RuntimeError, match="already computed"):
            step(x, y)  # the batch's clipped sums are in .grad: a second call would add a second contribution
    with pytest.raises(TypeError, match="scalar loss"):
        engine2, model2, _, loader2 = _engine(_mlp())
        step2 = engine2.make_step(lambda x, y: nn.functional.cross_entropy(model2(x), y, reduction="none"))
        step2(*next(iter(loader2)))


def test_private_step_refuses_ghost_mode_and_a_graph_without_fixed_batches():
    engine = pdpfast.PrivacyEngine(seed=0)
    model = _mlp()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(_data(), 10),
        noise_multiplier=1.0, max_grad_norm=1.0, mode="ghost", criterion=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="ghost"):
        engine.make_step(_loss(model))
    engine, model, opt, loader = _engine(_mlp(), physical_batch_size=None)
    with pytest.raises(ValueError, match="physical_batch_size"):
        engine.make_step(_loss(model), cuda_graph=True)


def test_rebind_batch_keeps_shapes():
    engine, model, opt, loader = _engine(_mlp())
    next(iter(loader))
    with pytest.raises(ValueError, match="shapes"):
        engine.state.rebind_batch(torch.ones(3, dtype=torch.float64), engine.state.mask)


def test_device_step_counter_gives_the_host_step_seed():
    rng = random.Random(0)
    for _ in range(500):
        seed, step = rng.getrandbits(rng.choice([8, 56, 64])), rng.getrandbits(rng.choice([4, 40, 64]))
        assert int(step_seed_tensor(seed_and_step_tensor(seed, step, "cpu"))) == step_seed(seed, step)


def test_a_capture_takes_only_a_pinned_buffer_set_aside_before_it():
    """A copy recorded in a CUDA capture reads a pinned host buffer that eager runs set aside (a
    capture refuses pageable memory and cannot pin); a dropped graph gives back only pinned ones."""
    with pytest.raises(RuntimeError, match="set aside by an eager run"):
        take_pinned((4, 12347))
    keep = [torch.zeros(4, 12347, dtype=torch.int64), torch.zeros(4, 12347, dtype=torch.int64)]
    release_pinned(keep)  # pageable: nothing to give back
    assert keep == []
    with pytest.raises(RuntimeError, match="set aside by an eager run"):
        take_pinned((4, 12347))


def test_reference_noise_refuses_a_device_side_seed():
    with pytest.raises(RuntimeError, match="Triton noise kernel"):
        add_noise_reference_([torch.zeros(3)], 1.0, 0, 0, device_seed=torch.zeros((), dtype=torch.int64))


def test_private_step_keeps_user_state_untouched_by_deepcopy():
    """The step holds the model's own gradient buffers: a deep copy of the model trains apart."""
    engine, model, opt, loader = _engine(_mlp())
    step = engine.make_step(_loss(model))
    twin = copy.deepcopy(model)
    _stepped(step, opt, loader, 2)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_private_step_second_call_into_a_clipped_batch_never_adds_a_second_contribution():
    """A batch's clipped sums are in .grad after one call: calling the step again on the same batch
    (mid-draw: the batch is CLIPPED; at a draw's end: the step closed it) is refused, never added."""
    engine, model, opt, loader = _engine(_mlp(), physical_batch_size=2)
    step = engine.make_step(_loss(model))
    batches = iter(loader)
    x, y = next(batches)
    step(x, y)
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="already computed|needs an open batch"):
        step(x, y)
    if not loader.current.is_last:
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    else:  # a draw of one batch stepped: nothing was added after
        assert all(p.grad is None for p in model.parameters())
    while not loader.current.is_last:
        step(*next(batches))
    with pytest.raises(RuntimeError, match="needs an open batch"):
        step(x, y)
    assert opt.steps == 1


def test_private_step_under_autocast_equals_the_ordinary_loop():
    """bf16 autocast inside the loss function: the same steps as the ordinary loop under autocast
    (norms and clip weights in fp32, the rounding margin on the bounds)."""
    def autocast_loss(model):
        def loss(x, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return nn.functional.cross_entropy(model(x.float()).float(), y)
        return loss

    def mlp32():
        return _mlp().float()

    a_engine, a_model, a_opt, a_loader = _engine(mlp32())
    b_engine, b_model, b_opt, b_loader = _engine(mlp32())
    draws = 3
    while a_opt.steps < draws:
        for x, y in a_loader:
            autocast_loss(a_model)(x, y).backward()
            a_opt.step()
            a_opt.zero_grad()
            if a_opt.steps == draws and a_loader.current.is_last:
                break
    _stepped(b_engine.make_step(autocast_loss(b_model)), b_opt, b_loader, draws)
    for p, q in zip(b_model.parameters(), a_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(b_engine.epsilons(), a_engine.epsilons())


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_a_replayed_backward_leaves_the_batch_as_its_backward_does(clipping):
    """The host side of a replayed graph (``ClippingState.replayed_backward``; the replay itself runs
    on CUDA only): given a backward's outputs and clipped sums, the batch is clipped and its draw
    pending as after that backward: the same norms, hooks, refusal of a second contribution, noisy
    step and charge."""
    a_engine, a_model, a_opt, a_loader = _engine(_mlp(), clipping=clipping, physical_batch_size=None)
    b_engine, b_model, b_opt, b_loader = _engine(_mlp(), clipping=clipping, physical_batch_size=None)
    (x, y), (xb, yb) = next(iter(a_loader)), next(iter(b_loader))
    assert torch.equal(x, xb) and torch.equal(y, yb)
    _loss(a_model)(x, y).backward()
    state, calls = b_engine.state, []
    state.post_backward_hooks.append(calls.append)
    assert state.phase is Phase.OPEN
    for p, q in zip(b_model.parameters(), a_model.parameters()):  # what the graph's replay wrote, before the host hears
        p.grad = q.grad.clone()
    state.replayed_backward(tuple(None if t is None else t.clone() for t in a_engine.state.clipped_outputs()))
    assert state.phase is Phase.CLIPPED and state.pending and calls == [state]
    torch.testing.assert_close(state.last_norms, a_engine.state.last_norms, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="already computed"):
        state.replayed_backward(state.clipped_outputs())
    with pytest.raises(RuntimeError, match="already computed"):
        _loss(b_model)(xb, yb)
    a_opt.step()
    b_opt.step()
    for p, q in zip(b_model.parameters(), a_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    np.testing.assert_array_equal(b_engine.epsilons(), a_engine.epsilons())
    assert b_opt.steps == a_opt.steps == 1
