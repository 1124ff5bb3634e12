"""Compile every Triton kernel of ``pdpfast.kernels`` for an NVIDIA GPU, on a machine without one.

The kernel tests run the kernels in Triton's CPU interpreter, which executes each ``tl`` call with
numpy and never compiles anything: a kernel that fails to compile for a GPU (a type the code
generator refuses, a block shape it cannot lay out, an op the interpreter accepts and the compiler
does not) passes there and fails at its first launch on a GPU. Triton compiles for a GPU target with
no GPU present, so this script does, for each launch the launchers make:

1. every ``JITFunction.run`` is replaced by one that records the launch and runs nothing, and each
   registered op's kernel is called on (uninitialized) CPU tensors of the shapes, dtypes and options
   that choose its compile-time variants (paths, block sizes, bias, rounding bound, seed source);
2. each distinct (kernel, argument types, constexprs, launch options) is compiled to machine code
   for the target (``triton.compile``; fp32 dot products both as "tf32", where torch allows TF32,
   and as the default precision: only a CUDA tensor chooses between them), and the shared memory
   it needs is checked against what a block of the target may use (an excess compiles and fails
   only at launch).

    python tests/triton_gpu_compile.py [--arch 90] [--list] [--resources]

Must run without ``TRITON_INTERPRET`` (the kernels must be ``JITFunction``s); ``tests/test_triton_gpu_compile.py``
runs it in a process of its own. Exit status 0 when every variant compiles, 1 when one does not
(each failure printed), 2 when this Triton cannot compile for the target at all (a canary kernel
fails: no NVIDIA backend in this build).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import torch

# the most shared memory one block may use (opt-in) by compute capability: a variant that needs
# more compiles, and fails at its launch with "out of resource: shared memory"
SHARED_MEMORY_PER_BLOCK = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1"}


def record_launches(calls) -> list:
    """Run ``calls()`` with every Triton launch recorded and none run.

    Returns:
        [(JITFunction, args, kwargs)] in launch order (``grid`` and ``warmup`` dropped).
    """
    from triton.runtime.jit import JITFunction

    launches = []
    run = JITFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = recording
    try:
        calls()
    finally:
        JITFunction.run = run
    return launches


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"a launch argument of type {type(value).__name__}")


def variants(launches) -> dict:
    """Distinct compile-time variants of the recorded launches.

    Returns:
        {key: (JITFunction, signature {name: type}, constexprs {name: value}, options)}; an fp32 launch
        whose ``DOT_PRECISION`` is a constexpr appears with "tf32" and with its recorded precision.
    """
    out = {}
    for fn, args, kwargs in launches:
        names = fn.arg_names
        is_const = {p.name: p.is_constexpr for p in fn.params}
        bound = dict(zip(names, args))
        options = {k: v for k, v in kwargs.items() if k not in names}
        bound.update((k, v) for k, v in kwargs.items() if k in names)
        missing = [n for n in names if n not in bound]
        if missing:
            raise RuntimeError(f"{fn.__name__}: launched without {missing} (defaults are not recorded)")
        signature = {n: "constexpr" if is_const[n] else _arg_type(v) for n, v in bound.items()}
        constexprs = {n: v for n, v in bound.items() if is_const[n]}
        precisions = [constexprs.get("DOT_PRECISION")]
        if "DOT_PRECISION" in constexprs and "*fp32" in signature.values():
            precisions = sorted({constexprs["DOT_PRECISION"], "tf32"})
        for precision in precisions:
            if precision is not None:
                constexprs = dict(constexprs, DOT_PRECISION=precision)
            key = (fn.__name__, tuple(signature.items()), tuple(sorted(constexprs.items())),
                   tuple(sorted(options.items())))
            out.setdefault(key, (fn, signature, constexprs, options))
    return out


def signature_dtypes(signature: dict) -> str:
    """The pointer dtypes of a signature, e.g. "bf16,i64"."""
    return ",".join(dict.fromkeys(t[1:] for t in signature.values() if t.startswith("*")))


def compile_for(fn, signature: dict, constexprs: dict, options: dict, arch: int):
    """``fn`` compiled for CUDA compute capability ``arch`` (e.g. 90: Hopper), warp size 32.

    Returns:
        the compiled kernel (its ``asm`` holds the PTX and the cubin).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32), options=options)


def _canary(arch: int) -> None:
    """Compile a trivial kernel: raises where this Triton cannot target CUDA at all."""
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

    compile_for(_copy, {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 64}, {}, arch)


def defined_kernels() -> list[str]:
    """Names of the launchable Triton kernels of ``pdpfast.kernels`` (the ``@triton.jit`` functions
    named ``*_kernel``; the others are helpers compiled into them)."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import pdpfast.kernels as package

    names = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        names += [name for name, value in vars(module).items() if isinstance(value, JITFunction)
                  and name.endswith("_kernel") and value.__module__ == module.__name__]
    return names


def resource_usage(compiled) -> tuple[int, int] | None:
    """(registers per thread, stack bytes per thread: the spills) of a compiled kernel's cubin, read
    by ``cuobjdump`` (Triton's own, else one on the PATH); None where there is none."""
    import re
    import shutil
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    tool = tool if os.path.exists(tool) else shutil.which("cuobjdump")
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        out = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _e(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def kernel_calls() -> None:
    """Call each registered op's kernel once per compile-time variant the model layers choose: every
    block configuration in each dtype, and each path's full-size configuration with every
    combination of its flags (the flags' code is the same at other block sizes)."""
    from pdpfast.kernels import conv_norms, noise, norm_grads, norms

    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    # (B, T, d, p), each path's full-size configuration first: rank one (T = 1) at BERT-base's pooler
    # and at width 16; Gram at BERT-base's T = 128 and at short sequences (T blocks 16, 32); direct
    # at GPT-2's 768→768 call (T = 512) and a tiny one
    linear_shapes = [(2, 1, 768, 768), (2, 1, 16, 16), (2, 128, 768, 3072), (2, 8, 16, 64), (2, 20, 64, 64),
                     (2, 512, 768, 768), (2, 4, 3, 2)]
    for dtype in dtypes:
        first_of_path = set()
        for B, T, d, p in linear_shapes:
            a, o = _e(B, T, d, dtype=dtype), _e(B, T, p, dtype=dtype)
            path = "rank_one" if T == 1 else "gram" if norms.kernel_uses_gram(T, d, p) else "direct"
            every_flag = path not in first_of_path
            first_of_path.add(path)
            for with_bias in (False, True) if every_flag else (True,):
                if every_flag or path == "direct":
                    norms.linear_weight_sq_norms(a, o, with_bias=with_bias)
                if path != "direct":
                    norms.linear_sq_norms_rounding(a, o, with_bias, 2.0 ** -8)
        # grouped norms of Gram-path calls of one (B, T): BERT-base's projections (widths multiples of
        # 16), a short sequence's, and widths that are not multiples of 16 (no divisibility hints)
        for B, T, widths in [(2, 128, [(768, 768), (768, 3072), (3072, 768)]), (2, 8, [(16, 64), (16, 16)]),
                             (2, 20, [(64, 72), (40, 64)])]:
            calls = [(_e(B, T, d, dtype=dtype), _e(B, T, p, dtype=dtype)) for d, p in widths]
            for with_bias, u in ((False, 0.0), (True, 0.0), (True, 2.0 ** -8)):
                norms.linear_sq_norms_grouped(calls, with_bias, u)
        for B, T, p in [(2, 8, 16), (2, 128, 768), (2, 3, 5)]:
            norms.bias_sq_norms(_e(B, T, p, dtype=dtype))
            ids = torch.zeros(B, T, dtype=torch.int64)
            for padding_idx in (None, 0):
                norms.embedding_sq_norms(ids, _e(B, T, p, dtype=dtype), 100, padding_idx)
    # LayerNorm (with and without bias) and RMSNorm rows: BERT's (N = 768, row tiles of 4, positions
    # split among programs), a narrow one (many rows a tile), LLaMA-7B's and the widest the kernel
    # takes (8 and 16 warps), one position (one program per sample)
    for dtype in dtypes:
        for B, T, N in [(2, 128, 768), (2, 8, 16), (2, 64, 4096), (2, 4, 8192), (2, 1, 33)]:
            x = _e(B, T, N, dtype=dtype)
            for bias in (True, False):
                norm_grads.layer_norm_per_sample_grads(x, _e(B, T, N, dtype=dtype), SimpleNamespace(
                    normalized_shape=(N,), eps=1e-5, bias=object() if bias else None))
            norm_grads.rms_norm_per_sample_grads(x, _e(B, T, N, dtype=dtype), SimpleNamespace(
                normalized_shape=(N,), eps=None))
        # same-shape calls in one grouped launch (offsets table): BERT's and a narrow one
        for B, T, N in [(2, 128, 768), (2, 8, 16)]:
            calls = [(_e(B, T, N, dtype=dtype), _e(B, T, N, dtype=dtype)) for _ in range(3)]
            for bias in (True, False):
                norm_grads.layer_norm_per_sample_grads_grouped(calls, SimpleNamespace(
                    normalized_shape=(N,), eps=1e-5, bias=object() if bias else None))
            norm_grads.rms_norm_per_sample_grads_grouped(calls, SimpleNamespace(normalized_shape=(N,), eps=None))
    # GroupNorm at ResNet-18-GN's first and last stages, a (B, C) input, instance norm (G = C) (each
    # group one tile), and groups of several position tiles and of several channel tiles (the loops)
    for dtype in dtypes:
        for shape, groups in [((2, 64, 32, 32), 32), ((2, 512, 4, 4), 32), ((2, 6), 3), ((2, 8, 9), 8),
                              ((2, 4, 40, 40), 2), ((2, 512, 3, 3), 1)]:
            for bias in (True, False):
                norm_grads.group_norm_affine_grads(_e(*shape, dtype=dtype), _e(*shape, dtype=dtype), groups, 1e-5, bias)
                # a stage's same-shape calls in one grouped launch (offsets table)
                norm_grads.group_norm_affine_grads_grouped(
                    [(_e(*shape, dtype=dtype), _e(*shape, dtype=dtype)) for _ in range(3)], groups, 1e-5, bias)
    # convolutions (inputs already padded), fp32 and one 16-bit dtype: a CIFAR ResNet-18's first 3×3
    # layer, a strided 3×3 one, a 1×1 downsample, a grouped one and a Conv1d
    convs = [((2, 3, 34, 34), (2, 64, 32, 32), (3, 3), 1, 1), ((2, 128, 9, 9), (2, 256, 4, 4), (3, 3), 2, 1),
             ((2, 64, 16, 16), (2, 128, 8, 8), (1, 1), 2, 1), ((2, 32, 10, 10), (2, 32, 8, 8), (3, 3), 1, 4),
             ((2, 8, 20), (2, 16, 18), (3,), 1, 1)]
    for dtype in (torch.float32, torch.bfloat16):
        for x_shape, o_shape, kernel, stride, groups in convs:
            module = SimpleNamespace(kernel_size=kernel, stride=(stride,) * len(kernel), dilation=(1,) * len(kernel),
                                     groups=groups)
            for path in ("direct", "gram"):
                conv_norms.conv_weight_sq_norms(_e(*x_shape, dtype=dtype), _e(*o_shape, dtype=dtype), module, path)
    # the same convolutions unpadded, the kernels masking the taps in the zero padding, and a stage's
    # same-shape calls in one grouped launch (offsets table), padded by masking and already padded
    for dtype in (torch.float32, torch.bfloat16):
        for x_shape, o_shape, kernel, stride, groups in convs:
            module = SimpleNamespace(kernel_size=kernel, stride=(stride,) * len(kernel), dilation=(1,) * len(kernel),
                                     groups=groups)
            pad = tuple(k // 2 for k in kernel)
            unpadded = (*x_shape[:2], *(n - 2 * q for n, q in zip(x_shape[2:], pad)))
            for path in ("direct", "gram"):
                conv_norms.conv_weight_sq_norms(_e(*unpadded, dtype=dtype), _e(*o_shape, dtype=dtype), module, path,
                                                padding=pad)
                # with the rounding bound in the launch (bias or not), padded by masking and already padded
                for shape, padding, bias in ((unpadded, pad, True), (x_shape, None, False)):
                    conv_norms.conv_sq_norms_rounding(_e(*shape, dtype=dtype), _e(*o_shape, dtype=dtype), module, bias,
                                                      2.0 ** -8, padding, path=path)
            for shape, padding in ((unpadded, pad), (x_shape, None)):
                calls = [(_e(*shape, dtype=dtype), _e(*o_shape, dtype=dtype)) for _ in range(3)]
                conv_norms.conv_sq_norms_grouped(calls, module, padding)
                conv_norms.conv_sq_norms_grouped(calls, module, padding, 2.0 ** -8, True)
    for dtype in dtypes + (torch.float64,):
        grads = [_e(5000, dtype=dtype), _e(3, 7, dtype=dtype)]
        noise.add_noise_(grads, 1.0, 0, 3)
        noise.add_noise_(grads, 1.0, 0, 3, device_seed=torch.tensor(12345, dtype=torch.int64), keep=[])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability ×10 (90: H100/H200)")
    parser.add_argument("--list", action="store_true", help="print each variant as it compiles")
    parser.add_argument("--resources", action="store_true",
                        help="also print each variant's registers and spilled stack bytes per thread (cuobjdump)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("triton_gpu_compile: unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)",
              file=sys.stderr)
        return 2
    try:
        _canary(args.arch)
    except Exception as exc:  # no NVIDIA backend (or no ptxas) in this Triton build: nothing to check here
        print(f"triton_gpu_compile: this Triton cannot compile for sm_{args.arch}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 2
    found = variants(record_launches(kernel_calls))
    unlaunched = sorted(set(defined_kernels()) - {key[0] for key in found})
    if unlaunched:
        print(f"triton_gpu_compile: no call in kernel_calls() launches {unlaunched}: add one")
        return 1
    failures = []
    start = time.perf_counter()
    limit = SHARED_MEMORY_PER_BLOCK.get(args.arch)
    most_shared = 0
    for (name, _, constexprs, options), (fn, signature, consts, opts) in found.items():
        try:
            compiled = compile_for(fn, signature, consts, opts, args.arch)
            shared = compiled.metadata.shared
        except Exception as exc:
            failures.append(name)
            print(f"FAIL {name} {dict(constexprs)} {dict(options)}\n     {type(exc).__name__}: {exc}")
            continue
        most_shared = max(most_shared, shared)
        if limit is not None and shared > limit:
            failures.append(name)
            print(f"FAIL {name} {dict(constexprs)} {dict(options)}\n     needs {shared} bytes of shared memory, "
                  f"more than a block of sm_{args.arch} may use ({limit})")
        elif args.list or args.resources:
            usage = resource_usage(compiled) if args.resources else None
            regs = "" if usage is None else f", {usage[0]} registers, {usage[1]} bytes spilled"
            print(f"ok   {name} {signature_dtypes(signature)} {dict(constexprs)} {dict(options)} "
                  f"shared memory {shared} bytes{regs}")
    kernels = sorted({key[0] for key in found})
    print(f"{len(found) - len(failures)} of {len(found)} variants of {len(kernels)} kernels compiled for "
          f"sm_{args.arch} in {time.perf_counter() - start:.0f} s: {', '.join(kernels)}; the most shared "
          f"memory a block uses: {most_shared} bytes (limit {limit or 'unknown'})")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
