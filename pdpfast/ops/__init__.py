"""Per-layer-family math of individualized clipping, each op with a plain-torch reference.

Triton kernels register under the same op names (``pdpfast.ops.dispatch``) and run for CUDA
tensors; everything else runs the reference.
"""
from .clip import clip_weights
from .dispatch import pick, register, use_triton
from .embedding import embedding_clipped_grad_reference, embedding_sq_norms, embedding_sq_norms_reference
from .linear import (bias_sq_norms, linear_clipped_grads, linear_sq_norms, linear_sq_norms_reference,
                     linear_weight_sq_norms, linear_weight_sq_norms_reference, use_gram)
from .noise import add_noise_, add_noise_reference_

__all__ = [
    "add_noise_", "add_noise_reference_", "bias_sq_norms", "clip_weights", "embedding_clipped_grad_reference",
    "embedding_sq_norms", "embedding_sq_norms_reference", "linear_clipped_grads", "linear_sq_norms",
    "linear_sq_norms_reference", "linear_weight_sq_norms", "linear_weight_sq_norms_reference", "pick", "register",
    "use_gram", "use_triton",
]
