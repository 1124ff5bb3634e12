"""Weighted Bernoulli (Poisson) sampling: the privacy-critical draw of every DP-SGD step.

The accountant assumes record i is in step t's batch independently with probability q_i — never a
shuffle, never a fixed size, never truncated. These tests check that property statistically, and
check that the C++ kernel, the CUDA kernel and the plain-torch reference make bit-identical draws
for every (seed, step), whatever the thread count.
"""
import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy import stats

from pdpfast import sampling
from pdpfast.sampling import PoissonSampler, poisson_sample, poisson_sample_reference, sample_thresholds

HAS_CPP = sampling.unavailable_reason("cpu") is None
needs_cpp = pytest.mark.skipif(not HAS_CPP, reason=f"C++ sampler not built: {sampling.unavailable_reason('cpu')}")
HAS_THRESHOLDS = sampling._THRESHOLDS_ERROR is None
needs_thresholds = pytest.mark.skipif(not HAS_THRESHOLDS, reason=f"no threshold kernel: {sampling._THRESHOLDS_ERROR}")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# "auto" is whatever poisson_sample picks here (the C++ kernel when built); "torch" the reference;
# "loader" what DPDataLoader draws with (PoissonSampler: the C++ threshold kernel when built).
SAMPLERS = {"auto": poisson_sample, "torch": poisson_sample_reference,
            "loader": lambda rates, seed, step: PoissonSampler(rates).draw(seed, step)}
GRID_RATES = (0.0, 1e-3, 0.05, 0.3, 0.9, 1.0)
# Per-record acceptance bands hold with probability 1 - ALPHA each; with ~100 records checked per
# test a false alarm is ~1e-6.
ALPHA = 1e-8


@pytest.fixture(autouse=True)
def _quiet_fallback_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="pdpfast.sampling: using the plain-torch", category=RuntimeWarning)
        yield


def _hit_counts(sampler, rates, seed, steps):
    counts = torch.zeros(rates.numel(), dtype=torch.int64)
    sizes = []
    for step in range(steps):
        batch = sampler(rates, seed, step)
        counts += torch.bincount(batch, minlength=rates.numel())
        sizes.append(batch.numel())
    return counts, np.array(sizes)


def _binomial_band(trials, rate, alpha=ALPHA):
    return stats.binom.ppf(alpha / 2, trials, rate), stats.binom.isf(alpha / 2, trials, rate)


# ---------------------------------------------------------------------------------------------
# The draw has the distribution the accountant assumes
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampler_name", sorted(SAMPLERS))
def test_per_record_frequencies_match_sample_rates(sampler_name):
    steps = 2000
    rates = torch.tensor(GRID_RATES, dtype=torch.float64).repeat_interleave(8)
    counts, _ = _hit_counts(SAMPLERS[sampler_name], rates, seed=20240611, steps=steps)
    for record, rate in enumerate(rates.tolist()):
        if rate == 0.0:
            assert counts[record] == 0, f"record {record} with q=0 was drawn"
        elif rate == 1.0:
            assert counts[record] == steps, f"record {record} with q=1 was left out"
        else:
            low, high = _binomial_band(steps, rate)
            assert low <= counts[record] <= high, f"record {record}: q={rate}, {int(counts[record])} hits in {steps}"
    # pooled over the 8 records that share a rate the band is tighter
    for group, rate in enumerate(GRID_RATES):
        pooled = int(counts[8 * group:8 * (group + 1)].sum())
        low, high = _binomial_band(8 * steps, rate)
        assert low <= pooled <= high, f"q={rate}: {pooled} hits in {8 * steps} draws"


@pytest.mark.parametrize("sampler_name", sorted(SAMPLERS))
def test_poisson_sampling_is_never_truncated_or_fixed_size(sampler_name):
    sampler = SAMPLERS[sampler_name]
    generator = torch.Generator().manual_seed(7)
    rates = torch.rand(5000, generator=generator, dtype=torch.float64) * 0.2
    steps = 300
    _, sizes = _hit_counts(sampler, rates, seed=11, steps=steps)
    expected_size = float(rates.sum())
    size_std = float((rates * (1 - rates)).sum().sqrt())
    # the size is random (Poisson-binomial), not fixed
    assert len(set(sizes.tolist())) > 20
    assert abs(sizes.mean() - expected_size) < 5 * size_std / np.sqrt(steps)
    assert 0.75 * size_std < sizes.std() < 1.25 * size_std
    # rates of 1 put every record in, however large the draw: nothing is cut to a capacity
    everyone = torch.ones(100_003, dtype=torch.float32)
    assert torch.equal(sampler(everyone, 3, 5), torch.arange(100_003))
    nearly_everyone = torch.full((100_003,), 0.99, dtype=torch.float64)
    assert sampler(nearly_everyone, 3, 5).numel() > 98_000


@pytest.mark.parametrize("sampler_name", sorted(SAMPLERS))
def test_draws_of_different_steps_are_independent(sampler_name):
    sampler = SAMPLERS[sampler_name]
    num_records, rate = 20_000, 0.5
    rates = torch.full((num_records,), rate)
    batches = [sampler(rates, 99, step) for step in range(6)] + [sampler(rates, 100, 0)]
    for a in range(len(batches)):
        for b in range(a + 1, len(batches)):
            assert not torch.equal(batches[a], batches[b])
            # |A ∩ B| ~ Binomial(N, q^2) when the two draws are independent
            shared = np.intersect1d(batches[a].numpy(), batches[b].numpy()).size
            low, high = _binomial_band(num_records, rate * rate)
            assert low <= shared <= high, f"draws {a} and {b} share {shared} records"


# ---------------------------------------------------------------------------------------------
# Reproducibility and agreement between implementations
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampler_name", sorted(SAMPLERS))
def test_draw_is_reproducible_from_seed_and_step(sampler_name):
    sampler = SAMPLERS[sampler_name]
    rates = torch.rand(10_007, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    first = sampler(rates, 123, 45)
    assert torch.equal(first, sampler(rates, 123, 45))
    assert torch.equal(first, sampler(rates.numpy(), 123, 45))
    assert first.dtype == torch.int64 and first.device.type == "cpu"
    # sorted, unique, in range
    assert bool((first[1:] > first[:-1]).all()) and 0 <= int(first[0]) and int(first[-1]) < rates.numel()


@needs_cpp
def test_draw_does_not_depend_on_thread_count():
    rates = torch.rand(300_001, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.3
    reference = poisson_sample(rates, 5, 8, num_threads=1)
    for num_threads in (2, 3, 4, 7, 16):
        assert torch.equal(poisson_sample(rates, 5, 8, num_threads=num_threads), reference)
    previous = torch.get_num_threads()
    try:
        for torch_threads in (1, 2):
            torch.set_num_threads(torch_threads)
            assert torch.equal(poisson_sample(rates, 5, 8), reference)
    finally:
        torch.set_num_threads(previous)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_records", [1, 7, 63, 64, 65, 513, 100_003])
@pytest.mark.parametrize("seed,step", [(0, 0), (1, 2), (2**64 - 1, 2**63 + 5), (987654321, 10**12)])
def test_cpp_and_torch_paths_draw_identical_indices(dtype, num_records, seed, step):
    generator = torch.Generator().manual_seed(num_records)
    rates = torch.rand(num_records, generator=generator, dtype=torch.float64).to(dtype)
    rates[::5] = 0.0
    rates[1::7] = 1.0
    expected = poisson_sample_reference(rates, seed, step)
    assert torch.equal(sampling._C.poisson_sample_cpu(rates, seed, step, 0), expected)
    assert torch.equal(poisson_sample(rates, seed, step, num_threads=2), expected)


@needs_cpp
@pytest.mark.parametrize("seed,step", [(0, 0), (42, 7), (2**64 - 1, 2**64 - 1)])
def test_cpp_and_torch_generators_agree_bit_for_bit(seed, step):
    assert torch.equal(sampling._C.sampler_random_bits_cpu(4099, seed, step),
                       sampling.random_bits_reference(4099, seed, step))


def test_mix_function_is_the_splitmix64_finalizer():
    # published SplitMix64 outputs (Vigna's splitmix64.c, state 1234567): the finalizer and the
    # uint64 wrap-around of the int64 tensor arithmetic are right
    published = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
                 16408922859458223821]
    states = [(1234567 + k * sampling.GOLDEN_GAMMA) & sampling._MASK64 for k in range(1, 6)]
    assert [sampling.mix64_int(state) for state in states] == published
    as_tensor = torch.tensor([sampling.as_int64(state) for state in states], dtype=torch.int64)
    assert [value & sampling._MASK64 for value in sampling.mix64_(as_tensor).tolist()] == published


def test_torch_generator_follows_the_documented_formula():
    mix, mask, gamma = sampling.mix64_int, sampling._MASK64, 0x9E3779B97F4A7C15
    seed, step = 2**64 - 3, 12345
    key_stream = mix((mix(seed ^ 0x243F6A8885A308D3) + step * gamma) & mask)
    key_out = mix(key_stream ^ 0x13198A2E03707344)
    expected = [mix(mix((key_stream + i * gamma) & mask) ^ key_out) for i in range(300)]
    got = [value & mask for value in sampling.random_bits_reference(300, seed, step).tolist()]
    assert got == expected
    rates = torch.rand(300, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    drawn = [i for i in range(300) if (expected[i] >> 11) * 2.0**-53 < float(rates[i])]
    assert poisson_sample_reference(rates, seed, step).tolist() == drawn
    assert poisson_sample(rates, seed, step).tolist() == drawn


@needs_cuda
def test_cuda_path_draws_the_same_indices_as_the_cpu():
    rates = torch.rand(1_000_003, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 0.1
    expected = poisson_sample_reference(rates, 77, 12)
    for dtype in (torch.float32, torch.float64):
        cpu_rates = rates.to(dtype)
        on_gpu = poisson_sample(cpu_rates.cuda(), 77, 12)
        assert on_gpu.device.type == "cuda"
        assert torch.equal(on_gpu.cpu(), poisson_sample_reference(cpu_rates, 77, 12))
    assert torch.equal(poisson_sample_reference(rates.cuda(), 77, 12).cpu(), expected)


# ---------------------------------------------------------------------------------------------
# Edge cases, input checks, graceful absence of the extension
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampler_name", sorted(SAMPLERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_records_give_an_empty_batch(sampler_name, dtype):
    batch = SAMPLERS[sampler_name](torch.empty(0, dtype=dtype), 1, 1)
    assert batch.dtype == torch.int64 and batch.shape == (0,)


@pytest.mark.parametrize("sampler_name", sorted(SAMPLERS))
def test_strided_rates_draw_like_their_contiguous_copy(sampler_name):
    sampler = SAMPLERS[sampler_name]
    rates = torch.rand(2, 5001, generator=torch.Generator().manual_seed(6), dtype=torch.float64)[:, ::3][1]
    assert not rates.is_contiguous()
    assert torch.equal(sampler(rates, 4, 4), sampler(rates.contiguous(), 4, 4))
    reversed_numpy = rates.numpy()[::-1]
    assert torch.equal(sampler(reversed_numpy, 4, 4), sampler(torch.from_numpy(reversed_numpy.copy()), 4, 4))


def test_low_precision_rates_draw_as_their_exact_float64_values():
    rates = torch.rand(4097, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert torch.equal(poisson_sample(rates, 9, 9), poisson_sample(rates.to(torch.float64), 9, 9))
    assert torch.equal(poisson_sample_reference(rates, 9, 9), poisson_sample(rates.to(torch.float64), 9, 9))


@pytest.mark.parametrize("sampler_name", sorted(SAMPLERS))
@pytest.mark.parametrize("bad_rates,error", [
    ([0.1, 0.2], TypeError),
    ((0.1,), TypeError),
    (torch.tensor([0, 1]), TypeError),
    (np.array([0, 1]), TypeError),
    (torch.full((2, 3), 0.5), ValueError),
    (torch.tensor(0.5), ValueError),
    (torch.tensor([0.5, float("nan")]), ValueError),
    (torch.tensor([0.5, -0.01]), ValueError),
    (torch.tensor([1.0000001, 0.5], dtype=torch.float64), ValueError),
    (torch.tensor([0.5, float("inf")]), ValueError),
    (np.array([0.2, np.nan]), ValueError),
])
def test_bad_sample_rates_are_rejected(sampler_name, bad_rates, error):
    with pytest.raises(error, match="sample_rates"):
        SAMPLERS[sampler_name](bad_rates, 0, 0)


@pytest.mark.parametrize("sampler_name", sorted(SAMPLERS))
@pytest.mark.parametrize("seed,step,error", [
    (-1, 0, ValueError), (0, -3, ValueError), (2**64, 0, ValueError),
    (1.0, 0, TypeError), (0, "1", TypeError), (True, 0, TypeError),
])
def test_bad_seed_or_step_is_rejected(sampler_name, seed, step, error):
    with pytest.raises(error, match="seed" if seed != 0 else "step"):
        SAMPLERS[sampler_name](torch.full((4,), 0.5), seed, step)


def test_numpy_counters_are_accepted():
    rates = torch.full((100,), 0.5)
    assert torch.equal(poisson_sample(rates, np.int64(3), np.uint64(4)), poisson_sample(rates, 3, 4))


def test_fallback_warns_once_says_why_and_draws_the_same(monkeypatch):
    rates = torch.rand(1000, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    expected = poisson_sample(rates, 1, 2)
    monkeypatch.setattr(sampling, "_IMPORT_ERROR", "pretend the extension failed to build")
    monkeypatch.setattr(sampling, "_fallback_warned", False)
    assert sampling.backend() == "torch" and sampling.backend("cpu") == "torch"
    assert sampling.unavailable_reason() == "pretend the extension failed to build"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = poisson_sample(rates, 1, 2)
        second = poisson_sample(rates, 1, 3)
    fallback_warnings = [w for w in caught if "plain-torch" in str(w.message)]
    assert len(fallback_warnings) == 1
    assert "pretend the extension failed to build" in str(fallback_warnings[0].message)
    assert torch.equal(first, expected) and not torch.equal(second, expected)


def test_backend_names_the_path_that_runs():
    assert sampling.backend("cpu") == ("cpp" if HAS_CPP else "torch")
    assert sampling.backend() in {"cpp", "cuda", "torch"}
    assert sampling.backend("meta") == "torch"
    if HAS_CPP:
        assert sampling.unavailable_reason("cpu") is None
    else:
        assert isinstance(sampling.unavailable_reason("cpu"), str)


@pytest.mark.parametrize("device,error,match", [("gpu", ValueError, "device must name a device"),
                                                ("cuda:x", ValueError, "device must name a device"),
                                                (1, TypeError, "device must be a torch.device or a string"),
                                                (3.5, TypeError, "device must be a torch.device or a string")])
@pytest.mark.parametrize("function", [sampling.backend, sampling.unavailable_reason,
                                      lambda device: sampling.random_bits_reference(2, 0, 0, device)])
def test_a_device_that_is_not_a_device_name_is_refused_by_name(function, device, error, match):
    with pytest.raises(error, match=match):
        function(device)


# ---------------------------------------------------------------------------------------------
# PoissonSampler: the loader's draw from thresholds computed once, bit for bit poisson_sample's
# ---------------------------------------------------------------------------------------------

# poisson_sample_reference(linspace(0, 1, 200) ** 3, 20261129, 7): written down, so that a change of the
# generator or of the decision rule (in any implementation) fails here and not only in a comparison
PINNED_DRAW = [51, 76, 79, 107, 110, 112, 118, 120, 121, 123, 127, 129, 135, 138, 140, 146, 147, 148, 150, 151,
               152, 154, 155, 157, 160, 161, 163, 165, 166, 167, 168, 169, 171, 174, 175, 176, 177, 178, 179, 180,
               181, 182, 184, 186, 187, 188, 189, 193, 194, 195, 196, 197, 198, 199]


@pytest.mark.parametrize("sampler_name", sorted(SAMPLERS))
def test_draws_are_unchanged_for_a_given_seed(sampler_name):
    rates = torch.linspace(0.0, 1.0, 200, dtype=torch.float64) ** 3
    assert SAMPLERS[sampler_name](rates, 20261129, 7).tolist() == PINNED_DRAW


def _edge_rates(num_records: int, dtype) -> torch.Tensor:
    """Random rates with the edges of the decision rule mixed in: 0, 1, multiples of 2^-53 (where
    u < q·2^53 and u < ceil(q·2^53) meet), their float neighbours, subnormals."""
    rates = torch.rand(num_records, generator=torch.Generator().manual_seed(num_records), dtype=torch.float64)
    two53 = float(2**53)
    edges = torch.tensor([0.0, 1.0, 1 / two53, 2 / two53, 3 / two53, np.nextafter(1 / two53, 1),
                          np.nextafter(1 / two53, 0), np.nextafter(1.0, 0), 5e-324, 1e-300, 0.5, np.nextafter(0.5, 0),
                          2**-20, 1e-12], dtype=torch.float64)
    rates[::3] = edges.repeat(num_records // len(edges) + 1)[: rates[::3].numel()]
    return rates.to(dtype)


@needs_thresholds
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_records", [1, 7, 63, 64, 65, 513, 100_003])
@pytest.mark.parametrize("seed,step", [(0, 0), (1, 2), (2**64 - 1, 2**63 + 5), (987654321, 10**12)])
def test_threshold_kernel_draws_are_unchanged_for_a_given_seed(dtype, num_records, seed, step):
    """The loader's kernel compares (z >> 11) with ceil(q·2^53) as integers, vectorized: the records it
    draws must be poisson_sample's, bit for bit, on the rule's edges and for every thread count."""
    rates = _edge_rates(num_records, dtype)
    expected = poisson_sample_reference(rates, seed, step)
    sampler = PoissonSampler(rates)
    for num_threads in (1, 2, 3, 7):
        assert torch.equal(sampler.draw(seed, step, num_threads), expected)
    assert torch.equal(sampling._C.poisson_sample_thresholds_cpu(sample_thresholds(rates), seed, step, 0), expected)


def test_thresholds_are_the_exact_integer_form_of_the_rates():
    rates = _edge_rates(4099, torch.float64)
    thresholds = sample_thresholds(rates)
    exact = [math.ceil(Fraction(q) * 2**53) for q in rates.tolist()]
    assert thresholds.dtype == torch.int64 and thresholds.tolist() == exact
    assert sample_thresholds(torch.tensor([0.0, 1.0])).tolist() == [0, 2**53]


@needs_thresholds
@pytest.mark.parametrize("bad", [-1, 2**53 + 1, -(2**63)])
def test_threshold_kernel_refuses_a_threshold_outside_0_to_2_pow_53(bad):
    thresholds = torch.zeros(300, dtype=torch.int64)
    thresholds[130] = bad
    with pytest.raises(ValueError, match=r"thresholds\[130\]"):
        sampling._C.poisson_sample_thresholds_cpu(thresholds, 1, 1, 0)


def test_sampler_without_the_threshold_kernel_draws_through_poisson_sample(monkeypatch):
    """An extension built before the threshold kernel existed (or none at all) still draws the same."""
    rates = _edge_rates(5000, torch.float64)
    expected = poisson_sample_reference(rates, 3, 4)
    monkeypatch.setattr(sampling, "_THRESHOLDS_ERROR", "pretend an older build")
    sampler = PoissonSampler(rates)
    assert torch.equal(sampler.draw(3, 4), expected)
    monkeypatch.setattr(sampling, "_IMPORT_ERROR", "pretend no build")
    assert torch.equal(PoissonSampler(rates).draw(3, 4), expected)


@pytest.mark.parametrize("num_threads,error", [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError)])
def test_sampler_refuses_a_thread_count_that_is_not_a_positive_int(num_threads, error):
    with pytest.raises(error, match="num_threads"):
        PoissonSampler(torch.full((10,), 0.5)).draw(0, 0, num_threads)


@needs_thresholds
@pytest.mark.parametrize("seed,step", [(5, 6), (2**64 - 1, 0)])
def test_threshold_kernel_decides_as_poisson_sample_where_u_meets_q(seed, step):
    """Rates made from the records' own uniforms u_i = (z_i >> 11)·2^-53, where u < q turns: q_i = u_i
    and the float just below are not drawn, the float just above and u_i + 2^-53 are. The threshold
    kernel must decide each as the rule (and the reference) does."""
    n = 4000
    top_bits = sampling.logical_shift_right(sampling.random_bits_reference(n, seed, step), 11)
    at = top_bits.to(torch.float64) / 2**53                      # exact: top_bits < 2^53
    choices = torch.stack([at, torch.nextafter(at, torch.zeros_like(at)),
                           torch.nextafter(at, torch.ones_like(at)), (top_bits + 1).to(torch.float64) / 2**53])
    which = torch.arange(n) % 4
    rates = choices[which, torch.arange(n)].clamp(0.0, 1.0)
    drawn = torch.nonzero(which >= 2).flatten()                  # the two rates above u_i
    assert torch.equal(poisson_sample_reference(rates, seed, step), drawn)
    assert torch.equal(PoissonSampler(rates).draw(seed, step), drawn)
    for num_threads in (1, 3):
        assert torch.equal(PoissonSampler(rates).draw(seed, step, num_threads), drawn)
