"""LayerNorm / GroupNorm / RMSNorm per-sample gradients (DESIGN.md §2).

The affine weight's per-sample gradient is Σ_t o_{i,t} ⊙ x̂_{i,t} with x̂ the normalized input,
the bias's is Σ_t o_{i,t}; both are as small as the parameters, so they are materialized.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _sum_to(per_elem: torch.Tensor, trailing: int) -> torch.Tensor:
    """Sum (B, ..., *shape) over the middle dims, keeping the batch and the last ``trailing`` dims."""
    middle = list(range(1, per_elem.dim() - trailing))
    return per_elem.sum(middle) if middle else per_elem


def layer_norm_per_sample_grads(x, o, module) -> dict[str, torch.Tensor]:
    shape = tuple(module.normalized_shape)
    x_hat = F.layer_norm(x, shape, None, None, module.eps)
    out = {"weight": _sum_to(o * x_hat, len(shape))}
    if getattr(module, "bias", None) is not None:
        out["bias"] = _sum_to(o, len(shape))
    return out


def rms_norm_per_sample_grads(x, o, module) -> dict[str, torch.Tensor]:
    shape = tuple(module.normalized_shape)
    x_hat = F.rms_norm(x, shape, None, module.eps)
    return {"weight": _sum_to(o * x_hat, len(shape))}


def group_norm_per_sample_grads(x, o, module) -> dict[str, torch.Tensor]:
    # weights are per channel (dim 1): sum over the spatial dims only
    x_hat = F.group_norm(x, module.num_groups, None, None, module.eps)
    spatial = list(range(2, x.dim()))
    out = {"weight": (o * x_hat).sum(spatial) if spatial else o * x_hat}
    if module.bias is not None:
        out["bias"] = o.sum(spatial) if spatial else o
    return out


def instance_norm_per_sample_grads(x, o, module) -> dict[str, torch.Tensor]:
    # instance norm normalizes each (sample, channel) over its positions: GroupNorm with C groups
    x_hat = F.instance_norm(x, eps=module.eps)
    spatial = list(range(2, x.dim()))
    out = {"weight": (o * x_hat).sum(spatial)}
    if module.bias is not None:
        out["bias"] = o.sum(spatial)
    return out
