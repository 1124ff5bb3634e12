"""Weighted Bernoulli (Poisson) sampling: which records are in step t's batch (DESIGN.md §1, step 1).

Record i is in the batch independently with probability ``q_i``. The batch is never shuffled,
never of fixed size and never truncated: the privacy accountant assumes exactly this draw.

The draw is counter-based: record i's decision is a pure function of ``(seed, step, i, q_i)``, so
it is reproducible from ``(seed, step)`` alone and does not depend on the thread count, the chunking
or the backend. Three implementations compute the same decisions bit for bit:

* ``"cpp"`` — the OpenMP C++ kernel in ``pdpfast._C`` (``csrc/sampler.cpp``), for CPU tensors;
* ``"cuda"`` — the CUDA kernel (``csrc/sampler_cuda.cu``), for CUDA tensors when the extension was
  built with CUDA;
* ``"torch"`` — :func:`poisson_sample_reference`, plain int64 tensor arithmetic on any device; used
  when the extension is missing (a warning says why, once).

The generator (see ``csrc/sampler.cpp``), all arithmetic modulo 2^64::

    mix64(z)   = SplitMix64 finalizer
    key_stream = mix64(mix64(seed ^ 0x243F6A8885A308D3) + step * 0x9E3779B97F4A7C15)
    key_out    = mix64(key_stream ^ 0x13198A2E03707344)
    z_i        = mix64(mix64(key_stream + i * 0x9E3779B97F4A7C15) ^ key_out)
    record i drawn  iff  (z_i >> 11) * 2^-53 < q_i

It is a statistical generator (SplitMix64-based), not a cryptographic one.

A loader draws from the same rates at every step: :class:`PoissonSampler` does the per-record work
that does not depend on the step once (the rates' check, and the integer thresholds
``ceil(q_i * 2^53)``, with which ``u_i < q_i`` is ``(z_i >> 11) < threshold_i``), so the C++
kernel's record loop is one integer comparison per record, which vectorizes. Same draws, bit for bit.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from . import _ext
from ._checks import as_device

__all__ = ["poisson_sample", "PoissonSampler", "sample_thresholds", "loader_route",
           "poisson_sample_reference", "random_bits_reference", "backend", "unavailable_reason",
           "as_int64", "logical_shift_right", "mix64_", "mix64_int", "mix64_np_", "GOLDEN_GAMMA"]

# the compiled extension is optional: the package works without it
_C = _ext._C
_IMPORT_ERROR: str | None = _ext.missing("poisson_sample_cpu", "sampler.cpp")
# an extension built before the threshold kernel existed still draws, through poisson_sample_cpu
_THRESHOLDS_ERROR: str | None = _ext.missing("poisson_sample_thresholds_cpu", "sampler.cpp")

_MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_SEED_SALT = 0x243F6A8885A308D3
_OUTPUT_SALT = 0x13198A2E03707344
_MIX_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_TWO_POW_53 = float(1 << 53)
# The reference works through the records in chunks so its int64 temporaries stay cache-sized.
_REFERENCE_CHUNK = 1 << 17

_fallback_warned = False


# ---------------------------------------------------------------------------------------------
# Which implementation runs, and why
# ---------------------------------------------------------------------------------------------

def _cpp_available() -> bool:
    return _IMPORT_ERROR is None


def _cuda_available() -> bool:
    return _cpp_available() and bool(getattr(_C, "sampler_with_cuda", False)) and torch.cuda.is_available()


def backend(device: torch.device | str | None = None) -> str:
    """The implementation :func:`poisson_sample` uses for rates on ``device``.

    Args:
        device: where the sample rates live (a ``torch.device`` or a string such as "cuda:0"). ``None``
            means the fastest path this installation has (``"cuda"`` if the CUDA kernel is built and a
            GPU is visible, else ``"cpp"``, else ``"torch"``).
    Returns:
        ``"cpp"``, ``"cuda"`` or ``"torch"`` (the plain-torch fallback, also for other device types).
    Raises:
        TypeError for a device that is neither a ``torch.device`` nor a string; ValueError for a string
        that names no device.
    """
    if device is None:
        return "cuda" if _cuda_available() else ("cpp" if _cpp_available() else "torch")
    device = as_device("device", device)
    if device.type == "cpu":
        return "cpp" if _cpp_available() else "torch"
    if device.type == "cuda":
        return "cuda" if _cuda_available() else "torch"
    return "torch"


def unavailable_reason(device: torch.device | str | None = "cpu") -> str | None:
    """Why the compiled path for ``device`` is not used.

    Args:
        device: a ``torch.device`` or string (default CPU; ``None`` is taken as CPU).
    Returns:
        a one-line reason (extension not importable or built without the sampler, built without CUDA,
        no CUDA device visible, no compiled sampler for the device type), or ``None`` when it is used.
    """
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    device_type = "cpu" if device is None else as_device("device", device).type
    if device_type == "cpu":
        return None
    if device_type == "cuda":
        if not getattr(_C, "sampler_with_cuda", False):
            return "pdpfast._C was built without CUDA (no CUDA toolkit or a CPU-only torch at build time)"
        if not torch.cuda.is_available():
            return "no CUDA device is visible"
        return None
    return f"no compiled sampler for device type {device_type!r}"


def loader_route() -> str:
    """How :class:`PoissonSampler` (the loader's draw) runs on CPU rates here.

    Returns:
        "cpp thresholds (AVX-512)" or "cpp thresholds" (the integer-threshold kernel, vectorized with
        AVX-512 or not on this CPU), or "cpp" / "torch" with the reason the threshold kernel is missing.
    """
    if _THRESHOLDS_ERROR is None:
        return "cpp thresholds" + (" (AVX-512)" if _C.sampler_thresholds_vectorized() else "")
    return f"{backend('cpu')} ({_THRESHOLDS_ERROR})"


def _warn_fallback_once(reason: str) -> None:
    global _fallback_warned
    if not _fallback_warned:
        _fallback_warned = True
        warnings.warn(f"pdpfast.sampling: using the plain-torch Poisson sampler (same draws, slower): {reason}",
                      RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------

def _as_rate_tensor(sample_rates) -> torch.Tensor:
    if isinstance(sample_rates, np.ndarray):
        if not np.issubdtype(sample_rates.dtype, np.floating):
            raise TypeError(f"sample_rates must hold floating-point values, got numpy dtype {sample_rates.dtype}")
        sample_rates = torch.from_numpy(np.ascontiguousarray(sample_rates))
    elif not isinstance(sample_rates, torch.Tensor):
        raise TypeError(f"sample_rates must be a torch.Tensor or numpy.ndarray, got {type(sample_rates).__name__}")
    if not sample_rates.is_floating_point():
        raise TypeError(f"sample_rates must hold floating-point values, got {sample_rates.dtype}")
    if sample_rates.dim() != 1:
        raise ValueError(f"sample_rates must be 1-D (one rate per record), got shape {tuple(sample_rates.shape)}")
    if sample_rates.dtype not in (torch.float32, torch.float64):
        # float16/bfloat16 -> float64 is exact, so the draw is the one the rates describe
        sample_rates = sample_rates.to(torch.float64)
    return sample_rates.detach()


def _check_counter(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a non-negative int, got {type(value).__name__}")
    value = int(value)
    if not 0 <= value <= _MASK64:
        raise ValueError(f"{name} must be in [0, 2**64), got {value}")
    return value


def _check_threads(num_threads) -> None:
    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer)):
            raise TypeError(f"num_threads must be a positive int or None, got {type(num_threads).__name__}")
        if num_threads < 1:
            raise ValueError(f"num_threads must be a positive int or None, got {num_threads}")


def _check_rate_values(sample_rates: torch.Tensor) -> None:
    invalid = ~((sample_rates >= 0) & (sample_rates <= 1))  # NaN compares false, so it is invalid too
    if bool(invalid.any()):
        first = int(invalid.nonzero()[0, 0])
        raise ValueError(f"sample_rates must lie in [0, 1] (no NaN); "
                         f"sample_rates[{first}] = {float(sample_rates[first])}")


# ---------------------------------------------------------------------------------------------
# The plain-torch generator (bit for bit the C++/CUDA one)
# ---------------------------------------------------------------------------------------------

def as_int64(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned ``value`` (for int64 tensor arithmetic).

    Args:
        value: a Python int, taken modulo 2^64.
    Returns:
        an int in [-2^63, 2^63).
    """
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def mix64_int(z: int) -> int:
    """SplitMix64's finalizer on a Python int (modulo 2^64).

    Args:
        z: a Python int, taken modulo 2^64.
    Returns:
        an int in [0, 2^64).
    """
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX_MULTIPLIERS[0]) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX_MULTIPLIERS[1]) & _MASK64
    return z ^ (z >> 31)


def mix64_np_(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer in place on a numpy uint64 array (its arithmetic wraps like uint64).

    Args:
        z: a uint64 array, any shape; overwritten.
    Returns:
        ``z`` itself.
    """
    z ^= z >> np.uint64(30)
    z *= np.uint64(_MIX_MULTIPLIERS[0])
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MIX_MULTIPLIERS[1])
    z ^= z >> np.uint64(31)
    return z


def _stream_keys(seed: int, step: int) -> tuple[int, int]:
    stream = mix64_int(mix64_int(seed ^ _SEED_SALT) + step * GOLDEN_GAMMA)
    return stream, mix64_int(stream ^ _OUTPUT_SALT)


def logical_shift_right(z: torch.Tensor, shift: int) -> torch.Tensor:
    """The unsigned (logical) right shift of uint64 bits held in int64.

    Args:
        z: an int64 tensor, any shape, read as uint64 bits.
        shift: an int in [1, 63].
    Returns:
        a new int64 tensor of ``z``'s shape: the bits of z >> shift with zeros shifted in.
    Raises:
        TypeError when ``z`` is not an int64 tensor or ``shift`` not an int; ValueError for a shift
        outside [1, 63].
    """
    _check_int64_bits(z)
    if isinstance(shift, bool) or not isinstance(shift, (int, np.integer)):
        raise TypeError(f"shift must be an int in [1, 63], got {type(shift).__name__} {shift!r}")
    if not 1 <= shift <= 63:
        raise ValueError(f"shift must be an int in [1, 63], got {shift!r}")
    return _shift_right(z, int(shift))


def _shift_right(z: torch.Tensor, shift: int) -> torch.Tensor:
    # int64 >> is arithmetic; masking off the copies of the sign bit makes it the uint64 shift
    shifted = z >> shift
    shifted &= (1 << (64 - shift)) - 1
    return shifted


def _check_int64_bits(z) -> None:
    if not isinstance(z, torch.Tensor) or z.dtype is not torch.int64:
        what = f"a {z.dtype} tensor" if isinstance(z, torch.Tensor) else type(z).__name__
        raise TypeError(f"z must be an int64 tensor (uint64 bits; other widths would give other bits), got {what}")


def mix64_(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer in place on int64 bits (int64 + and * wrap like uint64).

    Args:
        z: an int64 tensor, any shape, read as uint64 bits; overwritten.
    Returns:
        ``z`` itself.
    Raises:
        TypeError when ``z`` is not an int64 tensor (int32 arithmetic would give other bits).
    """
    _check_int64_bits(z)
    return _mix64(z)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z ^= _shift_right(z, 30)
    z *= as_int64(_MIX_MULTIPLIERS[0])
    z ^= _shift_right(z, 27)
    z *= as_int64(_MIX_MULTIPLIERS[1])
    z ^= _shift_right(z, 31)
    return z


def _random_bits(start: int, stop: int, keys: tuple[int, int], device: torch.device) -> torch.Tensor:
    z = torch.arange(start, stop, dtype=torch.int64, device=device)
    z *= as_int64(GOLDEN_GAMMA)
    z += as_int64(keys[0])
    _mix64(z)
    z ^= as_int64(keys[1])
    return _mix64(z)


def random_bits_reference(count: int, seed: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The generator's raw outputs z_0..z_{count-1} at (seed, step) (see the module docstring).

    Args:
        count: how many outputs (records), an int ≥ 0.
        seed, step: non-negative ints below 2**64.
        device: where to compute them.
    Returns:
        (count,) int64 tensor on ``device`` holding the uint64 bits.
    Raises:
        TypeError when ``count``, ``seed`` or ``step`` is not an int (a bool, a float or a string is
        refused); ValueError when one is out of range (``count`` < 0 or ≥ 2**63).
    """
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
        raise TypeError(f"count must be an int ≥ 0, got {type(count).__name__} {count!r}")
    if not 0 <= count < 1 << 63:
        raise ValueError(f"count must be an int ≥ 0 (and < 2**63), got {count!r}")
    keys = _stream_keys(_check_counter("seed", seed), _check_counter("step", step))
    return _random_bits(0, int(count), keys, as_device("device", device))


def poisson_sample_reference(sample_rates, seed: int, step: int) -> torch.Tensor:
    """Plain-torch :func:`poisson_sample`: the same draw on any device, no compiled code.

    Args:
        sample_rates: (N,) float tensor (any device) or numpy array, q_i in [0, 1].
        seed, step: non-negative ints below 2**64.
    Returns:
        (B,) int64 indices of the drawn records, ascending, on the rates' device (CPU for numpy input).
    Raises:
        TypeError and ValueError as :func:`poisson_sample`.
    """
    sample_rates = _as_rate_tensor(sample_rates)
    seed, step = _check_counter("seed", seed), _check_counter("step", step)
    _check_rate_values(sample_rates)
    return _poisson_sample_torch(sample_rates, seed, step)


def _poisson_sample_torch(sample_rates: torch.Tensor, seed: int, step: int) -> torch.Tensor:
    keys = _stream_keys(seed, step)
    num_records = sample_rates.numel()
    pieces = []
    for start in range(0, num_records, _REFERENCE_CHUNK):
        stop = min(start + _REFERENCE_CHUNK, num_records)
        top_bits = _shift_right(_random_bits(start, stop, keys, sample_rates.device), 11)
        # u < q  <=>  (z >> 11) < q * 2^53, both sides exact in float64
        drawn = top_bits.to(torch.float64) < sample_rates[start:stop].to(torch.float64) * _TWO_POW_53
        pieces.append(drawn.nonzero().flatten() + start)
    if not pieces:
        return torch.empty(0, dtype=torch.int64, device=sample_rates.device)
    return torch.cat(pieces)


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------

def poisson_sample(sample_rates, seed: int, step: int, num_threads: int | None = None) -> torch.Tensor:
    """Indices of the records in step ``step``'s Poisson batch, sorted ascending.

    Args:
        sample_rates: (N,) float tensor (any device) or numpy array, q_i in [0, 1] — record i is drawn
            independently with probability q_i (q_i = 0: never; q_i = 1: always). fp16/bf16 rates are
            widened to float64 (exactly).
        seed, step: non-negative ints below 2**64; the draw is a pure function of (seed, step, rates).
        num_threads: CPU threads for the C++ kernel (default: ``torch.get_num_threads()``), a positive
            int or None. The result does not depend on it.
    Returns:
        (B,) int64 tensor on the rates' device (CPU for numpy input); B is random with mean
        sum_i q_i. The batch is never truncated or padded here: a caller with a fixed physical batch
        capacity must split a large draw over several physical batches (DESIGN.md §1).
    Raises:
        TypeError for a wrong type of ``sample_rates``, ``seed``, ``step`` or ``num_threads``; ValueError
        when ``sample_rates`` is not 1-D or holds NaN or values outside [0, 1], a counter is out of
        range, or ``num_threads`` < 1.
    """
    sample_rates = _as_rate_tensor(sample_rates)
    seed, step = _check_counter("seed", seed), _check_counter("step", step)
    _check_threads(num_threads)
    chosen = backend(sample_rates.device)
    if chosen == "cpp":
        # the kernel validates the rates in the same pass; std::invalid_argument arrives as ValueError
        return _C.poisson_sample_cpu(sample_rates, seed, step, num_threads or 0)
    if chosen == "cuda":
        return _C.poisson_sample_cuda(sample_rates, seed, step)
    _warn_fallback_once(unavailable_reason(sample_rates.device) or "no compiled sampler")
    _check_rate_values(sample_rates)
    return _poisson_sample_torch(sample_rates, seed, step)


def sample_thresholds(sample_rates) -> torch.Tensor:
    """The integer form of the rates: record i is drawn iff ``(z_i >> 11) < threshold_i``.

    For the integer u = z_i >> 11 < 2^53, u < q_i·2^53 (exact: a power-of-two scaling) holds iff
    u < ceil(q_i·2^53), so these decisions are :func:`poisson_sample`'s, bit for bit.

    Args:
        sample_rates: (N,) float tensor (any device) or numpy array, q_i in [0, 1].
    Returns:
        (N,) int64 tensor ceil(q_i·2^53), in [0, 2^53], on the rates' device (CPU for numpy input).
    Raises:
        TypeError and ValueError as :func:`poisson_sample` for the rates.
    """
    sample_rates = _as_rate_tensor(sample_rates)
    _check_rate_values(sample_rates)
    return torch.ceil(sample_rates.to(torch.float64) * _TWO_POW_53).to(torch.int64)


class PoissonSampler:
    """The draws of ``poisson_sample(sample_rates, seed, step)`` for rates fixed across steps, with the
    per-record work that does not depend on the step done once (the rates' check, their thresholds).

    A draw is still O(N): each record's decision needs its own z_i, from (seed, step, i). On the CPU
    with the compiled extension the record loop is an integer comparison that vectorizes (AVX-512
    where the CPU has it: 10^7 records in about 6 ms on one core instead of about 30); elsewhere the
    draw is :func:`poisson_sample`'s own path. The thresholds take 8 bytes per record.

    Args:
        sample_rates: (N,) float tensor (any device) or numpy array, q_i in [0, 1]; a CPU tensor is kept
            as given (not copied): it must not change while the sampler draws from it.
    Raises:
        TypeError and ValueError as :func:`poisson_sample` for the rates.
    """

    def __init__(self, sample_rates):
        self.sample_rates = _as_rate_tensor(sample_rates)
        self.thresholds = sample_thresholds(self.sample_rates)  # checks the rates, once
        self._threshold_kernel = self.sample_rates.device.type == "cpu" and _THRESHOLDS_ERROR is None

    def draw(self, seed: int, step: int, num_threads: int | None = None) -> torch.Tensor:
        """Indices of the records in step ``step``'s Poisson batch, sorted ascending: ``poisson_sample(
        sample_rates, seed, step)``, bit for bit.

        Args:
            seed, step: non-negative ints below 2**64.
            num_threads: CPU threads (default: ``torch.get_num_threads()``), a positive int or None; the result
                does not depend on it.
        Returns:
            (B,) int64 tensor on the rates' device.
        Raises:
            TypeError and ValueError as :func:`poisson_sample` for the counters and ``num_threads``.
        """
        if not self._threshold_kernel:
            return poisson_sample(self.sample_rates, seed, step, num_threads)
        seed, step = _check_counter("seed", seed), _check_counter("step", step)
        _check_threads(num_threads)
        return _C.poisson_sample_thresholds_cpu(self.thresholds, seed, step, num_threads or 0)
