"""How honest is the progress ETA? A real ``hydro.tune`` of ``examples/charlm`` (the README's
main job, scaled down: two fused cohorts and the median pruner), every progress update recorded
with its time, then the ETA each showed against the time that actually remained.

The progress lines (stderr is not a terminal here) are caught as they are written, every
update printed (the plain lines' throttle is off), and parsed: ``eta M:SS`` is what a user
reads. The table gives, at each update, the fraction of the run gone, the ETA shown, the time
that actually remained (until the last line) and the error in percent; then the largest error
from 10% of the run on (and from 10% to 90%: in the last seconds a second of rounding is a
large share of what remains).

    python benchmarks/progress_eta.py                      # ~1-2 min on one CPU thread
    python benchmarks/progress_eta.py --load run.json      # the table of a run saved by --save
    python benchmarks/progress_eta.py --trials 32 --fuse 16 --steps 200 --eval-every 50 \
        --batch 32                                         # the README's main job (long)
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import time

LINE = re.compile(r"trial-steps (\d+)/(\d+) \((\d+)%\), trials (\d+)/(\d+), .*eta (\?|[\d:]+),")


class Recorder:
    """A stand-in for stderr that keeps each progress line with the time it was written."""

    def __init__(self, echo: bool) -> None:
        self.lines: list[tuple[float, str]] = []
        self.echo = echo

    def write(self, text: str) -> int:
        now = time.monotonic()
        for line in text.splitlines():
            if line.startswith("trial-steps "):
                self.lines.append((now, line))
        if self.echo:
            sys.__stderr__.write(text)
        return len(text)

    def flush(self) -> None:
        sys.__stderr__.flush()

    def isatty(self) -> bool:
        return False


def seconds(text: str) -> float:
    """``M:SS`` or ``H:MM:SS`` in seconds."""
    total = 0
    for part in text.split(":"):
        total = total * 60 + int(part)
    return float(total)


def run(args: argparse.Namespace) -> tuple[list[tuple[float, str]], float, dict]:
    """Tune; returns the progress lines with their times, the start time and the trial
    states."""
    import optuna
    import torch

    import hydro
    from examples.charlm.data import load
    from examples.charlm.model import gpt
    from hydro.tuning.progress import Progress

    torch.set_num_threads(args.threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    D = optuna.distributions
    space = {"lr": D.FloatDistribution(1e-4, 3e-2, log=True),
             "weight_decay": D.FloatDistribution(0.0, 0.2),
             "warmup": D.IntDistribution(0, max(1, args.steps // 4)),
             "dropout": D.FloatDistribution(0.0, 0.2),
             "beta2": D.CategoricalDistribution([0.95, 0.99, 0.999])}
    data = load(block_size=args.block, max_chars=args.chars)
    task = hydro.Task(model=functools.partial(gpt, n_layer=4, n_head=4, n_embd=256,
                                              block_size=args.block),
                      train_data=data["train"], val_data=data["val"], loss="cross_entropy",
                      optimizer="adamw", scheduler="cosine", steps=args.steps,
                      eval_every=args.eval_every, batch_size=args.batch)
    Progress.line_seconds, Progress.line_fraction = 0.0, 0.0  # a line at every update
    recorder = Recorder(args.echo)
    sys.stderr = recorder
    try:
        start = time.monotonic()
        result = hydro.tune(task, space, n_trials=args.trials, ratio=8, fuse=args.fuse,
                            storage="sqlite:///:memory:", seed=args.seed, progress=True,
                            pruner=optuna.pruners.MedianPruner())
    finally:
        sys.stderr = sys.__stderr__
    states: dict[str, int] = {}
    for t in result.study.trials:
        states[t.state.name] = states.get(t.state.name, 0) + 1
    return recorder.lines, start, states


def table(lines: list[tuple[float, str]], start: float) -> tuple[str, float, float, float, float]:
    """The table; the largest |error| % from 10% of the run on, from 10% to 90%, the largest
    |error| in seconds from 10% on, and the fraction of the run when the first ETA showed."""
    end = lines[-1][0]
    rows = ["  run%  trial-steps%  eta shown  remaining  error%"]
    worst = worst_mid = worst_s = 0.0
    first = None
    for t, line in lines:
        m = LINE.search(line)
        if m is None:
            raise ValueError(f"unparsed progress line: {line!r}")
        frac = (t - start) / (end - start)
        remaining = end - t
        shown = None if m[6] == "?" else seconds(m[6])
        if shown is not None and first is None:
            first = frac
        err = None
        if shown is not None and remaining > 0:
            err = 100 * (shown - remaining) / remaining
            if frac >= 0.1:
                worst = max(worst, abs(err))
                worst_s = max(worst_s, abs(shown - remaining))
                if frac <= 0.9:
                    worst_mid = max(worst_mid, abs(err))
        rows.append(f"{100 * frac:6.1f}  {m[3]:>12}  {m[6]:>9}  {remaining:9.1f}  "
                    + ("-" if err is None else f"{err:+6.1f}"))
    return "\n".join(rows), worst, worst_mid, worst_s, 1.0 if first is None else first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--fuse", type=int, default=16)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--chars", type=int, default=50000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--echo", action="store_true", help="also show the progress lines")
    p.add_argument("--save", help="also write the lines and their times here (JSON)")
    p.add_argument("--load", help="no run: the table of the lines --save wrote there")
    args = p.parse_args()
    if args.load:
        with open(args.load) as f:
            saved = json.load(f)
        lines, start, states = saved["lines"], saved["start"], saved.get("states", "?")
        args = argparse.Namespace(**{**saved["args"], "load": args.load})
    else:
        lines, start, states = run(args)
    if args.save and not args.load:
        with open(args.save, "w") as f:
            json.dump({"start": start, "lines": lines, "args": vars(args), "states": states}, f)
    text, worst, worst_mid, worst_s, first = table(lines, start)
    print(text)
    print(f"charlm ratio 8, {args.trials} trials, fuse {args.fuse}, {args.steps} steps "
          f"(eval every {args.eval_every}), batch {args.batch}, {args.threads} thread(s): "
          f"{lines[-1][0] - start:.1f} s, {len(lines)} updates, trials {states}")
    print(f"first ETA at {100 * first:.1f}% of the run; largest ETA error from 10% of the run "
          f"on: {worst:.1f}% ({worst_s:.1f} s); from 10% to 90%: {worst_mid:.1f}%")


if __name__ == "__main__":
    main()
