"""Triton kernels of pdpfast, installed as ``pdpfast.kernels`` (DESIGN.md §2, §4).

One file per family — ``norms`` (linear Gram/direct/rank-one, bias and embedding per-sample
squared norms; a linear call's norms with its low-precision rounding bound in the same launch),
``conv_norms`` (Conv1d/Conv2d weight norms, unfolded inside the kernel, with the rounding bound in
the same launch), ``norm_grads``
(LayerNorm, RMSNorm, GroupNorm and InstanceNorm per-sample affine gradients in one launch; same-shape
calls of each in one launch), ``noise`` (in-place Gaussian
noise). Only kernels that beat torch are kept: the clipped sum is cuBLAS's weight-gradient GEMM
on row-scaled gradients, and clip weights are five torch ops (a Triton GEMM and clip-weight kernel,
measured at 0.39-0.51x and 0.5-0.8x of torch on an H100, were removed). ``norm_grads`` has not met a
GPU yet: it replaces four launches with one, and ``bench_kernels`` will say whether its GPU time
keeps it.

Each launcher registers itself, in its own file, under the name of the op it speeds up
(``@register("bias_sq_norms", when=...)``, ``pdpfast.ops.dispatch``); importing this package imports
every family, and ``pdpfast.ops.<op>`` then runs the kernel for CUDA tensors (or on the CPU under
``TRITON_INTERPRET=1``) unless ``PDPFAST_DISABLE_TRITON=1``. A name no op declared raises at
import. Every launcher is a drop-in for the plain-torch ``<op>_reference`` of the same name in
``pdpfast.ops``. A new kernel file is added to the imports below.
"""
from .conv_norms import conv_sq_norms_grouped, conv_sq_norms_rounding, conv_weight_sq_norms
from .noise import add_noise_
from .norm_grads import (
    group_norm_affine_grads,
    group_norm_affine_grads_grouped,
    layer_norm_per_sample_grads,
    layer_norm_per_sample_grads_grouped,
    rms_norm_per_sample_grads,
    rms_norm_per_sample_grads_grouped,
)
from .norms import (
    bias_sq_norms,
    embedding_sq_norms,
    linear_sq_norms_grouped,
    linear_sq_norms_rounding,
    linear_weight_sq_norms,
)

__all__ = ["add_noise_", "bias_sq_norms", "conv_sq_norms_grouped", "conv_sq_norms_rounding", "conv_weight_sq_norms",
           "embedding_sq_norms",
           "group_norm_affine_grads", "group_norm_affine_grads_grouped",
           "layer_norm_per_sample_grads", "layer_norm_per_sample_grads_grouped",
           "linear_sq_norms_grouped", "linear_sq_norms_rounding", "linear_weight_sq_norms", "rms_norm_per_sample_grads",
           "rms_norm_per_sample_grads_grouped"]
