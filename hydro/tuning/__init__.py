"""Tuning, one module a part of a run: its options (:mod:`~hydro.tuning.options`), the one
function that runs it (:mod:`~hydro.tuning.run`), what it trains (:mod:`~hydro.tuning.task`,
:mod:`~hydro.tuning.loop`), the engine (:mod:`~hydro.tuning.engine`, with stream, fleet,
slots and group), the study's bookkeeping (:mod:`~hydro.tuning.bookkeeping`) and the outputs
(:mod:`~hydro.tuning.outputs`: the result and the export; :mod:`~hydro.tuning.verification`:
the check on the full model; :mod:`~hydro.tuning.report`).

Names are imported on first use (PEP 562), so :mod:`hydro.tuning.options` loads without torch.
"""

import importlib as _importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hydro.tuning.loop import Loop, Run
    from hydro.tuning.options import TuneOptions
    from hydro.tuning.outputs import TuneResult, export
    from hydro.tuning.task import Task
    from hydro.tuning.tune import tune
    from hydro.tuning.verification import verify

_LAZY = {"Task": "hydro.tuning.task", "Loop": "hydro.tuning.loop", "Run": "hydro.tuning.loop",
         "TuneOptions": "hydro.tuning.options", "TuneResult": "hydro.tuning.outputs",
         "export": "hydro.tuning.outputs", "tune": "hydro.tuning.tune",
         "verify": "hydro.tuning.verification"}

__all__ = ["Loop", "Run", "Task", "TuneOptions", "TuneResult", "export", "tune", "verify"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hydro.tuning' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
