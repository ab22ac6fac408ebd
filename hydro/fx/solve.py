"""Solving the width analysis (:mod:`hydro.fx.widths`) at one ratio: the width plan.

:func:`analysis` runs the rules over every graph of a captured model and returns the symbols and
relations (:class:`hydro.fx.widths.Analysis`); :func:`analyze` then solves them at a ``ratio``
into a :class:`hydro.fx.widths.WidthPlan`. Solving closes the fixed classes (reached from inputs
and outputs) over slices, products and sums, shrinks every other class that holds a parameter
dimension by ``ratio``, decides head splits by the head policy, keeps tables and pinned outputs
whole, checks buffers derived from widths, and records the muP attention scales to rewrite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx

from hydro.errors import ScaleError
from hydro.fx import pins
from hydro.fx.paths import get_path
from hydro.fx.rules import tables
from hydro.fx.rules.common import TensorSyms, bound, op_name
from hydro.fx.rules.rotary import RotaryTable, rotary_base
from hydro.fx.widths import (
    Analysis,
    HeadPolicy,
    Product,
    WidthPlan,
    describe,
    propagate,
)

# --- solving -------------------------------------------------------------------------------------


def _divisor_suggestions(sizes: Iterable[int], ratio: int) -> str:
    g = 0
    for s in sizes:
        g = math.gcd(g, s)
    divisors = [d for d in range(1, g + 1) if g % d == 0]
    below = [d for d in divisors if d < ratio]
    above = [d for d in divisors if d > ratio]
    options = ([below[-1]] if below else []) + ([above[0]] if above else [])
    return ", ".join(str(d) for d in options) or "1"


def analyze(
    root: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any],
    ratio: int,
    *,
    head_policy: HeadPolicy = "keep_head_dim",
    values: dict[torch.fx.Node, Any] | None = None,
) -> WidthPlan:
    """Find the width dimensions of a captured model and solve their sizes at ``ratio``.

    Args:
        root: the captured target (:func:`hydro.fx.capture.capture`); all its graphs are read.
        example_inputs: positional inputs of one call (shapes and dtypes are used).
        example_kwargs: keyword inputs of that call.
        ratio: the width divisor.
        head_policy: how a head split ``C = H * D`` shrinks: ``"keep_head_dim"`` (default,
            fewer heads of the same size; when ``ratio`` does not divide the head count, the
            head count is kept and the head dim shrinks) or ``"keep_head_count"``.
        values: every node's value on fake copies of the inputs, as :func:`fake_run` gives them
            (read from the capture cache); ``None``: the graphs are run here.

    Raises:
        ScaleError: a width that ``ratio`` does not divide, a head split that cannot shrink, or
            a buffer spanning a width that would have to be cut whose values follow no rule
            Hydro rebuilds (rotary and sinusoid tables, sequences, identities, constants), or a
            parameter visibly structured by no such rule, naming the node, module, parameter or
            buffer and what would work.
    """
    a = analysis(root, example_inputs, example_kwargs, values)
    return _solve(a, ratio, head_policy)


def fake_run(
    root: torch.nn.Module, example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any]
) -> dict[torch.fx.Node, Any]:
    """Every node's value when each graph of ``root`` runs on fake copies of the inputs."""
    values: dict[torch.fx.Node, Any] = {}
    for gm in root.graphs.values():
        values.update(propagate(root, gm, example_inputs, example_kwargs))
    return values


def analysis(
    root: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any],
    values: dict[torch.fx.Node, Any] | None = None,
) -> Analysis:
    """The width symbols and relations of every graph of ``root``, before any ratio is solved
    (:func:`analyze` solves one ratio; ``ratio="auto"`` solves several from one analysis).
    ``values``: :func:`fake_run`'s, when known."""
    if values is None:
        values = fake_run(root, example_inputs, example_kwargs)
    a = Analysis(root, values)
    for gm in root.graphs.values():
        a.run_graph(gm.graph, None)
    return a


def _close_fixed(a: Analysis, extra: Iterable[int] = ()) -> set[int]:
    """Fixed classes (and ``extra`` symbols, pinned), closed over slices, products and sums
    whose other side is fixed."""
    fixed = {a.find(s) for s in a.fixed_syms} | {a.find(s) for s in extra}
    changed = True
    while changed:
        changed = False
        for c in a.parts:
            p, w = a.find(c.part), a.find(c.whole)
            if c.sliced and p in fixed and w not in fixed:
                fixed.add(w)  # a table sliced by a fixed length (positions) keeps its rows
                changed = True
            elif w in fixed and p not in fixed:
                fixed.add(p)
                changed = True
        for c in a.products:
            for one, other in ((c.lhs, c.rhs), (c.rhs, c.lhs)):
                if all(a.find(s) in fixed for s in one):
                    free = {a.find(s) for s in other} - fixed
                    if len(free) == 1:
                        fixed |= free
                        changed = True
        for c in a.sums:
            if all(a.find(s) in fixed for s in c.parts) and a.find(c.out) not in fixed:
                fixed.add(a.find(c.out))
                changed = True
    return fixed


def _solve(a: Analysis, ratio: int, head_policy: HeadPolicy) -> WidthPlan:
    """Solve every size at ``ratio``: outputs beside no loss and integer indices into
    anything but a width are pinned first; an index into a width is pinned, and the sizes
    solved again, only where it would fall outside the cut width."""
    sources = _width_sources(a)
    fixed_selects, into_width = pins.select_pins(a, sources)
    chosen = list(a.pins)
    while True:
        pinned = fixed_selects + [s for p in chosen for s in p.syms]
        plan = _solve_pinned(a, ratio, head_policy, pinned)
        more = [p for p in pins.out_of_range(plan, into_width) if p not in chosen]
        if not more:
            break
        chosen += more
    plan.pinned = _pinned_widths(a, chosen, sources, fixed_selects)
    plan.tables = _table_keys(a)
    return plan


def _pinned_widths(a: Analysis, chosen: list[pins.Pin], sources: set[int],
                   base: list[int]) -> list[tuple[str, int, str]]:
    """The hidden widths that only the pins keep whole, each with the first pin's reason."""
    if not chosen:
        return []
    unpinned = _close_fixed(a, base)
    closures = [_close_fixed(a, base + p.syms) for p in chosen]
    hidden = pins.hidden_classes(a)
    names = _dim_names(a)
    out = []
    for r in sorted(set().union(*closures) - unpinned):
        why = [p for p, c in zip(chosen, closures) if r in c and (r in hidden or not p.hidden_only)]
        if r in sources and why:
            out.append((names.get(r, "a hidden dimension"), a.sizes[r], why[0].reason))
    return out


def _solve_pinned(a: Analysis, ratio: int, head_policy: HeadPolicy,
                  pinned: list[int]) -> WidthPlan:
    roots = {a.find(s) for s in range(len(a.sizes))}
    fixed = _close_fixed(a, pinned)
    derived = {a.find(c.out) for c in a.sums} | {a.find(c.part) for c in a.parts}
    derived |= {a.find(s) for s in a.derived_syms}
    touching = {a.find(s) for s in a.param_dim_syms}
    width = (_width_sources(a) - fixed) - derived
    new: dict[int, int] = {r: a.sizes[r] for r in fixed}
    names = _dim_names(a)
    bad = [r for r in sorted(width) if a.sizes[r] % ratio]
    if bad:
        r = bad[0]
        raise ScaleError(
            f"width {a.sizes[r]} of {names.get(r, 'a hidden dimension')} is not divisible by "
            f"ratio {ratio}. Nearest ratios that divide every width: "
            f"{_divisor_suggestions((a.sizes[w] for w in width), ratio)}; or change the width."
        )
    for r in width:
        new[r] = a.sizes[r] // ratio
    # classes whose size follows the width; at ratio 1 nothing changes size, so this (not a
    # size comparison) says which dimensions are width
    dep: set[int] = set(width)
    decisions: list[str] = []
    pending = list(a.products)

    def value(s: int) -> int | None:
        return new.get(a.find(s))

    def follow(target: int, sources: Iterable[int]) -> None:
        if any(a.find(x) in dep for x in sources):
            dep.add(a.find(target))

    def node_error(node: torch.fx.Node, what: str) -> ScaleError:
        return ScaleError(f"cannot scale {describe(node)} by ratio {ratio}: {what}")

    changed = True
    while changed:
        changed = False
        for c in a.parts:
            w, p = value(c.whole), value(c.part)
            if w is not None and p is None:
                if (w * c.num) % c.den:
                    what = f"a part of {a.sizes[c.part]} out of {a.sizes[c.whole]}"
                    raise node_error(c.node, f"{what} does not shrink to a whole number")
                new[a.find(c.part)] = w * c.num // c.den
                follow(c.part, [c.whole])
                changed = True
            elif p is not None and w is None and a.find(c.part) in dep:
                new[a.find(c.whole)] = p * c.den // c.num
                follow(c.whole, [c.part])
                changed = True
        for c in a.sums:
            parts = [value(s) for s in c.parts]
            out = value(c.out)
            missing = {a.find(s) for s, v in zip(c.parts, parts) if v is None}
            if out is None and not missing:
                new[a.find(c.out)] = sum(parts)
                follow(c.out, c.parts)
                changed = True
            elif out is not None and len(missing) == 1:
                root = missing.pop()
                count = sum(1 for s in c.parts if a.find(s) == root)
                rest = out - sum(v for v in parts if v is not None)
                if rest % count:
                    raise node_error(c.node, "a concatenation's parts do not add up after scaling")
                new[root] = rest // count
                follow(root, [c.out, *c.parts])
                changed = True
        for c in list(pending):
            unknown = {a.find(s) for s in c.lhs + c.rhs if value(s) is None}
            if not unknown:
                pending.remove(c)
                continue
            if len(unknown) == 1:
                root = unknown.pop()
                lhs = math.prod(value(x) for x in c.lhs if a.find(x) != root) * c.lhs_const
                rhs = math.prod(value(x) for x in c.rhs if a.find(x) != root) * c.rhs_const
                on_left = sum(1 for x in c.lhs if a.find(x) == root)
                on_right = sum(1 for x in c.rhs if a.find(x) == root)
                num, den = (rhs, lhs) if on_left else (lhs, rhs)
                power = on_left or on_right
                if on_left and on_right or num % den:
                    raise node_error(c.node, f"a dimension of size {a.sizes[root]} would have to "
                                     f"become {num}/{den}" + _heads_hint(c, a, ratio))
                size = round((num // den) ** (1 / power))
                new[root] = size
                follow(root, c.lhs + c.rhs)
                pending.remove(c)
                changed = True
        if not changed and pending:
            changed = _head_policy(a, pending, new, value, head_policy, decisions, node_error, dep)
    for r in roots:
        new.setdefault(r, a.sizes[r])
    plan = WidthPlan(
        root=a.root, ratio=ratio, values=a.values, node_syms=a.node_syms, param_syms=a.param_syms,
        tensor_names=a.tensor_names, sizes=a.sizes, parent=a.parent, new_size=new,
        width=dep, fixed=fixed, uses=a.uses, head_decisions=decisions,
    )
    _verify(a, plan, node_error)
    _check_tables(a, plan, touching)
    plan.literal_rewrites = _attention_scales(a, plan, decisions)
    for key, syms in a.param_syms.items():
        name = a.tensor_names[key][0]
        if key in {id(p) for p in a.root.parameters()}:
            for i, s in enumerate(syms):
                if s in a.indexed or any(a.find(s) == a.find(c.whole) and c.sliced
                                         for c in a.parts):
                    if not plan.is_width(s) and a.sizes[s] > 1:
                        plan.kept.append((name, i, a.sizes[s]))
    return plan


def _table_keys(a: Analysis) -> set[int]:
    """The ids of the parameters read by an index tensor's values (``table[index]``)."""
    return {key for key, syms in a.param_syms.items() if any(s in a.tables for s in syms)}


def _width_sources(a: Analysis) -> set[int]:
    """Classes holding a dimension of a parameter other than a table read by index.

    A table read as ``table[index]`` (Swin's relative-position bias, ``heads`` columns) adds its
    rows to what it is added to: its other dimensions follow those (a head count solved by the
    head policy), they do not make a width of their own.
    """
    tables = _table_keys(a)
    counts = _counts(a)
    return {a.find(s) for key, syms in a.param_syms.items() if key not in tables for s in syms
            if s in a.param_dim_syms and a.find(s) not in counts}


def _counts(a: Analysis) -> set[int]:
    """Classes that count things rather than measure a width: a parameter dimension that no
    other parameter shares, that no layer contracts or produces (no fan-in or fan-out of any
    use) and that only concatenations relate to the rest of the graph, such as the 4 register
    tokens of ``reg_token [1, 4, D]`` or DETR's learned queries concatenated with the patch
    tokens. Cutting them would change the model's structure, not its width."""
    owners: dict[int, set[tuple[int, int]]] = {}
    for key, syms in a.param_syms.items():
        for i, s in enumerate(syms):
            if s in a.param_dim_syms:
                owners.setdefault(a.find(s), set()).add((key, i))
    used = {(key, d) for key, uses in a.uses.items() for u in uses for d in u.fan_in + u.fan_out}
    contracted = {r for r, own in owners.items() if own & used}  # a layer's fan-in or fan-out
    # parts of concatenations along a dimension no layer contracts (tokens, not channels)
    in_sums = {a.find(s) for c in a.sums if a.find(c.out) not in contracted for s in c.parts}
    in_other = {a.find(s) for c in a.products for s in c.lhs + c.rhs}
    in_other |= {a.find(s) for c in a.parts for s in (c.part, c.whole)}
    in_other |= {a.find(s) for c in a.sums if a.find(c.out) in contracted for s in c.parts}
    return {r for r, own in owners.items() if len(own) == 1 and r not in contracted
            and r in in_sums and r not in in_other}


def _heads_hint(c: Product, a: Analysis, ratio: int) -> str:
    sizes = [a.sizes[s] for s in c.lhs + c.rhs]
    return (f" (a reshape of {[a.sizes[s] for s in c.lhs]} into {[a.sizes[s] for s in c.rhs]}; "
            f"with grouped-query attention both the query and the key/value head counts must "
            f"stay whole: try a ratio dividing {math.gcd(*sizes)})")


def _head_policy(a, pending, new, value, policy, decisions, node_error, dep) -> bool:
    """Resolve a split ``known = outer * inner`` with two unknowns by the head policy.

    Head splits (``C = H * D``) go before packed projections (``3C = 3 * C``): the split with
    the smallest inner size first.
    """

    def inner_size(c: Product) -> int:
        sides = [x for x in (c.lhs, c.rhs) if len(x) > 1]
        return min((a.sizes[x[-1]] for x in sides), default=0)

    for c in sorted(pending, key=inner_size):
        for known_side, unknown_side in ((c.lhs, c.rhs), (c.rhs, c.lhs)):
            if not all(value(s) is not None for s in known_side):
                continue
            unknown = [s for s in unknown_side if value(s) is None]
            if len({a.find(s) for s in unknown}) != 2 or len(unknown) != 2:
                continue
            known_const = c.lhs_const if known_side is c.lhs else c.rhs_const
            other_const = c.rhs_const if known_side is c.lhs else c.lhs_const
            total = math.prod(value(s) for s in known_side) * known_const
            rest = math.prod(value(s) for s in unknown_side if value(s) is not None) * other_const
            target = total // rest if total % rest == 0 else None
            outer, inner = unknown
            heads, dim = a.sizes[outer], a.sizes[inner]
            orders = [("head dim", inner, outer), ("head count", outer, inner)]
            if policy == "keep_head_count":
                orders.reverse()
            for kept, keep, solve in orders:
                if target is not None and target % a.sizes[keep] == 0 and target >= a.sizes[keep]:
                    new[a.find(keep)] = a.sizes[keep]
                    new[a.find(solve)] = target // a.sizes[keep]
                    if any(a.find(x) in dep for x in known_side):
                        dep.add(a.find(solve))
                    why = "" if kept == orders[0][0] else f"; whole heads of {dim} do not fit"
                    text = (f"{describe(c.node)}: {heads} heads x {dim} -> {new[a.find(outer)]} "
                            f"heads x {new[a.find(inner)]} (kept the {kept}{why})")
                    if text not in decisions:  # the train and eval graphs split alike
                        decisions.append(text)
                    pending.remove(c)
                    return True
            raise node_error(
                c.node,
                f"a split of {heads * dim} into {heads} x {dim} (heads x head dim) cannot shrink "
                f"to {target}: neither {heads} heads nor head dim {dim} divides it. Choose a "
                f"ratio that divides the head count ({_divisor_suggestions([heads], 1)}...) or "
                "the head dim.",
            )
    return False


def _verify(a: Analysis, plan: WidthPlan, node_error) -> None:
    v = plan.new_dim
    for c in a.products:
        lhs = math.prod(v(s) for s in c.lhs) * c.lhs_const
        rhs = math.prod(v(s) for s in c.rhs) * c.rhs_const
        if lhs != rhs:
            raise node_error(c.node, f"a reshape of {[a.sizes[s] for s in c.lhs]} into "
                             f"{[a.sizes[s] for s in c.rhs]} would need {lhs} == {rhs}"
                             + _heads_hint(c, a, plan.ratio))
    for c in a.sums:
        if v(c.out) != sum(v(s) for s in c.parts):
            raise node_error(c.node, "a concatenation's parts do not add up after scaling")


_BATCH_NORMS = ("batch_norm", "native_batch_norm", "_native_batch_norm_legit", "instance_norm",
                "_native_batch_norm_legit_functional", "cudnn_batch_norm")


def _running_stats(a: Analysis) -> set[int]:
    """Ids of the buffers a batch norm reads as running statistics: state the graph updates,
    not a table (their leading entries are the surrogate's, as its channels are)."""
    found = set()
    for node in a.node_syms:
        if node.op == "call_function" and op_name(node) in _BATCH_NORMS:
            b = bound(node)
            for key in ("running_mean", "running_var"):
                t = a.param_of(b.get(key))
                if t is not None:
                    found.add(id(t))
    return found


def _check_tables(a: Analysis, plan: WidthPlan, touching: set[int]) -> None:
    """Parameters and buffers whose values are not a random draw are never cut or redrawn: a
    rotary table (``1 / base ** (2i / d)``) is rebuilt for the new head dim (``plan.rotary``), a
    table of a rule of :mod:`hydro.fx.rules.tables` (sinusoids, arange/log sequences,
    identities) for the new width (``plan.structured``); a constant stays that constant, running
    statistics keep their leading entries. Any other buffer spanning a width that shrinks, or a
    parameter whose values are visibly structured by no known rule, is an error naming it."""
    params = {id(p) for p in a.root.parameters()}
    running = _running_stats(a)
    for key, syms in a.param_syms.items():
        shrinking = [i for i, s in enumerate(syms) if plan.new_dim(s) != a.sizes[s]]
        if not shrinking or key in running:
            continue
        name = a.tensor_names[key][0]
        t = get_path(a.root, name)
        if not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        is_param = key in params
        base = None if is_param or len(syms) != 1 else rotary_base(t)
        if base is not None:
            s = syms[0]
            plan.rotary[key] = RotaryTable(name, 2 * a.sizes[s], 2 * plan.new_dim(s), base)
            continue
        table = tables.recognize(name, t, shrinking)
        if table is not None:
            if table.kind != "constant":  # a constant is drawn (parameters) or cut as it is
                plan.structured[key] = table
            continue
        dim = shrinking[0]
        old, new = a.sizes[syms[dim]], plan.new_dim(syms[dim])
        where = f"'{name}' (dimension {dim}, size {old} -> {new} at ratio {plan.ratio})"
        rules = ("not a rotary table 1 / base ** (arange(0, d, 2) / d), a sinusoid table, an "
                 "arange or log(arange) sequence, an identity or a constant")
        if is_param:
            if tables.looks_structured(t, shrinking):
                raise ScaleError(
                    f"parameter {where} holds structured values (repeated or sorted along that "
                    f"dimension), not a random draw, and follow no rule Hydro can rebuild "
                    f"({rules}); the surrogate would replace them with random numbers. Compute "
                    "them in forward from the width (x.size(-1)), or initialize the parameter "
                    "by one of those rules."
                )
            continue
        heads = "" if a.find(syms[dim]) in touching else (
            " Or keep the head dim: use head_policy='keep_head_dim' with a ratio that divides "
            "the head count (and the key/value head count), or give the model more heads.")
        raise ScaleError(
            f"buffer {where} spans a width that shrinks, and its values follow no rule Hydro can "
            f"rebuild ({rules}); cutting it would change what it encodes. Compute it in forward "
            "from the width (x.size(-1)), or register it as a parameter with "
            f"requires_grad=False if it is a random draw.{heads}"
        )


_PASS_THROUGH = ("view", "reshape", "_unsafe_view", "transpose", "permute", "t", "contiguous",
                 "clone", "to", "_to_copy", "expand", "unsqueeze", "alias")


def _scalar_factor(node: torch.fx.Node) -> tuple[int, float, bool] | None:
    """``(argument index, literal, divides)`` of a ``mul``/``div`` of a tensor by a number."""
    name = op_name(node)
    if name not in ("mul", "div") or len(node.args) != 2:
        return None
    for i, arg in enumerate(node.args):
        other = node.args[1 - i]
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            if isinstance(other, torch.fx.Node) and (name == "mul" or i == 1):
                return i, float(arg), name == "div"
    return None


def _attention_scales(a: Analysis, plan: WidthPlan, decisions: list[str]) -> dict:
    """Literal attention scales rewritten for muP: ``q @ k^T * s`` (or ``/ s``, or ``q * s``
    before the product) where the product of two activations contracts a dimension that shrinks
    from ``d`` to ``d'`` becomes ``s * d / d'`` (``/ s`` becomes ``/ (s * d' / d)``): logits
    scale as ``1/d`` relative to the target, as SDPA's ``scale=`` is set. The scale is found by
    the symbol of the contracted dimension, never by its value; at ratio 1 nothing changes.
    """
    rewrites: dict[torch.fx.Node, tuple[int, float]] = {}
    for node in list(a.node_syms):
        if node.op != "call_function" or op_name(node) not in ("matmul", "bmm"):
            continue
        x, y = node.args[0], node.args[1]
        if a.param_of(x) is not None or a.param_of(y) is not None:
            continue  # a layer's weight: not attention
        xs = a.syms_of(x)
        if not isinstance(xs, TensorSyms) or len(xs) < 2:
            continue
        d_old, d_new = a.sizes[xs[-1]], plan.new_dim(xs[-1])
        if d_old == d_new or not plan.is_width(xs[-1]):
            continue
        found = _find_scale(node)
        if found is None:
            continue
        mul, (i, value, divides) = found
        new = value * d_new / d_old if divides else value * d_old / d_new
        rewrites[mul] = (i, new)
        op = "/" if divides else "x"
        text = (f"{describe(mul)}: attention scale {op} {value:g} -> {op} {new:g} "
                f"(muP 1/d for head dim {d_old} -> {d_new})")
        if text not in decisions:
            decisions.append(text)
    return rewrites


def _find_scale(matmul: torch.fx.Node) -> tuple[torch.fx.Node, tuple[int, float, bool]] | None:
    """The scalar ``mul``/``div`` applied to an attention product's output (first) or to one of
    its operands, through views and transposes."""
    node = matmul
    while len(node.users) == 1:
        node = next(iter(node.users))
        found = _scalar_factor(node)
        if found is not None:
            return node, found
        if op_name(node) not in _PASS_THROUGH:
            break
    for arg in matmul.args[:2]:
        while isinstance(arg, torch.fx.Node) and arg.op == "call_function":
            found = _scalar_factor(arg)
            if found is not None:
                return arg, found
            if op_name(arg) not in _PASS_THROUGH:
                break
            arg = arg.args[0]
    return None


def _dim_names(a: Analysis) -> dict[int, str]:
    """A readable name for each class root: the first parameter dimension in it."""
    names: dict[int, str] = {}
    for key, syms in a.param_syms.items():
        for i, s in enumerate(syms):
            names.setdefault(a.find(s), f"'{a.tensor_names[key][0]}' (dimension {i})")
    return names


__all__ = ["Analysis", "HeadPolicy", "WidthPlan", "analyze", "bound", "describe", "op_name"]
