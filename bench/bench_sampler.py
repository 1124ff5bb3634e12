"""Time one Poisson draw (pdpfast.sampling.poisson_sample) per step for N records.

    python -m bench.bench_sampler [--sizes 100000 1000000 10000000] [--mean-rate 0.01]

Providers, all in the same process and run, each at one thread and at every thread torch uses:
the C++ kernel (directly and through ``poisson_sample``), the plain-torch reference (the fallback,
same draws), and as the baseline the usual non-reproducible torch idiom
``torch.bernoulli(rates).nonzero()`` at the same thread count; on a GPU also the CUDA kernel. Rows
(median and min ms per draw, ratio to the baseline, the load average while timing) go to
bench/results/sampler_cpu.json (CPU rows) and sampler_cuda.json (CUDA rows, when any).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch

from pdpfast import sampling

RESULTS = Path(__file__).resolve().parent / "results"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _time_ms(fn, min_repeats: int, budget_s: float) -> tuple[float, float, int]:
    """(median, min, repeats) of wall-clock milliseconds per call; the min is the least disturbed
    by other work on a shared machine."""
    for _ in range(2):  # warm-up: page faults, thread pool start, CUDA context
        fn()
    times = []
    started = time.perf_counter()
    while len(times) < min_repeats or (time.perf_counter() - started < budget_s and len(times) < 200):
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times), min(times), len(times)


def _time_ms_cuda(fn, min_repeats: int, budget_s: float) -> tuple[float, float, int]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    started = time.perf_counter()
    while len(times) < min_repeats or (time.perf_counter() - started < budget_s and len(times) < 500):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times), min(times), len(times)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**5, 10**6, 10**7])
    parser.add_argument("--mean-rate", type=float, default=0.01,
                        help="rates are uniform on [0, 2 * mean-rate] (default 0.01: batch = 1%% of N)")
    parser.add_argument("--min-repeats", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=2.0, help="seconds of repeats per (provider, N)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    all_threads = torch.get_num_threads()
    common = {
        "benchmark": "poisson_sample", "torch_version": torch.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "triton_version": _triton_version(), "mean_rate": args.mean_rate, "dtype": "float64",
        "cpu_count": os.cpu_count(),
    }
    cpu_device = f"cpu: {_cpu_name()}"
    rows: list[dict] = []
    warnings.filterwarnings("ignore", message="pdpfast.sampling: using the plain-torch")
    print(f"backend={sampling.backend()} unavailable_reason(cpu)={sampling.unavailable_reason('cpu')}")

    for num_records in args.sizes:
        rates = torch.rand(num_records, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        rates *= 2 * args.mean_rate
        # every provider at one thread and at all threads, each compared with the baseline at the
        # same thread count
        for threads in sorted({1, all_threads}):
            torch.set_num_threads(threads)
            providers = [("torch.bernoulli baseline", lambda: torch.bernoulli(rates).nonzero().flatten())]
            if sampling.unavailable_reason("cpu") is None:
                providers += [("cpp", lambda: sampling._C.poisson_sample_cpu(rates, 1, 2, threads)),
                              ("cpp via poisson_sample", lambda: sampling.poisson_sample(rates, 1, 2))]
            providers.append(("torch reference", lambda: sampling.poisson_sample_reference(rates, 1, 2)))
            baseline_ms = None
            for name, fn in providers:
                median_ms, min_ms, repeats = _time_ms(fn, args.min_repeats, args.budget_s)
                baseline_ms = median_ms if baseline_ms is None else baseline_ms
                rows.append({**common, "backend": name, "N": num_records, "median_ms": round(median_ms, 4),
                             "min_ms": round(min_ms, 4), "threads": threads, "device": cpu_device,
                             "repeats": repeats, "speedup_vs_bernoulli": round(baseline_ms / median_ms, 3),
                             "load_average_1min": round(os.getloadavg()[0], 2)})
                print(f"N={num_records:>10,d}  {name:<24s} threads={threads:<3d} median {median_ms:9.3f} ms  "
                      f"min {min_ms:9.3f} ms  x{baseline_ms / median_ms:6.2f} vs bernoulli  ({repeats} repeats)")
    torch.set_num_threads(all_threads)

    cuda_rows: list[dict] = []
    if torch.cuda.is_available():
        cuda_device = f"cuda: {torch.cuda.get_device_name()}"
        for num_records in args.sizes:
            rates = torch.rand(num_records, device="cuda", dtype=torch.float64) * (2 * args.mean_rate)
            providers = [("torch.bernoulli baseline", lambda: torch.bernoulli(rates).nonzero().flatten())]
            if sampling.unavailable_reason("cuda") is None:
                providers.append(("cuda", lambda: sampling._C.poisson_sample_cuda(rates, 1, 2)))
            providers.append(("torch reference", lambda: sampling.poisson_sample_reference(rates, 1, 2)))
            baseline_ms = None
            for name, fn in providers:
                median_ms, min_ms, repeats = _time_ms_cuda(fn, args.min_repeats, args.budget_s)
                baseline_ms = median_ms if baseline_ms is None else baseline_ms
                cuda_rows.append({**common, "backend": name, "N": num_records, "median_ms": round(median_ms, 4),
                                  "min_ms": round(min_ms, 4), "threads": None, "device": cuda_device,
                                  "repeats": repeats,
                                  "speedup_vs_bernoulli": round(baseline_ms / median_ms, 3)})
                print(f"N={num_records:>9,d}  {name:<26s} {cuda_device}  {median_ms:10.4f} ms")

    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "sampler_cpu.json").write_text(json.dumps(rows, indent=1) + "\n")
    if cuda_rows:
        (args.output_dir / "sampler_cuda.json").write_text(json.dumps(cuda_rows, indent=1) + "\n")
    print(f"wrote {args.output_dir / 'sampler_cpu.json'}" + (" and sampler_cuda.json" if cuda_rows else ""))
    return rows + cuda_rows


if __name__ == "__main__":
    main()
