"""The ``hydro`` command: tune, export, report, inspect and coord-check.

Models are named as ``module:callable`` (the callable returns an ``nn.Module``, or a
``(model, example_inputs)`` pair); the current directory is importable, as for ``python -m``.
Bad input exits with status 2 and a one-paragraph error; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hydro.errors import ConfigError, HydroError


def load_callable(spec: str, what: str = "model factory") -> Any:
    """Import ``module:attribute`` (the current directory is on the path)."""
    if ":" not in spec:
        raise ConfigError(f"{what} {spec!r} must look like 'package.module:callable'")
    module_name, attr = spec.split(":", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"cannot import module {module_name!r} for the {what} {spec!r}: {exc}. "
            "Run from the directory that contains it or install it."
        ) from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"module {module_name!r} has no attribute {part!r} ({what} {spec!r})")
        obj = getattr(obj, part)
    return obj


def _model_and_inputs(spec: str) -> tuple[nn.Module, tuple[Any, ...] | None]:
    made = load_callable(spec)()
    if isinstance(made, nn.Module):
        return made, None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        return made[0], tuple(made[1])
    raise ConfigError(f"{spec} returned {type(made).__name__}; it must return an nn.Module or "
                      "a (model, example_inputs) pair")  # fmt: skip


def _ratios(text: str) -> list[int]:
    try:
        return [int(r) for r in text.split(",") if r]
    except ValueError as exc:
        raise ConfigError(f"--ratios must be integers separated by commas, got {text!r}") from exc


def cmd_inspect(args: argparse.Namespace) -> int:
    from hydro.inspection import inspect

    model, inputs = _model_and_inputs(args.model)
    report = inspect(model, args.ratio, example_inputs=inputs, head_policy=args.head_policy)
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
        print(f"wrote {args.json}")
    return 0


def cmd_coord_check(args: argparse.Namespace) -> int:
    from hydro.coord import coord_check
    from hydro.scaling import guess_inputs

    model, inputs = _model_and_inputs(args.model)
    torch.manual_seed(args.seed)
    if inputs is None:
        # random data shaped like the model's inputs; an Embedding gets valid token ids
        inputs = guess_inputs(model)
        inputs = tuple(
            torch.randint(0, _vocab(model), (8, 16)) if x.dtype == torch.long
            else torch.randn(8, *x.shape[1:])
            for x in inputs
        )  # fmt: skip
    with torch.no_grad():
        out = model(*inputs)
    # regress onto a fixed random target: any loss that moves every layer will do
    target = torch.randn_like(out)
    result = coord_check(model, inputs, target, F.mse_loss, ratios=_ratios(args.ratios),
                         steps=args.steps, lr=args.lr, optimizer=args.optimizer,
                         parametrization=args.parametrization, seed=args.seed)  # fmt: skip
    print(result)
    result.plot(args.output)
    print(f"wrote {args.output}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    import optuna

    from hydro.tuning import config as config_module
    from hydro.tuning.tune import TuneResult, make_executor, open_study, verify

    cfg = config_module.load(
        args.config, storage=args.storage, study=args.study, trials=args.trials,
        ratio=args.ratio, fuse=args.fuse, seed=args.seed, verify_top_k=args.verify_top_k,
    )  # fmt: skip
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    executor = make_executor(args.executor)
    from hydro.integrations.optuna import optimize

    study = open_study(cfg.storage, cfg.study, cfg.task.direction, cfg.sampler, cfg.pruner)
    before = len(study.trials)
    print(f"study '{cfg.study}' in {cfg.storage or 'sqlite:///hydro.db'}: {before} trials so far, "
          f"target {cfg.trials}; ratio {cfg.ratio}, {cfg.fuse} trials per fused group",
          file=sys.stderr)  # fmt: skip
    optimize(study, cfg.task, cfg.space, cfg.trials, ratio=cfg.ratio, fuse=cfg.fuse,
             seed=cfg.seed, progress=True, executor=executor)  # fmt: skip
    result = TuneResult(study, cfg.ratio)
    if cfg.verify_top_k:
        result.verification = verify(cfg.task, study, cfg.verify_top_k, seed=cfg.seed)
        study.set_user_attr("hydro_verification", result.verification)
    print(f"best value {result.best_value:.6g} (trial {result.best_trial.number})")
    for key, value in result.best_params.items():
        print(f"  {key}: {value}")
    if result.verification:
        v = result.verification
        print(f"verified top {len(v['configs'])} on the full model: winner trial {v['winner']}, "
              f"rank agreement (Spearman) {v['spearman']}")  # fmt: skip
    if args.output:
        result.export(args.output)
        print(f"wrote {args.output}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from hydro.tuning.tune import export

    study = _load_study(args.storage, args.study)
    data = export(study, args.output, verification=study.user_attrs.get("hydro_verification"))
    print(f"wrote {args.output}: trial {data['provenance']['trial']}, value "
          f"{data['provenance']['surrogate_value']:.6g}")  # fmt: skip
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from hydro.tuning.report import write_report

    study = _load_study(args.storage, args.study)
    write_report(study, args.output)
    print(f"wrote {args.output}")
    return 0


def _load_study(storage: str, name: str):  # noqa: ANN202
    import optuna

    from hydro.errors import StorageError

    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError as exc:
        raise ConfigError(f"storage {storage!r} has no study named {name!r}") from exc
    except Exception as exc:  # noqa: BLE001
        raise StorageError(f"cannot open Optuna storage {storage!r}: {exc}") from exc


def _vocab(model: nn.Module) -> int:
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return min(sizes) if sizes else 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hydro", description="Hydro: tune hyperparameters on fused muP surrogates."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tune", help="tune a model described by a YAML config (resumable)")
    p.add_argument("config", help="the YAML config file (see docs/tuning.md)")
    p.add_argument("--storage", help="Optuna storage URL (default: the config's, or hydro.db)")
    p.add_argument("--study", help="study name")
    p.add_argument("--trials", type=int, help="trials to finish")
    p.add_argument("--ratio", type=int, help="surrogate width divisor")
    p.add_argument("--fuse", type=int, help="trials per fused group")
    p.add_argument("--executor", choices=["inline", "local", "ray"], default=None,
                   help="where groups train: this process (default), local worker processes, "
                   "or a Ray cluster (RAY_ADDRESS, else a local one)")  # fmt: skip
    p.add_argument("--seed", type=int)
    p.add_argument("--verify-top-k", type=int, help="train the full model with the best k")
    p.add_argument("-o", "--output", help="also export the best hyperparameters here")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("export", help="write a study's best hyperparameters (YAML or JSON)")
    p.add_argument("--storage", default="sqlite:///hydro.db")
    p.add_argument("--study", default="hydro")
    p.add_argument("-o", "--output", default="best.yaml")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("report", help="an HTML or PNG report of a study")
    p.add_argument("--storage", default="sqlite:///hydro.db")
    p.add_argument("--study", default="hydro")
    p.add_argument("-o", "--output", default="report.html")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("inspect", help="per-layer scaling plan of a model")
    p.add_argument("model", help="module:callable returning the model (or (model, inputs))")
    p.add_argument("--ratio", type=int, default=8)
    p.add_argument("--head-policy", default="keep_head_dim",
                   choices=["keep_head_dim", "keep_head_count"])  # fmt: skip
    p.add_argument("--json", help="also write the plan as JSON to this file")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("coord-check", help="activation sizes over widths: does muP hold?")
    p.add_argument("model", help="module:callable returning the model (or (model, inputs))")
    p.add_argument("--ratios", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    p.add_argument("--parametrization", default="mup", choices=["mup", "sp"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", default="coord_check.png", help="plot file (PNG)")
    p.set_defaults(func=cmd_coord_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hydro`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except HydroError as exc:
        if args.debug:
            raise
        print(f"hydro {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
