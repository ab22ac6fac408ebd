"""Training one trial group: n surrogates fused into one model, trained in lockstep.

Every member reports its own validation value at every ``eval_every`` steps; a member the caller
prunes is dropped from the fused model (``select``) so it stops costing compute; a member whose
loss or gradients stop being finite is frozen by the fused optimizer and ends as a failure.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

import hydro.optim as fused_optim
from hydro.errors import ConfigError, HydroWarning
from hydro.fusion import fuse
from hydro.parametrize import READOUT
from hydro.scaling import build
from hydro.tuning import checkpoint as _checkpoint
from hydro.tuning.task import Task

# report(member, step, value) -> True when the caller prunes that member
Report = Callable[[int, int, float], bool]

DEFAULTS = {"adamw": {"lr": 1e-3, "weight_decay": 0.01}, "adam": {"lr": 1e-3, "weight_decay": 0.0},
            "sgd": {"lr": 1e-2, "weight_decay": 0.0}}  # fmt: skip


@dataclass
class Outcome:
    """How one member of a group ended."""

    state: Literal["complete", "pruned", "fail"]
    value: float | None
    step: int
    reason: str = ""
    history: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GroupInfo:
    """Facts about a trained group, recorded with each of its trials."""

    ratio: int
    size: int
    widths: dict[str, list[int]]
    seconds: float = 0.0
    pid: int = field(default_factory=os.getpid)  # the process that trained the group


def group_key(params: dict[str, Any], task: Task) -> tuple:
    """Trials can share one fused model when their batch size and architecture agree.

    Architecture is what a factory argument *does*, not its name: the model is built on the
    ``meta`` device (no memory) and its parameter and buffer shapes, module types and
    non-float settings make the key. A searched ``dropout`` (a float stored on modules, or a
    literal in forward) changes none of them, so trials differing only in dropout fuse; each
    member is still built from its own arguments (:func:`build_members`).
    """
    args = tuple(sorted((k, params[k]) for k in task.model_args() if k in params))
    return (params.get("batch_size", task.batch_size), structure(task, args))


_STRUCTURES: dict[tuple, Any] = {}
_SITES: dict[tuple, Any] = {}


def structure(task: Task, args: tuple) -> Any:
    """A hashable summary of what the factory builds for ``args`` (shapes, types, settings)."""
    key = (id(task.model), repr(args))
    if key not in _STRUCTURES:
        try:
            with torch.device("meta"):
                model = task.build_model(**dict(args))
        except Exception:
            return ("args", args)  # the factory does not build on meta: every argument counts
        parts: list[Any] = []
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            parts.append((name, tuple(t.shape), str(t.dtype)))
        for name, m in model.named_modules():
            settings = tuple(sorted(
                (k, v) for k, v in vars(m).items()
                if not k.startswith("_") and isinstance(v, (bool, int, str, type(None)))
            ))  # fmt: skip
            parts.append((name, type(m).__qualname__, settings))
        _STRUCTURES[key] = tuple(parts)
    return _STRUCTURES[key]


def build_members(
    task: Task,
    params: Sequence[dict[str, Any]],
    ratio: int,
    seeds: Sequence[int],
    example: tuple[tuple, dict],
    target: nn.Module | None = None,
) -> list[nn.Module]:
    """One surrogate per member, each from its own factory arguments and seed.

    The group shares one capture and width analysis (its members agree on
    :func:`group_key`). Factory arguments that differ between members without changing the
    architecture (dropout) show up as literals in the captured graphs: the target is captured
    once more with the argument changed, the literals that follow it are located, and each
    member's copy gets its own value there. Where a literal does not equal the argument
    (computed from it), that member is captured on its own.
    """
    names = sorted(k for k in task.model_args() if k in params[0])
    args = [{k: p[k] for k in names} for p in params]
    always = any("output_mult" in p for p in params)
    if target is None:
        target = task.build_model(**args[0])
    ex_args, ex_kwargs = example
    scaled = build(target, ratio, example_inputs=ex_args, example_kwargs=ex_kwargs,
                   seed=int(seeds[0]), always_readout=always)  # fmt: skip
    members: list[nn.Module] = [scaled.surrogate]
    sites = {}  # argument name -> [(mode, node name, argument index)] where its value is written
    for name in names:
        other = next((a[name] for a in args if a[name] != args[0][name]), None)
        if other is not None:
            key = (id(task.model), structure(task, tuple(args[0].items())), name, ratio)
            if key not in _SITES:  # one extra capture per argument, not per group
                _SITES[key] = _literal_sites(task, scaled, args[0], name, other, example)
            sites[name] = _SITES[key]
    for k in range(1, len(params)):
        differs = [n for n in names if args[k][n] != args[0][n]]
        if any(sites.get(n) is None for n in differs):
            own = build(task.build_model(**args[k]), ratio, example_inputs=ex_args,
                        example_kwargs=ex_kwargs, seed=int(seeds[k]),
                        always_readout=always)  # fmt: skip
            members.append(own.surrogate)
            continue
        sur = scaled.sample(int(seeds[k]))
        for n in differs:
            for mode, node_name, index in sites[n]:
                node = next(x for x in sur.graphs[mode].graph.nodes if x.name == node_name)
                node.update_arg(index, args[k][n])
        for gm in sur.graphs.values():
            gm.recompile()
        members.append(sur)
    return members


def _lit(x: Any) -> Any:
    return torch.fx.node.map_arg(x, lambda n: ("node", n.name))


def _literal_sites(task, scaled, args0, name, value, example) -> list | None:  # noqa: ANN001
    """Where the captured graphs write factory argument ``name`` as a literal, or ``None``."""
    from hydro.fx.capture import capture

    # training is where a literal like dropout acts; the eval graph keeps the first member's
    other = capture(task.build_model(**{**args0, name: value}), example[0], example[1],
                    modes=("train",))  # fmt: skip
    sites = []
    for mode, gm in scaled.captured.graphs.items():
        if mode not in other.graphs:
            continue
        a_nodes, b_nodes = list(gm.graph.nodes), list(other.graphs[mode].graph.nodes)
        if len(a_nodes) != len(b_nodes):
            return None
        for a, b in zip(a_nodes, b_nodes):
            if (
                a.target != b.target
                or len(a.args) != len(b.args)
                or _lit(a.kwargs) != _lit(b.kwargs)
            ):
                return None
            for i, (x, y) in enumerate(zip(a.args, b.args)):
                if _lit(x) == _lit(y):
                    continue
                if isinstance(x, (torch.fx.Node, list, tuple)):
                    return None
                if x != args0[name] or y != value:
                    return None  # computed from the argument: not a plain literal
                new = scaled.node_map[a]
                sites.append((mode, new.name, i))
    return sites


def train_group(
    task: Task,
    params: Sequence[dict[str, Any]],
    *,
    ratio: int,
    seeds: Sequence[int],
    report: Report | None = None,
    device: str | torch.device = "cpu",
    pruned: Callable[[], set[int]] | None = None,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
) -> tuple[list[Outcome], GroupInfo]:
    """Train ``len(params)`` trials of ``task`` fused, and return how each ended.

    Args:
        task: what to train.
        params: each member's hyperparameters (all with the same :func:`group_key`).
        ratio: surrogate width divisor (1 trains the target itself).
        seeds: each member's initialization and data seed.
        report: called with ``(member, step, value)`` at every evaluation; returns ``True`` to
            prune that member.
        device: where to train.
        pruned: polled every step for members pruned meanwhile (when reports travel to
            another process and the answer comes later).
        checkpoint: a directory for the group's checkpoint: training resumes from the one
            found there, and ends bit-identical to a run never interrupted.
        checkpoint_every: save a checkpoint every this many steps (0: never).
    """
    start = time.perf_counter()
    params = [dict(p) for p in params]
    n = len(params)
    batch_size = int(params[0].get("batch_size", task.batch_size))
    batches = task.train_batches(batch_size, seed=int(seeds[0]))
    first = next(task.train_batches(min(batch_size, 2), seed=int(seeds[0])))
    target = task.build_model(**{k: params[0][k] for k in task.model_args() if k in params[0]})
    task.validate(target, first)  # clear errors before any training
    if task.example_inputs is not None:
        example: tuple[tuple, dict] = (tuple(task.example_inputs), {})
    else:
        args, kwargs, _ = task.split(first)
        example = (args, kwargs)
    # one capture and width analysis for the group; each member an independent draw
    members = build_members(task, params, ratio, seeds, example, target=target)
    for sur, p in zip(members, params):  # after sampling: samples copy the first member
        _apply_model_params(sur, p, task.model_args())
    widths = _widths(members[0])
    if ratio > 1 and not widths["target"]:
        warnings.warn(HydroWarning(
            f"no width of {type(target).__name__} can shrink (every dimension is tied to the "
            f"inputs or outputs), so the ratio-{ratio} surrogate equals the full model: Hydro "
            "tunes the full model itself, fused. Use a model with hidden layers, or ratio=1."
        ), stacklevel=2)  # fmt: skip
    fused = fuse(members).to(device)
    fused.train()
    opt = _optimizer(task, fused, params)
    sched = _scheduler(task, opt, params)
    clip = [p.get("grad_clip") for p in params]

    alive = list(range(n))  # original member index of each fused position
    outcomes: dict[int, Outcome] = {}
    history: dict[int, list[tuple[int, float]]] = {k: [] for k in range(n)}
    first = 1
    saved = _checkpoint.load(checkpoint) if checkpoint is not None else None
    if saved is not None:
        first, alive = _resume(saved, fused, opt, sched, outcomes, history)
        for _ in range(first - 1):  # the data stream continues where it stopped
            next(batches)
    for step in range(first, task.steps + 1):
        losses = _train_step(task, fused, opt, next(batches), [clip[k] for k in alive], device)
        if sched is not None:
            sched.step()
        _fail_diverged(fused, alive, outcomes, history, step, losses)
        for k in pruned() if pruned is not None else ():
            if k in alive and k not in outcomes:
                last = history[k][-1][1] if history[k] else None
                outcomes[k] = Outcome("pruned", last, step, "", history[k])
        if step % task.eval_every == 0 or step == task.steps:
            values = evaluate(task, fused, batch_size, device)
            for pos, k in enumerate(alive):
                if k in outcomes:
                    continue
                v = float(values[pos])
                history[k].append((step, v))
                if not math.isfinite(v):
                    outcomes[k] = Outcome("fail", None, step, "non-finite validation value",
                                          history[k])  # fmt: skip
                elif report is not None and report(k, step, v) and step < task.steps:
                    outcomes[k] = Outcome("pruned", v, step, "", history[k])
        # members that ended (pruned, failed) leave the fused model and stop costing compute
        keep = [pos for pos, k in enumerate(alive) if k not in outcomes]
        if len(keep) < len(alive):
            if not keep:
                break
            fused.select(keep)
            opt.select(keep)
            alive = [alive[pos] for pos in keep]
        if checkpoint is not None and checkpoint_every and step % checkpoint_every == 0 \
                and step < task.steps:  # fmt: skip
            _checkpoint.save(checkpoint, _state(step, fused, opt, alive, outcomes, history))
    for k in alive:
        if k not in outcomes:
            last = history[k][-1][1] if history[k] else None
            outcomes[k] = Outcome("complete", last, task.steps, "", history[k])
    info = GroupInfo(ratio=ratio, size=n, widths=widths, seconds=time.perf_counter() - start)
    return [outcomes[k] for k in range(n)], info


def _state(step, fused, opt, alive, outcomes, history) -> dict[str, Any]:  # noqa: ANN001
    """Everything the loop needs to go on after ``step``: tensors and plain containers only."""
    return {
        "step": step,
        "model": fused.state_dict(),
        "optimizer": opt.state_dict(),
        "alive": list(alive),
        "outcomes": {k: [o.state, o.value, o.step, o.reason] for k, o in outcomes.items()},
        "history": {k: [list(h) for h in v] for k, v in history.items()},
        "rng": _checkpoint.rng_state(),
    }


def _resume(saved, fused, opt, sched, outcomes, history) -> tuple[int, list[int]]:  # noqa: ANN001
    """Put a freshly built group in the state of checkpoint ``saved``; returns (next step,
    alive members)."""
    step = int(saved["step"])
    for k, v in saved["history"].items():
        history[int(k)] = [(int(s), float(x)) for s, x in v]
    for k, (state, value, at, reason) in saved["outcomes"].items():
        outcomes[int(k)] = Outcome(state, value, at, reason, history[int(k)])
    if sched is not None:  # per-trial schedules are pure functions of the step: replay them
        for _ in range(step):
            sched.step()
    alive = [int(k) for k in saved["alive"]]
    if len(alive) < fused.n:
        fused.select(alive)
        opt.select(alive)
    fused.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    _checkpoint.set_rng_state(saved["rng"])
    return step + 1, alive


def _train_step(task, fused, opt, batch, clip, device) -> list[float]:  # noqa: ANN001
    """One step of every member; returns their losses as floats.

    Nothing of the autograd graph outlives this function: ``select`` shrinks parameters in place,
    which autograd accepts only once no graph still refers to them.
    """
    args, kwargs, y = task.split(batch, device)
    losses = task.trial_losses(fused(*args, **kwargs), y)
    opt.zero_grad(set_to_none=True)
    # non-finite losses give non-finite gradients: the optimizer freezes those members
    losses.sum().backward()
    if any(c is not None for c in clip):
        fused_optim.clip_grad_norm_(fused, [c if c is not None else math.inf for c in clip])
    opt.step()
    return losses.detach().tolist()


@torch.no_grad()
def evaluate(task: Task, fused: nn.Module, batch_size: int, device: Any) -> list[float]:
    """Each member's metric (or loss) averaged over the validation data."""
    fused.eval()
    total, count = None, 0
    for batch in task.val_batches(max(batch_size, 64)):
        args, kwargs, y = task.split(batch, device)
        size = task.batch_len(batch)
        v = task.trial_metrics(fused(*args, **kwargs), y).double() * size
        total = v if total is None else total + v
        count += size
    fused.train()
    return (total / max(count, 1)).tolist() if total is not None else [math.nan] * fused.n


def _fail_diverged(fused, alive, outcomes, history, step, losses) -> None:  # noqa: ANN001
    flags = fused.diverged.tolist()
    for pos, k in enumerate(alive):
        if k not in outcomes and (flags[pos] or not math.isfinite(losses[pos])):
            outcomes[k] = Outcome("fail", None, step, f"diverged at step {step}: non-finite "
                                  "loss or gradient", history[k])  # fmt: skip


def _apply_model_params(sur: nn.Module, p: dict[str, Any], model_args: set[str]) -> None:
    """Hyperparameters that act on a built surrogate: the readout multiplier (its buffer),
    dropout (the ``aten.dropout`` literals, unless the factory takes ``dropout`` itself), the
    initialization scale."""
    if "output_mult" in p:
        with torch.no_grad():
            for name, b in sur.named_buffers():
                if name.startswith(READOUT) and name.endswith(".scale"):
                    b.mul_(float(p["output_mult"]))
    if "dropout" in p and "dropout" not in model_args:
        for gm in sur.graphs.values():
            for node in gm.graph.nodes:
                if node.target is torch.ops.aten.dropout.default:
                    node.update_arg(1, float(p["dropout"]))
            gm.recompile()
    if "init_scale" in p:
        with torch.no_grad():
            for param in sur.parameters():
                if param.dim() >= 2:
                    param.mul_(float(p["init_scale"]))


def _optimizer(task: Task, fused: nn.Module, params: Sequence[dict]) -> fused_optim.FusedOptimizer:
    defaults = DEFAULTS[task.optimizer]

    def column(name: str, default: float) -> list[float]:
        return [float(p.get(name, default)) for p in params]

    lr = column("lr", defaults["lr"])
    wd = column("weight_decay", defaults["weight_decay"])
    if task.optimizer == "sgd":
        return fused_optim.SGD(fused.parameters(), lr=lr, momentum=column("momentum", 0.0),
                               weight_decay=wd)  # fmt: skip
    cls = fused_optim.AdamW if task.optimizer == "adamw" else fused_optim.Adam
    return cls(fused.parameters(), lr=lr, betas=(column("beta1", 0.9), column("beta2", 0.999)),
               eps=column("eps", 1e-8), weight_decay=wd)  # fmt: skip


def _scheduler(task: Task, opt: fused_optim.FusedOptimizer, params: Sequence[dict]) -> Any:
    steps = task.steps
    warm = [int(p.get("warmup", 0)) for p in params]
    if any(w >= steps for w in warm):
        raise ConfigError(f"warmup {max(warm)} must be shorter than steps ({steps})")
    S = fused_optim.lr_scheduler
    if task.scheduler == "none" and not any(warm):
        return None
    # a member without warm-up spends one step at its base lr: one schedule shape for all
    w1 = [max(w, 1) for w in warm]
    rest = [steps - w for w in w1]
    if task.scheduler == "cosine":
        main = S.CosineAnnealingLR(opt, T_max=rest)
    elif task.scheduler == "linear":
        main = S.LinearLR(opt, start_factor=1.0, end_factor=1e-3, total_iters=rest)
    elif task.scheduler == "step":
        main = S.StepLR(opt, step_size=[max(1, r // 3) for r in rest], gamma=0.1)
    else:
        main = S.LinearLR(opt, start_factor=1.0, end_factor=1.0, total_iters=1)
    if not any(warm):
        return main
    warmup = S.LinearLR(opt, start_factor=[1.0 / (w + 1) if w else 1.0 for w in warm],
                        end_factor=1.0, total_iters=w1)  # fmt: skip
    return S.SequentialLR(opt, [warmup, main], milestones=[[w] for w in w1])


def _widths(sur: nn.Module) -> dict[str, list[int]]:
    """The distinct hidden widths of the target and of the surrogate."""
    target, surrogate = set(), set()
    info = sur.hydro
    for name, p in sur.named_parameters():
        old = info.target_shapes.get(name)
        if old is None:
            continue
        for d_old, d_new in zip(old, p.shape):
            if d_old != d_new:
                target.add(int(d_old))
                surrogate.add(int(d_new))
    return {"target": sorted(target), "surrogate": sorted(surrogate)}


def _to(x: Any, device: Any) -> Any:
    return x.to(device) if isinstance(x, torch.Tensor) else x
