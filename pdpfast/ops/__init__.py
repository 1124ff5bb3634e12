"""Per-layer-family math of individualized clipping, each op with a plain-torch reference.

Each family's file declares the ops that can run a kernel next to their references
(``dispatch.declare``); importing this package imports every family, so every op is declared before
a Triton kernel registers under its name (``pdpfast.ops.dispatch``). Kernels run for CUDA
tensors; everything else runs the reference.

These are the engine's inner ops, called on every layer of every step: they check nothing (no
shapes, no signs, no NaN), since a check there is host time each step and, on a GPU, often a
synchronisation. Their callers check once: the DP layers check their modules when they are built
and converted, the engine checks clip norms, masks, noise and options in ``make_private``. Calling
them directly with a negative clip norm, a mask above 1 or a NaN std gives weights and gradients
no privacy guarantee covers.
"""
from .clip import clip_weights, clip_weights_reference, clip_weights_route
from .conv import conv_weight_sq_norms, conv_weight_sq_norms_reference
from .dispatch import pick, register, registered, use_triton
from .embedding import embedding_clipped_grad_reference, embedding_sq_norms, embedding_sq_norms_reference
from .linear import (
    bias_sq_norms,
    kernel_uses_gram,
    linear_clipped_grads,
    linear_sq_norms,
    linear_sq_norms_reference,
    linear_weight_sq_norms,
    linear_weight_sq_norms_reference,
    use_gram,
)
from .noise import add_noise_, add_noise_reference_
from .norm import group_norm_affine_grads, layer_norm_per_sample_grads, rms_norm_per_sample_grads

__all__ = [
    "add_noise_", "add_noise_reference_", "bias_sq_norms", "clip_weights", "clip_weights_reference",
    "clip_weights_route", "conv_weight_sq_norms",
    "conv_weight_sq_norms_reference", "embedding_clipped_grad_reference",
    "embedding_sq_norms", "embedding_sq_norms_reference", "group_norm_affine_grads", "kernel_uses_gram",
    "layer_norm_per_sample_grads",
    "linear_clipped_grads", "linear_sq_norms",
    "linear_sq_norms_reference", "linear_weight_sq_norms", "linear_weight_sq_norms_reference", "pick", "register",
    "registered", "rms_norm_per_sample_grads", "use_gram", "use_triton",
]
