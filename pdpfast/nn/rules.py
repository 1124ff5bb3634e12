"""The layer registry: torch layer → its DP class → its per-sample rule, one call per family.

A layer family lives in one file under ``pdpfast/nn/`` (``linear.py``, ``conv.py``, ...): its DP
classes, its rule, and one ``register_layer(torch_classes, dp_class, rule)``. ``convert`` swaps
the registered torch classes and their subclasses for the DP class (a subclass with its own
forward keeps it, and its ``super().forward`` is the private forward); the clipping state finds the
rule through the DP class's MRO.

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

A rule with norm formulas says how its clipped sum rounds (``rounding``). Where the sum scales
each of a per-sample gradient's terms before adding them (positions of a sequence, pixels) in a
low precision, each w_i·o_t is rounded relative to its own size, not to the sum's: a record whose
terms cancel would exceed its bound by far more than a relative margin covers. ``rounding`` bounds
that error per record, and the clipping state clips to c_i with it included. A rule that gives no
``rounding`` forms its per-sample gradients in a low precision instead (``low_precision``).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch import nn

from ..ops.linear import tf32_allowed, weights_as
from .layers import DPModule

PerSampleGrads = Callable[[nn.Module, torch.Tensor, torch.Tensor], dict]
SqNorms = Callable[[nn.Module, torch.Tensor, torch.Tensor, tuple], torch.Tensor]
ClippedGrads = Callable[[nn.Module, torch.Tensor, torch.Tensor, "torch.Tensor | None", tuple], dict]


Call = tuple  # (module, x, o, names): one call of a layer in a backward
Rounding = Callable[[nn.Module, torch.Tensor, torch.Tensor, tuple], "torch.Tensor | None"]

# Unit roundoff of a clipped sum's row scaling w_i·o_t (round to nearest), by its dtype.
_SCALING_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# fp32 through TF32 tensor cores: both operands of each product lose all but 10 mantissa bits
# (truncated: 2^-10 relative each), the scaled one and the other.
_TF32_ROUNDOFF = 2.0 ** -9


def scaling_roundoff(t: torch.Tensor, kind: str) -> float:
    """u such that a clipped sum Σ_t round(w·o_t)·a_tᵀ computed like ``t`` is within u·w·Σ_t ‖o_t‖‖a_t‖
    of w·Σ_t o_t a_tᵀ (each scaled term rounded relative to its own size).

    Args:
        t: a tensor of the sum's dtype and device.
        kind: the sum's products: "matmul" (a GEMM on cuBLAS) or "conv" (a convolution's weight
            gradient on cuDNN), whose TF32 setting decides for CUDA fp32 (``tf32_allowed``).
    Returns:
        2^-8 for bf16, 2^-11 for fp16, 2^-9 for CUDA fp32 with ``tf32``, else 0.0 (fp32 and fp64
        round at 2^-24 or finer: the fixed margin covers them).
    """
    if t.dtype == torch.float32 and t.is_cuda and tf32_allowed(kind):
        return _TF32_ROUNDOFF
    return _SCALING_ROUNDOFF.get(t.dtype, 0.0)


def low_precision(t: torch.Tensor) -> bool:
    """Whether clipped sums computed like ``t`` round by more than fp32.

    Args:
        t: a tensor of the sum's dtype and device.
    Returns:
        True for bf16 and fp16, and for CUDA fp32 where torch allows TF32 (for GEMMs or convolutions).
    """
    if t.dtype == torch.float32 and t.is_cuda:
        return tf32_allowed("matmul") or tf32_allowed("conv")
    return t.dtype in _SCALING_ROUNDOFF


def exact_scaling(module, x, o, names) -> None:
    """The ``rounding`` of a rule whose clipped sums weigh formed per-sample gradients (Σ_i w_i g_i,
    each w_i g_i rounded relative to g_i) or scale in the accumulation dtype.

    Args:
        module, x, o, names: the call (not read).
    Returns:
        None: nothing beyond the fixed relative margin.
    """
    return None


@dataclass(frozen=True)
class Stacked:
    """How same-shape calls of a layer family are computed as one batch of n calls.

    A call is (module, x, o, names) as a rule sees it (see the module docstring).

    Args:
        key: ``key(module, x, o, names)`` → a hashable key; calls with equal keys stack (None: this
            call does not stack).
        sq_norms: ``sq_norms(calls)`` for n calls of one key → (n, B) per-sample squared gradient norms
            of each call (summed over its ``names``), fp32 (fp64 for fp64 calls).
        clipped: ``clipped(calls, weights)`` with weights (B,) shared by the calls (flat clipping) or
            (n, B), one row per call (per-layer clipping) → a list of n {parameter name: Σ_i w_i g_i}
            dicts, each gradient of its parameter's shape.
        rounding: ``rounding(calls)`` → (n, B) the calls' ``LayerRule.rounding`` bounds, or None
            where they add nothing. Where a stack of a rule with norm formulas has none, its calls do
            not stack in a low precision (each goes through the rule's own ``rounding``).
        sq_norms_rounding: ``sq_norms_rounding(calls)`` → (``sq_norms(calls)``, ``rounding(calls)``)
            from one pass over the stacked calls, or None: the two apart.
    """

    key: Callable[[nn.Module, torch.Tensor, torch.Tensor, tuple], Hashable | None]
    sq_norms: Callable[[list], torch.Tensor]
    clipped: Callable[[list, torch.Tensor], list]
    rounding: Callable[[list], torch.Tensor | None] | None = None
    sq_norms_rounding: Callable[[list], tuple] | None = None

    def norms_and_rounding(self, calls: list, bound: bool) -> tuple:
        """(n, B) squared norms of a chunk of stacked calls, and their (n, B) ρ or None.

        Args:
            calls: calls of one key; bound: whether their clipped sums need the rounding bound.
        Returns:
            (sq, rho): rho None where not ``bound``, or where the stack has no ``rounding``.
        """
        if not bound or self.rounding is None:
            return self.sq_norms(calls), None
        if self.sq_norms_rounding is not None:
            return self.sq_norms_rounding(calls)
        return self.sq_norms(calls), self.rounding(calls)


@dataclass(frozen=True)
class Grouped:
    """How large calls of a layer family compute their norms (or, for a family whose per-sample
    gradients are formed, those) together, in one launch and without copying them: the host issues
    one launch where it issued one per call. Book-keeping holds every norm call's input and output
    gradient to the end of the backward anyway; calls whose gradients are formed are held within a
    bound (``pdpfast.clipping.RUN_BYTES``).

    A call is (module, x, o, names) as a rule sees it (see the module docstring). A rule with norm
    formulas gives ``norms_and_rounding``; one whose per-sample gradients are formed
    (``LayerRule.materializes``) gives ``per_sample_grads``.

    Args:
        key: ``key(module, x, o, names)`` → a hashable key, or None where this call does not group
            (calls with equal keys must share shapes, strides, dtype and device: x is in o's dtype
            by then, ``ClippingState.on_backward``). It may read the module's configuration, the
            kernels' dispatch and whether x and o start on 16-byte boundaries, but no values: the
            engine keeps a layer's key per layout (``ClippingState._route``), so the grouped
            functions must check that the calls' modules still agree where they read one module's
            configuration for all.
        norms_and_rounding: ``norms_and_rounding(calls, bound)`` for n ≥ 2 calls of one key → (sq,
            rho), each (n, B, K) (or a list of n per-call tensors): row c call c's per-sample squared
            norms and its ``LayerRule.rounding`` bound as (B, K) partial sums (``LayerRule.norm_parts``;
            ρ may instead be (B,), as ``LayerRule.norms_and_rounding`` gives it); rho None where not
            ``bound`` or where they add nothing.
        per_sample_grads: ``per_sample_grads(calls)`` for n ≥ 2 calls of one key → a list of n
            {name: (B, *param.shape)}, call c's what ``LayerRule.per_sample_grads`` gives it.
        clipped_into: ``clipped_into(calls, weights)`` for n ≥ 1 calls of one key and their clip
            weights (n of them, all (B,) tensors or all ``PendingWeights`` computed alike: of one
            launch's norms, in one dtype) → True where it added every call's clipped sums into its
            parameters' ``.grad`` as ``LayerRule.clipped_into`` would, False where it did nothing
            (each call then takes its own route). What it saves is the host's: the calls' routes
            are checked once, and no Python runs between their ops.
    """

    key: Callable[[nn.Module, torch.Tensor, torch.Tensor, tuple], Hashable | None]
    norms_and_rounding: Callable[[list, bool], tuple] | None = None
    per_sample_grads: Callable[[list], list] | None = None
    clipped_into: Callable[[list, list], bool] | None = None


@dataclass(frozen=True)
class LayerRule:
    """The per-sample gradient math of a layer family; a rule works on one call (module, x, o).

    x is the call's saved input, (B, ...) (the module's ``_prepare`` applied), or a tuple of tensors
    sharing dim 0; o is the gradient of the summed loss w.r.t. the call's output (e.g. (B·T, p) for
    a linear layer). ``names`` are the trainable parameter names the call reached.

    Args:
        per_sample_grads: ``(module, x, o)`` → {name: (B, *param.shape)} per-sample gradients (a dict,
            or any object indexed by name: only the names asked for are read). Required.
        sq_norms: ``(module, x, o, names)`` → (B,) per-sample squared gradient norms summed over
            ``names``, fp32 or wider; None: from ``per_sample_grads``.
        clipped_grads: ``(module, x, o, weights, names)`` → {name: Σ_i w_i g_i, of the parameter's
            shape} for weights (B,), or Σ_i g_i for weights None; None: from ``per_sample_grads``.
        stacked: how same-shape calls compute together (``Stacked``), or None.
        materialize_when: ``(module, x, o, kept)`` → True where this call's per-sample gradients are
            better formed (see the module docstring), ``kept`` saying whether they would be kept until
            every layer's norms are known (flat clipping) or clipped and freed at once (per-layer
            clipping); or None (never, when ``sq_norms`` is given).
        add_per_sample_grads: ``(module, x, o, names, into)`` adds this call's per-sample gradients of
            ``names`` into ``into[name]`` ((B, *param.shape), of ``o``'s dtype) in place, for a
            parameter used more than once (tied weights) whose gradients of an earlier use are held;
            None: they are formed with ``per_sample_grads`` and added. Worth giving where the
            gradients are sparse (an embedding's B×V×d touch only the sample's tokens' rows).
        rounding: ``(module, x, o, names)`` → (B,) ρ_i ≥ 0 with ‖computed clipped sum of record i −
            w_i g_i‖ ≤ w_i ρ_i beyond the fixed relative margin (e.g. u·Σ_t ‖o_t‖‖a_t‖ for a sum
            that rounds each scaled w_i·o_t, ``scaling_roundoff``), or None where the call adds
            nothing (``exact_scaling``). The clipping state clips ‖g_i‖ + ρ_i to c_i (ρ of different
            parameters add in quadrature: their errors lie in different coordinates). None (no
            function) with ``sq_norms`` given: in a low precision the calls form per-sample
            gradients instead, whose weighted sums round relative to g_i.
        sq_norms_rounding: ``(module, x, o, names)`` → (``sq_norms(...)``, ``rounding(...)``) from one
            pass where that is cheaper than two (the linear norm kernel reads the row norms of ρ off
            its Grams' diagonals); None: the two apart. Given only with both of them.
        norm_parts: ``sq_norms`` and ``sq_norms_rounding`` take a keyword ``parts``: when True the
            caller sums the rows of the squared norms itself, and they may return (B, K) partial
            sums (the norm kernel's per-program sums) instead of (B,): book-keeping sums every
            layer's once per backward, not once per call. ``sq_norms_rounding`` may return ρ as
            (B, K') partial sums too. Needs ``sq_norms``, and ``sq_norms_rounding`` where
            ``rounding`` is given.
        pending_weights: ``clipped_grads`` also takes its weights as ``pdpfast.ops.clip.PendingWeights``
            (the norms and bounds they come from) and computes them in the op that applies them
            (``pdpfast.ops.clip.clip_scale``): per-layer clipping then hands a call its weights
            uncomputed, one op where three ran.
        grouped: how calls computed on their own (too large to stack) compute their norms, or their
            per-sample gradients, together (``Grouped``): norms of all calls of one key at the end of
            the backward in flat clipping, of consecutive ones in per-layer clipping; per-sample
            gradients of the calls held within a bound (``pdpfast.clipping.RUN_BYTES``) in both; or None.
        clipped_into: ``(module, x, o, weights, names)`` → True after adding ``clipped_grads``' sums
            into the parameters' ``.grad`` itself, as the clipping state adds them (cast to the
            parameter's dtype, set where it has none), e.g. in one call of compiled code where the
            Python around the ops is most of a call's host time; False where it did nothing (the
            state then runs ``clipped_grads``). Only for weights (B,) or ``PendingWeights``; None: never.
    """

    per_sample_grads: PerSampleGrads          # (module, x, o) -> {name: (B, *param.shape)}
    sq_norms: SqNorms | None = None            # (module, x, o, names) -> (B,) summed over names, fp32+
    clipped_grads: ClippedGrads | None = None  # (module, x, o, weights (B,) | None, names) -> {name: grad}
    stacked: Stacked | None = None
    # (module, x, o, kept) -> True where this call's per-sample gradients are better formed
    materialize_when: Callable[[nn.Module, torch.Tensor, torch.Tensor, bool], bool] | None = None
    # (module, x, o, names, into {name: (B, *param.shape)}) -> None: this call's gradients added in place
    add_per_sample_grads: Callable[[nn.Module, torch.Tensor, torch.Tensor, tuple, dict], None] | None = None
    rounding: Rounding | None = None
    sq_norms_rounding: Callable[[nn.Module, torch.Tensor, torch.Tensor, tuple], tuple] | None = None
    norm_parts: bool = False
    pending_weights: bool = False
    grouped: Grouped | None = None
    # (module, x, o, weights, names) -> whether it added the clipped sums into the parameters' .grad
    clipped_into: Callable[[nn.Module, torch.Tensor, torch.Tensor, object, tuple], bool] | None = None

    def __post_init__(self):
        missing_rounding = self.rounding is not None and self.sq_norms_rounding is None
        if self.norm_parts and (self.sq_norms is None or missing_rounding):
            raise ValueError("norm_parts=True needs sq_norms, and sq_norms_rounding where rounding is given "
                             "(both take the keyword parts)")
        if self.pending_weights and self.clipped_grads is None:
            raise ValueError("pending_weights=True needs clipped_grads (which takes PendingWeights)")

    @property
    def materializes(self) -> bool:
        """True when per-sample gradients are the layer's cheapest exact route (no norm rule)."""
        return self.sq_norms is None

    def materializes_call(self, module, x, o, kept: bool = True) -> bool:
        """Whether this call's per-sample gradients are formed (then norms and clipped sums come
        from them) rather than its norms and clipped sums computed without them.

        Args:
            module: the DP layer; x: the call's input, (B, ...); o: its output gradient;
            kept: they would be kept until every layer's norms are known (flat clipping); False:
                clipped and freed at once (per-layer clipping).
        Returns:
            True when the rule has no norm formula, when it has no ``rounding`` and ``o`` is of a low
            precision (``low_precision``), or when ``materialize_when`` says so for this call.
        """
        return self.sq_norms is None or (self.rounding is None and low_precision(o)) or (
            self.materialize_when is not None and self.materialize_when(module, x, o, kept))

    def norms_and_rounding(self, module, x, o, names, bound: bool, parts: bool = False) -> tuple:
        """A call's per-sample squared norms (``norms``) and, where ``bound``, its rounding bound ρ
        (see ``rounding``), from one pass where the rule has one (``sq_norms_rounding``).

        Args:
            module, x, o, names: the call, as in ``norms``.
            bound: whether the call's clipped sum needs ρ (it rounds more coarsely than the fixed
                margin covers).
            parts: the caller sums the squared norms' rows itself (``norm_parts``).
        Returns:
            (sq, rho): (B,) squared norms, or (B, K) partial sums with ``parts`` where the rule gives
            them; (B,) ρ fp32 (fp64 for fp64 calls) (or (B, K') partial sums, likewise), or None
            where not ``bound``, where the rule has no ``rounding`` or where the call adds nothing.
        """
        if parts and self.norm_parts:
            if not bound or self.rounding is None:
                return self.sq_norms(module, x, o, names, parts=True), None
            return self.sq_norms_rounding(module, x, o, names, parts=True)
        if not bound or self.rounding is None:
            return self.norms(module, x, o, names), None
        if self.sq_norms_rounding is not None:
            return self.sq_norms_rounding(module, x, o, names)
        return self.norms(module, x, o, names), self.rounding(module, x, o, names)

    def norms(self, module, x, o, names) -> torch.Tensor:
        """Per-sample squared gradient norms ‖g_i‖² of one call, summed over the parameters ``names``.

        Args:
            module: the DP layer; x: the call's input, (B, ...); o: its output gradient;
            names: a tuple of the parameter names to include.
        Returns:
            (B,) squared norms, fp32 (fp64 for fp64 gradients), from ``sq_norms`` or else from the
            materialized per-sample gradients.
        """
        if self.sq_norms is not None:
            return self.sq_norms(module, x, o, names)
        grads = self.per_sample_grads(module, x, o)
        return sq_norms_of([grads[n] for n in names])

    def clipped(self, module, x, o, weights, names) -> dict:
        """The weighted sum Σ_i w_i g_i of one call's per-sample gradients.

        Args:
            module: the DP layer; x: the call's input, (B, ...); o: its output gradient;
            weights: (B,) clip weights w_i, or None for the plain sum Σ_i g_i (the loss was already
                weighted, as in ghost clipping's second backward); names: a tuple of parameter names.
        Returns:
            {name: gradient of the parameter's shape}, in the gradients' dtype.
        """
        if self.clipped_grads is not None:
            return self.clipped_grads(module, x, o, weights, names)
        grads = self.per_sample_grads(module, x, o)
        if weights is None:
            return {n: grads[n].sum(0) for n in names}
        return {n: weighted_sum(weights, grads[n]) for n in names}


def sq_norms_of(per_sample: list[torch.Tensor]) -> torch.Tensor:
    """Σ over tensors of ‖g_i‖²: the per-sample squared norm of several parameters' gradients together.

    Args:
        per_sample: per-sample gradients, each (B, ...), any float dtype.
    Returns:
        (B,) squared norms, accumulated in fp32 (in fp64 when the first tensor is fp64); None for an
        empty list.
    """
    total = None
    for g in per_sample:
        # one read of g, no temporary of its size (g.pow(2) would allocate and fault in one);
        # the root is squared back to within a few ulps, as exact as summing the squares
        dtype = g.dtype if g.dtype in (torch.float32, torch.float64) else torch.float32
        sq = torch.linalg.vector_norm(g if g.dim() == 2 else g.flatten(1), dim=1, dtype=dtype).square_()
        total = sq if total is None else total.add_(sq)
    return total


def weighted_sum(weights: torch.Tensor, per_sample: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i g_i, one GEMV over the flattened per-sample gradients.

    Args:
        weights: (B,) w_i (cast to the gradients' dtype).
        per_sample: (B, ...) per-sample gradients g_i.
    Returns:
        (...) = per_sample.shape[1:], in the per-sample gradients' dtype.
    """
    w = weights_as(weights, per_sample.dtype)
    if per_sample.dim() == 2:
        return w @ per_sample
    return (w @ per_sample.flatten(1)).view(per_sample.shape[1:])


_RULES: dict[type, LayerRule] = {}
_DP_CLASSES: dict[type, type] = {}
# Layers of optional libraries, by qualified name so their libraries are never imported here.
_DP_CLASSES_BY_NAME: dict[str, type] = {}
_FORMS: list[type] = []  # register_form: DP classes that recognize modules by their forward
_generation = 0  # bumped by every torch → DP mapping, so lookups cached elsewhere know to redo


def register_layer(torch_classes, dp_class: type, rule: LayerRule | None = None, *, replace: bool = False) -> None:
    """Register a layer family: ``convert`` swaps ``torch_classes`` for ``dp_class``, whose
    per-sample gradients come from ``rule``.

    Args:
        torch_classes: an ``nn.Module`` subclass, its qualified name as a string (e.g.
            ``"transformers.pytorch_utils.Conv1D"``: the optional library is never imported here), or a
            tuple/list of them. Subclasses are converted too; one with its own forward keeps it (the DP
            class comes after it in the MRO, so its ``super().forward`` is the private forward) when
            its parameters are only those the rule clips (weight, bias), and is left alone when frozen.
        dp_class: a ``DPModule`` subclass (typically also a subclass of the torch class); layer options it
            cannot train privately are refused by its ``unsupported_options``.
        rule: the rule of ``dp_class`` and its subclasses; None when ``dp_class`` inherits one from a
            registered base.
        replace: allow mapping a torch class already mapped to another DP class, and replacing
            ``dp_class``'s rule.
    Returns:
        None.
    Raises:
        ValueError when ``dp_class`` has no rule (none given or inherited), when a torch class already
        converts to another DP class or ``dp_class`` already has another rule (unless ``replace=True``),
        or for a class name without a module path; TypeError for a key that is not an ``nn.Module``
        subclass or a string, or a ``dp_class`` that is not a ``DPModule`` subclass.
    """
    keys = _keys(torch_classes, dp_class)
    if rule is None and rule_for_class(dp_class) is None:
        raise ValueError(f"{dp_class.__name__} has no rule: pass rule=, or subclass a DP class that has one")
    if not replace:
        taken = [_name(k) for k in keys if _table(k).get(k) not in (None, dp_class)]
        if taken:
            raise ValueError(f"{', '.join(taken)} already convert to another DP class; pass replace=True")
    if rule is not None:
        register_rule(dp_class, rule=rule, replace=replace or _RULES.get(dp_class) is rule)
    _map(keys, dp_class)


def register_module(torch_class: type | str, dp_class: type) -> None:
    """Make ``convert`` swap ``torch_class`` (and subclasses keeping its forward) for ``dp_class``,
    replacing any earlier mapping. Kept for existing callers: ``register_layer(torch_class,
    dp_class, rule)`` registers the mapping and the rule in one call.

    Args:
        torch_class: an ``nn.Module`` subclass or its qualified name (``"module.Class"``).
        dp_class: a ``DPModule`` subclass (its rule is registered separately, ``register_rule``).
    Returns:
        None.
    Raises:
        TypeError for a ``torch_class`` that is not an ``nn.Module`` subclass or a string, or a ``dp_class``
        that is not a ``DPModule`` subclass; ValueError for a name without a module path.
    """
    _map(_keys(torch_class, dp_class), dp_class)


def _keys(torch_classes, dp_class: type) -> list:
    keys = list(torch_classes) if isinstance(torch_classes, (tuple, list)) else [torch_classes]
    for key in keys:
        if isinstance(key, str):
            if "." not in key:
                raise ValueError(f"a class given by name needs its qualified name (module.Class), got {key!r}")
        elif not (isinstance(key, type) and issubclass(key, nn.Module)):
            raise TypeError(f"torch_classes must be nn.Module subclasses or qualified names, got {key!r}")
    if not (isinstance(dp_class, type) and issubclass(dp_class, DPModule)):
        raise TypeError(f"dp_class must be a subclass of pdpfast.nn.DPModule, got {dp_class!r}")
    return keys


def _table(key) -> dict:
    return _DP_CLASSES_BY_NAME if isinstance(key, str) else _DP_CLASSES


def _map(keys: list, dp_class: type) -> None:
    global _generation
    for key in keys:
        _table(key)[key] = dp_class
    _generation += 1


def _name(key) -> str:
    return key if isinstance(key, str) else f"{key.__module__}.{key.__qualname__}"


def register_rule(*types: type, rule: LayerRule, replace: bool = False) -> None:
    """Register ``rule`` for DP module classes ``types`` (subclasses inherit it through the MRO).

    ``register_layer`` does this and the torch-class mapping in one call; use this alone only for
    a DP class that ``convert`` never produces (one a model instantiates directly).

    Args:
        *types: the DP classes (``DPModule`` subclasses).
        rule: their ``LayerRule``.
        replace: allow replacing a rule already registered for one of them.
    Returns:
        None.
    Raises:
        TypeError when no type is given, one of ``types`` is not a ``DPModule`` subclass or ``rule`` is not
        a ``LayerRule``; ValueError when one of ``types`` already has a rule and ``replace`` is False (the
        types before it are registered by then).
    """
    if not types:
        raise TypeError("register_rule needs at least one DP class (*types)")
    bad = [t for t in types if not (isinstance(t, type) and issubclass(t, DPModule))]
    if bad:
        raise TypeError(f"types must be subclasses of pdpfast.nn.DPModule, got {', '.join(map(repr, bad))}")
    if not isinstance(rule, LayerRule):
        raise TypeError(f"rule must be a pdpfast.nn.LayerRule, got {rule!r}")
    for t in types:
        if t in _RULES and not replace:
            raise ValueError(f"a rule for {t.__name__} is already registered; pass replace=True")
        _RULES[t] = rule


def rule_for_class(cls: type) -> LayerRule | None:
    """The rule of DP class ``cls``: the first registered class of its MRO.

    Args:
        cls: a class (typically a ``DPModule`` subclass).
    Returns:
        its ``LayerRule``, or None when no class of its MRO has one.
    """
    for base in cls.__mro__:
        if base in _RULES:
            return _RULES[base]
    return None


def rule_for(module: nn.Module) -> LayerRule | None:
    """The rule of a DP layer (``rule_for_class`` of its type, through the MRO).

    Args:
        module: a module (typically a converted DP layer).
    Returns:
        its ``LayerRule``, or None when its class has none.
    """
    return rule_for_class(type(module))


def dp_class_registered(cls: type) -> type | None:
    """The DP class registered for exactly ``cls`` (by class, else by qualified name); ``convert``
    walks a module's MRO with this.

    Args:
        cls: a torch module class.
    Returns:
        the DP class, or None when ``cls`` itself (not a base) is not registered.
    """
    return _DP_CLASSES.get(cls) or _DP_CLASSES_BY_NAME.get(_name(cls))


def generation() -> int:
    """A counter of the registrations so far, for caches of registry lookups.

    Returns:
        an int that changes whenever a torch → DP mapping is registered.
    """
    return _generation


def register_form(dp_class: type) -> None:
    """Make ``convert`` recognize modules by what their forward computes: a module of a class with no
    registered DP class is swapped for ``dp_class`` (mixed into its own class) when
    ``dp_class.recognizes(module)``, e.g. the RMSNorm that Hugging Face copies into each model family
    under the family's own name (``DPRMSNormForm``). Forms are tried in order of registration.

    Args:
        dp_class: a ``DPModule`` subclass with a rule (``register_rule``) and a classmethod
            ``recognizes(module) -> bool`` that checks the module's own forward, not its name.
    Returns:
        None.
    Raises:
        TypeError for a ``dp_class`` that is not a ``DPModule`` subclass or has no ``recognizes``;
        ValueError when it has no rule.
    """
    global _generation
    if not (isinstance(dp_class, type) and issubclass(dp_class, DPModule)):
        raise TypeError(f"dp_class must be a subclass of pdpfast.nn.DPModule, got {dp_class!r}")
    if not callable(getattr(dp_class, "recognizes", None)):
        raise TypeError(f"{dp_class.__name__} has no classmethod recognizes(module)")
    if rule_for_class(dp_class) is None:
        raise ValueError(f"{dp_class.__name__} has no rule: register one with register_rule first")
    if dp_class not in _FORMS:
        _FORMS.append(dp_class)
        _generation += 1


def dp_class_by_form(module: nn.Module) -> type | None:
    """The first registered form (``register_form``) that recognizes ``module``; ``convert`` asks
    this for a module whose class has no registered DP class.

    Args:
        module: a module of a class with no registered DP class.
    Returns:
        the form's DP class, or None.
    """
    return next((form for form in _FORMS if form.recognizes(module)), None)


def registered_forms() -> tuple:
    """Every form ``convert`` recognizes modules by (``register_form``).

    Returns:
        a tuple of DP classes, in order of registration.
    """
    return tuple(_FORMS)


def registered_layers() -> dict:
    """Every registered torch → DP mapping.

    Returns:
        a new dict, torch class (or qualified name) → its DP class: classes first, then names, each
        in order of first registration.
    """
    return {**_DP_CLASSES, **_DP_CLASSES_BY_NAME}
