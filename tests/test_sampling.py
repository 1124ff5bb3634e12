"""pdpfast.sampling's public generator pieces refuse arguments that would give other bits, by name."""
import numpy as np
import pytest
import torch

from pdpfast import sampling


@pytest.mark.parametrize("count,error", [(-1, ValueError), (1.5, TypeError), ("3", TypeError), (True, TypeError),
                                         (None, TypeError)])
def test_random_bits_reference_refuses_a_count_that_is_not_an_int_at_least_zero(count, error):
    with pytest.raises(error, match="count must be an int"):
        sampling.random_bits_reference(count, 1, 0)


def test_random_bits_reference_accepts_zero_and_numpy_counts():
    assert sampling.random_bits_reference(0, 1, 0).shape == (0,)
    assert torch.equal(sampling.random_bits_reference(np.int64(5), 1, 0), sampling.random_bits_reference(5, 1, 0))


@pytest.mark.parametrize("shift,error", [(0, ValueError), (64, ValueError), (-1, ValueError), (1.0, TypeError),
                                         (True, TypeError)])
def test_logical_shift_right_refuses_a_shift_outside_1_to_63(shift, error):
    with pytest.raises(error, match=r"shift must be an int in \[1, 63\]"):
        sampling.logical_shift_right(torch.tensor([-1], dtype=torch.int64), shift)


def test_logical_shift_right_shifts_in_zeros():
    z = torch.tensor([-1], dtype=torch.int64)
    assert sampling.logical_shift_right(z, 63).item() == 1 and sampling.logical_shift_right(z, 1).item() == 2**63 - 1


@pytest.mark.parametrize("z", [torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1.0]), np.array([1])],
                         ids=["int32", "float", "numpy"])
def test_mix64_refuses_anything_but_an_int64_tensor(z):
    """Before: an int32 tensor was mixed in int32 arithmetic, silently giving other bits."""
    with pytest.raises(TypeError, match="z must be an int64 tensor"):
        sampling.mix64_(z)
    with pytest.raises(TypeError, match="z must be an int64 tensor"):
        sampling.logical_shift_right(z, 3)
