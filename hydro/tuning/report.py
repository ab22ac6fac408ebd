"""``hydro report``: a study at a glance, as an HTML page or a PNG."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Callable
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.trial import TrialState

from hydro.files import replacing, write_text
from hydro.tuning.selection import SELECTION
from hydro.tuning.space import trained_params

FIGURE_SUFFIXES = (".png", ".pdf", ".svg")
PAGE_SUFFIXES = (".html", ".htm")


BELOW_FLOOR = "hydro_below_floor"  # study attribute: the layers its ratio takes below their floor


def below_floor_line(ratio: int, below: list[str]) -> str:
    """What a study says of a ratio that takes layers below their width floor, where its
    results are read (the top of ``hydro tune``'s output, the export, the report)."""
    shown = "; ".join(below[:3]) + (f"; and {len(below) - 3} more" if len(below) > 3 else "")
    return (f"BELOW THE WIDTH FLOOR: ratio {ratio} takes {len(below)} layer(s) below the width "
            f"at which the best learning rate was measured to transfer ({shown}); the "
            "surrogate's choice may not be the full model's: a smaller ratio, or ratio auto, "
            "stays within the floors")


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
    """Optimization history, learning curves (each pruned trial marked at its last report),
    value per hyperparameter on the axis its distribution implies and, when the study was
    verified on the full model, surrogate-vs-target agreement (docs/how-to/read-the-report.md
    says what each mark means). ``.png``, ``.pdf`` and ``.svg`` write one figure; ``.html`` a
    self-contained page; other suffixes are refused (``ConfigError``)."""
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
    below = study.user_attrs.get(BELOW_FLOOR)
    ratio = next((t.user_attrs.get("ratio") for t in study.get_trials(deepcopy=False)
                  if t.user_attrs.get("ratio")), "?")
    warning = (f'<p style="color:firebrick"><b>{html.escape(below_floor_line(ratio, below))}'
               "</b></p>" if below else "")
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<title>Hydro study {html.escape(study.study_name)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;font-size:12px}}</style></head><body>
<h1>Study {html.escape(study.study_name)}</h1>{warning}
<p>{html.escape(_summary(trial_counts(study)))}<br>{best}</p>
<img src="data:image/png;base64,{image}" style="max-width:100%">
<p style="font-size:13px">{_KEY}</p>
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
    return (
        f"<table><tr><th>#</th><th>state</th><th>value</th>{heads}<th>fail reason</th>"
        f"</tr>{rows}</table>"
    )


# what the figure's marks mean, under it on the HTML page
_KEY = (
    "Blue: complete trials (dots: final values; lines: learning curves). Red crosses: pruned "
    "trials at their last report, the value the pruner stopped them on (a trial pruned at its "
    "first report is a cross without a line); red ticks along a panel's bottom: where pruned "
    "trials sat on that axis. Orange: the best trial (star, thick curve) and the best value so "
    "far. Each hyperparameter's axis follows its distribution (log, linear, integer or one "
    "column per choice) over the searched range."
)

# the figure's marks, one style each, so the legend, the page and the docs say the same
_COMPLETE = "C0"
_PRUNED = "C3"
_BEST = "C1"
# a learning curve is drawn through at most this many of its reports (evenly spaced, its last
# one always kept), so a study of long runs still draws in bounded time
_CURVE_POINTS = 200


def _figure(study: optuna.Study) -> Any:
    """The report's figure: optimization history, learning curves with a mark at each pruned
    trial's last report, one panel per hyperparameter on the axis its distribution implies and,
    when the study was verified on the full model, surrogate against full-model values."""
    import matplotlib.pyplot as plt

    trials = [t for t in study.get_trials(deepcopy=False) if not is_surplus(t)]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    dists = _distributions(trials)
    verification = study.user_attrs.get("hydro_verification")
    panels = 2 + len(dists) + (1 if verification else 0)
    cols = min(3, panels)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
    axes = [ax for row in axes for ax in row]
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    ranked = sorted(complete, key=lambda t: t.value, reverse=maximize)  # type: ignore[arg-type]
    best = ranked[0] if ranked else None
    _history(axes[0], complete, pruned, best, maximize)
    _curves(axes[1], complete, pruned, best)
    for ax, (name, dist) in zip(axes[2:], dists.items()):
        _param_panel(ax, name, dist, complete, pruned, best,
                     (study.user_attrs.get(SELECTION) or {}).get("ranges", {}).get(name))
    if verification:
        ax = axes[2 + len(dists)]
        pts = [
            (c["surrogate_value"], c["full_value"])
            for c in verification["configs"]
            if c["full_value"] is not None
        ]
        ax.scatter([p for p, _ in pts], [q for _, q in pts])
        ax.set(
            title=f"surrogate vs full model (Spearman {_fmt(verification.get('spearman'))})",
            xlabel="surrogate value",
            ylabel="full-model value",
        )
    for ax in axes[panels:]:
        ax.axis("off")
    title = f"study {study.study_name}: {_summary(trial_counts(study))}"
    below = study.user_attrs.get(BELOW_FLOOR)
    if below:  # the choice was made below the width floor: said where the results are read
        title += f"\nBELOW THE WIDTH FLOOR: {len(below)} layer(s) under their floor at this ratio"
    fig.suptitle(title, fontsize=11, color="firebrick" if below else "black")
    fig.tight_layout()
    return fig


def _summary(counts: dict[str, int]) -> str:
    """``"64 trials: 31 complete, 33 pruned"``, naming only the outcomes that occurred."""
    parts = [
        f"{counts[k]} {k}"
        for k in ("complete", "pruned", "failed", "interrupted", "running")
        if counts[k]
    ]
    total = sum(counts[k] for k in ("complete", "pruned", "failed", "interrupted", "running"))
    return f"{total} trial{'s' * (total != 1)}" + (": " + ", ".join(parts) if parts else "")


def _alpha(n: int, full: float = 0.8, floor: float = 0.12) -> float:
    """Opacity for ``n`` overlapping marks: opaque when few, fainter as they pile up, so that
    dense regions darken instead of one colour covering everything."""
    return max(floor, min(full, 12.0 / max(n, 1)))


def _last_report(t: optuna.trial.FrozenTrial) -> tuple[int, float] | None:
    if not t.intermediate_values:
        return None
    step = max(t.intermediate_values)
    return step, t.intermediate_values[step]


def _history(ax: Any, complete: list, pruned: list, best: Any, maximize: bool) -> None:
    """Each complete trial's value by trial number, the best so far, and each pruned trial
    at the value of its last report (what the pruner judged it by)."""
    marks = [(t.number, r[1]) for t in pruned if (r := _last_report(t)) is not None]
    clamp = _fit(ax, [[t.value] for t in complete] + [[v] for _, v in marks])
    ax.scatter(
        [t.number for t in complete],
        clamp([t.value for t in complete]),
        s=14,
        color=_COMPLETE,
        alpha=_alpha(len(complete) / 4, floor=0.35),
        label=f"complete ({len(complete)})",
        gid="complete",
    )
    if pruned:
        ax.scatter(
            [n for n, _ in marks],
            clamp([v for _, v in marks]),
            marker="x",
            s=16,
            color=_PRUNED,
            alpha=_alpha(len(marks) / 4, floor=0.35),
            linewidths=1,
            label=f"pruned ({len(pruned)}): its last report",
            gid="pruned",
        )
    if best is not None:
        xs, ys, running = [], [], None
        for t in sorted(complete, key=lambda t: t.number):
            better = running is None or (t.value > running if maximize else t.value < running)
            running = t.value if better else running
            xs.append(t.number)
            ys.append(running)
        ax.step(xs, ys, where="post", color=_BEST, lw=1.5, label="best so far")
    ax.set(title="optimization history", xlabel="trial", ylabel="value")
    _legend(ax)


def _curves(ax: Any, complete: list, pruned: list, best: Any) -> None:
    """Learning curves: complete trials in blue, pruned ones in red ending in a cross at their
    last report (a trial pruned at its first report is a cross alone), the best trial on top."""
    from matplotlib.collections import LineCollection
    from matplotlib.ticker import MaxNLocator

    def segments(ts: list) -> list:
        out = []
        for t in ts:
            steps = sorted(t.intermediate_values)
            if len(steps) > 1:
                stride = max(1, math.ceil(len(steps) / _CURVE_POINTS))
                kept = steps[::stride] + ([steps[-1]] if (len(steps) - 1) % stride else [])
                out.append([(s, t.intermediate_values[s]) for s in kept])
        return out

    drawn = [(segments(complete), _COMPLETE), (segments(pruned), _PRUNED)]
    lines = [line for segs, _ in drawn for line in segs]
    alpha = _alpha(len(lines), full=0.6, floor=0.08)
    for segs, color in drawn:
        if segs:
            ax.add_collection(LineCollection(segs, colors=color, alpha=alpha, lw=1))
    ends = [r for t in pruned if (r := _last_report(t)) is not None]
    clamp = _fit(ax, [list(t.intermediate_values.values()) for t in complete + pruned])
    singles = [r for t in complete if len(t.intermediate_values) == 1 and (r := _last_report(t))]
    if singles:  # a complete trial that reported once draws a dot, not a line
        ax.scatter(
            [s for s, _ in singles],
            clamp([v for _, v in singles]),
            s=10,
            color=_COMPLETE,
            alpha=_alpha(len(singles) / 4, floor=0.35),
            gid="complete",
        )
    ax.plot([], [], color=_COMPLETE, lw=1, label=f"complete ({len(complete)})")
    if pruned:
        by_step: dict[int, int] = {}
        for s, _ in ends:
            by_step[s] = by_step.get(s, 0) + 1
        label = f"pruned ({len(pruned)}): x at its last report"
        if 1 < len(by_step) <= 6:  # few distinct steps: how many stopped at each
            parts = [
                f"{n} at {'step ' * (i == 0)}{s}"
                for i, (s, n) in enumerate(sorted(by_step.items()))
            ]
            label += "\n" + ", ".join(parts)
        elif len(by_step) == 1:
            label += f"\nall at step {next(iter(by_step))}"
        if len(ends) < len(pruned):
            label += f"\n{len(pruned) - len(ends)} pruned before any report"
        ax.scatter(
            [s for s, _ in ends],
            clamp([v for _, v in ends]),
            marker="x",
            s=22,
            color=_PRUNED,
            alpha=_alpha(len(ends) / 3, floor=0.4),
            linewidths=1.2,
            zorder=3,
            gid="pruned",
            label=label,
        )
    if best is not None and best.intermediate_values:
        [points] = segments([best]) or [sorted(best.intermediate_values.items())]
        ax.plot(
            [s for s, _ in points],
            [v for _, v in points],
            color=_BEST,
            lw=1.6,
            zorder=4,
            label=f"best (trial {best.number})",
        )
    if lines or ends:
        ax.autoscale_view()  # a collection does not scale the axes by itself
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    steps = {s for t in complete + pruned for s in t.intermediate_values}
    if steps and max(steps) - min(steps) < 2:  # one or two steps: whole numbers around them
        ax.set_xlim(min(steps) - 1, max(steps) + 1)
    ax.set(title="learning curves", xlabel="step", ylabel="reported value")
    _legend(ax)


def _fit(ax: Any, trials: list[list[float]]) -> Callable[[list[float]], list[float]]:
    """Fit ``ax``'s value axis to the bulk of the values (``trials``: each trial's values on
    this panel): a few far outliers (a diverged trial's loss of 1e3 beside values near 1)
    would flatten every other mark into a line. Returns the function that moves a mark beyond
    the limits onto the nearest edge, and notes on the axes how many trials lie beyond.

    A trial counts with its lowest and highest value only, so a long curve, dense where it
    flattens out, does not make its own early steps look like outliers."""
    import numpy as np

    spans = [(min(f), max(f)) for vs in trials if (f := [v for v in vs if math.isfinite(v)])]
    if len(spans) < 5:
        return lambda ys: ys
    finite = np.asarray([v for span in spans for v in span], dtype=float)
    q10, q90 = np.quantile(finite, [0.1, 0.9])
    spread = (q90 - q10) or abs(q90) or 1.0
    lo = max(float(finite.min()), q10 - 1.5 * spread)
    hi = min(float(finite.max()), q90 + 1.5 * spread)
    beyond = sum(bool(a < lo or b > hi) for a, b in spans)
    if not beyond:
        return lambda ys: ys
    pad = (hi - lo) * 0.06
    lo, hi = lo - pad, hi + pad
    ax.set_ylim(lo, hi)
    ax.annotate(
        f"{beyond} trial{'s' * (beyond != 1)} beyond the scale: marks at its edge",
        (0.01, 0.99),
        xycoords="axes fraction",
        ha="left",
        va="top",
        fontsize=6,
        color="0.35",
    )
    return lambda ys: [min(max(y, lo), hi) if math.isfinite(y) else y for y in ys]


def _legend(ax: Any) -> None:
    """A small legend whose marks are drawn opaque, however faint the many marks they stand
    for."""
    legend = ax.legend(fontsize=7, loc="best")
    for handle in legend.legend_handles:
        if handle is not None:
            handle.set_alpha(1)


def _distributions(trials: list) -> dict[str, BaseDistribution]:
    """Each sampled hyperparameter's distribution, by name (the latest trial's, should a
    dynamic space change one)."""
    dists: dict[str, BaseDistribution] = {}
    for t in trials:
        if t.state.is_finished():
            dists.update(t.distributions)
    return dict(sorted(dists.items()))


def _param_panel(
    ax: Any, name: str, dist: BaseDistribution, complete: list, pruned: list, best: Any,
    within: list | None = None,
) -> None:
    """Value per ``name``: a log axis for a log distribution, linear otherwise, integer ticks
    for an int one, the choices as categories (in their order, spread a little sideways so
    equal choices do not hide each other); the searched range as the axis limits; a tick
    along the bottom where each pruned trial sat; with a choice made with the seeds' noise,
    the range (or the choices) within noise of the best as a band."""
    from matplotlib.ticker import MaxNLocator

    pts = [(t, t.params[name]) for t in complete if name in t.params]
    cut = [t.params[name] for t in pruned if name in t.params]
    if isinstance(dist, CategoricalDistribution):
        choices = list(dist.choices)  # a study keeps one set of choices per name (Optuna)
        index = {_choice_key(c): i for i, c in enumerate(choices)}

        def x_of(v: Any, number: int = 0) -> float:
            return index[_choice_key(v)] + ((number * 0.618) % 1 - 0.5) * 0.3

        labels = ["None" if c is None else _cell(c) for c in choices]
        ax.set_xticks(range(len(choices)), labels)
        if len(choices) > 6 or sum(map(len, labels)) > 40:
            ax.tick_params(axis="x", labelrotation=45)
        ax.set_xlim(-0.5, len(choices) - 0.5)
        xs = [x_of(v, t.number) for t, v in pts]
        cut_xs = [x_of(v) for v in cut]
        kind = "categorical"
    else:
        seen = [float(v) for v in [v for _, v in pts] + cut]
        low = min([float(dist.low), *seen])  # type: ignore[attr-defined]
        high = max([float(dist.high), *seen])  # type: ignore[attr-defined]
        log = bool(getattr(dist, "log", False))
        if log:
            ax.set_xscale("log")
            pad = (high / low) ** 0.03
            ax.set_xlim(low / pad, high * pad)
        else:
            pad = (high - low) * 0.03 or 0.5
            ax.set_xlim(low - pad, high + pad)
            if isinstance(dist, IntDistribution):
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        xs = [v for _, v in pts]
        cut_xs = list(cut)
        kind = ("log" if log else "linear") + (", int" if isinstance(dist, IntDistribution) else "")
    clamp = _fit(ax, [[t.value] for t, _ in pts])
    ax.scatter(
        xs,
        clamp([t.value for t, _ in pts]),
        s=14,
        color=_COMPLETE,
        alpha=_alpha(len(pts) / 4, floor=0.35),
        gid="complete",
    )
    if cut_xs:
        ax.plot(
            cut_xs,
            [0.0] * len(cut_xs),
            "|",
            color=_PRUNED,
            ms=9,
            alpha=_alpha(len(cut_xs) / 3, floor=0.3),
            gid="pruned",
            transform=ax.get_xaxis_transform(),
            label=f"pruned ({len(cut_xs)}): tried here",
        )
    if within:
        spans = ([(index[_choice_key(c)] - 0.4, index[_choice_key(c)] + 0.4) for c in choices
                  if str(c) in within] if kind == "categorical"
                 else [(float(within[0]), float(within[1]))])
        for k, (lo, hi) in enumerate(spans):
            ax.axvspan(lo, hi, color=_BEST, alpha=0.15, lw=0, gid="within",
                       label="within noise of the best" if k == 0 else None)
    if best is not None and name in best.params:
        bx = xs[[t.number for t, _ in pts].index(best.number)]
        ax.scatter(
            [bx],
            clamp([best.value]),
            marker="*",
            s=120,
            color=_BEST,
            zorder=4,
            edgecolors="black",
            linewidths=0.5,
            label="best",
        )
    if cut_xs or best is not None or within:
        _legend(ax)
    ax.set(title=f"value per {name} ({kind})", xlabel=name, ylabel="value")


def _choice_key(v: Any) -> str:
    """A categorical choice as the study stores it (a JSON-able value), for matching."""
    return f"{type(v).__name__}:{v!r}"


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
