"""Host overhead per training step: a 12-layer Hugging Face BERT of width 16 (batch 4, seq 8).

At this size the arithmetic is negligible, so a step's time is almost all Python, autograd and op
dispatch: the host work that keeps a GPU idle when the model is large. Non-private training, every
pdpfast mode and Opacus (hooks) run interleaved in one process; medians and ratios to the
non-private step of the same run.

    python -m bench.bench_overhead [--repeats 200] [--threads 1] [--out bench/results/overhead_cpu.json]
    python -m bench.bench_overhead --device cuda        # host-bound step on a GPU: the same ratios there
    python -m bench.bench_overhead --model llama-12x16   # a Llama-style decoder of the same sizes
    python -m bench.bench_overhead --model resnet18-w4   # ResNet-18-GN's convolution and GroupNorm
                                                         # calls at width 4 (8x8 images, batch 4)
    python -m bench.bench_overhead --route large         # every call as a large model's call
    python -m bench.bench_overhead --dtype bf16          # bf16 weights (the low-precision route)
    TRITON_INTERPRET=1 python -m bench.bench_overhead --dtype bf16 --route large --repeats 3
                                                         # the kernels' launches per step (not times)
    python -m bench.bench_overhead --route large --kernels stub
                                                         # the GPU route's host time, on the CPU
    python -m bench.bench_overhead --model bert-base --route large --kernels stub
                                                         # BERT-base's launches per step on the GPU
                                                         # route at batch 32 (counts only: no times;
                                                         # minutes on a CPU)
    python -m bench.bench_overhead --records 1e3,1e4,1e5,1e6,1e7 --clock cpu
                                                         # host time per step vs the number of records
                                                         # N (a tiny MLP, make_private_with_budgets)

``--records`` asks another question: how a private step's host time grows with the dataset's size N,
everything else fixed. A 2-layer MLP of width 8 on 4 features (its own work is negligible) trains
by ``make_private_with_budgets`` on a ``TensorDataset`` of N rows with expected batch 32 (sample rate
32/N), for each method (``--methods``) and budget shape (``--budgets``: ``groups``, three values 1/2/3
in the demo's proportions; ``distinct``, uniform in [1, 3], every record its own), δ = 1e-8, against
non-private training of the same MLP (a shuffled batch-32 loader) in the same rounds. Per step it splits
the time into the loader's (the Poisson draw and the collate), the ledger's check (``would_exceed``,
before the step) and charge (``step``, after it), and the rest; once per variant, the one-off costs:
calibration, the rest of ``make_private_with_budgets``, and the first step (first draw, the ledger's
first full evaluation).

The issue's target (GPU step): pdpfast bk ≤ 1.8× the non-private host time, per-layer ≤ bk.

``--route large`` makes every layer call take the route it takes in a full-size model on a GPU
(BERT-base): computed on its own (small same-shape calls otherwise stack into one launch per op,
``pdpfast.clipping.SMALL_CALL_BYTES``), without forming per-sample gradients (on the CPU a
choice for small calls, ``pdpfast.ops.linear.MATERIALIZE_RATIO``; on a GPU only per-layer clipping
forms them, for calls with long sequences, ``prefer_per_sample``), and held together in runs bounded
by the model's own bytes, as a full-size model's are (``pdpfast.clipping.RUN_FLOOR``). At width 16 every call is small
and stacks, so the default route measures less host work per layer than a large model issues.

``--providers`` also takes ``pdpfast per-layer one run``: per-layer clipping with its runs unbounded
(``pdpfast.clipping.RUN_FLOOR`` and ``RUN_BYTES`` past any model), so that its same-key calls share
one norm launch as book-keeping's do. Beside ``pdpfast per-layer`` it says how much of per-layer's
host time above bk's is its runs, which its memory bound sets (a diagnosis, not a mode: held to the
end, its peak memory is bk's).

``--kernels stub`` times, on a CPU, the host work of the route a GPU takes: the Triton kernels are
chosen as on a GPU (``TRITON_INTERPRET=1``) and every launch returns at once without running, so
their outputs hold garbage and only the host's time means anything. It counts everything around a
launch (the launcher's Python, its output buffers, the torch ops on its results, the noise
kernel's table) but not Triton's own launch cost, which only a GPU measures.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import math
import statistics
import time
import warnings

import numpy as np
import torch
from torch import nn

from bench.harness import PROVIDERS, environment, measure, with_ratios, write_rows


def build(device: torch.device, layers: int = 12, width: int = 16, batch: int = 4, seq: int = 8):
    """(model, inputs, targets, per-sample loss) of the overhead benchmark."""
    from pdpfast.models import bert

    torch.manual_seed(0)
    model = bert("base", hidden_size=width, num_hidden_layers=layers, num_attention_heads=2,
                 intermediate_size=4 * width, vocab_size=128, max_position_embeddings=64,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).to(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (batch, seq), generator=g)
    # explicit (B, T) position ids, as in bench_e2e: Opacus cannot broadcast HF's default (1, T) ids
    inputs = {"input_ids": ids.to(device), "position_ids": torch.arange(seq).repeat(batch, 1).to(device)}
    y = torch.randint(0, 2, (batch,), generator=g).to(device)
    loss = lambda out, t: nn.functional.cross_entropy(out.logits, t, reduction="none")  # noqa: E731
    return model, inputs, y, loss


def build_llama(device: torch.device, layers: int = 12, width: int = 16, batch: int = 4, seq: int = 8):
    """(model, inputs, targets, per-sample loss) of ``build``'s sizes for a Llama-style decoder
    (Hugging Face ``LlamaForCausalLM``: RMSNorm copies, rotary positions, grouped-query attention,
    SwiGLU) trained on next-token loss, each record's loss the mean over its positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         attn_implementation="eager")
    model = LlamaForCausalLM(config).to(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (batch, seq), generator=g).to(device)
    inputs = {"input_ids": ids, "position_ids": torch.arange(seq).repeat(batch, 1).to(device)}

    def loss(out, t):
        return nn.functional.cross_entropy(out.logits[:, :-1].transpose(1, 2), t[:, 1:], reduction="none").mean(1)
    return model, inputs, ids, loss


def build_resnet(device: torch.device, width: int = 4, batch: int = 4, size: int = 8):
    """(model, inputs, targets, per-sample loss) of ResNet-18-GN (CIFAR stem) at width ``width`` (stages
    of 4, 8, 16 and 32 channels) on ``size``×``size`` images: every convolution and GroupNorm call of
    the full model (``bench_e2e``'s ResNet-18), with negligible arithmetic."""
    from pdpfast.models import resnet18_gn

    torch.manual_seed(0)
    model = resnet18_gn(num_classes=10, width=width).to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    loss = lambda out, t: nn.functional.cross_entropy(out, t, reduction="none")  # noqa: E731
    return model, (x,), y, loss


# the small models whose step is nearly all host work, by --model name (bench_overhead, profile_step)
STAND_INS = {"bert-12x16": build, "llama-12x16": build_llama, "resnet18-w4": build_resnet}


def in_dtype(built: tuple, dtype: torch.dtype) -> tuple:
    """A builder's (model, inputs, targets, loss) with the model and its float inputs (images; ids
    stay ints) in ``dtype``."""
    model, inputs, y, loss = built
    if dtype != torch.float32:
        model = model.to(dtype)
        if isinstance(inputs, tuple):  # images (a dict holds ids)
            inputs = tuple(t.to(dtype) for t in inputs)
    return model, inputs, y, loss


def build_bert_base(device: torch.device, batch: int = 32, seq: int = 128):
    """(model, inputs, targets, per-sample loss) of BERT-base at ``bench_e2e``'s batch and sequence
    length. On a CPU its arithmetic dwarfs its host work, so it is for counting launches, not for
    timing. The counts depend on the batch where a bound in bytes splits the calls a clipping mode
    holds together (per-layer clipping's runs, ``pdpfast.clipping.RUN_BYTES``: 28 Triton launches a
    step at bench_e2e's batch 32 in bf16, 13 at batch 2), so the default is the GPU's batch (a
    step takes ~40 s on one CPU core); ``--batch`` takes another."""
    from pdpfast.models import bert

    torch.manual_seed(0)
    model = bert("base", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).to(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (batch, seq), generator=g)
    inputs = {"input_ids": ids.to(device), "position_ids": torch.arange(seq).repeat(batch, 1).to(device)}
    y = torch.randint(0, 2, (batch,), generator=g).to(device)
    loss = lambda out, t: nn.functional.cross_entropy(out.logits, t, reduction="none")  # noqa: E731
    return model, inputs, y, loss


# aten ops that only make views or read metadata: no kernel launch on a GPU
_VIEW_OPS = frozenset({"view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "expand",
                       "unsqueeze", "squeeze", "squeeze_", "select", "slice", "split", "split_with_sizes", "unbind",
                       "detach", "alias", "as_strided", "promote_types"})


def launches_per_step(step) -> tuple[int, int]:
    """The kernels one call of ``step`` sends a GPU, each one the host issues (a proxy of host work
    that does not depend on the clock): aten ops that are not views, plus one per Triton kernel
    launch and one per call of ``pdpfast._C`` (each of its ops is one kernel on a GPU; the tensors
    it allocates launch nothing), except its calls made of torch ops (``_EXTENSION_COMPOSITES``),
    whose aten ops count as anyone's (less their allocations) plus the kernels of their own. Under
    ``TRITON_INTERPRET=1`` the kernels' route runs on the CPU; the ops the interpreter (or the
    extension) runs inside a kernel are not counted, so the count is the GPU's (the times are not).

    Returns:
        (all launches, the Triton launches among them).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    inside = [0, 0]  # [inside a kernel, inside an extension call made of torch ops]

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not inside[0] and name not in _VIEW_OPS and not (inside[1] and name in _ALLOCATION_OPS):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    class Triton:
        n = 0

    with Count(), _counting_triton_launches(Triton, inside), _counting_extension_calls(Count, inside):
        step()
    return Count.n + Triton.n, Triton.n


# pdpfast._C functions made of torch ops (csrc/linear_sums.cpp): the dispatcher sees each of their aten
# ops; the value is the kernels they launch beside them (clip_scale's own, called from C++)
_EXTENSION_COMPOSITES = {"linear_clipped_into": 0, "linear_clip_scale_into": 1}
_ALLOCATION_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty"})


def extension_functions() -> list:
    """The names of ``pdpfast._C``'s public functions ([] without the extension)."""
    from pdpfast import _ext

    ext = _ext._C
    return [] if ext is None else [n for n in dir(ext) if not n.startswith("_") and callable(getattr(ext, n))]


@contextlib.contextmanager
def _counting_extension_calls(counter, inside: list):
    """Each call of a ``pdpfast._C`` function adds one to ``counter.n``; ``inside[0]`` > 0 while one
    runs. A call of one of ``_EXTENSION_COMPOSITES`` adds the kernels of its own, and ``inside[1]`` > 0
    while it runs (its aten ops are counted, less their allocations)."""
    from pdpfast import _ext

    ext = _ext._C
    names = extension_functions()
    saved = {n: getattr(ext, n) for n in names}

    def counting(fn, own: int | None):
        kernel = own is None  # one kernel: the ops it runs inside are not counted
        depth = 0 if kernel else 1

        def wrapped(*args, **kwargs):
            counter.n += 1 if kernel else own
            inside[depth] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                inside[depth] -= 1
        return wrapped

    try:
        for n, fn in saved.items():
            setattr(ext, n, counting(fn, _EXTENSION_COMPOSITES.get(n)))
        yield
    finally:
        for n, fn in saved.items():
            setattr(ext, n, fn)


@contextlib.contextmanager
def _counting_triton_launches(counter, inside: list):
    """Each Triton kernel launch adds one to ``counter.n``; ``inside[0]`` > 0 while one runs."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton: no kernel launches to count
        yield
        return
    saved = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def counting(run):
        def wrapped(self, *args, **kwargs):
            counter.n += 1
            inside[0] += 1
            try:
                return run(self, *args, **kwargs)
            finally:
                inside[0] -= 1
        return wrapped

    try:
        for cls, run in saved.items():
            cls.run = counting(run)
        yield
    finally:
        for cls, run in saved.items():
            cls.run = run


def stub_kernel_launches() -> None:
    """Select the Triton kernels as on a GPU and make every launch a no-op (``--kernels stub``), and
    take no batch in cache-sized chunks as the CPU route does (``pdpfast.ops.norm``,
    ``pdpfast.ops.conv``: a GPU takes the whole batch at once, so the count of launches is the
    GPU's whatever the CPU's cache or thread count), and skip the check of non-finite norms, which a
    GPU does not make.

    Must run before ``pdpfast.kernels`` is imported: Triton reads ``TRITON_INTERPRET`` when it
    defines a kernel. Not undone (the process is a benchmark).
    """
    import os
    import sys

    if "pdpfast.kernels" in sys.modules or "kernels" in sys.modules:
        raise RuntimeError("stub_kernel_launches() must run before the kernels are imported")
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    InterpretedFunction.run = lambda self, *args, **kwargs: None
    import pdpfast.ops.conv as conv_ops
    import pdpfast.ops.norm as norm_ops

    conv_ops._CPU_CHUNK_ELEMENTS = norm_ops._CPU_CHUNK_ELEMENTS = sys.maxsize
    # a stubbed kernel leaves its output unset, so the norms are whatever memory held: the CPU's
    # refusal of non-finite norms would fire on them, and a GPU does not make that check anyway
    import pdpfast.clipping

    pdpfast.clipping.CHECK_FINITE_ON_CPU = False


@contextlib.contextmanager
def large_call_route():
    """Every layer call computed on its own, with no per-sample gradient formed: the route of a
    full-size model's calls on a GPU (the module docstring). The calls a clipping mode holds together
    (per-layer clipping's runs) are bounded as a full-size model's are, relative to the model's own
    bytes (``pdpfast.clipping.RUN_FLOOR`` 0): the width-16 BERT's per-layer step then takes 28 Triton
    launches, as BERT-base's at batch 32 does, not 13. As on a GPU, whose caching allocator counts its
    tensors' bytes, the CPU's are counted (``bench.cpu_bytes.counted_cpu_bytes``), so that per-layer
    clipping's runs go on while the device holds no more than where its backward began (where no C++
    compiler builds the counter: a warning, and the CPU's rule). And as on a GPU, which has no such
    pool, the CPU's buffer pool (``pdpfast.ops.workspace``) takes nothing back: a formed per-sample
    gradient is freed when dropped, not kept for the next step, where it would add to that step's peak
    memory (GPT-2's tied embedding and LM head: 589 MiB at batch 8 in bf16, which had read as an 11%
    higher peak than a GPU's). Restores the thresholds, the pool and the count on exit.

    Yields "counted", or "not counted (<why>)": what the rows record as ``device_bytes``."""
    import pdpfast.clipping as clipping
    import pdpfast.ops.linear as lin_ops
    from bench.cpu_bytes import counted_cpu_bytes, why_not_counted
    from pdpfast.ops import workspace

    saved = clipping.SMALL_CALL_BYTES, lin_ops.MATERIALIZE_RATIO, lin_ops.MATERIALIZE_MIN_ELEMENTS, clipping.RUN_FLOOR
    recycle = workspace.recycle
    clipping.SMALL_CALL_BYTES = lin_ops.MATERIALIZE_RATIO = lin_ops.MATERIALIZE_MIN_ELEMENTS = clipping.RUN_FLOOR = 0
    workspace.recycle = _keep_nothing
    try:
        why = why_not_counted()
        if why is not None:
            warnings.warn(f"--route large: the CPU's tensor bytes are not counted ({why}); per-layer clipping's "
                          "runs take the CPU's bounds, not a GPU's", RuntimeWarning, stacklevel=3)
        with counted_cpu_bytes() if why is None else contextlib.nullcontext():
            yield "counted" if why is None else f"not counted ({why})"
    finally:
        (clipping.SMALL_CALL_BYTES, lin_ops.MATERIALIZE_RATIO, lin_ops.MATERIALIZE_MIN_ELEMENTS,
         clipping.RUN_FLOOR) = saved
        workspace.recycle = recycle


def _keep_nothing(tensors) -> None:
    """``pdpfast.ops.workspace.recycle`` under ``large_call_route``: the buffers are freed when dropped."""


# --records: a private step's host time against the number of records N
RECORDS_BATCH = 32   # expected batch size, the same at every N (sample rate 32/N)
RECORDS_DELTA = 1e-8  # below 1/N up to N = 10^7


def records_budgets(n: int, shape: str) -> np.ndarray:
    """(n,) ε_i: "groups" (1/2/3 in the demo's proportions) or "distinct" (uniform in [1, 3], the same range:
    every record its own budget)."""
    rng = np.random.default_rng(0)
    if shape == "groups":
        return rng.choice([1.0, 2.0, 3.0], size=n, p=[0.34, 0.43, 0.23])
    if shape == "distinct":
        return rng.uniform(1.0, 3.0, size=n)
    raise ValueError(f"--budgets takes groups and distinct, got {shape!r}")


def records_dataset(n: int):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


class _Run:
    """One variant of the --records benchmark: a model, its loader and ``step()``, with the step's
    time split into the loader's (draw and collate), the ledger's check and charge, and the rest."""

    def __init__(self, dataset, timer, *, method: str | None = None, budgets: str | None = None,
                 clipping: str = "flat", steps: int = 1):
        n = len(dataset)
        self.timer, self.model, self.part = timer, _mlp(), {"check": 0.0, "charge": 0.0}
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.one_off = {}
        if method is None:  # the non-private baseline
            self.loader = torch.utils.data.DataLoader(dataset, batch_size=RECORDS_BATCH, shuffle=True)
        else:
            import pdpfast.accounting

            spent = []
            calibrate = pdpfast.accounting.calibrate

            def timed_calibrate(*args, **kwargs):
                t = timer()
                try:
                    return calibrate(*args, **kwargs)
                finally:
                    spent.append(timer() - t)
            loader = torch.utils.data.DataLoader(dataset, batch_size=RECORDS_BATCH)
            engine = pdpfast.PrivacyEngine(seed=0)
            epochs = math.ceil(steps / max(1, round(n / RECORDS_BATCH)))
            pdpfast.accounting.calibrate = timed_calibrate  # make_private_with_budgets looks it up at its call
            t = timer()
            try:
                with warnings.catch_warnings():  # δ against N, groups rarely drawn: not the question here
                    warnings.simplefilter("ignore")
                    self.model, self.optimizer, self.loader = engine.make_private_with_budgets(
                        module=self.model, optimizer=self.optimizer, data_loader=loader,
                        budgets=records_budgets(n, budgets), delta=RECORDS_DELTA, epochs=epochs, method=method,
                        sample_rate=RECORDS_BATCH / n, clipping=clipping)
            finally:
                pdpfast.accounting.calibrate = calibrate
            total = timer() - t
            self.one_off = {"calibrate_s": spent[0], "make_private_rest_s": total - spent[0],
                            "ledger_rows": int(engine.accountant.group_rates.shape[0]),
                            "distinct_sample_rates": int(np.unique(engine.plan.sample_rates).size),
                            "distinct_clip_norms": int(np.unique(engine.plan.clip_norms).size)}
            ledger = engine.accountant
            for name, part in (("would_exceed", "check"), ("exceeding", "check"), ("step", "charge")):
                if hasattr(ledger, name):
                    setattr(ledger, name, self._timed(getattr(ledger, name), part))
        self.batches = iter(self.loader)
        first = self.step()
        self.one_off.update(first_step_ms=first["step"] * 1e3, first_loader_ms=first["loader"] * 1e3,
                            first_check_ms=first["check"] * 1e3)

    def _timed(self, fn, part: str):
        def timed(*args, **kwargs):
            t = self.timer()
            try:
                return fn(*args, **kwargs)
            finally:
                self.part[part] += self.timer() - t
        return timed

    def step(self) -> dict:
        """One training step; its times in seconds: "step" (all of it), "loader", "check", "charge"."""
        self.part.update(check=0.0, charge=0.0)
        t = self.timer()
        try:
            x, y = next(self.batches)
        except StopIteration:   # the next pass over the loader (its next draws)
            self.batches = iter(self.loader)
            x, y = next(self.batches)
        loaded = self.timer()
        nn.functional.cross_entropy(self.model(x), y).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        end = self.timer()
        return {"step": end - t, "loader": loaded - t, **self.part}


def records_scaling(args) -> list:
    """Rows of the --records benchmark: for each N, every (method, budgets, clipping) variant and the
    non-private baseline, interleaved step by step; medians over ``args.repeats`` steps."""
    timer = time.process_time if args.clock == "cpu" else time.perf_counter
    env = environment(torch.device("cpu"))
    rows = []
    for n in (int(float(v)) for v in args.records.split(",")):
        dataset = records_dataset(n)
        steps = args.repeats + 10 + 2
        runs = {("non-private", None, None, None): _Run(dataset, timer)}
        for method in args.methods.split(","):
            for budgets in args.budgets.split(","):
                for clipping in args.clipping.split(","):
                    runs[("pdpfast", method, budgets, clipping)] = _Run(
                        dataset, timer, method=method, budgets=budgets, clipping=clipping, steps=steps)
        times = {key: [] for key in runs}
        for r in range(10 + args.repeats):   # 10 warm-up rounds
            for key, run in runs.items():
                measured = run.step()
                if r >= 10:
                    times[key].append(measured)
        base = statistics.median(t["step"] for t in times[("non-private", None, None, None)])
        for (provider, method, budgets, clipping), ts in times.items():
            median = {part: statistics.median(t[part] for t in ts) * 1e3 for part in ("step", "loader", "check",
                                                                                     "charge")}
            rows.append({"benchmark": "host_per_step_vs_records", "records": n, "provider": provider,
                         "method": method, "budgets": budgets, "clipping": clipping,
                         "expected_batch": RECORDS_BATCH, "median_ms": median["step"],
                         "loader_ms": median["loader"], "check_ms": median["check"], "charge_ms": median["charge"],
                         "time_ratio_vs_nonprivate": median["step"] / (base * 1e3),
                         **runs[(provider, method, budgets, clipping)].one_off, **env, "repeats": args.repeats,
                         "clock": args.clock})
        del runs, dataset
    return rows


def _print_records(rows: list) -> None:
    print("| N | provider | budgets | clipping | step (ms) | × non-private | loader | check | charge | "
          "calibration (s) | make_private rest (s) | first step (ms) | ledger rows |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        name = r["provider"] if r["method"] is None else r["method"]
        once = (f"{r['calibrate_s']:.2f} | {r['make_private_rest_s']:.2f} | {r['first_step_ms']:.1f} | "
                f"{r['ledger_rows']}") if "calibrate_s" in r else " | | | "
        print(f"| {r['records']:.0e} | {name} | {r['budgets'] or ''} | {r['clipping'] or ''} | {r['median_ms']:.2f} | "
              f"{r['time_ratio_vs_nonprivate']:.2f} | {r['loader_ms']:.2f} | {r['check_ms']:.2f} | "
              f"{r['charge_ms']:.2f} | {once} |")


def _one_run_per_layer(model, inputs, y, loss):
    """``pdpfast per-layer`` whose steps hold every same-key call to one launch (module docstring)."""
    import pdpfast.clipping as clipping

    step = PROVIDERS["pdpfast per-layer"](model, inputs, y, loss)

    def unbounded():
        saved = clipping.RUN_FLOOR, clipping.RUN_BYTES
        clipping.RUN_FLOOR = clipping.RUN_BYTES = 1 << 62
        try:
            step()
        finally:
            clipping.RUN_FLOOR, clipping.RUN_BYTES = saved
    return unbounded


DIAGNOSTIC_PROVIDERS = {"pdpfast per-layer one run": _one_run_per_layer}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: time is host work only)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the process's CPU time, steadier than wall time on a shared machine")
    parser.add_argument("--providers", default="non-private,pdpfast bk,pdpfast per-layer,pdpfast ghost,opacus hooks")
    parser.add_argument("--route", choices=("model", "large"), default="model",
                        help="large: every call takes a full-size model's route (no stacking, no per-sample "
                             "gradients formed); model: the route this model's sizes choose")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: the model in bf16, whose calls also bound their clipped sums' rounding")
    parser.add_argument("--kernels", choices=("run", "stub"), default="run",
                        help="stub: the GPU's kernel choices with every launch a no-op (the GPU route's host "
                             "time on a CPU; outputs are garbage)")
    parser.add_argument("--model", choices=("bert-12x16", "llama-12x16", "resnet18-w4", "bert-base"),
                        default="bert-12x16",
                        help="llama-12x16: a Llama-style decoder of the same sizes on next-token loss; resnet18-w4: "
                             "ResNet-18-GN of width 4 on 8x8 images (batch 4), every conv and GroupNorm call of "
                             "the full model's step; bert-base: "
                             "BERT-base (--batch, default 32; seq 128), launches per step only (no times: on a CPU its "
                             "arithmetic dwarfs its host work)")
    parser.add_argument("--batch", type=int, default=32,
                        help="with --model bert-base: the batch whose launches are counted (default: bench_e2e's)")
    parser.add_argument("--records", default=None,
                        help="comma-separated dataset sizes N (1e3,1e6 or 1000,1000000): a private step's host "
                             "time vs N on a tiny MLP (see above) instead of the BERT providers")
    parser.add_argument("--methods", default="sample,scale,hybrid", help="with --records: calibration methods")
    parser.add_argument("--budgets", default="groups,distinct", help="with --records: budget shapes")
    parser.add_argument("--clipping", default="flat", help="with --records: flat, per_layer or both")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.records is not None:
        torch.set_num_threads(args.threads)
        rows = records_scaling(args)
        out = write_rows(args.out or "bench/results/overhead_records_cpu.json", rows)
        _print_records(rows)
        print(f"device: {rows[0]['device']}, torch {rows[0]['torch']}, {rows[0]['date']}; written to {out}")
        return 0
    if args.kernels == "stub":
        stub_kernel_launches()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    timed = args.model != "bert-base"
    builder = functools.partial(build_bert_base, batch=args.batch) if args.model == "bert-base" else \
        STAND_INS[args.model]
    model, inputs, y, loss = in_dtype(builder(device), torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    known = {**PROVIDERS, **DIAGNOSTIC_PROVIDERS}
    unknown = [name for name in args.providers.split(",") if name not in known]
    if unknown:
        parser.error(f"--providers: unknown {unknown}; choose from {', '.join(known)}")
    providers = {name: known[name] for name in args.providers.split(",")}
    with large_call_route() if args.route == "large" else contextlib.nullcontext() as device_bytes:
        if timed:
            results = with_ratios(measure(model, inputs, y, loss, repeats=args.repeats, warmup=10,
                                          providers=providers, clock=args.clock), y.shape[0])
        else:
            results = {name: {} for name in providers}
        for name, make in providers.items():
            if "median_ms" in results[name] or not timed:
                step = make(copy.deepcopy(model), inputs, y, loss)
                step(), step()  # warm: lazily built state is not counted
                launches, triton_launches = launches_per_step(step)
                results[name]["launches_per_step"] = launches
                results[name]["triton_launches_per_step"] = triton_launches
    env = environment(device)
    batch, seq = (4, None) if args.model == "resnet18-w4" else (4, 8) if timed else (args.batch, 128)
    rows = [{"benchmark": "host_overhead", "model": args.model, "batch": batch, "seq": seq, "provider": name, **r,
             **env, "repeats": args.repeats, "clock": args.clock, "route": args.route, "dtype": args.dtype,
             "kernels": args.kernels, **({"device_bytes": device_bytes} if device_bytes else {})}
            for name, r in results.items()]
    suffix = "" if args.model == "bert-12x16" else "_" + args.model.replace("-", "_")
    suffix += "" if args.route == "model" else f"_{args.route}_calls"
    suffix += "" if args.dtype == "fp32" else f"_{args.dtype}"
    suffix += "" if args.kernels == "run" else f"_{args.kernels}_kernels"
    out = write_rows(args.out or f"bench/results/overhead_{device.type}{suffix}.json", rows)
    print("| provider | median step (ms) | × non-private | launches per step |\n|---|---:|---:|---:|")
    for r in rows:
        if "median_ms" in r:
            print(f"| {r['provider']} | {r['median_ms']:.2f} | {r.get('time_ratio_vs_nonprivate', float('nan')):.2f} "
                  f"| {r.get('launches_per_step', '')} |")
        elif "launches_per_step" in r:
            print(f"| {r['provider']} | | | {r['launches_per_step']} |")
        else:
            print(f"| {r['provider']} | {r['error']} | |")
    print(f"device: {env['device']}, torch {env['torch']}, {env['date']}; written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
