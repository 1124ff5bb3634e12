"""In-place Gaussian noise kernel: statistics, independence, reproducibility from (seed, step)."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from pdpfast.kernels import _utils, noise  # noqa: E402

N = 1 << 17  # 131072 draws: standard errors ~0.3 % of std


def _noise(tools, shapes, std=1.0, seed=7, step=3, dtype=torch.float32):
    grads = [torch.zeros(s, dtype=dtype, device=tools.device) for s in shapes]
    noise.add_noise_(grads, std, seed, step)
    return [g.cpu() for g in grads]


def test_noise_is_standard_normal_scaled_by_std(tools):
    std = 2.5
    (x,) = _noise(tools, [(N,)], std=std)
    z = x.double() / std
    se = 1 / math.sqrt(N)
    assert abs(z.mean().item()) < 5 * se
    assert abs(z.std().item() - 1) < 5 * se / math.sqrt(2)
    assert abs((z ** 3).mean().item()) < 5 * math.sqrt(15) * se          # skewness ≈ 0
    assert abs((z ** 4).mean().item() - 3) < 5 * math.sqrt(96) * se      # kurtosis ≈ 3
    # Kolmogorov–Smirnov distance to N(0, 1)
    sorted_z = z.sort().values
    cdf = torch.special.ndtr(sorted_z)
    ranks = torch.arange(1, N + 1, dtype=torch.float64) / N
    ks = torch.maximum((ranks - cdf).abs(), (ranks - 1 / N - cdf).abs()).max().item()
    assert ks < 1.95 / math.sqrt(N)  # 0.1 % level


def _corr(x, y):
    x, y = x.double().flatten(), y.double().flatten()
    x, y = x - x.mean(), y - y.mean()
    return (x @ y / (x.norm() * y.norm())).item()


def test_noise_is_independent_across_elements_tensors_and_steps(tools):
    limit = 5 / math.sqrt(N)
    a, b = _noise(tools, [(N,), (N,)], step=3)
    (a_next,) = _noise(tools, [(N,)], step=4)
    (a_other_seed,) = _noise(tools, [(N,)], seed=8, step=3)
    assert abs(_corr(a, b)) < limit                       # two tensors of one call
    assert abs(_corr(a, a_next)) < limit                  # consecutive steps
    assert abs(_corr(a, a_other_seed)) < limit            # another seed
    quarter = noise.NOISE_BLOCK // 4
    for lag in (1, 2, quarter, noise.NOISE_BLOCK):        # neighbours and lanes of one Philox call
        assert abs(_corr(a[:-lag], a[lag:])) < limit, lag


def test_noise_is_reproducible_from_seed_and_step(tools):
    shapes = [(3, 5), (4097,), (1,), (2, 3, 4)]
    first = _noise(tools, shapes, seed=11, step=5)
    again = _noise(tools, shapes, seed=11, step=5)
    other = _noise(tools, shapes, seed=11, step=6)
    for x, y, z in zip(first, again, other):
        assert torch.equal(x, y)
        assert not torch.equal(x, z)


def test_noise_depends_on_list_layout_not_on_dtype_grouping(tools):
    """The j-th tensor's noise comes from its own counter range: the same whatever the dtypes of
    the others (one launch per dtype group), and the first tensor's noise is that of it alone."""
    shapes = [(5000,), (300,), (7, 9)]
    all_fp32 = _noise(tools, shapes)
    grads = [torch.zeros(5000, device=tools.device), torch.zeros(300, dtype=torch.float64, device=tools.device),
             torch.zeros(7, 9, dtype=torch.bfloat16, device=tools.device)]
    noise.add_noise_(grads, 1.0, 7, 3)
    assert torch.equal(grads[0].cpu(), all_fp32[0])
    torch.testing.assert_close(grads[1].cpu().float(), all_fp32[1], rtol=0, atol=1e-6)
    # within one bf16 ulp: the interpreter truncates fp32 → bf16 where GPUs round to nearest even
    torch.testing.assert_close(grads[2].cpu().float(), all_fp32[2].bfloat16().float(),
                               rtol=torch.finfo(torch.bfloat16).eps, atol=0)
    (alone,) = _noise(tools, [(5000,)])
    assert torch.equal(alone, all_fp32[0])
    assert not torch.equal(all_fp32[1], all_fp32[0][:300])  # distinct ranges, not reused draws


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_noise_adds_to_existing_values_in_place(tools, gen, dtype):
    base = tools.randn(gen, 20000, dtype=dtype, device=tools.device)
    g = base.clone()
    ptr = g.data_ptr()
    noise.add_noise_([g], 0.5, 1, 2)
    assert g.data_ptr() == ptr and g.dtype == dtype
    added = (g.double() - base.double()).cpu()
    assert abs(added.std().item() / 0.5 - 1) < 0.05
    assert abs(added.mean().item()) < 0.05


def test_noise_non_contiguous_empty_and_scalar_tensors(tools):
    g = torch.zeros(64, 33, device=tools.device).t()  # non-contiguous
    empty = torch.zeros(0, 3, device=tools.device)
    scalar = torch.zeros((), device=tools.device)
    noise.add_noise_([empty, g, scalar], 1.0, 3, 4)
    assert empty.numel() == 0
    assert (g != 0).all() and scalar.item() != 0
    assert abs(g.std().item() - 1) < 0.1


def test_noise_zero_std_and_empty_list_are_no_ops(tools):
    g = torch.ones(10, device=tools.device)
    noise.add_noise_([g], 0.0, 1, 1)
    noise.add_noise_([], 1.0, 1, 1)
    assert torch.equal(g.cpu(), torch.ones(10))


def test_noise_plan_from_cpp_is_the_python_plan_and_gives_the_same_noise(tools, monkeypatch):
    """``pdpfast._C.noise_groups`` builds add_noise_'s launch plan (one group per dtype, each tensor's
    first Philox counter and block, contiguous copies of strided tensors) as the Python route does."""
    if noise._NOISE_GROUPS is None:
        pytest.skip("pdpfast._C was not built")
    d = tools.device
    grads = [torch.zeros(5, 7, device=d), torch.zeros(2 * noise.NOISE_BLOCK + 3, dtype=torch.bfloat16, device=d),
             torch.zeros(64, 33, device=d).t(), torch.zeros(0, 3, device=d), torch.zeros((), device=d),
             torch.zeros(10, dtype=torch.float64, device=d), torch.zeros(3, dtype=torch.bfloat16, device=d)]
    plans = {}
    for route in ("C++", "Python"):
        if route == "Python":
            monkeypatch.setattr(noise, "_NOISE_GROUPS", None)
        plans[route] = noise._groups(grads)
    (cpp_groups, cpp_back), (py_groups, py_back) = plans["C++"], plans["Python"]
    assert [(g.dtype, b, n) for g, _, b, n in cpp_groups] == [(g.dtype, b, n) for g, _, b, n in py_groups] == [
        (torch.float32, 3, 3), (torch.bfloat16, 4, 2), (torch.float64, 1, 1)]
    assert [(t.shape, c.is_contiguous()) for t, c in cpp_back] == [(t.shape, c.is_contiguous()) for t, c in py_back] \
        == [((33, 64), True)]
    copies = {id(t): c for t, c in cpp_back}, {id(t): c for t, c in py_back}
    for (_, cpp_values, _, n), (_, py_values, _, _) in zip(cpp_groups, py_groups):
        assert cpp_values[n:] == py_values[n:]  # numels, first counters, first blocks
    # addresses: each tensor's own, or its contiguous copy's
    nonempty = [g for g in grads if g.numel()]
    for route, (groups, _), copied in (("C++", plans["C++"], copies[0]), ("Python", plans["Python"], copies[1])):
        addresses = [a for _, values, _, n in groups for a in values[:n]]
        assert sorted(addresses) == sorted(copied[id(g)].data_ptr() if id(g) in copied else g.data_ptr()
                                           for g in nonempty), route
    monkeypatch.undo()
    noised = {}
    for route in ("C++", "Python"):
        if route == "Python":
            monkeypatch.setattr(noise, "_NOISE_GROUPS", None)
        copy = [g.clone() for g in grads]  # (a clone keeps the strided tensor's strides)
        noise.add_noise_(copy, 1.0, 11, 2)
        noised[route] = copy
    for a, b in zip(noised["C++"], noised["Python"]):
        assert torch.equal(a, b) and (a.numel() == 0 or bool((a != 0).all()))


def test_noise_rejects_integer_tensors(tools):
    with pytest.raises(TypeError):
        noise.add_noise_([torch.zeros(3, dtype=torch.int64, device=tools.device)], 1.0, 1, 1)


@pytest.mark.gpu
def test_noise_gpu_sizes(tools):
    shapes = [(4096, 4096), (4096,), (50257, 768), (3,)]
    grads = [torch.zeros(s, dtype=torch.bfloat16, device=tools.device) for s in shapes]
    noise.add_noise_(grads, 1.0, 0, 0)
    flat = torch.cat([g.float().flatten() for g in grads])
    assert abs(flat.mean().item()) < 1e-3 and abs(flat.std().item() - 1) < 2e-3


@pytest.mark.parametrize("seed,step", [(7, 3), (2 ** 56 - 5, 123456789), (2 ** 64 - 1, 2 ** 40 + 17)])
def test_noise_from_a_device_side_step_counter_equals_host_seed_and_step(tools, seed, step):
    """A captured CUDA graph reads (seed, step) from device memory (``step_seed_tensor``): its noise
    is the eager step's bit for bit, and the tables it reads are handed to ``keep``: built afresh
    (gradients made inside a capture have addresses no earlier run knew), with the host tensor a
    captured copy repeats its table from, equal to the cached table an eager step reads."""
    from pdpfast.ops.noise import seed_and_step_tensor, step_seed_tensor

    shapes = [(5000,), (3, 7), (1,)]
    eager = _noise(tools, shapes, seed=seed, step=step)
    grads = [torch.zeros(s, device=tools.device) for s in shapes]
    keep = []
    counter = seed_and_step_tensor(seed, step, tools.device)
    noise.add_noise_(grads, 1.0, 0, 0, device_seed=step_seed_tensor(counter), keep=keep)
    for x, y in zip(grads, eager):
        assert torch.equal(x.cpu(), y)
    host, table = keep
    assert host.device.type == "cpu" and table.device == grads[0].device and torch.equal(host, table.cpu())
    assert all(table is not cached for cached in _utils._TABLES.values())
    entries = [(g.data_ptr(), g.numel()) for g in grads]
    assert [(a, n) for a, n in zip(host[0].tolist(), host[1].tolist())] == entries
    counter[1] += 1  # the graph's counter moves on: the next step's noise
    nxt = [torch.zeros(s, device=tools.device) for s in shapes]
    noise.add_noise_(nxt, 1.0, 0, 0, device_seed=step_seed_tensor(counter))
    assert torch.equal(nxt[0].cpu(), _noise(tools, shapes, seed=seed, step=step + 1)[0])
