"""Command line of the federated front end: ``pdpfast fl <command>`` (or ``python -m pdpfast.fl
<command>``).

* ``simulate``: rPDP-FL and the baselines in process; prints an accuracy table, writes
  ``<out>.json`` and a plot of accuracy per round ``<out>.png``.
* ``flower``: the same run through Flower: its server loop with the clients called in process
  (``--engine inprocess``), or its Ray simulation engine (``--engine ray``, needs Ray).
* ``server`` / ``client``: one Flower server or client process (gRPC).
* ``launch``: one server and M client processes on 127.0.0.1, bounded in time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from .budgets import distributions
from .config import CONVERSIONS, PRIVATE_FIELDS, THREATS, FLConfig
from .datasets import SPLITS, datasets
from .methods import METHODS

_HELP = {
    "rounds": "T, communication rounds", "local_steps": "τ, local DP-SGD steps per sampled client and round",
    "client_rate": "λ ∈ (0, 1], probability that a round samples a client", "noise_multiplier": "σ",
    "max_grad_norm": "C, clip bound", "delta": "δ of every record", "lr": "local SGD learning rate",
    "threat": "threat model the sampling rates are calibrated for", "conversion": "RDP → (ε, δ) conversion",
    "mode": "engine clipping schedule (bk, ghost)", "clipping": "flat or per_layer",
    "seed": "public seed: model initialization, split and budget draws (not the client sampling nor the noise)",
    "method": "rPDP-FL or a baseline",
}
_NOISE_SEED_HELP = ("the clients' secret seed of their noise and record draws (default: each client draws its own "
                    "from os.urandom). Given, the run is reproducible bit for bit, but whoever knows it can "
                    "recompute the noise and remove it from the updates: only for experiments")
_SAMPLING_SEED_HELP = ("the server's secret seed of the client sampling (default: a fresh one from os.urandom). Given, "
                       "the sampling is reproducible, but whoever knows it knows which rounds every client took part "
                       "in, and the 'clients' epsilon does not hold against them: only for experiments")
_CHOICES = {"method": tuple(METHODS), "threat": THREATS, "conversion": CONVERSIONS, "mode": ("bk", "ghost"),
            "clipping": ("flat", "per_layer")}   # the engine's (FLConfig checks against it)
# settings only the private methods read: the nonprivate baseline trains without budgets, clipping,
# noise or a ledger, and samples clients with no privacy claim. Every command parses them with no
# default, to tell one the user gave from none.
_PRIVATE_ONLY = ("budgets", *PRIVATE_FIELDS, "noise_seed", "ledger")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(FLConfig)} | {"budgets": "ThreeLevels", "noise_seed": None,
                                                                        "ledger": None}


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="digits", choices=datasets())
    parser.add_argument("--clients", type=int, default=5, help="M, number of clients (silos)")
    parser.add_argument("--split", default="iid", choices=SPLITS, help="how records are split across clients")
    parser.add_argument("--dirichlet-alpha", type=float, help="α of --split dirichlet (default 0.5)")
    parser.add_argument("--budgets", default=_DEFAULTS["budgets"], choices=distributions(),
                        help="per-record budget distribution")


def _add_config_args(parser: argparse.ArgumentParser, skip=()) -> None:
    for f in dataclasses.fields(FLConfig):
        if f.name in skip:
            continue
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                            choices=_CHOICES.get(f.name), help=f"{_HELP.get(f.name, '')} (default {f.default})")


def _config(args, **override) -> FLConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(FLConfig) if hasattr(args, f.name)}
    return FLConfig(**(values | override))


def _data_kwargs(args) -> dict:
    alpha = args.dirichlet_alpha
    if alpha is not None and args.split != "dirichlet":
        raise ValueError(f"--dirichlet-alpha is for --split dirichlet (this is --split {args.split}, which does not "
                         "read it)")
    return dict(dataset=args.dataset, clients=args.clients, split=args.split,
                dirichlet_alpha=0.5 if alpha is None else alpha)


def format_table(rows: list[dict]) -> str:
    """The comparison table of ``fl simulate``.

    Args:
        rows: ``FederatedResult.summary()`` dicts, each with "seconds" added.
    Returns:
        a plain-text table, one line per row after the header.
    """
    head = ("method", "final acc", "best acc", "records trained", "max ε/budget clients", "max ε/budget server",
            "seconds")
    lines = [" | ".join(head), " | ".join("-" * len(h) for h in head)]
    for r in rows:
        ratio = lambda v: "∞ (no DP)" if v == float("inf") else f"{v:.7f}"  # noqa: E731
        lines.append(" | ".join([r["method"], f"{r['final_accuracy']:.3f}", f"{r['best_accuracy']:.3f}",
                                 f"{r['records_trained']}/{r['records']}", ratio(r["max_spent_fraction_clients"]),
                                 ratio(r["max_spent_fraction_server"]), f"{r['seconds']:.1f}"]))
    return "\n".join(lines)


def plot_accuracy(results: dict, path, title: str) -> None:
    """Plot test accuracy per round, one line per method.

    Args:
        results: {method: FederatedResult}.
        path: the image file to write.
        title: its title.
    Returns:
        None.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, res in results.items():
        ax.plot(range(len(res.accuracy)), res.accuracy, label=method)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    from ..plots import atomic_path

    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def _out_paths(out: str) -> tuple[Path, Path]:
    """(<out>.json, <out>.png): a name ending in .json or .png gives its stem, any other name is kept
    whole (``--out run_lr0.05`` writes run_lr0.05.json, not run_lr0.json)."""
    path = Path(out)
    if path.suffix.lower() in (".json", ".png"):
        path = path.with_suffix("")
    return path.with_name(path.name + ".json"), path.with_name(path.name + ".png")


def _private_only_given(args) -> None:
    """Refuse a privacy setting given to a run of the non-private baseline alone (it would be
    ignored; every command alike); fill the settings not given with their defaults."""
    names = [name for name in _PRIVATE_ONLY if hasattr(args, name)]
    given = [name for name in names if getattr(args, name) is not None]
    methods, flag = (args.methods, "--methods") if hasattr(args, "methods") else ([args.method], "--method")
    if given and not any(METHODS[m].private for m in methods):
        option, private = "--" + given[0].replace("_", "-"), ", ".join(m for m in METHODS if METHODS[m].private)
        raise ValueError(f"{option} is for the private methods ({private}); "
                         f"{flag} {' '.join(methods)} trains without budgets, clipping or noise")
    for name in names:
        if getattr(args, name) is None:
            setattr(args, name, _DEFAULTS[name])


def _simulate(args) -> int:
    from .._options import method_words
    from .simulation import _json_float, simulate

    args.methods = method_words(args.methods, METHODS)
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        raise ValueError(f"--methods: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(METHODS)}")
    twice = [m for m in dict.fromkeys(args.methods) if args.methods.count(m) > 1]
    if twice:
        raise ValueError(f"--methods lists {', '.join(twice)} more than once; each method runs once (one row, one "
                         "entry of the JSON)")
    _private_only_given(args)
    data = _data_kwargs(args)
    if args.out:     # checked before any work: a bad path fails in a second, not after the runs
        from .._io import check_output_path

        json_path, png_path = _out_paths(args.out)
        check_output_path(json_path, "--out")
        if not args.no_plot:
            check_output_path(png_path, "--out")
    from .config import draw_sampling_seed

    # the runs of the several methods sample the same clients (a secret seed drawn once, unless given)
    sampling_seed = draw_sampling_seed(args.sampling_seed)
    results, rows = {}, []
    for method in args.methods:
        config = _config(args, method=method)
        start = time.perf_counter()
        # without --noise-seed, every client of every method's run draws its own secret noise seed
        res = simulate(budgets=args.budgets, progress=not args.quiet, threads=args.threads, noise_seed=args.noise_seed,
                       sampling_seed=sampling_seed, **data, **{k: v for k, v in config.to_dict().items()})
        if args.sampling_seed is None:
            res.info["sampling_seed"] = "secret (os.urandom)"
        results[method] = res
        rows.append(res.summary() | {"seconds": time.perf_counter() - start})
    private = any(METHODS[m].private for m in args.methods)    # the baseline alone reads none of these
    title = (f"{args.dataset}, {args.clients} clients ({args.split})" + (f", {args.budgets}" if private else "")
             + f"; T={args.rounds}, τ={args.local_steps}, λ={args.client_rate}"
             + (f", σ={args.noise_multiplier}, δ={args.delta:g}" if private else ""))
    print(title)
    print(format_table(rows))
    if args.out:
        from ..plots import atomic_write_text

        argv = getattr(args, "argv", None)
        argv = sys.argv[1:] if argv is None else argv
        payload = {"title": title, "command": "python -m pdpfast.fl " + " ".join(argv),
                   "rows": [{k: _json_float(v) for k, v in r.items()} for r in rows],
                   "runs": {m: r.to_dict() for m, r in results.items()}}
        atomic_write_text(json_path, json.dumps(payload, indent=2))
        if not args.no_plot:
            plot_accuracy(results, png_path, title)
        print(f"wrote {json_path}" + ("" if args.no_plot else f" and {png_path}"))
    return 0


def _flower(args) -> int:
    from .flower import run_inprocess, run_ray_simulation

    _private_only_given(args)
    runner = run_ray_simulation if args.engine == "ray" else run_inprocess
    start = time.perf_counter()
    res = runner(budgets=args.budgets, config=_config(args), noise_seed=args.noise_seed,
                 sampling_seed=args.sampling_seed, **_data_kwargs(args))
    print(format_table([res.summary() | {"seconds": time.perf_counter() - start}]))
    return 0


def _server(args) -> int:
    from .flower import serve

    if args.budgets is not None:
        raise ValueError("--budgets is read by the clients (each rebuilds its records' budgets), not by the server: "
                         "give it to every client")
    _private_only_given(args)
    report = serve(args.address, config=_config(args), out=args.out, wait_timeout=args.wait_timeout,
                   sampling_seed=args.sampling_seed, **_data_kwargs(args))
    print(f"final accuracy {report['accuracy'][-1]:.4f}" if report["accuracy"] else "no evaluation")
    return 0


def _client(args) -> int:
    from .flower import run_client

    _private_only_given(args)
    report = run_client(args.address, args.client_id, budgets=args.budgets, config=_config(args), out=args.out,
                        max_wait_time=args.max_wait_time, ledger_path=args.ledger, noise_seed=args.noise_seed,
                        **_data_kwargs(args))
    print(json.dumps(report["stats"]))
    return 0


def _launch(args) -> int:
    from .flower import launch_local

    _private_only_given(args)
    out = launch_local(budgets=args.budgets, config=_config(args), timeout=args.timeout, noise_seed=args.noise_seed,
                       sampling_seed=args.sampling_seed, workdir=args.workdir, **_data_kwargs(args))
    server = out["server"]
    print(f"Flower on {out['address']}: {args.clients} client processes, {args.rounds} rounds; "
          f"accuracy per round {[round(a, 4) for a in server['accuracy']]}")
    for c in out["clients"]:
        print(json.dumps(c["stats"]))
    print(f"logs and outputs in {out['workdir']}")
    return 0


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Add the ``fl`` command to a parent command line.

    Args:
        subparsers: the parent parser's ``add_subparsers()`` result.
    Returns:
        the ``fl`` parser added there (with its own subcommands).
    """
    fl = subparsers.add_parser("fl", help="rPDP-FL: personalized DP in cross-silo federated learning",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _fill(fl)
    return fl


def _fill(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="fl_command", required=True)
    sim = sub.add_parser("simulate", help="in-process simulation of rPDP-FL and the baselines")
    _add_data_args(sim)
    _add_config_args(sim, skip=("method",))
    sim.add_argument("--methods", nargs="+", default=list(METHODS),
                     help=f"the runs, each method once, as words or comma-separated, from {' '.join(METHODS)} "
                          "(default all)")
    sim.add_argument("--noise-seed", type=int, help=_NOISE_SEED_HELP + "; the runs of several --methods then "
                                                                       "share it")
    sim.add_argument("--sampling-seed", type=int, help=_SAMPLING_SEED_HELP + "; the runs of several --methods share "
                                                                             "one, given or drawn")
    sim.add_argument("--out", help="write <out>.json and <out>.png (accuracy per round)")
    sim.add_argument("--no-plot", action="store_true")
    sim.add_argument("--quiet", action="store_true", help="no progress bars")
    sim.add_argument("--threads", type=int,
                     help="torch threads (default: torch's own setting; 0 = the same), restored afterwards; "
                          "the results do not depend on it beyond float rounding")
    # no default: a privacy setting given with --methods nonprivate alone is refused (_private_only_given)
    sim.set_defaults(run=_simulate, **dict.fromkeys(_PRIVATE_ONLY))

    flw = sub.add_parser("flower", help="the same run on Flower: its server loop with clients in process, "
                                        "or its Ray simulation engine")
    _add_data_args(flw)
    _add_config_args(flw)
    flw.add_argument("--engine", default="inprocess", choices=("inprocess", "ray"),
                     help="inprocess: Flower's Server, clients called directly; ray: flwr.simulation (needs Ray)")
    flw.add_argument("--noise-seed", type=int, help=_NOISE_SEED_HELP)
    flw.add_argument("--sampling-seed", type=int, help=_SAMPLING_SEED_HELP)
    flw.set_defaults(run=_flower, **dict.fromkeys(_PRIVATE_ONLY))

    srv = sub.add_parser("server", help="a Flower server process")
    _add_data_args(srv)
    _add_config_args(srv)
    srv.add_argument("--address", default="127.0.0.1:8080")
    srv.add_argument("--out", help="JSON report (and the final weights next to it as .npz)")
    srv.add_argument("--wait-timeout", type=float, default=120.0, help="seconds to wait for all clients")
    srv.add_argument("--sampling-seed", type=int, help=_SAMPLING_SEED_HELP)
    # the server has no noise seed: it is the clients' secret
    srv.set_defaults(run=_server, **dict.fromkeys(n for n in _PRIVATE_ONLY if n != "noise_seed"))

    cli = sub.add_parser("client", help="a Flower client process (one silo)")
    _add_data_args(cli)
    _add_config_args(cli)
    cli.add_argument("--address", default="127.0.0.1:8080")
    cli.add_argument("--client-id", type=int, required=True)
    cli.add_argument("--out", help="JSON report: per-record budgets and ε (kept on the client's side)")
    cli.add_argument("--max-wait-time", type=float, default=120.0, help="seconds to keep trying to connect")
    cli.add_argument("--ledger", help="the silo's ledger file (.npz): resumed if present, saved every round")
    cli.add_argument("--noise-seed", type=int, help=_NOISE_SEED_HELP.replace("each client draws its own", "drawn"))
    cli.set_defaults(run=_client, **dict.fromkeys(_PRIVATE_ONLY))

    lau = sub.add_parser("launch", help="a server and M client processes on 127.0.0.1")
    _add_data_args(lau)
    _add_config_args(lau)
    lau.add_argument("--timeout", type=float, default=300.0, help="kill everything after this many seconds")
    lau.add_argument("--noise-seed", type=int, help=_NOISE_SEED_HELP + "; passed to the client processes only")
    lau.add_argument("--sampling-seed", type=int, help=_SAMPLING_SEED_HELP + "; passed to the server process only")
    lau.add_argument("--workdir", help="directory for the processes' logs and JSON outputs, made if missing (default: "
                                       "a new temporary directory)")
    lau.set_defaults(run=_launch, **dict.fromkeys(_PRIVATE_ONLY))


def main(argv: list[str] | None = None) -> int:
    """``python -m pdpfast.fl``.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
    Returns:
        the exit status: 0 on success, 2 for a ValueError, TypeError, ImportError, RuntimeError or
        TimeoutError (printed to stderr: a bad setting, a missing package, a Flower process that failed
        or clients that did not connect in time).
    """
    parser = argparse.ArgumentParser(prog="python -m pdpfast.fl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _fill(parser)
    args = parser.parse_args(argv)
    args.argv = argv
    from .._options import as_option_words, warnings_as_lines

    try:
        with warnings_as_lines(parser, args, f"pdpfast fl {args.fl_command}"):
            return args.run(args)
    except (ValueError, TypeError, ImportError, RuntimeError, TimeoutError) as exc:
        print(f"pdpfast fl {args.fl_command}: error: {as_option_words(parser, args, str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
