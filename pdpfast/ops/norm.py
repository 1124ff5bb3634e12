"""LayerNorm / GroupNorm / RMSNorm per-sample gradients (DESIGN.md §2).

The affine weight's per-sample gradient is Σ_t o_{i,t} ⊙ x̂_{i,t} with x̂ the normalized input,
the bias's is Σ_t o_{i,t}; both are as small as the parameters, so they are materialized.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import workspace

# On a CPU, a large batch is taken a few samples at a time, so that x̂ and o ⊙ x̂ (each as large as
# the input) stay in an L2 cache instead of costing two fresh full-size buffers and their page
# faults (GroupNorm CNN benchmark, 64 x 32 x 32 x 32 input: 2.2 -> 1.7 ms alone, ~2x more in a
# step). This many elements per thread (512 KiB in fp32).
_CPU_CHUNK_ELEMENTS = 1 << 17


def _by_batch_chunks(per_sample_grads):
    """``per_sample_grads(x, o, module)`` run on cache-sized slices of the batch on a CPU."""
    @functools.wraps(per_sample_grads)
    def wrapper(x, o, module):
        B = x.shape[0]
        per_sample = x[0].numel() if B else 0
        chunk = _CPU_CHUNK_ELEMENTS * torch.get_num_threads()
        if x.device.type != "cpu" or B * per_sample <= chunk:
            return per_sample_grads(x, o, module)
        out = None
        for samples in workspace.batch_chunks(B, per_sample, chunk):
            part = per_sample_grads(x[samples], o[samples], module)
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
def layer_norm_per_sample_grads(x, o, module) -> dict[str, torch.Tensor]:
    """Per-sample gradients of a LayerNorm's affine parameters: Σ_t o_{i,t} ⊙ x̂_{i,t} and Σ_t o_{i,t}.

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
def rms_norm_per_sample_grads(x, o, module) -> dict[str, torch.Tensor]:
    """Per-sample gradient of an RMSNorm's weight: Σ_t o_{i,t} ⊙ x̂_{i,t}, x̂ = x / RMS(x).

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


@_by_batch_chunks
def group_norm_per_sample_grads(x, o, module) -> dict[str, torch.Tensor]:
    """Per-sample gradients of a GroupNorm's per-channel affine parameters, summed over positions.

    On a CPU a large batch is taken a few samples at a time (the same result, cache-sized temporaries).

    Args:
        x: (B, C, *spatial) the layer's input (no spatial dims: (B, C)).
        o: like ``x``, the gradient of the summed loss w.r.t. the layer's output.
        module: supplies ``num_groups``, ``eps`` and ``bias`` (None: no bias gradient).
    Returns:
        {"weight": (B, C)} in ``x``'s dtype, plus "bias": (B, C) in ``o``'s dtype when the module has
        a bias.
    """
    # weights are per channel (dim 1): sum over the spatial dims only
    x_hat = F.group_norm(x, module.num_groups, None, None, module.eps)
    spatial = list(range(2, x.dim()))
    out = {"weight": x_hat.mul_(o).sum(spatial) if spatial else x_hat.mul_(o)}
    if module.bias is not None:
        out["bias"] = o.sum(spatial) if spatial else o
    return out


@_by_batch_chunks
def instance_norm_per_sample_grads(x, o, module) -> dict[str, torch.Tensor]:
    """Per-sample gradients of an InstanceNorm1d/2d/3d's per-channel affine parameters.

    On a CPU a large batch is taken a few samples at a time (the same result, cache-sized temporaries).

    Args:
        x: (B, C, *spatial) the layer's input, at least one spatial dim.
        o: like ``x``, the gradient of the summed loss w.r.t. the layer's output.
        module: supplies ``eps`` and ``bias`` (None: no bias gradient); running statistics are not used.
    Returns:
        {"weight": (B, C)} in ``x``'s dtype, plus "bias": (B, C) in ``o``'s dtype when the module has
        a bias.
    """
    # instance norm normalizes each (sample, channel) over its positions: GroupNorm with C groups
    x_hat = F.instance_norm(x, eps=module.eps)
    spatial = list(range(2, x.dim()))
    out = {"weight": x_hat.mul_(o).sum(spatial)}
    if module.bias is not None:
        out["bias"] = o.sum(spatial)
    return out
