"""A private training step replayed from CUDA graphs: the step with the host out of the way.

On a fast GPU a private step is host-bound: every DP layer's backward issues its norms, clip
weights and clipped sums from Python, and the GPU waits for them (``bench/README.md``). A
``PrivateStep`` captures the step once and replays it, so a step costs one or two graph launches.

A Poisson draw may span several physical batches, and the optimizer steps after the last of them
only. So there are three step bodies, each captured once per input signature (shapes, dtypes, tree
of the inputs; physical batches of a fixed size, ``physical_batch_size``, padded with masked rows,
keep it to one):

* **whole step** — a draw of one physical batch, the usual case when the physical batch holds the
  expected batch with room to spare: forward, loss, backward, per-sample norms, clip weights,
  clipped sums, noise, normalization by the expected batch size and the wrapped optimizer's step,
  in one graph. ``param.grad`` is made during its backward and freed at its end, as the eager step
  makes and frees it (``zero_grad()``), so the graph's memory is the eager step's: no gradient
  buffer is alive through the forward.
* **accumulate** — one physical batch of a draw that spans several: forward, backward and the
  clipped sums added into static gradient buffers (made at the first such draw, kept after).
* **update** — noise, normalization and the optimizer's step over those buffers, after the draw's
  last batch; the buffers are zeroed for the next such draw.

Between steps ``param.grad`` is None, as after ``zero_grad()``. The whole-step and accumulate
graphs share one memory pool, so a run with draws of both kinds holds one pool of activations,
not two. That is safe because each graph's outputs (the loss, the last norms and clip weights, the
noise tables) are held for its life, so no later capture places anything over them, and because
no graph of the pool replays between another's replay and the host reading that one's outputs
(the state's norms point at the last replayed graph's). The update graph, which replays right
after an accumulate graph and before anything reads the accumulate's norms, has a pool of its own.

What changes from step to step lives in static device buffers that the graphs read: the batch's
inputs, its rows' clip bounds and mask (copied in before each replay from pinned host memory, so
the copy is queued, not waited for), and the noise's (seed, step) counter, which the graphs that
step advance themselves; the noise kernel derives its Philox seed from it on the device
(``pdpfast.ops.noise.step_seed_tensor``), so a replayed step draws exactly the noise the eager step
``t`` draws. Everything the host must know — the batch lifecycle (``ClippingState``), the ledger's
check before a step and its charge after, the step count — runs on the host around each replay,
as the eager step runs it.

``cuda_graph=False`` runs the same bodies eagerly every time (its noise seeded on the host): the
same static buffers, the same host lifecycle, no capture; it keeps the static inputs of its eight most
recently used signatures only. The first ``warmup`` steps of a captured
step run the very bodies the capture records, device counter included, eagerly on a side stream, as
CUDA graph capture requires: every kernel a capture launches is compiled and loaded by then (a
module cannot be loaded while a stream captures). A body first met after the warm-up (the accumulate
and update bodies at the first draw of several batches, when every warm-up draw was of one) runs
eagerly once before its capture. Rehearsing them all in the warm-up instead would cost every run a
gradient buffer through one forward, and the peak memory of a run counts its warm-up; an eager run
after a capture reuses the memory the warm-up's eager steps left in torch's cache. Tests on the CPU
check the eager path against the ordinary loop, that nothing in a step's body synchronises with the
host, and, with the kernels under the Triton interpreter and a stand-in for the capture, that a
capture launches no kernel variant its warm-up did not, repeats its last warm-up run op for op, and
is repeated by every later run (``tests/kernels/test_captured_step.py``).

Rebuilt rather than replayed: a new input signature (new accumulate and whole-step graphs), and a
change of the optimizer's hyperparameters, state or noise (new update and whole-step graphs: a
learning rate baked in as a number would go stale; give the optimizer a tensor learning rate to
change it without recapture).
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import clipping
from ._checks import check_int
from .clipping import ClippingState
from .ops.dispatch import use_triton
from .ops.noise import release_pinned, seed_and_step_tensor, step_seed_tensor
from .optimizer import DPOptimizer
from .sampling import as_int64

# Distinct input signatures before a warning: each has its own accumulate graph and memory pool.
_SIGNATURES_WARN = 4
# Signatures an eager step (cuda_graph=False) keeps, the most recently used: it captures nothing, so one
# dropped is only rebuilt (static inputs) when its shapes come back; keeping all would grow with every
# new batch size, sequence length or non-tensor argument value of a run.
_EAGER_SIGNATURES = 8


def _pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` ready for a queued copy to ``device``: host tensors go through pinned memory."""
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        return t.pin_memory()
    return t


class _Body:
    """One step body: run eagerly, or captured once in a CUDA graph and then replayed.

    ``key`` names the body its runs belong to (an input signature's accumulate or whole step, or
    the update): the eager runs that rehearse a capture are ``_Body`` objects of the same key.
    ``pool`` gives the memory pool the capture allocates from (the step's, shared by its graphs).
    """

    def __init__(self, fn: Callable[[], tuple], device: torch.device, guard: Callable = contextlib.nullcontext,
                 key=None, pool: Callable | None = None):
        self.fn, self.device, self.guard, self.key, self.pool = fn, device, guard, key, pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple | None = None

    def run_eagerly(self, side_stream: bool) -> tuple:
        if not side_stream:
            with self.guard():
                return self.fn()
        # CUDA graph warm-up runs on a side stream (lazy initialisation off the capturing stream)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side), self.guard():
            outputs = self.fn()
        current.wait_stream(side)
        return outputs

    def replay(self) -> tuple[tuple, bool]:
        """(outputs, captured now): the first call captures the body (its host code runs once,
        then) and replays it; later calls only replay."""
        if self.graph is not None:
            self.graph.replay()
            return self.outputs, False
        graph = torch.cuda.CUDAGraph()
        try:
            # "thread_local": CUDA calls of other threads (a DataLoader's pin-memory thread queries its
            # events and allocates pinned blocks) do not invalidate the capture; those of this thread
            # and every launch into the capturing stream, the autograd engine's included, still count
            with torch.cuda.graph(graph, pool=None if self.pool is None else self.pool(),
                                  capture_error_mode="thread_local"), self.guard():
                outputs = self.fn()
        except RuntimeError as exc:
            hint = ""
            if "Cannot copy between CPU and CUDA tensors" in str(exc):
                # seen on an H100: transformers 5.17's eager attention mask makes torch.tensor(0.0, device=...)
                # under capture (the mask it skips eagerly); 5.23 builds it on the device
                hint = (" (a host tensor is copied to the GPU inside the step, e.g. torch.tensor(x, device='cuda') "
                        "in the forward; Hugging Face transformers before 5.23 does this when it builds an "
                        "attention mask under capture: upgrade transformers)")
            raise RuntimeError(
                f"capturing the private step in a CUDA graph failed: {exc}{hint}. Everything the step runs must stay "
                "on the GPU with no host synchronisation: no .item(), .tolist(), .cpu(), printing or branching on a "
                "tensor's value, no host-to-device copies of unpinned tensors, and no data-dependent shapes "
                "(nonzero, unique, boolean indexing), in the loss function and the model's forward. Make the step "
                "capture-safe, or use cuda_graph=False") from exc
        self.graph, self.outputs = graph, outputs
        graph.replay()
        return outputs, True


class PrivateStep:
    """One private training step per call, captured in CUDA graphs and replayed (module docstring).

    Args:
        state: the model's ``ClippingState`` (``mode="bk"``, flat or per-layer clipping; ghost mode
            runs two backwards over per-sample losses and is not offered here), between draws.
        optimizer: the ``DPOptimizer`` of the model's parameters. Optimizers with a ``capturable``
            option (Adam, AdamW, ...) need ``capturable=True`` for a captured step.
        loss_fn: ``loss_fn(*inputs, **kw_inputs)`` → the scalar loss of one physical batch, reduced as
            the batch was opened (mean over its rows for ``loss_reduction="mean"``, else the sum).
        cuda_graph: capture and replay (default: when the parameters are on a CUDA device); False
            runs the same step eagerly.
        warmup: steps run eagerly before the capture (CUDA graphs need the lazy initialisation of
            cuBLAS, the optimizer's state and the kernels' tables done first). Each is a real step.

    A call takes the physical batch the state has open (``state.begin_batch`` — the engine's data
    loader opens each batch it yields), runs forward, backward and clipping, and, when the optimizer
    is at a step boundary (the draw's last physical batch), the noisy optimizer step. Returns the
    batch's loss (a fresh tensor, safe to keep). Between draws ``param.grad`` is None; inside a draw
    of several physical batches it holds the clipped sums so far.
    """

    def __init__(self, state: ClippingState, optimizer: DPOptimizer, loss_fn: Callable, *,
                 cuda_graph: bool | None = None, warmup: int = 2):
        if not isinstance(state, ClippingState):
            raise TypeError(f"state must be a pdpfast ClippingState, got {type(state).__name__}")
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(f"optimizer must be a pdpfast DPOptimizer, got {type(optimizer).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (inputs → scalar loss), got {type(loss_fn).__name__}")
        if state.mode == "ghost":
            raise ValueError("a captured step runs one backward; mode='ghost' needs two over per-sample losses. Use "
                             "mode='bk' (book-keeping, the default) or clipping='per_layer'")
        if state.pending:
            raise RuntimeError("make the step between draws: a draw is in progress (its earlier physical batches ran "
                               "without the step); finish it with optimizer.step() first")
        warmup = check_int("warmup (eager steps before the capture)", warmup, 1)
        params = optimizer.trainable_params()
        if not params:
            raise ValueError("the optimizer has no trainable parameters")
        self.device = params[0].device
        if cuda_graph is None:
            cuda_graph = self.device.type == "cuda"
        if cuda_graph:
            self._check_capturable(optimizer)
        self.state, self.optimizer, self.loss_fn = state, optimizer, loss_fn
        self.cuda_graph, self.warmup = bool(cuda_graph), warmup
        self.eager_steps = 0  # optimizer steps run eagerly (the warm-up)
        # wraps every run of a body (tests: ``no_host_sync`` shows a synchronisation on the CPU)
        self.body_guard: Callable = contextlib.nullcontext
        self._signatures: dict[tuple, _Signature] = {}
        # a pool of its own: scratch of a shared pool could lie over the last accumulate's norms
        self._update = _SteppingGraph("update", lambda keep: self._update_body(on_device=True, keep=keep),
                                      self.device, self._guard, key="update")
        self._update_rehearsed = False             # the update body ran eagerly (its kernels are loaded)
        self._grads: list | None = None            # static gradient buffers of draws of several batches
        self._grads_dirty = False                  # they hold sums of a draw that never stepped
        self._pool = None                          # the pool the whole-step and accumulate graphs share
        self._counter: torch.Tensor | None = None  # (seed, step) of the noise, on the device
        self._counter_value: tuple | None = None   # the (seed, step) it holds
        for p in params:  # a step starts from no gradients, as after zero_grad()
            p.grad = None

    def _check_capturable(self, optimizer: DPOptimizer) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs the model on a CUDA device; its parameters are on {self.device}")
        if optimizer.reduce_grads is not None:
            raise ValueError("cuda_graph=True is not supported with DistributedDataParallel (the all-reduce of the "
                             "clipped sums runs between the graphs' steps); use cuda_graph=False")
        if any(group.get("capturable") is False for group in optimizer.param_groups):
            name = type(optimizer.original_optimizer).__name__
            raise ValueError(f"cuda_graph=True needs {name}(..., capturable=True): its step count must live on the GPU "
                             "to be replayed")
        if optimizer.noise_std > 0 and not use_triton(torch.empty(0, device=self.device)):
            raise ValueError("cuda_graph=True needs the Triton noise kernel (its noise follows a step counter on the "
                             "GPU); Triton is not available or PDPFAST_DISABLE_TRITON is set (python -m pdpfast.info)")

    def _graph_pool(self):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    @contextlib.contextmanager
    def _guard(self):
        # a capture keeps one norm launch per call (its replay issues nothing from the host, and the
        # grouped launch copies a table from it): so must the eager runs that rehearse it, or the
        # capture would meet kernels they never compiled
        state, grouping = self.state, self.state.group_calls
        state.group_calls = grouping and not self.cuda_graph
        try:
            with self.body_guard():
                yield
        finally:
            state.group_calls = grouping

    # ------------------------------------------------------------------ a call

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        state, optimizer = self.state, self.optimizer
        state.require_open()
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = (spec, tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", x) for x in leaves),
               tuple(state.clip_norms.shape), state.mask is None, state.loss_scale)
        signature = self._signatures.pop(key, None)  # put back last: the dict runs from least to most recently used
        if signature is None:
            if not self.cuda_graph and len(self._signatures) >= _EAGER_SIGNATURES:
                del self._signatures[next(iter(self._signatures))]  # the least recently used
            signature = _Signature(self, spec, leaves)
            if len(self._signatures) == _SIGNATURES_WARN and self.cuda_graph:
                warnings.warn(f"the captured step has seen {_SIGNATURES_WARN + 1} input signatures (shapes, dtypes): "
                              "each is captured in graphs of its own. Give every batch the same shapes "
                              "(physical_batch_size= pads Poisson batches to a fixed size)", stacklevel=2)
        self._signatures[key] = signature
        eager = not self.cuda_graph or self.eager_steps < self.warmup
        if not state.pending and optimizer.at_step_boundary():
            # a draw of one physical batch: forward to optimizer step in one body
            optimizer.before_step()  # a step past a budget is refused before any device work
            if self.cuda_graph:
                self._sync_counter()
            loss = signature.whole_step(leaves, eager)
            self._stepped(eager)
            return loss.clone()
        self._hold_grads()
        # dirty before the batch runs: a backward that raises (a non-finite record) may have written them
        self._grads_dirty = True
        loss = signature.accumulate(leaves, eager)
        if optimizer.at_step_boundary():
            optimizer.before_step()
            self._update_step(eager)
            self._grads_dirty = False
            for p in optimizer.trainable_params():  # the buffers stay with the step, zeroed
                p.grad = None
            self._stepped(eager)
        return loss.clone()

    def _stepped(self, eager: bool) -> None:
        """The host side after a step's device work: count it, charge it, close the draw."""
        self.optimizer.after_step()
        self._counter_value = (self.optimizer.seed, self.optimizer.steps)
        if eager:
            self.eager_steps += 1

    def _hold_grads(self) -> None:
        """``param.grad`` are the static buffers a draw of several physical batches sums into."""
        if self.state.pending:
            return  # inside the draw: they are already
        params = self.optimizer.trainable_params()
        with torch.no_grad():
            if self._grads is None:
                self._grads = [torch.zeros_like(p) for p in params]
            elif self._grads_dirty:  # a draw discarded before its step (the update zeroes them otherwise)
                torch._foreach_zero_(self._grads)
        for p, g in zip(params, self._grads):
            p.grad = g

    # ------------------------------------------------------------------ the update

    def _update_body(self, on_device: bool, keep: list | None = None, release: bool = False) -> tuple:
        """Noise (from the device counter when ``on_device``), normalization, the optimizer step, and
        the gradients freed (``release``: a whole step's, made in its backward) or zeroed (the static
        buffers)."""
        optimizer = self.optimizer
        with torch.no_grad():
            if on_device:
                optimizer.add_noise_and_normalize(device_seed=step_seed_tensor(self._counter), keep=keep)
            else:
                optimizer.add_noise_and_normalize()
            optimizer.step_wrapped()
            params = optimizer.trainable_params()
            if release:
                for p in params:
                    p.grad = None
            else:
                torch._foreach_zero_([p.grad for p in params])
            if on_device:
                self._counter[1] += 1
        return ()

    def _update_step(self, eager: bool) -> None:
        """The update after the last batch of a draw of several: eager, rehearsed or replayed."""
        if not self.cuda_graph:
            _Body(lambda: self._update_body(on_device=False), self.device, self._guard,
                  key="update").run_eagerly(side_stream=False)
            return
        self._sync_counter()
        if eager or not self._update_rehearsed:
            # the rehearsal runs the body the capture will record, device counter included: every
            # kernel it launches (the noise kernel's variant that reads its seed from the device,
            # above all) is compiled and loaded now, since loading a module during capture fails
            _Body(lambda: self._update_body(on_device=True, keep=[]), self.device, self._guard,
                  key="update").run_eagerly(side_stream=True)
            self._update_rehearsed = True
            return
        self._update.body_for(self._hyper_key()).replay()

    def _sync_counter(self) -> None:
        """The device counter holds the optimizer's (seed, step): set where eager steps, a checkpoint
        or a new seed moved them (queued fills, no host synchronisation)."""
        optimizer = self.optimizer
        value = (optimizer.seed, optimizer.steps)
        if self._counter is None:
            self._counter = seed_and_step_tensor(*value, self.device)
        elif self._counter_value != value:
            self._counter[0].fill_(as_int64(value[0]))
            self._counter[1].fill_(as_int64(value[1]))
        self._counter_value = value

    def _hyper_key(self) -> tuple:
        """What a graph that steps bakes in: each group's hyperparameters (tensors by identity), the
        optimizer's state and groups objects (replaced by load_state_dict), the noise and B_exp."""
        optimizer = self.optimizer
        groups = tuple(tuple((k, id(v) if isinstance(v, torch.Tensor) else v) for k, v in sorted(g.items())
                             if k != "params") for g in optimizer.param_groups)
        return (groups, id(optimizer.state), id(optimizer.param_groups), optimizer.noise_std,
                optimizer.expected_batch_size, optimizer.seed)


class _SteppingGraph:
    """A captured body that takes the optimizer's step (update, whole step): captured again when
    what it bakes in (``PrivateStep._hyper_key``) changes, the old graph's pinned noise tables given
    back first. ``fn(keep)`` runs the body, its noise launch's tables into ``keep``."""

    def __init__(self, name: str, fn: Callable[[list], tuple], device: torch.device, guard: Callable, key,
                 pool: Callable | None = None):
        self.name, self.fn, self.device, self.guard, self.key, self.pool = name, fn, device, guard, key, pool
        self.body: _Body | None = None
        self.hyper = None
        self.tables: list = []  # what the noise launch of the captured body reads

    def body_for(self, hyper: tuple) -> _Body:
        if self.body is None or hyper != self.hyper:
            if self.body is not None:
                warnings.warn(f"the optimizer's hyperparameters, state or noise changed: the {self.name} graph is "
                              "captured again (a learning-rate schedule does this every step; give the optimizer a "
                              "tensor learning rate, e.g. lr=torch.tensor(1e-3, device='cuda'), to avoid it)",
                              stacklevel=4)
                self.body = None  # the old graph goes before its pinned tables serve another
                release_pinned(self.tables)
            tables = self.tables = []
            self.body = _Body(lambda: self.fn(tables), self.device, self.guard, key=self.key, pool=self.pool)
            self.hyper = hyper
        return self.body


class _Signature:
    """The bodies of one input signature (accumulate, whole step) with their static inputs, bounds and mask."""

    def __init__(self, step: PrivateStep, spec, leaves: list):
        self.step, self.spec = step, spec
        device = step.device
        self.inputs = [torch.empty_like(x, device=device) if isinstance(x, torch.Tensor) else x for x in leaves]
        state = step.state
        self.clip_norms = torch.empty(state.clip_norms.shape, dtype=state.clip_norms.dtype, device=device)
        self.mask = None if state.mask is None else torch.empty(state.mask.shape, dtype=state.mask.dtype, device=device)
        self._accumulate = _Body(self._forward_backward, device, step._guard, key=(self, "accumulate"),
                                 pool=step._graph_pool)
        self.accumulate_runs = 0          # runs of the accumulate body, eager ones included
        self._whole = _SteppingGraph("whole-step", lambda keep: self._whole_step(True, keep), device, step._guard,
                                     key=(self, "whole step"), pool=step._graph_pool)
        self.whole_runs = 0               # runs of the whole-step body, eager ones included

    def _forward_backward(self) -> tuple:
        args, kwargs = pytree.tree_unflatten(self.inputs, self.spec)
        loss = self.step.loss_fn(*args, **kwargs)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise TypeError(f"loss_fn must return a scalar loss tensor, got {type(loss).__name__}"
                            f"{'' if not isinstance(loss, torch.Tensor) else ' of shape ' + str(tuple(loss.shape))}")
        loss.backward()
        return (loss.detach(), *self.step.state.clipped_outputs())

    def _whole_step(self, on_device: bool, keep: list | None) -> tuple:
        outputs = self._forward_backward()
        self.step._update_body(on_device, keep, release=True)
        return outputs

    def _load(self, leaves: list) -> None:
        device, state = self.step.device, self.step.state
        with torch.no_grad():
            for static, x in zip(self.inputs, leaves):
                if isinstance(static, torch.Tensor):
                    static.copy_(_pinned(x, device), non_blocking=True)
            self.clip_norms.copy_(_pinned(state.clip_norms, device), non_blocking=True)
            if self.mask is not None:
                self.mask.copy_(_pinned(state.mask, device), non_blocking=True)

    def _run(self, body: _Body, eager: bool) -> torch.Tensor:
        state = self.step.state
        if eager or body.graph is None:
            # the graph reads the static bounds and mask: bind them to the batch the host opened
            state.rebind_batch(self.clip_norms, self.mask)
        if eager:
            return body.run_eagerly(side_stream=self.step.cuda_graph)[0]
        outputs, captured = body.replay()
        if not captured:  # the capture ran the host side of the backward itself
            state.replayed_backward(outputs[1:])
        else:  # but its norms, seen inside the capture, were not queued for the host: those of this replay
            state.defer_finite_check(outputs[1])
        return outputs[0]

    def accumulate(self, leaves: list, eager: bool) -> torch.Tensor:
        """One physical batch of a draw of several: its clipped sums added into ``param.grad``."""
        self._load(leaves)
        # a body's first run is eager (its kernels' lazy set-up), the next is captured
        eager = eager or self.accumulate_runs == 0
        self.accumulate_runs += 1
        return self._run(self._accumulate, eager)

    def whole_step(self, leaves: list, eager: bool) -> torch.Tensor:
        """A draw of one physical batch, forward to optimizer step; ``param.grad`` is None after."""
        step = self.step
        self._load(leaves)
        if not step.cuda_graph:
            body = _Body(lambda: self._whole_step(False, None), step.device, step._guard, key=(self, "whole step"))
        elif eager or self.whole_runs == 0:
            # a body's first run is eager (its kernels' lazy set-up), the next is captured
            body = _Body(lambda: self._whole_step(True, []), step.device, step._guard, key=(self, "whole step"))
            eager = True
        else:
            body = self._whole.body_for(step._hyper_key())
        self.whole_runs += 1
        return self._run(body, eager)


# aten ops whose output size or value a CUDA device must report to the host before it returns. equal and
# allclose return a Python bool: they run as one op at the dispatcher (their inner reads are not seen there)
_SYNCING_OPS = frozenset({"_local_scalar_dense", "nonzero", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                          "unique_dim_consecutive", "masked_select", "repeat_interleave", "bincount", "equal",
                          "allclose", "is_nonzero", "histc"})


def _histc_reads_its_range(args, kwargs) -> bool:
    """histc with min == max (its default 0, 0) on a non-empty tensor reads the tensor's min and max on the
    host to find its range (CUDA's ``_histc_cuda_template``); with a range given it does not."""
    named = ("self", "bins", "min", "max")
    values = dict(zip(named, args)) | kwargs
    low, high = values.get("min", 0), values.get("max", 0)
    return low == high and values["self"].numel() > 0


class _RefuseSyncs(TorchDispatchMode):
    """Raises on the aten ops that read a device tensor's values on the host: what ``.item()``,
    ``bool(t)``, ``torch.unique``, ``nonzero``, boolean-mask indexing and the like reach."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _SYNCING_OPS:
            # repeat_interleave syncs for tensor repeats (overloads Tensor, self_Tensor) without
            # output_size, not for int repeats
            if name == "repeat_interleave":
                syncs = (func._overloadname in ("Tensor", "self_Tensor")
                         and (kwargs or {}).get("output_size") is None)
            elif name == "histc":
                syncs = _histc_reads_its_range(args, kwargs or {})
            else:
                syncs = True
            if syncs:
                raise RuntimeError(f"aten::{name} synchronises with the host inside a step body")
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else (kwargs or {}).get("indices", ())
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                raise RuntimeError(f"aten::{name} with a boolean mask synchronises with the host inside a step "
                                   "body (the mask's count sets the output size); use torch.where or a product")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_sync():
    """Raise on every operation that synchronises with the host while the block runs.

    Covers ``.item()``, ``bool(t)``, ``int(t)``, ``nonzero``, ``torch.unique``, boolean-mask indexing
    (``x[mask]``, ``x[mask] = v``), ``masked_select``, ``repeat_interleave`` without ``output_size``,
    ``bincount``, ``torch.equal``, ``torch.allclose`` (a Python bool), ``torch.histc`` without a range
    (min == max: it reads the input's min and max) (seen at the dispatcher, so also where torch's own
    code calls them) and ``.tolist()``, ``.cpu()``, ``.numpy()``: what a CUDA graph capture forbids and
    what stalls the host behind the GPU, made visible on the CPU (tests wrap a step's body in it). The
    CPU's refusal of non-finite norms, a read a GPU's step skips, is off inside. Everything is restored
    on exit.

    Returns:
        a context manager (yields None).
    Raises:
        RuntimeError ("... synchronises with the host inside a step body") on any such call inside
        the block.
    """
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
             "unique", "equal")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    checked, clipping.CHECK_FINITE_ON_CPU = clipping.CHECK_FINITE_ON_CPU, False   # a GPU's step skips it

    def refuse(name):
        def method(self, *args, **kwargs):
            raise RuntimeError(f"Tensor.{name} synchronises with the host inside a step body")
        return method

    try:
        for n in names:
            setattr(torch.Tensor, n, refuse(n))
        with _RefuseSyncs():
            yield
    finally:
        for n, method in saved.items():
            setattr(torch.Tensor, n, method)
        clipping.CHECK_FINITE_ON_CPU = checked
