"""``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``: the recurrence unrolled, each projection a DP linear call.

cuDNN's fused recurrence hides the per-step inputs, so in a private batch ``DPRNNBase`` runs the
same recurrence step by step with torch's gate order and formulas (output equal to torch's to
float64 rounding):

* the input projection x W_ihᵀ + b_ih of a layer and direction is one linear call over the whole
  sequence: its per-sample gradient is exact with the linear rule, without materializing anything;
* the recurrent projection h_{t-1} W_hhᵀ + b_hh is one call per time step of the same parameters,
  so its per-sample gradient is a sum over steps: the clipping state forms it exactly by summing
  per-step per-sample gradients (B × |W_hh| memory, as Opacus's DP RNNs do).

Supported: any number of layers, ``bidirectional``, ``bias``, RNN's tanh/relu, dropout between
layers, an initial state (h_0, and c_0 for LSTM). Needs ``batch_first=True`` (the engine refuses
sequence-first modules) and a padded (B, T, d) tensor, not a PackedSequence; ``proj_size`` is refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import linear as lin_ops
from .layers import DPModule
from .linear import as_btd, linear_rounding, linear_sq_norms_rounding
from .rules import LayerRule, register_layer


def _projection(x, p, weight, bias):
    return F.linear(x.reshape(-1, x.shape[-1]), p[weight], p.get(bias))


class DPRNNBase(DPModule):
    """Mixin of the DP recurrent layers; ``_cell`` is the one step of each kind.

    A DP class lists it before the torch layer (``DPRNN``, ``DPLSTM``, ``DPGRU``) and takes that
    layer's constructor arguments.
    """

    @classmethod
    def unsupported_options(cls, module):
        """Why ``module`` cannot be converted, or None.

        Args:
            module: an ``nn.RNN``, ``nn.LSTM`` or ``nn.GRU``.
        Returns:
            the reason for ``proj_size > 0``; None otherwise.
        """
        if getattr(module, "proj_size", 0):
            return f"proj_size={module.proj_size} (LSTM with projections) is not supported; use proj_size=0"
        return None

    def forward(self, input, hx=None):
        """The recurrence over the whole sequence, unrolled step by step in a private batch.

        Outside a private batch this is the torch layer's forward (all its input forms). With
        L = num_layers, D = 2 if bidirectional else 1 and H = hidden_size:

        Args:
            input: (B, T, input_size) float, padded (batch-first; no PackedSequence).
            hx: None (zeros), or h_0 (L·D, B, H); for LSTM the pair (h_0, c_0), each (L·D, B, H).
        Returns:
            (output (B, T, D·H) — the last layer's h_t for every t, directions concatenated —, h_n
            (L·D, B, H)); for LSTM the second item is (h_n, c_n). The reverse direction's final state
            is the one after reading the sequence backwards (at t = 0), as in torch.
        Raises:
            ValueError in a private batch for input that is not a 3-D tensor.
        """
        state = self._pdpfast_state
        if state is None or not self.training or not torch.is_grad_enabled():
            return super(DPModule, self).forward(input, hx)
        if not isinstance(input, torch.Tensor) or input.dim() != 3:
            raise ValueError(f"{type(self).__name__} in a private batch needs a padded (B, T, d) tensor "
                             "(batch_first=True), not a PackedSequence or an unbatched sequence")
        B, T, _ = input.shape
        dirs = 2 if self.bidirectional else 1
        lstm = self.mode == "LSTM"
        if hx is None:
            zeros = input.new_zeros(self.num_layers * dirs, B, self.hidden_size)
            hx = (zeros, zeros) if lstm else zeros
        h0, c0 = hx if lstm else (hx, None)
        layer_input, last_h, last_c = input, [], []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(dirs):
                k = layer * dirs + direction
                suffix = f"_l{layer}" + ("_reverse" if direction else "")
                seq = layer_input.flip(1) if direction else layer_input
                names_ih = (f"weight_ih{suffix}", f"bias_ih{suffix}")
                names_hh = (f"weight_hh{suffix}", f"bias_hh{suffix}")
                gates_x = state.partial_forward(self, seq, names_ih, lambda x, p, n=names_ih: _projection(x, p, *n))
                gates_x = gates_x.view(B, T, gates_x.shape[-1])  # (not -1: an empty batch has no rows to infer it)
                h, c, steps = h0[k], (c0[k] if lstm else None), []
                for t in range(T):
                    gates_h = state.partial_forward(self, h, names_hh, lambda x, p, n=names_hh: _projection(x, p, *n))
                    h, c = self._cell(gates_x[:, t], gates_h, h, c)
                    steps.append(h)
                out = torch.stack(steps, 1)
                outputs.append(out.flip(1) if direction else out)
                last_h.append(h)
                last_c.append(c)
            layer_input = torch.cat(outputs, -1) if dirs == 2 else outputs[0]
            if self.dropout and layer < self.num_layers - 1:
                layer_input = F.dropout(layer_input, self.dropout)
        h_n = torch.stack(last_h)
        return layer_input, ((h_n, torch.stack(last_c)) if lstm else h_n)

    def _cell(self, gates_x, gates_h, h, c):
        mode = self.mode
        if mode == "LSTM":
            i, f, g, o = (gates_x + gates_h).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c), c
        if mode == "GRU":
            xr, xz, xn = gates_x.chunk(3, -1)
            hr, hz, hn = gates_h.chunk(3, -1)
            r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
            n = torch.tanh(xn + r * hn)
            return (1 - z) * n + z * h, None
        act = torch.tanh if mode == "RNN_TANH" else torch.relu
        return act(gates_x + gates_h), None


class DPRNN(DPRNNBase, nn.RNN):
    """``nn.RNN`` (tanh or relu) with per-sample clipping; ``forward`` as ``DPRNNBase.forward``.

    Args:
        input_size, hidden_size, num_layers, nonlinearity, bias, batch_first, dropout, bidirectional,
            device, dtype: as ``nn.RNN`` (``batch_first`` must be True for private training);
            ``convert`` makes one from an existing layer.
    """


class DPLSTM(DPRNNBase, nn.LSTM):
    """``nn.LSTM`` with per-sample clipping; ``forward`` as ``DPRNNBase.forward``.

    Args:
        input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, device, dtype:
            as ``nn.LSTM`` (``batch_first`` must be True for private training; ``proj_size`` must be 0);
            ``convert`` makes one from an existing layer.
    """


class DPGRU(DPRNNBase, nn.GRU):
    """``nn.GRU`` with per-sample clipping; ``forward`` as ``DPRNNBase.forward``.

    Args:
        input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, device, dtype:
            as ``nn.GRU`` (``batch_first`` must be True for private training); ``convert`` makes one
            from an existing layer.
    """


def _split(names):
    weight = next((n for n in names if n.startswith("weight")), None)
    bias = next((n for n in names if n.startswith("bias")), None)
    return weight, bias


class _ProjectionGrads:
    """Per-sample gradients of one projection call, formed for whichever name is asked for."""

    def __init__(self, x, o):
        self.a, self.g = as_btd(x, o)

    def __getitem__(self, name):
        return lin_ops.linear_per_sample_grads(self.a, self.g) if name.startswith("weight") else self.g.sum(1)


def _per_sample(m, x, o):
    return _ProjectionGrads(x, o)


def _sq_norms(m, x, o, names):
    weight, bias = _split(names)
    a, g = as_btd(x, o)
    if weight is None:
        return lin_ops.bias_sq_norms(g)
    return lin_ops.linear_sq_norms(a, g, with_bias=bias is not None)


def _clipped(m, x, o, weights, names):
    weight, bias = _split(names)
    a, g = as_btd(x, o)
    grad_w, grad_b = lin_ops.linear_clipped_grads(a, g, weights, weight is not None, bias is not None, False)
    return {n: grad for n, grad in ((weight, grad_w), (bias, grad_b)) if n is not None}


def _rounding(m, x, o, names):
    weight, bias = _split(names)
    return linear_rounding(*as_btd(x, o), weight is not None, bias is not None)


def _sq_norms_rounding(m, x, o, names):
    weight, bias = _split(names)
    return linear_sq_norms_rounding(*as_btd(x, o), weight is not None, bias is not None)


_RULE = LayerRule(_per_sample, _sq_norms, _clipped, rounding=_rounding, sq_norms_rounding=_sq_norms_rounding)
register_layer(nn.RNN, DPRNN, _RULE)
register_layer(nn.LSTM, DPLSTM, _RULE)
register_layer(nn.GRU, DPGRU, _RULE)
