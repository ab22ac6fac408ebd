"""Depth: find stacks of repeated residual blocks and keep every ``depth_ratio``-th block.

A *stack* is an ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` whose children are all
of one class with the same parameter shapes (GPT's ``h``, LLaMA's ``layers``, BERT's
``encoder.layer``, a ResNet stage). The module tree only proposes it; the captured graphs must
confirm it, in every mode:

* each block's nodes form one segment, the blocks in order, nothing else in between;
* the blocks are structurally identical (the same ops in the same order);
* each block has exactly one output read outside it, and it feeds only the next block (the
  last block's may be read anywhere);
* each block has a residual add: an ``add`` whose one operand is the block's input (the residual
  stream, or the previous residual add of the block) and whose other operand, the *branch*, is
  computed from it.

Where the loop body lives in the parent's ``forward`` (``x = x + self.attn[i](self.ln1[i](x))``,
then the same with ``self.mlp[i]``), no container is a stack on its own. Sibling containers of
one length that failed alone are then tried together: block ``i`` is the ``i``-th item of each
plus the parent's operations up to block ``i + 1`` (the residual adds), and the same four
conditions must hold. Such a group is cut as one (``Stack.siblings``).

A confirmed stack of ``L`` blocks keeps blocks ``0, k, 2k, ...`` (``k = depth_ratio``, at least
one); the others' nodes are removed (the stream passes straight through) and so are their
tensors. Everything else is left whole, with the reason recorded for :func:`hydro.inspect`.

Then each kept block's residual branches are multiplied by ``(L / L_kept) ** alpha``
(CompleteP, Dey et al. 2025, with the *target* as the base depth: at ``depth_ratio=1`` the
multiplier is 1 and nothing is inserted). See :mod:`hydro.parametrize` for the learning-rate
rule that goes with it.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx
from torch import nn

from hydro.errors import HydroWarning, ScaleError
from hydro.fx.capture import Captured, register_at
from hydro.fx.nodes import clean_path

_ADDS = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)
_A = torch.ops.aten
_PASSTHROUGH = (_A.to.dtype, _A.to.dtype_layout, _A._to_copy.default, _A.clone.default,
                _A.alias.default, _A.contiguous.default, _A.detach.default)


@dataclass
class Stack:
    """One stack of repeated blocks and what the depth cut did with it.

    Attributes:
        path: the container's module path (``"h"``, ``"transformer.h"``, ``"layer1"``).
        blocks: the blocks' module paths, in order.
        head: blocks of the container before the stack, of other parameter shapes, left as
            they are (a ResNet stage's first block, which changes the stride or the width).
        kept: the blocks the surrogate keeps (all of them when the stack is left whole).
        reason: why the stack is left whole; ``None`` when it is cut.
        multiplier: the residual-branch multiplier of its kept blocks (1 when left whole).
        buffer: the 0-dim buffer holding ``multiplier`` in the surrogate, if one was inserted.
        siblings: the other containers whose ``i``-th items, with the parent's code between
            them, form block ``i`` together with this one's (a loop body in the parent).
    """

    path: str
    blocks: list[str]
    kept: list[str] = field(default_factory=list)
    reason: str | None = None
    multiplier: float = 1.0
    buffer: str | None = None
    head: list[str] = field(default_factory=list)
    siblings: list[str] = field(default_factory=list)

    @property
    def cut(self) -> bool:
        return self.reason is None and len(self.kept) < len(self.blocks)


@dataclass
class DepthPlan:
    """The depth cut of one model: its stacks, and the residual adds of the kept blocks."""

    depth_ratio: int
    alpha: float
    stacks: list[Stack] = field(default_factory=list)
    # per mode: (add node, index of the branch operand, stack) in the cut graphs
    residuals: dict[str, list[tuple[torch.fx.Node, int, Stack]]] = field(default_factory=dict)


def check_args(depth_ratio: object, alpha: object) -> None:
    """A clear error for a ``depth_ratio`` or ``depth_alpha`` Hydro cannot use."""
    if isinstance(depth_ratio, bool) or not isinstance(depth_ratio, int) or depth_ratio < 1:
        raise ScaleError(
            f"depth_ratio must be a positive integer (1 keeps every block, 4 keeps every 4th "
            f"block of each stack of repeated blocks), got {depth_ratio!r}"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ScaleError(
            f"depth_alpha must be a number in [0, 1] (1: CompleteP, 0.5: Depth-muP), got {alpha!r}"
        )


def candidates(model: nn.Module) -> list[Stack]:
    """Containers of the module tree that look like stacks of repeated blocks.

    Every ``ModuleList``/``Sequential`` whose children all hold parameters and share one class
    is a candidate. Where the first blocks differ in parameter shapes from the rest (a ResNet
    stage opens with a block that changes the stride or the width), the identical tail is the
    candidate and the first blocks are its ``head``, left as they are. Containers without two
    identical trailing blocks are returned already marked left whole.
    """
    found: list[Stack] = []
    for path, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) or not len(mod):
            continue
        children = list(mod.named_children())
        if any(not any(True for _ in c.parameters()) for _, c in children):
            continue
        if len({type(c) for _, c in children}) != 1:
            continue
        blocks = [f"{path}.{n}" if path else n for n, _ in children]
        stack = Stack(path, blocks, kept=list(blocks))
        shapes = [[(n, tuple(p.shape)) for n, p in c.named_parameters()] for _, c in children]
        # the identical tail: blocks[lead:] all have the last block's shapes
        lead = len(shapes) - 1
        while lead and shapes[lead - 1] == shapes[-1]:
            lead -= 1
        if len(children) == 1:
            stack.reason = "one block"
        elif len(shapes) - lead < 2:
            stack.reason = "blocks of different parameter shapes"
        elif lead:
            stack = Stack(path, blocks[lead:], kept=blocks[lead:], head=blocks[:lead])
        found.append(stack)
    # a stack inside a block of another stack is that block's business
    inside = {s.path for s in found for o in found if o is not s
              for b in o.head + o.blocks if s.path.startswith(b + ".")}
    return [s for s in found if s.path not in inside]


def cut(
    cap: Captured, model: nn.Module, depth_ratio: int, alpha: float = 1.0
) -> tuple[Captured, DepthPlan]:
    """The captured model with every ``depth_ratio``-th block of each confirmed stack kept.

    Pure: ``cap`` is not modified; the result shares ``cap``'s tensors (those it keeps).
    """
    check_args(depth_ratio, alpha)
    if depth_ratio == 1:  # every block kept: the graphs are not even looked at
        return cap, DepthPlan(1, float(alpha))
    plan = DepthPlan(depth_ratio, float(alpha), candidates(model))
    graphs = {mode: _copy_gm(gm) for mode, gm in cap.graphs.items()}
    # each unit is cut as one: a stack alone, or sibling containers run by one loop body
    units: list[tuple[list[Stack], dict[str, _Found]]] = []
    alone: list[Stack] = []  # confirmable in principle, but not alone
    for stack in plan.stacks:
        if stack.reason is not None:
            continue
        f = _confirm_all(graphs, [stack], plan.stacks)
        if isinstance(f, str):
            stack.reason = f
            if not stack.head:
                alone.append(stack)
        else:
            units.append(([stack], f))
    for group in _sibling_groups(alone):  # (one container alone was tried as a loop body)
        f = _confirm_all(graphs, group, plan.stacks)
        if isinstance(f, str):
            names = ", ".join(f"'{st.path}'" for st in group)
            for st in group:
                st.reason += f"{_GROUP}{names}: {f}"
            continue
        for st in group:
            st.reason = None
            st.siblings = [o.path for o in group if o is not st]
        units.append((group, f))
    removed: list[str] = []
    for mode in graphs:
        plan.residuals[mode] = []
    for group, per_mode in units:
        stack = group[0]
        keep = list(range(0, len(stack.blocks), depth_ratio))
        for st in group:
            st.kept = [st.blocks[i] for i in keep]
            st.multiplier = (len(st.blocks) / len(keep)) ** plan.alpha
            if len(keep) < len(st.blocks):
                removed += [b for i, b in enumerate(st.blocks) if i not in keep]
        for mode, f in per_mode.items():
            _remove_blocks(f, set(keep))
            if stack.multiplier != 1.0:
                plan.residuals[mode] += [(a, i, stack) for k in keep for a, i in f.residual[k]]
    if not removed:
        return cap, plan

    def gone(name: str) -> bool:
        return any(name.startswith(b + ".") for b in removed)

    for gm in graphs.values():
        for n in list(gm.graph.nodes):  # reads of the removed blocks' tensors
            if n.op == "get_attr" and not n.users and gone(n.target):
                gm.graph.erase_node(n)
        gm.recompile()
    holder = nn.Module()
    persistent = set(cap.state_dict())

    for name, t in cap.named_parameters(remove_duplicate=False):
        if not gone(name):
            register_at(holder, name, t, "param")
    for name, t in cap.named_buffers(remove_duplicate=False):
        if not gone(name):
            register_at(holder, name, t, "buffer", persistent=name in persistent)
    non_persistent = {n for n, _ in cap.named_buffers(remove_duplicate=False)
                      if n not in persistent}
    out = Captured(graphs, cap.captured_name, state=holder, non_persistent=non_persistent)
    out.train(cap.training)
    return out, plan


def _copy_gm(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    new = torch.fx.GraphModule(nn.Module(), torch.fx.Graph(), type(gm).__name__)
    for name, sub in gm.named_children():
        if isinstance(sub, torch.fx.GraphModule):
            new.add_submodule(name, copy.deepcopy(sub))
    new.graph = copy.deepcopy(gm.graph)
    new._in_spec, new._out_spec = gm._in_spec, gm._out_spec
    return new


@dataclass
class _Found:
    segments: list[list[torch.fx.Node]]
    inputs: list[torch.fx.Node]  # each block's residual-stream input
    outputs: list[torch.fx.Node]
    residual: list[list[tuple[torch.fx.Node, int]]]  # per block: (add, branch operand index)


def _paths(node: torch.fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [clean_path(v[0]) for v in stack.values()]


def _owner(node: torch.fx.Node, items: list[list[str]]) -> int | None:
    """The block ``node`` belongs to: ``i`` when it runs inside one of ``items[i]``'s modules."""
    for path in _paths(node):
        for i, modules in enumerate(items):
            if any(path == b or path.startswith(b + ".") for b in modules):
                return i
    return None


def _tensorish(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        return any(isinstance(v, torch.Tensor) for v in val)
    return isinstance(val, torch.Tensor) or val is None and "nn_module_stack" in node.meta


def _sig(node: torch.fx.Node) -> tuple:
    return (node.op, str(node.target), len(node.args))


_GROUP = "; as one loop body with its siblings "


def _sibling_groups(stacks: list[Stack]) -> list[list[Stack]]:
    """Containers with one parent and one length, in module order (a loop body's candidates)."""
    groups: dict[tuple[str, int], list[Stack]] = {}
    for st in stacks:
        groups.setdefault((st.path.rpartition(".")[0], len(st.blocks)), []).append(st)
    return [g for g in groups.values() if len(g) > 1]


def _confirm_all(
    graphs: dict[str, torch.fx.GraphModule], group: list[Stack], stacks: list[Stack]
) -> dict | str:
    """``{mode: _Found}`` for a stack (or sibling group) in every graph, or the first reason why
    not (naming the graph). A loop body may run no block of the other ``stacks``."""
    foreign = [b for st in stacks if st not in group for b in st.head + st.blocks]
    per_mode = {}
    for mode, gm in graphs.items():
        f = _confirm(gm.graph, group, foreign)
        if isinstance(f, str):
            return f"{f} ({mode} graph)"
        per_mode[mode] = f
    return per_mode


def _confirm(graph: torch.fx.Graph, group: list[Stack], foreign: list[str]) -> _Found | str:
    """The blocks of a stack (or of a group of sibling containers run by one loop body) in
    ``graph``, or why they are not a stack of residual blocks."""
    # sizes (batch x heads) computed once and reused by later blocks are no block's own
    nodes = [n for n in graph.nodes if n.op == "call_function" and _tensorish(n)]
    stack = group[0]
    items = [[st.blocks[i] for st in group] for i in range(len(stack.blocks))]
    owner = {n: _owner(n, items) for n in nodes}
    segs: list[list[torch.fx.Node]] = [[] for _ in stack.blocks]
    for n in nodes:
        if owner[n] is not None:
            segs[owner[n]].append(n)
    if any(not s for s in segs):
        return "a block does not run in forward"
    pos = {n: i for i, n in enumerate(nodes)}
    if len(group) > 1 or _between(nodes, segs, pos):
        # the loop body is the parent's: block i runs from its first op to block i+1's first
        segs = _loop_body(nodes, segs, pos, owner, foreign)
        if isinstance(segs, str):
            return segs
    first, last = pos[segs[0][0]], pos[segs[-1][-1]]
    span = nodes[first : last + 1]
    if len(span) != sum(map(len, segs)) or any(
        pos[a[-1]] > pos[b[0]] for a, b in zip(segs, segs[1:])
    ):
        return "the blocks' operations are interleaved with other code"
    if any([_sig(n) for n in s] != [_sig(n) for n in segs[0]] for s in segs[1:]):
        return "the blocks do not run the same operations"
    members = [set(s) for s in segs]
    outputs = []
    for i, s in enumerate(segs):
        out = [n for n in s if any(u not in members[i] for u in n.users)]
        if len(out) != 1:
            return f"block {stack.blocks[i]} has {len(out)} outputs read outside it, not one"
        if i + 1 < len(segs) and any(u not in members[i + 1] for u in out[0].users):
            return f"the output of {stack.blocks[i]} is read by more than the next block"
        outputs.append(out[0])
    # block 0's stream input: what block 1 reads of block 0, at the same place in block 0
    where = [(k, j) for k, n in enumerate(segs[1]) for j, a in enumerate(n.args)
             if a is outputs[0]]
    if not where:
        return "the blocks are not chained (a block's output does not feed the next)"
    firsts = {segs[0][k].args[j] for k, j in where}
    if len(firsts) != 1 or not isinstance(next(iter(firsts)), torch.fx.Node):
        return "the first block's input cannot be told from the others"
    inputs = [next(iter(firsts)), *outputs[:-1]]
    residual = []
    for i, s in enumerate(segs):
        found = _residual_adds(s, inputs[i], members[i])
        if not found:
            return (
                f"no residual add in {stack.blocks[i]} (an add of the block's input and a "
                "branch computed from it)"
            )
        residual.append(found)
    return _Found(segs, inputs, outputs, residual)


def _between(nodes: list, segs: list[list[torch.fx.Node]], pos: dict) -> bool:
    """Whether only code outside the blocks (the parent's) runs between consecutive blocks."""
    owned = {n for s in segs for n in s}
    first, last = pos[segs[0][0]], pos[segs[-1][-1]]
    return any(n not in owned for n in nodes[first : last + 1])


def _loop_body(
    nodes: list, segs: list[list[torch.fx.Node]], pos: dict, owner: dict, foreign: list[str]
) -> list[list[torch.fx.Node]] | str:
    """Blocks that end with the parent's code after them: block ``i`` runs from its first op up
    to block ``i + 1``'s first, the last block as many ops as the first. ``str``: why not.

    That code may not run another container's blocks (``foreign``): those must be cut with
    these, as siblings, or the stream would lose them."""
    starts = [pos[s[0]] for s in segs]
    if any(a >= b for a, b in zip(starts, starts[1:])):
        return "the blocks' operations are interleaved with other code"
    size = starts[1] - starts[0]
    ends = [*starts[1:], starts[-1] + size]
    body = [nodes[a:b] for a, b in zip(starts, ends)]
    for i, (seg, own) in enumerate(zip(body, segs)):
        if any(owner[n] not in (i, None) for n in seg) or not set(own) <= set(seg):
            return "the blocks' operations are interleaved with other code"
        if len(seg) != size:
            return "the parent's code between blocks differs from block to block"
        for n in (n for n in seg if owner[n] is None):
            inside = next((b for p in _paths(n) for b in foreign
                           if p == b or p.startswith(b + ".")), None)
            if inside:
                return f"the blocks' operations are interleaved with those of {inside}"
    return body


def _residual_adds(
    seg: list[torch.fx.Node], stream: torch.fx.Node, members: set[torch.fx.Node]
) -> list[tuple[torch.fx.Node, int]]:
    """The chain of residual adds of one block: ``stream + branch(stream)``, then again from
    that sum. A no-op conversion of the stream (LLaMA's ``hidden.to(float32)``, which export
    records inside the norm) still counts as the stream."""
    found = []
    aliases = {stream}
    for n in seg:
        if n.target in _PASSTHROUGH and n.args and n.args[0] in aliases:
            aliases.add(n)
            continue
        if n.target not in _ADDS or len(n.args) < 2:
            continue
        a, b = n.args[:2]
        j = 1 if a in aliases else 0 if b in aliases else None
        if j is None:
            continue
        other = n.args[j]
        if isinstance(other, torch.fx.Node) and other in members and _reads(other, stream, members):
            found.append((n, j))
            stream, aliases = n, {n}
    return found


def _reads(node: torch.fx.Node, source: torch.fx.Node, members: set[torch.fx.Node]) -> bool:
    """Whether ``node`` is computed from ``source`` (within the block)."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n is source:
            return True
        if n in seen or n not in members:
            continue
        seen.add(n)
        todo += [a for a in n.all_input_nodes]
    return False


def _remove_blocks(f: _Found, keep: set[int]) -> None:
    stream = f.inputs[0]
    for i, seg in enumerate(f.segments):
        if i in keep:
            stream = f.outputs[i]
            continue
        f.outputs[i].replace_all_uses_with(stream)
        for n in reversed(seg):
            n.graph.erase_node(n)


DEPTH = "depth_residual"


def insert_multipliers(
    sur: Captured, plan: DepthPlan, node_map: dict[torch.fx.Node, torch.fx.Node]
) -> dict[str, float]:
    """Multiply each kept block's residual branches by a 0-dim buffer (``depth_residual.scale``).

    A non-persistent buffer, like the muP readout multiplier: the ``state_dict`` keys stay the
    target's, and a fused group holds one value per trial. Returns ``{buffer: value}``.
    """
    names: dict[float, str] = {}
    dtype = next((p.dtype for p in sur.parameters() if p.is_floating_point()), torch.float32)
    changed = False
    for residuals in plan.residuals.values():
        for add, j, stack in residuals:
            value = stack.multiplier
            if value not in names:
                module = DEPTH if not names else f"{DEPTH}_{len(names)}"
                holder = nn.Module()
                holder.register_buffer("scale", torch.tensor(value, dtype=dtype),
                                       persistent=False)
                sur.add_module(module, holder)
                for gm in sur.graphs.values():
                    gm.add_module(module, holder)
                names[value] = module
            stack.buffer = f"{names[value]}.scale"
            new = node_map[add]
            branch = new.args[j]
            graph = new.graph
            with graph.inserting_before(new):
                scale = graph.get_attr(stack.buffer)
                scaled = graph.call_function(torch.ops.aten.mul.Tensor, (branch, scale))
            if "val" in branch.meta:
                scaled.meta["val"] = branch.meta["val"]
                scale.meta["val"] = sur.get_buffer(stack.buffer)
            for key in ("nn_module_stack", "stack_trace"):
                if key in branch.meta:
                    scaled.meta[key] = branch.meta[key]
            new.update_arg(j, scaled)
            changed = True
    if changed:
        for gm in sur.graphs.values():
            gm.recompile()
    return {f"{m}.scale": v for v, m in names.items()}


def warn_deep_cut(plan: DepthPlan, stacklevel: int = 3) -> bool:
    """Warn (:class:`hydro.errors.HydroWarning`) when CompleteP (``alpha`` 1) keeps a quarter or
    less of a stack's blocks: measured end to end on a char GPT, that surrogate's choice of
    learning rate was 2.2 doublings above the target's, where Depth-muP's matched the uncut
    surrogate's."""
    deep = [st for st in plan.stacks if st.cut and len(st.blocks) >= 4 * len(st.kept)]
    if plan.alpha != 1.0 or not deep:
        return False
    st = deep[0]
    warnings.warn(HydroWarning(
        f"depth_ratio {plan.depth_ratio} keeps {len(st.kept)} of {len(st.blocks)} blocks of "
        f"'{st.path}' with CompleteP (depth_alpha=1). On the 8-block char GPT of "
        "docs/explanation/transfer.md "
        "a CompleteP surrogate at depth ratio 4 chose a learning rate 2.2 doublings above the "
        "target's (40% worse loss), where depth_alpha=0.5 (Depth-muP) chose as well as keeping "
        "every block; use depth_alpha=0.5, or depth_ratio=2."
    ), stacklevel=stacklevel)
    return True


def warn_no_cut(plan: DepthPlan, model: nn.Module, stacklevel: int = 3) -> bool:
    """Warn (:class:`hydro.errors.HydroWarning`) when ``depth_ratio > 1`` cuts no block anywhere:
    the surrogate then has the target's depth, which the user asked not to pay for. The line
    names each container looked at and why it was left whole."""
    if plan.depth_ratio == 1 or any(st.cut for st in plan.stacks):
        return False
    name = type(model).__name__
    if plan.stacks:
        lines: list[str] = []  # a sibling group once, by its reason as one loop body
        for st in plan.stacks:
            reason = st.reason or "too few blocks to keep fewer"
            own, _, group = reason.partition(_GROUP)
            line = f"'{st.path or '(the model)'}' ({len(st.blocks)} blocks) left whole: {own}"
            if group:
                names, why_group = group.split(": ", 1)
                line = f"{names} ({len(st.blocks)} blocks each) left whole as one loop body: "
                line += why_group
            if line not in lines:
                lines.append(line)
        why = "; ".join(lines[:4])
        if len(lines) > 4:
            why += f"; and {len(lines) - 4} more (hydro.inspect lists them)"
    else:
        why = "it has no ModuleList, Sequential or ModuleDict of two or more blocks of one class"
    warnings.warn(HydroWarning(
        f"depth_ratio {plan.depth_ratio} cut no block of {name}, so the surrogate keeps the "
        f"target's depth: {why}. A block is cut when it is one module holding its residual add, "
        "or the i-th items of sibling lists run by one loop body in order "
        "(docs/explanation/concepts.md, "
        "'Depth')"
    ), stacklevel=stacklevel)
    return True


def block_of(name: str, plan: DepthPlan) -> Stack | None:
    """The cut stack a (surrogate) parameter name lies in, if any."""
    for stack in plan.stacks:
        if stack.cut and any(name.startswith(b + ".") for b in stack.kept):
            return stack
    return None


__all__ = [
    "DepthPlan",
    "Stack",
    "candidates",
    "check_args",
    "cut",
    "insert_multipliers",
    "warn_deep_cut",
    "warn_no_cut",
]
