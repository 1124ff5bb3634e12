"""Data parallelism: 2 processes (gloo, CPU) train the same model as 1 process with the same seed.

The properties of issue 14, each checked on the trained parameters and the ledgers: one global
Poisson draw shared out (not a per-rank draw), noise added once with the single-process variance
(not once per rank), normalization by the global expected batch size; every clipping mode and
method; draws where one rank's share is empty; a rank that dies gives an error, not a hang.
"""
from __future__ import annotations

import datetime
import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pdpfast
from pdpfast.distributed import leave_process_group

N, STEPS, SEED = 40, 4, 11
CONFIGS = [  # (mode, clipping, method, sample_rate, physical batch)
    ("bk", "flat", "sample", 0.2, 3),
    ("ghost", "flat", "scale", 0.2, 3),
    ("bk", "per_layer", "hybrid", 0.2, 3),
    ("bk", "flat", "hybrid", 0.2, None),
    ("bk", "flat", "sample", 0.04, 2),  # about 1.6 records per draw: shares are often empty
]


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N,), generator=g)
    budgets = np.where(np.arange(N) % 3 == 0, 1.0, 4.0)
    return TensorDataset(x, y), budgets


def model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)).double()


def train(config, wrap=None, stop_at=None, checkpoint=None, resume=None):
    """STEPS private steps of ``config``; returns (final parameters, per-record ε). stop_at: save
    ``checkpoint`` and stop after that many steps; resume: continue from ``checkpoint``."""
    mode, clipping, method, rate, physical = config
    dataset, budgets = data()
    net = model()
    if wrap is not None:
        net = wrap(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    engine = pdpfast.PrivacyEngine(seed=SEED)
    criterion = nn.CrossEntropyLoss()
    extra = dict(criterion=criterion) if mode == "ghost" else {}
    out = engine.make_private_with_budgets(
        module=net, optimizer=optimizer, data_loader=DataLoader(dataset, batch_size=8), budgets=budgets,
        delta=1e-5, steps=STEPS, method=method, sample_rate=rate, mode=mode, clipping=clipping,
        physical_batch_size=physical, **extra)
    net, optimizer, loader = out[0], out[1], out[-1]
    criterion = out[2] if mode == "ghost" else criterion
    if resume:
        engine.load_checkpoint(checkpoint, net)
    for x, y in loader:
        loss = criterion(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if engine.steps == stop_at:
            engine.save_checkpoint(checkpoint, net)
            break
        if engine.steps == STEPS:  # a resumed loader's epoch runs past the plan's last step
            break
    inner = net.module if hasattr(net, "module") else net
    return {n: p.detach().clone() for n, p in inner.named_parameters()}, engine.epsilons()


def _worker(rank, world, init_file, out_dir, scenario):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    try:
        if scenario == "train":
            wrap = lambda m: nn.parallel.DistributedDataParallel(m)  # noqa: E731
            results = [train(config, wrap) for config in CONFIGS]
            checkpoint = os.path.join(out_dir, "resume.pt")  # written once, by rank 0
            train(CONFIGS[0], wrap, stop_at=2, checkpoint=checkpoint)
            results.append(train(CONFIGS[0], wrap, checkpoint=checkpoint, resume=True))
            torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        elif scenario == "killed":
            net = nn.parallel.DistributedDataParallel(model())
            dataset, budgets = data()
            engine = pdpfast.PrivacyEngine(seed=SEED)
            net, optimizer, loader = engine.make_private_with_budgets(
                module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                data_loader=DataLoader(dataset, batch_size=8), budgets=budgets, delta=1e-5, steps=STEPS)
            if rank == 1:
                os._exit(0)  # dies before its first step
            x, y = next(iter(loader))
            try:  # on the CPU the first collective is in backward (do the ranks agree the records are finite?)
                nn.functional.cross_entropy(net(x), y).backward()
                optimizer.step()
                message = "no error"
            except RuntimeError as exc:
                message = str(exc)
            with open(os.path.join(out_dir, "killed.txt"), "w") as f:
                f.write(message)
            os._exit(0)  # the process group is broken: skip its destructors (gloo may abort in them)
    finally:
        if scenario != "killed":
            leave_process_group()


def _spawn(tmp_path, scenario):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path), scenario), nprocs=2, join=True)


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    _spawn(tmp, "train")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=["-".join(map(str, c[:3])) + f"-q{c[3]}" for c in CONFIGS])
def test_two_processes_train_the_single_process_model(two_process_results, index):
    params, eps = train(CONFIGS[index])
    for rank in (0, 1):
        rank_params, rank_eps = two_process_results[rank][index]
        np.testing.assert_array_equal(rank_eps, eps)  # the same ledger on every rank
        for name, p in params.items():
            torch.testing.assert_close(rank_params[name], p, rtol=1e-12, atol=1e-12, msg=f"rank {rank}: {name}")


def test_a_resumed_two_process_run_continues_exactly(two_process_results):
    params, eps = train(CONFIGS[0])
    for rank in (0, 1):
        rank_params, rank_eps = two_process_results[rank][len(CONFIGS)]
        np.testing.assert_array_equal(rank_eps, eps)
        for name, p in params.items():
            torch.testing.assert_close(rank_params[name], p, rtol=1e-12, atol=1e-12, msg=f"rank {rank}: {name}")


def test_the_global_draw_is_shared_out_with_equal_batch_counts():
    dataset, _ = data()
    rates = np.full(N, 0.3)
    loaders = [pdpfast.DPDataLoader(dataset, rates, physical_batch_size=2, seed=3, rank=r, world_size=2)
               for r in (0, 1)]
    whole = pdpfast.DPDataLoader(dataset, rates, seed=3)
    for step in range(20):
        drawn = pdpfast.sampling.poisson_sample(whole.sample_rates_tensor, 3, step)
        shares = [loader.split(drawn, step) for loader in loaders]
        assert len(shares[0]) == len(shares[1])  # same number of backward passes on every rank
        real = [torch.cat([b.indices[b.mask.bool()] for b in batches]) for batches in shares]
        assert sorted(torch.cat(real).tolist()) == sorted(drawn.tolist())  # nothing lost, nothing twice


@pytest.mark.parametrize("drawn", [[7], [7, 2, 11], [], [4, 9]], ids=["one", "three", "none", "two"])
def test_without_a_physical_batch_size_an_empty_share_runs_one_masked_row(drawn):
    """Before: a rank whose share of the draw was empty yielded 0 rows, and a loop that skips an empty
    batch's backward (``pdpfast train``'s) skipped the collectives in it that the other rank took: gloo
    aborted ("collective mismatch"), NCCL would hang. Now it yields one masked row (weight 0), so every
    rank runs a backward whenever the draw is not empty; an empty draw is empty on every rank."""
    dataset, _ = data()
    loaders = [pdpfast.DPDataLoader(dataset, np.full(N, 0.3), seed=3, rank=r, world_size=3) for r in range(3)]
    drawn = torch.tensor(drawn, dtype=torch.long)
    shares = [loader.split(drawn, 5) for loader in loaders]
    assert all(len(batches) == 1 and batches[0].is_last for batches in shares)
    real = []
    for batches in shares:
        b = batches[0]
        if not drawn.numel():
            assert b.indices.numel() == 0 and b.mask is None
        elif b.mask is not None:  # the padded empty share
            assert b.indices.tolist() == [0] and b.mask.tolist() == [0.0]
        else:
            real += b.indices.tolist()
    assert sorted(real) == sorted(drawn.tolist())  # nothing lost, nothing twice


def test_a_dead_rank_is_an_error_not_a_hang(tmp_path):
    _spawn(tmp_path, "killed")
    message = (tmp_path / "killed.txt").read_text()
    assert "another rank stopped" in message and "step 0" in message


def test_mismatched_seeds_are_refused(tmp_path):
    mp.spawn(_mismatch_worker, args=(str(tmp_path / "init"), str(tmp_path), "seed"), nprocs=2, join=True)
    assert "seed differs between ranks" in (tmp_path / "rank0.txt").read_text()


def test_ranks_given_their_own_shard_of_the_data_are_refused(tmp_path):
    """Before: ranks with different data of one size (each its own shard) passed the plan check; a record was
    then trained only when drawn *and* at its rank's place in the draw (about q/2), while the ledger charged q."""
    mp.spawn(_mismatch_worker, args=(str(tmp_path / "init"), str(tmp_path), "shard"), nprocs=2, join=True)
    message = (tmp_path / "rank0.txt").read_text()
    assert "dataset differs between ranks" in message and "not a shard" in message


def _mismatch_worker(rank, init_file, out_dir, what):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    dataset, budgets = data()
    if what == "shard":
        dataset = TensorDataset(dataset.tensors[0] + rank, dataset.tensors[1])
    try:
        net = nn.parallel.DistributedDataParallel(model())
        pdpfast.PrivacyEngine(seed=rank if what == "seed" else 0).make_private_with_budgets(
            module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), data_loader=DataLoader(dataset),
            budgets=budgets, delta=1e-5, steps=STEPS)
        message = "no error"
    except (ValueError, TypeError) as exc:
        message = str(exc)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(message)
    leave_process_group()


def test_cli_nproc_2_trains_the_one_process_model(tmp_path):
    import json
    import subprocess
    import sys

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(60, 5)), y=rng.integers(0, 3, 60),
             budgets=rng.choice([1.0, 4.0], 60))
    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"n{nproc}"
        cmd = [sys.executable, "-m", "pdpfast", "train", "--data", str(tmp_path / "d.npz"), "--epochs", "1",
               "--batch-size", "12", "--physical-batch-size", "4", "--hidden", "8", "--test-fraction", "0",
               "--method", "hybrid", "--seed", "3", "--noise-seed", "3", "--quiet", "--checkpoint", str(out) + ".pt",
               "--out-json", str(out) + ".json", "--nproc", str(nproc)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        # one report, from rank 0: the other rank used to print every line again
        assert done.stdout.count("pdpfast train:") == 1 and done.stdout.count("done:") == 1, done.stdout
        runs[nproc] = (json.loads((tmp_path / f"n{nproc}.json").read_text()),
                       torch.load(str(out) + ".pt", weights_only=False)["model"])
    (one, one_weights), (two, two_weights) = runs[1], runs[2]
    assert two["steps"] == one["steps"] and two["groups"] == one["groups"]
    for name, w in one_weights.items():
        torch.testing.assert_close(two_weights[name], w, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("env,speaks", [({}, True), ({"RANK": "3", "WORLD_SIZE": "1"}, True),
                                        ({"RANK": "0", "WORLD_SIZE": "2"}, True),
                                        ({"RANK": "1", "WORLD_SIZE": "2"}, False)])
def test_only_rank_0_of_a_multi_process_job_reports(monkeypatch, capsys, env, speaks):
    from pdpfast import train

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    train._say(train.TrainConfig(), "a report line")
    train._warn("a warning")
    out, err = capsys.readouterr()
    assert ("a report line" in out) == speaks and ("a warning" in err) == speaks


def test_the_data_fingerprint_sees_other_records_and_cannot_compare_random_ones():
    from pdpfast.distributed import data_fingerprint

    dataset, _ = data()
    same = TensorDataset(dataset.tensors[0].clone(), dataset.tensors[1].clone())
    assert data_fingerprint(dataset) == data_fingerprint(same)
    other = TensorDataset(dataset.tensors[0].clone(), dataset.tensors[1].clone())
    other.tensors[0][N - 1, 0] += 1.0                     # the last record is always read
    assert data_fingerprint(other) != data_fingerprint(dataset)

    class Augmented(torch.utils.data.Dataset):            # a random transform reads differently each time
        def __len__(self):
            return N

        def __getitem__(self, i):
            return torch.randn(3), 0

    assert data_fingerprint(Augmented()) == f"unverifiable ({N} records)"
    assert data_fingerprint([]) == data_fingerprint(TensorDataset(torch.zeros(0, 2)))


def test_leaving_without_a_process_group_does_nothing_at_once():
    """Before: slept, then torch's AssertionError "Default process group has not been initialized"."""
    assert not dist.is_initialized()
    start = time.perf_counter()
    leave_process_group(settle_s=5.0)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("settle_s,error", [(-1.0, ValueError), (float("nan"), ValueError), ("0.1", TypeError)])
def test_a_settle_time_that_is_not_a_number_of_seconds_is_refused_by_name(settle_s, error):
    with pytest.raises(error, match="settle_s must be"):
        leave_process_group(settle_s)
