"""``nn.Embedding`` (``padding_idx``): exact per-sample norms over the tokens a sample contains,
repeated tokens included (``pdpfast.ops.embedding``)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ..ops import embedding as emb_ops
from .layers import DPModule
from .rules import LayerRule, register_layer


class DPEmbedding(DPModule, nn.Embedding):
    @classmethod
    def unsupported_options(cls, module):
        if module.max_norm is not None:
            return "max_norm renormalizes table rows in place from the batch's tokens; set max_norm=None"
        if module.scale_grad_by_freq:
            return "scale_grad_by_freq scales gradients by batch-wide token counts; set it to False"
        if module.sparse:
            return "sparse gradients are not supported; set sparse=False"
        return None

    def _compute(self, x, p):
        return F.embedding(x, p["weight"], self.padding_idx)


def _embedding_per_sample(m, ids, o):
    return {"weight": emb_ops.embedding_per_sample_grads(ids, o, m.num_embeddings, m.padding_idx)}


def _embedding_sq_norms(m, ids, o, names):
    return emb_ops.embedding_sq_norms(ids, o, m.num_embeddings, m.padding_idx)


def _embedding_clipped(m, ids, o, weights, names):
    return {"weight": emb_ops.embedding_clipped_grad_reference(ids, o, weights, m.num_embeddings, m.padding_idx)}


register_layer(nn.Embedding, DPEmbedding, LayerRule(_embedding_per_sample, _embedding_sq_norms, _embedding_clipped))
