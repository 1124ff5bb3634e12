"""DPDataLoader (pdpfast.data): what it cannot draw from is refused by name at construction; an empty
draw is a zero-row batch of the collate's own structure."""
from collections.abc import Mapping

import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import pdpfast
from pdpfast.data import DPDataLoader, map_style_length


def _data(n=10):
    return TensorDataset(torch.randn(n, 2), torch.arange(n))


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize("dataset", [None, _Stream(), 5], ids=["None", "IterableDataset", "int"])
def test_dp_data_loader_refuses_a_dataset_that_is_not_map_style(dataset):
    with pytest.raises(TypeError, match="dataset must be a map-style dataset"):
        DPDataLoader(dataset, 0.3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(collate_fn=5), "collate_fn must be callable"),
    (dict(generator=5), "generator must be a torch.Generator"),
])
def test_dp_data_loader_refuses_a_collate_fn_or_generator_of_the_wrong_kind_at_construction(kwargs, match):
    """Before: collate_fn=5 failed only at iteration ("'int' object is not callable"), generator=5 in torch."""
    with pytest.raises(TypeError, match=match):
        DPDataLoader(_data(), 0.3, seed=0, **kwargs)


def test_dp_data_loader_keeps_a_callable_collate_fn_and_a_generator():
    loader = DPDataLoader(_data(), 1.0, seed=0, steps_per_epoch=1, collate_fn=lambda rows: len(rows),
                          generator=torch.Generator().manual_seed(1))
    assert list(loader) == [10]


def test_from_data_loader_refuses_a_dataset_given_for_the_loader():
    with pytest.raises(TypeError, match="data_loader must be a torch DataLoader"):
        DPDataLoader.from_data_loader(_data(), 0.3)
    assert DPDataLoader.from_data_loader(DataLoader(_data(), batch_size=2), 0.3, seed=0).expected_batch_size == \
        pytest.approx(3.0)


class _EveryOtherBatch(BatchSampler):
    def __iter__(self):
        return (batch for j, batch in enumerate(super().__iter__()) if j % 2 == 0)


_PICKING_LOADERS = {
    "SubsetRandomSampler": lambda ds: DataLoader(ds, batch_size=2, sampler=SubsetRandomSampler(range(5))),
    "WeightedRandomSampler": lambda ds: DataLoader(ds, sampler=WeightedRandomSampler([1.0] * 10, 10)),
    "a list of indices": lambda ds: DataLoader(ds, sampler=[0, 1, 2]),
    "RandomSampler with replacement": lambda ds: DataLoader(ds, sampler=RandomSampler(ds, replacement=True)),
    "RandomSampler of fewer records": lambda ds: DataLoader(ds, sampler=RandomSampler(ds, num_samples=5)),
    "SequentialSampler of other data": lambda ds: DataLoader(ds, sampler=SequentialSampler(range(10))),
    "batch_sampler of index lists": lambda ds: DataLoader(ds, batch_sampler=[[0, 1], [2]]),
    "BatchSampler subclass": lambda ds: DataLoader(ds, batch_sampler=_EveryOtherBatch(SequentialSampler(ds), 2,
                                                                                      False)),
    "DistributedSampler in one process": lambda ds: DataLoader(ds, sampler=DistributedSampler(ds, 2, 0)),
}


@pytest.mark.parametrize("make", _PICKING_LOADERS.values(), ids=_PICKING_LOADERS.keys())
def test_a_sampler_that_picks_records_is_refused_since_poisson_sampling_replaces_it(make):
    """Before: ignored, and the Poisson draw ran over every record (held-out ones trained on)."""
    with pytest.raises(ValueError, match=r"data_loader has a .*sampler.*Poisson sampling replaces the sampler.*"
                                         r"torch\.utils\.data\.Subset"):
        DPDataLoader.from_data_loader(make(_data()), 0.3, seed=0)


def test_make_private_refuses_a_subset_sampler_and_leaves_the_model_unconverted():
    model = nn.Sequential(nn.Linear(2, 3))
    before = [type(m) for m in model.modules()]
    loader = DataLoader(_data(), batch_size=2, sampler=SubsetRandomSampler(range(5)))
    with pytest.raises(ValueError, match="Subset"):
        pdpfast.PrivacyEngine(seed=0).make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                   data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
    assert [type(m) for m in model.modules()] == before


class _Unsized:
    """A sampler without __len__ (so a loader over it has none either)."""

    def __iter__(self):
        return iter(range(5))


def test_make_private_names_a_sampler_without_a_length_rather_than_failing_on_len():
    model = nn.Sequential(nn.Linear(2, 3))
    loader = DataLoader(_data(), batch_size=2, sampler=_Unsized())
    with pytest.raises(ValueError, match="data_loader has a sampler other than the whole dataset.*_Unsized"):
        pdpfast.PrivacyEngine(seed=0).make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                   data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)


_WHOLE_DATASET_LOADERS = {
    "batch_size": lambda ds: DataLoader(ds, batch_size=2),
    "shuffle": lambda ds: DataLoader(ds, batch_size=2, shuffle=True, drop_last=True),
    "unbatched": lambda ds: DataLoader(ds, batch_size=None),
    "RandomSampler over all": lambda ds: DataLoader(ds, sampler=RandomSampler(ds)),
    "BatchSampler given": lambda ds: DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 2, False)),
}


@pytest.mark.parametrize("make", _WHOLE_DATASET_LOADERS.values(), ids=_WHOLE_DATASET_LOADERS.keys())
def test_the_samplers_batch_size_and_shuffle_make_are_replaced_by_the_draw_over_every_record(make):
    loader = DPDataLoader.from_data_loader(make(_data()), 1.0, seed=0, steps_per_epoch=1)
    assert [sorted(y.tolist()) for _, y in loader] == [list(range(10))]


def test_a_distributed_sampler_is_replaced_by_each_ranks_share_of_the_global_draw():
    dataset = _data()
    loaders = [DPDataLoader.from_data_loader(DataLoader(dataset, sampler=DistributedSampler(dataset, 2, r)), 1.0,
                                             seed=0, steps_per_epoch=1, rank=r, world_size=2) for r in (0, 1)]
    shares = [y.tolist() for loader in loaders for _, y in loader]
    assert sorted(shares[0] + shares[1]) == list(range(10))


def test_a_dp_data_loader_given_back_to_from_data_loader_is_refused_by_name():
    with pytest.raises(TypeError, match="data_loader is already a DPDataLoader"):
        DPDataLoader.from_data_loader(DPDataLoader(_data(), 0.3, seed=0), 0.3)


@pytest.mark.parametrize("dataset", [{"a": 1, "b": 2}, {0: 1, 1: 2}, "abc", b"abc"],
                         ids=["str keys", "int keys", "str", "bytes"])
def test_a_mapping_or_a_string_is_refused_since_records_are_drawn_by_number(dataset):
    """Before: accepted, then a KeyError 0 (or single characters) at the first draw."""
    with pytest.raises(TypeError, match="dataset must be indexed by record number"):
        map_style_length(dataset)
    assert map_style_length([(1, 2), (3, 4)]) == 2


class _Record(Mapping):
    """A read-only mapping of one's own, built from a dict (not a dict subclass)."""

    def __init__(self, fields):
        self._fields = dict(fields)

    def __getitem__(self, key):
        return self._fields[key]

    def __iter__(self):
        return iter(self._fields)

    def __len__(self):
        return len(self._fields)


class _Fixed(_Record):
    """A mapping whose constructor takes no dict."""

    def __init__(self):
        super().__init__({"x": torch.ones(1, 2)})


def _empty_draw(collate):
    records = [{"x": torch.randn(2), "y": torch.tensor(i)} for i in range(6)]
    loader = DPDataLoader(records, 1e-9, seed=0, steps_per_epoch=1, collate_fn=collate)
    (batch,) = list(loader)
    assert len(loader.current.indices) == 0
    return batch


def test_an_empty_draw_through_a_collate_returning_any_mapping_has_zero_rows_not_record_0():
    """Before: only a dict was cut to zero rows; any other Mapping came back as record 0, a one-row batch."""
    batch = _empty_draw(lambda rows: _Record({k: torch.stack([r[k] for r in rows]) for k in rows[0]}))
    assert type(batch) is _Record and batch["x"].shape == (0, 2) and batch["y"].shape == (0,)
    batch = _empty_draw(lambda rows: _Fixed())
    assert type(batch) is dict and batch["x"].shape == (0, 2)


def test_an_empty_draw_through_a_collate_returning_a_batch_encoding_keeps_its_type_with_zero_rows():
    transformers = pytest.importorskip("transformers")
    batch = _empty_draw(lambda rows: transformers.BatchEncoding(
        {"input_ids": torch.stack([r["x"] for r in rows]), "labels": torch.stack([r["y"] for r in rows])}))
    assert isinstance(batch, transformers.BatchEncoding)
    assert batch["input_ids"].shape == (0, 2) and batch["labels"].shape == (0,)


def test_a_loader_draws_from_the_rates_it_was_given_even_if_the_callers_array_changes_later():
    """The loader's Poisson draw uses thresholds computed once from its rates: it keeps its own read-only
    copy, so a caller's array edited afterwards cannot leave its draws and its expected batch size apart."""
    import numpy as np

    from pdpfast.sampling import poisson_sample

    rates = np.full(64, 0.25)
    loader = DPDataLoader(_data(64), rates, seed=3)
    rates[:] = 1.0
    drawn = [batch[1] for batch in loader]
    assert loader.expected_batch_size == 16.0
    for step, labels in enumerate(drawn):
        assert torch.equal(labels, poisson_sample(torch.full((64,), 0.25, dtype=torch.float64), 3, step))
    with pytest.raises(ValueError, match="read-only"):
        loader.sample_rates[0] = 1.0
