"""The base of every DP layer: ``DPModule`` and the autograd Function its backward reports through.

A DP layer subclasses the torch layer it replaces, so parameters, state_dict names, hooks and
isinstance checks are untouched. Outside a private batch (no ``ClippingState`` attached, eval mode
or grad disabled) it is exactly the torch layer. In a private batch the forward runs with
detached parameters, so autograd computes input gradients as usual but no weight-gradient GEMM,
and the layer call's backward hands (input, output gradient) to the clipping state: per-sample
norms and clipped sums come from the layer's rule. ``record_call`` attaches that backward: a
pre-hook (``LayerCall``) on the autograd node that computed the output, or, where the output has
no such node (the first layer of a model, whose input needs no gradient), the ``DPLayerFunction``
identity with the parameters as inputs so that autograd reaches it. The hook costs about a fifth
of the Function's host time per call (no Python ``ctx``, no extra graph node); it is registered by
``pdpfast._C.add_call_hook`` (``csrc/hooks.cpp``), where torch's ``register_prehook`` would build a
Python handle and dictionary for every call, and by ``register_prehook`` without the extension.
A linear layer's whole private call (the GEMM on detached parameters, the hook, the view) is one
C++ call, ``pdpfast._C.linear_call``, where nothing in Python would see its ops (``plain_call``).

The layer families (DP classes, rule, one ``register_layer`` each) live in ``linear.py``,
``conv.py``, ``embedding.py`` and ``norms.py``.
"""
from __future__ import annotations

import torch
from torch import nn

from pdpfast import _ext


class DPLayerFunction(torch.autograd.Function):
    """Identity on ``out`` whose backward reports (x, ∂L/∂out) for one call of a DP layer.

    ``params`` are inputs only so autograd reaches this node even when nothing else requires a
    gradient (first layer); their gradients are written by the clipping state, so None is returned.
    """

    @staticmethod
    def forward(ctx, out, x, call, *params):
        """Mark ``out`` as the layer call's output and save ``x`` for the backward.

        Args:
            out: the layer's output computed on detached parameters, e.g. (B·T, p) for a linear layer
                (any shape; not a view, since it is marked modified in place).
            x: the rule's input, (B, ...) (after the layer's ``_prepare``), or a tuple of tensors sharing
                dim 0 (e.g. an embedding bag's (ids (B, L), weights (B, L))).
            call: (the clipping state's record of the layer, the tuple of parameter names the call uses).
            *params: the call's trainable parameters when nothing else makes autograd reach this node
                (else none).
        Returns:
            ``out`` itself.
        """
        ctx.call = call
        # x: the rule's input, a tensor or a tuple of tensors (e.g. an embedding bag's ids and weights)
        ctx.packed = isinstance(x, tuple)
        ctx.save_for_backward(*x) if ctx.packed else ctx.save_for_backward(x)
        # in place in autograd's eyes, so later in-place ops (ReLU(inplace=True)) stay legal
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        """Hand (x, ∂L/∂out) to the clipping state (``ClippingState.on_backward``).

        Args:
            grad_out: ∂L/∂out, the shape of ``out``.
        Returns:
            (grad_out, None, None, None per parameter): the gradient passes through to ``out``; ``x``,
            ``call`` and the parameters get none (the state writes the parameters' clipped sums).
        """
        saved = ctx.saved_tensors
        x = tuple(saved) if ctx.packed else saved[0]
        layer = ctx.call[0]
        layer.state.on_backward(ctx.call, x, grad_out)
        return (grad_out, None, None) + (None,) * (len(ctx.needs_input_grad) - 3)


class LayerCall:
    """The backward of one DP layer call as a pre-hook on the autograd node that computed its output.

    Called with the call's output gradient, before the node runs, and hands (x, ∂L/∂out) to the
    clipping state (``ClippingState.on_backward``), as ``DPLayerFunction.backward`` does. It keeps
    what ``save_for_backward`` would give: an error if ``x`` was modified in place after the forward,
    and ``x`` released once used (kept only between ghost clipping's two backwards), so a graph kept
    alive by a loss tensor does not keep every layer input alive with it.

    Args:
        call: (the clipping state's record of the layer, the tuple of parameter names the call uses).
        x: the rule's input, (B, ...), or a tuple of tensors sharing dim 0.
    """

    __slots__ = ("call", "x", "versions")

    def __init__(self, call, x):
        self.call, self.x = call, x
        self.versions = tuple(t._version for t in x) if isinstance(x, tuple) else x._version

    def __call__(self, o: torch.Tensor) -> None:
        x, layer = self.x, self.call[0]
        state = layer.state
        if x is not None:
            versions = tuple(t._version for t in x) if isinstance(x, tuple) else x._version
            if versions != self.versions:
                raise RuntimeError(f"the input of DP layer {layer.name} was modified in place after its forward, so "
                                   "its per-sample gradients cannot be computed; use an out-of-place operation "
                                   "(e.g. x = x + 1, or ReLU(inplace=False)) on that tensor")
            if not state.keeps_inputs():
                self.x = None
        state.on_backward(self.call, x, o)


class _NodePreHook:
    """A ``LayerCall`` as torch's ``register_prehook`` calls a node's pre-hooks (the route without
    ``pdpfast._C``): with all the node's output gradients, of which it takes its call's."""

    __slots__ = ("layer_call", "output_nr")

    def __init__(self, layer_call: LayerCall, output_nr: int):
        self.layer_call, self.output_nr = layer_call, output_nr

    def __call__(self, grad_outputs) -> None:
        o = grad_outputs[self.output_nr]
        if o is not None:  # (an output that did not reach the loss has none)
            self.layer_call(o)


_HOOK_MISSING = _ext.missing("add_call_hook", "hooks.cpp")
_ADD_CALL_HOOK = None if _HOOK_MISSING else _ext._C.add_call_hook
# a linear layer's whole private call in one C++ call (_FlatLinear in linear.py); None without it
_LINEAR_CALL = None if _ext.missing("linear_call", "hooks.cpp") else _ext._C.linear_call


def plain_call(x, params: dict, buffers: dict) -> bool:
    """Whether a layer's private call may run as one C++ call (``_LINEAR_CALL``), which nothing in
    Python sees: the hooks are registered from C++, the input is a plain tensor, the layer
    has plain parameters ``weight`` and ``bias`` (or a None bias) and no buffers, and no torch function
    mode is active (``TorchFunctionMode``, ``with torch.device(...)``: it would not see the call's op).

    Args:
        x: the prepared input; params, buffers: the layer's ``_parameters`` and ``_buffers``.
    Returns:
        True where the C++ call gives what the Python route (``DPModule._record``) gives.
    """
    if _ADD_CALL_HOOK is None or buffers or len(params) != 2 or type(x) is not torch.Tensor or \
            torch._C._len_torch_function_stack():
        return False
    weight, bias = params.get("weight"), params.get("bias", False)
    return type(weight) is nn.Parameter and (bias is None or type(bias) is nn.Parameter)


def call_hook_route() -> str:
    """How a DP layer call's backward hook is registered (``pdpfast info``).

    Returns:
        "C++ (pdpfast._C)", or "torch's register_prehook (<why>)" where the extension lacks it.
    """
    return "C++ (pdpfast._C)" if _HOOK_MISSING is None else f"torch's register_prehook ({_HOOK_MISSING})"


def record_call(out: torch.Tensor, x, call, params) -> torch.Tensor:
    """Attach a DP layer call's backward to its output (module docstring).

    Args:
        out: the call's output, computed on detached parameters (not a view of ``x``).
        x: the rule's input, (B, ...), or a tuple of tensors sharing dim 0.
        call: (the clipping state's record of the layer, the tuple of parameter names the call uses).
        params: the call's trainable parameters (inputs of the Function where ``out`` has no node).
    Returns:
        ``out`` itself, or the Function's identity of it.
    """
    if _ADD_CALL_HOOK is not None:
        if _ADD_CALL_HOOK(out, LayerCall(call, x)):
            return out
    else:
        node = out.grad_fn
        if node is not None:
            node.register_prehook(_NodePreHook(LayerCall(call, x), out.output_nr))
            return out
    # nothing before the layer needs a gradient: the parameters make autograd reach it
    return DPLayerFunction.apply(out, x, call, *params)


class DPModule:
    """Mixin of every DP layer. ``_pdpfast_state`` is set by ``ClippingState.attach``.

    A DP class usually lists it before the torch layer it replaces (``class DPLinear(..., nn.Linear)``)
    and takes that layer's constructor arguments; one that does not (``DPLayerScale``, broadcast
    hosts) is mixed into the module's own class by ``convert``. ``convert`` makes DP layers by
    changing the class of existing modules, so they are rarely constructed directly; one built
    directly is checked (``unsupported_options``) by ``convert`` and by ``ClippingState``.
    """

    _pdpfast_state = None

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the layer's rule needs it (e.g. padded for convolutions)."""
        return x

    def _compute(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        raise NotImplementedError

    def _unflatten(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The layer's output from what ``_compute`` returned (see DPLinear)."""
        return out

    def _record(self, x, params: dict, buffers: dict, call: tuple, trainable: list) -> torch.Tensor:
        """A private call's output with its backward attached (``ClippingState.forward``, after its checks):
        ``_compute`` on the detached parameters, ``record_call``, ``_unflatten``.

        Args:
            x: the prepared input (``_prepare``); params, buffers: the module's ``_parameters`` and
                ``_buffers``; call: (the clipping state's record of the layer, the trainable names);
            trainable: those parameters.
        Returns:
            the layer's output, (B, ...).
        """
        detached = {n: (p.detach() if p is not None else None) for n, p in params.items()}
        if buffers:  # a frozen weight or bias kept as a buffer: torch's forward reads it as self.<name> too
            detached = {**buffers, **detached}
        return self._unflatten(record_call(self._compute(x, detached), x, call, trainable), x)

    @classmethod
    def unsupported_options(cls, module: nn.Module) -> str | None:
        """Why ``module`` cannot be trained privately with this class, or None.

        Checked by ``pdpfast.nn.convert.layer_problem``: before ``convert`` swaps a torch module, on a
        module that already is a DP layer (built directly: ``convert`` and ``ClippingState`` both check
        it), never in a forward or backward.

        Args:
            module: the torch module ``convert`` would swap (still of its original class), or a DP layer.
        Returns:
            a one-line reason naming the options whose per-sample gradient would be wrong or would leak
            (and what to set instead), or None when the module can be swapped (the base class: always None).
        """
        return None

    def forward(self, input=None, *, x=None):
        """The layer's output; in a private batch its call is also recorded for the per-sample backward.

        Outside a private batch (no state attached, eval mode or grad disabled) it is the torch
        layer's computation; in one it runs through ``ClippingState.forward``.

        Args:
            input: the layer's input, batch-first: (B, ...) with the shape the torch layer takes (by
                torch's name for it, ``input``, or HF Conv1D's, ``x``).
        Returns:
            the layer's output, (B, ...), as the torch layer returns it.
        Raises:
            in a private forward, RuntimeError unless a batch is open, and ValueError for an input whose
            dim 0 is not the batch's B (or 1) (see ``ClippingState.forward``).
        """
        x = input if x is None else x
        state = self._pdpfast_state
        if state is None or not self.training or not torch.is_grad_enabled():
            x = self._prepare(x)
            # buffers too: torch's forward reads a weight or bias kept as a buffer (a frozen one, e.g. after
            # torch.nn.utils.parametrize.remove_parametrizations) as self.<name>, like a parameter
            return self._unflatten(self._compute(x, {**self._buffers, **self._parameters}), x)
        return state.forward(self, x)
