"""Python's cyclic garbage collector paused over work that allocates many long-lived objects.

Loading torch, Optuna and Hydro leaves some 400,000 objects; building a fused group allocates
tens of thousands more that live on (graph nodes, fake tensors, modules). The collections their
allocation triggers traverse them again and again to find next to nothing: about a fifth of a
warm group build, and 0.5 s of a command's imports. Standard library only: the CLI imports it
before torch.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused(*, freeze: bool = False) -> Iterator[None]:
    """The collector off inside (a ``with`` block, or a decorator: ``@collector_paused()``),
    back on after, an error included; left as it was found when it was already off.

    ``freeze``: what the process holds on leaving is moved out of the collector's sight for good
    (:func:`gc.freeze`, the standard library's recipe before a fork): modules, classes and
    functions that live as long as the process. Without it, the first collections of young
    objects after the pause go through all of them once more (0.4 s after the imports). Only for
    a process whose objects are all of that kind (the console script, before it loads torch): a
    cycle among frozen objects is never collected. Unfrozen, every cycle dropped inside is
    collected once the collector runs again."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        gc.enable()


__all__ = ["collector_paused"]
