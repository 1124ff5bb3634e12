"""Weighted Poisson sampling data loader (DESIGN.md §1.1).

Every step draws record i independently with probability q_i, so batch sizes are random and may be
zero. Nothing here ever shuffles, fixes the batch size or truncates a draw: with a physical batch
capacity, a larger draw is split over several physical batches (the last padded with masked rows)
and the optimizer steps once all of them have been through backward.
"""
from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)
from torch.utils.data.dataloader import default_collate, default_convert

from ._checks import as_per_record, check_int
from .sampling import PoissonSampler


@dataclass(frozen=True)
class PhysicalBatch:
    """What the engine needs to know about one physical batch.

    Args:
        indices: (rows,) int64 record index of every row (padding rows repeat a record).
        mask: (rows,) float, 1 for real rows, 0 for padding, or None when there is no padding.
        step: the logical step (draw) this batch belongs to.
        is_last: whether the optimizer should step after this batch.
    """

    indices: torch.Tensor
    mask: torch.Tensor | None
    step: int
    is_last: bool


class _EmptySafeCollate:
    """The user's collate, plus zero-row batches shaped like one sample (empty Poisson draws)."""

    def __init__(self, dataset: Dataset, collate_fn: Callable):
        self.dataset, self.collate_fn = dataset, collate_fn

    def __call__(self, samples):
        if samples:
            return self.collate_fn(samples)
        return _take_zero_rows(self.collate_fn([self.dataset[0]]))


def _take_zero_rows(batch):
    """The zero-row batch shaped like ``batch`` (one sample collated).

    Args:
        batch: a tensor, or a mapping, named tuple, list or tuple of them (nested); anything else is kept.
    Returns:
        the same structure with every tensor's rows cut to 0. A mapping of any kind (a dict, transformers'
        ``BatchEncoding``, a ``collections.abc.Mapping`` of one's own) keeps its type where
        ``type(batch)(dict)`` builds one, and is a plain dict of the same keys where it does not.
    """
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, Mapping):
        rows = {k: _take_zero_rows(v) for k, v in batch.items()}
        try:
            return type(batch)(rows)
        except (TypeError, ValueError):     # a mapping type not built from a dict (defaultdict, a no-argument init)
            return rows
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_take_zero_rows(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take_zero_rows(v) for v in batch)
    return batch


def map_style_length(dataset) -> int:
    """N of a map-style dataset (``len`` and ``dataset[i]``): Poisson sampling draws records by index.

    Args:
        dataset: the dataset a Poisson loader (or ``make_private``, or ``PDPSGD``) would draw from.
    Returns:
        len(dataset), an int.
    Raises:
        TypeError for an iterable-style dataset, one without ``__len__`` and ``__getitem__``, or a mapping or
        string (``len`` and ``[]`` of their own, but records 0..N-1 are not their items).
    """
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(f"dataset must be a map-style dataset (with __len__ and __getitem__: records are drawn "
                        f"by index), got {type(dataset).__name__}")
    if isinstance(dataset, (Mapping, str, bytes)):  # d[0] would look up a key or give one character
        raise TypeError(f"dataset must be indexed by record number 0..N-1 (records are drawn by index), got a "
                        f"{type(dataset).__name__}; for a dict of records, pass list(d.values())")
    return len(dataset)


def check_whole_dataset_sampler(data_loader: DataLoader, world_size: int = 1) -> None:
    """Refuse a loader whose sampler picks records: Poisson sampling replaces the sampler and draws
    from every record of ``data_loader.dataset``, so a sampler that selects a subset, repeats or
    weights records would be silently ignored (and the held-out records trained on).

    What passes: the samplers ``shuffle=False`` / ``shuffle=True`` make (a ``SequentialSampler``, or a
    ``RandomSampler`` without replacement over the whole dataset once), batched by torch's own
    ``BatchSampler`` (``batch_size=B``, or given as ``batch_sampler=``) or not batched; and, when
    ``world_size > 1``, a ``DistributedSampler`` over the whole dataset with ``num_replicas ==
    world_size`` (each rank takes its share of the global draw instead).

    Args:
        data_loader: the torch DataLoader given to ``make_private`` / ``DPDataLoader.from_data_loader``.
        world_size: processes sharing each draw (1 without data parallelism).
    Returns:
        None.
    Raises:
        ValueError naming the sampler otherwise.
    """
    dataset, sampler, batch_sampler = data_loader.dataset, data_loader.sampler, data_loader.batch_sampler
    fix = ("Poisson sampling replaces the sampler: every step draws each record of data_loader.dataset with "
           "its own rate q_i, so the sampler would be ignored; to train on part of the data, pass "
           "DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=...)")
    # exact types: a subclass may pick records its own way
    if batch_sampler is not None:
        if type(batch_sampler) is not BatchSampler:
            raise ValueError(f"data_loader has a custom batch_sampler ({type(batch_sampler).__name__}); {fix}")
        sampler = batch_sampler.sampler  # batch_size=B's own, or one the user batched with BatchSampler
    whole = (type(sampler) is SequentialSampler and sampler.data_source is dataset) or (
        type(sampler) is RandomSampler and sampler.data_source is dataset and not sampler.replacement
        and sampler.num_samples == len(dataset))
    sharded = (world_size > 1 and type(sampler) is DistributedSampler and sampler.dataset is dataset
               and sampler.num_replicas == world_size)
    if not (whole or sharded):
        raise ValueError(f"data_loader has a sampler other than the whole dataset once in order or shuffled "
                         f"({_describe(sampler, world_size)}); {fix}")


def _describe(sampler, world_size: int) -> str:
    if type(sampler) is RandomSampler:
        return f"RandomSampler(replacement={sampler.replacement}, num_samples={sampler.num_samples})"
    if type(sampler) is DistributedSampler:
        return f"DistributedSampler(num_replicas={sampler.num_replicas}) with world_size={world_size}"
    return type(sampler).__name__


class _PhysicalBatches:
    """Batch sampler for the inner DataLoader; queues each batch's metadata in draw order."""

    def __init__(self, loader: DPDataLoader):
        self.loader = loader

    def __iter__(self):
        loader = self.loader
        first, resume = loader.next_step, loader._resume
        for step in range(first, first + loader.steps_per_epoch):
            batches = loader.split(loader.poisson_sampler.draw(loader.seed, step), step)
            if resume is not None and resume[0] == step:  # the rest of a draw left part-way
                batches = batches[resume[1]:]
            for batch in batches:
                loader._pending.append(batch)
                yield batch.indices.tolist()

    def __len__(self):
        return self.loader.steps_per_epoch


class DPDataLoader:
    """Iterates batches drawn by weighted Poisson sampling.

    Args:
        dataset: any map-style dataset of N records.
        sample_rates: q_i, a float or (N,) in [0, 1].
        steps_per_epoch: draws per iteration of the loader (default N / Σ q_i, i.e. one pass in
            expectation).
        physical_batch_size: optional capacity K; draws larger than K are split into several batches of
            K rows and the last is padded with masked rows, so every batch has K rows.
        seed: of the counter-based draw (a fresh random one by default); draw t depends only on
            (seed, t), so a resumed run continues the same sequence from ``next_step``.
        collate_fn: the collate function (default torch's); empty draws collate to zero-row batches.
        start_step: the first draw's index (``next_step``).
        rank, world_size: under data parallelism every process draws the same global sample (same
            seed) and takes its share, drawn records ``rank::world_size``. Every rank yields the same number
            of physical batches per draw (those with a smaller share pad with masked rows), so collectives
            stay in step; without a physical batch size each rank yields one batch per draw, of one masked
            row where its share is empty (and empty on every rank where the draw is).
        **loader_kwargs: go to the inner ``DataLoader`` (not batch_size, shuffle, sampler, batch_sampler,
            drop_last).
    Raises:
        TypeError for a dataset that is not map-style (None, an ``IterableDataset``), a ``collate_fn`` that is
        not callable or a ``generator`` that is not a ``torch.Generator``; ValueError for an empty dataset,
        all-zero rates, a bad rank / count / seed (an int in [0, 2**63)), or a batching argument.
    """

    def __init__(self, dataset: Dataset, sample_rates, *, steps_per_epoch: int | None = None,
                 physical_batch_size: int | None = None, seed: int | None = None,
                 collate_fn: Callable | None = None, start_step: int = 0, rank: int = 0, world_size: int = 1,
                 **loader_kwargs):
        n = map_style_length(dataset)
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable (a function of a list of samples) or None, got "
                            f"{type(collate_fn).__name__}")
        if loader_kwargs.get("generator") is not None and not isinstance(loader_kwargs["generator"], torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(loader_kwargs['generator']).__name__}")
        world_size, rank = check_int("world_size", world_size, 1), check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank!r}, world_size={world_size!r}")
        self.rank, self.world_size = rank, world_size
        if n == 0:
            raise ValueError("dataset is empty")
        self.dataset = dataset
        # the loader's own copy, read-only: the sampler's thresholds are computed from it once, and a
        # caller's array changed in place afterwards must not leave the draws and the rates apart
        rates = as_per_record("sample_rates", sample_rates, n, low=0.0, high=1.0).copy()
        self.sample_rates_tensor = torch.from_numpy(rates)
        rates.flags.writeable = False
        self.sample_rates = rates
        # poisson_sample(sample_rates_tensor, seed, step) bit for bit, with its per-record set-up done once
        self.poisson_sampler = PoissonSampler(self.sample_rates_tensor)
        self.expected_batch_size = float(self.sample_rates.sum())
        if self.expected_batch_size <= 0:
            raise ValueError("sample_rates are all 0: no record would ever be drawn")
        if steps_per_epoch is None:
            steps_per_epoch = max(1, round(n / self.expected_batch_size))
        steps_per_epoch = check_int("steps_per_epoch", steps_per_epoch, 1)
        if physical_batch_size is not None:
            physical_batch_size = check_int("physical_batch_size", physical_batch_size, 1)
        for key in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if key in loader_kwargs:
                raise ValueError(f"{key} cannot be set: batches are drawn by Poisson sampling")
        self.steps_per_epoch = steps_per_epoch
        self.physical_batch_size = physical_batch_size
        self.seed = int.from_bytes(os.urandom(7), "little") if seed is None else check_int("seed", seed, 0)
        self.next_step = check_int("start_step", start_step, 0)
        self.on_batch: Callable[[PhysicalBatch], None] | None = None
        self.current: PhysicalBatch | None = None
        self._yielded_of_draw = 0      # physical batches of current's draw yielded so far
        self._resume: tuple[int, int] | None = None
        self._pending: deque[PhysicalBatch] = deque()
        # the DataLoader draws its worker base seed from this generator, not from torch's global one
        loader_kwargs.setdefault("generator", torch.Generator().manual_seed(self.seed))
        self._loader = DataLoader(dataset, batch_sampler=_PhysicalBatches(self),
                                  collate_fn=_EmptySafeCollate(dataset, collate_fn or default_collate), **loader_kwargs)

    @classmethod
    def from_data_loader(cls, data_loader: DataLoader, sample_rates, **kwargs) -> DPDataLoader:
        """A Poisson loader with the same dataset, collate function and worker settings as ``data_loader``.

        Args:
            data_loader: the torch DataLoader to copy settings from.
            sample_rates: q_i, a float or (N,) in [0, 1].
            **kwargs: other constructor arguments (override the copied settings).
        Returns:
            a ``DPDataLoader``.
        Raises:
            TypeError when ``data_loader`` is not a torch DataLoader (a dataset goes to ``DPDataLoader(...)``
            itself); ValueError for a loader with a sampler or batch sampler that picks records
            (``check_whole_dataset_sampler``: Poisson sampling replaces it; use ``Subset`` for part of the
            data); otherwise as the constructor.
        """
        if isinstance(data_loader, DPDataLoader):
            raise TypeError("data_loader is already a DPDataLoader; pass the torch DataLoader it was made from "
                            "(or DPDataLoader(data_loader.dataset, sample_rates, ...))")
        if not isinstance(data_loader, DataLoader):
            raise TypeError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__} (for a "
                            "dataset, call DPDataLoader(dataset, sample_rates, ...))")
        check_whole_dataset_sampler(data_loader, check_int("world_size", kwargs.get("world_size", 1), 1))
        keep = {k: getattr(data_loader, k) for k in ("num_workers", "pin_memory", "timeout", "worker_init_fn",
                                                      "multiprocessing_context", "persistent_workers", "generator")}
        if keep["generator"] is None:
            del keep["generator"]
        if data_loader.num_workers > 0:
            keep["prefetch_factor"] = data_loader.prefetch_factor
        keep.update(kwargs)
        # batch_size=None turns batching off and torch's collate into default_convert (one sample at a
        # time); Poisson batches need the batching collate
        collate_fn = None if data_loader.collate_fn is default_convert else data_loader.collate_fn
        return cls(data_loader.dataset, sample_rates, collate_fn=collate_fn, **keep)

    def split(self, drawn: torch.Tensor, step: int) -> list[PhysicalBatch]:
        """The physical batches of one draw: all of it, in chunks of the capacity if one is set.

        Args:
            drawn: (n,) int64 indices of the records drawn (the global sample; this rank takes its share).
            step: the draw's index.
        Returns:
            a list of ``PhysicalBatch``; the last has ``is_last`` True.
        """
        K, W = self.physical_batch_size, self.world_size
        share = drawn if W == 1 else drawn[self.rank::W]
        if K is None:
            if share.numel() or not drawn.numel():
                return [PhysicalBatch(share, None, step, True)]
            # a rank whose share of a drawn sample is empty runs one masked row (a copy of record 0, weight 0),
            # so that every rank runs a backward, and the collectives in it stay in step
            return [PhysicalBatch(torch.zeros(1, dtype=torch.long), torch.zeros(1), step, True)]
        chunks = list(share.split(K)) or [share]
        # every rank makes as many batches as the largest share needs (rank 0's: ⌈n/W⌉ records)
        largest_share = -(-drawn.numel() // W)
        count = max(1, -(-largest_share // K))
        chunks += [share[:0]] * (count - len(chunks))
        batches = []
        for j, chunk in enumerate(chunks):
            mask = torch.zeros(K)
            mask[: chunk.numel()] = 1
            pad = chunk[:1] if chunk.numel() else torch.zeros(1, dtype=torch.long)
            indices = torch.cat([chunk, pad.expand(K - chunk.numel())])
            batches.append(PhysicalBatch(indices, mask, step, j == len(chunks) - 1))
        return batches

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def batch_sampler(self):
        """Absent: the loader draws its own Poisson batches. Reading it raises an ``AttributeError`` that
        says so, for code written for Opacus (its ``BatchMemoryManager`` reads it to split batches)."""
        raise AttributeError(
            "DPDataLoader has no batch_sampler: it draws its own Poisson batches, and a sampler that re-split "
            "them would change what one step is. Opacus's BatchMemoryManager is not needed here: pass "
            "physical_batch_size= (to make_private or DPDataLoader) to split each draw into batches of that many "
            "rows, one optimizer.step() per draw")

    def __iter__(self):
        self._pending.clear()
        # a draw left part-way (a break, an exception) goes on where it stopped: its first physical batches are
        # not yielded again (their rows would add to the pending sums twice) and the rest is not dropped
        part_way = self.current is not None and not self.current.is_last
        self._resume = (self.current.step, self._yielded_of_draw) if part_way else None
        for data in self._loader:
            batch = self._pending.popleft()
            if self.on_batch is not None:
                # may refuse the batch (the engine: the previous draw is not stepped); then it is not given
                # out, and the next pass offers it again
                self.on_batch(batch)
            same_draw = self.current is not None and not self.current.is_last and self.current.step == batch.step
            self._yielded_of_draw = self._yielded_of_draw + 1 if same_draw else 1
            self.current = batch
            if batch.is_last:
                self.next_step = batch.step + 1
            yield data
