"""What compiling a fused group cost and bought, measured on this machine and kept on disk.

``compile="auto"`` decides from the seconds a compile would take and the speed-up it would
give (:func:`hydro.tuning.compiling.decide`). Without a measurement both are estimates of a
cold compile, which on a CPU costs minutes; but inductor's own on-disk caches (its FX graph
cache and AOTAutograd's) make the next compile of the same graph take seconds. So the first
compile of a fused graph is timed, with the compiled steps that follow, and the figures are
kept per (fused graph, fusion size, device, compile mode, torch version): the next search of
the same model decides from what compiling cost here last time, and says so.

Records live beside the capture cache's entries (:func:`hydro.fx.cache.directory`, checked
the same way: this user's alone, else not used) as ``<key>.hydro-compile`` JSON files, and
inductor's caches go to its ``inductor`` folder (unless ``TORCHINDUCTOR_CACHE_DIR`` is set),
so that they outlive ``/tmp`` and sit under the same check. A record that does not parse, or
is of another key, is ignored: it can only change a decision, never what is trained.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable
from typing import Any

SUFFIX = ".hydro-compile"
VERSION = 1


def key(codes: Iterable[str], n: int, device: Any, mode: Any) -> str:
    """The record's key: the fused graphs' code, the fusion size, the device's kind, the
    compile mode and torch's version."""
    import torch

    h = hashlib.sha256()
    for part in (*codes, str(n), str(device).split(":")[0], str(mode), torch.__version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def load(k: str) -> dict[str, float | None] | None:
    """The record of ``k``: ``{"compile_s", "speedup"}`` (``speedup`` ``None`` where only
    compiled steps were timed: ``compile=True``), or ``None`` (none, another key's,
    unreadable, not this user's folder)."""
    from hydro.fx import cache

    if not cache.enabled() or not os.path.isdir(cache.directory()) or not cache.is_private():
        return None
    try:
        with open(os.path.join(cache.directory(), k + SUFFIX)) as f:
            data = json.load(f)
        speedup = data["speedup"]
        record = {"compile_s": float(data["compile_s"]),
                  "speedup": None if speedup is None else float(speedup)}
        if data.get("key") != k or data.get("version") != VERSION:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not all(math.isfinite(v) and v > 0 for v in record.values() if v is not None):
        return None
    return record


def store(k: str, compile_s: float, speedup: float | None) -> bool:
    """Keep what compiling ``k`` cost (seconds) and bought (eager step / compiled step;
    ``None``: not measured)."""
    from hydro.fx import cache

    if not cache.enabled():
        return False
    data = {"version": VERSION, "key": k, "compile_s": round(max(compile_s, 0.01), 3),
            "speedup": None if speedup is None else round(max(speedup, 0.01), 4)}
    path = os.path.join(cache.directory(), k + SUFFIX)

    def write(tmp: str, secret: bytes) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f)

    return cache.write_entry(path, write)


def use_private_inductor_cache() -> None:
    """Point inductor's on-disk caches into Hydro's cache folder (unless the user chose a
    folder with ``TORCHINDUCTOR_CACHE_DIR``), where they outlive ``/tmp`` and are checked."""
    from hydro.fx import cache

    if "TORCHINDUCTOR_CACHE_DIR" in os.environ or not cache.enabled() or not cache.is_private():
        return
    folder = os.path.join(cache.directory(), "inductor")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError:
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
