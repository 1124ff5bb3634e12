"""Registry: DP module type → its per-sample norm and clipped-gradient rule (STYLE.md).

A rule works on one call of a layer: ``x`` the saved input (the module's own preprocessing
applied, e.g. the padded conv input), ``o`` the gradient of the summed loss w.r.t. the output.
Only ``per_sample_grads`` is required; the other two default to exact formulas on its result,
which is the right choice for layers whose per-sample gradients are as small as their parameters
(the clipping state then forms them once per backward and keeps them, see ``materializes``).
A rule with norm formulas may still ask for that route call by call (``materialize_when``): where
the per-sample gradients are small next to the call's activations, forming them once makes the
clipped sum a B×|W| weighted sum instead of a second GEMM-sized pass.

A rule may also say how same-shape calls are computed together (``Stacked``): book-keeping then
forms the norms and clipped sums of n such calls (BERT's 48 attention projections, say) with one
launch each instead of n, which is most of the host time a private step adds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import torch
from torch import nn

PerSampleGrads = Callable[[nn.Module, torch.Tensor, torch.Tensor], dict]
SqNorms = Callable[[nn.Module, torch.Tensor, torch.Tensor, tuple], torch.Tensor]
ClippedGrads = Callable[[nn.Module, torch.Tensor, torch.Tensor, "torch.Tensor | None", tuple], dict]


Call = tuple  # (module, x, o, names): one call of a layer in a backward


@dataclass(frozen=True)
class Stacked:
    """How same-shape calls of a layer family are computed as one batch of n calls.

    key(module, x, o, names): calls with equal keys stack (None: this call does not). sq_norms(calls)
    → (n, B) squared norms; clipped(calls, weights (B,)) → one {name: grad} per call.
    """

    key: Callable[[nn.Module, torch.Tensor, torch.Tensor, tuple], Hashable | None]
    sq_norms: Callable[[list], torch.Tensor]
    clipped: Callable[[list, torch.Tensor], list]


@dataclass(frozen=True)
class LayerRule:
    per_sample_grads: PerSampleGrads          # (module, x, o) -> {name: (B, *param.shape)}
    sq_norms: SqNorms | None = None            # (module, x, o, names) -> (B,) summed over names, fp32+
    clipped_grads: ClippedGrads | None = None  # (module, x, o, weights (B,) | None, names) -> {name: grad}
    stacked: Stacked | None = None
    # (module, x, o) -> True where this call's per-sample gradients are better formed and kept
    materialize_when: Callable[[nn.Module, torch.Tensor, torch.Tensor], bool] | None = None

    @property
    def materializes(self) -> bool:
        """True when per-sample gradients are the layer's cheapest exact route (no norm rule)."""
        return self.sq_norms is None

    def materializes_call(self, module, x, o) -> bool:
        """Whether this call's per-sample gradients are formed (then norms and clipped sums come
        from them) rather than its norms and clipped sums computed without them."""
        return self.sq_norms is None or (self.materialize_when is not None and self.materialize_when(module, x, o))

    def norms(self, module, x, o, names) -> torch.Tensor:
        """(B,) per-sample squared gradient norm summed over the parameters ``names``."""
        if self.sq_norms is not None:
            return self.sq_norms(module, x, o, names)
        grads = self.per_sample_grads(module, x, o)
        return sq_norms_of([grads[n] for n in names])

    def clipped(self, module, x, o, weights, names) -> dict:
        if self.clipped_grads is not None:
            return self.clipped_grads(module, x, o, weights, names)
        grads = self.per_sample_grads(module, x, o)
        if weights is None:
            return {n: grads[n].sum(0) for n in names}
        return {n: weighted_sum(weights, grads[n]) for n in names}


def sq_norms_of(per_sample: list[torch.Tensor]) -> torch.Tensor:
    """(B,) Σ over tensors of ‖g_i‖², each (B, ...), accumulated in fp32 (fp64 kept)."""
    total = None
    for g in per_sample:
        # one read of g, no temporary of its size (g.pow(2) would allocate and fault in one);
        # the root is squared back to within a few ulps, as exact as summing the squares
        dtype = g.dtype if g.dtype in (torch.float32, torch.float64) else torch.float32
        sq = torch.linalg.vector_norm(g if g.dim() == 2 else g.flatten(1), dim=1, dtype=dtype).square_()
        total = sq if total is None else total.add_(sq)
    return total


def weighted_sum(weights: torch.Tensor, per_sample: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i g_i: weights (B,), per_sample (B, ...) → (...), in the per-sample gradients' dtype."""
    w = weights if weights.dtype == per_sample.dtype else weights.to(per_sample.dtype)
    if per_sample.dim() == 2:
        return w @ per_sample
    return (w @ per_sample.flatten(1)).view(per_sample.shape[1:])


_RULES: dict[type, LayerRule] = {}


def register_rule(*types: type, rule: LayerRule, replace: bool = False) -> None:
    """Register ``rule`` for DP module classes ``types`` (subclasses inherit it through the MRO)."""
    for t in types:
        if t in _RULES and not replace:
            raise ValueError(f"a rule for {t.__name__} is already registered; pass replace=True")
        _RULES[t] = rule


def rule_for(module: nn.Module) -> LayerRule | None:
    for cls in type(module).__mro__:
        if cls in _RULES:
            return _RULES[cls]
    return None
