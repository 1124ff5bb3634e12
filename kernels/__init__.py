"""Triton kernels of pdpfast, installed as ``pdpfast.kernels`` (DESIGN.md §2, §4).

One file per family — ``norms`` (linear Gram/direct/rank-one, bias and embedding per-sample
squared norms), ``conv_norms`` (Conv1d/Conv2d weight norms, unfolded inside the kernel), ``noise``
(in-place Gaussian noise). Only kernels that beat torch are here: the clipped sum is cuBLAS's
weight-gradient GEMM on row-scaled gradients, and clip weights are five torch ops (a Triton GEMM
and clip-weight kernel, measured at 0.39-0.51x and 0.5-0.8x of torch on an H100, were removed). Importing this package registers each launcher under its op name in
``pdpfast.ops.dispatch``; ``pdpfast.ops.<op>`` then runs it for CUDA tensors (or on the CPU under
``TRITON_INTERPRET=1``) unless ``PDPFAST_DISABLE_TRITON=1``. Every launcher is a drop-in for the
plain-torch ``<op>_reference`` of the same name in ``pdpfast.ops``.
"""
import torch

from pdpfast.ops.dispatch import register

from .conv_norms import conv_weight_sq_norms
from .noise import add_noise_
from .norms import bias_sq_norms, embedding_sq_norms, linear_weight_sq_norms

for _name, _fn in {
    "conv_weight_sq_norms": conv_weight_sq_norms,
    "embedding_sq_norms": embedding_sq_norms,
    "add_noise_": add_noise_,
}.items():
    register(_name)(_fn)
del _name, _fn
# Measured on an H100, 2026-11-23 (bench/results/bench_kernels-NVIDIA_H100_80GB_HBM3.json):
# - linear norms win in fp16/bf16 (1.5-7.1x); in fp32 the kernel's exact FMA dots lose to cuBLAS's
#   fp32 Gram (0.40-0.87x), so fp32 runs the reference;
# - the bias kernel wins only on fp16/bf16 sequences (1.7x at (64, 512, 1024)); torch's three ops
#   win in fp32 (0.6x) and on one-row samples (0.8x).
# conv norms are kept in fp32 although two stride-1 layers are slower than the old path: that path
# materialized B x |W| per-sample gradients (up to 4.6 GiB a layer), which bk and per-layer must not.
_LOW_PRECISION = (torch.float16, torch.bfloat16)
register("linear_weight_sq_norms", when=lambda a, o: o.dtype in _LOW_PRECISION)(linear_weight_sq_norms)
register("bias_sq_norms", when=lambda o: o.dim() == 3 and o.shape[1] > 1 and o.dtype in _LOW_PRECISION)(bias_sq_norms)

__all__ = ["add_noise_", "bias_sq_norms", "conv_weight_sq_norms", "embedding_sq_norms", "linear_weight_sq_norms"]
