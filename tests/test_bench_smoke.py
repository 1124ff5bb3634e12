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
