"""The benchmark scripts run end to end at tiny sizes (their real sizes need a GPU or minutes)."""
import json

import pytest

pytest.importorskip("opacus")


def test_e2e_benchmark_runs_every_provider_and_writes_json(tmp_path):
    from bench import bench_e2e
    from bench.harness import PROVIDERS

    out = tmp_path / "e2e.json"
    assert bench_e2e.main(["--device", "cpu", "--size", "micro", "--models", "bert,vit", "--repeats", "1",
                           "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["provider"] for r in rows} == set(PROVIDERS)
    for r in rows:
        assert r["device"].startswith("cpu") and r["date"] and r["torch"]
        if r["provider"].endswith(" graph"):  # CUDA graphs: the row says why it has no timing
            assert "CUDA" in r["error"], r
            continue
        assert r["median_ms"] > 0 and r["throughput_samples_per_s"] > 0, r


def test_e2e_benchmark_measures_a_gpu_routes_memory_on_the_cpu(tmp_path, capsys):
    """--route large: every call takes a full-size model's GPU route, so each provider's own peak
    memory on the CPU is what it allocates on a GPU; --providers picks the rows; an unknown provider
    is refused by name."""
    from bench import bench_e2e

    out = tmp_path / "e2e.json"
    assert bench_e2e.main(["--device", "cpu", "--size", "micro", "--models", "bert", "--repeats", "1", "--route",
                           "large", "--providers", "non-private,pdpfast per-layer", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["provider"] for r in rows] == ["non-private", "pdpfast per-layer"]
    for r in rows:
        assert r["route"] == "large" and r["peak_memory_mb"] > 0 and r["memory_ratio_vs_nonprivate"] > 0, r
    # --batch: the first samples of the model's batch (a full-size model's memory in a CPU's time)
    assert bench_e2e.main(["--device", "cpu", "--size", "micro", "--models", "vit,llama", "--repeats", "1", "--batch",
                           "1", "--providers", "non-private,pdpfast bk", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["model"], r["batch"], r["provider"]) for r in rows] == [
        (model, 1, provider) for model in ("vit", "llama") for provider in ("non-private", "pdpfast bk")]
    assert all(r["throughput_samples_per_s"] == pytest.approx(1000 / r["median_ms"]) for r in rows), rows
    with pytest.raises(SystemExit):
        bench_e2e.main(["--device", "cpu", "--batch", "0"])
    with pytest.raises(SystemExit):
        bench_e2e.main(["--device", "cpu", "--providers", "non-private,pdpfast bk-typo"])
    assert "pdpfast bk-typo" in capsys.readouterr().err


def test_e2e_benchmark_stopped_part_way_keeps_the_models_it_finished(tmp_path, monkeypatch):
    """A lent GPU stops a command at its time limit: the JSON is rewritten after every model, so
    what was measured before the stop is on disk."""
    from bench import bench_e2e

    build = bench_e2e.build

    def stop_at_vit(name, *args):
        if name == "vit":
            raise KeyboardInterrupt  # stands in for the kill
        return build(name, *args)

    monkeypatch.setattr(bench_e2e, "build", stop_at_vit)
    out = tmp_path / "e2e.json"
    with pytest.raises(KeyboardInterrupt):
        bench_e2e.main(["--device", "cpu", "--size", "micro", "--models", "bert,vit", "--repeats", "1",
                        "--providers", "non-private,pdpfast bk", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["model"], r["provider"]) for r in rows] == [("bert", "non-private"), ("bert", "pdpfast bk")]


def test_e2e_benchmark_runs_the_other_models_when_one_cannot_be_built(tmp_path, monkeypatch, capsys):
    """A GPU machine may lack a model's package (peft for gpt2-lora): that model gets an error row,
    the others are measured. An unknown model name is refused before anything runs."""
    from bench import bench_e2e

    build = bench_e2e.build

    def no_peft(name, *args):
        if name == "gpt2-lora":
            raise ModuleNotFoundError("No module named 'peft'")
        return build(name, *args)

    monkeypatch.setattr(bench_e2e, "build", no_peft)
    out = tmp_path / "e2e.json"
    assert bench_e2e.main(["--device", "cpu", "--size", "micro", "--models", "gpt2-lora,bert,gpt2-lora", "--repeats",
                           "1", "--providers", "non-private", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["model"], "error" in r) for r in rows] == [("gpt2-lora", True), ("bert", False), ("gpt2-lora", True)]
    assert "peft" in rows[0]["error"] and "peft" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_e2e.main(["--device", "cpu", "--models", "bert,resnet"])
    assert "resnet" in capsys.readouterr().err


def test_e2e_benchmark_without_cuda_says_so(capsys):
    import torch

    from bench import bench_e2e

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert bench_e2e.main(["--models", "resnet18"]) == 1
    assert "no CUDA device" in capsys.readouterr().err


def test_ddp_scaling_benchmark_runs_and_writes_json(tmp_path):
    from bench import bench_ddp

    out = tmp_path / "ddp.json"
    assert bench_ddp.main(["--nprocs", "1,2", "--steps", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["processes"] for r in rows] == [1, 2] and rows[0]["speedup_vs_one_process"] == 1.0
    assert all(r["records_per_second"] > 0 and r["device"].startswith("cpu") for r in rows)


def test_cpu_benchmark_counts_page_faults_and_retains_freed_memory_on_request(tmp_path):
    """bench_cpu records page faults per step; with --allocator retain (glibc) a step no longer
    faults its activations back in, so the ratios measure computation."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not hasattr(os, "confstr") or "glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") or ""):
        pytest.skip("mallopt is glibc's")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "cpu.json"
    # a subprocess: the allocator setting is process-wide and must not leak into the test session
    subprocess.run([sys.executable, "-m", "bench.bench_cpu", "--models", "cnn", "--repeats", "5", "--threads", "1",
                    "--providers", "non-private,pdpfast bk", "--allocator", "retain", "--out", str(out)],
                   cwd=root, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(root)})
    rows = json.loads(out.read_text())
    assert [r["provider"] for r in rows] == ["non-private", "pdpfast bk"]
    for r in rows:
        assert r["allocator"] == "retain" and r["median_ms"] > 0
        # default glibc settings fault in 5,000-14,000 pages every step here (8 MiB activations); with
        # retain the heap can still grow by a block (1,024-4,096 pages) in one or two of the first
        # timed steps while both providers reach their high-water marks: the median of 5 steps is 0
        assert 0 <= r["page_faults_per_step"] < 1000, r


def test_overhead_benchmark_large_call_route_runs_and_restores_the_thresholds(tmp_path):
    """--route large times every call on its own, as a full-size model's calls run on a GPU, and
    leaves the stacking and forming thresholds as it found them."""
    import pdpfast.clipping
    import pdpfast.ops.linear as lin_ops
    from bench import bench_overhead

    def thresholds():
        return (pdpfast.clipping.SMALL_CALL_BYTES, lin_ops.MATERIALIZE_RATIO, lin_ops.MATERIALIZE_MIN_ELEMENTS,
                pdpfast.clipping.RUN_FLOOR)

    from bench.cpu_bytes import why_not_counted

    before = thresholds()
    out = tmp_path / "overhead.json"
    assert bench_overhead.main(["--route", "large", "--repeats", "2", "--providers",
                                "non-private,pdpfast bk,pdpfast per-layer", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["provider"] for r in rows] == ["non-private", "pdpfast bk", "pdpfast per-layer"]
    assert all(r["route"] == "large" and r["median_ms"] > 0 and r["launches_per_step"] > 0 for r in rows)
    # what a private step adds is counted: more launches than the non-private step
    assert rows[1]["launches_per_step"] > rows[0]["launches_per_step"]
    assert thresholds() == before
    # the CPU's bytes counted as a GPU's allocator counts them (where a compiler builds the counter)
    why = why_not_counted()
    assert all(r["device_bytes"] == ("counted" if why is None else f"not counted ({why})") for r in rows), rows


def test_large_call_route_counts_the_cpus_tensor_bytes_as_a_gpus_allocator_does():
    """Under the large route ``pdpfast.clipping._allocated_bytes`` reads a count of the CPU's tensor
    bytes (``bench.cpu_bytes``), as it reads a GPU's caching allocator: up by what a tensor takes
    when it is made, down when it is freed, the same after the tensor's life; outside it the CPU
    counts nothing (None), per-layer clipping's rule off the GPU."""
    import torch

    import pdpfast.clipping as clipping
    from bench import bench_overhead
    from bench.cpu_bytes import why_not_counted

    if why_not_counted() is not None:
        pytest.skip(f"the counting allocator does not build here: {why_not_counted()}")
    cpu = torch.device("cpu")
    with bench_overhead.large_call_route() as counted:
        assert counted == "counted"
        before = clipping._allocated_bytes(cpu)
        x = torch.empty(1 << 20)
        assert clipping._allocated_bytes(cpu) == before + 4 * (1 << 20)
        y = (x + 1).sum()  # an op's output; its temporary (x + 1) freed
        assert clipping._allocated_bytes(cpu) == before + 4 * (1 << 20) + 4
        del x, y
        assert clipping._allocated_bytes(cpu) == before
    assert clipping._allocated_bytes(cpu) is None


def test_large_call_route_says_when_the_cpus_bytes_cannot_be_counted(monkeypatch):
    """Where the counting allocator does not build (no compiler, say), the large route warns, records
    why in its rows' ``device_bytes``, and runs with the CPU's run bounds (nothing counted)."""
    import torch

    import pdpfast.clipping as clipping
    from bench import bench_overhead, cpu_bytes

    monkeypatch.setattr(cpu_bytes, "why_not_counted", lambda: "RuntimeError: Ninja is required")
    with pytest.warns(RuntimeWarning, match="not counted .RuntimeError: Ninja is required"), \
            bench_overhead.large_call_route() as counted:
        assert counted == "not counted (RuntimeError: Ninja is required)"
        assert clipping._allocated_bytes(torch.device("cpu")) is None


def test_overhead_one_run_per_layer_holds_every_call_to_one_launch_and_restores_the_bounds(tmp_path):
    """The diagnostic provider ``pdpfast per-layer one run`` lifts per-layer clipping's run bounds for
    its own steps only: the bounds are what they were after it (its launches on the GPU route:
    ``test_bench_overhead_stub_kernels_times_the_gpu_route_on_the_cpu``); an unknown provider is
    refused by name."""
    import pdpfast.clipping
    from bench import bench_overhead

    bounds = pdpfast.clipping.RUN_FLOOR, pdpfast.clipping.RUN_BYTES
    out = tmp_path / "overhead.json"
    assert bench_overhead.main(["--route", "large", "--repeats", "2", "--providers",
                                "pdpfast bk,pdpfast per-layer,pdpfast per-layer one run", "--out", str(out)]) == 0
    rows = {r["provider"]: r for r in json.loads(out.read_text())}
    assert (pdpfast.clipping.RUN_FLOOR, pdpfast.clipping.RUN_BYTES) == bounds
    assert rows["pdpfast per-layer one run"]["median_ms"] > 0
    with pytest.raises(SystemExit):
        bench_overhead.main(["--providers", "pdpfast per-layer,no such provider", "--out", str(out)])


def test_large_call_route_pools_no_formed_gradient_between_steps_as_a_gpu():
    """A GPU has no buffer pool: under the large route the CPU's pool takes nothing back, so a
    formed per-sample gradient (a tied embedding's B×V×d) does not outlive its step and add to the
    next step's peak, as it did on GPT-2's stand-in; the pool is restored on exit."""
    import torch

    from bench import bench_overhead
    from pdpfast.ops import workspace

    workspace.clear()
    before = workspace.lent_bytes()  # (what earlier tests' live tensors still hold)
    with bench_overhead.large_call_route():
        lent = workspace.empty((workspace.MIN_BYTES // 4,), torch.float32, "cpu")
        assert workspace.lent_bytes() == before + workspace.MIN_BYTES
        workspace.recycle([lent])
        del lent
        assert workspace.lent_bytes() == before and workspace._free_bytes == 0  # freed, not pooled
    lent = workspace.empty((workspace.MIN_BYTES // 4,), torch.float32, "cpu")
    workspace.recycle([lent])
    assert workspace._free_bytes == workspace.MIN_BYTES  # the pool takes it back again
    workspace.clear()


def test_e2e_benchmark_stub_kernels_measures_a_gpu_routes_memory_with_its_shared_launches(tmp_path):
    """--kernels stub (in a process of its own: it sets TRITON_INTERPRET before the kernels are imported)
    chooses the Triton kernels as a GPU does, so calls that share a launch there are held as there,
    and the rows say so; on a GPU it is refused (the GPU runs the kernels)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from bench import bench_e2e

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "e2e_stub.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    subprocess.run([sys.executable, "-m", "bench.bench_e2e", "--device", "cpu", "--size", "micro", "--models",
                    "resnet18", "--repeats", "1", "--route", "large", "--kernels", "stub", "--providers",
                    "non-private,pdpfast per-layer", "--out", str(out)],
                   cwd=root, env=env, check=True, capture_output=True, timeout=600)
    rows = json.loads(out.read_text())
    assert [(r["provider"], r["kernels"], r["route"]) for r in rows] == [
        ("non-private", "stub", "large"), ("pdpfast per-layer", "stub", "large")]
    assert all(r["peak_memory_mb"] > 0 for r in rows), rows
    with pytest.raises(SystemExit):
        bench_e2e.main(["--device", "cuda", "--kernels", "stub"])


def test_bench_overhead_stub_kernels_times_the_gpu_route_on_the_cpu(tmp_path):
    """--kernels stub picks the Triton kernels as a GPU does and makes their launches no-ops (in a
    process of its own: it sets TRITON_INTERPRET before the kernels are imported). The private
    step then launches the kernels a GPU runs, which the CPU route never does; per-layer clipping's
    runs, unbounded (``pdpfast per-layer one run``), take fewer launches than its bounded ones."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "overhead_stub.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    subprocess.run([sys.executable, "-m", "bench.bench_overhead", "--kernels", "stub", "--route", "large",
                    "--repeats", "2", "--providers",
                    "non-private,pdpfast bk,pdpfast per-layer,pdpfast per-layer one run", "--out", str(out)],
                   cwd=root, env=env, check=True, capture_output=True, timeout=600)
    rows = json.loads(out.read_text())
    assert [r["kernels"] for r in rows] == ["stub"] * 4 and all(r["median_ms"] > 0 for r in rows)
    # the private step takes the GPU's kernels (norms, noise), which the CPU route never launches
    assert rows[0]["triton_launches_per_step"] == 0 < rows[1]["triton_launches_per_step"]
    assert rows[1]["launches_per_step"] > rows[0]["launches_per_step"]
    # a run's calls share one norm launch: unbounded, per-layer takes fewer of them
    assert rows[3]["triton_launches_per_step"] < rows[2]["triton_launches_per_step"], rows


def test_bench_overhead_times_a_llama_style_decoder_in_every_mode(tmp_path):
    """--model llama-12x16: Hugging Face's Llama (its own RMSNorm class, recognized by its forward)
    of the BERT's sizes, on next-token loss, timed with the same providers."""
    pytest.importorskip("transformers")
    from bench import bench_overhead

    out = tmp_path / "overhead_llama.json"
    assert bench_overhead.main(["--model", "llama-12x16", "--repeats", "2", "--providers",
                                "non-private,pdpfast bk,pdpfast ghost", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["model"], r["provider"]) for r in rows] == [("llama-12x16", p) for p in
                                                           ("non-private", "pdpfast bk", "pdpfast ghost")]
    assert all(r["median_ms"] > 0 and r["launches_per_step"] > 0 for r in rows), rows


def test_bench_overhead_counts_bert_bases_launches_without_timing_them(tmp_path):
    """--model bert-base counts a full-size model's launches per step (on a CPU its arithmetic would
    swamp any time of its host work, so no time is reported)."""
    from bench import bench_overhead

    out = tmp_path / "overhead_bert_base.json"
    assert bench_overhead.main(["--model", "bert-base", "--batch", "2", "--route", "large", "--providers",
                                "non-private,pdpfast bk", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["model"], r["seq"]) for r in rows] == [("bert-base", 128)] * 2
    assert all("median_ms" not in r for r in rows)
    assert rows[1]["launches_per_step"] > rows[0]["launches_per_step"] > 0


def test_bench_overhead_records_splits_a_private_steps_host_time_by_dataset_size(tmp_path):
    """--records times make_private_with_budgets steps of a tiny MLP at each dataset size N, every
    (method, budgets) variant beside a non-private baseline, with the step split into the loader's, the
    ledger's check and charge, and the one-off costs (calibration, first step)."""
    from bench import bench_overhead

    out = tmp_path / "overhead_records.json"
    assert bench_overhead.main(["--records", "300,2e3", "--repeats", "2", "--methods", "sample,scale",
                                "--budgets", "groups,distinct", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    variants = [("non-private", None, None), ("pdpfast", "sample", "groups"), ("pdpfast", "sample", "distinct"),
                ("pdpfast", "scale", "groups"), ("pdpfast", "scale", "distinct")]
    assert [(r["records"], r["provider"], r["method"], r["budgets"]) for r in rows] == [
        (n, *v) for n in (300, 2000) for v in variants]
    private = [r for r in rows if r["provider"] == "pdpfast"]
    assert all(r["median_ms"] > 0 and r["loader_ms"] > 0 and r["check_ms"] > 0 and r["charge_ms"] > 0 for r in private)
    assert all(r["calibrate_s"] > 0 and r["first_step_ms"] > 0 and r["ledger_rows"] >= 1 for r in private)
    assert [r["ledger_rows"] for r in private if r["budgets"] == "groups"] == [3] * 4
    assert all(r["check_ms"] == 0 and "calibrate_s" not in r for r in rows if r["provider"] == "non-private")


def test_bench_overhead_bf16_runs_the_low_precision_route(tmp_path):
    """--dtype bf16 times the bf16 model, whose calls also bound their clipped sums' rounding."""
    from bench import bench_overhead

    out = tmp_path / "overhead_bf16.json"
    assert bench_overhead.main(["--dtype", "bf16", "--route", "large", "--repeats", "2", "--providers",
                                "non-private,pdpfast bk", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["dtype"] for r in rows] == ["bf16", "bf16"] and all(r["median_ms"] > 0 for r in rows)


def test_bench_rounding_reports_the_signal_a_clipped_bf16_record_keeps(tmp_path):
    from bench import bench_rounding

    out = tmp_path / "rounding.json"
    assert bench_rounding.main(["--models", "resnet18", "--batch", "2", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["model"] == "resnet18" and len(row["signal_kept"]) == 2
    # the bound costs some signal, never all of it; ρ_i > 0: ResNet's convolutions sum over pixels
    assert 0.5 < row["signal_kept_min"] < 1.0 and min(row["rho_over_norm"]) > 0
    with pytest.raises(SystemExit, match="unknown"):
        bench_rounding.main(["--models", "resnet"])


def test_own_peak_memory_is_the_high_point_of_what_the_block_allocated_and_still_held():
    """On the CPU from the profiler's allocation events: 1 MiB kept, 2 MiB freed, then 0.5 MiB → a
    3 MiB high point; a block the process allocated before does not count, nor does its release."""
    import torch

    from bench.harness import own_peak_memory

    before = torch.empty(2**20)  # 4 MiB held by the process, not by the block
    with own_peak_memory(torch.device("cpu")) as peak:
        kept = torch.empty(2**18)  # 1 MiB of float32
        transient = torch.empty(2**19)  # 2 MiB
        del transient, before
        later = torch.empty(2**17)  # 0.5 MiB
    assert peak["bytes"] == 3 * 2**20
    assert kept.numel() + later.numel() == 2**18 + 2**17


def test_a_providers_peak_memory_is_its_own_whatever_ran_before_it():
    """Peak memory used to be the device's whole allocated peak, which counted the model copy of every
    provider built before (the H100 rows of 2026-11-23: each row carried the earlier rows' models).
    Now each provider's peak is its own: the same in either order, and at least its model copy."""
    import torch
    from torch import nn

    from bench.harness import PROVIDERS, measure

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 10))
    param_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    loss = lambda out, y: nn.functional.cross_entropy(out, y, reduction="none")  # noqa: E731
    names = ["non-private", "pdpfast bk", "pdpfast per-layer", "pdpfast ghost"]
    peaks = []
    for order in (names, names[::-1]):
        results = measure(base, (x,), y, loss, repeats=1, warmup=0, providers={n: PROVIDERS[n] for n in order})
        peaks.append({n: results[n]["peak_memory_mb"] * 2**20 for n in names})
    for n in names:
        # a model copy retained by an earlier provider would add param_bytes (77 KiB) to the later order
        assert abs(peaks[0][n] - peaks[1][n]) < 0.05 * param_bytes, (n, peaks)
        assert peaks[0][n] > param_bytes, (n, peaks)


def test_a_captured_steps_memory_window_reaches_its_capture():
    """The graph rows' peak memory counts their CUDA graphs: the window's steps go past the
    captured step's eager warm-up (the capture happens in the first step after it)."""
    import inspect

    from bench.harness import MEMORY_STEPS
    from pdpfast.graphs import PrivateStep

    assert MEMORY_STEPS > inspect.signature(PrivateStep).parameters["warmup"].default


def test_calibration_benchmark_times_the_plan_load_and_the_ledger_step_with_each_plan(tmp_path):
    from bench import bench_calibration

    out = tmp_path / "calibration.json"
    bench_calibration.main(["--sizes", "200", "--repeats", "1", "--baseline-budgets", "0", "--out", str(out),
                            "--plot", str(tmp_path / "calibration.png")])
    rows = json.loads(out.read_text())
    for method in bench_calibration.METHODS:
        timed = {r["benchmark"]: r for r in rows if r["method"] == method}
        assert set(timed) == {"calibration", "plan_load", "ledger_step"}
        assert all(r["seconds"] > 0 and r["N"] == 200 and r["device"] == "cpu" for r in timed.values())
        assert len(timed["ledger_step"]["all_seconds"]) == bench_calibration.LEDGER_STEPS
    assert (tmp_path / "calibration.png").stat().st_size > 0


def test_a_cpu_memory_measurement_keeps_stderr_but_not_the_profilers_own_lines(capfd):
    """torch's profiler, which measures a provider's CPU memory, writes kineto's "USDT:" markers to the
    process's stderr from C++ at every start and stop (24 lines around `pdpfast bench`'s table); the
    block's own output to stderr still comes through, in order."""
    import sys

    import torch

    from bench.harness import own_peak_memory

    with own_peak_memory(torch.device("cpu")) as peak:
        print("the block's own line", file=sys.stderr)
        x = torch.ones(256, 256)
        del x
    assert peak["bytes"] >= 256 * 256 * 4
    err = capfd.readouterr().err
    assert "the block's own line" in err
    assert not [line for line in err.splitlines() if line.startswith(("USDT:", "STAGE:"))], err


def test_bench_overhead_times_resnet18_gn_at_width_4_in_every_mode(tmp_path):
    """--model resnet18-w4: every convolution and GroupNorm call of ResNet-18-GN, at width 4 on 8x8
    images, so the step's time is host work; bf16 casts the images with the model."""
    from bench import bench_overhead

    out = tmp_path / "overhead_resnet.json"
    assert bench_overhead.main(["--model", "resnet18-w4", "--dtype", "bf16", "--repeats", "2", "--providers",
                                "non-private,pdpfast bk,pdpfast per-layer", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["model"], r["provider"], r["dtype"]) for r in rows] == [
        ("resnet18-w4", p, "bf16") for p in ("non-private", "pdpfast bk", "pdpfast per-layer")]
    assert all(r["median_ms"] > 0 and r["launches_per_step"] > 0 for r in rows), rows
    assert rows[1]["launches_per_step"] > rows[0]["launches_per_step"]


def test_profile_step_splits_each_providers_host_time_into_pdpfasts_parts(tmp_path):
    """bench.profile_step times pdpfast's parts of an eager step (the DP forwards, the backward hooks,
    the end of the backward, the optimizer step, launches) for each provider, adds a profiler's top
    ops, and puts the wrapped functions back afterwards."""
    from bench import profile_step
    from pdpfast.clipping import ClippingState

    forward = ClippingState.__dict__["forward"]
    out = tmp_path / "profile.json"
    assert profile_step.main(["--model", "bert-12x16", "--steps", "2", "--warmup", "1", "--profiled-steps", "1",
                              "--dtype", "fp32", "--device", "cpu", "--out", str(out)]) == 0
    rows = {r["provider"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["non-private", "pdpfast bk", "pdpfast per-layer"]
    assert ClippingState.__dict__["forward"] is forward
    plain, bk, per_layer = rows["non-private"], rows["pdpfast bk"], rows["pdpfast per-layer"]
    assert plain["counts"]["dp forward"] == 0 and plain["parts_ms"]["dp forward"] == 0
    # the width-16 BERT's DP layer calls, each with one forward and one backward hook
    assert bk["counts"]["dp forward"] == bk["counts"]["backward hooks"] == per_layer["counts"]["dp forward"] > 50
    for r in (bk, per_layer):
        parts = r["parts_ms"]
        assert parts["step"] > parts["dp forward"] > 0 and parts["step"] > parts["optimizer step"] > 0
        assert parts["end of backward"] > 0 and r["top_ops"] and r["top_ops"][0]["name"].startswith("aten::")


def test_profile_step_counts_per_layer_runs_and_the_allocator_reads_that_let_them_go_on(tmp_path):
    """On the GPU's route (``--route large --kernels stub``, in a process of its own) per-layer clipping
    holds runs of calls for one norm launch and, where the device's bytes are counted (the CPU's
    stand-in counts them as a GPU's allocator does), reads them to let a run go on: profile_step counts
    both a step; book-keeping flushes no run and reads nothing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from bench.cpu_bytes import why_not_counted

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "profile_large.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    subprocess.run([sys.executable, "-m", "bench.profile_step", "--model", "bert-12x16", "--route", "large",
                    "--kernels", "stub", "--steps", "2", "--warmup", "1", "--profiled-steps", "1", "--providers",
                    "pdpfast bk,pdpfast per-layer", "--device", "cpu", "--out", str(out)],
                   cwd=root, env=env, check=True, capture_output=True, timeout=600)
    rows = {r["provider"]: r for r in json.loads(out.read_text())}
    bk, per_layer = rows["pdpfast bk"]["counts"], rows["pdpfast per-layer"]["counts"]
    assert bk["run flushes"] == bk["allocator reads"] == 0, bk
    assert per_layer["run flushes"] > 1, per_layer
    # read at the backward's first call and where a run would have ended (counted), else never
    assert per_layer["allocator reads"] >= (2 if why_not_counted() is None else 0), per_layer
