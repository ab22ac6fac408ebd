"""When reading a tensor's value on the host is free.

On an accelerator, reading a device value on the host (``.item()``, ``.tolist()``, ``bool(t)``)
waits until every queued kernel has run: the device idles while Python catches up, and with the
small kernels of a surrogate that wait can cost more than the step. So the training loop keeps its
per-trial flags and losses on the device and reads them together, once per evaluation. On a CPU
the value is in host memory already, and reading it early can buy something: the fused
optimizer reads its divergence flags to skip a masking pass that is a no-op while every trial
is live.

Example:
    >>> reads_are_free("cpu"), reads_are_free("cuda")
    (True, False)
"""

from __future__ import annotations

from typing import Any

import torch

#: Device types whose tensors live in host memory (tests empty it to run the accelerator path).
FREE = {"cpu"}


def reads_are_free(device: Any) -> bool:
    """Whether reading a value of a tensor on ``device`` costs no synchronization."""
    return torch.device(device).type in FREE
