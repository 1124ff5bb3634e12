"""Individualized per-sample clipping of one batch: book-keeping, ghost and per-layer (DESIGN.md §1-2).

A ``ClippingState`` is attached to a converted model. Each batch is told the records' clip bounds
c_i (and a 0/1 mask for padded rows); the state then sees every DP layer's forward and backward.

The lifecycle of a batch, one ``Phase`` at a time (``_enter`` is the only place the phase changes):

* ``IDLE`` — no batch is open. A private forward (training mode, grad enabled) is refused: every
  private forward must belong to a batch whose records and bounds are known.
* ``OPEN`` — ``begin_batch`` opened a batch; forwards record their layer calls. Its backward runs
  the handler of the clipping style:
    - flat book-keeping (``mode="bk"``, one backward): each layer's backward adds its per-sample
      squared norms and keeps (input, output gradient); a callback at the end of the backward forms
      w_i from the total norms and writes Σ_i w_i g_i with one GEMM per layer (``_finish_flat``);
    - per-layer (``clipping="per_layer"``): clipping group k gets the bound c_i·C_k (Σ_k C_k² = 1)
      and clips inside the layer's own backward the moment its norms are known; nothing is kept;
    - ghost (``mode="ghost"``): a plain backward is refused; ``ghost_backward`` runs
      ``GHOST_NORMS`` (norms only, nothing kept) and then ``GHOST_GRADS`` (the same backward
      again, each layer writing its clipped sum Σ_i w_i g_i from the weights the norms gave).
* ``CLIPPED`` — the batch's clipped sums are in ``param.grad``. A second backward or a forward
  into the same batch is refused: it would add another contribution of up to c_i per record. The
  next ``begin_batch`` (the next physical batch of the same draw) or ``end_draw`` (after
  ``optimizer.step()``) leaves it. Until then the sums must stay as the backward wrote them
  (``check_clipped_sums_unchanged``): the noise is calibrated to them.

A draw (one Poisson sample, one optimizer step) may span several physical batches. ``begin_batch``
with ``draw=`` refuses a batch of a *new* draw while gradients of the previous draw are still
waiting for ``optimizer.step()``: that step would be charged once for two draws.

A parameter used more than once in a forward (tied embeddings, a module called twice) has per-sample
gradients that are sums over its uses, so norms of the uses do not add: such parameters fall back
to accumulating their materialized per-sample gradients, which is exact.

Activation checkpointing re-runs a block's forward inside the backward. torch's non-reentrant
checkpoint (``use_reentrant=False``) replays it only to refill the saved tensors of the graph the
forward built, whose nodes (and the layer calls hooked on them) are the ones autograd runs: a
replayed call is computed as the forward computed it but neither counted as a use nor reported
(``_replaying``). A reentrant checkpoint's block is first run under no_grad and recorded only in the
backward, after other layers were clipped with uses counted without it: refused.

Host cost is part of the design: a layer's backward makes a fixed, small number of tensor ops, no
host synchronisation, and clip bounds move to the device once per batch.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import math
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from . import _ext
from ._checks import as_per_sample, check_choice, check_nonnegative, check_number, check_positive
from .nn.broadcast import BroadcastParameterFunction, DPBroadcastHost
from .nn.convert import refuse_unsupported_layers
from .nn.layers import DPModule, record_call
from .nn.rules import LayerRule, low_precision, rule_for, sq_norms_of, weighted_sum
from .ops import workspace
from .ops.clip import PendingWeights, clip_weights
from .ops.dispatch import triton_disabled
from .ops.linear import acc_dtype, tf32_allowed

MODES = ("bk", "ghost")
CLIPPINGS = ("flat", "per_layer")

# Relative margin taken off every clip bound when a layer computes its clipped sum in fp16/bf16:
# the weight w_i, the norms and the stored result are each rounded (unit roundoff u), so a record's
# rounded contribution can exceed w_i‖g_i‖ by about 2u; 4u keeps it ≤ c_i. The rounding of the
# scaled terms w_i·o_t, relative to each term and not to their (possibly cancelling) sum, is
# bounded per record by the layer rules (``LayerRule.rounding``: ρ_i, and w_i clips ‖g_i‖ + ρ_i).
# The refusal of non-finite norms (``ClippingState._refuse_nonfinite``) reads them on the host: free
# where they are on the CPU, a stall on a GPU, which reads them later instead (``DEFERRED_CHECK_DEVICES``).
# A block standing in for a GPU's step on the CPU (``pdpfast.graphs.no_host_sync``, ``bench_overhead
# --kernels stub``) turns it off. Under torch.distributed its verdict is all-reduced, so that every rank
# refuses the same batches.
CHECK_FINITE_ON_CPU = True
# Devices whose norms are copied to the host without waiting (a pinned buffer, an event) and checked at
# the next ``optimizer.step()`` that finds the copy done: the draw's own step when the GPU got there
# first, else a later one, after the draw's step was applied (``ClippingState.check_finite``). Only
# where something reads them (``ClippingState.defer_checks``: the engine). Under torch.distributed,
# whose ranks must reach one verdict at one point, a backward's flag is summed over the ranks on the
# device (NaN where any rank's share holds such a record) and read at the step after its draw's, where
# every rank reads it (``ClippingState.nonfinite_reduce``).
DEFERRED_CHECK_DEVICES = ("cuda",)
# Copies outstanding at most (a draw of many physical batches queues one each before its step reads
# them): beyond, the oldest, several backwards old, is waited for and read
MAX_DEFERRED_CHECKS = 8


class _DeferredCheck:
    """The norms of one backward, on their way to the host: ``event`` (None: already there) marks
    the copy done; ``applied``: the draw's step was taken since; ``flag``: under torch.distributed,
    the (1,) sum over the ranks of their 0·norms (NaN where any rank's share holds a non-finite
    record), else None."""

    __slots__ = ("sq", "event", "records", "applied", "flag", "draw")

    def __init__(self, total_sq: torch.Tensor, records, flag: torch.Tensor | None = None, draw=None):
        self.sq, self.records, self.applied, self.draw = _to_host(total_sq), records, False, draw
        self.flag = None if flag is None else _to_host(flag)
        self.event = None
        if total_sq.is_cuda:  # on the stream that copies (the norms' device's, whatever the current device)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(total_sq.device))

    def ready(self, wait: bool = False) -> bool:
        if self.event is not None:
            if wait:
                self.event.synchronize()
            elif not self.event.query():
                return False
        return True


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the host: queued into pinned memory from a GPU (read it once its event is
    done), a clone on the CPU."""
    t = t.detach()
    if not t.is_cuda:
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _nonfinite_rows(sq: torch.Tensor) -> list:
    """Rows of host tensor ``sq`` that are NaN or inf ([] in one op when the sum is finite, the usual
    case). Masked rows too: a padding row (a copy of a record, bound 0) still adds 0·NaN = NaN."""
    if math.isfinite(float(sq.sum())):
        return []
    return (~torch.isfinite(sq)).nonzero().flatten().tolist()


def _nonfinite_message(rows: list, records) -> str:
    """"n record(s) (which) have a per-sample gradient norm that is NaN or inf: ..." for ``rows`` of a
    batch whose dataset indices are ``records`` (None: rows only)."""
    where = f"rows {rows[:8]}{' ...' if len(rows) > 8 else ''} of the batch"
    count = len(rows)
    if records is not None:  # (padding rows copy a record: each named once)
        named = list(dict.fromkeys(int(records[r]) for r in rows))
        count = len(named)
        where = f"dataset records {named[:8]}{' ...' if len(named) > 8 else ''} (0-based; {where})"
    return (f"{count} record(s) ({where}) have a per-sample gradient norm that is NaN or inf: their data or "
            "loss is not finite (a NaN or inf input, a log of 0), or the gradient overflowed its dtype")

# nn.DataParallel over several devices copies the model at every forward; the copies' layers hold no
# parameters of their own, so the private forward cannot be run in them (refused at make_private, and
# by a DP layer that finds itself in such a copy)
DATA_PARALLEL_REFUSAL = (
    "nn.DataParallel over several devices is not supported: it copies the model onto each device at every "
    "forward, and a DP layer's copy holds no parameters of its own to clip per sample. Use "
    "DistributedDataParallel (one process per device, wrapped before make_private: see pdpfast.distributed), "
    "or DataParallel over one device")

def _refuse_replica(module) -> None:
    """Refuse a DP layer run in nn.DataParallel's copy of the model, whose parameters are not in
    ``_parameters`` (checked where a layer found no trainable parameter: off the common path)."""
    if module.__dict__.get("_is_replica"):
        raise RuntimeError(DATA_PARALLEL_REFUSAL)


# Where the backward runs a node (None outside a backward), and the innermost saved-tensor hooks
# (None when none are active); both private torch APIs, absent from old versions: then no forward is
# seen as one inside a backward, as before.
_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)
_top_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _: None)

REENTRANT_CHECKPOINT_REFUSAL = (
    "a DP layer's private forward ran inside a backward without the saved-tensor hooks of torch's non-reentrant "
    "checkpoint: a reentrant activation checkpoint (torch.utils.checkpoint.checkpoint(..., use_reentrant=True), "
    "or one of its kind) recomputes its block there. That block ran its forward under no_grad, so pdpfast sees its "
    "layer calls only now, after other layers were clipped without them: a parameter used in the block and "
    "elsewhere (or twice in it, with per-layer clipping) would be clipped as separate uses, beyond its bound. Pass "
    "use_reentrant=False (torch's recommendation and Hugging Face's gradient_checkpointing_enable() default): "
    "its replay is exact with every clipping mode")


def _replaying() -> bool:
    """Whether a private forward is a non-reentrant activation checkpoint's replay of a block inside the
    backward (module docstring): a forward inside a backward under saved-tensor hooks (the checkpoint's).

    Returns:
        True for such a replay, False for a forward outside a backward.
    Raises:
        RuntimeError (``REENTRANT_CHECKPOINT_REFUSAL``) for a forward inside a backward without such
        hooks: a reentrant checkpoint's recomputation, whose graph a nested backward runs.
    """
    if _current_autograd_node() is None:
        return False
    if _top_saved_tensors_hooks(False) is not None:
        return True
    raise RuntimeError(REENTRANT_CHECKPOINT_REFUSAL)


class _ReplayedLayer:
    """Stands for the layer in a call a non-reentrant checkpoint replays: autograd runs the original
    graph's nodes with the replay's tensors, never the replay's own nodes, so this call's backward does
    not run. Were it to (a backward inside the checkpointed function itself), it would report a call
    no forward counted: refused. Has what ``LayerCall`` and ``DPLayerFunction`` read of a ``_Layer``."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    @property
    def state(self):
        return self

    @staticmethod
    def keeps_inputs() -> bool:
        return False

    def on_backward(self, call, x, o) -> None:
        raise RuntimeError(f"a backward reached a call of DP layer {self.name} that activation checkpointing "
                           "replayed inside the backward; pdpfast clips the calls of the forward. Do not run a "
                           "backward inside a checkpointed function")


# The states attached now (``attach`` adds, ``detach`` removes) and a count of those changes: a
# ``DPOptimizer`` releases only gradients that one of them clipped (``unguarded``).
_ATTACHED: weakref.WeakSet = weakref.WeakSet()
_ATTACH_CHANGES = [0]


def attach_changes() -> int:
    """How many times a state was attached or detached so far.

    Returns:
        an int; a verdict of :func:`unguarded` holds until it changes.
    """
    return _ATTACH_CHANGES[0]


def _discard_earlier_grads(named) -> None:
    """Set to None the gradients that trainable parameters hold from before a state guards them (a
    non-private backward, e.g. a warm-up loop ended without ``zero_grad``): a state adds its clipped sums
    into ``.grad``, so the first private step would release them, unclipped. A warning names them
    when any was not all zero (read once, when the state is attached)."""
    held = [(name, p) for name, p in named if p.requires_grad and p.grad is not None]
    nonzero = [name for name, p in held if bool(p.grad.any())]
    for _, p in held:
        p.grad = None
    if nonzero:
        warnings.warn(f"{len(nonzero)} trainable parameter(s) (e.g. {nonzero[0]!r}) held a nonzero gradient from "
                      "before they were made private (a non-private backward): it was discarded, since a private step "
                      "releases only the clipped sums of its own draw. Call optimizer.zero_grad() before "
                      "make_private to leave none", stacklevel=4)


def unguarded(params) -> torch.Tensor | None:
    """The first of ``params`` that no attached ``ClippingState`` guards: its gradient would not be
    clipped (a state writes the clipped sums of the parameters it guards).

    Args:
        params: an iterable of parameters.
    Returns:
        that parameter, or None when every one is guarded.
    """
    guarded = [state._guarded for state in _ATTACHED]
    for p in params:
        if not any(id(p) in ids for ids in guarded):
            return p
    return None

_ROUNDING_MARGIN = {torch.bfloat16: 4 * 2.0 ** -8, torch.float16: 4 * 2.0 ** -11}
# fp32 on a GPU with TF32 allowed (cuDNN allows it by default for convolutions): operands are
# rounded to 10-bit mantissas inside the products, in the clipped sum (cuDNN) and in the per-sample
# norms (the conv-norm kernel multiplies TF32 where cuDNN may): each can be off by ~2u (u = 2^-11),
# a norm low and a sum high together by ~4u, so fp32 layers there take twice fp16's margin (0.4%).
_TF32_MARGIN = 8 * 2.0 ** -11
# fp32 on a GPU without TF32: the norm kernels' tf32x3 products keep 22 of fp32's 24 significant
# bits (``pdpfast.kernels._utils.FP32_DOT_PRECISION``), so a norm can be low by ~2·2^-22.
_TF32X3_MARGIN = 8 * 2.0 ** -22


def _rounds_finely(o: torch.Tensor) -> bool:
    """fp32 on a CPU and fp64 round finely enough for the fixed margin: their rules' rounding bounds
    are not asked for (a check cheaper than the call, on every layer call)."""
    return (o.dtype == torch.float32 and not o.is_cuda) or o.dtype == torch.float64


def _norms_and_rounding(layer, names: tuple, x, o, parts: bool = False) -> tuple:
    """(sq, ρ_i or None) of a call whose norms come from its rule's formulas (``LayerRule.rounding``);
    ``parts``: sq (and ρ) may be (B, K) partial sums (``LayerRule.norm_parts``)."""
    return layer.rule.norms_and_rounding(layer.module, x, o, names, bound=not _rounds_finely(o), parts=parts)


def _grouped_norms_and_rounding(calls: list) -> list:
    """[(sq, ρ or None)] of calls (layer, names, x, o) of one ``Grouped`` key, each as
    ``_norms_and_rounding(..., parts=True)`` gives it: from one launch for several calls, from the
    call's own for one."""
    if len(calls) == 1:
        layer, names, x, o = calls[0]
        return [_norms_and_rounding(layer, names, x, o, parts=True)]
    sq, rho = calls[0][0].rule.grouped.norms_and_rounding(
        [(layer.module, x, o, names) for layer, names, x, o in calls], not _rounds_finely(calls[0][3]))
    # (n, B, K) tensors: n views from one op, not n indexing ops (BERT-base's 72 calls)
    sq = sq.unbind(0) if isinstance(sq, torch.Tensor) else sq
    if rho is None:
        rho = [None] * len(sq)
    elif isinstance(rho, torch.Tensor):
        rho = rho.unbind(0)
    return list(zip(sq, rho))


def _allocated_bytes(device: torch.device) -> int | None:
    """The bytes of the tensors allocated on ``device`` now, where its allocator counts them (CUDA's
    caching allocator: a host-side read of its statistics, no synchronisation), else None.

    From ``pdpfast._C.cuda_allocated_bytes`` (``csrc/memory.cpp``) where the extension was built with
    CUDA: torch's read from Python, ``torch._C._cuda_memoryStats``, builds a dictionary of every
    statistic first, and per-layer clipping reads it a few times a run (``_below_backward_start``)."""
    if device.type != "cuda":
        return None
    if _CUDA_BYTES is not None and device.index is not None:
        counted = _CUDA_BYTES(device.index)
        if counted >= 0:
            return counted or None
    try:  # (an allocator that keeps no statistics, a pluggable one: not counted)
        return torch._C._cuda_memoryStats(device.index)["allocated_bytes"]["all"]["current"] or None
    except (AttributeError, KeyError, RuntimeError, TypeError):
        return None


_CUDA_BYTES = None if _ext.missing("cuda_allocated_bytes", "memory.cpp") else _ext._C.cuda_allocated_bytes


def _params_bytes(layer, names: tuple) -> int:
    """The bytes of a call's trained parameters (``names`` of its module): those of their sums."""
    params = layer.module._parameters
    return sum(params[n].nbytes for n in names)


def _input_bytes(x) -> int:
    """The bytes of a layer call's input (a tensor, a tuple of them, or None once released)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(t.numel() * t.element_size() for t in x) if isinstance(x, tuple) else 0


def _grouped_per_sample_grads(grouped, calls: list) -> list:
    """[{name: per-sample gradients}] of same-shape calls (layer, names, x, o) of one ``Grouped`` key
    whose rule forms them (``Grouped.per_sample_grads``): from one launch for several calls, from the
    call's own for one."""
    if len(calls) == 1:
        layer, _, x, o = calls[0]
        return [layer.rule.per_sample_grads(layer.module, x, o)]
    return grouped.per_sample_grads([(layer.module, x, o, names) for layer, names, x, o in calls])


def _row_sums(t: torch.Tensor) -> torch.Tensor:
    """(B,) from (B,) values or (B, K) partial sums of them (``LayerRule.norm_parts``): a view where
    K = 1 (the norm kernel's rank-one path), one sum otherwise."""
    if t.dim() == 1:
        return t
    return t[:, 0] if t.shape[1] == 1 else t.sum(1)


def _in_quadrature(parts: list) -> torch.Tensor:
    """√(Σ_l ρ_l²) over the layers' rounding bounds, each (B,), or (B, K) partial sums whose rows sum
    to it (``LayerRule.norm_parts``): a layer's ρ is the sum of its partial sums, and the layers'
    combine in quadrature. Layers of one K are summed together (one stack and one sum, not one sum
    each). Returns (B,) in the first one's dtype."""
    dtype = parts[0].dtype
    if len(parts) == 1:
        return _row_sums(parts[0])
    summed, by_k = [], {}
    for rho in parts:
        rho = rho if rho.dtype == dtype else rho.to(dtype)
        if rho.dim() == 1:
            summed.append(rho)
        else:
            by_k.setdefault(rho.shape[1], []).append(rho)
    rows = [torch.stack(summed)] if summed else []  # (L, B) each
    for k, group in by_k.items():
        group = torch.stack(group)  # (L, B, K)
        rows.append(group[..., 0] if k == 1 else group.sum(-1))
    return torch.linalg.vector_norm(rows[0] if len(rows) == 1 else torch.cat(rows), dim=0)


def _stack_norms_and_rounding(stacked, calls) -> tuple:
    """((n, B) squared norms, (n, B) ρ or None) of a chunk of stacked calls."""
    return stacked.norms_and_rounding(calls, bound=not _rounds_finely(calls[0][2]))


def rounding_margin(t: torch.Tensor) -> float:
    """Relative margin taken off clip bounds for clipped sums computed in ``t``'s dtype and device.

    Args:
        t: a tensor of the layer's compute dtype and device.
    Returns:
        a float ≥ 0, a fraction of the bound: 4u for bf16 / fp16 (u their unit roundoff), 8u with
        TF32's u = 2^-11 for CUDA fp32 with TF32 allowed, 8·2^-22 (tf32x3 norms) for CUDA fp32
        without, else 0.0.
    """
    if t.dtype == torch.float32 and t.is_cuda:
        tf32 = tf32_allowed("conv") or tf32_allowed("matmul")
        return _TF32_MARGIN if tf32 else _TF32X3_MARGIN
    return _ROUNDING_MARGIN.get(t.dtype, 0.0)


# Small layer calls are host-bound (a launch costs more than its arithmetic): calls whose input and
# output gradient take at most SMALL_CALL_BYTES stack with their same-shape peers, in chunks of at
# most STACK_BYTES, so n of them cost one launch per op. Larger calls are device-bound and are
# computed on their own, without the copy stacking makes (book-keeping memory stays that of the
# kept activations; per-layer clipping clips them inside their own backward).
STACK_BYTES = 64 << 20
SMALL_CALL_BYTES = 1 << 20
# Formed per-sample gradients of at most PACK_BYTES per parameter (normalization layers' γ and β,
# small biases) are packed with their peers at the end of the backward: one concatenation, then a
# few ops for all of them (norms, clip weights, weighted sums, accumulation) instead of a few per
# parameter (BERT-base's 25 LayerNorms: ~250 launches a step become ~10). Per-layer clipping holds
# them until then, at most STACK_BYTES in all.
PACK_BYTES = 1 << 20
# Per-layer clipping holds a run of consecutive calls of one key for one norm launch (``Grouped``:
# a transformer's projections of one batch and sequence length, whatever their widths) until their
# inputs and output gradients pass this many bytes, the call that passes it included (BERT-base at
# batch 32: 12 launches for its 72 projections, in fp32 and bf16, with the bounds below), so that
# a deep stack is not all held. Both clipping modes hold normalization calls for one launch of
# their per-sample gradients within as many bytes again (BERT-base's 25 LayerNorm calls at batch 32:
# 5 launches in bk, 4 in its bf16 where the tenth below binds, 4 in per-layer clipping): book-keeping,
# whose tape already holds every linear call's
# tensors to the end of the backward, would otherwise add all of theirs to its peak (BERT-base at
# batch 8 on the CPU's stand-in of the GPU route: +150 MB, 14% of the non-private step's peak). A
# fixed budget is a larger share of a smaller step's memory, so neither holds more than a tenth of
# the forward's layer inputs either, where that is above RUN_FLOOR (a small model's whole step):
# per-layer clipping's runs of calls of any widths added 7% to the peak of BERT-base's per-layer
# step at batch 8 (CPU stand-in) with 128 MiB, 1.6% with 32 MiB, which is what batch 32 holds with
# 128 MiB. Per-layer clipping's peak is where its backward starts, so above the floor it holds
# instead no more than the inputs of the calls its backward has passed, less what it holds
# (``_hold_limit``): holding ResNet-18-GN's GroupNorm calls took its per-layer peak (CPU stand-in,
# batch 256, fp32) from 1.004x the non-private step's to 1.059x, 1.017x with this bound, and
# BERT-base's at batch 8 is back to 1.003x (1.013x). Until 2026-12-01 per-layer clipping kept the
# fixed budgets above the floor too; without them BERT-base at batch 32 takes 22 Triton launches a
# step in bf16 where it took 28 (its peak on the stand-in 0.995x the non-private step's either
# way), and ResNet-18-GN's peak is 1.020x. The bound counts an input as let go of once the backward
# has passed its call, which a graph that still needs it elsewhere belies: holding as much as was
# passed (not less what is held) took ResNet-18-GN's peak to 1.20x, 1.07x within 128 MiB. (Under
# activation checkpointing the peak is at a block's recomputation instead, whose inputs count as
# passed: the bound is then a heuristic.) The layers' inputs are the lesser part of what a backward
# lets go of, and these runs are nearly all of per-layer clipping's host time above book-keeping's
# (on the CPU's stand-in, with its runs unbounded, per-layer's step took bk's host time: bf16 1.44x
# the non-private step's both, fp32 1.63 against 1.60; bounded, 1.56 and 1.79). Where the device
# counts its tensors' bytes (a GPU's caching allocator), a run that passes the bound goes on while
# the device, with what flushing the run will allocate, holds no more than where the backward began
# (``_below_backward_start``): on the CPU's stand-in, which counts its bytes the same way
# (bench/cpu_bytes.py), BERT-base at batch 32 then takes 12 launches a step in bf16 and fp32 at the
# same peak (without the flush's bytes counted, 13 at a 1.05x peak against 0.99x).
RUN_BYTES = 128 << 20
RUN_FLOOR = 16 << 20
# Layouts whose route a layer keeps (``ClippingState._route``); past them it starts afresh.
ROUTES_PER_LAYER = 256  # (Poisson batches of varying size without a physical batch size: a route per size)


def refuse_sequence_first(model: nn.Module) -> None:
    """Refuse modules laid out (T, B, ...): per-sample means per row of dim 0, and such a module
    would make DP layers clip per position (undetectable when T == B).

    Args:
        model: the model, converted or not.
    Returns:
        None.
    Raises:
        ValueError naming every module with ``batch_first=False``.
    """
    seq_first = [f"{name or '<model>'} ({type(m).__name__})" for name, m in model.named_modules()
                 if getattr(m, "batch_first", None) is False]
    if seq_first:
        raise ValueError("DP layers need batch-first tensors (per-sample = per row of dim 0), but these "
                         "modules are batch_first=False: " + "; ".join(seq_first) +
                         ". Construct them with batch_first=True")


class Phase(enum.Enum):
    """The phase of a ``ClippingState``'s batch lifecycle (see the module docstring)."""

    IDLE = "idle"
    OPEN = "open"
    GHOST_NORMS = "ghost norms"
    GHOST_GRADS = "ghost grads"
    CLIPPED = "clipped"


def _shares_memory(t: torch.Tensor, x, o) -> bool:
    """Whether ``t`` lies in the storage of a call's input ``x`` (a tensor or a tuple of them) or of
    its output gradient ``o``: then it is not the clipping state's to change in place."""
    ptr = t.untyped_storage().data_ptr()
    return any(isinstance(u, torch.Tensor) and u.untyped_storage().data_ptr() == ptr
               for u in (*(x if isinstance(x, tuple) else (x,)), o))


def _trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}


def _without_autocast(finish) -> None:
    """Run an end-of-backward callback with autocast off (a backward may run inside autocast): the
    norms, clip weights and clipped sums it computes keep the dtypes the rules chose."""
    on = [device for device in _AUTOCAST_DEVICES if torch.is_autocast_enabled(device)]
    if not on:
        finish()
        return
    with contextlib.ExitStack() as stack:
        for device in on:
            stack.enter_context(torch.autocast(device, enabled=False))
        finish()


_AUTOCAST_DEVICES = ("cpu", "cuda")


class _Layer:
    """What the state knows of one DP layer, fixed at construction: its rule, name and group."""

    __slots__ = ("state", "module", "rule", "name", "group", "routes")

    def __init__(self, state: ClippingState, module: DPModule, rule: LayerRule, name: str, group: int | None):
        self.state, self.module, self.rule, self.name, self.group = state, module, rule, name, group
        self.routes: dict = {}  # its calls' routes by layout (ClippingState._route)


def check_clipping_options(mode: str, clipping: str, layer_shares=None, automatic_gamma=None) -> None:
    """The options ``ClippingState`` takes, checked alone: callers check them before they change a model
    (``make_private`` before ``convert``, ``PDPSGD`` before round 0 is charged).

    Args:
        mode: "bk" or "ghost". clipping: "flat" or "per_layer".
        layer_shares: per-layer shares (``clipping="per_layer"`` only; their values are checked against
            the layers, by ``ClippingState``), or None.
        automatic_gamma: γ > 0, or None.
    Returns:
        None.
    Raises:
        ValueError for an unknown mode or clipping, per-layer clipping in ghost mode, shares without
        per-layer clipping, or γ not finite and > 0 (TypeError for γ not a number).
    """
    check_choice("mode", mode, MODES)
    check_choice("clipping", clipping, CLIPPINGS)
    if clipping == "per_layer" and mode == "ghost":
        raise ValueError("clipping='per_layer' clips inside one backward; mode='ghost' does not apply "
                         "to it (use mode='bk', the default)")
    if layer_shares is not None and clipping != "per_layer":
        raise ValueError("layer_shares applies only to clipping='per_layer'")
    if automatic_gamma is not None:
        check_positive("automatic_gamma", automatic_gamma)


class ClippingState:
    """Per-model state of private backward passes. See the module docstring for the lifecycle.

    Args:
        model: converted with ``pdpfast.nn.convert`` (every trainable parameter in a DP layer, batch-first).
        mode: "bk" (book-keeping, one backward) or "ghost" (two backwards, see ``ghost_backward``).
        clipping: "flat" (one bound per record over all parameters) or "per_layer".
        layer_shares: per-layer clipping only: None for equal shares 1/√K over the K clipping groups, or a
            mapping from module name to C_k, or a sequence of K values in ``self.group_names`` order;
            Σ C_k² must be 1.
        automatic_gamma: None for standard clipping, γ > 0 for automatic clipping w_i = c_i / (‖g_i‖ + γ).
    Raises:
        ValueError for an unknown mode / clipping, an option that does not apply, shares that are not
        positive or do not satisfy Σ C_k² = 1, a batch_first=False module, a DP layer with options its
        private forward cannot train (``pdpfast.nn.convert.layer_problem``, as ``convert`` words it),
        trainable parameters outside DP layers, or no trainable DP parameter at all.
    """

    def __init__(self, model: nn.Module, *, mode: str = "bk", clipping: str = "flat",
                 layer_shares: Mapping[str, float] | Sequence[float] | None = None,
                 automatic_gamma: float | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        check_clipping_options(mode, clipping, layer_shares, automatic_gamma)
        self.model, self.mode, self.clipping, self.automatic_gamma = model, mode, clipping, automatic_gamma
        self._names = {m: name or "<model>" for name, m in model.named_modules()}
        refuse_sequence_first(model)
        self.layers = [m for m in model.modules() if isinstance(m, DPModule)]
        refuse_unsupported_layers(self.layers, self._names)  # DP layers built directly skip convert's check
        loose = [f"{self._names[m]} ({type(m).__name__})" for m in model.modules()
                 if not isinstance(m, DPModule) and _trainable(m)]
        if loose:
            raise ValueError("the model has trainable parameters outside DP layers; call "
                             "pdpfast.nn.convert(model) first. Modules: " + "; ".join(loose))
        if not any(_trainable(m) for m in self.layers):
            raise ValueError("the model has no trainable parameters in DP layers; call pdpfast.nn.convert(model)")
        self._build_groups()
        in_groups = {id(p) for params in self._group_params for p in params}
        # (name, parameter) of every parameter whose clipped sum the state writes, once each
        self._clipped_params = [(name, p) for name, p in model.named_parameters() if id(p) in in_groups]
        self._written: list | None = None  # (grad, its version) of each, as the last backward left them
        self._layer = {m: _Layer(self, m, rule_for(m), self._names[m], self._group_of.get(m)) for m in self.layers}
        self.shares = self._resolve_shares(layer_shares) if clipping == "per_layer" else None
        self._multi_call_groups = frozenset(k for k, calls in enumerate(self._group_calls) if calls > 1)
        self._guards: list = []
        self._guarded: frozenset = frozenset()  # ids of the parameters trainable at attach(): each guarded
        self._frozen: list = []                 # (name, parameter) frozen at attach()
        self._group_index: dict = {}  # (device, groups) → index of their rows in the per-layer bounds
        self._shares_by_device: dict = {}
        self.batch_size: int | None = None
        self.draw = None
        self.pending = False  # clipped sums of self.draw are in .grad, not yet consumed by a step
        self._records = None  # (B,) dataset index of each row of the open batch, for messages
        self._nonfinite: str | None = None  # why the draw's clipped sums are not finite (a step is refused)
        self._deferred: list[_DeferredCheck] = []  # a GPU's norms on their way to the host (check_finite)
        self._applied_error: str | None = None  # a deferred check's finding on a draw already stepped
        self.defer_checks = False  # queue them (set by the engine, whose steps call check_finite)
        self.refused_nonfinite = False  # check_finite refused a step (the engine's loader reads and clears it)
        self._total_sq: torch.Tensor | None = None
        self.last_weights: torch.Tensor | None = None
        self._last_group_sq: torch.Tensor | None = None
        self._ghost_weights: torch.Tensor | None = None  # ghost clipping's second backward: the w_i of its layers
        self._replayed: dict[DPModule, _ReplayedLayer] = {}  # the layer of a checkpoint's replayed calls
        self._last_rho: torch.Tensor | None = None
        # called as hook(state) once a batch's clipped sums are formed (e.g. adaptive clipping
        # reads last_norms / last_group_norms there: a draw's physical batches each report)
        self.post_backward_hooks: list = []
        self.keep_group_norms = False  # per-layer clipping: keep each group's norms (last_group_norms)
        # calls of one key share a norm launch (``LayerRule.grouped``: host time of an eager step). A
        # captured step (``engine.make_step``) turns it off in its bodies, so that its eager warm-up
        # launches (and compiles) the per-call kernels its capture records; a step captured by other
        # means must turn it off for its warm-up too
        self.group_calls = True
        self._kernels_off = triton_disabled()  # PDPFAST_DISABLE_TRITON as the layers' routes knew it
        # under torch.distributed: flag → whether any rank's flag is set (a collective), so that a non-finite
        # record in one rank's share refuses the batch on every rank (``DistributedContext.any_rank``)
        self.nonfinite_anywhere: Callable[[bool], bool] | None = None
        # under torch.distributed, for the deferred check: sums a (1,) tensor over the ranks in place, on its
        # device, without waiting (``DistributedContext.sum_over_ranks_``)
        self.nonfinite_reduce: Callable[[torch.Tensor], None] | None = None
        self._reset_backward()
        self._enter(Phase.IDLE)

    # ------------------------------------------------------------------ structure

    def _build_groups(self) -> None:
        """Clipping groups: one per DP layer, merged where layers share a parameter (tied weights).

        Only trainable parameters count: a frozen layer is never clipped, so giving it a group
        would shrink every other group's share 1/√K for nothing."""
        parent = list(range(len(self.layers)))

        def find(i):
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        owner: dict[nn.Parameter, int] = {}
        for i, m in enumerate(self.layers):
            for p in _trainable(m).values():
                if p in owner:
                    parent[find(i)] = find(owner[p])
                owner[p] = i
        roots: dict[int, int] = {}
        self._group_of: dict[nn.Module, int] = {}
        self.group_names: list[str] = []
        self._group_params: list[list[nn.Parameter]] = []
        self._group_calls: list[int] = []  # backward calls per forward of the group's layers
        self._param_group: dict[int, int] = {}  # id(parameter) → its clipping group
        self._param_order: dict[int, int] = {}  # id(parameter) → its place among the layers' parameters
        for i, m in enumerate(self.layers):
            if not _trainable(m):
                continue
            r = find(i)
            if r not in roots:
                roots[r] = len(self.group_names)
                self.group_names.append(self._names[m])
                self._group_params.append([])
                self._group_calls.append(0)
            k = roots[r]
            self._group_of[m] = k
            # a broadcast host reports each of its parameters in a call of its own
            self._group_calls[k] += len(_trainable(m)) if isinstance(m, DPBroadcastHost) else 1
            for p in _trainable(m).values():
                if not any(p is q for q in self._group_params[k]):
                    self._group_params[k].append(p)
                    self._param_group[id(p)] = k
                self._param_order.setdefault(id(p), len(self._param_order))

    def _resolve_shares(self, layer_shares) -> torch.Tensor:
        K = len(self.group_names)
        if layer_shares is None:
            return torch.full((K,), 1.0 / math.sqrt(K), dtype=torch.float64)
        if isinstance(layer_shares, Mapping):
            by_name, named_by = {}, {}
            modules = dict(self.model.named_modules())
            for name, share in layer_shares.items():
                module = modules.get(name)
                if module is None or module not in self._group_of:
                    raise ValueError(f"layer_shares names {name!r}, which is not a DP layer with trainable parameters; "
                                     f"clipping groups: {self.group_names}")
                k = self._group_of[module]
                share = check_number(f"layer_shares[{name!r}]", share)
                if k in by_name and share != by_name[k]:
                    # tied layers are one clipping group with one share: keeping either value would ignore the other
                    raise ValueError(f"layer_shares gives {named_by[k]!r} {by_name[k]:g} and {name!r} {share:g}, but "
                                     f"they share a parameter and are clipped as one group ({self.group_names[k]!r}): "
                                     "give that group one share")
                by_name[k], named_by[k] = share, name
            missing = [self.group_names[k] for k in range(K) if k not in by_name]
            if missing:
                raise ValueError(f"layer_shares gives no share for the clipping groups {missing}")
            shares = torch.tensor([by_name[k] for k in range(K)], dtype=torch.float64)
        else:
            if isinstance(layer_shares, torch.Tensor):
                if layer_shares.is_complex() or layer_shares.dtype == torch.bool:
                    raise TypeError(f"layer_shares must be real numbers, got a {layer_shares.dtype} tensor")
                shares = layer_shares.detach().to("cpu", torch.float64).reshape(-1)
            else:  # not text float() would read, nor bools
                shares = torch.tensor([check_number(f"layer_shares[{k}]", s) for k, s in enumerate(layer_shares)],
                                      dtype=torch.float64)
            if shares.shape != (K,):
                raise ValueError(f"layer_shares must have one value per clipping group ({K}: {self.group_names}), "
                                 f"got {tuple(shares.shape)}")
        if not torch.isfinite(shares).all() or (shares <= 0).any():
            raise ValueError("layer_shares must be positive and finite")
        total = float((shares ** 2).sum())
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"layer_shares must satisfy Σ C_k² = 1 so each record's total sensitivity stays "
                             f"≤ c_i; got Σ C_k² = {total:.6g} (divide the shares by {math.sqrt(total):.6g})")
        return shares

    @contextmanager
    def attached(self):
        """Context manager: ``attach()`` on entry, ``detach()`` on exit.

        Returns:
            a context manager yielding this state.
        """
        self.attach()
        try:
            yield self
        finally:
            self.detach()

    def attach(self) -> None:
        """Attach the state to every DP layer and guard each trainable parameter against unclipped gradients.

        Returns:
            None.
        Raises:
            RuntimeError if a layer is already attached to another state (another engine).
        """
        for m in self.layers:
            if m._pdpfast_state is not None and m._pdpfast_state is not self:
                raise RuntimeError(f"{self._names[m]} is already attached to another pdpfast engine")
            m._pdpfast_state = self
        if not self._guards:
            # DP layers hand autograd detached parameters, so a trainable parameter receives an autograd
            # gradient only through a use outside its layer's private forward; that gradient is unclipped
            named = list(self.model.named_parameters())
            _discard_earlier_grads(named)
            self._guards = [p.register_hook(functools.partial(self._refuse_plain_grad, name))
                            for name, p in named if p.requires_grad]
            self._guarded = frozenset(id(p) for _, p in named if p.requires_grad)
            self._frozen = [(name, p) for name, p in named if not p.requires_grad]
        _ATTACHED.add(self)
        _ATTACH_CHANGES[0] += 1

    def check_trainable(self, params=None) -> None:
        """Refuse a parameter whose gradient nothing clips: one frozen when the state was attached and
        trainable now (it has no guard and no clipping group, so an unclipped gradient would reach the
        step), or, among ``params`` (the optimizer's trainable ones), one that is not the model's (added
        with ``add_param_group`` afterwards). A loop over the frozen parameters, and over ``params``.

        Args:
            params: the parameters a step will update, or None to check the model's only.
        Returns:
            None.
        Raises:
            RuntimeError naming the parameter.
        """
        for name, p in self._frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"parameter {name} was frozen when the model was made private and is trainable now: its gradient "
                    "would not be clipped. Choose which parameters train before make_private (or freeze it again)")
        if params is not None:
            for p in params:
                if id(p) not in self._guarded:
                    raise RuntimeError(
                        f"the optimizer updates a parameter of shape {tuple(p.shape)} that the engine does not clip "
                        "(added with add_param_group after make_private, or not the model's): its gradient would "
                        "reach the step unclipped. Give the optimizer every parameter before make_private")

    def detach(self) -> None:
        """Undo ``attach()``: release the layers, remove the gradient guards, clear the workspace.

        Returns:
            None.
        """
        for m in self.layers:
            if m._pdpfast_state is self:
                m._pdpfast_state = None
        for handle in self._guards:
            handle.remove()
        self._guards = []
        _ATTACHED.discard(self)
        _ATTACH_CHANGES[0] += 1
        workspace.clear()

    @staticmethod
    def _refuse_plain_grad(name: str, grad) -> None:
        if grad is not None:
            raise RuntimeError(
                f"parameter {name} received an ordinary, unclipped gradient in a private backward: it is used "
                "outside its DP layer's private forward (e.g. F.linear(x, layer.weight), a layer subclass whose own "
                "forward uses it without calling super().forward, or a DP layer in eval mode). Use it through its "
                "module (share the Parameter between modules to tie weights), or "
                "freeze it")

    # ------------------------------------------------------------------ the lifecycle

    def _enter(self, phase: Phase) -> None:
        """The one place the phase changes; binds the handler of a layer's backward in that phase."""
        self.phase = phase
        if phase is Phase.OPEN:
            handler = {"ghost": self._refuse_plain_backward, "per_layer": self._per_layer_backward,
                       "flat": self._bk_backward}["ghost" if self.mode == "ghost" else self.clipping]
        else:
            handler = {Phase.IDLE: self._refuse_without_batch, Phase.GHOST_NORMS: self._ghost_norms_backward,
                       Phase.GHOST_GRADS: self._ghost_grads_backward, Phase.CLIPPED: self._refuse_second_backward,
                       }[phase]
        self._layer_backward = handler

    def begin_batch(self, clip_norms, mask=None, loss_scale: float = 1.0, *, draw=None, records=None) -> None:
        """Open a batch of B = len(clip_norms) samples (padded rows have mask 0).

        Args:
            clip_norms: (B,) c_i, positive, in gradient-L2-norm units (a 1-D tensor or array: it sets
                B); with ``clipping="per_layer"`` also (K, B), row k the bounds of clipping group k itself (then the
                layer shares are not applied: record i's sensitivity is sqrt(Σ_k c_{k,i}²)), which is how
                per-layer adaptive clipping moves each layer's bound.
            mask: None, or (B,) of 0 / 1 (0 for a padded row).
            loss_scale: how much the backward's output gradients are scaled down relative to
                per-sample losses (B for a loss that is the batch mean, 1 for a sum; 0 for an empty
                batch under a mean loss: all weights 0), a finite number ≥ 0.
            draw: the id of the Poisson draw this (physical) batch belongs to. With a draw id, a batch of a
                new draw is refused while the previous draw's clipped sums still wait for
                ``optimizer.step()``; without one (the functional API, benchmarks) the caller owns the
                lifecycle.
            records: None, or (B,) the dataset index of each row, which errors name (a record whose
                gradient is not finite) instead of its row in the batch.
        Returns:
            None; the state enters phase ``OPEN``.
        Raises:
            RuntimeError for a new draw while the previous one is pending, or a parameter frozen at ``attach()``
            that is trainable now (``check_trainable``); ValueError for bad clip norms
            (wrong shape, K rows for per-layer), a mask that is not 0 / 1, or a loss scale < 0 or not
            finite; TypeError for a loss scale that is not a number.
        """
        if draw is not None and self.pending and draw != self.draw:
            raise RuntimeError(
                "a new Poisson draw began before optimizer.step() used the clipped gradients of the previous "
                "one: one step would then be charged for two draws, and a record drawn in both could contribute "
                "twice its clip bound. Call optimizer.step() after every draw's backward; to bound memory for a "
                "large logical batch, pass physical_batch_size= to make_private (it splits one draw into "
                "physical batches that form one step)")
        if draw is not None and self.pending:  # the next physical batch of the draw adds into the sums
            self.check_clipped_sums_unchanged()
        self.check_trainable()
        self.clip_norms = self._as_clip_norms(clip_norms)
        self.batch_size = int(self.clip_norms.shape[-1])
        self.mask = None if mask is None else as_per_sample("mask", mask, self.batch_size, positive=False)
        if self.mask is not None and not ((self.mask == 0) | (self.mask == 1)).all():
            raise ValueError("mask must hold only 0 and 1")
        # s < 0 would flip every weight's sign and lift its clip: min(s, c/‖g‖) is then s, unbounded
        self.loss_scale = check_nonnegative("loss_scale", loss_scale)
        self._uses: dict[int, int] = {}  # id(parameter) → calls in this batch's forward
        self._forward_bytes = 0  # the bytes of its layer calls' inputs (``_hold_limit``)
        self._partial_calls: dict[int, int] = {}  # clipping group → its partial_forward calls in this forward
        self._bounds: dict = {}
        if triton_disabled() != self._kernels_off:  # the kernels turned on or off: routes change
            self._kernels_off = not self._kernels_off
            for layer in self._layer.values():
                layer.routes.clear()
        if draw is None or draw != self.draw:
            self.pending = False
            self._nonfinite = None
            self._written = None
        self.draw = draw
        self._records = records
        self._reset_backward()
        self._enter(Phase.OPEN)

    def _as_clip_norms(self, clip_norms) -> torch.Tensor:
        t = clip_norms if isinstance(clip_norms, torch.Tensor) else np.asarray(clip_norms)
        if t.ndim == 2 and self.clipping == "per_layer":
            t = torch.as_tensor(t)
            K = len(self.group_names)
            if t.shape[0] != K:
                raise ValueError(f"per-layer clip_norms of shape (K, B) need K = {K} rows (one per clipping "
                                 f"group: {self.group_names}), got shape {tuple(t.shape)}")
            rows = [as_per_sample("clip_norms", row) for row in t.unbind(0)]
            return torch.stack(rows)
        return as_per_sample("clip_norms", clip_norms)

    def end_draw(self, released: bool = False) -> None:
        """The draw's clipped sums were consumed (optimizer step) or discarded: no batch is open.

        Args:
            released: whether a step consumed them (its norms' deferred checks then report a
                non-finite record as one whose step was applied); else they were discarded, and so are
                those checks.
        Returns:
            None; the state enters phase ``IDLE``.
        """
        if self._deferred:
            if released:
                for check in self._deferred:
                    check.applied = True
            else:
                self._deferred = [check for check in self._deferred if check.applied]
        self.pending = False
        self._nonfinite = None
        self._written = None
        self._reset_backward()
        self._enter(Phase.IDLE)

    # ------------------------------------------------------------------ forward

    def forward(self, module: DPModule, x: torch.Tensor) -> torch.Tensor:
        """A DP layer's private forward: its computation on detached parameters, recorded for the backward.

        Args:
            module: the DP layer (attached to this state).
            x: its input, batch-first, (B, ...) (a (1, ...) input is expanded to B rows; a tuple for a
                packed input whose tensors share dim 0).
        Returns:
            the layer's output, (B, ...).
        Raises:
            RuntimeError unless a batch is open (inside a backward: for a reentrant checkpoint's
            recomputation, ``_replaying``); ValueError for an input whose dim 0 is not B (or 1).
        """
        replay = self._check_forward()
        x = self._batch_first(module, x)
        prepared = module._prepare(x)
        params, buffers = module._parameters, module._buffers
        names = tuple(n for n, p in params.items() if p is not None and p.requires_grad)
        if not names:
            _refuse_replica(module)
            return module._unflatten(module._compute(prepared, {**buffers, **params} if buffers else params), prepared)
        trainable = [params[n] for n in names]
        if replay:
            layer = self._replayed_layer(module)
        else:
            uses = self._uses  # keyed by id: a Parameter's __hash__ is a Python call, this runs per layer call
            for p in trainable:
                uses[id(p)] = uses.get(id(p), 0) + 1
            layer = self._layer[module]
            if isinstance(x, torch.Tensor):
                self._forward_bytes += x.numel() * x.element_size()
        return module._record(prepared, params, buffers, (layer, names), trainable)

    def _check_forward(self) -> bool:
        """Refuse a private forward outside an open batch; returns whether it is a checkpoint's replay
        (``_replaying``), which runs inside the batch's backward (phase ``OPEN``, a ghost phase, or
        ``CLIPPED``, whose layers' backwards then refuse a second backward)."""
        replay = _replaying()
        if replay:
            if self.phase is Phase.IDLE:
                self._refuse_without_batch()
        elif self.phase is not Phase.OPEN:
            self._refuse_forward()
        return replay

    def _replayed_layer(self, module: DPModule) -> _ReplayedLayer:
        replayed = self._replayed.get(module)
        if replayed is None:
            replayed = self._replayed[module] = _ReplayedLayer(self._names[module])
        return replayed

    def partial_forward(self, module: DPModule, x: torch.Tensor, names: tuple, compute) -> torch.Tensor:
        """One call of ``module`` that uses only its parameters ``names`` (e.g. one gate projection of
        a recurrent layer); the call reaches the rule with these names.

        Args:
            module: the DP layer; x: its input, (B, ...); names: the parameter names the call uses;
            compute: ``compute(x, params)`` with the parameters detached (a dict name → tensor or None),
                returning a 2-D (rows, features) tensor, not a view.
        Returns:
            compute's output.
        Raises:
            RuntimeError unless a batch is open (as ``forward``); ValueError for an input whose dim 0 is
            not B (or 1).
        """
        replay = self._check_forward()
        x = self._batch_first(module, x)
        params = module._parameters
        used = tuple(n for n in names if params.get(n) is not None and params[n].requires_grad)
        if not used:
            _refuse_replica(module)
            return compute(x, {n: params.get(n) for n in names})
        trainable = [params[n] for n in used]
        if replay:
            layer = self._replayed_layer(module)
        else:
            for p in trainable:
                self._uses[id(p)] = self._uses.get(id(p), 0) + 1
            # calls on different parameters of one group (a recurrent layer's projections) use none of them
            # twice, yet per-layer clipping must clip the group's sum over the calls, not each call alone
            layer = self._layer[module]
            self._partial_calls[layer.group] = self._partial_calls.get(layer.group, 0) + 1
        out = compute(x, {n: (params[n].detach() if params.get(n) is not None else None) for n in names})
        return record_call(out, x, (layer, used), trainable)

    def broadcast_forward(self, module, forward, args, kwargs):
        """The forward of a module with batch-broadcast parameters (``pdpfast.nn.broadcast``): each
        trainable one is seen as its (B, ...) expansion, whose gradient is per sample.

        Args:
            module: the broadcast host; forward: its original forward; args, kwargs: the call's arguments.
        Returns:
            what ``forward(*args, **kwargs)`` returns (the parameters are restored afterwards).
        Raises:
            RuntimeError unless a batch is open (as ``forward``), or (naming the parameters) when the forward
            fails with them expanded to the batch size.
        """
        replay = self._check_forward()
        params = module._parameters
        names = [n for n in module.broadcast_names if params.get(n) is not None and params[n].requires_grad]
        if not names:
            _refuse_replica(module)
        layer, saved = (self._replayed_layer(module) if replay else self._layer[module]), {}
        try:
            for n in names:
                p = saved[n] = params[n]
                if not replay:
                    self._uses[id(p)] = self._uses.get(id(p), 0) + 1
                params[n] = BroadcastParameterFunction.apply(p, self.batch_size, (layer, (n,)))
            return forward(*args, **kwargs)
        except RuntimeError as e:
            raise RuntimeError(f"{layer.name} ({type(module).__name__}) failed in a private forward, where its "
                               f"batch-broadcast parameters {', '.join(names)} have a leading dim of the batch "
                               f"size {self.batch_size} instead of 1. Is the module registered as a broadcast host "
                               f"but uses them in a way that is not batch-aligned? ({e})") from e
        finally:
            params.update(saved)

    def require_open(self) -> None:
        """Raise, as a private forward would, unless a batch is open (phase ``OPEN``).

        Returns:
            None.
        Raises:
            RuntimeError when no batch is open, or when the open batch's clipped sums were already computed.
        """
        if self.phase is not Phase.OPEN:
            self._refuse_forward()

    def rebind_batch(self, clip_norms: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Point the open batch at other tensors holding the same clip bounds and mask (a captured
        step's static device buffers, into which it copied the values ``begin_batch`` checked), so
        a graph captured from this batch reads whatever they hold at replay. No checks of values
        here: they would synchronise with the device.

        Args:
            clip_norms: a tensor of the open batch's clip-norm shape, (B,) or (K, B).
            mask: None or (B,), as the open batch has (None exactly when it has none).
        Returns:
            None.
        Raises:
            RuntimeError unless a batch is open; ValueError for a shape that differs from the open batch's.
        """
        self.require_open()
        if tuple(clip_norms.shape) != tuple(self.clip_norms.shape) or (mask is None) != (self.mask is None) or (
                mask is not None and tuple(mask.shape) != tuple(self.mask.shape)):
            mask_shape = None if self.mask is None else tuple(self.mask.shape)
            raise ValueError("rebind_batch needs tensors of the open batch's shapes: clip_norms "
                             f"{tuple(self.clip_norms.shape)}, mask {mask_shape}")
        self.clip_norms, self.mask = clip_norms, mask
        self._bounds = {}

    def _refuse_forward(self) -> None:
        if self.phase is Phase.IDLE:
            raise RuntimeError("a private forward needs an open batch: iterate the data loader returned by "
                               "PrivacyEngine.make_private (each batch it yields opens one, optimizer.step() closes "
                               "it), name the records of a batch you built with `with privacy_engine.records("
                               "indices): ...`, or use pdpfast.functional.clipped_gradients. A batch built by hand "
                               "has no known records, so its clip bounds and privacy cost are unknown")
        raise RuntimeError("this batch's clipped gradients were already computed; another forward and backward "
                           "on it would add a second contribution of up to c_i per record. Call optimizer.step() "
                           "and take the next batch from the loader (to combine several losses of one batch, add "
                           "them and call backward once)")

    def _batch_first(self, module, x: torch.Tensor) -> torch.Tensor:
        B = self.batch_size
        if isinstance(x, tuple):  # a packed input (see record_call): its tensors share dim 0
            if any(t.shape[0] != B for t in x):
                raise ValueError(f"{self._names[module]} got inputs of shapes {[tuple(t.shape) for t in x]} but "
                                 f"the batch has {B} samples")
            return x
        dims = x.dim()
        if dims == 1 and getattr(module, "_pdpfast_own_forward", False) and \
                any(p is not None and p.requires_grad for p in module._parameters.values()):
            self._refuse_own_forward_1d(module, x)
        n = x.shape[0] if dims else None
        if n == B:
            return x
        if n == 1:  # e.g. position ids of shape (1, T) broadcast over the batch: make it per sample
            return x.expand(B, *x.shape[1:])
        hint = ""
        if dims == 1:
            hint = (f"; a 1-D input of {n} rows is usually positions looked up for the whole batch "
                    "(torch.arange(T)) and broadcast afterwards: pass them as (1, T) (torch.arange(T)[None]), "
                    "which is broadcast over the batch with exact per-sample gradients (with T equal to the "
                    "batch size a 1-D one would be taken for B records)")
        elif n is not None and B and n > B and n % B == 0:
            hint = (f"; {n} rows = {B} × {n // B} is usually the batch flattened with its positions (as a "
                    "mixture-of-experts block routes tokens, e.g. to a shared expert): the layer cannot tell "
                    "the records apart there, so keep (B, T, ...) inputs, or freeze the layer "
                    "(requires_grad_(False))")
        raise ValueError(f"{self._names[module]} got an input of shape {tuple(x.shape)} but the batch has {B} "
                         f"samples; DP layers need batch-first inputs (e.g. batch_first=True){hint}")

    def _refuse_own_forward_1d(self, module, x: torch.Tensor) -> None:
        """A subclass's own forward (``pdpfast.nn.convert``) gave its layer a 1-D input: its rows would
        be taken as records, which they are only when it holds one id per record. Blenderbot's, LED's and
        BigBird-Pegasus's learned positions look up ``torch.arange(T)`` for the whole batch, broadcast
        afterwards: with T equal to the batch size, each row of the gradient would be one position's,
        summed over the records, and clipped as a record."""
        raise ValueError(
            f"{self._names[module]} ({type(module).__mro__[1].__name__}, whose own forward calls the layer's) gave the "
            f"layer a 1-D input of shape {tuple(x.shape)}: its rows would be clipped as records, which they are not "
            "when the forward looks up positions for the whole batch (torch.arange(T), broadcast afterwards). Freeze "
            "the layer (requires_grad_(False)), or make its forward pass (B, ...) or (1, T) inputs")

    # ------------------------------------------------------------------ backward

    def keeps_inputs(self) -> bool:
        """Whether a layer call's input must outlive its backward: between ghost clipping's two backwards.

        Returns:
            True in phase ``GHOST_NORMS``.
        """
        return self.phase is Phase.GHOST_NORMS

    def on_backward(self, call, x: torch.Tensor, o: torch.Tensor) -> None:
        """A DP layer call's backward: hands it to the handler of the current phase.

        Args:
            call: (layer, parameter names) as the forward recorded it.
            x: the call's input, (B, ...) (cast to ``o``'s dtype when autocast ran the layer in another).
            o: the output gradient, (B, ...) (made contiguous here).
        Returns:
            None.
        """
        layer, names = call
        if x is None and self.phase in (Phase.OPEN, Phase.GHOST_NORMS, Phase.GHOST_GRADS):
            raise RuntimeError(f"a second backward through the same graph reached DP layer {layer.name}: its input "
                               "was released after the first, as autograd releases saved tensors (retain_graph=True "
                               "does not keep it). Run the forward again for another backward")
        # gradients arriving through views (e.g. attention's head split) are often strided; one copy
        # here instead of one in every reshape of every rule
        if not o.is_contiguous():
            o = o.contiguous()
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != o.dtype:
            # autocast ran the layer in o's dtype on a cast of x: per-sample math sees what it saw
            x = x.to(o.dtype)
        device = o.device.type
        if torch.is_autocast_enabled(device):
            # a backward run inside autocast would run the norms' products in its low dtype: the
            # rules choose their own (fp32 accumulation), and the rounding bounds assume them
            with torch.autocast(device, enabled=False):
                self._layer_backward(layer, names, x, o)
            return
        self._layer_backward(layer, names, x, o)

    def _refuse_without_batch(self, *call) -> None:
        raise RuntimeError("a private backward reached a DP layer with no open batch (optimizer.step() closed "
                           "it); take the next batch from the loader")

    def _refuse_second_backward(self, layer, names, x, o) -> None:
        raise RuntimeError("a second backward into a batch whose clipped gradients were already computed would "
                           "add a second contribution of up to c_i per record (twice its bound). Call backward "
                           "once per batch (add the losses first), then optimizer.step()")

    def _refuse_plain_backward(self, layer, names, x, o) -> None:
        raise RuntimeError("mode='ghost' needs two backward passes over per-sample losses: call backward() "
                           "on the loss returned by the criterion that make_private returned "
                           "(or use pdpfast.functional.clipped_gradients)")

    @staticmethod
    def _stack_key(layer: _Layer, names: tuple, x, o):
        """(key, rule.stacked, bytes of x and o) when this call is small enough to be host-bound and
        its rule stacks same-shape calls; (None, None, 0) when it is computed on its own, without a copy."""
        stacked = layer.rule.stacked
        if stacked is None or (stacked.rounding is None and not layer.rule.materializes and low_precision(o)):
            return None, None, 0  # (a stack that cannot bound its rounding: each call bounds its own)
        nbytes = x.numel() * x.element_size() + o.numel() * o.element_size()
        if nbytes > SMALL_CALL_BYTES:
            return None, None, 0
        return stacked.key(layer.module, x, o, names), stacked, nbytes

    def _split_reused(self, layer: _Layer, names: tuple) -> tuple[tuple, tuple]:
        """(names clipped from norms, names whose per-sample gradients must be formed and kept)."""
        uses = self._uses
        params = layer.module._parameters
        for n in names:  # a loop, not a generator: this runs for every layer call
            if uses[id(params[n])] > 1:
                break
        else:
            return names, ()
        reused = tuple(n for n in names if uses[id(params[n])] > 1)
        return tuple(n for n in names if n not in reused), reused

    def _materialize(self, layer: _Layer, names: tuple, x, o, reused: bool = False) -> None:
        """Form this call's per-sample gradients of ``names`` and hold them to the end of the backward.

        ``reused``: the names may belong to parameters used more than once in the forward (tied
        weights, a module called twice). Such a parameter gets each further use's gradients added to
        the tensor held for it. Where that tensor is the state's own, the add is in place: through the
        rule's ``add_per_sample_grads`` where it has one (an embedding scatters its tokens' rows, with
        no B×V×d tensor of its own), else by forming them and adding. For GPT-2's tied embedding and
        LM head that is one B×V×d tensor instead of three at once (1.2 GB each, fp32).
        """
        rule, params, held, owned = layer.rule, layer.module._parameters, self._materialized, self._owned
        if not reused:  # each used once: this call's gradients are all of them (no ownership checks)
            self._hold_grads(layer, names, rule.per_sample_grads(layer.module, x, o))
            self._note_precision(o)
            return
        into, fresh = {}, None
        for n in names:
            p = params[n]
            g = held.get(p)
            if g is not None and p in owned and rule.add_per_sample_grads is not None and g.dtype == o.dtype:
                into[n] = g
                continue
            if fresh is None:
                fresh = rule.per_sample_grads(layer.module, x, o)
            new = fresh[n]
            if g is None:
                held[p] = new
                if new.is_contiguous() and not _shares_memory(new, x, o):  # not a view of the call's tensors
                    owned.add(p)
            elif p in owned and new.dtype == g.dtype:
                g.add_(new)
            else:
                held[p] = g + new
                owned.add(p)
        if into:
            rule.add_per_sample_grads(layer.module, x, o, tuple(into), into)
        self._note_precision(o)

    def _bk_backward(self, layer: _Layer, names: tuple, x, o) -> None:
        normal, reused = self._split_reused(layer, names)
        if reused:
            self._materialize(layer, reused, x, o, reused=True)
        if normal:
            key, stacked, _ = self._stack_key(layer, normal, x, o)
            if key is not None:  # norms deferred to the end of the backward, for all stacked calls at once
                self._stacks.setdefault((stacked, key), []).append((layer.module, x, o, normal))
            else:
                formed, group = self._route(layer, normal, x, o, True)
                if formed:
                    if group is not None:  # formed with their same-shape peers in one launch
                        self._hold_formed(group, layer, normal, x, o, self._hold_grads)
                    else:
                        self._materialize(layer, normal, x, o)
                elif group is not None:  # norms and clipped sums at the end of the backward, the key's calls at once
                    self._groups.setdefault(group, []).append((layer, normal, x, o))
                else:
                    # partial sums where the norm kernel leaves them: all summed at once in _batch_sq
                    self._add_sq_and_rounding(*_norms_and_rounding(layer, normal, x, o, parts=True))
                    self._tape.append((layer, x, o, normal))
            self._note_precision(o)
        self._queue_finish(self._finish_flat)

    def _per_layer_backward(self, layer: _Layer, names: tuple, x, o) -> None:
        k = layer.group
        if not self._started:  # where this backward began, for _below_backward_start
            self._started = True
            start = _allocated_bytes(o.device) if self.group_calls and self._forward_bytes // 10 > RUN_FLOOR else None
            if start is not None:
                self._start_bytes = o.device, start
        if id(x) != self._passed_input:  # (the attention projections share their input: it is let go of once)
            self._passed_input = id(x)
            self._passed_bytes += _input_bytes(x)
        self._queue_finish(self._finish_per_layer)
        if k in self._reused_groups():
            # tied across layers or calls, or one host's parameters in separate calls: the group's
            # per-sample gradient is formed from all of them
            self._flush_run()
            self._materialize(layer, names, x, o, reused=True)
            return
        key, stacked, nbytes = self._stack_key(layer, names, x, o)
        if key is not None:
            # a small call is host-bound: held briefly and clipped with its same-shape peers (per-layer
            # weights need only the call's own norms, so the buffer can be flushed at any point)
            self._flush_run()
            self._stacks.setdefault((stacked, key), []).append((layer.module, x, o, names))
            self._stack_bytes += nbytes
            if self._stack_bytes > STACK_BYTES:
                self._flush_per_layer_stacks()
            return
        formed, group = self._route(layer, names, x, o, False)
        if formed:  # form them once, clip them now
            # (a held run goes on past it: a CNN's normalization layers sit between its same-shape convolutions)
            if group is not None:  # formed with their same-shape peers in one launch (small: clipped at the end)
                self._hold_formed(group, layer, names, x, o, self._clip_or_hold)
                return
            self._clip_or_hold(layer, names, layer.rule.per_sample_grads(layer.module, x, o))
            return
        if self._run and group != self._run_key:
            self._flush_run()
        if group is not None:
            # held until a call that does not join them: consecutive calls of one key (a transformer's
            # projections) take one norm launch, and are clipped then, each against its own weights
            shared = self._run and self._run[-1][2] is x  # (the attention projections share their input)
            x_bytes, o_bytes = x.numel() * x.element_size(), o.numel() * o.element_size()
            self._run_bytes += o_bytes + (0 if shared else x_bytes)
            if self._start_bytes is not None:  # what its flush will allocate (_below_backward_start)
                self._run_grads += _params_bytes(layer, names)
                self._run_scratch = max(self._run_scratch, min(x_bytes, o_bytes))
            self._run_key = group
            self._run.append((layer, names, x, o))
            if self._run_bytes > self._hold_limit() and not self._below_backward_start(o):
                self._flush_run()
            return
        self._clip_call(layer, names, x, o)

    def _clip_or_hold(self, layer: _Layer, names: tuple, per_sample) -> None:
        """Per-layer clipping of a call's formed per-sample gradients: held to be clipped with their
        peers at the end of the backward where small, else clipped now."""
        grads = [per_sample[n] for n in names]
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        params = layer.module._parameters
        if max(g.numel() * g.element_size() for g in grads) <= PACK_BYTES and \
                self._held_bytes + nbytes <= STACK_BYTES:  # small: clipped with their peers at the end
            self._materialized.update((params[n], g) for n, g in zip(names, grads))
            self._held_bytes += nbytes
            return
        sq = sq_norms_of(grads)
        weights = self._group_weights(sq, layer.group, *grads)
        for n, g in zip(names, grads):
            self._accumulate_param(params[n], weighted_sum(weights, g))
        workspace.recycle(grads)
        self._add_group_sq(layer.group, sq)
        self._add_sq(sq)

    def _hold_formed(self, group, layer: _Layer, names: tuple, x, o, take) -> None:
        """Hold a call whose per-sample gradients are formed with its same-shape peers' in one launch
        (``Grouped.per_sample_grads``); once the held calls' inputs and output gradients pass
        ``_hold_limit()`` (this call included), form the held ones (``_flush_formed(take)``)."""
        self._formed.setdefault(group, []).append((layer, names, x, o))
        self._formed_bytes += x.numel() * x.element_size() + o.numel() * o.element_size()
        if self._start_bytes is not None:  # its per-sample gradients and their sums (_below_backward_start)
            self._formed_grads += (o.shape[0] + 1) * _params_bytes(layer, names)
        if self._formed_bytes > self._hold_limit() and not self._below_backward_start(o):
            self._flush_formed(take)

    def _hold_limit(self) -> int:
        """The bytes of inputs and output gradients the held calls of a run, or of calls whose
        per-sample gradients are formed together, may pass: ``RUN_BYTES``, and a tenth of this
        forward's layer inputs where that is more than ``RUN_FLOOR`` (see ``RUN_BYTES``). Per-layer
        clipping's peak is where its backward starts, so above the floor it holds instead no more
        than the inputs of the calls its backward has passed, less what it holds (``_passed_bytes``)."""
        tenth = self._forward_bytes // 10
        if self.clipping == "per_layer" and tenth > RUN_FLOOR:
            return max(0, self._passed_bytes - self._run_bytes - self._formed_bytes)
        return min(RUN_BYTES, max(RUN_FLOOR, tenth))

    def _below_backward_start(self, o: torch.Tensor) -> bool:
        """Per-layer clipping above ``RUN_FLOOR``, where the device counts its tensors' bytes (a GPU's
        caching allocator, ``_allocated_bytes``): whether they, with what flushing the held calls
        will allocate (their clipped sums, the largest operand one scales, formed per-sample
        gradients), are still no more than where this backward began (its first call, the held ones
        included now), so that held calls may pass ``_hold_limit()`` and raise no peak. A read clears
        the held calls to grow by the room it found (``_cleared``, until the next flush), so the
        allocator is read again only past it.

        What the backward has passed counts only the layers' inputs, and in a transformer they are
        the lesser part of what a backward lets go of (attention probabilities, activations' inputs,
        dropout masks); the device knows the rest. Read once a backward at its first call, then only
        where the limit would have ended a run and the last read's room is spent (a read is one C++ call
        through ``pdpfast._C``, unmeasured on a GPU, tens of µs through torch's dictionary; a held
        run's flush more than a hundred)."""
        start = self._start_bytes
        if start is None or start[0] != o.device:  # (a model across devices: not compared)
            return False
        flush = self._run_grads + self._run_scratch + self._formed_grads
        held = self._run_bytes + self._formed_bytes
        if held + flush <= self._cleared:
            return True
        now = _allocated_bytes(o.device)
        if now is None or now + flush > start[1]:
            return False
        # held calls may grow by the room left before the next read (what they add counts their inputs,
        # which were allocated already, and what their flush will allocate); a flush, whose calls'
        # tensors may outlive it, clears it
        self._cleared = held + start[1] - now
        return True

    def _flush_formed(self, take) -> None:
        """Form the held calls' per-sample gradients (``_hold_formed``), one launch per key, and hand
        each call's to ``take(layer, names, grads)``: ``_hold_grads`` (flat clipping) or
        ``_clip_or_hold`` (per-layer clipping)."""
        formed, self._formed, self._formed_bytes, self._formed_grads, self._cleared = self._formed, {}, 0, 0, 0
        for (grouped, _), calls in formed.items():
            for (layer, names, _, _), grads in zip(calls, _grouped_per_sample_grads(grouped, calls)):
                take(layer, names, grads)

    def _hold_grads(self, layer: _Layer, names: tuple, per_sample) -> None:
        """Hold a call's formed per-sample gradients of ``names`` to the end of the backward, each the
        only one of its parameter (``_materialize`` of parameters used once, book-keeping's grouped calls)."""
        params = layer.module._parameters
        self._materialized.update((params[n], per_sample[n]) for n in names)

    def _route(self, layer: _Layer, names: tuple, x, o, kept: bool) -> tuple:
        """(formed, group) of a call computed on its own (not stacked): whether its per-sample
        gradients are formed (``LayerRule.materializes_call``; ``kept``: until every layer's norms
        are known, flat clipping) and the launch it waits to share (``_launch_group``), or None.

        Kept per layer and layout (``_Layer.routes``: names, shapes, strides, dtype, device, at most
        ``ROUTES_PER_LAYER``): a step of fixed shapes asks the same questions every step, and asking
        took a transformer call ~25 µs of host time (the rule's key ~17, whether to form ~8), the
        most of any part of its backward. What the answers read: the call's layout, its module's
        configuration, the kernels' dispatch, whether x and o start on 16-byte boundaries, and for
        forming, the memory lent at the time (``pdpfast.ops.workspace``), and whether a CUDA graph is
        being captured (no grouped launch then). So calls whose tensors do not start on such
        boundaries, and calls in a capture, are asked every time, and so is whether to form where a rule's
        ``materialize_when`` said yes (a no is kept: the norm route is exact, only its speed is at
        stake); ``PDPFAST_DISABLE_TRITON`` is read once a batch (``begin_batch``); a module whose
        configuration changed is caught by the grouped launch, which takes its calls apart unless their
        modules agree (``Grouped``)."""
        routes, layout = layer.routes, None
        if type(x) is torch.Tensor and not (x.data_ptr() % 16 or o.data_ptr() % 16 or (
                o.is_cuda and torch.cuda.is_current_stream_capturing())):  # (no grouped launch in a capture)
            layout = (names, kept, self.group_calls, x.shape, x.stride(), x.dtype, o.shape, o.stride(), o.dtype,
                      o.device)
            route = routes.get(layout)
            if route is not None:
                return route
        formed = layer.rule.materializes_call(layer.module, x, o, kept)
        route = formed, self._launch_group(layer, names, x, o, formed)
        # a yes from materialize_when may hang on the memory lent now: asked again
        if layout is not None and (not formed or layer.rule.materialize_when is None):
            if len(routes) >= ROUTES_PER_LAYER:  # e.g. a new sequence length every batch
                routes.clear()
            routes[layout] = route
        return route

    def _launch_group(self, layer: _Layer, names: tuple, x, o, formed: bool):
        """(the rule's ``Grouped``, this call's key) where the call waits to share a launch with its
        peers of its key; None where it takes its own. ``formed``: the call's per-sample gradients are
        formed (its rule's ``Grouped.per_sample_grads``), else its norms (``norms_and_rounding``)."""
        grouped = layer.rule.grouped if self.group_calls else None
        if grouped is None or (grouped.per_sample_grads is not None) is not formed:
            return None
        key = grouped.key(layer.module, x, o, names)
        return None if key is None else (grouped, key)

    def _clip_call(self, layer: _Layer, names: tuple, x, o, sq=None, rho=None) -> None:
        """Per-layer clipping of one large call from its norms (and ρ; computed here unless given):
        partial sums where the norm kernel leaves them, summed by the clip-weight call, and where the
        rule takes them, the weights computed by the op that scales the clipped sum's rows."""
        if sq is None:
            sq, rho = _norms_and_rounding(layer, names, x, o, parts=True)
        weights = self._group_weights(sq, layer.group, o, rounding=rho, parts=sq.dim() == 2,
                                      pending=layer.rule.pending_weights)
        self._clip_into(layer, x, o, weights, names)
        self._add_group_sq(layer.group, sq)
        self._add_sq(sq)

    def _flush_run(self) -> None:
        """Per-layer clipping of the held run of consecutive calls of one key (``Grouped``): their
        norms (and ρ) from one launch, each call's weights against its group's bounds, and the clipped
        sums of all of them in one pass (``_clip_group_into``)."""
        run, self._run, self._run_key, self._run_bytes, self._cleared = self._run, [], None, 0, 0
        self._run_grads = self._run_scratch = 0
        if len(run) == 1:
            self._clip_call(*run[0])
        elif run:
            norms = _grouped_norms_and_rounding(run)
            self._clip_group_into(run[0][0].rule.grouped, run, [
                self._group_weights(sq, layer.group, o, rounding=rho, parts=sq.dim() == 2,
                                    pending=layer.rule.pending_weights)
                for (layer, _, _, o), (sq, rho) in zip(run, norms)])
            for (layer, *_), (sq, _) in zip(run, norms):
                self._add_group_sq(layer.group, sq)
                self._add_sq(sq)

    def _reused_groups(self) -> frozenset:
        """Per-layer clipping groups whose per-sample gradient sums several calls (tied across
        layers or calls, one broadcast host's parameters in separate calls, or several partial calls
        of one layer, as a recurrent layer's): found once per backward, when the forward's use counts
        are complete."""
        reused = self._reused
        if reused is None:
            group = self._param_group
            partial = (k for k, calls in self._partial_calls.items() if calls > 1)
            reused = self._reused = self._multi_call_groups.union(
                partial, (group[pid] for pid, count in self._uses.items() if count > 1 and pid in group))
        return reused

    def _ghost_norms_backward(self, layer: _Layer, names: tuple, x, o) -> None:
        normal, reused = self._split_reused(layer, names)
        if reused:
            self._materialize(layer, reused, x, o, reused=True)
        if normal:
            sq, rho = _norms_and_rounding(layer, normal, x, o)
            self._add_sq(sq)
            self._add_rounding(rho)
            self._note_precision(o)

    def _ghost_grads_backward(self, layer: _Layer, names: tuple, x, o) -> None:
        # the layer weighs its own terms, as book-keeping does, so its rounding is what its rule bounds
        self._clip_into(layer, x, o, self._ghost_weights, names)

    def _add_sq(self, sq: torch.Tensor) -> None:
        """Add one layer's (or group's) per-sample squared norms to the batch's total: kept, and summed
        with the others once, at the end of the backward (one launch for all, not one per layer).
        ``sq``: (B,), or (B, K) partial sums whose rows sum to the norms (``LayerRule.norm_parts``)."""
        self._sq_parts.append(sq)

    def _add_sq_and_rounding(self, sq: torch.Tensor, rho: torch.Tensor | None) -> None:
        self._add_sq(sq)
        self._add_rounding(rho)

    def _add_rounding(self, rho: torch.Tensor | None) -> None:
        """Flat clipping: keep one layer's (or stack's) ρ_i (``LayerRule.rounding``), combined with the
        others once, at the end of the backward: in quadrature, their errors lying in different
        coordinates (different parameters). ``rho``: (B,), or (B, K) partial sums (``norm_parts``),
        kept unsummed (``_in_quadrature`` sums each layer's)."""
        if rho is not None:
            self._rho_parts.append(rho)

    def _add_group_sq(self, group: int, sq: torch.Tensor) -> None:
        """Per-layer clipping: keep clipping group k's own per-sample squared norms, (B,) or (B, K)
        partial sums (for ``last_group_norms``, when ``keep_group_norms`` is set); each group reports
        once per backward."""
        if self.keep_group_norms:
            self._group_sq[group] = _row_sums(sq).detach()

    def _queue_finish(self, finish) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_without_autocast, finish))

    # ------------------------------------------------------------------ weights

    def _bounds_for(self, device: torch.device, dtype: torch.dtype, margin: float = 0.0):
        """c_i·m_i (masked rows get bound 0) on ``device``, (B,) for flat clipping or (K, B), row k
        c_i·C_k·m_i, for per-layer clipping; moved once per batch, whatever the number of layers.
        ``margin``: the rounding margin of the dtype the clipped sums are computed in."""
        key = (device, dtype, margin)
        bounds = self._bounds.get(key)
        if bounds is None:
            c = self.clip_norms.double()  # c_i·C_k formed in float64, then rounded once
            if self.mask is not None:
                c = c * self.mask.double()
            if margin:
                c = c * (1.0 - margin)
            if self.shares is not None and c.dim() == 1:
                c = self._shares_on(c.device).unsqueeze(1) * c.unsqueeze(0)
            c = c.to(dtype)
            if device.type == "cuda" and c.device.type == "cpu":
                if torch.cuda.is_current_stream_capturing():  # a captured step keeps its bounds on the device
                    raise RuntimeError("clip bounds on the host cannot be copied inside a CUDA graph capture")
                # a copy from pageable memory waits for the GPU to drain: from pinned memory it is queued
                c = c.pin_memory()
            bounds = c.to(device=device, non_blocking=True)
            self._bounds[key] = bounds
        return bounds

    def _shares_on(self, device: torch.device) -> torch.Tensor:
        """The layer shares C_k (K,) float64 on ``device``, moved there once (a captured step's
        bounds live on the GPU: its capture must find them there)."""
        shares = self._shares_by_device.get(device)
        if shares is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the layer shares must reach the GPU before CUDA graph capture (warm up first)")
            shares = self.shares.pin_memory() if device.type == "cuda" else self.shares
            shares = self._shares_by_device[device] = shares.to(device, non_blocking=True)
        return shares

    def _note_precision(self, o: torch.Tensor) -> None:
        self._margin = max(self._margin, rounding_margin(o))

    def _weights(self, sq: torch.Tensor, bounds: torch.Tensor, rounding: torch.Tensor | None = None,
                 parts: bool = False, pending: bool = False) -> torch.Tensor | PendingWeights:
        """Weights applied to the backward's output gradients (s·w_i, the loss scale s folded in):
        sq the squared norms of their per-sample gradients (with ``parts``, (..., K) partial sums of
        them), bounds c_i broadcast against sq, rounding their rounding bounds ρ_i
        (``LayerRule.rounding``) or None; ``pending``: uncomputed, for the op that applies them
        (``LayerRule.pending_weights``)."""
        if rounding is not None and rounding.dtype != sq.dtype:
            rounding = rounding.to(sq.dtype)
        if pending:
            return PendingWeights(sq, bounds, self.automatic_gamma, self.loss_scale, rounding, parts)
        return clip_weights(sq, bounds, None, self.automatic_gamma, self.loss_scale, rounding, parts)

    def _flat_weights(self, sq: torch.Tensor) -> torch.Tensor:
        self._last_rho = _in_quadrature(self._rho_parts) if self._rho_parts else None
        return self._weights(sq, self._bounds_for(sq.device, sq.dtype, self._margin), self._last_rho)

    def _group_weights(self, sq: torch.Tensor, group: int, *like: torch.Tensor,
                       rounding: torch.Tensor | None = None, parts: bool = False,
                       pending: bool = False) -> torch.Tensor | PendingWeights:
        """Weights of per-layer group k for clipped sums computed like the tensors ``like`` (dtype,
        device): the bounds keep the widest of their rounding margins (a tied weight's group under
        autocast holds fp32 and bf16 gradients); ``rounding``: the group's ρ_i, or None; ``parts``:
        sq is (B, K) partial sums; ``pending``: as in ``_weights``."""
        margin = rounding_margin(like[0]) if len(like) == 1 else max(map(rounding_margin, like))
        key = (sq.device, sq.dtype, margin, group)
        bounds = self._bounds.get(key)  # the group's row, kept for the batch: no view made per call
        if bounds is None:
            bounds = self._bounds[key] = self._bounds_for(sq.device, sq.dtype, margin)[group]
        return self._weights(sq, bounds, rounding, parts, pending)

    # ------------------------------------------------------------------ end of a backward

    def _packed(self, params) -> tuple[list, list]:
        """(packs, rest) of formed per-sample gradients: those of at most ``PACK_BYTES`` concatenated
        per dtype and device, each pack (params, (B, N) gradients side by side in the layers' order of
        their parameters, whatever the order they were formed in: calls held for a shared launch come
        later); the other params alone."""
        small, rest = {}, []
        order = self._param_order
        for p in sorted(params, key=lambda p: order.get(id(p), len(order))):
            g = self._materialized[p]
            if g.numel() * g.element_size() <= PACK_BYTES:
                small.setdefault((g.dtype, g.device), []).append(p)
            else:
                rest.append(p)
        packs = []
        for ps in small.values():
            if len(ps) == 1:
                rest += ps
                continue
            B = self._materialized[ps[0]].shape[0]
            packs.append((ps, torch.cat([self._materialized[p].reshape(B, p.numel()) for p in ps], 1)))
        return packs, rest

    def _accumulate_packed(self, params: list, summed: torch.Tensor) -> None:
        """Add the (N,) clipped sums of a pack into its params' ``.grad``: one launch for those that
        have a gradient of their dtype (``_foreach_add_``), views of ``summed`` for those that have none.
        Sums in the accumulation dtype (fp32) of low-precision params are cast once, not per param."""
        dtype = params[0].dtype
        if summed.dtype != dtype and all(p.dtype == dtype for p in params):
            summed = summed.to(dtype)
        into, add = [], []
        for p, g in zip(params, summed.split([p.numel() for p in params])):
            if p.grad is not None and p.grad.dtype == g.dtype:
                into.append(p.grad)
                add.append(g.view(p.shape))
            else:
                self._accumulate_param(p, g)
        if into:
            with torch.no_grad():
                torch._foreach_add_(into, add)

    def _batch_sq(self, packs=None, rest=None) -> torch.Tensor:
        """(B,) total squared norms of the backward: the layers' plus the materialized parameters'
        (``packs`` and ``rest`` as ``_packed`` returns them, computed here when not given)."""
        if packs is None:
            packs, rest = self._packed(list(self._materialized))
        parts = self._sq_parts
        grads = [flat for _, flat in packs] + [self._materialized[p] for p in rest]
        if grads:
            parts = [*parts, sq_norms_of(grads)]
        if not parts:  # no layer saw this batch's backward
            return torch.zeros(self.batch_size, dtype=torch.float64)
        dtype = parts[0].dtype  # the first layer's accumulation dtype (fp64 for fp64 models)
        parts = [sq if sq.dtype == dtype else sq.to(dtype) for sq in parts]
        if all(sq.dim() == 1 for sq in parts):
            return parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
        # (B, K) partial sums among them: all columns side by side, one sum
        return torch.cat([sq if sq.dim() == 2 else sq.unsqueeze(1) for sq in parts], 1).sum(1)

    def _stack_chunks(self) -> list:
        """Stacked calls cut into chunks of at most ``STACK_BYTES`` of inputs and output gradients, so
        stacking costs a bounded copy whatever the model's size."""
        chunks = []
        for (stacked, _), calls in self._stacks.items():
            chunk, size = [], 0
            for call in calls:
                nbytes = call[1].numel() * call[1].element_size() + call[2].numel() * call[2].element_size()
                if chunk and size + nbytes > STACK_BYTES:
                    chunks.append((stacked, chunk))
                    chunk, size = [], 0
                chunk.append(call)
                size += nbytes
            chunks.append((stacked, chunk))
        return chunks

    def _finish_flat(self) -> None:
        """End of a bk backward: the clipped sums that needed every layer's norms."""
        chunks = self._stack_chunks()
        for stacked, calls in chunks:
            sq, rho = _stack_norms_and_rounding(stacked, calls)
            self._add_sq(sq.sum(0))
            if rho is not None:
                self._add_rounding(torch.linalg.vector_norm(rho, dim=0))
        for calls in self._groups.values():
            for sq, rho in _grouped_norms_and_rounding(calls):
                self._add_sq_and_rounding(sq, rho)
        self._flush_formed(self._hold_grads)
        packs, rest = self._packed(list(self._materialized))
        total = self._batch_sq(packs, rest)
        weights = self._flat_weights(total)
        for stacked, calls in chunks:
            for (module, *_), grads in zip(calls, stacked.clipped(calls, weights)):
                self._accumulate(module, grads)
        for (grouped, _), calls in self._groups.items():
            self._clip_group_into(grouped, calls, [weights] * len(calls))
        for layer, x, o, names in self._tape:
            self._clip_into(layer, x, o, weights, names)
        for p in rest:
            self._accumulate_param(p, weighted_sum(weights, self._materialized[p]))
        for params, flat in packs:
            self._accumulate_packed(params, weighted_sum(weights, flat))
        workspace.recycle(self._materialized.values())
        self._close_backward(total, weights)

    def _flush_per_layer_stacks(self) -> None:
        """Clip the held small calls: per call, its own norms against its group's bound c_i·C_k.
        The weights of every held call come from one clip-weight computation over their (n, B)
        norms, whatever the number of stacks (host time: a few ops per flush, not per stack)."""
        chunks = self._stack_chunks()
        self._stacks, self._stack_bytes = {}, 0
        if not chunks:
            return
        sq, rho = zip(*(_stack_norms_and_rounding(stacked, calls) for stacked, calls in chunks))  # (n_j, B) each
        sq = sq[0] if len(sq) == 1 else torch.cat(sq)
        if any(r is not None for r in rho):  # chunks without a bound add nothing: ρ = 0 there
            rho = torch.cat([torch.zeros(len(calls), sq.shape[1], dtype=sq.dtype, device=sq.device) if r is None
                             else r.to(sq.dtype) for r, (_, calls) in zip(rho, chunks)])
        else:
            rho = None
        groups = [tuple(self._layer[call[0]].group for call in calls) for _, calls in chunks]
        all_groups = sum(groups, ())
        margins = [rounding_margin(calls[0][2]) for _, calls in chunks]
        if len(set(margins)) == 1:
            bounds = self._group_bounds(sq, margins[0], all_groups)
        else:  # stacks computed in different precisions keep their own margins
            bounds = torch.cat([self._group_bounds(sq, m, g) for m, g in zip(margins, groups)])
        weights = self._weights(sq, bounds, rho)
        start = 0
        for stacked, calls in chunks:
            for (module, *_), grads in zip(calls, stacked.clipped(calls, weights[start:start + len(calls)])):
                self._accumulate(module, grads)
            start += len(calls)
        if self.keep_group_norms:
            for group, row in zip(all_groups, sq.unbind(0)):
                self._add_group_sq(group, row)
        self._add_sq(sq.sum(0))

    def _group_bounds(self, sq: torch.Tensor, margin: float, groups: tuple) -> torch.Tensor:
        """(n, B) bounds c_i·C_k of clipping groups ``groups`` (one row each), gathered in one op;
        the gather's index is kept across batches (the same stacks recur every step)."""
        key = (sq.device, sq.dtype, margin, groups)
        bounds = self._bounds.get(key)
        if bounds is None:
            index = self._layout_tensor((sq.device, groups), lambda: torch.tensor(groups, dtype=torch.int64),
                                        "a per-layer stack index")
            bounds = self._bounds[key] = self._bounds_for(sq.device, sq.dtype, margin).index_select(0, index)
        return bounds

    def _layout_tensor(self, key: tuple, build, what: str) -> torch.Tensor:
        """A tensor that depends only on the model's layout (``build()`` on the host), moved to the
        device ``key[0]`` once (queued, from pinned memory) and kept across batches in ``_group_index``."""
        t = self._group_index.get(key)
        if t is None:
            device = key[0]
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{what} must be built before CUDA graph capture (warm up the step eagerly first)")
            t = build()
            if device.type == "cuda":
                t = t.pin_memory()
            t = self._group_index[key] = t.to(device, non_blocking=True)
        return t

    def _finish_per_layer(self) -> None:
        """End of a per-layer backward: held calls, and groups used more than once."""
        self._flush_run()
        self._flush_formed(self._clip_or_hold)
        self._flush_per_layer_stacks()
        groups = sorted({self._param_group[id(p)] for p in self._materialized})
        by_group = {k: [p for p in self._group_params[k] if p in self._materialized] for k in groups}
        small = {}  # groups whose formed gradients are all small, by dtype and device: packed
        for k, done in by_group.items():
            grads = [self._materialized[p] for p in done]
            key = (grads[0].dtype, grads[0].device)
            if all(g.numel() * g.element_size() <= PACK_BYTES and (g.dtype, g.device) == key for g in grads):
                small.setdefault(key, []).append(k)
        for ks in small.values():
            if len(ks) > 1:
                self._clip_packed_groups(ks, by_group)
                for k in ks:
                    del by_group[k]
        for k, done in by_group.items():
            grads = [self._materialized[p] for p in done]
            sq = sq_norms_of(grads)
            weights = self._group_weights(sq, k, *grads)
            for p, g in zip(done, grads):
                self._accumulate_param(p, weighted_sum(weights, g))
            workspace.recycle(grads)
            self._add_group_sq(k, sq)
            self._add_sq(sq)
        workspace.recycle(self._materialized.values())
        self._materialized, self._owned = {}, set()
        self._close_backward(self._batch_sq(), None)

    def _clip_packed_groups(self, groups: list, by_group: dict) -> None:
        """Per-layer clipping of several groups' small formed gradients at once: (B, N) side by side,
        a (K, N) 0/1 matrix S of which group each column is in (kept across batches), then
        ‖g_{k,i}‖² = (S (g²)ᵀ)_{k,i}, weights (K, B) in one clip-weight computation, and the clipped
        sums Σ_i w_{k(j),i} g_{i,j} of every column j = ((Sᵀ W) ⊙ gᵀ) summed over i."""
        params = [p for k in groups for p in by_group[k]]
        B = self._materialized[params[0]].shape[0]
        flat = torch.cat([self._materialized[p].reshape(B, p.numel()) for p in params], 1)
        layout = tuple((k, sum(p.numel() for p in by_group[k])) for k in groups)

        def membership():
            member = torch.zeros(len(groups), flat.shape[1], dtype=acc_dtype(flat))
            start = 0
            for row, (_, n) in enumerate(layout):
                member[row, start:start + n] = 1
                start += n
            return member

        member = self._layout_tensor((flat.device, flat.dtype, layout), membership, "a per-layer pack layout")
        acc = flat if flat.dtype == member.dtype else flat.to(member.dtype)  # fp32 for fp16/bf16
        sq = member.mm(acc.square().t())  # (K, B)
        weights = self._weights(sq, self._group_bounds(sq, rounding_margin(flat), tuple(groups)))
        summed = (member.t().mm(weights) * acc.t()).sum(1)  # (N,), in the accumulation dtype
        self._accumulate_packed(params, summed)
        if self.keep_group_norms:
            for k, row in zip(groups, sq.unbind(0)):
                self._add_group_sq(k, row)
        self._add_sq(sq.sum(0))

    def _close_backward(self, total_sq, weights) -> None:
        group_sq = None
        if self.keep_group_norms and self.clipping == "per_layer":
            zeros = torch.zeros_like(total_sq)  # a group no record reached this backward: norm 0
            group_sq = torch.stack([self._group_sq.get(k, zeros).to(total_sq.dtype)
                                    for k in range(len(self.group_names))])
        self._clipped(total_sq, None if weights is None else weights / self.loss_scale, group_sq)
        if total_sq.device.type == "cpu" and CHECK_FINITE_ON_CPU:   # (on a GPU it would stop the host)
            self._refuse_nonfinite(total_sq)

    def _refuse_nonfinite(self, total_sq: torch.Tensor) -> None:
        """Refuse a batch in which a record's per-sample gradient norm is NaN or inf: its clip weight
        is then NaN (or its terms are), and the clipped sum, the update and the model with it, turn
        NaN, a change one record makes that no noise hides. The batch stays CLIPPED, so that
        ``zero_grad()`` discards the draw, and a step on it is refused (``check_finite``). A padding
        row (mask 0) counts: it copies a record of the dataset, and its weight 0 times NaN is NaN in
        the sum all the same, so a record that was not drawn would turn the model NaN unseen.

        Under ``torch.distributed`` (``nonfinite_anywhere`` set) every rank refuses the batch when any
        rank's share holds such a record: a rank that discarded the draw while another released its share
        would leave the summed step with part of the draw (and the run unlike the single-process one)."""
        rows = _nonfinite_rows(total_sq)
        # every rank takes the collective, whether its own share holds such a record or not
        anywhere = bool(rows) if self.nonfinite_anywhere is None else self.nonfinite_anywhere(bool(rows))
        if anywhere and not rows:
            self._nonfinite = ("another rank's share of the draw holds a record whose per-sample gradient norm is NaN "
                               "or inf (that rank's error names the rows); every rank refuses the batch, so that all "
                               "discard the same draw")
            raise FloatingPointError(f"{self._nonfinite}. Call optimizer.zero_grad() to discard the draw, then "
                                     "optimizer.step() (noise only), as every rank does")
        if not rows:
            return
        self._nonfinite = _nonfinite_message(rows, self._records) + ". Their clipped sum would turn the model NaN"
        raise FloatingPointError(f"{self._nonfinite}. Call optimizer.zero_grad() to discard the draw, then "
                                 "optimizer.step() (noise only), and check the data (pdpfast train refuses non-finite "
                                 "features) and the loss")

    def check_finite(self, wait: bool = False) -> None:
        """Refuse a step on a draw whose clipped sums are not finite: ``_refuse_nonfinite`` raised in
        its backward (norms on the CPU), or the deferred check of a GPU's norms finds it now. A GPU's
        norms reach the host without stopping it (``DEFERRED_CHECK_DEVICES``) and are read here once
        there: at the draw's own step when the GPU has finished its backward by then, else at a later
        step, after the draw's step was applied (the error then says so: raised once, for the first
        such draw; the draws stepped after it, on its parameters, are not reported again). Under
        torch.distributed every rank reads them at the step after their draw's, so that all refuse the
        same step (``_read_deferred``): every rank must then call this at the same points (a rank that
        alone waits would read, and raise, before the others).

        Args:
            wait: wait for every copy on its way (a host synchronisation: at the end of a run, before
                a checkpoint), so that the last draws are checked too.
        Returns:
            None.
        Raises:
            FloatingPointError saying which records.
        """
        if self._deferred:
            self._read_deferred(wait=wait)
        self.refused_nonfinite = self._applied_error is not None or self._nonfinite is not None
        if self._applied_error is not None:
            message, self._applied_error = self._applied_error, None
            if self.pending:  # the open draw's sums came from the parameters that step made NaN
                self._nonfinite = ("this draw's clipped sums were computed after an earlier draw's step made the "
                                   "parameters NaN or inf")
            raise FloatingPointError(message + ". Call optimizer.zero_grad() to discard the open draw, then "
                                     "optimizer.step() (noise only)")
        if self._nonfinite is not None:
            raise FloatingPointError(f"the step is refused: {self._nonfinite}. Call optimizer.zero_grad() to discard "
                                     "the draw, then optimizer.step() (noise only): the loader's next draw waits for "
                                     "it")

    def defer_finite_check(self, total_sq: torch.Tensor) -> None:
        """Queue the copy of a backward's (B,) norms to the host for ``check_finite`` (no stall): on a
        device of ``DEFERRED_CHECK_DEVICES`` where the engine reads them (``defer_checks``), outside a
        capture. ``_clipped`` calls it, and a captured step after the replay that follows its capture
        (whose backward ``_clipped`` saw inside the capture). Under torch.distributed
        (``nonfinite_reduce``) the norms' flag is summed over the ranks too (a collective on the
        device: every rank calls this once a physical batch, and runs as many), so that every rank
        reads one verdict.

        Args:
            total_sq: the (B,) squared norms, on their device.
        Returns:
            None.
        """
        if not self.defer_checks or total_sq.device.type not in DEFERRED_CHECK_DEVICES:
            return
        distributed = self.nonfinite_anywhere is not None
        if distributed and self.nonfinite_reduce is None:
            return  # (a state given a verdict by hand, but no way to reach one on the device)
        if total_sq.is_cuda:
            with torch.cuda.device(total_sq.device):
                if torch.cuda.is_current_stream_capturing():
                    return
        if len(self._deferred) >= MAX_DEFERRED_CHECKS:
            self._read_deferred(wait_oldest=True)
        flag = None
        if distributed:
            flag = total_sq.detach().mul(0).sum().view(1)  # 0, or NaN where a row is NaN or inf (no overflow)
            self.nonfinite_reduce(flag)
        self._deferred.append(_DeferredCheck(total_sq, self._records, flag, self.draw))

    def _read_deferred(self, wait_oldest: bool = False, wait: bool = False) -> None:
        """Read the deferred checks whose copies are done, in order (``wait_oldest``: wait for the
        first; ``wait``: for all). Never raises (a backward calls it, past ``MAX_DEFERRED_CHECKS``):
        a non-finite row of the open draw refuses its step (``_nonfinite``); one of a draw already
        stepped is kept for ``check_finite`` to raise (``_applied_error``), and the other stepped
        draws' checks go with it (they ran on the parameters that draw made NaN).

        Under torch.distributed (checks with a ``flag``) a copy is read where every rank reads it,
        whatever its GPU's pace: once its draw's step was taken (at the next step, waiting for it),
        and where ``wait`` or ``wait_oldest`` say (points every rank reaches alike); never at its
        draw's own step, which every rank therefore applies."""
        pending = []
        for i, check in enumerate(self._deferred):
            forced = wait or (wait_oldest and i == 0)
            if check.flag is not None:
                due = not pending and (forced or check.applied) and check.ready(wait=True)
            else:
                due = not pending and check.ready(wait=forced)
            if not due:
                pending.append(check)  # (in order: a later copy is read after the earlier ones)
                continue
            rows, records = _nonfinite_rows(check.sq), check.records
            elsewhere = not rows and check.flag is not None and not math.isfinite(float(check.flag))
            if elsewhere:  # this rank's own later batches of the draw may hold one too: name it then
                own = [(r, c.records) for c in self._deferred[i + 1:] if c.flag is not None and c.draw == check.draw
                       and c.applied == check.applied and c.ready(wait=True) for r in [_nonfinite_rows(c.sq)] if r]
                if own:
                    (rows, records), elsewhere = own[0], False
            if elsewhere:
                found = ("another rank's share of the draw holds a record whose per-sample gradient norm is NaN or "
                         "inf (that rank's error names it)")
            elif rows:
                found = _nonfinite_message(rows, records)
            else:
                continue
            if check.applied:
                if self._applied_error is None:
                    when = ("Under torch.distributed every rank reads the norms after their draw's step (at the next "
                            "step, a checkpoint or the end of the run), so that all refuse the same step"
                            if check.flag is not None else
                            "On a GPU the norms reach the host without stopping it, here after that draw's step was "
                            "applied")
                    self._applied_error = (
                        f"the step is refused: in an earlier draw, {found}. {when}: the model's parameters may now "
                        "be NaN or inf. Restore them from a checkpoint, and check the data (pdpfast train refuses "
                        "non-finite features) and the loss")
                pending = [c for c in self._deferred[i + 1:] if not c.applied]
                break
            if self._nonfinite is None:
                self._nonfinite = found + (
                    ". Read on the host after the backward (a GPU's norms are not waited for); this draw's "
                    "clipped sum would turn the model NaN")
        self._deferred = pending

    def _clipped(self, total_sq, last_weights, group_sq) -> None:
        """The batch's clipped sums are in ``param.grad``: keep what the backward leaves besides them
        (``clipped_outputs``), and the batch is CLIPPED with its draw pending. A GPU's norms (of an eager
        backward, or of a captured one replayed) start for the host (``defer_finite_check``)."""
        self.defer_finite_check(total_sq)
        self._total_sq, self.last_weights, self._last_group_sq = total_sq, last_weights, group_sq
        self._reset_backward()
        self.pending = True
        self._enter(Phase.CLIPPED)
        for hook in self.post_backward_hooks:
            hook(self)
        self._written = [(g, None if g is None else g._version) for g in (p.grad for _, p in self._clipped_params)]

    def check_clipped_sums_unchanged(self) -> None:
        """Refuse a step (or a draw's next physical batch) on clipped sums that were changed after the
        backward wrote them: in place (``torch.nn.utils.clip_grad_norm_``, ``p.grad.mul_``) or replaced. The
        noise is calibrated to Σ_i w_i g_i with each record within c_i; a change that scales the sum up or
        adds to it would release more than the noise covers, and a clip of it only shrinks the signal
        against the same noise (Opacus overwrites ``.grad`` at the step, where such a call does nothing).
        Changes through ``.data``, which keeps no version, are not seen; neither are torch.amp.GradScaler's
        (its unscale keeps the versions: ``DPOptimizer`` refuses the scaler itself).

        Returns:
            None.
        Raises:
            RuntimeError naming the first parameter whose clipped sum changed.
        """
        written = self._written
        if written is None:
            return
        for (name, p), (grad, version) in zip(self._clipped_params, written):
            now = p.grad
            if now is grad and (now is None or now._version == version):
                continue
            how = "changed in place" if now is grad else "replaced"
            raise RuntimeError(
                f"the clipped gradient of {name} was {how} between the backward and optimizer.step() (e.g. by "
                "torch.nn.utils.clip_grad_norm_, or an edit of .grad). Here .grad holds the sum of the records' "
                "gradients, each already clipped to its bound c_i, and the step's noise is calibrated to that sum: "
                "a change that scales it up or adds to it releases more than the noise covers, and a clip of it "
                "only shrinks the signal against the same noise. Remove the change (per-sample clipping replaces "
                "gradient clipping: make_private's max_grad_norm / clip_norms); to drop the draw instead, call "
                "optimizer.zero_grad() and then optimizer.step()")

    def clipped_outputs(self) -> tuple:
        """What a backward leaves besides ``param.grad``. A captured step (``pdpfast.graphs``) holds
        these tensors of its capture: every replay rewrites them in place.

        Returns:
            (total squared norms (B,), last weights w_i (B,), group squared norms (K, B) or None); each
            None before a backward.
        """
        return self._total_sq, self.last_weights, self._last_group_sq

    def replayed_backward(self, outputs: tuple) -> None:
        """Record that a replayed backward (a CUDA graph of the open batch's forward and backward)
        wrote the batch's clipped sums: the batch is CLIPPED and its draw pending, as after a
        backward run here.

        Args:
            outputs: ``clipped_outputs()`` of the capture.
        Returns:
            None; the post-backward hooks run.
        Raises:
            RuntimeError unless a batch is open.
        """
        if self.phase is not Phase.OPEN:
            self._refuse_forward()
        self._clipped(*outputs)

    def _reset_backward(self) -> None:
        self._sq_parts: list[torch.Tensor] = []  # (B,) squared norms of each layer, group or stack
        self._rho_parts: list[torch.Tensor] = []  # (B,) ρ_i of each layer or stack that rounds (flat clipping)
        self._tape: list = []
        self._groups: dict = {}  # (Grouped, key) -> calls whose norms take one launch, and clipped sums one pass (flat)
        self._formed: dict = {}  # (Grouped, key) -> held calls whose per-sample gradients take one launch
        self._formed_bytes = 0   # their inputs' and output gradients' bytes (``_hold_limit()`` at most)
        self._formed_grads = 0   # where counted: their per-sample gradients' and sums' bytes (_below_backward_start)
        self._run: list = []     # per-layer clipping: consecutive calls of one key held for one norm launch
        self._run_key = None
        self._run_bytes = 0      # their inputs' and output gradients' bytes (``_hold_limit()`` at most)
        self._run_grads = 0      # where counted: the bytes of their clipped sums (_below_backward_start)
        self._run_scratch = 0    # and of the largest scaled operand one of them takes
        self._passed_bytes = 0   # per-layer clipping: the inputs of the calls its backward has reached
        self._passed_input = 0   # id() of the last of them
        self._started = False     # per-layer clipping: its backward's first call came
        self._start_bytes = None  # (device, its allocated bytes) then, on the full-size route where counted
        self._cleared = 0         # held bytes the last read of the device left room for (_below_backward_start)
        self._stacks: dict = {}
        self._stack_bytes = 0
        self._materialized: dict[nn.Parameter, torch.Tensor] = {}
        self._owned: set[nn.Parameter] = set()  # those of _materialized's tensors that may be added into in place
        self._held_bytes = 0  # per-layer clipping: small formed gradients held to the end of the backward
        self._group_sq: dict[int, torch.Tensor] = {}
        self._queued = False
        self._margin = 0.0
        self._reused: frozenset | None = None

    @property
    def last_norms(self) -> torch.Tensor | None:
        """(B,) per-sample gradient norms (all parameters) before clipping, of the last backward; None before one.

        In units of the per-sample loss's gradient (the backward's norms times ``loss_scale``).
        """
        if self._total_sq is None:
            return None
        return self._total_sq.clamp_min(0).sqrt() * self.loss_scale

    @property
    def last_rounding(self) -> torch.Tensor | None:
        """(B,) ρ_i of the last backward (flat clipping): the bound on how far rounding takes a record's
        clipped sums over positions from w_i·g_i (``pdpfast.nn.rules.LayerRule.rounding``), in the
        units of ``last_norms``. The weights clip ‖g_i‖ + ρ_i to c_i, so a clipped record keeps
        ‖g_i‖ / (‖g_i‖ + ρ_i) of its bound. None where no layer's clipped sum rounds more than fp32
        (fp32 on a CPU, fp64), and for per-layer clipping (each group has its own).
        """
        if self._last_rho is None:
            return None
        return self._last_rho * self.loss_scale

    @property
    def last_group_norms(self) -> torch.Tensor | None:
        """(K, B) per-sample gradient norms of each clipping group before clipping, of the last
        backward (per-layer clipping with ``keep_group_norms`` set; None otherwise)."""
        if self._last_group_sq is None:
            return None
        return self._last_group_sq.clamp_min(0).sqrt() * self.loss_scale

    def ghost_backward(self, losses: torch.Tensor) -> None:
        """Two backwards over per-sample losses: norms, then the clipped sums.

        The second backward is the first one again (Σ_i ℓ_i), and each layer weighs its own terms by
        w_i as book-keeping does, rather than backpropagating Σ_i w_i ℓ_i: in a low precision that
        would round every scaled gradient on its way down through the layers, which no per-layer
        bound covers. Each layer's clipped sum then rounds as its rule bounds (``LayerRule.rounding``).

        Args:
            losses: (B,) per-sample losses of the open batch.
        Returns:
            None; the clipped sums are in ``param.grad`` and the state is ``CLIPPED``.
        Raises:
            RuntimeError outside mode "ghost" or without an open batch; ValueError for losses not of shape (B,).
        """
        if self.mode != "ghost":
            raise RuntimeError("ghost_backward is for mode='ghost'")
        if self.phase is not Phase.OPEN:
            self._refuse_forward()
        if losses.dim() != 1 or losses.shape[0] != self.batch_size:
            raise ValueError(f"per-sample losses must have shape ({self.batch_size},), got {tuple(losses.shape)}")
        self._enter(Phase.GHOST_NORMS)
        try:
            losses.sum().backward(retain_graph=True)
            total = self._batch_sq()
            weights = self._flat_weights(total)
            self._materialized, self._owned = {}, set()
            self._ghost_weights = weights
            self._enter(Phase.GHOST_GRADS)
            losses.sum().backward()
        except BaseException:
            self._reset_backward()
            self._enter(Phase.OPEN)
            raise
        finally:
            self._ghost_weights = None
        self._close_backward(total, weights)

    # ------------------------------------------------------------------ gradients

    def _clip_group_into(self, grouped, calls: list, weights: list) -> None:
        """Add the clipped sums of calls (layer, names, x, o) of one ``Grouped`` key into their
        parameters' ``.grad``, ``weights`` one per call: all in one pass where the rule's
        ``Grouped.clipped_into`` takes them, else each as ``_clip_into``."""
        if grouped.clipped_into is None or \
                not grouped.clipped_into([(layer.module, x, o, names) for layer, names, x, o in calls], weights):
            for (layer, names, x, o), w in zip(calls, weights):
                self._clip_into(layer, x, o, w, names)

    def _clip_into(self, layer: _Layer, x, o, weights, names: tuple) -> None:
        """Add one call's clipped sums Σ_i w_i g_i into its parameters' ``.grad``: by the rule's
        ``clipped_into`` where it takes the call (one call of compiled code), else ``clipped``."""
        rule = layer.rule
        if rule.clipped_into is None or not rule.clipped_into(layer.module, x, o, weights, names):
            self._accumulate(layer.module, rule.clipped(layer.module, x, o, weights, names))

    def _accumulate(self, module: nn.Module, grads: dict) -> None:
        params = module._parameters
        for name, g in grads.items():
            self._accumulate_param(params[name], g)

    @staticmethod
    def _accumulate_param(p: nn.Parameter, g: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # a backward with create_graph=True; a no_grad decorator would cost
            with torch.no_grad():    # ~10 µs on every call, hundreds of times per step
                return ClippingState._accumulate_param(p, g)
        if g.dtype != p.dtype:
            g = g.to(p.dtype)
        if g.shape != p.shape:
            g = g.reshape(p.shape)
        if p.grad is None:
            p.grad = g.clone() if g.data_ptr() == p.data_ptr() else g.contiguous()
        else:
            p.grad.add_(g)
