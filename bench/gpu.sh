#!/usr/bin/env bash
# Everything pdpfast measures on a GPU, in one command, on a machine with no network.
#
#   bash bench/gpu.sh                 # build, tests, kernels, overhead, end to end fp32 + bf16
#   bash bench/gpu.sh tests e2e       # only some steps: build tests (= engine + kernel tests) engine kernels
#                                     # overhead e2e (= e2e-fp32 e2e-bf16)
#   E2E_MODELS=bert,gpt2 bash bench/gpu.sh e2e-bf16    # some models (default: all of bench_e2e's)
#
# It uses the machine's own python3 and torch (nothing is installed from the network): the C++/CUDA
# sampler is built in place (`setup.py build_ext --inplace`; `pip install -e .` needs the network
# for its build isolation), kernels/ is linked as pdpfast/kernels, and wheels carried in .whl/
# (Opacus, the baseline: `pip download opacus==1.6.0 -d .whl` on a machine with a network) are
# unpacked into /tmp/site. JSON results go to bench/results/ (named after the device); logs to
# $LOGS; with $OUT set (the device tool's return folder) the run's JSON and a tarball of the logs
# are copied there every 20 s while it runs, and at the end: a command the device stops at its
# time limit still returns what it measured (bench_e2e rewrites its JSON after each model).
# A lent GPU allows 10 minutes a command: give the steps to separate calls (build tests | kernels
# overhead | e2e-fp32 | e2e-bf16).
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${LOGS:-/tmp/pdpfast-gpu-logs}
mkdir -p "$LOGS"
touch "$LOGS/.start"
steps=${*:-build tests kernels overhead e2e}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -e pdpfast/kernels ] || ln -s ../kernels pdpfast/kernels
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    | tee "$LOGS/env.txt"
collect() {  # this run's JSON and the logs so far, into $OUT
    find bench/results -name '*.json' -newer "$LOGS/.start" -exec cp {} "$OUT/" \;
    tar czf "$LOGS.tgz" -C "$LOGS" . && cp "$LOGS.tgz" "$OUT/logs.tgz"
}
if [ -n "${OUT:-}" ]; then
    ( while sleep 20; do collect; done ) &
    collector=$!
fi
e2e() {  # e2e DTYPE
    run "e2e_$1" python3 -m bench.bench_e2e --dtype "$1" ${E2E_MODELS:+--models "$E2E_MODELS"}
}
status=0
run() {  # run NAME COMMAND...: print and log to $LOGS/NAME.log as it goes, remember a failure, keep going
    local name=$1; shift
    echo "== $name: $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$LOGS/$name.log" || { echo "   FAILED (see $LOGS/$name.log)"; status=1; }
    echo "   ($((SECONDS - t0)) s)"
}
ext_check() {  # is pdpfast._C importable, built with CUDA, and does it define all that csrc/ defines?
    python3 - <<'PY'
import pathlib, re
from pdpfast import _ext
if _ext._IMPORT_ERROR:
    raise SystemExit(f"pdpfast._C: {_ext._IMPORT_ERROR}")
if not getattr(_ext._C, "clip_with_cuda", False):
    raise SystemExit("pdpfast._C was built without CUDA")
names = set()  # what a CUDA build of today's csrc/ defines
for source in pathlib.Path("csrc").glob("*.cpp"):
    names |= set(re.findall(r'm\.(?:def|attr)\("(\w+)"', source.read_text()))
stale = sorted(n for n in names if not hasattr(_ext._C, n))
if stale:  # e.g. a .so carried from a call before csrc/ gained them
    raise SystemExit(f"pdpfast._C is stale: it lacks {', '.join(stale)}")
print("pdpfast._C: importable, current, with CUDA")
PY
}
warned=
for step in $steps; do
    # before the first test or timed step: is pdpfast._C there and current (built in this call, or
    # carried from an earlier one)? Its CUDA tests skip, and timings take torch's routes, without it
    case $step in tests|engine|kernels|overhead|e2e*) [ -n "$warned" ] || {
        warned=1
        ext_check 2>&1 | tee -a "$LOGS/env.txt" | grep -q "importable, current" \
            || echo "   WARNING: $(tail -1 "$LOGS/env.txt"): its CUDA tests skip and the timings take slower torch routes (run the build step)"
    } ;;
    esac
    case $step in
        build) run build env MAX_JOBS=16 python3 setup.py build_ext --inplace
               if [ -n "${OUT:-}" ]; then  # without debug symbols (~0.3 MB): a later call can carry it back
                   for so in pdpfast/_C.*.so; do strip --strip-debug -o "$OUT/$(basename "$so")" "$so" \
                       || cp "$so" "$OUT/"; done
               fi ;;
        tests|engine) # the engine first: it holds the captured step's real captures (about 1 minute)
               run engine_tests python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 300 tests/test_cuda.py
               [ "$step" = engine ] || \
               run kernel_tests python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 300 tests/kernels ;;
        kernels) # every op bench_kernels has a benchmark for (a list here once left a new op out)
                 run bench_kernels python3 -m bench.bench_kernels --quick --dtypes bf16,fp32 ;;
        overhead) run bench_overhead python3 -m bench.bench_overhead --device cuda --repeats 100 \
                      --providers "non-private,non-private graph,pdpfast bk,pdpfast bk graph,pdpfast per-layer,pdpfast per-layer graph,pdpfast ghost,opacus hooks"
                  run bench_overhead_large python3 -m bench.bench_overhead --device cuda --repeats 100 --route large \
                      --providers "non-private,pdpfast bk,pdpfast per-layer"
                  run bench_overhead_large_bf16 python3 -m bench.bench_overhead --device cuda --repeats 100 \
                      --route large --dtype bf16 --providers "non-private,pdpfast bk,pdpfast per-layer" ;;
        e2e) e2e fp32; e2e bf16 ;;
        e2e-fp32) e2e fp32 ;;
        e2e-bf16) e2e bf16 ;;
        *) echo "unknown step $step (build tests engine kernels overhead e2e e2e-fp32 e2e-bf16)"; status=2 ;;
    esac
done
if [ -n "${OUT:-}" ]; then
    kill "$collector" 2>/dev/null; wait "$collector" 2>/dev/null
    collect
fi
exit $status
