"""``hydro report``: a study at a glance, as an HTML page or a PNG."""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any

import optuna
from optuna.trial import TrialState

from hydro.files import replacing, write_text
from hydro.tuning.space import trained_params

FIGURE_SUFFIXES = (".png", ".pdf", ".svg")
PAGE_SUFFIXES = (".html", ".htm")


def is_interrupted(trial: optuna.trial.FrozenTrial) -> bool:
    """A trial failed only because the process running it stopped (it is asked again)."""
    if trial.state != TrialState.FAIL:
        return False
    reason = str(trial.user_attrs.get("fail_reason", ""))
    return bool(trial.user_attrs.get("interrupted")) or reason.startswith("interrupted")


def is_put_back(trial: optuna.trial.FrozenTrial) -> bool:
    """A trial interrupted with its process and put back in the queue (WAITING): the next run
    takes it up again, same number (:func:`hydro.tuning.bookkeeping.put_back`)."""
    return trial.state == TrialState.WAITING and bool(trial.user_attrs.get("hydro_interrupted"))


def is_surplus(trial: optuna.trial.FrozenTrial) -> bool:
    """A row asked past ``n_trials`` by a process sharing the study: never trained, not a trial."""
    return trial.state == TrialState.FAIL and str(
        trial.user_attrs.get("fail_reason", "")
    ).startswith("surplus")


def trial_counts(study: optuna.Study) -> dict[str, int]:
    """Trials by outcome: ``complete``, ``pruned``, ``failed`` (real failures),
    ``interrupted`` (stopped with their process: waiting to resume, or an older study's FAIL
    row asked again; not finished), ``running``, and ``finished`` = complete + pruned +
    failed."""
    counts = dict.fromkeys(("complete", "pruned", "failed", "interrupted", "running"), 0)
    for t in study.get_trials(deepcopy=False):
        if is_surplus(t):
            continue
        if t.state == TrialState.COMPLETE:
            counts["complete"] += 1
        elif t.state == TrialState.PRUNED:
            counts["pruned"] += 1
        elif t.state == TrialState.FAIL:
            counts["interrupted" if is_interrupted(t) else "failed"] += 1
        elif t.state == TrialState.RUNNING:
            counts["running"] += 1
        elif is_put_back(t):
            counts["interrupted"] += 1
    counts["finished"] = counts["complete"] + counts["pruned"] + counts["failed"]
    return counts


def check_report_path(path: str) -> None:
    """Refuse a report file name whose suffix says a format the report cannot write."""
    from hydro.errors import ConfigError

    if not str(path).lower().endswith(FIGURE_SUFFIXES + PAGE_SUFFIXES):
        raise ConfigError(
            f"cannot write a report to {path!r}: name a .html page, or a .png, .pdf or .svg figure"
        )


def write_report(study: optuna.Study, path: str) -> None:
    """Optimization history, value per hyperparameter, learning curves and, when the study was
    verified on the full model, surrogate-vs-target agreement. ``.png``, ``.pdf`` and ``.svg``
    write one figure; ``.html`` a self-contained page; other suffixes are refused
    (``ConfigError``)."""
    import matplotlib

    check_report_path(path)
    matplotlib.use("Agg")
    figure = _figure(study)
    if str(path).lower().endswith(FIGURE_SUFFIXES):
        with replacing(path) as tmp:
            figure.savefig(tmp, dpi=110)
        return
    buf = io.BytesIO()
    figure.savefig(buf, format="png", dpi=110)
    image = base64.b64encode(buf.getvalue()).decode()
    try:
        best = (
            f"best value {study.best_value:.6g} (trial {study.best_trial.number}): "
            + html.escape(
                ", ".join(
                    f"{k} {_cell(v)}" for k, v in sorted(trained_params(study.best_trial).items())
                )
            )
        )
    except ValueError:
        best = "no completed trial yet"
    occ = study.user_attrs.get("hydro_occupancy")
    if occ and occ.get("overall") is not None:
        asking = occ.get("while_asking")
        best += (
            f"<br>fused groups of {occ['fuse']}: on average {occ['overall']:.0%} of the slots "
            "trained at each fused step"
            + (f" ({asking:.0%} while trials remained to ask)" if asking is not None else "")
        )
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<title>Hydro study {html.escape(study.study_name)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;font-size:12px}}</style></head><body>
<h1>Study {html.escape(study.study_name)}</h1><p>{best}</p>
<img src="data:image/png;base64,{image}" style="max-width:100%">
<h2>Trials</h2>{trials_table(study)}</body></html>"""
    write_text(path, page)


def trials_table(study: optuna.Study) -> str:
    """The report's table of trials, as HTML: number, state, value, one column per
    hyperparameter (sorted by name; blank where a trial has none) and the fail reason."""
    trials = study.get_trials(deepcopy=False)
    params = [trained_params(t) for t in trials]
    names = sorted({k for p in params for k in p})
    heads = "".join(f"<th>{html.escape(k)}</th>" for k in names)
    rows = "".join(
        f"<tr><td>{t.number}</td><td>{_state(t)}</td><td>{_fmt(t.value)}</td>"
        + "".join(f"<td>{html.escape(_cell(p.get(k)))}</td>" for k in names)
        + f"<td>{html.escape(str(t.user_attrs.get('fail_reason', '')))}</td></tr>"
        for t, p in zip(trials, params)
    )
    return (f"<table><tr><th>#</th><th>state</th><th>value</th>{heads}<th>fail reason</th>"
            f"</tr>{rows}</table>")  # fmt: skip


def _figure(study: optuna.Study) -> Any:
    import matplotlib.pyplot as plt

    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    params = sorted({k for t in complete for k in t.params})
    verification = study.user_attrs.get("hydro_verification")
    panels = 2 + len(params) + (1 if verification else 0)
    cols = min(3, panels)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    axes = [ax for row in axes for ax in row]
    ax = axes[0]
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    xs = [t.number for t in complete]
    ys = [t.value for t in complete]
    ax.scatter(xs, ys, s=12, label="trial")
    best, running = [], None
    for y in ys:
        running = y if running is None else (max(running, y) if maximize else min(running, y))
        best.append(running)
    ax.plot(xs, best, color="C1", label="best so far")
    ax.set(title="optimization history", xlabel="trial", ylabel="value")
    ax.legend(fontsize=7)
    ax = axes[1]
    for t in trials:
        if t.intermediate_values:
            steps = sorted(t.intermediate_values)
            color = "C3" if t.state == TrialState.PRUNED else "C0"
            ax.plot(steps, [t.intermediate_values[s] for s in steps], color=color, alpha=0.5, lw=1)
    ax.set(title="learning curves (red: pruned)", xlabel="step", ylabel="value")
    for i, name in enumerate(params):
        ax = axes[2 + i]
        pts = [(t.params[name], t.value) for t in complete if name in t.params]
        if pts and all(isinstance(p, (int, float)) for p, _ in pts):
            ax.scatter([p for p, _ in pts], [v for _, v in pts], s=12)
            if all(p > 0 for p, _ in pts) and max(p for p, _ in pts) / min(p for p, _ in pts) > 50:
                ax.set_xscale("log")
        elif pts:
            labels = sorted({str(p) for p, _ in pts})
            ax.scatter([labels.index(str(p)) for p, _ in pts], [v for _, v in pts], s=12)
            ax.set_xticks(range(len(labels)), labels)
        ax.set(title=f"value per {name}", xlabel=name, ylabel="value")
    if verification:
        ax = axes[2 + len(params)]
        pts = [(c["surrogate_value"], c["full_value"]) for c in verification["configs"]
               if c["full_value"] is not None]  # fmt: skip
        ax.scatter([p for p, _ in pts], [q for _, q in pts])
        ax.set(title=f"surrogate vs full model (Spearman {_fmt(verification.get('spearman'))})",
               xlabel="surrogate value", ylabel="full-model value")  # fmt: skip
    for ax in axes[panels:]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) else "-"


def _cell(v: Any) -> str:
    """A hyperparameter's table cell: numbers to 4 significant digits, blank when the trial has
    none (a conditional parameter, or a trial stopped before it was sampled)."""
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _state(t: optuna.trial.FrozenTrial) -> str:
    if is_put_back(t):
        return "WAITING (interrupted: resumes on the next run)"
    return "INTERRUPTED (asked again)" if is_interrupted(t) else t.state.name
