"""Drop-in DP modules and ``convert(model)``.

One file per layer family (``linear``, ``conv``, ``embedding``, ``norms``, ``attention``, ``rnn``, ``broadcast``), each
registering itself with ``register_layer``; importing them here is what makes ``convert`` know them.
"""
from .attention import DPMultiheadAttention
from .broadcast import DPBroadcastHost, DPLayerScale, register_broadcast_host
from .conv import DPConv1d, DPConv2d, DPConv3d
from .convert import convert, replace_batchnorm
from .embedding import DPEmbedding, DPEmbeddingBag
from .layers import DPLayerFunction, DPModule
from .linear import DPConv1D, DPLinear
from .norms import DPGroupNorm, DPInstanceNorm, DPLayerNorm, DPRMSNorm, DPRMSNormForm
from .rnn import DPGRU, DPLSTM, DPRNN
from .rules import LayerRule, register_form, register_layer, register_module, register_rule, rule_for

__all__ = ["DPBroadcastHost", "DPMultiheadAttention", "DPConv1D", "DPConv1d", "DPConv2d", "DPConv3d", "DPEmbedding",
           "DPEmbeddingBag", "DPGroupNorm", "DPGRU", "DPInstanceNorm", "DPLSTM", "DPRNN", "DPLayerFunction",
           "DPLayerNorm", "DPLayerScale", "DPLinear", "DPModule", "DPRMSNorm", "DPRMSNormForm",
           "LayerRule", "convert", "register_broadcast_host", "register_form", "register_layer", "register_module",
           "register_rule", "replace_batchnorm", "rule_for"]
