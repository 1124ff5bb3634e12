"""The engine on a CUDA device (skipped without one): every clipping mode against the float64
brute-force oracle (per-sample gradients by micro-batching on the CPU) with the Triton kernels on,
fp16/bf16 bounds, autocast, and a training loop under budgets.

Run by ``bench/gpu.sh tests`` on a GPU machine; the same math runs on the CPU everywhere else.
"""
import itertools

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pdpfast
from pdpfast.functional import clipped_gradients

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STYLES = [dict(mode="bk", clipping="flat"), dict(mode="bk", clipping="per_layer"), dict(mode="ghost", clipping="flat")]
STYLE_IDS = ["bk", "per_layer", "ghost"]


def _models():
    from pdpfast.models import bert, gpt2, resnet18_gn

    torch.manual_seed(0)
    yield "bert", bert("micro", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), \
        (torch.randint(1, 128, (5, 12)),), lambda out: out.logits.float().pow(2).sum(1)
    yield "gpt2-tied", gpt2("micro", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), \
        (torch.randint(0, 128, (3, 10)),), lambda out: out.logits.float().pow(2).mean((1, 2))
    yield "resnet18-gn", resnet18_gn(num_classes=4), (torch.randn(3, 3, 16, 16),), \
        lambda out: out.float().pow(2).sum(1)
    yield "mlp", nn.Sequential(nn.Linear(7, 33), nn.GELU(), nn.Linear(33, 5)), (torch.randn(9, 7),), \
        lambda out: out.float().pow(2).sum(1)
    # 160 positions through narrow layers: per-layer clipping forms these calls' per-sample gradients
    # on a GPU (``prefer_per_sample``: the norm would cost more than three passes over them)
    yield "long-sequence", nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 3)), (torch.randn(3, 160, 4),), \
        lambda out: out.float().pow(2).sum((1, 2))


MODELS = {name: (model, inputs, loss) for name, model, inputs, loss in _models()}


def clipped_sums_against_the_oracle(name, style, oracle, device):
    """Every mode on ``device`` in fp32 against the brute-force float64 oracle (``tests/conftest.py``:
    per-sample gradients by micro-batching a float64 copy of the plain torch model)."""
    import copy

    model, inputs, loss = MODELS[name]
    B = inputs[0].shape[0]
    clip_norms = torch.linspace(0.05, 3.0, B, dtype=torch.float64)
    reference = copy.deepcopy(model).double().train()
    per_sample = oracle.per_sample_grads(reference, loss, tuple(t.double() if t.is_floating_point() else t
                                                                for t in inputs), method="loop")
    expected = oracle.expected(reference, per_sample, clip_norms, clipping=style["clipping"])
    converted = pdpfast.nn.convert(copy.deepcopy(model).to(device))
    result = clipped_gradients(converted, loss, *(t.to(device) for t in inputs), clip_norms=clip_norms.float(),
                               **style)
    torch.testing.assert_close(result.norms.double().cpu(), expected.norms, rtol=2e-4, atol=1e-6)
    assert set(result.grads) == set(expected.grads)
    for key, want in expected.grads.items():
        got = result.grads[key].double().cpu()
        scale = max(1e-3, float(want.abs().max()))
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-4 * scale, msg=key)


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_cuda_clipped_sums_equal_the_float64_oracle(name, style, exact_fp32, oracle):
    clipped_sums_against_the_oracle(name, style, oracle, "cuda")


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32-tf32"])
def test_cuda_low_precision_contribution_stays_within_bound(style, dtype):
    """Each record's rounded contribution ≤ c_i: bf16/fp16, and fp32 with TF32 convolutions."""
    torch.manual_seed(0)
    torch.backends.cudnn.allow_tf32 = True
    worst = 0.0
    for _ in range(10):
        model = pdpfast.nn.convert(nn.Sequential(nn.Conv1d(4, 16, 3), nn.Tanh(), nn.Flatten(), nn.Linear(16 * 14, 8))
                                   .cuda().to(dtype))
        x = (torch.randn(1, 4, 16, device="cuda") * 10).to(dtype)
        c = float(torch.rand(()) * 0.5 + 0.01)
        result = clipped_gradients(model, lambda out: out.float().pow(2).sum(1), x,
                                   clip_norms=torch.tensor([c]), **style)
        norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in result.grads.values())))
        worst = max(worst, norm / c)
    assert 0.9 < worst <= 1.0


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_cuda_autocast_bf16_trains_under_budgets(style):
    torch.manual_seed(0)
    n = 64
    x, y = torch.randn(n, 16), torch.randint(0, 4, (n,))
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    budgets = np.where(np.arange(n) % 2 == 0, 1.0, 3.0)
    engine = pdpfast.PrivacyEngine(seed=0)
    kwargs = dict(criterion=nn.CrossEntropyLoss()) if style["mode"] == "ghost" else {}
    out = engine.make_private_with_budgets(module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y),
                                           batch_size=16), budgets=budgets, delta=1e-5, epochs=2, **style, **kwargs)
    model, opt, loader = (out[0], out[1], out[3]) if style["mode"] == "ghost" else out
    criterion = out[2] if style["mode"] == "ghost" else nn.CrossEntropyLoss()
    for xb, yb in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(xb.cuda())
        criterion(logits.float(), yb.cuda()).backward()
        opt.step()
        opt.zero_grad()
    assert engine.steps == len(loader)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert (engine.epsilons() <= budgets).all()


# ---------------------------------------------------------------------------------------------
# The captured step (pdpfast.graphs): replays equal the eager step
# ---------------------------------------------------------------------------------------------

def _graph_run(model_fn, inputs_fn, criterion, *, graph, draws=6, clipping="flat", lr_schedule=False,
               optimizer="sgd", dtype=torch.float32, checkpoint=None, physical_batch_size=4):
    """``draws`` Poisson draws of a model under per-record budgets, physical batches of 4 rows (so
    draws span several of them; 48 makes every draw one batch); eager (forward/backward/step) or
    ``make_step(cuda_graph=True)``."""
    n = 48
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(inputs_fn(g, n), torch.randint(0, 3, (n,), generator=g))
    torch.manual_seed(0)
    model = model_fn().cuda().to(dtype)
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = pdpfast.PrivacyEngine(seed=3)
    model, opt, loader = engine.make_private_with_budgets(
        module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=8, pin_memory=True),
        budgets=np.repeat([1.0, 3.0], n // 2), delta=1e-5, steps=draws + 2, method="hybrid",
        physical_batch_size=physical_batch_size, clipping=clipping)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if lr_schedule else None
    loss_fn = lambda x, y: criterion(model(x), y)  # noqa: E731
    step = engine.make_step(loss_fn, cuda_graph=True) if graph else None
    losses = []
    while opt.steps < draws:
        for x, y in loader:
            if step is not None:
                losses.append(step(x, y))
            else:
                loss = loss_fn(x.cuda(), y.cuda())
                loss.backward()
                losses.append(loss.detach())
                opt.step()
                opt.zero_grad()
            if loader.current.is_last and scheduler is not None:
                scheduler.step()
            if opt.steps == draws and loader.current.is_last:
                break
    return model, engine, torch.stack(losses), step


def _mlp_cuda():
    return nn.Sequential(nn.Linear(6, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 3))


class _MaskedBert(nn.Module):
    """A Hugging Face model given the attention mask of its padding ids (id 0)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, attention_mask=(ids != 0).long())


_GRAPH_MODELS = {
    "mlp": (_mlp_cuda, lambda g, n: torch.randn(n, 6, generator=g), nn.functional.cross_entropy),
    "long-sequence": (_mlp_cuda, lambda g, n: torch.randn(n, 160, 6, generator=g),
                      lambda out, y: nn.functional.cross_entropy(out.mean(1), y)),
    "bert": (lambda: __import__("pdpfast.models", fromlist=["bert"]).bert(
                 "micro", num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
             lambda g, n: torch.randint(1, 128, (n, 12), generator=g),
             lambda out, y: nn.functional.cross_entropy(out.logits, y)),
    # an attention mask of padding ids (none here): transformers checks mask.all() eagerly but skips the
    # check under capture, so the capture builds a mask the warm-up never did (a path only a GPU runs)
    "bert-attention-mask": (lambda: _MaskedBert(__import__("pdpfast.models", fromlist=["bert"]).bert(
                                "micro", num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
                            lambda g, n: torch.randint(1, 128, (n, 12), generator=g),
                            lambda out, y: nn.functional.cross_entropy(out.logits, y)),
    "resnet18-gn": (lambda: __import__("pdpfast.models", fromlist=["resnet18_gn"]).resnet18_gn(num_classes=3),
                    lambda g, n: torch.randn(n, 3, 16, 16, generator=g), nn.functional.cross_entropy),
}


@pytest.fixture
def deterministic_cudnn():
    """cuDNN's non-deterministic weight-gradient algorithms (atomics) make two eager runs of a CNN differ
    by ~1e-4 relative after a dozen steps (ResNet-18-GN on an H100): the comparison pins them."""
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("name", list(_GRAPH_MODELS))
def test_cuda_captured_step_equals_the_eager_step(name, clipping, exact_fp32, deterministic_cudnn):
    """Replayed graphs give the eager step's weights, losses and ledger: same kernels, noise from the
    same (seed, step) through the device-side counter. Tolerance 1e-5 relative (the replay may pick
    other cuBLAS algorithms than the eager warm-up did)."""
    eager_model, eager_engine, eager_losses, _ = _graph_run(*_GRAPH_MODELS[name], graph=False, clipping=clipping)
    model, engine, losses, step = _graph_run(*_GRAPH_MODELS[name], graph=True, clipping=clipping)
    assert step.eager_steps == step.warmup and step._update.body.graph is not None
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(engine.epsilons(), eager_engine.epsilons())


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("name", ["mlp", "bert", "resnet18-gn"])
def test_cuda_captured_whole_step_equals_the_eager_step(name, clipping, exact_fp32, deterministic_cudnn):
    """Draws of one physical batch (every draw here) replay the whole-step graph: forward to
    optimizer step, its gradients made and freed inside it. Same weights, losses and ledger as the
    eager loop, to 1e-5 relative, and no gradient buffer left between steps."""
    eager_model, eager_engine, eager_losses, _ = _graph_run(*_GRAPH_MODELS[name], graph=False, clipping=clipping,
                                                            physical_batch_size=48)
    model, engine, losses, step = _graph_run(*_GRAPH_MODELS[name], graph=True, clipping=clipping,
                                             physical_batch_size=48)
    (signature,) = step._signatures.values()
    assert step.eager_steps == step.warmup and signature._whole.body.graph is not None and step._grads is None
    assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(engine.epsilons(), eager_engine.epsilons())


def test_cuda_captured_whole_step_takes_the_eager_steps_memory():
    """The whole-step graph's peak memory is the eager step's: its gradients live from the backward
    to the step, not through the forward. An MLP whose activations and gradients are of a size
    (five layers of 4096², 320 MB of gradients; 48 rows of 64 tokens) would peak about one
    gradient buffer higher with static gradients. Slack: half of that buffer, for the capture
    stream's cuBLAS workspaces."""
    def peak(cuda_graph: bool) -> int:
        torch.manual_seed(0)
        layers = [nn.Linear(32, 4096)] + [m for _ in range(5) for m in (nn.GELU(), nn.Linear(4096, 4096))]
        model = nn.Sequential(*layers, nn.GELU(), nn.Linear(4096, 3)).cuda()
        data = TensorDataset(torch.randn(48, 64, 32), torch.randint(0, 3, (48,)))
        engine = pdpfast.PrivacyEngine(seed=0)
        model, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, 48),
            noise_multiplier=1.0, max_grad_norm=1.0, physical_batch_size=48)  # every record, every draw
        step = engine.make_step(lambda x, y: nn.functional.cross_entropy(model(x).mean(1), y), cuda_graph=cuda_graph)

        def run(steps):
            for _ in range(steps):
                step(*next(iter(loader)))  # one draw (one physical batch) per pass
        run(step.warmup)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run(3)  # captured: the capture and two replays
        torch.cuda.synchronize()
        assert engine.optimizer.steps == step.warmup + 3
        return torch.cuda.max_memory_allocated() - base

    grad_bytes = 5 * 4096 * 4096 * 4
    eager, captured = peak(False), peak(True)
    assert captured <= eager + grad_bytes // 2, (eager / 2**20, captured / 2**20)


def test_cuda_captured_step_follows_a_learning_rate_schedule_and_adam():
    eager_model, *_ = _graph_run(*_GRAPH_MODELS["mlp"], graph=False, lr_schedule=True, optimizer="adam")
    with pytest.warns(UserWarning, match="captured again"):
        model, *_ = _graph_run(*_GRAPH_MODELS["mlp"], graph=True, lr_schedule=True, optimizer="adam")
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_cuda_captured_step_refuses_adam_without_capturable():
    model = _mlp_cuda().cuda()
    engine = pdpfast.PrivacyEngine(seed=0)
    data = TensorDataset(torch.randn(16, 6), torch.randint(0, 3, (16,)))
    model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.Adam(model.parameters()),
                                             data_loader=DataLoader(data, batch_size=4), noise_multiplier=1.0,
                                             max_grad_norm=1.0, physical_batch_size=4)
    with pytest.raises(ValueError, match="capturable=True"):
        engine.make_step(lambda x, y: nn.functional.cross_entropy(model(x), y))


@pytest.mark.parametrize("kind", ["conv", "linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_rounding_bounds_under_tf32_never_fall_below_the_exact_bound(kind, dtype, monkeypatch):
    """With TF32 allowed for both cuBLAS and cuDNN, a layer's rounding bound ρ (its box sums and its
    row dot run on the GPU in fp32) is never below the float64 bound of the same inputs: TF32_SLACK
    covers the products' rounding (bf16: up to ρ's own fp32 sums). Many records, so that an uncovered
    low rounding would show."""
    from pdpfast.nn.rules import rule_for

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    g = torch.Generator().manual_seed(3)
    if kind == "conv":
        layer = pdpfast.nn.convert(nn.Conv2d(16, 8, 3, padding=1)).to("cuda", dtype)
        x = torch.randn(256, 16, 9, 9, generator=g).mul_(1 + torch.rand(256, 1, 1, 1, generator=g))
        patches = nn.functional.unfold(x.to(dtype).double(), 3, padding=1)
        size = patches.pow(2).sum(1).add_(1)
    else:
        layer = pdpfast.nn.convert(nn.Linear(48, 8)).to("cuda", dtype)
        x = torch.randn(256, 9, 48, generator=g).mul_(1 + torch.rand(256, 1, 1, generator=g))
        size = x.to(dtype).double().pow(2).sum(-1).add_(1)
    x = x.to("cuda", dtype)
    with torch.no_grad():
        shape = layer(x).shape
    o = torch.randn(shape, generator=g).to("cuda", dtype)
    rho = rule_for(layer).norms_and_rounding(layer, x, o, ("weight", "bias"), bound=True)[1]
    o64 = o.double().cpu()
    terms = (o64.flatten(2).norm(dim=1) if kind == "conv" else o64.norm(dim=-1))
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -9
    exact = u * (terms * size.sqrt()).sum(1)
    # bf16 operands take no TF32 rounding (fp32 products of them are exact): there ρ is the float64
    # bound up to the fp32 rounding of its own sums (a few ulps; H200, 2026-11-30: 1 - ρ/exact < 1e-4
    # shown as 1.0000), which the clip bound's fixed margin (``rounding_margin``: 4·2^-8) covers
    low = 1 - 2.0 ** -16 if dtype == torch.bfloat16 else 1.0
    assert rho is not None and (rho.double().cpu() >= low * exact).all(), (rho.double().cpu() / exact).min()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gamma", [None, 0.01])
def test_cuda_clip_weights_op_equals_the_torch_formula(dtype, gamma):
    """The CUDA clip-weight op of pdpfast._C (csrc/clip_cuda.cu) against the five torch ops it
    replaces, special values included; also captured in a CUDA graph."""
    from pdpfast import _ext
    from pdpfast.ops.clip import clip_weights, clip_weights_reference, clip_weights_route

    if _ext.missing("clip_weights", "clip.cpp") is not None or not _ext._C.clip_with_cuda:
        pytest.skip("pdpfast._C was built without CUDA (python setup.py build_ext --inplace on this machine)")
    g = torch.Generator().manual_seed(4)
    sq = torch.exp(torch.randn(3001, generator=g, dtype=torch.float64) * 6).to(dtype)
    sq[:5] = torch.tensor([-1e-7, 0.0, float("nan"), float("inf"), 1e-30], dtype=dtype)
    bounds = (torch.rand(3001, generator=g, dtype=torch.float64) * 3).to(dtype)
    bounds[1::4] = 0.0
    sq, bounds = sq.cuda(), bounds.cuda()
    assert clip_weights_route(sq, bounds) == "C++ kernel"
    for s in (1.0, 7.0):
        got = clip_weights(sq, bounds, None, gamma, s)
        expected = clip_weights_reference(sq, bounds, None, gamma, s)
        torch.testing.assert_close(got, expected, rtol=2 * torch.finfo(dtype).eps, atol=0, equal_nan=True)
        assert torch.equal(got.isnan(), expected.isnan())
    out = torch.empty_like(sq)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(clip_weights(sq, bounds, None, gamma, 3.0))
    graph.replay()
    torch.testing.assert_close(out, clip_weights_reference(sq, bounds, None, gamma, 3.0),
                               rtol=2 * torch.finfo(dtype).eps, atol=0, equal_nan=True)
    # parts=True: (B, K) partial sums, summed by the same thread that computes the weight
    split = torch.rand(3001, 5, generator=g, dtype=torch.float64).to(dtype).cuda() + 0.1
    partial = sq.unsqueeze(1) * split / split.sum(1, keepdim=True)
    assert clip_weights_route(partial, bounds, parts=True) == "C++ kernel"
    got = clip_weights(partial, bounds, None, gamma, 3.0, parts=True)
    expected = clip_weights_reference(partial.sum(1), bounds, None, gamma, 3.0)
    torch.testing.assert_close(got, expected, rtol=10 * torch.finfo(dtype).eps, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cuda_clip_scale_op_equals_the_cpu_op_bit_for_bit(dtype):
    """The CUDA clip-scale op (csrc/clip_cuda.cu: the weights, their cast to x's dtype and the row
    scaling in one kernel) against the CPU op, which equals the weights' formula, the cast and
    torch's product bit for bit (tests/test_clip_weights.py): IEEE square root, division and
    products round alike on both. Rows of several blocks, partial sums of the norms and of ρ, an
    empty batch, and a CUDA graph capture."""
    from pdpfast import _ext
    from pdpfast.ops.clip import PendingWeights, clip_scale, clip_scale_route

    if _ext.missing("clip_scale", "clip.cpp") is not None or not _ext._C.clip_with_cuda:
        pytest.skip("pdpfast._C was built without CUDA (python setup.py build_ext --inplace on this machine)")
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(9)
    for B, row, K in [(0, (5,), 3), (1, (7,), 1), (33, (3, 4096 + 5), 4), (6, (0,), 2)]:
        sq = torch.exp(torch.randn(B, K, generator=g, dtype=torch.float64) * 4).to(acc)
        rho = (torch.rand(B, K, generator=g, dtype=torch.float64) * 0.1).to(acc)
        bounds = (torch.rand(B, generator=g, dtype=torch.float64) * 3).to(acc)
        x = torch.randn(B, *row, generator=g, dtype=torch.float64).mul_(10).to(dtype)
        for gamma, s, r in [(None, 1.0, None), (None, 7.0, rho), (0.01, 2.0, rho)]:
            cpu = clip_scale(x, PendingWeights(sq, bounds, gamma, s, r, True))
            weights = PendingWeights(sq.cuda(), bounds.cuda(), gamma, s, None if r is None else r.cuda(), True)
            assert clip_scale_route(x.cuda(), weights) == "C++ kernel"
            got = clip_scale(x.cuda(), weights)
            assert torch.equal(got[0].cpu(), cpu[0]) and torch.equal(got[1].cpu(), cpu[1])
        if B == 33:  # captured: the op launches on the capture stream and replays the same values
            x_cuda = x.cuda()
            out_x, out_w = torch.empty_like(x_cuda), torch.empty(B, dtype=dtype, device="cuda")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                scaled, w = clip_scale(x_cuda, weights)
                out_x.copy_(scaled), out_w.copy_(w)
            graph.replay()
            assert torch.equal(out_x.cpu(), cpu[0]) and torch.equal(out_w.cpu(), cpu[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_linear_clipped_into_equals_the_python_route_bit_for_bit(dtype):
    """A linear call's clipped sums added into .grad by one C++ call (csrc/linear_sums.cpp) run the
    Python route's cuBLAS and torch ops in its order: the same bits on the GPU too, scaling either
    operand, with weights computed or pending (clip_scale's CUDA kernel inside), into a .grad that
    exists or not."""
    from pdpfast import _ext
    from pdpfast.clipping import ClippingState
    from pdpfast.nn.linear import as_btd
    from pdpfast.ops import linear as lin_ops
    from pdpfast.ops.clip import PendingWeights

    if _ext.missing("linear_clipped_into", "linear_sums.cpp") is not None or not _ext._C.clip_with_cuda:
        pytest.skip("pdpfast._C was built without CUDA (python setup.py build_ext --inplace on this machine)")
    g = torch.Generator().manual_seed(4)
    B, T = 8, 33
    for (d, p), pending, with_grad in itertools.product([(96, 160), (160, 96)], [False, True], [False, True]):
        x = torch.randn(B, T, d, generator=g).to("cuda", dtype)
        o = torch.randn(B * T, p, generator=g).to("cuda", dtype)
        if pending:
            weights = PendingWeights(torch.rand(B, 3, generator=g).cuda(), torch.rand(B, generator=g).cuda() + 0.1,
                                     None, 4.0, torch.rand(B, 3, generator=g).cuda() * 1e-3, True)
        else:
            weights = torch.rand(B, generator=g).cuda()
        made = [nn.Parameter(torch.randn(*shape, generator=g).to("cuda", dtype)) for shape in ((p, d), (p,))]
        for t in made:
            t.grad = torch.randn_like(t) if with_grad else None
        ref = [nn.Parameter(t.detach().clone()) for t in made]
        for r, t in zip(ref, made):
            r.grad = None if t.grad is None else t.grad.clone()
        with torch.no_grad():
            assert lin_ops.linear_clipped_into(x, o, weights, *made)
            a, og = as_btd(x, o)
            for param, grad in zip(ref, lin_ops.linear_clipped_grads(a, og, weights, True, True)):
                ClippingState._accumulate_param(param, grad)
        for t, r in zip(made, ref):
            assert torch.equal(t.grad, r.grad), (d, p, pending, with_grad)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_cuda_eager_steps_of_fixed_shapes_reuse_their_grouped_launch_tables(clipping, monkeypatch):
    """Grouped launches read their calls' offsets, widths and strides from a table built on the host
    and copied to the GPU (``pdpfast.kernels._utils.table_on``), cached by content. torch's caching
    allocator lays a step of fixed shapes out alike every time, so after the first steps no table is
    built: each grouped launch of BERT's calls (linear norms, LayerNorm gradients) and the noise
    launch reuse theirs. (They are slices of one buffer a device: tables allocated one by one stayed in
    the allocator's pool of small blocks and moved this model's small tensors elsewhere every step,
    so that no table repeated: H200, 2026-11-30.)"""
    import pdpfast.clipping as clipping_mod
    import pdpfast.ops.linear as lin_ops
    from pdpfast.clipping import ClippingState
    from pdpfast.kernels import _utils
    from pdpfast.models import bert
    from pdpfast.optimizer import DPOptimizer

    # every call on a full-size model's route (bench_overhead's large_call_route): grouped, not stacked
    monkeypatch.setattr(clipping_mod, "SMALL_CALL_BYTES", 0)
    monkeypatch.setattr(lin_ops, "MATERIALIZE_RATIO", 0)
    monkeypatch.setattr(lin_ops, "MATERIALIZE_MIN_ELEMENTS", 0)
    torch.manual_seed(0)
    model = pdpfast.nn.convert(bert("micro", num_labels=3, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0).cuda())
    state = ClippingState(model, mode="bk", clipping=clipping)
    B = 8
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=B, seed=0)
    ids, y = torch.randint(1, 128, (B, 16), device="cuda"), torch.randint(0, 3, (B,), device="cuda")
    for name, empty in (("TABLE_STATS", {"hits": 0, "builds": 0}), ("_TABLES", {}), ("_ARENAS", {})):
        monkeypatch.setattr(_utils, name, empty)
    builds = []
    with state.attached():
        for _ in range(6):
            state.begin_batch(torch.ones(B, device="cuda"), loss_scale=B)
            nn.functional.cross_entropy(model(input_ids=ids).logits, y).backward()
            opt.step()
            opt.zero_grad()
            builds.append(dict(_utils.TABLE_STATS))
    lookups = builds[0]["builds"] + builds[0]["hits"]  # a step's
    assert lookups > 0 and builds[-1]["builds"] == builds[2]["builds"], builds
    assert builds[-1]["hits"] - builds[2]["hits"] == 3 * lookups, builds  # every table, every step


def test_cuda_allocated_bytes_are_read_through_the_extension_as_torch_counts_them():
    """Where ``pdpfast._C`` was built with CUDA, ``pdpfast.clipping._allocated_bytes`` reads the caching
    allocator's count through it (``csrc/memory.cpp``: no dictionary of every statistic built first):
    the count ``torch.cuda.memory_allocated`` gives, up by a tensor's bytes while it lives."""
    import pdpfast.clipping as clipping_mod
    from pdpfast import _ext

    if _ext.missing("cuda_allocated_bytes", "memory.cpp") or not _ext._C.clip_with_cuda:
        pytest.skip("pdpfast._C was not built with CUDA (bench/gpu.sh builds it in place)")
    device = torch.device("cuda", torch.cuda.current_device())
    assert clipping_mod._CUDA_BYTES is not None
    held = torch.empty(1 << 20, device=device)
    count, nbytes = clipping_mod._allocated_bytes(device), held.nbytes
    assert count == torch.cuda.memory_allocated(device) >= nbytes
    del held
    # (None where the device holds nothing: not counted as room)
    assert (clipping_mod._allocated_bytes(device) or 0) == torch.cuda.memory_allocated(device) == count - nbytes


def test_cuda_per_layer_runs_go_on_within_the_memory_where_the_backward_began(monkeypatch):
    """On a GPU the caching allocator counts every tensor's bytes (``pdpfast.clipping._allocated_bytes``,
    a host-side read): per-layer clipping's runs of projections go on past what its backward has
    passed while the device holds no more than where the backward began. On a 6-block BERT on the
    full-size route the allocator is consulted, the projections take no more norm launches than with
    the passed-bytes bound alone (on the CPU, with the allocator's reads emulated to say the device
    has room: 8 launches a step become 1), and the step's peak is no higher (1% and 1 MiB of slack:
    the allocator's rounding)."""
    import pdpfast.clipping as clipping_mod
    import pdpfast.ops.linear as lin_ops
    from pdpfast.clipping import ClippingState
    from pdpfast.models import bert
    from pdpfast.optimizer import DPOptimizer

    held = torch.empty(1 << 20, device="cuda")
    assert clipping_mod._allocated_bytes(held.device) >= held.numel() * 4
    del held
    for name in ("SMALL_CALL_BYTES", "RUN_FLOOR"):  # every call on a full-size model's route
        monkeypatch.setattr(clipping_mod, name, 0)
    monkeypatch.setattr(lin_ops, "MATERIALIZE_RATIO", 0)
    monkeypatch.setattr(lin_ops, "MATERIALIZE_MIN_ELEMENTS", 0)
    launches, reads = [], []
    grouped, read = lin_ops.linear_sq_norms_grouped, clipping_mod._allocated_bytes
    monkeypatch.setattr(lin_ops, "linear_sq_norms_grouped",
                        lambda calls, *args: (launches.append(len(calls)), grouped(calls, *args))[1])
    B = 32
    # (sequence 32: the norms' Gram path at width 128, on which calls share launches)
    ids, y = torch.randint(1, 128, (B, 32), device="cuda"), torch.randint(0, 3, (B,), device="cuda")

    def second_step(reader):
        monkeypatch.setattr(clipping_mod, "_allocated_bytes", reader)
        torch.manual_seed(0)
        model = pdpfast.nn.convert(bert("tiny", num_labels=3, num_hidden_layers=6, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0).cuda())
        state = ClippingState(model, clipping="per_layer")
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), noise_multiplier=1.0, max_grad_norm=1.0,
                          expected_batch_size=B, seed=0)
        with state.attached():
            for _ in range(2):
                launches.clear()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                state.begin_batch(torch.ones(B, device="cuda"), loss_scale=B)
                nn.functional.cross_entropy(model(input_ids=ids).logits, y).backward()
                opt.step()
                opt.zero_grad()
                torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, list(launches)

    peak_bound, launches_bound = second_step(lambda device: None)
    peak_read, launches_read = second_step(lambda device: (reads.append(device), read(device))[1])
    assert len(reads) > 2, reads  # where each backward began, then past the passed-bytes bound
    # fewer where the backward lets go of more than its runs hold (what bench_e2e and bench_overhead
    # measure on BERT-base and GPT-2); never more
    assert len(launches_read) <= len(launches_bound), (launches_read, launches_bound)
    assert peak_read <= 1.01 * peak_bound + (1 << 20), (peak_read, peak_bound)


def test_cuda_nonprivate_graph_provider_keeps_the_memory_it_replays_into():
    """bench.harness drops each provider's model copy and empties the cache before the next: a
    captured step must hold what its graph writes (else an illegal memory access, seen on an H100)."""
    import gc
    import weakref

    from bench.harness import nonprivate_graph

    model = _mlp_cuda().cuda()
    alive = weakref.ref(model)
    step = nonprivate_graph(model, (torch.randn(8, 6, device="cuda"),), torch.randint(0, 3, (8,), device="cuda"),
                            lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    assert alive() is not None
    step()
    torch.cuda.synchronize()


@pytest.mark.parametrize("graph,nan_draw", [(False, 3), (True, 2), (True, 3)],
                         ids=["eager", "captured-at-capture", "captured-replayed"])
def test_cuda_a_nonfinite_record_is_refused_at_its_draws_step_or_the_next(graph, nan_draw):
    """A GPU's norms reach the host without stopping it (``pdpfast.clipping.DEFERRED_CHECK_DEVICES``):
    a record whose gradient turns NaN is refused at its draw's own step when the copy is there by
    then (eager), else at the next step, which says that the draw's step was applied. Every draw
    holds every record; record 5 turns NaN at ``nan_draw`` (the captured step's warm-up takes draws
    0 and 1, its capture draw 2, whose norms are queued after the replay that follows it)."""
    x, y = torch.randn(8, 6), torch.arange(8) % 3
    torch.manual_seed(0)
    model = _mlp_cuda().cuda()
    engine = pdpfast.PrivacyEngine(seed=0)
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
        sample_rates=1.0, loss_reduction="sum", physical_batch_size=8)
    loss_fn = lambda xb, yb: nn.functional.cross_entropy(model(xb.cuda()), yb.cuda(), reduction="sum")  # noqa: E731
    step = engine.make_step(loss_fn, cuda_graph=True) if graph else None
    refused = None
    for draw in range(6):
        if draw == nan_draw:
            x[5, 2] = float("nan")  # the loader's dataset holds x
        xb, yb = next(iter(loader))
        try:
            if step is not None:
                step(xb, yb)
            else:
                loss_fn(xb, yb).backward()
                opt.step()
                opt.zero_grad()
        except FloatingPointError as exc:
            refused = (draw, str(exc))
            break
    assert refused is not None and refused[0] in (nan_draw, nan_draw + 1), refused
    assert "dataset records [5]" in refused[1]
    assert refused[0] == nan_draw or "after that draw's step was applied" in refused[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_cuda_linear_layers_call_in_cpp_and_the_noise_plan_from_cpp_equal_their_python_routes(clipping, dtype,
                                                                                               monkeypatch):
    """On the GPU too, a linear layer's private forward as one C++ call (``pdpfast._C.linear_call``) and
    the noise launch's plan from C++ (``pdpfast._C.noise_groups``) give the Python routes' bits: the
    per-sample norms, the clipped sums (first layer, hidden layers, Conv1D's transposed weight; 2- and
    3-D inputs) and the noise added to them."""
    from pdpfast.kernels import noise
    from pdpfast.nn import convert, layers

    if layers._LINEAR_CALL is None or noise._NOISE_GROUPS is None:
        pytest.skip("pdpfast._C was built without linear_call or noise_groups (rebuild it on this machine)")
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    g = torch.Generator().manual_seed(6)
    for shape in ((6, 8), (4, 5, 8)):
        torch.manual_seed(6)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), conv1d(12, 16), nn.Tanh(), nn.Linear(12, 3))
        convert(model)
        model = model.to("cuda", dtype)
        x = torch.randn(*shape, generator=g).to("cuda", dtype)
        clip_norms = torch.linspace(0.1, 1.0, shape[0])
        results = {}
        for route in ("C++", "Python"):
            if route == "Python":
                monkeypatch.setattr(layers, "_LINEAR_CALL", None)
                monkeypatch.setattr(noise, "_NOISE_GROUPS", None)
            result = clipped_gradients(model, lambda y: y.float().pow(2).flatten(1).sum(1), x, clip_norms=clip_norms,
                                       clipping=clipping)
            grads = [result.grads[name].clone() for name, _ in model.named_parameters()]
            noise.add_noise_(grads, 0.5, 3, 1)
            results[route] = result.norms, grads
        monkeypatch.undo()
        (norms_cpp, cpp), (norms_py, py) = results["C++"], results["Python"]
        assert torch.equal(norms_cpp, norms_py) and bool((norms_cpp > 0).all())
        assert len(cpp) == 6 and all(torch.equal(a, b) for a, b in zip(cpp, py)), (shape, clipping, dtype)
