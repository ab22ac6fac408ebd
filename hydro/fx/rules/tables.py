"""Structured values: parameters and buffers whose values follow a rule of their size.

A surrogate's layers are drawn at random from the target's statistics, and a width-shaped
buffer of running statistics keeps its leading entries. Neither is right for a tensor whose
values are not a random draw: a sinusoidal position table, ``log(arange(1, N + 1))`` (Mamba's
``A_log``), an identity. Such a tensor is recognized here by its values, never by a class or
attribute name, and rebuilt at the surrogate's size by the rule it follows; one that is visibly
structured but follows no known rule is refused (:func:`looks_structured`), never replaced.

Rules (``d`` the size of a dimension that shrinks):

- ``sinusoid``: a ``[positions, d]`` table (unit dimensions aside) of ``sin(p * f_i)`` and
  ``cos(p * f_i)`` for positions ``p = 0, 1, ...`` and frequencies ``f_i = base ** (-i / (d/2 -
  k))`` (``k = 0``: Vaswani et al., the PyTorch tutorial, Marian, Pegasus; ``k = 1``: fairseq),
  sines and cosines interleaved or in two halves. Rebuilt with the same base, layout and ``k``.
  Rows that are all zero (fairseq's and M2M100's padding row, ``padding_idx``, the positions
  counted from ``padding_idx + 1``) stay zero.
- ``sequence``: along one shrinking dimension ``g(a + b * j)`` with ``g`` the identity or ``log``,
  every other dimension constant (``arange``, ``log(arange(1, N + 1))`` repeated over channels).
  An integral step keeps its start and step (an ``arange`` of the new length); another keeps
  both ends (a ``linspace`` of the new length).
- ``identity``: ``c * eye(d)`` over two dimensions that shrink alike.
- ``constant``: every entry equal; stays that constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Table:
    """A tensor the surrogate rebuilds by its rule (see the module docstring).

    ``dims`` are the tensor's dimensions the rule runs along (the position and width dims of a
    sinusoid, the sequence's dim, the identity's two); ``args`` the rule's recovered constants.
    """

    name: str
    kind: str
    dims: tuple[int, ...]
    args: dict = field(default_factory=dict, hash=False)

    def __str__(self) -> str:
        what = {
            "sinusoid": lambda a: (f"sinusoid table (base {_num(a['base'])}, "
                                   f"{'interleaved' if a['interleaved'] else 'sin | cos'}"
                                   + (f", zero rows {a['zero_rows']}" if a.get("zero_rows")
                                      else "") + ")"),
            "sequence": lambda a: (f"{'log of ' if a['log'] else ''}"
                                   f"{'arange' if a['keep'] == 'step' else 'linspace'} "
                                   f"from {_num(a['start'])} step {_num(a['step'])}"),
            "identity": lambda a: f"identity x {_num(a['scale'])}",
            "constant": lambda a: f"constant {_num(a['value'])}",
        }[self.kind](self.args)
        return f"'{self.name}': {what}, rebuilt at the surrogate's size"

    def build(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The table at ``shape`` (the surrogate's), by the same rule, in ``dtype``."""
        a = self.args
        if self.kind == "constant":
            return torch.full(shape, a["value"], dtype=torch.float64).to(dtype)
        if self.kind == "identity":
            i, j = self.dims
            eye = torch.eye(shape[i], dtype=torch.float64) * a["scale"]
            view = [1] * len(shape)
            view[i], view[j] = shape[i], shape[j]
            return eye.reshape(view).expand(shape).to(dtype).clone()
        if self.kind == "sequence":
            (k,) = self.dims
            n = shape[k]
            if a["keep"] == "step":
                x = a["start"] + a["step"] * torch.arange(n, dtype=torch.float64)
            else:
                x = torch.linspace(a["start"], a["end"], n, dtype=torch.float64)
            x = x.log() if a["log"] else x
            view = [1] * len(shape)
            view[k] = n
            return x.reshape(view).expand(shape).to(dtype).clone()
        p, w = self.dims
        grid = sinusoid(shape[p], shape[w], a["base"], a["k"], a["interleaved"])
        grid[list(a.get("zero_rows", ()))] = 0.0
        grid = grid if p < w else grid.T  # in the tensor's order of its two dimensions
        view = [shape[d] if d in (p, w) else 1 for d in range(len(shape))]
        return grid.reshape(view).expand(shape).to(dtype).clone()


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"


def sinusoid(positions: int, d: int, base: float, k: int, interleaved: bool) -> torch.Tensor:
    """``[positions, d]``: ``sin(p * f_i)``, ``cos(p * f_i)`` with ``f_i = base ** (-i / (d/2 -
    k))``, interleaved (``[sin, cos, sin, ...]``) or as two halves (``[sin... | cos...]``)."""
    half = d // 2
    freq = base ** (-torch.arange(half, dtype=torch.float64) / (half - k))
    angle = torch.arange(positions, dtype=torch.float64)[:, None] * freq[None, :]
    if interleaved:
        return torch.stack([angle.sin(), angle.cos()], dim=-1).reshape(positions, d)
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


def _tol(t: torch.Tensor, scale: float = 1.0) -> float:
    """How far a table held in ``t``'s dtype may be from the exact rule: float32 rounding for
    float32 and float64 alike (a table computed in float32, then the model cast with
    ``.double()``), half precision's for half types. Draws from a distribution are nowhere
    near a rule at that distance."""
    return (2e-2 if t.element_size() < 4 else 1e-4) * scale


def _close(x: torch.Tensor, want: torch.Tensor, t: torch.Tensor, scale: float = 1.0) -> bool:
    return bool((x - want).abs().max() <= _tol(t, scale))


def _constant_along(x: torch.Tensor, dims: list[int]) -> bool:
    for d in dims:
        if x.shape[d] > 1 and not torch.equal(x, x.narrow(d, 0, 1).expand_as(x)):
            return False
    return True


def recognize(name: str, t: torch.Tensor, shrinking: list[int]) -> Table | None:
    """The rule ``t``'s values follow, given the dimensions of ``t`` that shrink; ``None``
    when they follow none of this module's rules (or ``t`` holds no values: ``meta``)."""
    if not t.is_floating_point() or t.is_meta or t.numel() < 2 or not shrinking:
        return None
    x = t.detach().to("cpu", torch.float64)
    if torch.equal(x, x.flatten()[0].expand_as(x)):
        return Table(name, "constant", (), {"value": float(x.flatten()[0])})
    big = [d for d in range(x.dim()) if x.shape[d] > 1]
    for found in (_identity(x, t, shrinking, big), _sequence(x, t, shrinking, big),
                  _sinusoid(x, t, shrinking, big)):
        if found is not None:
            kind, dims, args = found
            return Table(name, kind, dims, args)
    return None


def _identity(x, t, shrinking, big) -> tuple | None:
    if len(big) != 2 or sorted(big) != sorted(shrinking) or x.shape[big[0]] != x.shape[big[1]]:
        return None
    m = x.reshape(x.shape[big[0]], x.shape[big[1]])
    c = float(m[0, 0])
    if c == 0.0 or not torch.equal(m, torch.eye(m.shape[0], dtype=m.dtype) * c):
        return None
    return "identity", (big[0], big[1]), {"scale": c}


def _sequence(x, t, shrinking, big) -> tuple | None:
    if len(shrinking) > 2:
        return None
    for k in shrinking:
        if x.shape[k] < 3 or not _constant_along(x, [d for d in big if d != k]):
            continue
        line = x.movedim(k, 0).reshape(x.shape[k], -1)[:, 0]
        for log in (False, True):
            if log and not bool((line.abs() < 50).all()):
                continue
            y = line.exp() if log else line
            start, step = float(y[0]), float(y[1] - y[0])
            n = y.numel()
            want = start + step * torch.arange(n, dtype=torch.float64)
            if step == 0.0 or not _close(line, want.log() if log else want, t,
                                         max(1.0, float(line.abs().max()))):
                continue
            integral = abs(step - round(step)) < 1e-6 and abs(start - round(start)) < 1e-6
            if integral:
                start, step = float(round(start)), float(round(step))
            keep = "step" if integral else "ends"
            return "sequence", (k,), {"start": start, "step": step, "log": log, "keep": keep,
                                      "end": start + step * (n - 1)}
    return None


def _sinusoid(x, t, shrinking, big) -> tuple | None:
    if len(big) != 2 or len([d for d in big if d in shrinking]) != 1:
        return None
    w = next(d for d in big if d in shrinking)
    p = next(d for d in big if d != w)
    grid = x.reshape(x.shape[big[0]], x.shape[big[1]])
    grid = grid if p < w else grid.T
    positions, d = grid.shape
    if d % 2 or d < 4 or positions < 2:
        return None
    half = d // 2
    # padding rows (all zero, at most a few: a sinusoid row is never all zero); two adjacent
    # rows of the table give the frequencies
    zero_rows = [int(r) for r in torch.nonzero((grid == 0).all(1)).flatten()]
    first = next((r for r in range(positions - 1)
                  if r not in zero_rows and r + 1 not in zero_rows), None)
    if first is None or len(zero_rows) > 2:
        return None
    for interleaved in (True, False):
        s, c = (grid[:, 0::2], grid[:, 1::2]) if interleaved else (grid[:, :half], grid[:, half:])
        starts = _close(s[0], torch.zeros(half, dtype=s.dtype), t) and _close(
            c[0], torch.ones(half, dtype=c.dtype), t
        )
        if 0 not in zero_rows and not starts:  # position 0: sin 0, cos 1
            continue
        step = torch.atan2(s[first + 1], c[first + 1]) - torch.atan2(s[first], c[first])
        freq = torch.remainder(step + math.pi, 2 * math.pi) - math.pi  # the angle's increment
        if not (abs(float(freq[0]) - 1.0) < 1e-3 and bool((freq[1:] > 0).all())
                and bool((freq[1:] < freq[:-1]).all())):
            continue
        q = float(freq[-1]) ** (1.0 / (half - 1))  # the geometric ratio, from the last entry
        found = []
        for k in (0, 1):
            base = q ** (-(half - k))
            if not math.isfinite(base) or base <= 1.0:
                continue
            if abs(base - round(base)) <= 1e-3 * base:
                base = float(round(base))
            want = sinusoid(positions, d, base, k, interleaved)
            want[zero_rows] = 0.0
            if _close(grid, want, t, positions):
                args = {"base": base, "k": k, "interleaved": interleaved}
                found.append(args | ({"zero_rows": zero_rows} if zero_rows else {}))
        # at one width (10000, k = 1) and (10000 ** (h / (h - 1)), k = 0) give the same table;
        # authors write a round base (10000), so the rule with one is the one to rebuild by
        if found:
            args = next((a for a in found if _round(a["base"])), found[0])
            return "sinusoid", (p, w), args
    return None


def _round(x: float) -> bool:
    """A number of two significant digits at most (10000, 500000, 1e6)."""
    digits = 10.0 ** (math.floor(math.log10(x)) - 1)
    return abs(x - round(x / digits) * digits) <= 1e-6 * x


def looks_structured(t: torch.Tensor, shrinking: list[int]) -> bool:
    """Whether ``t``'s values are visibly not a random draw although no rule above matched:
    repeated along a shrinking dimension (every slice equal, not constant), or sorted along it
    in every slice. Draws from a continuous distribution are neither (with any useful size)."""
    if not t.is_floating_point() or t.is_meta:
        return False
    x = t.detach().to("cpu", torch.float64)
    for k in shrinking:
        if x.shape[k] < 8:  # a random 8 sorted by chance: 1 in 20000
            continue
        others = [d for d in range(x.dim()) if d != k and x.shape[d] > 1]
        if others and _constant_along(x, others):
            return True  # the same values in every slice: a table, not independent draws
        diff = x.diff(dim=k)
        if bool((diff > 0).all()) or bool((diff < 0).all()):
            return True
    return False


__all__ = ["Table", "looks_structured", "recognize", "sinusoid"]
