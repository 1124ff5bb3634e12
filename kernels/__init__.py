"""Triton kernels of pdpfast, installed as ``pdpfast.kernels`` (DESIGN.md §2, §4).

One file per family — ``norms`` (linear Gram/direct/rank-one, bias and embedding per-sample
squared norms), ``conv_norms`` (Conv1d/Conv2d weight norms, unfolded inside the kernel), ``clip`` (clip weights), ``grad`` (clipped weighted gradient GEMM), ``noise``
(in-place Gaussian noise). Importing this package registers each launcher under its op name in
``pdpfast.ops.dispatch``; ``pdpfast.ops.<op>`` then runs it for CUDA tensors (or on the CPU under
``TRITON_INTERPRET=1``) unless ``PDPFAST_DISABLE_TRITON=1``. Every launcher is a drop-in for the
plain-torch ``<op>_reference`` of the same name in ``pdpfast.ops``.
"""
from pdpfast.ops.dispatch import register

from .clip import clip_weights
from .conv_norms import conv_weight_sq_norms
from .grad import linear_clipped_grad
from .noise import add_noise_
from .norms import bias_sq_norms, embedding_sq_norms, linear_weight_sq_norms

for _name, _fn in {
    "linear_weight_sq_norms": linear_weight_sq_norms,
    "conv_weight_sq_norms": conv_weight_sq_norms,
    "bias_sq_norms": bias_sq_norms,
    "embedding_sq_norms": embedding_sq_norms,
    "clip_weights": clip_weights,
    "linear_clipped_grad": linear_clipped_grad,
    "add_noise_": add_noise_,
}.items():
    register(_name)(_fn)
del _name, _fn

__all__ = ["add_noise_", "bias_sq_norms", "clip_weights", "conv_weight_sq_norms", "embedding_sq_norms",
           "linear_clipped_grad", "linear_weight_sq_norms"]
