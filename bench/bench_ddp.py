"""Data-parallel scaling: the same private training with 1 and with N processes (DDP).

    python -m bench.bench_ddp [--nprocs 1,2] [--device cpu|cuda] [--steps 20]

Each configuration trains a small transformer with per-record budgets (bk, hybrid) for ``--steps``
optimizer steps after two warm-up steps; processes use gloo on the CPU (one torch thread each, so
N processes use N cores) and NCCL on GPUs (one GPU each). Reports records/s (expected batch ×
steps / s) and the speed-up over one process, and writes JSON rows to bench/results/ddp_<device>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bench.harness import environment, write_rows
from pdpfast.distributed import leave_process_group

N, SEQ, VOCAB, BATCH = 4096, 64, 1000, 64


def _worker(rank, world, init_file, device_type, steps, out_file):
    torch.set_num_threads(1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=5))
    import pdpfast
    from bench.models import TinyTransformer

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        TinyTransformer(vocab=VOCAB, d=128, layers=2, heads=4, seq=SEQ).to(device),
        device_ids=[rank] if device_type == "cuda" else None)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, VOCAB, (N, SEQ), generator=g), torch.randint(0, 2, (N,), generator=g))
    budgets = np.where(np.arange(N) % 2 == 0, 2.0, 8.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = pdpfast.PrivacyEngine(seed=0)
    model, optimizer, loader = engine.make_private_with_budgets(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=BATCH), budgets=budgets,
        delta=1e-5, steps=steps + 2, method="hybrid", physical_batch_size=BATCH)
    criterion = nn.CrossEntropyLoss()
    start = None
    for x, y in loader:
        if engine.steps == 2 and start is None:
            if device_type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
        criterion(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()
        if engine.steps >= steps + 2:
            break
    if device_type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if rank == 0:
        Path(out_file).write_text(json.dumps({"seconds": seconds, "expected_batch": engine.expected_batch_size}))
    leave_process_group()  # not destroy_process_group alone: gloo's threads may abort the exit


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", default="1,2")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.nprocs.split(",")]
    if args.device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < max(counts)):
        print(f"bench_ddp: needs {max(counts)} CUDA devices", file=sys.stderr)
        return 1
    env, rows = environment(torch.device(args.device)), []
    for world in counts:
        with tempfile.TemporaryDirectory() as tmp:
            out_file = os.path.join(tmp, "result.json")
            mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), args.device, args.steps, out_file),
                     nprocs=world, join=True)
            result = json.loads(Path(out_file).read_text())
        rate = result["expected_batch"] * args.steps / result["seconds"]
        rows.append({"benchmark": "ddp_scaling", "processes": world, "steps": args.steps,
                     "records_per_second": rate, "seconds": result["seconds"], **env})
    for row in rows:
        row["speedup_vs_one_process"] = row["records_per_second"] / rows[0]["records_per_second"]
    tag = args.device
    out = write_rows(args.out or f"bench/results/ddp_{tag}.json", rows)
    print("| processes | records/s | speed-up |\n|---:|---:|---:|")
    for row in rows:
        print(f"| {row['processes']} | {row['records_per_second']:.1f} | {row['speedup_vs_one_process']:.2f} |")
    print(f"device: {env['device']}, torch {env['torch']}, {env['date']}; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
