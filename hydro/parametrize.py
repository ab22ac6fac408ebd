"""muP relative to the target: infshapes, initialization, multipliers and optimizer scaling.

The surrogate is parametrized with the Maximal Update Parametrization using the *target* model as
the base shape, so every width multiplier is ``surrogate width / target width = 1 / ratio``. At
ratio 1 every multiplier is exactly 1 and the surrogate is the target in standard parametrization.

Rules, per role of a parameter (``m`` is the width multiplier of the parameter's main width
dimension, as returned by ``p.infshape.width_mult()``; for the surrogate ``m = 1/ratio``):

========  ====================================  ===========  =============  ===================
role      example                               init std     Adam(W) lr     SGD lr
========  ====================================  ===========  =============  ===================
input     first Linear/Conv, Embedding          x 1          x 1            x m
hidden    Linear/Conv width -> width            x m^-1/2     x 1/m          x fan_out/fan_in
output    readout Linear width -> classes       x 1          x 1            x m
vector    biases, norm affine, layer scale      x 1          x 1            x m
fixed     no width dimension                    x 1          x 1            x 1
========  ====================================  ===========  =============  ===================

The output layer's input is multiplied by ``output_mult / m`` in the forward pass (the muP readout
multiplier), which is why its stored weights keep the target's scale. Weight decay follows the
``mup`` package: it is divided by the learning-rate multiplier, so that ``lr * weight_decay`` (the
per-step decay of AdamW and of SGD's coupled decay) does not change with width.

These are the rules of ``mup.MuAdam`` / ``mup.MuSGD``; :func:`optimizer_multipliers` returns them
per parameter so that Hydro's fused optimizers and plain ``torch.optim`` users (through
:func:`param_groups`) apply exactly what ``mup`` would.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn

OptimizerKind = Literal["adam", "sgd"]


class Multiplier(nn.Module):
    """Multiplies its input by a constant: the muP readout (or input) multiplier.

    ``scale`` is a plain float so that it is part of the parametrization, not a trained parameter.
    """

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = float(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def extra_repr(self) -> str:
        return f"scale={self.scale:g}"


def optimizer_multipliers(param: torch.Tensor, kind: OptimizerKind = "adam") -> tuple[float, float]:
    """The ``(lr, weight_decay)`` multipliers muP gives ``param`` under an optimizer ``kind``.

    Args:
        param: a parameter; if it carries the ``mup`` package's ``infshape`` attribute (every
            parameter of a Hydro surrogate does), the muP rules apply, otherwise ``(1.0, 1.0)``.
        kind: ``"adam"`` for Adam-like optimizers (Adam, AdamW, RMSprop...), ``"sgd"`` for
            SGD-like ones.

    Returns:
        ``(lr_mult, wd_mult)``: multiply the learning rate and the weight decay by these.

    Example:
        >>> import torch, hydro
        >>> sur = hydro.scale(torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(),
        ...                   torch.nn.Linear(64, 64), torch.nn.ReLU(),
        ...                   torch.nn.Linear(64, 2)), ratio=8)
        >>> hydro.parametrize.optimizer_multipliers(sur.get_parameter("2.weight"))
        (8.0, 0.125)
    """
    infshape = getattr(param, "infshape", None)
    if infshape is None:
        return 1.0, 1.0
    ninf = infshape.ninf()
    if ninf > 2:
        raise ValueError(
            f"a parameter of shape {tuple(param.shape)} has {ninf} width dimensions; muP defines "
            "learning-rate scaling for at most 2"
        )
    if kind == "adam":
        if ninf == 2:
            m = infshape.width_mult()
            return 1.0 / m, m
        return 1.0, 1.0
    if kind == "sgd":
        if ninf == 1:
            m = infshape.width_mult()
            return m, 1.0 / m
        if ninf == 2:
            r = infshape.fanin_fanout_mult_ratio()
            return 1.0 / r, r
        return 1.0, 1.0
    raise ValueError(f"unknown optimizer kind {kind!r}; use 'adam' (Adam-like) or 'sgd' (SGD-like)")


def param_groups(
    params: Iterable[torch.Tensor] | nn.Module,
    lr: float,
    weight_decay: float = 0.0,
    kind: OptimizerKind = "adam",
) -> list[dict]:
    """Parameter groups with muP learning rates and weight decays, for any ``torch.optim`` class.

    Args:
        params: a module (its parameters are used) or an iterable of parameters.
        lr: the base learning rate (the one that transfers to the target model).
        weight_decay: the base weight decay.
        kind: ``"adam"`` or ``"sgd"``, the family of the optimizer the groups are for.

    Example:
        >>> import torch, hydro
        >>> sur = hydro.scale(torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(),
        ...                   torch.nn.Linear(64, 2)), ratio=8)
        >>> opt = torch.optim.AdamW(hydro.parametrize.param_groups(sur, lr=1e-3, weight_decay=0.1))
    """
    if isinstance(params, nn.Module):
        params = params.parameters()
    groups: dict[tuple[float, float], list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(optimizer_multipliers(p, kind), []).append(p)
    return [
        {"params": ps, "lr": lr * lr_m, "weight_decay": weight_decay * wd_m}
        for (lr_m, wd_m), ps in groups.items()
    ]
