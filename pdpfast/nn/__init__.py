"""Drop-in DP modules and ``convert(model)``."""
from .broadcast import DPBroadcastHost, DPLayerScale
from .convert import convert, register_broadcast_host, register_module, replace_batchnorm
from .layers import (DPConv1D, DPConv1d, DPConv2d, DPConv3d, DPEmbedding, DPGroupNorm, DPInstanceNorm,
                     DPLayerFunction, DPLayerNorm, DPLinear, DPModule, DPRMSNorm)
from .rules import LayerRule, register_rule, rule_for

__all__ = ["DPBroadcastHost", "DPLayerScale", "DPConv1D", "DPConv1d", "DPConv2d", "DPConv3d", "DPEmbedding", "DPGroupNorm", "DPInstanceNorm",
           "DPLayerFunction", "DPLayerNorm",
           "DPLinear", "DPModule", "DPRMSNorm", "LayerRule", "convert", "register_broadcast_host", "register_module", "register_rule",
           "replace_batchnorm", "rule_for"]
