"""Live progress of a tuning run, counted in trial-steps, and a table of the best at the end.

A fused group's trials often all finish at its last step, so a count of finished trials sits
at 0 for the whole first cohort and then jumps. :class:`Progress` counts *trial-steps*
instead: the planned total is ``n_trials x task.steps``; a running trial counts the steps it
trained (in this process after every fused step, from an executor at each evaluation it
reports), and a finished trial counts its whole budget, whatever ended it. A pruned trial's
remaining steps thus count as done: the rate the ETA divides by is then the rate at which the
run gets through its planned budget, pruning included, so once pruning has started the ETA
expects later trials to be pruned about as often as earlier ones (rather than expecting every
later trial to train to the end, which overstates the time left whenever the pruner works).
The ETA is shown from the run's first evaluation on, so that the rate includes its cost, or
once the rate covers :attr:`Progress.eta_fraction` (2%) of the run, whichever comes first (the
README's main job evaluates first at 12% of its run).

On a terminal (or in a notebook) a tqdm bar is redrawn in place; elsewhere (a pipe, a file, a
CI log) one plain line is written per update, at most every :attr:`Progress.line_seconds`
seconds or :attr:`Progress.line_fraction` of the run (and once when the first ETA is known),
so logs stay short.

Before the first trial-step is trained, the ETA's place tells what the run is doing
(:meth:`Progress.phase`: ``starting 2 workers``, ``capturing the model``...): a start-up that
takes minutes on a loaded machine (workers importing torch, a first capture, a first compile)
says so rather than showing ``eta ?``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import optuna
from optuna.trial import TrialState

# the mark of a best value that is a running trial's intermediate value (no trial completed)
INTERIM = "*"


class Eta:
    """Seconds left in a run of ``total`` trial-steps, from the rate measured since its first
    advance (so a run's start-up, and the trial-steps a resumed study had done already, do not
    skew it).

    :meth:`observe` takes the trial-steps done now. The rate is measured up to the last
    advance; between advances (an executor reports only at evaluations) the estimate counts
    down with the clock instead of growing as if the run had stalled.

    Args:
        total: the planned trial-steps.
        clock: seconds, monotonic (injected by tests).

    Example:
        >>> now = [0.0]
        >>> eta = Eta(100, clock=lambda: now[0])
        >>> eta.observe(0) is None  # start-up: no advance yet
        True
        >>> now[0] = 2.0
        >>> eta.observe(10) is None  # the first advance: the rate is measured from here
        True
        >>> now[0] = 7.0
        >>> eta.observe(20)  # 10 steps in 5 s: 80 left take 40 s
        40.0
        >>> now[0] = 17.0
        >>> eta.observe(20)  # no advance since: 10 s of the 40 have passed
        30.0
    """

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.clock = total, clock
        self.origin: tuple[float, int] | None = None  # (time, done) of the first advance
        self.last: tuple[float, int] | None = None  # (time, done) of the latest advance
        self.base: int | None = None  # done at the first observation

    def observe(self, done: int) -> float | None:
        """Seconds left, given ``done`` trial-steps now; ``None`` until there is a rate."""
        now = self.clock()
        if self.base is None:
            self.base = done
        if self.origin is None:
            if done <= self.base and done < self.total:
                return None
            self.origin = self.last = (now, done)
        elif done > self.last[1]:
            self.last = (now, done)
        if done >= self.total:
            return 0.0
        (t0, d0), (t1, d1) = self.origin, self.last
        if d1 <= d0 or t1 <= t0:
            return None
        left = (self.total - d1) * (t1 - t0) / (d1 - d0)
        return max(0.0, left - (now - t1))


class Progress:
    """The progress of a tuning run on ``file``: trial-steps done out of the planned total,
    trials finished out of ``n_trials``, elapsed time, ETA, the best value, and at the end a
    table of the five best trials.

    The best value is the study's best complete trial (``best 1.234``); before any trial
    completed, the best intermediate value reported in this run, marked ``best~1.234*``.

    The driver calls :meth:`stepped` and :meth:`reported` as trials train, :meth:`ended` when
    one is told, :meth:`update` as often as it likes (the study is read at most every
    ``interval`` seconds, or after a trial ended) and :meth:`close` at the end.

    Args:
        study: the study being tuned.
        n_trials: the finished trials the run aims for.
        finished: counts the study's finished trials (the driver's own rule).
        steps: each trial's training steps (``task.steps``); ``None`` (a group callback, whose
            steps Hydro does not know) counts whole trials.
        file: where to write (default stderr).
        interval: seconds between reads of the study (and redraws of a bar).
        mode: ``"bar"`` (a redrawn tqdm bar) or ``"lines"`` (a plain line per update);
            default ``"bar"`` on a terminal or in a notebook, else ``"lines"``.
        clock: seconds, monotonic (injected by tests).
    """

    line_seconds = 30.0  # "lines": at most one line this often, unless the run moved on by ...
    line_fraction = 0.05  # ... this fraction of its trial-steps
    eta_fraction = 0.02  # the ETA is shown once its rate covers this much (or at an evaluation)

    def __init__(
        self,
        study: optuna.Study,
        n_trials: int,
        finished: Callable[[optuna.Study], int],
        steps: int | None = None,
        file: TextIO | None = None,
        interval: float = 0.5,
        mode: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.study, self.n_trials, self.finished = study, n_trials, finished
        self.file = file or sys.stderr
        self.per_trial = steps or 1  # a callback's trials count whole
        self.counts_steps = steps is not None
        self.total = n_trials * self.per_trial
        self.interval, self.clock = interval, clock
        self.mode = mode or ("bar" if interactive(self.file) else "lines")
        self.eta = Eta(self.total, clock)
        self.started = clock()
        self.running: dict[int, int] = {}  # trial -> trial-steps trained, until it is told
        self.interim: float | None = None  # best intermediate value reported in this run
        # no ETA before this run's first evaluation: until then the rate leaves out its cost
        self.evaluated = not self.counts_steps
        self.maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
        # mean live members per fused step out of ``fuse`` (continuous batching), when known
        self.occupancy: float | None = None
        self.done_trials = 0
        self.best: float | None = None  # the study's best complete value, when read
        self.done = 0  # trial-steps shown (never goes back)
        self.text = ""
        self._read_at: float | None = None  # when the study was last read; None: read next
        self._drawn_at = -float("inf")
        self._line: tuple[float, int, tuple] | None = None  # (time, done, news): last line
        self._no_eta = True  # the last line had no ETA: the first one gets a line of its own
        self.doing: str | None = None  # the start-up phase (:meth:`phase`), until a step trains
        self.bar = None
        if self.mode == "bar":
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, file=self.file, dynamic_ncols=True, mininterval=0.0,
                            desc="trial-steps" if self.counts_steps else "trials",
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}"
                                       "{postfix}")
        self.update()

    # -- what the driver tells it -------------------------------------------------------------

    def stepped(self, number: int, step: int) -> None:
        """Trial ``number`` has trained ``step`` steps (in this run's process or a worker)."""
        if self.counts_steps and step > self.running.get(number, 0):
            self.running[number] = min(step, self.per_trial)

    def reported(self, number: int, step: int, value: float) -> None:
        """Trial ``number`` reported intermediate ``value`` at ``step`` (an evaluation)."""
        self.stepped(number, step)
        self.evaluated = True
        if value == value and (self.interim is None  # not NaN
                               or (value > self.interim if self.maximize
                                   else value < self.interim)):
            self.interim = float(value)
        self.update()

    def ended(self, number: int) -> None:
        """Trial ``number`` was told: the study's count of finished trials has it now."""
        self.running.pop(number, None)
        self._read_at = None

    def phase(self, text: str) -> None:
        """Say what the run is doing before its first trial-step (``starting 2 workers``,
        ``capturing the model``, ``first fused step``): shown in place of the ETA, with the
        time elapsed, until a step is trained; ignored from then on."""
        if self.started_training() or text == self.doing:
            return
        self.doing = text
        self.update(force=True)

    def started_training(self) -> bool:
        """Whether a trial-step was trained (or a trial finished) in this run."""
        return self.eta.origin is not None

    def note(self, line: str) -> None:
        """Print ``line`` (above the bar, if there is one)."""
        if self.bar is not None:
            self.bar.write(line, file=self.file)
        else:
            print(line, file=self.file, flush=True)

    def _rate_known(self) -> bool:
        """Whether the step rate covers :attr:`eta_fraction` of the run (a long first cohort
        would otherwise show no ETA until its first evaluation)."""
        origin = self.eta.origin
        return origin is not None and self.done - origin[1] >= self.eta_fraction * self.total

    # -- drawing ----------------------------------------------------------------------------

    def update(self, force: bool = False) -> None:
        """Refresh what is shown (cheap when called often: see the class)."""
        now = self.clock()
        if force or self._read_at is None or now - self._read_at >= self.interval:
            self._read_at = now
            self.done_trials = min(self.finished(self.study), self.n_trials)
            self.best = best_value(self.study)
            self.text = postfix(self.study)
        done = self.done_trials * self.per_trial + sum(self.running.values())
        self.done = max(self.done, min(done, self.total))
        left = self.eta.observe(self.done)  # observed from the first advance on, ...
        left = left if self.evaluated or self._rate_known() else None  # ... shown once trusted
        if self.bar is not None:
            if not force and now - self._drawn_at < self.interval:
                return
            self._drawn_at = now
            self.bar.set_postfix_str(self.describe(left, now, plain=False), refresh=False)
            self.bar.update(self.done - self.bar.n)
            self.bar.refresh()
            return
        # news: what changed besides the clocks (elapsed, the ETA's countdown)
        news = (
            self.done,
            self.done_trials,
            self.best,
            self.interim,
            self.text,
            self.occupancy,
            self.doing,
        )
        last = self._line
        if last is not None and not force and not (left is not None and self._no_eta):
            moved = self.done - last[1] >= self.line_fraction * self.total
            if not moved and (now - last[0] < self.line_seconds or news == last[2]):
                return
        self._line, self._no_eta = (now, self.done, news), left is None
        print(self.describe(left, now, plain=True), file=self.file, flush=True)

    def describe(self, left: float | None, now: float, plain: bool) -> str:
        """The text of one update (``plain``: a whole line; else what follows the bar)."""
        parts = []
        if plain:
            unit = "trial-steps" if self.counts_steps else "trials"
            pct = 100 * self.done / self.total if self.total else 100.0
            parts.append(f"{unit} {self.done}/{self.total} ({pct:.0f}%)")
        if self.counts_steps or not plain:
            parts.append(f"trials {self.done_trials}/{self.n_trials}")
        parts.append(f"elapsed {clock_text(now - self.started)}")
        if self.doing is not None and not self.started_training():
            parts.append(self.doing)  # what the start-up is doing, in the ETA's place
        else:
            parts.append(f"eta {'?' if left is None else clock_text(left)}")
        if self.best is not None:
            parts.append(f"best {self.best:.4g}")
        elif self.interim is not None:
            parts.append(f"best~{self.interim:.4g}{INTERIM}")
        else:
            parts.append("best -")
        if self.text:
            parts.append(self.text)
        if self.occupancy is not None:
            parts.append(f"slots busy {self.occupancy:.0%}")
        return ", ".join(parts)

    def close(self) -> None:
        """The last update, the bar closed, and :func:`top_table`."""
        try:
            self.update(force=True)
        finally:  # a bar left open is redrawn at exit, after whatever was printed last
            if self.bar is not None:
                self.bar.close()
        print(top_table(self.study), file=self.file, flush=True)


def wanted(progress: bool | None, file: TextIO | None = None) -> bool:
    """Whether to show progress: ``progress`` itself, or for ``None`` (auto) whether ``file``
    (default stderr) is a terminal or this runs in a Jupyter/IPython kernel."""
    if progress is None:
        return interactive(file or sys.stderr)
    if not isinstance(progress, bool):
        from hydro.errors import ConfigError

        raise ConfigError(f"progress must be True, False or None (auto), got {progress!r}")
    return progress


def interactive(file: TextIO) -> bool:
    """Whether ``file`` is a terminal, or stdout/stderr inside a notebook's kernel (whose
    widgets show a bar where a terminal would)."""
    try:
        if file.isatty():
            return True
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
    return file in (sys.stderr, sys.stdout) and _in_kernel()


def _in_kernel() -> bool:
    ipython = sys.modules.get("IPython")  # never imported here: only if the user's session did
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def clock_text(seconds: float) -> str:
    """``seconds`` as ``M:SS`` or ``H:MM:SS``."""
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def postfix(study: optuna.Study) -> str:
    """The trials that did not finish well (an interrupted trial, asked again, is not a
    failure), e.g. ``pruned 3, failed 1``."""
    from hydro.tuning.report import trial_counts

    counts = trial_counts(study)
    parts = [f"{key} {counts[key]}" for key in ("pruned", "failed", "interrupted") if counts[key]]
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
             for t in top]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([head, *lines])


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)
