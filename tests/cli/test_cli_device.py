"""`pdpfast train --device`: CUDA by default when present, the CPU otherwise; a clear error for a
device that is not there; throughput in the progress bar."""
import json

import pytest
import torch

SMALL = ("--epochs", 1, "--batch-size", 40, "--noise-seed", 0)   # a fixed noise seed: reproducible


def _args(data_dir):
    return ("--data", data_dir / "x.npy", "--labels", data_dir / "y.npy", "--budgets", data_dir / "budgets.npy")


@pytest.mark.parametrize("method", ["scale", "pdp"])
def test_train_on_the_cpu_device(cli, data_dir, tmp_path, method):
    rc, out, err = cli("train", *_args(data_dir), "--device", "cpu", "--method", method, "--out-json",
                       tmp_path / "s.json", *SMALL, "--quiet")
    assert rc == 0, err
    assert "device cpu" in out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["device"] == "cpu" and summary["records_per_second"] > 0
    # on a CPU freed activations stay in the process (pdpfast._malloc), unless the user chose otherwise
    assert summary["cpu_allocator"] in {"retain", "not glibc"} or summary["cpu_allocator"].startswith(("user", "pre"))
    assert f"allocator: {summary['cpu_allocator']}" in out


def test_default_device_is_cuda_when_present(cli, data_dir):
    rc, out, err = cli("train", *_args(data_dir), "--stop-after-steps", 1, *SMALL, "--quiet")
    assert rc == 0, err
    assert ("device cuda" if torch.cuda.is_available() else "device cpu") in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_a_clear_error(cli, data_dir, tmp_path):
    message = cli.fails("train", *_args(data_dir), "--device", "cuda", "--checkpoint", tmp_path / "ck.pt", *SMALL)
    assert "--device cuda" in message and "CUDA" in message and "--device cpu" in message
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("device", ["gpu", "cuda:99", "cpu:x"])
def test_unknown_or_absent_device_is_a_clear_error(cli, data_dir, device):
    message = cli.fails("train", *_args(data_dir), "--device", device, *SMALL, "--quiet")
    assert f"--device {device}" in message


def test_progress_bar_reports_throughput():
    from pdpfast.train import TrainConfig, _Progress

    clock = iter([100.0, 102.0, 104.0, 104.0])       # start, then two steps 2 s apart
    progress = _Progress(TrainConfig(), total=10, initial=3, desc="sample", expected_batch_size=40.0,
                         clock=lambda: next(clock))
    progress.step(0.5)
    progress.step(0.4)
    assert progress.bar.postfix == "loss=0.400, rec/s=20"        # 2 steps × 40 expected records / 4 s
    assert progress.records_per_second() == 20.0
    progress.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["hybrid", "pdp"])
def test_train_on_cuda_matches_the_budgets(cli, data_dir, tmp_path, method):
    rc, out, err = cli("train", *_args(data_dir), "--device", "cuda", "--method", method, "--out-json",
                       tmp_path / "s.json", "--checkpoint", tmp_path / "ck.pt", *SMALL, "--quiet")
    assert rc == 0, err
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["device"].startswith("cuda")
    assert all(row["max_ratio"] <= 1.0 for row in summary["groups"])
    assert summary["test"]["accuracy"] > 0.2


@pytest.mark.parametrize("extra,message", [((), "--physical-batch-size"),
                                           (("--physical-batch-size", 8, "--mode", "ghost"), "--mode ghost"),
                                           (("--physical-batch-size", 8, "--method", "pdp"), "--method")])
def test_cuda_graph_needs_fixed_batches_one_backward_and_no_rounds(cli, data_dir, extra, message):
    rc, out, err = cli("train", *_args(data_dir), "--cuda-graph", *extra, *SMALL, "--quiet")
    assert rc != 0 and message in err and "--cuda-graph" in err


def test_cuda_graph_on_the_cpu_is_a_clear_error(cli, data_dir):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    rc, out, err = cli("train", *_args(data_dir), "--cuda-graph", "--physical-batch-size", 8, "--device", "cpu",
                       *SMALL)
    assert rc == 2 and "--cuda-graph needs a CUDA device (--device cuda)" in err
    assert out == ""  # refused with the other options, before any data is read or a plan is made


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_trains_like_the_eager_step(cli, data_dir, tmp_path):
    """The captured step takes the same steps with the same noise: the same summary as eager."""
    summaries = []
    for flag in ((), ("--cuda-graph",)):
        out_json = tmp_path / f"s{len(summaries)}.json"
        rc, out, err = cli("train", *_args(data_dir), "--physical-batch-size", 16, *flag, "--out-json", out_json,
                           *SMALL, "--quiet")
        assert rc == 0, err
        summaries.append(json.loads(out_json.read_text()))
    assert summaries[0]["steps"] == summaries[1]["steps"]
    assert abs(summaries[0]["test"]["accuracy"] - summaries[1]["test"]["accuracy"]) < 0.02


@pytest.mark.parametrize("method", ["sample", "scale"])
def test_train_in_bf16_autocast_stays_within_budgets(cli, data_dir, tmp_path, method):
    """--precision bf16 trains under torch.autocast: every budget group within its budget, a
    classifier that learns, and the summary says which precision it ran in."""
    rc, out, err = cli("train", *_args(data_dir), "--device", "cpu", "--method", method, "--precision", "bf16",
                       "--out-json", tmp_path / "s.json", *SMALL, "--quiet")
    assert rc == 0, err
    assert "bf16 autocast" in out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["precision"] == "bf16" and summary["finished"]
    assert all(row["max_ratio"] <= 1.0 for row in summary["groups"])
    assert summary["test"]["accuracy"] > 0.2


def test_bf16_autocast_runs_the_forward_in_bf16(monkeypatch):
    """private_steps(autocast=torch.bfloat16) computes each loss under autocast (the DP layers see bf16)."""
    from pdpfast import loop

    dtypes = []

    class Probe:
        def loss(self, model, batch, criterion):
            dtypes.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
            return model(batch[0]).sum()

    class Engine:
        steps = 0

    class Optimizer:
        def step(self):
            Engine.steps += 1

        def zero_grad(self):
            pass

    model = torch.nn.Linear(2, 1)
    loop.private_steps(Engine(), model, Optimizer(), [(torch.ones(3, 2),)], Probe(), None, until=2,
                       autocast=torch.bfloat16)
    assert dtypes == [torch.bfloat16, torch.bfloat16]


def test_unknown_precision_and_bf16_with_pdp_are_clear_errors(cli, data_dir):
    rc, out, err = cli("train", *_args(data_dir), "--precision", "fp16", *SMALL, "--quiet")
    assert rc != 0 and "--precision" in err
    message = cli.fails("train", *_args(data_dir), "--precision", "bf16", "--method", "pdp", *SMALL)
    assert "--precision bf16" in message and "sample/scale/hybrid/dpsgd" in message
