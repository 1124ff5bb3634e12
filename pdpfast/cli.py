"""The ``pdpfast`` command line: demo, train, calibrate, bench, info (and fl, when installed).

Every command either succeeds with all of its outputs in place, or fails with one line
``pdpfast <command>: error: ...`` on stderr, a non-zero exit status and no output file: outputs
are staged as temporary files and moved into place together at the end, and every output path
is checked before any work starts (checkpoints are the exception by design: a long run keeps its
last complete checkpoint, written atomically). ``train`` stopped by SIGINT / SIGTERM writes a
final checkpoint and exits with 128 + the signal's number.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

EXIT_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse, with errors as one line (``prog: error: message``) instead of usage + message."""

    def error(self, message):
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def _fail(command: str, exc: BaseException, parser: argparse.ArgumentParser | None = None, args=None) -> int:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if parser is not None:
        from ._options import as_option_words

        text = as_option_words(parser, args, text)
    _report(f"pdpfast {command}: error: {text}")
    return EXIT_ERROR


class _Interrupted(KeyboardInterrupt):
    """A stop signal outside the training steps (they handle their own: ``pdpfast.train``), raised
    by ``_CtrlC`` instead of a plain KeyboardInterrupt. CPython ends a process by SIGINT at exit,
    whatever status it was given, once a plain one has passed through code run by ``PyRun_String``,
    as in some extension's import, even where it was then caught: a rank of ``--nproc`` seemed killed."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _CtrlC:
    """While the command runs (its main thread; the training steps set handlers of their own), SIGINT
    and SIGTERM raise ``_Interrupted``, and the signal is remembered, so that an import it broke into
    (numpy's turns it into an ImportError) ends the command as an interruption too, in one line. A
    signal within ``launch.SAME_STOP_S`` of the last stop request (the copy a launcher hands on, a
    second one sent to every process) is that request again, and does nothing. When the command is
    the process's own (``process``) and ends on a signal, the signals are then ignored, so that
    nothing cuts the interpreter's exit (torch's atexit hooks printed a KeyboardInterrupt); otherwise
    their handlers are given back."""

    def __init__(self, process: bool):
        self.process = process
        self.signum: int | None = None
        self.status: int | None = None
        self._previous: dict = {}

    def _on_signal(self, signum, frame):
        from . import launch

        if launch.same_stop():
            return
        launch.note_stop()
        self.signum = signum
        raise _Interrupted(signum)

    def __enter__(self) -> _CtrlC:
        import signal
        import threading

        from . import launch

        launch.forget_stops()       # (an in-process caller's earlier command may have stopped on one)
        if threading.current_thread() is threading.main_thread():
            for signum, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
                if signal.getsignal(signum) is default:
                    self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc) -> bool:
        import signal

        ending = self.process and self.status is not None and self.status > 128
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if ending else handler)
        return False


def _interrupted(command: str | None, signum: int | None) -> int:
    """One line for a stop signal outside the training steps (no traceback), and the status a shell
    expects (128 + the signal's number)."""
    import signal

    signum = signal.SIGINT if signum is None else signum
    how = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
    _report(f"pdpfast{' ' + command if command else ''}: interrupted{how}")
    return 128 + signum


def _report(line: str) -> None:
    """Print the line that ends the command (an error, an interruption) on stderr; in a rank of
    ``train --nproc``, hand it to the launcher, which prints rank 0's and those of other ranks that
    differ from it (every rank reads the same inputs, so most errors are the same on all)."""
    from . import launch

    if not launch.report_ending(line):
        print(line, file=sys.stderr)


@contextlib.contextmanager
def _warnings_as_lines(args, shown: bool = True):
    """Warnings the API raises while the block runs, printed as they come, one line each
    (``pdpfast <command>: warning: ...``, in the options' words) rather than as Python's file:line report;
    ``shown=False`` (ranks other than 0 of ``train --nproc``, whose rank 0 warns the same) drops them."""
    from ._options import warnings_as_lines

    with warnings_as_lines(build_parser(), args, f"pdpfast {args.command}", shown):
        yield


def _method_names(values, default, known) -> tuple:
    """--methods as given (words, comma-separated or not: ``_options.method_words``), or ``default``
    when not given."""
    from ._options import method_words
    from .demo import check_method_names

    if values is None:
        return tuple(default)
    return check_method_names("--methods", method_words(values, known), known)


def _output_directory(out: str, names, what: str) -> Path:
    """Check --out (a directory) and the files a command will write into it, before any work."""
    from ._io import check_output_path

    directory = Path(out)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--out {out!r} is a file; give a directory for {what}")
    for name in names:
        check_output_path(directory / name, "--out")
    return directory


# ---------------------------------------------------------------------------------------------- demo
def _demo(args) -> int:
    from .demo import (
        DELTA,
        GROUP_EPSILONS,
        GROUP_FRACTIONS,
        METHODS,
        format_results,
        results_json,
        run_demo,
        save_plots,
    )
    from .plots import Staging

    if args.adaptive:
        return _demo_adaptive(args)
    methods = _method_names(args.methods, METHODS, METHODS)
    if args.rounds is not None and "pdp" not in methods:
        raise ValueError("--rounds is for PDP-SGD (method pdp), which --methods does not include")
    rounds, accountant = (2 if args.rounds is None else args.rounds), (args.accountant or "rdp")
    for name, value in (("epochs", args.epochs), ("seeds", args.seeds), ("rounds", rounds),
                        ("batch-size", args.batch_size)):
        if value <= 0:
            raise ValueError(f"--{name} must be a positive integer, got {value}")
    out = _output_directory(args.out, ("accuracy.png", "epsilon.png", "results.json"), "the plots and results.json")
    print(f"pdpfast demo: digits, privacy groups "
          f"{', '.join(f'{f:.0%} at ε={e:g}' for f, e in zip(GROUP_FRACTIONS, GROUP_EPSILONS))}, δ={DELTA:g}; "
          f"{args.epochs} epochs, {args.seeds} seed(s)" + (f", PDP-SGD in {rounds} rounds" if "pdp" in methods
                                                            else ""), flush=True)
    start = time.perf_counter()
    with _warnings_as_lines(args):
        results = run_demo(epochs=args.epochs, seeds=tuple(range(args.seeds)), methods=methods,
                           progress=not args.quiet, rounds=rounds, threads=args.threads, lr=args.lr,
                           batch_size=args.batch_size, accountant=accountant)
    print(format_results(results))
    with Staging() as staging:
        accuracy_png, epsilon_png, summary = (out / "accuracy.png", out / "epsilon.png", out / "results.json")
        save_plots(results, staging.path(accuracy_png), staging.path(epsilon_png))
        Path(staging.path(summary)).write_text(json.dumps(results_json(results), indent=1))
        staging.commit()
    print(f"plots: {accuracy_png}, {epsilon_png}; results: {summary}; total {time.perf_counter() - start:.0f}s")
    return 0


def _demo_adaptive(args) -> int:
    from .demo import METHODS as DEMO_METHODS
    from .demo_adaptive import METHODS, VARIANTS, adaptive_json, format_adaptive, run_adaptive_demo, save_adaptive_plot
    from .plots import Staging

    if args.methods is not None:
        from ._options import method_words

        without = [m for m in method_words(args.methods, DEMO_METHODS) if m in DEMO_METHODS and m not in METHODS]
        if without:
            raise ValueError(f"--methods: {', '.join(without)} {'has' if len(without) == 1 else 'have'} no adaptive "
                             f"variant; with --adaptive choose from {', '.join(METHODS)}")
    methods = _method_names(args.methods, METHODS, METHODS)
    if args.rounds is not None:
        raise ValueError("--rounds is for PDP-SGD, which --adaptive does not run")
    if args.accountant is not None:
        raise ValueError("--accountant is not read by --adaptive, whose plans are calibrated with RDP")
    for name, value in (("epochs", args.epochs), ("seeds", args.seeds), ("batch-size", args.batch_size)):
        if value <= 0:
            raise ValueError(f"--{name} must be a positive integer, got {value}")
    out = _output_directory(args.out, ("adaptive.png", "adaptive.json"), "the plot and adaptive.json")
    print(f"pdpfast demo --adaptive: digits, ε = 1/2/3; {', '.join(methods)} × {', '.join(VARIANTS)}; "
          f"{args.epochs} epochs, {args.seeds} seed(s)", flush=True)
    start = time.perf_counter()
    with _warnings_as_lines(args):
        runs = run_adaptive_demo(epochs=args.epochs, seeds=tuple(range(args.seeds)), methods=methods, lr=args.lr,
                                 batch_size=args.batch_size, threads=args.threads, progress=not args.quiet)
    print(format_adaptive(runs))
    with Staging() as staging:
        png, summary = out / "adaptive.png", out / "adaptive.json"
        save_adaptive_plot(runs, staging.path(png))
        Path(staging.path(summary)).write_text(json.dumps(adaptive_json(runs), indent=1))
        staging.commit()
    print(f"plot: {png}; results: {summary}; total {time.perf_counter() - start:.0f}s")
    return 0


# ---------------------------------------------------------------------------------------------- audit
def _audit(args) -> int:
    from .audit import AUDITED_METHODS, format_table, plot, run_audit
    from .demo import GROUP_EPSILONS
    from .plots import Staging

    methods = _method_names(args.methods, AUDITED_METHODS, AUDITED_METHODS)
    if args.epochs <= 0:
        raise ValueError("--epochs must be a positive integer")
    if args.canaries < 2 * len(GROUP_EPSILONS):
        raise ValueError(f"--canaries must be at least {2 * len(GROUP_EPSILONS)} (2 per privacy group), "
                         f"got {args.canaries}")
    out = _output_directory(args.out, ("audit.json", "audit.png"), "audit.json and audit.png")
    if not args.quiet:
        print(f"pdpfast audit: digits, groups at ε = 1/2/3, δ = 1e-5, {args.canaries} canaries, "
              f"methods {', '.join(methods)}", flush=True)
    result = run_audit(methods=methods, canaries_count=args.canaries, epochs=args.epochs, seed=args.seed,
                       confidence=args.confidence, quiet=args.quiet, threads=args.threads)
    print(format_table(result))
    over = [r for r in result["rows"]
            if r["certified_epsilon"] is not None and r["epsilon_lower_bound"] > r["certified_epsilon"]]
    with Staging() as staging:
        plot(result, staging.path(out / "audit.png"))
        Path(staging.path(out / "audit.json")).write_text(json.dumps(result, indent=1))
        staging.commit()
    print(f"results: {out / 'audit.json'}, plot: {out / 'audit.png'}; {result['seconds']:.0f}s")
    if over:
        print("pdpfast audit: the empirical lower bound exceeds the certified ε for "
              + ", ".join(f"{r['method']} ε={r['group_budget']:g}" for r in over)
              + ": the training does not give the guarantee it claims", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------- train
def _train(args) -> int:
    import warnings

    from . import launch
    from .train import TrainConfig, check_data_parallel, run

    if args.hybrid_weight is not None and args.method != "hybrid":
        raise ValueError(f"--hybrid-weight is for --method hybrid (this is --method {args.method})")
    pdp_only = {"--rounds": args.rounds, "--pdp-loss": args.pdp_loss, "--pdp-charge": args.pdp_charge}
    given = [name for name, value in pdp_only.items() if value is not None]
    if given and args.method != "pdp":
        raise ValueError(f"{', '.join(given)}: for --method pdp (PDP-SGD's rounds) only; this is "
                         f"--method {args.method}")
    if args.nproc < 1:
        raise ValueError(f"--nproc must be ≥ 1, got {args.nproc}")
    fields = TrainConfig.__dataclass_fields__
    settings = {k: v for k, v in vars(args).items() if k in fields and k != "log"}
    cfg = TrainConfig(**{k: v for k, v in settings.items() if v is not None or k not in ("rounds", "pdp_loss",
                                                                                           "pdp_charge")})
    rank = launch.launched_rank()
    if rank is not None:
        launch.follow_launcher()
    elif args.nproc > 1:
        outer = launch.outer_launcher()
        if outer is not None:
            raise ValueError(f"--nproc {args.nproc} inside a job of several processes ({outer} in the environment, "
                             "e.g. under torchrun): give the number of processes to that launcher and drop --nproc, "
                             "or unset WORLD_SIZE, RANK and LOCAL_RANK")
        with warnings.catch_warnings():     # rank 0 gives each warning in its own words
            warnings.simplefilter("ignore")
            check_data_parallel(cfg)        # once, here, before any process starts
        return launch.run_ranks(_ARGV, args.nproc, args.threads)
    with _warnings_as_lines(args, shown=not rank):
        run(cfg)    # checks every output path before it loads the data
    return 0


# ---------------------------------------------------------------------------------------------- calibrate
def _calibrate(args) -> int:
    import warnings

    import numpy as np

    import pdpfast

    from . import plots
    from ._checks import check_positive_integer, large_delta_message
    from ._io import check_output_path, check_outputs_spare_inputs
    from .datasets import read_budgets

    plot = Path(args.plot) if args.plot else Path(args.out).with_suffix(".png")
    outputs = {"--out": check_output_path(args.out, "--out"), "--plot": check_output_path(plot, "--plot")}
    plots.check_image_path(plot, "--plot")      # the suffix picks the format: checked before calibrating
    if outputs["--out"] == outputs["--plot"]:
        raise ValueError("--out and --plot name the same file; give each its own path")
    check_outputs_spare_inputs(outputs, {"budgets": args.budgets})
    if args.sample_rate is not None and args.batch_size is not None:
        raise ValueError("give one of --sample-rate and --batch-size, not both (each sets q)")
    for option, value in (("--batch-size", args.batch_size), ("--steps", args.steps), ("--epochs", args.epochs),
                          ("--max-rows", args.max_rows)):
        if value is not None:
            check_positive_integer(option, value)
    if args.hybrid_weight is not None and args.method != "hybrid":
        raise ValueError(f"--hybrid-weight is for --method hybrid (this is --method {args.method})")
    if args.column is not None and Path(args.budgets).suffix.lower() not in (".csv", ".npz"):
        raise ValueError(f"--column names a column of a .csv or an array of a .npz; {args.budgets!r} is neither")
    budgets = read_budgets(args.budgets, column=args.column, column_option="--column")
    too_large = large_delta_message(args.delta, budgets.shape[0], "--delta") if 0 < args.delta < 1 else None
    if too_large:
        print(f"pdpfast calibrate: warning: {too_large}", file=sys.stderr)
    if args.sample_rate is None:
        if args.batch_size is None:
            raise ValueError("give --sample-rate q (expected batch / N) or --batch-size B")
        sample_rate = min(1.0, args.batch_size / budgets.shape[0])
        if args.batch_size > budgets.shape[0]:
            print(f"pdpfast calibrate: warning: --batch-size {args.batch_size} exceeds the {budgets.shape[0]} records: "
                  "the sampling rate is capped at q = 1", file=sys.stderr)
    else:
        sample_rate = args.sample_rate
    if (args.steps is None) == (args.epochs is None):
        raise ValueError("give exactly one of --steps and --epochs")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"--sample-rate must lie in (0, 1], got {sample_rate!r}")
    steps = args.steps if args.steps is not None else args.epochs * max(1, round(1 / sample_rate))
    # a header before the work: PLD calibration of 10⁵–10⁶ records takes minutes (README, "Calibration")
    print(f"pdpfast calibrate: {budgets.shape[0]} records, {np.unique(budgets).size} distinct budgets; "
          f"--method {args.method}, --accountant {args.accountant}, {steps} steps at q = {sample_rate:.4g}", flush=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = pdpfast.calibrate(budgets, delta=args.delta, steps=steps, sample_rate=sample_rate,
                                 method=args.method, max_grad_norm=args.max_grad_norm,
                                 hybrid_weight=args.hybrid_weight,
                                 accountant=args.accountant)
    for w in caught:
        print(f"pdpfast calibrate: warning: {' '.join(str(w.message).split())}", file=sys.stderr)
    if sample_rate == 1.0:
        from .train import UNDER_SPENDING_AT_RATE_ONE, under_spending_groups

        groups = under_spending_groups(budgets, plan.epsilons())
        if groups:
            print(f"pdpfast calibrate: warning: {UNDER_SPENDING_AT_RATE_ONE.format(groups=groups)}", file=sys.stderr)
    print(plan.summary(max_rows=args.max_rows))
    eps = plan.epsilons()
    print(f"every record's guaranteed ε ≤ its budget: {bool(np.all(eps <= budgets))} "
          f"(largest ratio {float(np.max(eps / budgets)):.4f})")
    with plots.Staging() as staging:
        Path(staging.path(args.out)).write_text(plan.to_json())
        plots.plan_histograms(plan, staging.path(plot))
        staging.commit()
    print(f"plan: {args.out}; histograms of q_i and c_i: {plot}")
    return 0


# ---------------------------------------------------------------------------------------------- bench
def _import_bench(module: str, roots=None):
    """bench/ lives in the source checkout, not in the installed package: look in the working
    directory and next to the pdpfast package (or in ``roots``)."""
    import importlib

    candidates = [Path.cwd(), Path(__file__).resolve().parent.parent] if roots is None else [Path(r) for r in roots]
    for root in candidates:
        if (root / "bench" / "__init__.py").is_file() and str(root) not in sys.path:
            sys.path.insert(0, str(root))
    try:
        return importlib.import_module(f"bench.{module}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "bench":
            raise RuntimeError("the benchmarks (bench/) are part of the source checkout, not of the installed package: "
                               "run `pdpfast bench` from the repository root") from None
        raise


class _NamingOutput:
    """stdout with the staging file's name replaced by the one the user gave: the benchmark prints
    where it wrote its JSON, which under ``pdpfast bench`` is a temporary file moved into place."""

    def __init__(self, stream, staged: str, final: str):
        self.stream, self.staged, self.final = stream, staged, final

    def write(self, text: str) -> int:
        return self.stream.write(text.replace(self.staged, self.final))

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _bench(args) -> int:
    import torch

    from . import plots
    from ._checks import check_positive_integer
    from ._io import check_output_path

    suite = args.suite
    if suite == "auto":
        suite = "e2e" if torch.cuda.is_available() else "cpu"
    e2e_only = {"--device": args.device, "--size": args.size, "--dtype": args.dtype}
    if suite == "cpu" and any(v is not None for v in e2e_only.values()):
        given = ", ".join(k for k, v in e2e_only.items() if v is not None)
        raise ValueError(f"{given}: for the end-to-end suite (--suite e2e) only; this is the CPU suite")
    device, size, dtype = args.device or "cuda", args.size or "full", args.dtype or "fp32"
    if suite == "e2e" and device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the end-to-end benchmark needs a CUDA device (none here); use --suite cpu, or "
                           "--device cpu --size micro for a smoke test")
    if suite == "e2e":
        from .train import resolve_device

        resolve_device(device)
    if args.repeats is not None:
        check_positive_integer("--repeats", args.repeats)
    out = Path(args.out or f"bench/results/cli_{suite}.json")
    plot = Path(args.plot) if args.plot else out.with_suffix(".png")
    if check_output_path(out, "--out") == check_output_path(plot, "--plot"):
        raise ValueError("--out and --plot name the same file; give each its own path")
    plots.check_image_path(plot, "--plot")     # its suffix picks the format: refused now, not after the run
    with plots.Staging() as staging:
        tmp_json = staging.path(out)
        module = _import_bench("bench_cpu" if suite == "cpu" else "bench_e2e")
        known = tuple(module.CONFIGS) if suite == "cpu" else module.MODELS
        unknown = [m for m in (args.models or "").split(",") if m and m not in known]
        if unknown:
            raise ValueError(f"--models: unknown {', '.join(unknown)} for the {suite} suite; choose from "
                             f"{', '.join(known)}")
        if suite == "cpu":
            argv = ["--repeats", str(args.repeats or 15), "--out", tmp_json]
            if args.models:
                argv += ["--models", args.models]
            with contextlib.redirect_stdout(_NamingOutput(sys.stdout, str(tmp_json), str(out))):
                rc = module.main(argv)
            key, title = "time_ratio_vs_nonprivate", "step time × non-private (CPU; lower is better)"
        else:
            argv = ["--repeats", str(args.repeats or 20), "--out", tmp_json, "--device", device, "--size", size,
                    "--dtype", dtype]
            if args.models:
                argv += ["--models", args.models]
            with contextlib.redirect_stdout(_NamingOutput(sys.stdout, str(tmp_json), str(out))):
                rc = module.main(argv)
            key, title = "throughput_ratio_vs_nonprivate", "throughput × non-private (higher is better)"
        if rc not in (None, 0):
            raise RuntimeError(f"bench.{module.__name__.split('.')[-1]} exited with status {rc}")
        rows = json.loads(Path(tmp_json).read_text())
        if rows:
            title = f"{title}\n{rows[0].get('device', '')}"
        plots.bench_ratios(rows, staging.path(plot), key=key, title=title)
        staging.commit()
    print(f"results: {out}; plot: {plot}")
    return 0


# ---------------------------------------------------------------------------------------------- info, fl
def _info(args) -> int:
    from .info import report

    print(report())
    return 0


def _add_fl(sub) -> None:
    """``pdpfast fl ...`` from pdpfast.fl.cli when it imports; otherwise a stub that says why."""
    try:
        from .fl import cli as fl_cli

        fl_cli.add_subparser(sub)
    except Exception as exc:  # noqa: BLE001 — any import problem is reported when `fl` is used
        reason = f"{type(exc).__name__}: {exc}"
        fl = sub.add_parser("fl", help="federated learning with record-level budgets (unavailable here)",
                            add_help=False)
        fl.add_argument("rest", nargs=argparse.REMAINDER)

        def unavailable(args, reason=reason):
            raise RuntimeError(f"the federated front end could not be loaded ({' '.join(reason.split())})")

        fl.set_defaults(run=unavailable)


# ---------------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    """The command line.

    Returns:
        the ``pdpfast`` argument parser, with every subcommand.
    """
    from .demo import METHODS as DEMO_METHODS
    from .models import model_names
    from .train import METHODS, TrainConfig

    d = TrainConfig()
    parser = _Parser(prog="pdpfast", description="Individualized differential privacy for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser("demo", help="individualized DP-SGD vs DP-SGD vs PDP-SGD vs non-private on digits",
                          description="Trains non-private, DP-SGD at ε=1, IDP Sample / Scale / hybrid and PDP-SGD on "
                                      "scikit-learn's digits (groups 34%/43%/23% at ε=1/2/3, δ=1e-5); prints a "
                                      "table and writes accuracy.png, epsilon.png and results.json into --out.")
    demo.add_argument("--epochs", type=int, default=10, help="training epochs per method (default 10)")
    demo.add_argument("--seeds", type=int, default=3, help="number of seeds to average over (default 3)")
    # --methods, --rounds and --accountant default to None so that --adaptive can tell them given
    demo.add_argument("--methods", nargs="+",
                      help=f"private methods, each once, as words or comma-separated (default "
                           f"{' '.join(DEMO_METHODS)}; with --adaptive: sample scale hybrid)")
    demo.add_argument("--rounds", type=int, help="PDP-SGD rounds (default 2; needs pdp in --methods)")
    demo.add_argument("--accountant", choices=("rdp", "pld"),
                      help="accountant that calibrates the dpsgd/sample/scale/hybrid plans (default rdp; not "
                           "with --adaptive)")
    demo.add_argument("--batch-size", type=int, default=128, help="expected batch size (default 128)")
    demo.add_argument("--lr", type=float, default=0.2, help="private learning rate (non-private uses lr/5)")
    demo.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's default)")
    demo.add_argument("--out", default="demo_out", help="directory for the plots and results.json")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.add_argument("--adaptive", action="store_true",
                      help="instead: fixed vs adaptive (quantile) clipping and fixed vs decaying noise for IDP "
                           "Sample / Scale / hybrid; writes adaptive.png and adaptive.json into --out")
    demo.set_defaults(run=_demo)

    train = sub.add_parser("train", help="private training on your data with per-record budgets",
                           description="Train a model on CSV / NumPy / image-folder / Hugging Face data with "
                                       "per-record privacy budgets.")
    g = train.add_argument_group("data")
    g.add_argument("--data", help="file.csv, x.npy (with --labels), data.npz (x, y[, budgets]) or an image folder")
    g.add_argument("--labels", help="labels .npy for --data x.npy")
    g.add_argument("--hf-dataset", help="a Hugging Face dataset name (needs the `datasets` package)")
    g.add_argument("--hf-split", help="split of --hf-dataset (default train)")
    g.add_argument("--hf-config", help="configuration of --hf-dataset")
    g.add_argument("--label-column", help="CSV / HF label column")
    g.add_argument("--text-column", help="text column, tokenized for bert/gpt2/llama (hashing tokenizer by default)")
    g.add_argument("--tokenizer", help="a Hugging Face tokenizer name for --text-column (may download)")
    g.add_argument("--tokens", action="store_true",
                   help="feature columns are integer token ids (implied by bert/gpt2/llama)")
    g.add_argument("--max-length", type=int, help="tokens per text (default 64; text data only)")
    g.add_argument("--image-shape", help="view flat features as images C,H,W (e.g. 1,8,8) for cnn, resnet18-gn, vit")
    g.add_argument("--image-size", type=int, default=d.image_size, help="image folders are resized to this (32)")
    g.add_argument("--test-fraction", type=float, default=d.test_fraction,
                   help="held-out fraction for evaluation (default 0.2; 0 = none)")
    g = train.add_argument_group("budgets")
    g.add_argument("--budget-column", help="CSV / HF column with each record's ε")
    g.add_argument("--budgets", help="budgets file: .npy, .npz (one array), .csv (one column), .txt (one per line); "
                                     "one per record in order: the data's rows, an --hf-dataset split's row order, "
                                     "an image folder's classes sorted by name, then its images sorted by path")
    g.add_argument("--epsilon", type=float, help="the same ε for every record")
    g.add_argument("--delta", type=float, default=d.delta,
                   help=f"δ of every record's (ε, δ) guarantee, well below 1/N (default {d.delta:g})")
    g = train.add_argument_group("model and method")
    g.add_argument("--model", default=d.model, choices=model_names(), metavar="MODEL",
                   help=f"one of {', '.join(model_names())} (default mlp)")
    g.add_argument("--hidden", help="mlp hidden widths, comma-separated (default 128; --model mlp only)")
    g.add_argument("--method", default=d.method, choices=METHODS,
                   help="sample | scale | hybrid (individualized DP-SGD), dpsgd (min ε for everyone), pdp (PDP-SGD)")
    g.add_argument("--clipping", default=d.clipping, choices=("flat", "per_layer"))
    g.add_argument("--mode", default=d.mode, choices=("bk", "ghost"))
    g.add_argument("--hybrid-weight", type=float,
                   help="λ of --method hybrid (0 = Scale, 1 = Sample; default 0.5)")
    g.add_argument("--accountant", default=d.accountant, choices=("rdp", "pld"))
    g.add_argument("--rounds", type=int, help=f"PDP-SGD rounds (default {d.rounds}; --method pdp only)")
    g.add_argument("--pdp-loss", choices=("fixed", "adaptive", "harmonic"),
                   help=f"PDP-SGD threshold loss: fixed weights (default: {d.pdp_loss}), adaptive (balanced normalized "
                        "wastes) or the paper's harmonic form (degenerate: always the smallest budget)")
    g.add_argument("--pdp-charge", choices=("all", "sampled"),
                   help=f"PDP-SGD charging rule: all (default: {d.pdp_charge}) or sampled (the paper's)")
    g = train.add_argument_group("optimization")
    g.add_argument("--epochs", type=int, default=d.epochs,
                   help=f"expected passes over the data: steps = epochs × round(1/q) (default {d.epochs})")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="expected batch size (Poisson)")
    g.add_argument("--physical-batch-size", type=int, help="memory cap per physical batch (draws are split)")
    g.add_argument("--cuda-graph", action="store_true",
                   help="capture the step in CUDA graphs and replay it (needs CUDA and --physical-batch-size)")
    g.add_argument("--precision", default=d.precision, choices=("fp32", "bf16"),
                   help="bf16: forward and backward under torch.autocast(bfloat16), weights, norms and clip weights "
                        "in fp32; clip bounds keep a per-record rounding bound (README, 'Mixed precision')")
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--momentum", type=float, help="SGD's momentum (default 0.9; --optimizer sgd only)")
    g.add_argument("--optimizer", default=d.optimizer, choices=("sgd", "adam"))
    g.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm, help="reference clip norm C")
    g.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the train/test split and the model's initialization (default 0)")
    g.add_argument("--noise-seed", type=int,
                   help="seed of the Poisson draws and the noise (default: a secret one from os.urandom, kept in the "
                        "checkpoint). Give one only to reproduce a run: whoever knows it can recompute the draws and "
                        "the noise, and so remove it")
    g.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when present, else cpu)")
    g.add_argument("--threads", type=int, help="torch threads")
    g.add_argument("--nproc", type=int, default=1,
                   help="data-parallel processes on this machine, one per rank (gloo on CPU, NCCL on GPUs: one GPU "
                        "each); the draws, noise and ledger equal a one-process run's with the same --seed and "
                        "--noise-seed, and the model too, to float rounding, when it has no dropout")
    g = train.add_argument_group("checkpoints and output")
    g.add_argument("--checkpoint", help="checkpoint path (model, optimizer, privacy ledger); an existing one is "
                                        "refused unless --resume or --overwrite")
    g.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every N steps")
    g.add_argument("--resume", help="continue from this checkpoint (same data, budgets and settings)")
    g.add_argument("--overwrite", action="store_true",
                   help="start afresh over an existing --checkpoint (its ledger is replaced)")
    g.add_argument("--stop-after-steps", type=int,
                   help="stop after N steps of this invocation (resumably with --checkpoint)")
    g.add_argument("--out-json", help="write a summary (test metrics, ε per group) as JSON")
    g.add_argument("--save-model", help="write the trained model's weights alone (a torch state_dict) once training "
                                        "ends: what to publish. The checkpoint is secret: it holds the noise seeds "
                                        "and hashes of the data")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(run=_train)

    cal = sub.add_parser("calibrate", help="budgets → per-record sample rates, clip norms and σ (a plan)",
                         description="Turn a budgets file into a PrivacyPlan: prints its summary per group, writes "
                                     "the plan as JSON and a histogram of q_i and c_i as PNG.")
    cal.add_argument("budgets", help="budgets file: .npy, .npz, .csv (one column or --column), .txt (one per line)")
    cal.add_argument("--column", help="CSV column (or .npz array) holding the budgets")
    cal.add_argument("--delta", type=float, default=1e-5,
                     help="δ of every record's (ε, δ) guarantee, well below 1/N (default 1e-05)")
    cal.add_argument("--steps", type=int, help="training steps the plan covers (or --epochs)")
    cal.add_argument("--epochs", type=int, help="expected passes over the data: steps = epochs × round(1/q)")
    cal.add_argument("--sample-rate", type=float, help="mean Poisson rate q (expected batch / N)")
    cal.add_argument("--batch-size", type=int, help="expected batch size (sets q = B / N)")
    cal.add_argument("--method", default="sample", choices=("sample", "scale", "hybrid"))
    cal.add_argument("--hybrid-weight", type=float, help="λ of --method hybrid (0 = scale, 1 = sample; default 0.5)")
    cal.add_argument("--max-grad-norm", type=float, default=1.0)
    cal.add_argument("--accountant", default="rdp", choices=("rdp", "pld"))
    cal.add_argument("--out", default="plan.json", help="the plan as JSON (default plan.json)")
    cal.add_argument("--plot", help="histogram PNG (default: --out with .png)")
    cal.add_argument("--max-rows", type=int, default=20, help="groups shown in the summary")
    cal.set_defaults(run=_calibrate)

    bench = sub.add_parser("bench", help="step time / throughput vs non-private and Opacus (from a checkout)",
                           description="Runs bench.bench_cpu (CPU) or bench.bench_e2e (CUDA) from the source "
                                       "checkout; writes their JSON and a bar plot of the ratios to non-private.")
    bench.add_argument("--suite", default="auto", choices=("auto", "cpu", "e2e"),
                       help="auto: e2e when CUDA is present, else cpu")
    bench.add_argument("--models", help="cpu: transformer,cnn,resnet18 (default transformer,cnn); "
                                        "e2e: bert,resnet18,gpt2,gpt2-lora,vit (default all)")
    bench.add_argument("--repeats", type=int)
    bench.add_argument("--device", help="e2e only: cuda (default), cuda:N, or cpu for a smoke test")
    bench.add_argument("--size", choices=("full", "tiny", "micro"), help="e2e only (default full)")
    bench.add_argument("--dtype", choices=("fp32", "bf16"), help="e2e only (default fp32)")
    bench.add_argument("--out", help="JSON path (default bench/results/cli_<suite>.json)")
    bench.add_argument("--plot", help="PNG path (default: --out with .png)")
    bench.set_defaults(run=_bench)

    audit = sub.add_parser("audit", help="empirical privacy audit per privacy group (one training run)",
                           description="Steinke, Nasr & Jagielski's one-run audit on the demo's task: canaries per "
                                       "privacy group, one training run per method, an empirical lower bound on ε "
                                       "per group (it must stay below the group's certified ε).")
    audit.add_argument("--methods", nargs="+",
                       help="each once, as words or comma-separated, from sample scale hybrid dpsgd non-private "
                            "(default: all)")
    audit.add_argument("--canaries", type=int, default=3000, help="number of canaries (default 3000)")
    audit.add_argument("--epochs", type=int, default=10, help="training epochs per method (default 10)")
    audit.add_argument("--confidence", type=float, default=0.95, help="of the lower bounds (default 0.95)")
    audit.add_argument("--seed", type=int, default=0, help="seed of the canaries, the split, the model and the noise "
                                                           "(default 0)")
    audit.add_argument("--threads", type=int,
                       help="torch threads (default: torch's own; 1 is far faster on a machine other jobs load)")
    audit.add_argument("--out", default="audit_out", help="directory for audit.json and audit.png")
    audit.add_argument("--quiet", action="store_true", help="no progress bars")
    audit.set_defaults(run=_audit)

    info = sub.add_parser("info", help="which implementation each op uses, and why")
    info.set_defaults(run=_info)
    _add_fl(sub)
    return parser


_ARGV: list[str] = []  # the command line main() parsed (--nproc runs it again in each rank: pdpfast.launch)


def main(argv: list[str] | None = None) -> int:
    """``pdpfast``, the command.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
    Returns:
        the exit status (0: success).
    """
    global _ARGV
    _ARGV = list(sys.argv[1:] if argv is None else argv)
    with _CtrlC(process=argv is None) as ctrl_c:
        ctrl_c.status = _main(argv, ctrl_c)
    return ctrl_c.status


def _main(argv: list[str] | None, ctrl_c: _CtrlC) -> int:
    from . import launch

    command = _ARGV[0] if _ARGV and not _ARGV[0].startswith("-") else None
    try:
        launch.accept_stops()      # a rank of --nproc: a Ctrl-C handed on while it started arrives here
        parser = build_parser()    # imports torch: a Ctrl-C often lands here
        args = parser.parse_args(argv)
        from .train import TrainingInterrupted
    except SystemExit as exc:      # --help, or a usage error already printed as one line
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_ERROR
    except KeyboardInterrupt as exc:
        return _interrupted(command, getattr(exc, "signum", None))
    except Exception:
        if ctrl_c.signum is not None:   # an import the signal broke into
            return _interrupted(command, ctrl_c.signum)
        raise
    run = getattr(args, "run", None) or getattr(args, "func", None)
    try:
        with _warnings_as_lines(args) if args.command == "fl" else contextlib.nullcontext():
            rc = run(args)
        return 0 if rc is None else int(rc)
    except TrainingInterrupted as exc:      # stopped after a whole step, final checkpoint written
        _report(f"pdpfast {args.command}: {exc}")
        return 128 + exc.signum
    except KeyboardInterrupt as exc:   # before training started, or a second Ctrl-C (the last checkpoint stands)
        return _interrupted(args.command, getattr(exc, "signum", None))
    except (ValueError, TypeError, KeyError, OSError, ImportError, RuntimeError, FloatingPointError) as exc:
        if ctrl_c.signum is not None:
            return _interrupted(args.command, ctrl_c.signum)
        if os.environ.get("PDPFAST_DEBUG"):
            raise
        return _fail(args.command, exc, parser, args)


if __name__ == "__main__":
    sys.exit(main())
