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
    "linear_weight_sq_norms": linear_weight_sq_norms,
    "conv_weight_sq_norms": conv_weight_sq_norms,
    "embedding_sq_norms": embedding_sq_norms,
    "add_noise_": add_noise_,
}.items():
    register(_name)(_fn)
del _name, _fn
# H100, 2026-11-23 (bench_kernels): the bias kernel wins only on fp16/bf16 sequences (1.7x at
# (64, 512, 1024)); torch's three ops win in fp32 (0.6x) and on one-row samples (0.8x)
register("bias_sq_norms", when=lambda o: o.dim() == 3 and o.shape[1] > 1 and o.dtype in (torch.float16,
                                                                                          torch.bfloat16))(bias_sq_norms)

__all__ = ["add_noise_", "bias_sq_norms", "conv_weight_sq_norms", "embedding_sq_norms", "linear_weight_sq_norms"]
