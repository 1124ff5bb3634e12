"""Shared fixtures: a float64 oracle of individualized clipping (DESIGN.md §1.3, STYLE.md "Tests").

The oracle never touches pdpfast's clipping code. Per-sample gradients come from ``torch.func``
(``vmap(grad(...))`` over ``functional_call``) or from micro-batching (one ``.backward()`` per
sample), on a plain torch model or on a converted one used outside a private batch (then each DP
layer is exactly its torch layer). Norms, clip weights and clipped sums are then formed from the
materialized per-sample gradients, straight from the formulas of DESIGN.md §1.3.

A test case is (model, inputs, targets, loss): ``model(*inputs)`` is batch-first and
``loss(outputs, *targets)`` returns per-sample losses (B,); every input and target has the batch
as its first dim, so sample i's case is the slices ``[i:i+1]``.
"""
from __future__ import annotations

import math
import warnings
import zlib
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import pdpfast.functional

CLIP_EPS = 1e-6  # DESIGN.md §1.3: w_i = m_i · min(1, c_i / (‖g_i‖ + 1e-6))


@pytest.fixture(autouse=True)
def _seeded(request):
    """Fresh random inputs per test, reproducible from the test's id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@dataclass
class Group:
    """A clipping group: one DP layer, or several that share a parameter (tied weights)."""

    name: str                 # the first of its modules in ``model.named_modules()`` order
    module_names: list[str]
    param_names: list[str]    # canonical names (as ``model.named_parameters()`` gives them)


@dataclass
class Expected:
    norms: torch.Tensor                  # (B,) total per-sample norms before clipping
    grads: dict[str, torch.Tensor]       # {name: Σ_i w_i g_i}
    weights: torch.Tensor | None         # (B,) flat clip weights; None for per-layer clipping
    group_norms: dict[str, torch.Tensor] | None = None  # per-layer: {group name: (B,)}


class Oracle:
    CLIP_EPS = CLIP_EPS

    # -------------------------------------------------------------- per-sample gradients

    @staticmethod
    def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
        return {n: p for n, p in model.named_parameters() if p.requires_grad}

    def per_sample_grads(self, model, loss, inputs, targets=(), method: str = "vmap") -> dict[str, torch.Tensor]:
        """{name: (B, *param.shape)} per-sample gradients of ``loss`` for every trainable parameter."""
        inputs, targets = tuple(inputs), tuple(targets)
        B = inputs[0].shape[0]
        if any(isinstance(m, nn.RNNBase) for m in model.modules()):
            method = "loop"  # vmap cannot batch torch's recurrent kernels
        if method == "loop" or B == 0:
            return self._per_sample_loop(model, loss, inputs, targets)
        if method != "vmap":
            raise ValueError(method)
        trainable = {n: p.detach() for n, p in self.trainable(model).items()}
        fixed = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
        fixed.update(dict(model.named_buffers()))

        def sample_loss(params, sample_inputs, sample_targets):
            outputs = functional_call(model, {**params, **fixed}, tuple(t.unsqueeze(0) for t in sample_inputs))
            losses = loss(outputs, *(t.unsqueeze(0) for t in sample_targets))
            assert losses.shape == (1,), losses.shape
            return losses.sum()

        with warnings.catch_warnings():  # ops vmap runs one sample at a time (attention, bags): slower, exact
            warnings.filterwarnings("ignore", message="There is a performance drop", category=UserWarning)
            return vmap(grad(sample_loss), in_dims=(None, 0, 0))(trainable, inputs, targets)

    def _per_sample_loop(self, model, loss, inputs, targets):
        """Micro-batching: batches of one sample, one ordinary backward each."""
        params = self.trainable(model)
        B = inputs[0].shape[0]
        out = {n: torch.zeros(B, *p.shape, dtype=p.dtype) for n, p in params.items()}
        saved = {n: p.grad for n, p in params.items()}
        try:
            for i in range(B):
                for p in params.values():
                    p.grad = None
                losses = loss(model(*(t[i:i + 1] for t in inputs)), *(t[i:i + 1] for t in targets))
                assert losses.shape == (1,), losses.shape
                losses.sum().backward()
                for n, p in params.items():
                    if p.grad is not None:
                        out[n][i] = p.grad
        finally:
            for n, p in params.items():
                p.grad = saved[n]
        return out

    # -------------------------------------------------------------- clipping groups

    def groups(self, model: nn.Module) -> list[Group]:
        """One group per module with trainable parameters of its own; modules sharing one merged."""
        canonical = {}
        for name, p in model.named_parameters():
            canonical.setdefault(p, name)
        groups: list[tuple[list[str], set]] = []  # (module names, parameter set), model order kept
        for name, m in model.named_modules():
            own = {p for p in m.parameters(recurse=False) if p.requires_grad}
            if not own:
                continue
            touching = [g for g in groups if g[1] & own]
            merged = ([name], set(own))
            for g in touching:
                merged = (g[0] + merged[0], g[1] | merged[1])
                groups.remove(g)
            groups.append(merged)
        order = [name for name, _ in model.named_modules()]
        result = []
        for module_names, params in groups:
            module_names = sorted(module_names, key=order.index)
            param_names = sorted((canonical[p] for p in params), key=list(canonical.values()).index)
            result.append(Group(module_names[0] or "<model>", module_names, param_names))
        return sorted(result, key=lambda g: order.index(g.module_names[0]))

    # -------------------------------------------------------------- expected results

    @staticmethod
    def _weights(norms, bounds, mask, automatic_gamma):
        if automatic_gamma is None:
            w = torch.clamp(bounds / (norms + CLIP_EPS), max=1.0)
        else:
            w = bounds / (norms + automatic_gamma)
        return w if mask is None else w * mask

    def expected(self, model, per_sample, clip_norms, mask=None, clipping="flat", automatic_gamma=None,
                 layer_shares=None) -> Expected:
        sq = {n: g.flatten(1).pow(2).sum(1) for n, g in per_sample.items()}
        B = next(iter(per_sample.values())).shape[0]
        c = torch.as_tensor(clip_norms, dtype=torch.float64)
        m = None if mask is None else torch.as_tensor(mask, dtype=torch.float64)
        norms = sum(sq.values(), torch.zeros(B, dtype=torch.float64)).sqrt()
        if clipping == "flat":
            w = self._weights(norms, c, m, automatic_gamma)
            grads = {n: torch.tensordot(w.to(g.dtype), g, dims=1) for n, g in per_sample.items()}
            return Expected(norms, grads, w)
        assert clipping == "per_layer"
        groups = self.groups(model)
        shares = self.shares(groups, layer_shares)
        grads, group_norms = {}, {}
        for group, share in zip(groups, shares):
            n_k = sum((sq[n] for n in group.param_names), torch.zeros(B, dtype=torch.float64)).sqrt()
            w_k = self._weights(n_k, c * share, m, automatic_gamma)
            group_norms[group.name] = n_k
            for n in group.param_names:
                grads[n] = torch.tensordot(w_k.to(per_sample[n].dtype), per_sample[n], dims=1)
        assert set(grads) == set(per_sample)
        return Expected(norms, grads, None, group_norms)

    @staticmethod
    def shares(groups: list[Group], layer_shares) -> list[float]:
        K = len(groups)
        if layer_shares is None:
            return [1.0 / math.sqrt(K)] * K
        if isinstance(layer_shares, dict):
            out = [None] * K
            for module_name, share in layer_shares.items():
                (k,) = [k for k, g in enumerate(groups) if module_name in g.module_names]
                out[k] = float(share)
            assert None not in out
            return out
        return [float(s) for s in layer_shares]

    # -------------------------------------------------------------- random bounds and masks

    @staticmethod
    def bounds(norms: torch.Tensor, clipped: torch.Tensor | None = None) -> torch.Tensor:
        """Per-sample bounds around the samples' own norms: samples in ``clipped`` (a (B,) bool, by
        default a random non-empty proper subset when B ≥ 2) get c_i ∈ [0.3, 0.9]·‖g_i‖, the others
        c_i ∈ [1.1, 3]·‖g_i‖; no sample sits near the clipping threshold, and the bounds lie around
        the batch's own norms (so around their median), as individualized bounds do in practice."""
        B = norms.shape[0]
        if clipped is None:
            clipped = Oracle.random_subset(B)
        low = 0.3 + 0.6 * torch.rand(B, dtype=torch.float64)
        high = 1.1 + 1.9 * torch.rand(B, dtype=torch.float64)
        factor = torch.where(clipped, low, high)
        median = float(norms.median()) if B else 0.0
        base = norms.clamp_min(1e-3 * median if median > 0 else 1.0)  # (a batch of zero gradients: bounds ~1)
        return base * factor

    @staticmethod
    def random_subset(B: int) -> torch.Tensor:
        """A random (B,) bool with at least one True and one False when B ≥ 2."""
        if B < 2:
            return torch.rand(B) < 0.5
        k = int(torch.randint(1, B, ()))
        out = torch.zeros(B, dtype=torch.bool)
        out[torch.randperm(B)[:k]] = True
        return out

    @staticmethod
    def random_mask(B: int) -> torch.Tensor:
        """A random 0/1 float mask with both values present when B ≥ 2."""
        return Oracle.random_subset(B).double()

    # -------------------------------------------------------------- run and compare

    @staticmethod
    def run(model, loss, inputs, targets=(), **kwargs):
        return pdpfast.functional.clipped_gradients(model, lambda outputs: loss(outputs, *targets), *inputs,
                                                    **kwargs)

    @staticmethod
    def assert_close(actual, expected, what=""):
        """float64 comparison, tolerance relative to the expected tensor's scale."""
        assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
        scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
        torch.testing.assert_close(actual.double(), expected.double(), rtol=1e-9, atol=1e-10 * scale,
                                   msg=lambda m: f"{what}: {m}")

    def assert_matches(self, result, expected: Expected):
        assert set(result.grads) == set(expected.grads), (sorted(result.grads), sorted(expected.grads))
        self.assert_close(result.norms, expected.norms, "norms")
        for name, g in expected.grads.items():
            self.assert_close(result.grads[name], g, f"grad of {name}")
        if expected.weights is not None:  # flat clipping reports its clip weights
            assert result.weights is not None
            self.assert_close(result.weights, expected.weights, "weights")

    def check(self, model, loss, inputs, targets=(), *, reference=None, method="vmap", clip_norms=None,
              mask="random", **kwargs):
        """Run ``clipped_gradients`` on ``model`` and compare with the oracle on ``reference`` (default:
        the same, converted, model outside a private batch). Returns (result, expected)."""
        reference = model if reference is None else reference
        per_sample = self.per_sample_grads(reference, loss, inputs, targets, method)
        B = inputs[0].shape[0]
        if clip_norms is None:
            clip_norms = self.bounds(self.expected(reference, per_sample, torch.ones(B)).norms)
        if isinstance(mask, str):
            mask = self.random_mask(B)
        kwargs_oracle = {k: kwargs[k] for k in ("clipping", "automatic_gamma", "layer_shares") if k in kwargs}
        expected = self.expected(reference, per_sample, clip_norms, mask, **kwargs_oracle)
        result = self.run(model, loss, inputs, targets, clip_norms=clip_norms, mask=mask, **kwargs)
        self.assert_matches(result, expected)
        return result, expected

    def check_one(self, model, loss, inputs, targets=(), *, clipped: bool, reference=None, method="vmap",
                  **kwargs):
        """``check`` on the case's first sample alone (the slices ``[:1]``), unmasked, its bound below
        its norm (``clipped``) or above it. Returns (result, expected)."""
        inputs, targets = tuple(t[:1] for t in inputs), tuple(t[:1] for t in targets)
        per_sample = self.per_sample_grads(model if reference is None else reference, loss, inputs, targets, method)
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values()))
        return self.check(model, loss, inputs, targets, reference=reference, method=method, mask=None,
                          clip_norms=self.bounds(norms, torch.tensor([clipped])), **kwargs)

    def check_empty(self, model, loss, inputs, targets=(), **kwargs):
        """The case with no sample (the slices ``[:0]``): norms of shape (0,), and a gradient for every
        trainable parameter, of its shape and all zero. Returns the result."""
        inputs, targets = tuple(t[:0] for t in inputs), tuple(t[:0] for t in targets)
        result = self.run(model, loss, inputs, targets, clip_norms=torch.ones(0), mask=torch.ones(0), **kwargs)
        assert result.norms.shape == (0,)
        trainable = self.trainable(model)
        assert set(result.grads) == set(trainable), (sorted(result.grads), sorted(trainable))
        for name, p in trainable.items():
            assert result.grads[name].shape == p.shape, name
            assert not result.grads[name].any(), name
        return result


@pytest.fixture(scope="session")
def oracle() -> Oracle:
    return Oracle()


_STYLES = {
    "bk-flat": dict(mode="bk", clipping="flat"),
    "ghost-flat": dict(mode="ghost", clipping="flat"),
    "bk-automatic": dict(mode="bk", clipping="flat", automatic_gamma=0.05),
    "ghost-automatic": dict(mode="ghost", clipping="flat", automatic_gamma=0.05),
    "per_layer": dict(mode="bk", clipping="per_layer"),
    "per_layer-automatic": dict(mode="bk", clipping="per_layer", automatic_gamma=0.05),
}


@pytest.fixture(params=list(_STYLES))
def style(request) -> dict:
    """Every (mode, clipping, automatic clipping) combination, as keyword arguments."""
    return dict(_STYLES[request.param])



@pytest.fixture
def full_size_calls(monkeypatch):
    """Every layer call on the route a full-size model's calls take on a GPU: computed on its own
    (small same-shape calls otherwise stack) and without forming per-sample gradients, as
    ``bench_overhead --route large`` runs them."""
    import pdpfast.clipping
    import pdpfast.ops.linear

    monkeypatch.setattr(pdpfast.clipping, "SMALL_CALL_BYTES", 0)
    for name in ("MATERIALIZE_RATIO", "MATERIALIZE_MIN_ELEMENTS"):
        monkeypatch.setattr(pdpfast.ops.linear, name, 0)


@pytest.fixture
def exact_fp32():
    """No TF32 while the test runs: cuDNN's default TF32 convolutions (and, on a GPU, the kernels that
    follow them) round fp32 operands, and the state then keeps a 0.4% margin on the bounds; oracle
    comparisons run without it."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
