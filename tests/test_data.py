"""DPDataLoader (pdpfast.data): what it cannot draw from is refused by name at construction."""
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from pdpfast.data import DPDataLoader


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
