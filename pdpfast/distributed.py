"""Data parallelism: individualized DP-SGD under ``torch.distributed``, identical to one process.

A model wrapped in ``DistributedDataParallel`` is made private like any other; the engine then
closes the three traps of a careless port:

1. **One global Poisson draw.** Every rank runs the counter-based sampler with the same seed and
   step, so all ranks see the same drawn records, and each takes its share (records
   ``rank::world_size`` of the draw). Ranks with a smaller share pad with masked rows, so every
   rank runs the same number of physical batches.
2. **Noise once.** Clipping is local; the clipped sums are all-reduced (summed) once per step by
   the optimizer, and every rank then adds the *same* noise N(0, σ²C²), drawn from (seed, step):
   the ranks hold identical parameters and the run equals the single-process run with that seed.
3. **Global normalization.** The sum is divided by Σ_i q_i over the whole dataset.

What the ranks must share is checked, and a mismatch refused on every rank: the seed (an int, or None on
every rank), the ``noise_generator``'s state, the plan, the data, and on resuming the checkpoint's point
(steps, seeds, next draw). Where the norms are on the CPU, a non-finite record in one rank's share makes
every rank's backward raise ``FloatingPointError`` (one all-reduced flag per physical batch), so that all
ranks discard the same draw. On GPUs, whose norms reach the host without stopping it, each backward's
flag is summed over the ranks on the device and read at the next step on every rank: that step is
refused on every rank (the draw's own step was applied on every rank; restore a checkpoint).

DDP's own gradient synchronization is switched off for the wrapped model
(``require_backward_grad_sync = False``): DP layers write clipped sums into ``.grad`` themselves,
which DDP's reducer never sees, and averaging (DDP divides by the world size) is not what DP needs.
A rank that dies makes the next collective on the others fail after the process group's timeout
(set it in ``init_process_group(timeout=...)``); the error says so instead of hanging silently.
End a run with :func:`leave_process_group`, not ``destroy_process_group`` alone (it says why).
"""
from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import torch
from torch import nn

from ._checks import check_nonnegative


class DistributedContext:
    """rank and world size of the default process group, and the collectives the engine needs.

    Takes no arguments; the default process group must be initialized
    (``torch.distributed.init_process_group``). Attributes: ``rank`` and ``world_size`` (ints).
    """

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def agree_seed(self, seed: int | None) -> int:
        """The same seed on every rank (a collective: every rank must call it).

        Every rank first gathers what every rank was given (an int or None), so that ranks given
        None and ranks given an int take the same collectives and the mismatch is refused, not a
        hang until the process group's timeout.

        Args:
            seed: this rank's seed (an int), or None on every rank for a random one drawn by rank 0.
        Returns:
            the agreed seed, an int (< 2^56 when drawn).
        Raises:
            ValueError when the ranks were given different seeds, or None on some ranks and an int on
            others (their draws would differ).
        """
        given = self.gather(None if seed is None else int(seed))
        if any(v != given[0] for v in given):
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(given[:8])) + (" ..." if len(given) > 8 else "")
            raise ValueError(f"seed differs between ranks ({shown}); every rank must be given the same seed (the "
                             "ranks share one Poisson draw and add the same noise): give every rank the same int, "
                             "or None on every rank (rank 0 then draws one for all)")
        if seed is not None:
            return int(seed)
        box = [int.from_bytes(os.urandom(7), "little") if self.rank == 0 else 0]
        self.dist.broadcast_object_list(box, src=0)
        return int(box[0])

    def gather(self, value) -> list:
        """Every rank's ``value``, in rank order (a collective: every rank must call it).

        Args:
            value: a picklable value.
        Returns:
            a list of ``world_size`` values, rank 0's first.
        """
        values = [None] * self.world_size
        self.dist.all_gather_object(values, value)
        return values

    def check_same(self, what: str, value,
                   why: str = "the draws, clip bounds and noise must agree across ranks") -> None:
        """Refuse to go on unless every rank holds the same ``value`` (a collective: every rank calls it).

        Args:
            what: what the value is, for the message (e.g. "seed").
            value: a picklable value, gathered from every rank and compared with ``==`` (for large
                values pass a digest, e.g. ``plan_fingerprint``).
            why: the reason they must agree, for the message.
        Returns:
            None.
        Raises:
            ValueError on every rank when any rank's value differs from rank 0's.
        """
        values = self.gather(value)
        if any(v != values[0] for v in values):
            raise ValueError(f"{what} differs between ranks; every rank must be given the same {what} ({why})")

    def any_rank(self, flag: bool, what: str = "agreeing on a flag", device: torch.device | str = "cpu") -> bool:
        """Whether ``flag`` is true on any rank (a collective: every rank must call it): an
        all-reduce (MAX) of one number.

        Args:
            flag: this rank's flag.
            what: what the flag decides, for the error message (e.g. "checking step 3's records for
                non-finite gradients").
            device: where the number is reduced (a device the process group's backend reduces on).
        Returns:
            True on every rank when any rank's flag is true.
        Raises:
            RuntimeError (naming the rank and ``what``) when the all-reduce fails, e.g. another rank stopped.
        """
        return bool(self.max_over_ranks(1 if flag else 0, what, device))

    def max_over_ranks(self, value: int, what: str = "agreeing on a number", device: torch.device | str = "cpu") -> int:
        """The largest of every rank's ``value`` (a collective: every rank must call it): an all-reduce
        (MAX) of one number.

        Args:
            value: this rank's int, in int32's range.
            what: what the number decides, for the error message.
            device: where the number is reduced (a device the process group's backend reduces on).
        Returns:
            the maximum over the ranks, the same int on every rank.
        Raises:
            RuntimeError (naming the rank and ``what``) when the all-reduce fails, e.g. another rank stopped.
        """
        box = torch.tensor([int(value)], dtype=torch.int32, device=device)
        self._all_reduce(box, self.dist.ReduceOp.MAX, what)
        return int(box.item())

    def sum_over_ranks_(self, tensor: torch.Tensor, what: str) -> None:
        """Σ over ranks of ``tensor``, in place, on its device (a collective: every rank must call it);
        with NCCL on GPUs queued on the current stream, the host not waiting for it (gloo waits).

        Args:
            tensor: this rank's values (any shape; the same shape and dtype on every rank).
            what: what the sum decides, for the error message.
        Returns:
            None.
        Raises:
            RuntimeError (naming the rank and ``what``) when the all-reduce fails, e.g. another rank stopped.
        """
        self._all_reduce(tensor, self.dist.ReduceOp.SUM, what)

    def _all_reduce(self, tensor: torch.Tensor, op, what: str) -> None:
        """``all_reduce(tensor, op)`` in place; a failure (another rank stopped) raised naming ``what``."""
        try:
            self.dist.all_reduce(tensor, op=op)
        except Exception as exc:  # gloo raises RuntimeError, NCCL DistBackendError
            raise RuntimeError(
                f"rank {self.rank}: {what} across {self.world_size} ranks failed; another rank stopped (crashed, "
                "killed or out of memory) or did not reach this point within the process group's timeout "
                f"({type(exc).__name__}: {exc})") from exc

    def all_reduce_sum_(self, grads: list[torch.Tensor], step: int) -> None:
        """Σ over ranks of each tensor, in place: one collective per (device, dtype) bucket.

        Args:
            grads: the tensors (the clipped sums of the trainable parameters), any shapes; overwritten
                with their sums over the ranks.
            step: the optimizer step, for the error message.
        Returns:
            None.
        Raises:
            RuntimeError (naming the rank and step) when the all-reduce fails, e.g. another rank stopped
            or did not reach this step within the process group's timeout.
        """
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            buckets.setdefault((g.device, g.dtype), []).append(g)
        for group in buckets.values():
            flat = torch.cat([g.reshape(-1) for g in group])
            self._all_reduce(flat, self.dist.ReduceOp.SUM, f"summing the clipped gradients of step {step}")
            torch._foreach_copy_(group, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in group]), group)])

    def barrier(self) -> None:
        """Wait until every rank reaches this point (``torch.distributed.barrier``).

        Returns:
            None.
        """
        self.dist.barrier()


def leave_process_group(settle_s: float = 0.1) -> None:
    """Destroy the default process group so that the process can exit cleanly.

    A gloo worker thread frees a finished collective's tensors just after the caller has been told
    it finished. A tensor that Python once owned needs the GIL to be freed; if the main thread has
    meanwhile reached interpreter shutdown, the thread is killed inside a destructor and the process
    aborts ("terminate called without an active exception", SIGABRT; about one process in ten in a
    short DDP run on 2 cores). ``destroy_process_group`` does not stop these threads (torch keeps
    the group referenced from C++). Sleeping ``settle_s`` first releases the GIL so that the threads
    finish freeing. Safe when another rank has died: it runs no collective.

    Without a process group (never initialized, or already left) it does nothing, so it can end a
    ``finally`` block that runs whether or not the group was made.

    Args:
        settle_s: seconds to let the process group's threads finish, a finite number ≥ 0 (0.1 s ended
            100 of 100 runs that aborted about once in ten without it).
    Returns:
        None.
    Raises:
        TypeError / ValueError for a settle_s that is not a finite number ≥ 0.
    """
    import torch.distributed as dist

    settle_s = check_nonnegative("settle_s", settle_s)
    if not (dist.is_available() and dist.is_initialized()):
        return
    time.sleep(settle_s)
    dist.destroy_process_group()


def inner_module(module: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper (state_dict names without "module.").

    Args:
        module: a model, DDP-wrapped or not.
    Returns:
        ``module.module`` for a ``DistributedDataParallel``, else ``module`` itself.
    """
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def unwrap(module: nn.Module) -> tuple[nn.Module, DistributedContext | None]:
    """The model inside a DDP wrapper and its distributed context.

    For a DDP-wrapped model, also switches DDP's own gradient synchronization off
    (``require_backward_grad_sync = False``): the optimizer sums the clipped gradients itself.

    Args:
        module: a model, DDP-wrapped or not.
    Returns:
        (the model inside, a ``DistributedContext``) for a DDP-wrapped model; (module, None) otherwise.
    Raises:
        RuntimeError for a DDP-wrapped model when ``torch.distributed`` is not initialized.
    """
    if inner_module(module) is module:
        return module, None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("the model is wrapped in DistributedDataParallel but torch.distributed is not "
                           "initialized; call torch.distributed.init_process_group first")
    module.require_backward_grad_sync = False  # the optimizer sums the clipped gradients itself
    return module.module, DistributedContext()


def _item_digest(h, item) -> bool:
    """Feed one dataset item into ``h``; False when part of it has no comparable bytes."""
    if isinstance(item, torch.Tensor):
        item = item.detach().cpu().numpy() if item.dtype != torch.bfloat16 else item.detach().float().cpu().numpy()
    if isinstance(item, np.ndarray):
        h.update(f"{item.dtype}{item.shape}".encode())
        h.update(np.ascontiguousarray(item).tobytes())
        return True
    if isinstance(item, (str, bytes, int, float, complex, bool, np.generic)) or item is None:
        h.update(repr(item).encode())
        return True
    if isinstance(item, dict):
        return all(_item_digest(h, key) and _item_digest(h, item[key]) for key in sorted(item, key=repr))
    if isinstance(item, (tuple, list)):
        h.update(f"{type(item).__name__}{len(item)}".encode())
        return all(_item_digest(h, part) for part in item)
    return False   # an image object, a custom record: no bytes to compare


def data_fingerprint(dataset, samples: int = 16) -> str:
    """A digest of a map-style dataset's size and of a few records spread over it, for checking that
    every rank was given the same data (the ranks share one Poisson draw over the whole dataset, so a
    rank given its own shard would train on other records than those drawn and charged).

    Args:
        dataset: a map-style dataset (``len`` and ``dataset[i]``).
        samples: how many records to read, evenly spaced from the first to the last.
    Returns:
        a 64-character hex digest; or "unverifiable" plus the size when the records cannot be compared:
        a record with no comparable bytes (e.g. a PIL image), or one that reads differently twice
        (random augmentation).
    """
    n = len(dataset)
    h = hashlib.sha256(str(n).encode())
    for i in np.unique(np.linspace(0, n - 1, min(samples, n)).round().astype(np.int64)) if n else ():
        first, again = hashlib.sha256(), hashlib.sha256()
        if not (_item_digest(first, dataset[int(i)]) and _item_digest(again, dataset[int(i)])) \
                or first.digest() != again.digest():
            return f"unverifiable ({n} records)"
        h.update(first.digest())
    return h.hexdigest()


def plan_fingerprint(sample_rates: np.ndarray, clip_norms: np.ndarray, noise_multiplier: float,
                     max_grad_norm: float) -> str:
    """A digest of a privacy plan, for checking that every rank was given the same plan.

    Args:
        sample_rates: (N,) per-record sampling rates q_i (any float dtype, hashed as float64).
        clip_norms: (N,) per-record clip bounds c_i (likewise).
        noise_multiplier: σ, a float.
        max_grad_norm: C, a float.
    Returns:
        the SHA-256 of the values as float64 bytes, a 64-character hex string.
    """
    h = hashlib.sha256()
    for arr in (sample_rates, clip_norms, np.array([noise_multiplier, max_grad_norm])):
        h.update(np.ascontiguousarray(arr, dtype=np.float64).tobytes())
    return h.hexdigest()


def generator_fingerprint(generator: torch.Generator | None) -> str | None:
    """A digest of a random generator's state, for checking that every rank was given the same one.

    Args:
        generator: a ``torch.Generator`` (any device), or None.
    Returns:
        the SHA-256 of its device type and ``get_state()`` bytes, a 64-character hex string; None for None.
    """
    if generator is None:
        return None
    h = hashlib.sha256(generator.device.type.encode())
    h.update(generator.get_state().numpy().tobytes())
    return h.hexdigest()


def process_group_size() -> int:
    """The size of the default process group: 1 when ``torch.distributed`` is unavailable or not initialized.

    Returns:
        the world size, an int ≥ 1.
    """
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def active_ddp_wrapper() -> nn.Module | None:
    """The ``DistributedDataParallel`` whose forward is running now, if torch says (it records it for
    TorchDynamo in ``DistributedDataParallel._get_active_ddp_module``; None where this torch does not).

    Returns:
        the DDP wrapper running its forward, or None.
    """
    from torch.nn.parallel import DistributedDataParallel

    active = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    return active() if callable(active) else None
