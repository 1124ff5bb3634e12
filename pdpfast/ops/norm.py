"""LayerNorm / GroupNorm / RMSNorm per-sample gradients (DESIGN.md §2).

The affine weight's per-sample gradient is Σ_t o_{i,t} ⊙ x̂_{i,t} with x̂ the normalized input,
the bias's is Σ_t o_{i,t}; both are as small as the parameters, so they are materialized.

LayerNorm, RMSNorm and GroupNorm/InstanceNorm dispatch (``pdpfast.ops.dispatch``): where the
kernels run, one Triton launch per call (``pdpfast.kernels.norm_grads``) instead of the reference's
four ops.

GroupNorm and InstanceNorm on CPU fp32/fp64 tensors take the C++ kernel of ``pdpfast._C``
(``csrc/norms.cpp``): one call that reads x and o from memory once, where the torch route is a dozen ops
per cache-sized chunk of samples (GroupNorm CNN benchmark, 64 × 32 × 32 × 32: 0.21 against 0.69 ms
on two threads; the bk step 1.29 → 1.25× non-private). ``group_norm_kernel`` says which route runs;
without the extension, torch's.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .. import _ext
from . import workspace
from .dispatch import declare

# the compiled extension is optional: without it, the torch route below runs
_C = _ext._C
_CPP_MISSING = _ext.missing("group_norm_per_sample_grads_cpu", "norms.cpp")

# On a CPU, a large batch is taken a few samples at a time, so that x̂ and o ⊙ x̂ (each as large as
# the input) stay in an L2 cache instead of costing two fresh full-size buffers and their page
# faults (GroupNorm CNN benchmark, 64 x 32 x 32 x 32 input: 2.2 -> 1.7 ms alone, ~2x more in a
# step). This many elements per thread (512 KiB in fp32).
_CPU_CHUNK_ELEMENTS = 1 << 17


def _by_batch_chunks(per_sample_grads):
    """``per_sample_grads(x, o, *args)`` run on cache-sized slices of the batch on a CPU."""
    @functools.wraps(per_sample_grads)
    def wrapper(x, o, *args):
        B = x.shape[0]
        per_sample = x[0].numel() if B else 0
        chunk = _CPU_CHUNK_ELEMENTS * torch.get_num_threads()
        if x.device.type != "cpu" or B * per_sample <= chunk:
            return per_sample_grads(x, o, *args)
        out = None
        for samples in workspace.batch_chunks(B, per_sample, chunk):
            part = per_sample_grads(x[samples], o[samples], *args)
            if out is None:
                out = {name: g.new_empty((B, *g.shape[1:])) for name, g in part.items()}
            for name, g in part.items():
                out[name][samples] = g
        return out
    return wrapper


def _sum_to(per_elem: torch.Tensor, trailing: int) -> torch.Tensor:
    """Sum (B, ..., *shape) over the middle dims, keeping the batch and the last ``trailing`` dims."""
    middle = list(range(1, per_elem.dim() - trailing))
    return per_elem.sum(middle) if middle else per_elem


@_by_batch_chunks
def layer_norm_per_sample_grads_reference(x, o, module) -> dict[str, torch.Tensor]:
    """Per-sample gradients of a LayerNorm's affine parameters: Σ_t o_{i,t} ⊙ x̂_{i,t} and Σ_t o_{i,t},
    in plain torch (four ops: x̂ formed again, its product with o, two sums over the positions).

    On a CPU a large batch is taken a few samples at a time (the same result, cache-sized temporaries).

    Args:
        x: (B, ..., *normalized_shape) the layer's input.
        o: like ``x``, the gradient of the summed loss w.r.t. the layer's output.
        module: supplies ``normalized_shape``, ``eps`` and ``bias`` (None: no bias gradient).
    Returns:
        {"weight": (B, *normalized_shape)} in ``x``'s dtype, plus "bias": (B, *normalized_shape) in
        ``o``'s dtype when the module has a bias.
    """
    shape = tuple(module.normalized_shape)
    x_hat = F.layer_norm(x, shape, None, None, module.eps)
    out = {"weight": _sum_to(x_hat.mul_(o), len(shape))}  # x_hat is fresh: o ⊙ x̂ in place
    if getattr(module, "bias", None) is not None:
        out["bias"] = _sum_to(o, len(shape))
    return out


@_by_batch_chunks
def rms_norm_per_sample_grads_reference(x, o, module) -> dict[str, torch.Tensor]:
    """Per-sample gradient of an RMSNorm's weight: Σ_t o_{i,t} ⊙ x̂_{i,t}, x̂ = x / RMS(x), in plain torch.

    On a CPU a large batch is taken a few samples at a time (the same result, cache-sized temporaries).

    Args:
        x: (B, ..., *normalized_shape) the layer's input.
        o: like ``x``, the gradient of the summed loss w.r.t. the layer's output.
        module: supplies ``normalized_shape`` and ``eps`` (None: torch's default for the dtype).
    Returns:
        {"weight": (B, *normalized_shape)} in ``x``'s dtype.
    """
    shape = tuple(module.normalized_shape)
    x_hat = F.rms_norm(x, shape, None, module.eps)
    return {"weight": _sum_to(x_hat.mul_(o), len(shape))}


def layer_norm_per_sample_grads_grouped_reference(calls: list, module) -> list:
    """Per-sample gradients of n LayerNorm calls of one module configuration, one call at a time
    (``layer_norm_per_sample_grads``: a kernel launch each where it runs).

    Args:
        calls: n ≥ 1 pairs (x, o) as ``layer_norm_per_sample_grads`` takes them.
        module: supplies ``normalized_shape``, ``eps`` and ``bias`` for every call.
    Returns:
        a list of n dicts, call c's what ``layer_norm_per_sample_grads(x_c, o_c, module)`` gives.
    """
    return [layer_norm_per_sample_grads(x, o, module) for x, o in calls]


def rms_norm_per_sample_grads_grouped_reference(calls: list, module) -> list:
    """``layer_norm_per_sample_grads_grouped_reference`` for RMSNorm calls (``rms_norm_per_sample_grads``).

    Args:
        calls: n ≥ 1 pairs (x, o); module: supplies ``normalized_shape`` and ``eps``.
    Returns:
        a list of n dicts {"weight": (B, *normalized_shape)}.
    """
    return [rms_norm_per_sample_grads(x, o, module) for x, o in calls]


_LAYER_NORM_GRADS = declare("layer_norm_per_sample_grads", layer_norm_per_sample_grads_reference)
_RMS_NORM_GRADS = declare("rms_norm_per_sample_grads", rms_norm_per_sample_grads_reference)
_LAYER_NORM_GRADS_GROUPED = declare("layer_norm_per_sample_grads_grouped",
                                    layer_norm_per_sample_grads_grouped_reference)
_RMS_NORM_GRADS_GROUPED = declare("rms_norm_per_sample_grads_grouped", rms_norm_per_sample_grads_grouped_reference)


def layer_norm_per_sample_grads(x, o, module) -> dict[str, torch.Tensor]:
    """A LayerNorm's per-sample affine gradients (``layer_norm_per_sample_grads_reference``): one
    kernel launch where it runs (``pdpfast.kernels.norm_grads``: x and o read once, x̂ never
    stored), else the reference's four ops.

    Args:
        x, o, module: as in the reference.
    Returns:
        {"weight": (B, *normalized_shape)} in ``x``'s dtype, plus "bias" in ``o``'s dtype when the
        module has one.
    """
    return _LAYER_NORM_GRADS.pick(x, o)(x, o, module)


def rms_norm_per_sample_grads(x, o, module) -> dict[str, torch.Tensor]:
    """An RMSNorm's per-sample weight gradient (``rms_norm_per_sample_grads_reference``): the
    LayerNorm kernel without centring where it runs, else the reference.

    Args:
        x, o, module: as in the reference.
    Returns:
        {"weight": (B, *normalized_shape)} in ``x``'s dtype.
    """
    return _RMS_NORM_GRADS.pick(x, o)(x, o, module)


def groups_norm_grads(x: torch.Tensor, o: torch.Tensor, family: str = "layer_norm") -> bool:
    """Whether normalization calls like this one would share a launch
    (``layer_norm_per_sample_grads_grouped``, ``rms_norm_per_sample_grads_grouped``,
    ``group_norm_affine_grads_grouped``): where their kernel runs (on a GPU, or under
    ``TRITON_INTERPRET=1``), outside a CUDA graph capture (the launch copies the calls' offsets from
    the host: a captured step has no host work to save anyway).

    A call the launch would turn down takes its own, and is not held for it: an empty one, one whose x
    or o does not start on a 16-byte boundary (the launch reads every call at an aligned offset), or whose rows
    (LayerNorm's last dim) or positions (GroupNorm's dims after the channels) are not contiguous (its
    own launch copies them first).

    Args:
        x: the call's input; o: its output gradient.
        family: "layer_norm" (LayerNorm and RMSNorm, one kernel) or "group_norm" (GroupNorm and
            InstanceNorm).
    Returns:
        a bool.
    """
    grouped = _GROUP_NORM_GRADS_GROUPED if family == "group_norm" else _LAYER_NORM_GRADS_GROUPED
    if grouped.pick(x, o) is grouped.reference or not x.numel() or x.data_ptr() % 16 or o.data_ptr() % 16:
        return False
    first = 2 if family == "group_norm" else x.dim() - 1
    if not (_contiguous_from(x, first) and _contiguous_from(o, first)):
        return False
    return not (o.is_cuda and torch.cuda.is_current_stream_capturing())


def _contiguous_from(t: torch.Tensor, first: int) -> bool:
    """Whether ``t``'s dims from ``first`` on are laid out contiguously, row-major (dims of size 1
    aside): what a kernel reading them as one run of elements needs."""
    expected = 1
    for size, stride in zip(reversed(t.shape[first:]), reversed(t.stride()[first:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def layer_norm_per_sample_grads_grouped(calls: list, module) -> list:
    """Per-sample gradients of n LayerNorm calls of one module configuration, shape, strides and dtype:
    one kernel launch for all of them where ``groups_norm_grads`` holds
    (``pdpfast.kernels.norm_grads``), else one per call (the reference).

    Args:
        calls: n ≥ 1 pairs (x, o) as ``layer_norm_per_sample_grads`` takes them, alike.
        module: supplies ``normalized_shape``, ``eps`` and ``bias`` for every call.
    Returns:
        a list of n dicts, call c's what ``layer_norm_per_sample_grads(x_c, o_c, module)`` gives.
    """
    return _LAYER_NORM_GRADS_GROUPED.pick(*calls[0])(calls, module)


def rms_norm_per_sample_grads_grouped(calls: list, module) -> list:
    """``layer_norm_per_sample_grads_grouped`` for RMSNorm calls.

    Args:
        calls: n ≥ 1 pairs (x, o) alike; module: supplies ``normalized_shape`` and ``eps``.
    Returns:
        a list of n dicts {"weight": (B, *normalized_shape)}.
    """
    return _RMS_NORM_GRADS_GROUPED.pick(*calls[0])(calls, module)


def group_norm_kernel(x: torch.Tensor, o: torch.Tensor) -> str:
    """Which route GroupNorm and InstanceNorm per-sample gradients take for these tensors.

    Args:
        x: the layer's input; o: the gradient w.r.t. its output.
    Returns:
        "C++ kernel" (``csrc/norms.cpp``: x and o read from memory once, sums in double) for CPU fp32/fp64 tensors
        of one dtype when ``pdpfast._C`` has it; otherwise "torch (<why>)".
    """
    if _CPP_MISSING is not None:
        return f"torch ({_CPP_MISSING})"
    if x.device.type != "cpu" or o.device.type != "cpu":
        return "torch (not CPU tensors)"
    if x.dtype not in (torch.float32, torch.float64) or o.dtype != x.dtype:
        return f"torch (dtypes {x.dtype} and {o.dtype}: the kernel takes fp32 or fp64, both alike)"
    if 0 in x.shape[2:]:
        return "torch (no positions: the kernel's means would be 0 / 0)"
    return "C++ kernel"


def group_norm_affine_grads_reference(x, o, num_groups: int, eps: float, with_bias: bool) -> dict[str, torch.Tensor]:
    """Per-sample gradients of a GroupNorm's per-channel affine parameters, summed over positions:
    Σ_s o_{i,c,s} x̂_{i,c,s} and Σ_s o_{i,c,s} (InstanceNorm: one channel per group).

    CPU fp32/fp64: the C++ kernel (``group_norm_kernel``); elsewhere four torch ops (x̂ formed
    again, its product with o, two sums), a large CPU batch a few samples at a time.

    Args:
        x: (B, C, *spatial) the layer's input (no spatial dims: (B, C)).
        o: like ``x``, the gradient of the summed loss w.r.t. the layer's output.
        num_groups: G, dividing C; eps: the layer's ε; with_bias: also the bias's gradient.
    Returns:
        {"weight": (B, C)} in ``x``'s dtype, plus "bias": (B, C) in ``o``'s dtype with ``with_bias``.
    """
    if group_norm_kernel(x, o) == "C++ kernel":
        weight, bias = _C.group_norm_per_sample_grads_cpu(x, o, num_groups, eps, with_bias)
        return {"weight": weight, "bias": bias} if with_bias else {"weight": weight}
    return _group_norm_grads_torch(x, o, num_groups, eps, with_bias)


@_by_batch_chunks
def _group_norm_grads_torch(x, o, num_groups: int, eps: float, with_bias: bool) -> dict[str, torch.Tensor]:
    # weights are per channel (dim 1): sum over the spatial dims only
    x_hat = F.group_norm(x, num_groups, None, None, eps)
    spatial = list(range(2, x.dim()))
    out = {"weight": x_hat.mul_(o).sum(spatial) if spatial else x_hat.mul_(o)}
    if with_bias:
        out["bias"] = o.sum(spatial) if spatial else o
    return out


def group_norm_affine_grads_grouped_reference(calls: list, num_groups: int, eps: float, with_bias: bool) -> list:
    """Per-sample affine gradients of n GroupNorm (or InstanceNorm) calls of one configuration, one call
    at a time (``group_norm_affine_grads``: a kernel launch each where it runs).

    Args:
        calls: n ≥ 1 pairs (x, o) as ``group_norm_affine_grads`` takes them.
        num_groups, eps, with_bias: as in ``group_norm_affine_grads``, for every call.
    Returns:
        a list of n dicts, call c's what ``group_norm_affine_grads(x_c, o_c, ...)`` gives.
    """
    return [group_norm_affine_grads(x, o, num_groups, eps, with_bias) for x, o in calls]


_GROUP_NORM_GRADS = declare("group_norm_affine_grads", group_norm_affine_grads_reference)
_GROUP_NORM_GRADS_GROUPED = declare("group_norm_affine_grads_grouped", group_norm_affine_grads_grouped_reference)


def group_norm_affine_grads(x, o, num_groups: int, eps: float, with_bias: bool) -> dict[str, torch.Tensor]:
    """GroupNorm's per-sample affine gradients (``group_norm_affine_grads_reference``): one Triton
    launch where the kernels run (``pdpfast.kernels.norm_grads``), else the reference.

    Args:
        x, o, num_groups, eps, with_bias: as in the reference.
    Returns:
        as the reference.
    """
    return _GROUP_NORM_GRADS.pick(x, o)(x, o, num_groups, eps, with_bias)


def group_norm_affine_grads_grouped(calls: list, num_groups: int, eps: float, with_bias: bool) -> list:
    """Per-sample affine gradients of n GroupNorm (or InstanceNorm) calls of one configuration, shape,
    strides and dtype: one kernel launch for all of them where ``groups_norm_grads`` holds
    (``pdpfast.kernels.norm_grads``), else one per call (the reference).

    Args:
        calls: n ≥ 1 pairs (x, o) as ``group_norm_affine_grads`` takes them, alike.
        num_groups, eps, with_bias: as in ``group_norm_affine_grads``, for every call.
    Returns:
        a list of n dicts, call c's what ``group_norm_affine_grads(x_c, o_c, ...)`` gives.
    """
    return _GROUP_NORM_GRADS_GROUPED.pick(*calls[0])(calls, num_groups, eps, with_bias)


def group_norm_per_sample_grads_grouped(calls: list, module) -> list:
    """``group_norm_per_sample_grads`` of n calls of one GroupNorm configuration, shape, strides and
    dtype (``group_norm_affine_grads_grouped``).

    Args:
        calls: n ≥ 1 pairs (x, o) alike; module: supplies ``num_groups``, ``eps`` and ``bias``.
    Returns:
        a list of n dicts, call c's what ``group_norm_per_sample_grads(x_c, o_c, module)`` gives.
    """
    return group_norm_affine_grads_grouped(calls, module.num_groups, module.eps, module.bias is not None)


def instance_norm_per_sample_grads_grouped(calls: list, module) -> list:
    """``instance_norm_per_sample_grads`` of n calls of one InstanceNorm configuration, shape, strides
    and dtype (``group_norm_affine_grads_grouped``, one channel a group).

    Args:
        calls: n ≥ 1 pairs (x, o) alike; module: supplies ``eps`` and ``bias``.
    Returns:
        a list of n dicts, call c's what ``instance_norm_per_sample_grads(x_c, o_c, module)`` gives.
    """
    return group_norm_affine_grads_grouped(calls, calls[0][0].shape[1], module.eps, module.bias is not None)


def group_norm_in_one_op(x: torch.Tensor, o: torch.Tensor) -> bool:
    """Whether a GroupNorm or InstanceNorm call's gradients take one op (the C++ kernel on a CPU,
    the Triton kernel where the kernels run): same-shape calls then gain nothing from stacking.

    Args:
        x: the layer's input; o: the gradient w.r.t. its output.
    Returns:
        a bool.
    """
    return _GROUP_NORM_GRADS.pick(x, o) is not _GROUP_NORM_GRADS.reference or group_norm_kernel(x, o) == "C++ kernel"


def group_norm_per_sample_grads(x, o, module) -> dict[str, torch.Tensor]:
    """Per-sample gradients of a GroupNorm's per-channel affine parameters, summed over positions
    (``group_norm_affine_grads``).

    Args:
        x: (B, C, *spatial) the layer's input (no spatial dims: (B, C)).
        o: like ``x``, the gradient of the summed loss w.r.t. the layer's output.
        module: supplies ``num_groups``, ``eps`` and ``bias`` (None: no bias gradient).
    Returns:
        {"weight": (B, C)} in ``x``'s dtype, plus "bias": (B, C) in ``o``'s dtype when the module has
        a bias.
    """
    return group_norm_affine_grads(x, o, module.num_groups, module.eps, module.bias is not None)


def instance_norm_per_sample_grads(x, o, module) -> dict[str, torch.Tensor]:
    """Per-sample gradients of an InstanceNorm1d/2d/3d's per-channel affine parameters.

    Instance norm is GroupNorm with one channel per group: the same op (``group_norm_affine_grads``).

    Args:
        x: (B, C, *spatial) the layer's input, at least one spatial dim.
        o: like ``x``, the gradient of the summed loss w.r.t. the layer's output.
        module: supplies ``eps`` and ``bias`` (None: no bias gradient); running statistics are not used.
    Returns:
        {"weight": (B, C)} in ``x``'s dtype, plus "bias": (B, C) in ``o``'s dtype when the module has
        a bias.
    """
    return group_norm_affine_grads(x, o, x.shape[1], module.eps, module.bias is not None)
