"""The signal the low-precision rounding bound costs: per record, ‖g_i‖ / (‖g_i‖ + ρ_i) under bf16 autocast.

In bf16 each layer's clipped sum over positions rounds every scaled term w_i·o_t, and the weights
clip ‖g_i‖ + ρ_i to c_i so that the rounded contribution stays within c_i (README, "Mixed
precision"). A clipped record then keeps ‖g_i‖ / (‖g_i‖ + ρ_i) of its bound. This measures it on
real model shapes at random init, every call on the route a GPU takes (norm formulas, no
per-sample gradients formed: ``bench.bench_overhead.large_call_route``; a formed gradient needs
no bound).

    python -m bench.bench_rounding [--models bert,gpt2,resnet18,vit] [--batch 4] [--out bench/results/rounding_cpu.json]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from tqdm import tqdm

import pdpfast
from bench.bench_overhead import large_call_route
from bench.harness import environment, write_rows
from pdpfast.clipping import ClippingState


def _cases(batch: int):
    """name -> (build model, inputs, per-sample loss, shape label): built lazily (BERT-base is 110M parameters)."""
    from pdpfast import models

    g = torch.Generator().manual_seed(0)

    def classify(logits, y):
        return nn.functional.cross_entropy(logits.float(), y, reduction="none")

    def bert():
        ids, y = torch.randint(0, 30000, (batch, 128), generator=g), torch.randint(0, 2, (batch,), generator=g)
        return models.bert("base"), (ids,), lambda out: classify(out.logits, y), "BERT-base, T = 128"

    def gpt2():
        ids = torch.randint(0, 50000, (batch, 256), generator=g)
        return models.gpt2("small"), (ids,), lambda out: nn.functional.cross_entropy(
            out.logits.float().transpose(1, 2), ids, reduction="none").mean(1), "GPT-2 small, T = 256"

    def resnet18():
        x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
        return models.resnet18_gn(), (x,), lambda out: classify(out, y), "ResNet-18-GN, 32 px"

    def vit():
        x, y = torch.randn(batch, 3, 224, 224, generator=g), torch.randint(0, 10, (batch,), generator=g)
        return models.vit("base", image_size=224), (x,), lambda out: classify(out.logits, y), "ViT-B/16, 224 px"

    return {"bert": bert, "gpt2": gpt2, "resnet18": resnet18, "vit": vit}


def measure(model: nn.Module, inputs: tuple, loss, batch: int) -> dict:
    """One bf16-autocast backward with every record clipped: ‖g_i‖, ρ_i and the signal kept."""
    model = pdpfast.nn.convert(model).train()
    state = ClippingState(model)
    with state.attached(), large_call_route():
        state.begin_batch(torch.full((batch,), 1e-6))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = loss(model(*inputs))
        losses.sum().backward()
        norms, rho = state.last_norms.float(), state.last_rounding
        state.end_draw()
    if rho is None:
        raise RuntimeError("no layer bounded its rounding: the model did not run in bf16")
    kept = norms / (norms + rho.float())
    return {"rho_over_norm": (rho.float() / norms).tolist(), "signal_kept": kept.tolist(),
            "signal_kept_min": float(kept.min()), "signal_kept_median": float(kept.median())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert,gpt2,resnet18,vit")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", default="bench/results/rounding_cpu.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cases = _cases(args.batch)
    unknown = [m for m in args.models.split(",") if m not in cases]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {sorted(cases)}")
    env, rows = environment(torch.device("cpu")), []
    for name in tqdm(args.models.split(","), desc="models"):
        model, inputs, loss, label = cases[name]()
        start = time.perf_counter()
        row = measure(model, inputs, loss, args.batch)
        rows.append({"benchmark": "rounding_signal", "model": name, "shape": label, "batch": args.batch,
                     "dtype": "bf16 autocast", "route": "large", "seconds": time.perf_counter() - start, **row, **env})
    out = write_rows(args.out, rows)
    print("| model | signal kept by a clipped record (median, min) | ρ_i / ‖g_i‖ (median) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['signal_kept_median']:.3f}, {r['signal_kept_min']:.3f} "
              f"| {sorted(r['rho_over_norm'])[len(r['rho_over_norm']) // 2]:.4f} |")
    print(f"device: {env['device']}, torch {env['torch']}, {env['date']}; written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
