"""Live progress of a tuning run: a tqdm bar of finished trials, and a table of the best."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

import optuna
from optuna.trial import TrialState
from tqdm.auto import tqdm


class Progress:
    """A tqdm bar over a study's ``n_trials``: trials done, best value so far, and an ETA.

    ``update()`` may be called as often as every training step; it re-reads the study at most
    every ``interval`` seconds. ``close()`` ends the bar and prints :func:`top_table`.

    Args:
        study: the study being tuned.
        n_trials: the total the run aims for.
        finished: counts the study's finished trials (the driver's own rule).
        file: where to write (default stderr).
        interval: seconds between reads of the study.
    """

    def __init__(
        self,
        study: optuna.Study,
        n_trials: int,
        finished: Callable[[optuna.Study], int],
        file: TextIO | None = None,
        interval: float = 0.5,
    ) -> None:
        self.study, self.finished, self.file = study, finished, file or sys.stderr
        self.bar = tqdm(total=n_trials, desc="trials", unit="trial", file=self.file,
                        mininterval=0.0, dynamic_ncols=True)  # fmt: skip
        self.bar.n = self.bar.last_print_n = min(finished(study), n_trials)
        self.bar.start_t = self.bar._time()  # ETA from this run's rate, not from resumed trials
        self.interval = interval
        self._last = -interval
        # mean live members per fused step out of ``fuse`` (continuous batching), when known
        self.occupancy: float | None = None
        self.update()

    def note(self, line: str) -> None:
        """Print ``line`` above the bar."""
        self.bar.write(line, file=self.file)

    def update(self) -> None:
        now = self.bar._time()
        if now - self._last < self.interval:
            return
        self._last = now
        done = min(self.finished(self.study), self.bar.total)
        text = postfix(self.study)
        if self.occupancy is not None:
            text += f", slots busy {self.occupancy:.0%}"
        self.bar.set_postfix_str(text, refresh=False)
        self.bar.update(done - self.bar.n)
        self.bar.refresh()

    def close(self) -> None:
        self._last = -self.interval
        try:
            self.update()
        finally:  # a bar left open is redrawn at exit, after whatever was printed last
            self.bar.close()
        print(top_table(self.study), file=self.file, flush=True)


def postfix(study: optuna.Study) -> str:
    """The bar's text after the count: the best value so far, and the trials that did not
    finish well (an interrupted trial, asked again, is not a failure)."""
    from hydro.tuning.report import trial_counts

    best = best_value(study)
    counts = trial_counts(study)
    parts = ["best " + ("-" if best is None else f"{best:.4g}")]
    parts += [f"{key} {counts[key]}" for key in ("pruned", "failed", "interrupted") if counts[key]]
    return ", ".join(parts)


def best_value(study: optuna.Study) -> float | None:
    """The study's best value so far, or None before any complete trial."""
    try:
        return float(study.best_value)
    except ValueError:
        return None


def top_table(study: optuna.Study, k: int = 5) -> str:
    """The ``k`` best complete trials of ``study`` as a plain-text table.

    Example:
        >>> import optuna
        >>> study = optuna.create_study()
        >>> study.optimize(lambda t: t.suggest_float("x", 0, 1) ** 2, n_trials=3)
        >>> print(top_table(study).splitlines()[0])
        top 3 of 3 complete trials (minimize)
    """
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    reverse = study.direction == optuna.study.StudyDirection.MAXIMIZE
    top = sorted(complete, key=lambda t: t.value, reverse=reverse)[:k]
    head = f"top {len(top)} of {len(complete)} complete trials ({study.direction.name.lower()})"
    if not top:
        return head
    names = sorted({n for t in top for n in t.params})
    rows = [["trial", "value", *names]]
    rows += [[str(t.number), f"{t.value:.6g}", *(_fmt(t.params.get(n)) for n in names)]
             for t in top]  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([head, *lines])


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)
