"""End-to-end training throughput and peak memory: BERT-base (seq 128, batch 32), ResNet-18 with
GroupNorm (CIFAR 32×32, batch 256), GPT-2 small (seq 512, batch 8) in full and with LoRA r=8, ViT-B/16
(224×224, batch 64); non-private vs pdpfast (bk, ghost, per-layer) vs Opacus 1.6 (hooks, ghost), in one
process, on a CUDA device.

    python -m bench.bench_e2e [--models bert,resnet18,gpt2,gpt2-lora,vit,llama] [--dtype fp32|bf16] [--repeats 20]
    python -m bench.bench_e2e --device cpu --size micro --repeats 2     # smoke test without a GPU
    python -m bench.bench_e2e --device cpu --route large --models bert --repeats 1 \
        --providers "non-private,pdpfast bk,pdpfast per-layer"          # a GPU's peak memory, on a CPU
    python -m bench.bench_e2e --device cpu --route large --models vit --batch 24 ...   # a smaller batch
    python -m bench.bench_e2e --device cpu --route large --kernels stub --models resnet18 --batch 32 ...

``--route large`` makes every layer call take the route a full-size model's calls take on a GPU
(``bench.bench_overhead.large_call_route``): on a CPU the peak memory of each provider is then what
it allocates on a GPU, up to the kernels' own workspaces (the CPU path forms no per-sample gradient
there either). Each provider's peak is its own (``bench.harness.own_peak_memory``). The calls that
share a kernel launch on a GPU (same-shape convolutions, a transformer's projections, normalization
layers), and per-layer clipping's runs of them, are held as on a GPU only where the kernels are
chosen: ``--kernels stub`` chooses them with no-op launches (``bench.bench_overhead.stub_kernel_launches``),
so the peaks are a GPU's with its runs; the norms are then not computed, and the times are the host's
and the CPU's arithmetic around the kernels, not a step's.

Writes JSON rows (model, provider, batch, seq, dtype, device, versions, date, throughput, peak
memory, ratios to non-private) to bench/results/e2e_<device>_<dtype>.json, rewritten after each
model (a run stopped part-way keeps the models it finished). A provider that cannot run a model
(Opacus has no rule for Hugging Face's Conv1D in GPT-2, say) gets a row with its error.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from pathlib import Path

import torch
from torch import nn

from bench.bench_overhead import large_call_route, stub_kernel_launches
from bench.harness import PROVIDERS, environment, measure, with_ratios


def _classification_loss(out, y):
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(logits.float(), y, reduction="none")


def _lm_loss(out, y):
    logits = out.logits[:, :-1].float()
    per_token = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1),
                                            reduction="none")
    return per_token.view(y.shape[0], -1).mean(1)


def _with_positions(ids):
    # explicit (B, T) position ids: Hugging Face's default (1, T) ids are broadcast over the batch,
    # which Opacus's per-sample gradients cannot handle (pdpfast can: tested in tests/test_models.py)
    return {"input_ids": ids, "position_ids": torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)}


MODELS = ("bert", "resnet18", "gpt2", "gpt2-lora", "vit", "llama")


def build(name: str, size: str, device, dtype):
    from pdpfast import models

    g = torch.Generator().manual_seed(0)
    if name == "bert":
        model = models.bert("base" if size == "full" else size, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        batch, seq = (32, 128) if size == "full" else (4, 16)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
        y = torch.randint(0, 2, (batch,), generator=g)
        inputs, loss = _with_positions(ids), _classification_loss
    elif name == "resnet18":
        model = models.resnet18_gn()
        batch, seq = (256, None) if size == "full" else (4, None)
        inputs = (torch.randn(batch, 3, 32, 32, generator=g),)
        y, loss = torch.randint(0, 10, (batch,), generator=g), _classification_loss
    elif name == "gpt2":
        model = models.gpt2("small" if size == "full" else size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        batch, seq = (8, 512) if size == "full" else (2, 16)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
        inputs, y, loss = _with_positions(ids), ids, _lm_loss
    elif name == "gpt2-lora":  # DP fine-tuning of frozen GPT-2 small with LoRA r=8 on every attention/MLP map
        import peft

        base = models.gpt2("small" if size == "full" else size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, fan_in_fan_out=True,
                                                          target_modules=["c_attn", "c_proj", "c_fc"]))
        batch, seq = (8, 512) if size == "full" else (2, 16)
        ids = torch.randint(0, base.config.vocab_size, (batch, seq), generator=g)
        inputs, y, loss = _with_positions(ids), ids, _lm_loss
    elif name == "llama":  # a Llama-style decoder of SmolLM2-135M's shape (RMSNorm copies, grouped-query attention)
        model = models.llama("small" if size == "full" else size)
        batch, seq = (8, 512) if size == "full" else (2, 16)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
        inputs, y, loss = _with_positions(ids), ids, _lm_loss
    elif name == "vit":
        model = models.vit("base" if size == "full" else size, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
        batch, seq = (64, None) if size == "full" else (2, None)
        pixels = model.config.image_size
        inputs = (torch.randn(batch, 3, pixels, pixels, generator=g),)
        y, loss = torch.randint(0, 10, (batch,), generator=g), _classification_loss
    else:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    model = model.to(device=device, dtype=dtype)
    move = lambda t: t.to(device, dtype) if t.is_floating_point() else t.to(device)  # noqa: E731
    inputs = {k: move(t) for k, t in inputs.items()} if isinstance(inputs, dict) else tuple(map(move, inputs))
    return model, inputs, y.to(device), loss, batch, seq


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="full", help="full (the issue's sizes) | tiny | micro (smoke tests)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch", type=int, default=None,
                        help="the first BATCH samples of each model's batch (default: the model's own: 32 for BERT)")
    parser.add_argument("--providers", default=",".join(PROVIDERS),
                        help="comma-separated, from: " + ", ".join(PROVIDERS))
    parser.add_argument("--route", choices=("model", "large"), default="model",
                        help="large: every layer call takes a full-size model's GPU route (a GPU's memory, on a CPU)")
    parser.add_argument("--kernels", choices=("run", "stub"), default="run",
                        help="stub: the GPU's kernel choices with no-op launches, on a CPU (with --route large: a "
                             "GPU's peak memory with the calls it holds for a shared launch; no norm is computed)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch must be ≥ 1, got {args.batch}")
    unknown_models = set(args.models.split(",")) - set(MODELS)
    if unknown_models:
        parser.error(f"--models: unknown {sorted(unknown_models)}; choose from {', '.join(MODELS)}")
    unknown = set(args.providers.split(",")) - set(PROVIDERS)
    if unknown:
        parser.error(f"--providers: unknown {sorted(unknown)}; choose from {', '.join(PROVIDERS)}")
    providers = {name: PROVIDERS[name] for name in args.providers.split(",")}
    device = torch.device(args.device)
    if args.kernels == "stub":
        if device.type != "cpu":
            parser.error("--kernels stub is for a CPU (--device cpu): a GPU runs the kernels")
        stub_kernel_launches()
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_e2e: no CUDA device here; run it on a GPU machine, or pass --device cpu --size micro "
              "for a smoke test", file=sys.stderr)
        return 1
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    env, rows = environment(device), []
    tag = re.sub(r"[^A-Za-z0-9]+", "_", env["device"].split("(")[0].strip()).strip("_").lower()
    out = Path(args.out or f"bench/results/e2e_{tag}_{args.dtype}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():  # after every model: a run stopped part-way (a time limit on a lent GPU) keeps what it measured
        part = out.with_name(out.name + ".part")  # whole or not at all for whoever copies it meanwhile
        part.write_text(json.dumps(rows, indent=1))
        part.replace(out)

    for name in args.models.split(","):
        try:
            model, inputs, y, loss, batch, seq = build(name, args.size, device, dtype)
        except Exception as exc:  # a package missing on a GPU machine (peft, say): the other models still run
            rows.append({"benchmark": "e2e_training", "model": name, "size": args.size, "provider": "(model)",
                         "dtype": args.dtype, "error": f"{type(exc).__name__}: {exc}", **env})
            print(f"bench_e2e: {name} could not be built: {type(exc).__name__}: {exc}", file=sys.stderr)
            save()
            continue
        if args.batch is not None:  # a smaller batch of the same samples (a CPU's time and memory)
            batch, y = min(batch, args.batch), y[:args.batch]
            inputs = ({k: t[:batch] for k, t in inputs.items()} if isinstance(inputs, dict)
                      else tuple(t[:batch] for t in inputs))
        started = time.perf_counter()
        with large_call_route() if args.route == "large" else contextlib.nullcontext() as device_bytes:
            results = with_ratios(measure(model, inputs, y, loss, repeats=args.repeats, providers=providers), batch)
        print(f"bench_e2e: {name} measured in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        for provider, r in results.items():
            rows.append({"benchmark": "e2e_training", "model": name, "size": args.size, "provider": provider,
                         "batch": batch, "seq": seq, "dtype": args.dtype, "route": args.route,
                         "kernels": args.kernels, **r, **env,
                         "repeats": args.repeats, **({"device_bytes": device_bytes} if device_bytes else {})})
        del model
        save()
    print("| model | provider | samples/s | × non-private throughput | peak MiB | × memory | step ms | host ms |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['provider']} | {r['error']} | | | | | |")
            continue
        mem = (f"{r['peak_memory_mb']:.0f} | {r.get('memory_ratio_vs_nonprivate', float('nan')):.2f}"
               if "peak_memory_mb" in r else "– | –")
        print(f"| {r['model']} | {r['provider']} | {r['throughput_samples_per_s']:.1f} | "
              f"{r.get('throughput_ratio_vs_nonprivate', float('nan')):.2f} | {mem} | {r['median_ms']:.1f} | "
              f"{r.get('host_ms', float('nan')):.1f} |")
    print(f"device: {env['device']}, torch {env['torch']}, triton {env['triton']}, opacus {env['opacus']}, "
          f"{env['date']}; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
