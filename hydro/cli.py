"""The ``hydro`` command: tune, export, report, inspect and coord-check.

Models are named as ``module:callable`` (the callable returns an ``nn.Module``; for ``inspect``
also ``(model, args)``, ``(model, {kwargs})`` or ``(model, args, kwargs)``, for ``coord-check``
a ``(model, example_inputs)`` pair); the current directory is importable, as for ``python -m``.
Bad input exits with status 2 and a one-paragraph error, a study database that fails in use
(locked too long, read-only) with status 3 and one line; ``--debug`` shows the traceback.

This module imports only the standard library (and :mod:`hydro.errors`): ``hydro --help``, a
subcommand's ``--help`` and a mistyped argument answer at once, without loading torch, Optuna
or Ray; each ``cmd_*`` imports what it runs. The parser is :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hydro.collector import collector_paused
from hydro.errors import ConfigError, HydroError
from hydro.tuning.options import DEFAULT_STORAGE, TuneOptions
from hydro.tuning.signals import Terminated, interrupt_at_a_clean_point, terminate_as_interrupt
from hydro_fluid.policies import policy_help, policy_names

if TYPE_CHECKING:
    import torch
    from torch import nn


def load_callable(spec: str, what: str = "model factory") -> Any:
    """Import ``module:attribute`` (the current directory is on the path), checked as a
    config's callables are (:mod:`hydro.tuning.trust`); the module named on the command line
    is trusted (you typed it), what it reaches through attributes is not."""
    from hydro.tuning.trust import resolve_callable

    module = spec.split(":")[0] if isinstance(spec, str) else ""
    return resolve_callable(spec, what, (os.getcwd(),), trust=(module,) if module else ())


def _model_and_inputs(spec: str) -> tuple[nn.Module, tuple[Any, ...] | None]:
    from torch import nn

    made = load_callable(spec)()
    if isinstance(made, nn.Module):
        return made, None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        return made[0], tuple(made[1])
    raise ConfigError(f"{spec} returned {type(made).__name__}; it must return an nn.Module or "
                      "a (model, example_inputs) pair")


def _ratios(text: str) -> list[int]:
    try:
        return [int(r) for r in text.split(",") if r]
    except ValueError as exc:
        raise ConfigError(f"--ratios must be integers separated by commas, got {text!r}") from exc


def _ratio(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer, got {text!r}") from exc


def _count(minimum: int) -> Any:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


def _first_group(text: str) -> int | str:
    """An argparse type: ``auto`` or an integer >= 0 (``--first-group``)."""
    if text.strip().lower() == "auto":
        return "auto"
    return _count(0)(text)


def cmd_inspect(args: argparse.Namespace) -> int:
    from hydro.inspection import factory_inputs, inspect

    model, inputs, kwargs = factory_inputs(load_callable(args.model)(), args.model)
    report = inspect(model, args.ratio, example_inputs=inputs, example_kwargs=kwargs,
                     head_policy=args.head_policy, depth_ratio=args.depth_ratio,
                     depth_alpha=args.depth_alpha)
    print(report)
    if args.json:
        from hydro.files import write_text

        write_text(args.json, json.dumps(report.to_dict(), indent=2))
        print(f"wrote {args.json}")
    return 0


def cmd_coord_check(args: argparse.Namespace) -> int:
    import torch

    from hydro.coord import coord_check
    from hydro.scaling import guess_inputs
    from hydro.tuning.outputs import check_writable

    torch.manual_seed(args.seed)  # the model's own initialization too: same seed, same numbers
    model, inputs = _model_and_inputs(args.model)
    torch.manual_seed(args.seed)
    if inputs is None:
        # random data shaped like the model's inputs; an Embedding gets valid token ids
        inputs = guess_inputs(model)
        inputs = tuple(
            torch.randint(0, _vocab(model), (8, 16)) if x.dtype == torch.long
            else torch.randn(8, *x.shape[1:])
            for x in inputs
        )
    with torch.no_grad():
        out = model(*inputs)
    target, loss = _synthetic_task(out)
    result = coord_check(model, inputs, target, loss, ratios=_ratios(args.ratios),
                         steps=args.steps, lr=args.lr, optimizer=args.optimizer,
                         parametrization=args.parametrization, seed=args.seed)
    check_writable(args.output, "plot file")
    print(result)
    passed, line = result.verdict(args.threshold)
    result.plot(args.output, threshold=args.threshold)
    print(f"wrote {args.output}")
    print(line)
    return 0 if passed else 1


def _synthetic_task(out: Any) -> tuple[torch.Tensor, Callable]:
    """A fixed random target and its loss for the coord check: cross entropy on random classes
    for an output with a class dimension (logits), mean squared error for a single output. A
    HuggingFace ``ModelOutput`` (or a tuple) is judged by its ``logits`` (or first tensor).

    Not MSE onto random numbers for logits: under muP a surrogate's initial logits are larger
    by sqrt(ratio) (the target's readout init, times the readout multiplier), and MSE's gradient
    ``logits - target`` carries that into every layer, so the check measured the readout's
    initialization rather than width-stable training. Cross entropy's gradient at small logits
    (``softmax - onehot``) does not depend on their size; it is also what such models train on.
    """

    import torch
    import torch.nn.functional as F

    def pick(output: Any) -> torch.Tensor:
        for _ in range(8):  # (a captured ModelOutput may come back nested in another)
            if isinstance(output, torch.Tensor):
                return output
            if getattr(output, "logits", None) is not None:
                output = output.logits
            elif isinstance(output, dict):
                output = next(iter(output.values()))
            else:
                output = output[0]
        raise ConfigError("coord-check: the model's output holds no tensor to judge")

    out = pick(out)
    if out.is_floating_point() and out.dim() >= 2 and out.shape[-1] >= 2:
        classes = torch.randint(0, out.shape[-1], out.shape[:-1])

        def cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(pick(output).flatten(0, -2), target.flatten())

        return classes, cross_entropy

    def mse(output: Any, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(pick(output), target)

    return torch.randn_like(out), mse


def _say_hydro_lines() -> None:
    """Lines the tuner says to the ``hydro`` logger when no progress display takes them (the
    ``compile: auto`` decision) reach stderr, as the command's own lines do."""
    import logging

    class Stderr(logging.Handler):  # the stderr of the moment (a test may swap it)
        def emit(self, record: logging.LogRecord) -> None:
            print(record.getMessage(), file=sys.stderr)

    log = logging.getLogger("hydro")
    if not log.handlers:
        log.addHandler(Stderr())
        log.setLevel(logging.INFO)


def cmd_tune(args: argparse.Namespace) -> int:
    import optuna

    from hydro.tuning import config as config_module
    from hydro.tuning.outputs import check_writable
    from hydro.tuning.run import run

    if args.output:
        check_writable(args.output, "output file (-o)")  # before the study runs, not after
    given = {meta["config"]: getattr(args, name, None) for name, _, meta in TuneOptions.rows()
             if meta["flag"] and meta["config"]}
    cfg = config_module.load(args.config, trust=args.trust, steps=args.steps, cache=args.cache,
                             **given)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    _say_hydro_lines()
    options = cfg.options(progress=args.progress)
    where = f"study '{cfg.study}' of {cfg.storage or DEFAULT_STORAGE}"
    args.resume_hint = f"the finished trials are saved in {where}: run the same command " \
        "again to resume"
    try:
        result = run(cfg.task, cfg.space, options, say=lambda line: print(line, file=sys.stderr),
                     data_source=cfg.data_source, door="cli")
    except HydroError as exc:  # name the file, as for any other mistake in it
        if getattr(exc, "_hydro_task", False):
            raise type(exc)(f"{cfg.path}: task: {exc}") from exc
        raise
    print(f"best value {result.best_value:.6g} (trial {result.best_trial.number})")
    for key, value in result.best_params.items():
        print(f"  {key}: {value}")
    chosen = result.selection
    if chosen and (result.verification or {}).get("winner") is None:
        print(f"chosen with the seeds' noise: trial {chosen['chosen']}, mean {chosen['mean']:.6g} "
              f"over its seeds (noise {chosen['noise']:.3g}; {len(chosen['within'])} "
              "configuration(s) within noise of the best); the export gives:")
        for key, value in result.chosen_params.items():
            span = chosen["ranges"].get(key)
            print(f"  {key}: {value}" + (f"  (within noise: {span})" if span else ""))
    if result.verification:
        v = result.verification
        rho = "n/a" if v["spearman"] is None else f"{v['spearman']:+.2f}"
        print(f"checked the top {len(v['configs'])} on the full model ({v['steps']} steps): "
              f"winner trial {v['winner']}, rank agreement (Spearman) {rho}")
        if v["winner"] is not None and not v.get("agrees", True):
            print("  the export follows the full model's winner:")
            for key, value in result.chosen_params.items():
                print(f"  {key}: {value}")
    if args.output:
        result.export(args.output)
        print(f"wrote {args.output}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from hydro.tuning.outputs import check_writable, export
    from hydro.tuning.verification import CHECK

    check_writable(args.output, "export file")
    study = _load_study(args.storage, args.study)
    data = export(study, args.output, verification=study.user_attrs.get("hydro_verification"))
    prov = data["provenance"]
    by = {CHECK: " (the full-model check's winner)",
          "seed noise": " (chosen with the seeds' noise)"}.get(prov.get("chosen_by"), "")
    print(f"wrote {args.output}: study '{study.study_name}', trial {prov['trial']}{by}, value "
          f"{prov['surrogate_value']:.6g}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from hydro.tuning.outputs import check_writable
    from hydro.tuning.report import check_report_path, write_report

    check_report_path(args.output)
    check_writable(args.output, "report file")
    study = _load_study(args.storage, args.study)
    write_report(study, args.output)
    print(f"wrote {args.output}")
    return 0


def find_storage(storage: str | None, folder: str = ".") -> str:
    """The storage to read: the one named, else the only ``*.db`` file in ``folder``.

    An SQLite file must exist: opening a missing one would create an empty study database.
    """
    if storage is None:
        # several databases: which one is meant cannot be told, so ask rather than guess
        names = sorted(f for f in os.listdir(folder) if f.endswith(".db"))
        if not names:
            raise ConfigError(
                f"no study database here ({os.path.abspath(folder)} has no *.db file): run "
                "`hydro tune CONFIG` first, or name one with --storage "
                "sqlite:///path/to/study.db"
            )
        if len(names) > 1:
            raise ConfigError(
                f"several study databases here ({', '.join(names)}): name one with --storage, "
                f"e.g. --storage sqlite:///{names[0]}"
            )
        return f"sqlite:///{os.path.join(folder, names[0]) if folder != '.' else names[0]}"
    if storage.startswith("sqlite:///") and ":memory:" not in storage:
        file = storage[len("sqlite:///") :].split("?")[0]
        if not os.path.isfile(file):
            raise ConfigError(
                f"storage {storage!r}: no such file {file!r}. Name the database `hydro tune` "
                "wrote (its config's `storage:`, e.g. sqlite:///charlm.db)."
            )
    return storage


def _load_study(storage: str | None, name: str | None):
    import optuna

    from hydro.errors import StorageError
    from hydro.tuning.storage import cannot_open, open_storage

    url = find_storage(storage)
    try:
        opened = open_storage(url)  # retries a locked database, then one line
        names = optuna.get_all_study_names(storage=opened)
    except (StorageError, ConfigError):
        raise
    except Exception as exc:
        raise cannot_open(url, exc) from exc
    if name is None:
        if len(names) != 1:
            listed = ", ".join(names) or "none"
            raise ConfigError(f"storage {url!r} holds {len(names)} studies ({listed}): name one "
                              "with --study")
        name = names[0]
    if name not in names:
        raise ConfigError(f"storage {url!r} has no study named {name!r}; it has: "
                          f"{', '.join(names) or 'none'}")
    return optuna.load_study(study_name=name, storage=opened)


def _vocab(model: nn.Module) -> int:
    from torch import nn

    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return min(sizes) if sizes else 2


PARSERS: dict[str, Any] = {"count": _count(1), "count0": _count(0), "ratio": _ratio,
                           "first_group": _first_group, "int": int, "float": float, "str": str,
                           "compile": str, "policy": str}


def _option_flags(p: argparse.ArgumentParser) -> None:
    """One flag per run option that has one (:class:`hydro.tuning.options.TuneOptions`: the
    table the docs print): its help and its default, which the config's value overrides."""
    for name, _, meta in TuneOptions.rows():
        if not meta["flag"]:
            continue
        text = f"{meta['help']} (default: the config's, else {TuneOptions.shown(name)})"
        text = text.replace("%", "%%")
        if meta["kind"] == "flag":
            p.add_argument(meta["flag"], dest=name, action="store_const", const=True,
                           default=None, help=text)
            continue
        choices = meta["choices"]
        if meta["kind"] == "policy":  # the registry's (hydro_fluid.policies), standard library
            choices, text = policy_names(), f"{text}. {policy_help()}"
        p.add_argument(meta["flag"], dest=name, type=PARSERS[meta["kind"]], default=None,
                       choices=choices, help=text)


def versions() -> str:
    """One line: the versions of Hydro, torch, Optuna and Python, read from the installed
    packages' metadata (nothing is imported: it answers at once).

    Example:
        >>> versions().startswith("hydro ")
        True
    """
    from importlib.metadata import PackageNotFoundError, version

    from hydro._version import __version__

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    python = ".".join(map(str, sys.version_info[:3]))
    return f"hydro {__version__} (torch {of('torch')}, optuna {of('optuna')}, Python {python})"


class _Version(argparse.Action):
    """``--version``: print :func:`versions` and exit (read when asked, not when parsing)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(versions())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hydro", description="Hydro: tune hyperparameters on fused muP surrogates."
    )
    parser.add_argument(
        "--version", action=_Version, help="print the versions of Hydro, torch and Optuna, and exit"
    )
    parser.add_argument(
        "--debug", action="store_true", help="show tracebacks on errors (default: off)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tune", help="tune a model described by a YAML config (resumable)")
    p.add_argument("config", help="the YAML config file (see docs/reference/config.md)")
    _option_flags(p)
    p.add_argument(
        "--steps",
        type=_count(1),
        help="training steps per trial, overriding the "
        "config's task.steps (default: the config's task.steps)",
    )
    p.add_argument(
        "--no-cache",
        dest="cache",
        action="store_const",
        const=False,
        help="capture the model afresh and write nothing to the capture cache "
        "(HYDRO_CACHE=0 does the same; default: the config's task.cache, else the "
        "cache is used)",
    )
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar or lines, no table of the best trials (default: progress on)",
    )
    p.add_argument(
        "--trust",
        action="append",
        default=[],
        metavar="PACKAGE",
        help="an installed package whose callables the config may name, besides "
        "your own code (repeatable; adds to the config's trust list; docs/reference/cli.md, "
        "'A config is code'; default: the config's trust list only)",
    )
    p.add_argument(
        "-o",
        "--output",
        help="also export the best hyperparameters here "
        "(default: no export; `hydro export` writes one later)",
    )
    p.set_defaults(func=cmd_tune)

    where = "Optuna storage URL (default: the only *.db file in the current directory)"
    p = sub.add_parser("export", help="write a study's best hyperparameters (YAML or JSON)")
    p.add_argument("--storage", help=where)
    p.add_argument("--study", help="study name (default: the storage's only study)")
    p.add_argument(
        "-o",
        "--output",
        default="best.yaml",
        help="the file to write, JSON if it ends in .json (default: %(default)s)",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("report", help="an HTML page or a PNG/PDF/SVG figure of a study")
    p.add_argument("--storage", help=where)
    p.add_argument("--study", help="study name (default: the storage's only study)")
    p.add_argument(
        "-o",
        "--output",
        default="report.html",
        help=".html, .png, .pdf or .svg (default: %(default)s)",
    )
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("inspect", help="per-layer scaling plan of a model")
    p.add_argument("model", help="module:callable returning the model, or (model, args), "
                   "(model, {kwargs}) or (model, args, kwargs)")
    p.add_argument(
        "--ratio",
        type=_ratio,
        default="auto",
        help="width divisor, or 'auto': the largest within the width floors (at most 4 with "
        "attention) (default: %(default)s)",
    )
    p.add_argument(
        "--head-policy",
        default="keep_head_dim",
        choices=["keep_head_dim", "keep_head_count"],
        help="attention at a smaller width keeps each head's size (fewer heads) or the "
        "number of heads (default: %(default)s)",
    )
    p.add_argument(
        "--depth-ratio",
        type=int,
        default=1,
        help="keep every k-th repeated block (default: %(default)s)",
    )
    p.add_argument(
        "--depth-alpha",
        type=float,
        default=1.0,
        help="1: CompleteP, 0.5: Depth-muP (default: %(default)s)",
    )
    p.add_argument("--json", help="also write the plan as JSON to this file (default: none)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("coord-check", help="activation sizes over widths: does muP hold?")
    p.add_argument("model", help="module:callable returning the model (or (model, inputs))")
    p.add_argument(
        "--ratios",
        default="1,2,4,8",
        help="width divisors to compare, separated by commas (default: %(default)s)",
    )
    p.add_argument(
        "--steps", type=int, default=8, help="training steps at each width (default: %(default)s)"
    )
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default: %(default)s)")
    p.add_argument(
        "--optimizer",
        default="adam",
        choices=["adam", "sgd"],
        help="the optimizer (default: %(default)s)",
    )
    p.add_argument(
        "--parametrization",
        default="mup",
        choices=["mup", "sp"],
        help="muP relative to the model, or standard (default: %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seeds the models and the data (default: %(default)s)"
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=2.0,
        help="pass when the worst hidden layer's spread (largest / smallest mean "
        "activation across widths) at the last step is below this "
        "(default: %(default)s)",
    )
    p.add_argument(
        "-o", "--output", default="coord_check.png", help="plot file, PNG (default: %(default)s)"
    )
    p.set_defaults(func=cmd_coord_check)
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Refuse what argparse cannot see but the standard library can, before any command imports
    torch: a typo then answers in milliseconds, not after seconds of imports."""
    if args.command == "tune":
        if not os.path.exists(args.config):
            raise ConfigError(f"config file {args.config!r} does not exist: name a YAML config "
                              "(see docs/reference/config.md), e.g. examples/charlm/tune.yaml")
        if os.path.isdir(args.config):
            raise ConfigError(f"config file {args.config!r} is a directory: name the YAML file "
                              f"in it, e.g. {args.config}/tune.yaml")
    if args.command == "coord-check":
        if args.threshold <= 1:
            raise ConfigError(f"--threshold must be above 1 (a ratio of activation sizes), got "
                              f"{args.threshold}")
        _ratios(args.ratios)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hydro`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # Ctrl-C can land inside a library that turns it into another error (a half-done import,
    # a tracer that wraps what it catches): remember that it came, to say "interrupted" anyway
    stopped: list[int] = []
    try:
        # Ctrl-C and SIGTERM (kill, Slurm, Docker, systemd) stop a run at a clean point (never
        # between a trial's ask and its bookkeeping): exit 130 and 143, the shell's convention
        with interrupt_at_a_clean_point(stopped), terminate_as_interrupt(stopped):
            check_args(args)
            # hydro.tuning's package imports torch (and all of Hydro a command runs): only once
            # the arguments are known to be good. A process that had not loaded torch yet (the
            # console script; not a test or notebook calling main) freezes what imports leave
            with collector_paused(freeze="torch" not in sys.modules):
                import hydro.tuning.tune  # noqa: F401 - torch, Optuna and Hydro's tuning, frozen

                if args.command == "tune":
                    # every tune loads it (its optimizer, a capture, a cached graph's fake
                    # tensors): here, to be frozen with the rest
                    import torch._dynamo  # noqa: F401
            return args.func(args)
    except (KeyboardInterrupt, Exception) as exc:
        if args.debug or not (stopped or isinstance(exc, (KeyboardInterrupt, HydroError))):
            raise
        if stopped or isinstance(exc, KeyboardInterrupt):
            term = signal.SIGTERM in stopped or isinstance(exc, Terminated)
            hint = getattr(args, "resume_hint", None)
            word = "terminated" if term else "interrupted"
            print(f"\nhydro {args.command}: {word}{f'; {hint}' if hint else ''}", file=sys.stderr)
            return 128 + (signal.SIGTERM if term else signal.SIGINT)  # the shell's convention
        print(f"hydro {args.command}: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)  # 3: the study's database failed in use


if __name__ == "__main__":
    sys.exit(main())
