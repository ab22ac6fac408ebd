"""A captured model keeps the user's module hierarchy: typed submodules whose forward hooks fire.

The graphs of a :class:`~hydro.fx.capture.Captured` are flat (one ATen graph per mode, which is
what width analysis, muP and fusion rewrite). The module tree around them is rebuilt here:

* :func:`adopt` gives a captured model (or a surrogate) the user's tree: every submodule is an
  instance of the user's class (made without running its ``__init__``), holding the captured
  tensors under the same names, its plain attributes copied, and width-valued ones
  (``in_features``, ``out_features``, ``embedding_dim``, ``normalized_shape`` ...) set to the
  sizes of its own, scaled, parameters. ``named_modules()`` then lists the user's names
  (less blocks a depth cut removed), ``isinstance(m, nn.Linear)`` holds.
* :func:`run_hooked` runs a graph node by node and calls the forward (pre-)hooks of each
  submodule at the boundaries of its calls. Every node carries export's ``nn_module_stack``
  (the module calls it ran inside, one key per call, ``@1`` for a module's second call), so a
  call is the run of nodes under one key; its inputs are the tensors flowing into those nodes
  from outside, its outputs the tensors they produce that are read outside. The compiled graph
  is used whenever no hook is registered, so training pays nothing for this.

What differs from calling the user's module: a hook's ``args`` are the call's tensor inputs in
the order the call first reads them (keyword arguments arrive positionally, non-tensor
arguments are left out), a call returning several tensors gives them as a tuple (not the
user's container), and a module whose call computes nothing (``nn.Identity``, a pass-through)
has no call to hook.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx._pytree import tree_flatten_spec
from torch.nn.modules import module as _module_mod
from torch.utils._pytree import tree_unflatten

from hydro.fx.rules.common import TensorSyms

# the per-instance state nn.Module.__init__ makes; a shell gets fresh ones, not the user's
_STATE = tuple(k for k in nn.Module().__dict__ if k != "training")
_HOOKS = ("_forward_hooks", "_forward_pre_hooks")


def _shell(template: nn.Module, state: nn.Module | None, fresh_hooks: bool) -> nn.Module:
    """An instance of ``template``'s class with its plain attributes and ``state``'s tensors
    (a plain ``nn.Module`` where the class cannot be made without its ``__init__``)."""
    try:
        shell = type(template).__new__(type(template))
    except TypeError:
        shell = nn.Module.__new__(nn.Module)
    shell.__dict__.update(template.__dict__)
    blank = nn.Module().__dict__
    for key in _STATE:
        value = blank[key] if fresh_hooks else template.__dict__.get(key, blank[key])
        # a copy: the template's dicts stay its own (None: an unset optional slot)
        shell.__dict__[key] = value if value is None else type(value)(value)
    shell.__dict__["_modules"] = OrderedDict()
    if state is not None:
        shell.__dict__["_parameters"] = state._parameters
        shell.__dict__["_buffers"] = state._buffers
        shell.__dict__["_non_persistent_buffers_set"] = state._non_persistent_buffers_set
        shell.__dict__["_modules"] = OrderedDict(state._modules)  # adopted in their turn
    return shell


def _widths(template: nn.Module, shell: nn.Module, inside: dict[int, set[int]]) -> None:
    """Set the shell's width-valued attributes to its own tensors' sizes.

    A size of one of the template's own parameters or buffers that changed (64 -> 8) is a width;
    so is one of a tensor computed inside the module's calls (``inside``: a head count of 4 ->
    1, seen in the ``view`` that splits heads), where its own tensors say nothing about it. An
    int attribute equal to such a size (``in_features``, ``n_head``), or an int tuple made of
    them (``normalized_shape``), is rewritten where the change is unambiguous.
    """
    changed: dict[int, set[int]] = {}
    for kind in ("_parameters", "_buffers"):
        for name, old in template.__dict__[kind].items():
            new = shell.__dict__[kind].get(name)
            if old is None or new is None or old.dim() != new.dim():
                continue
            for o, n in zip(old.shape, new.shape):
                if o != n:
                    changed.setdefault(o, set()).add(n)
    for o, n in inside.items():
        changed.setdefault(o, set(n))
    sizes = {o: next(iter(n)) for o, n in changed.items() if len(n) == 1}
    if not sizes:
        return
    for key, value in template.__dict__.items():
        if key.startswith("_") or type(value) is bool:
            continue
        if type(value) is int and value in sizes:
            shell.__dict__[key] = sizes[value]
        elif isinstance(value, tuple) and value and all(type(v) is int for v in value):
            if any(v in sizes for v in value):
                shell.__dict__[key] = tuple(sizes.get(v, v) for v in value)


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _sizes_inside(plan: Any) -> dict[str, dict[int, set[int]]]:
    """For each module path, the sizes of the tensors its calls compute that the width plan
    changes: ``{path: {old size: {new sizes}}}``."""
    found: dict[str, dict[int, set[int]]] = {}
    for node, syms in plan.node_syms.items():
        stack = node.meta.get("nn_module_stack") or {}
        if not isinstance(syms, TensorSyms) or not stack:
            continue
        pairs = []
        for sym in syms:
            old, new = plan.sizes[sym], plan.new_dim(sym)
            if old != new:
                pairs.append((old, new))
        for entry in stack.values():
            path = entry[0] if isinstance(entry, tuple) else None
            if path and pairs:
                at = found.setdefault(path, {})
                for old, new in pairs:
                    at.setdefault(old, set()).add(new)
    return found


def adopt(
    root: nn.Module, template: nn.Module, removed: Iterable[str] = (), plan: Any = None
) -> None:
    """Give ``root`` (a captured model whose tensors sit in plain containers) the module tree of
    ``template`` (the user's model): each container becomes an instance of the user's class at
    that path, holding the same tensors; parameter-free submodules (activations, dropout) are
    added. Paths in ``removed`` (blocks a depth cut dropped) and submodules with tensors the
    captured model does not have are left out. Containers Hydro added (``mup_readout``) stay.
    ``plan`` (a :class:`~hydro.fx.widths.WidthPlan`) says the sizes computed inside each
    module's calls, for attributes its own tensors do not show (head counts).
    """
    inside = _sizes_inside(plan) if plan is not None else {}
    _adopt(root, template, "", set(removed), inside)
    root.__dict__.pop("_hydro_scan", None)  # a new tree: has_hooks lists it again


def _adopt(parent: nn.Module, template: nn.Module, prefix: str, removed: set, inside: dict):
    old = dict(parent._modules)
    children: OrderedDict[str, nn.Module] = OrderedDict()
    for name, t_child in template._modules.items():
        path = f"{prefix}{name}"
        existing = old.pop(name, None)
        if t_child is None or path in removed or (existing is None and _has_state(t_child)):
            continue
        shell = _shell(t_child, existing, fresh_hooks=True)
        _widths(t_child, shell, inside.get(path, {}))
        _adopt(shell, t_child, f"{path}.", removed, inside)
        children[name] = shell
    children.update(old)
    parent.__dict__["_modules"] = children


def copy_tree(source: nn.Module, new: nn.Module) -> None:
    """Give ``new`` (an empty module) the classes, attributes and hooks of ``source``'s
    submodules, without their tensors (a deep copy registers those after)."""
    for name, child in source._modules.items():
        if child is None:
            continue
        shell = _shell(child, None, fresh_hooks=False)
        copy_tree(child, shell)
        new._modules[name] = shell


# --- hooks ------------------------------------------------------------------------------------


def has_hooks(root: nn.Module) -> bool:
    """Whether any submodule of ``root`` (or the global registry) has a forward (pre-)hook.

    Called on every forward, so the submodules are listed once and kept (walking the tree each
    time costs more than a small surrogate's step gains from it); the list is made again when
    ``root``'s own children change.
    """
    if _module_mod._global_forward_hooks or _module_mod._global_forward_pre_hooks:
        return True
    key = (id(root._modules), len(root._modules))
    scan = root.__dict__.get("_hydro_scan")
    if scan is None or scan[0] != key:
        hooks = [getattr(m, h) for m in root.modules() if m is not root for h in _HOOKS]
        scan = (key, tuple(hooks))  # the hook dicts themselves: any() over them runs in C
        root.__dict__["_hydro_scan"] = scan
    return any(scan[1])


class _Call:
    """One call of one submodule in a graph: its nodes, inputs and outputs."""

    __slots__ = ("first", "inputs", "last", "module", "nodes", "outputs", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self.nodes: list[torch.fx.Node] = []
        self.inputs: list[torch.fx.Node] = []
        self.outputs: list[torch.fx.Node] = []
        self.module: nn.Module | None = None


def module_calls(graph: torch.fx.Graph) -> list[_Call]:
    """The submodule calls recorded in ``graph`` (export's ``nn_module_stack``), in graph
    order of their first node."""
    calls: dict[str, _Call] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for key, entry in (node.meta.get("nn_module_stack") or {}).items():
            path = entry[0] if isinstance(entry, tuple) else None
            if not path or not isinstance(path, str):  # the root: nn.Module.__call__ hooks it
                continue
            calls.setdefault(key, _Call(path)).nodes.append(node)
    for call in calls.values():
        members = set(call.nodes)
        seen: set[torch.fx.Node] = set()
        for node in call.nodes:
            for arg in node.all_input_nodes:
                if arg not in members and arg not in seen and arg.op != "get_attr":
                    seen.add(arg)
                    call.inputs.append(arg)
            if any(user not in members for user in node.users):
                call.outputs.append(node)
    return list(calls.values())


def _bind_flat(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list[Any]:
    """The graph's flat inputs for a call, as its generated ``forward`` computes them."""
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    spec = gm._in_spec
    n_pos = spec.child(0).num_children
    names = list(values)
    keys = spec.child(1).context
    return tree_flatten_spec(
        ([values[n] for n in names[:n_pos]], {k: values[k] for k in keys}), spec
    )


def _forward_hooks(module: nn.Module) -> list[tuple[Any, bool]]:
    hooks = [(h, False) for h in _module_mod._global_forward_hooks.values()]
    for hid, h in module._forward_hooks.items():
        hooks.append((h, hid in module._forward_hooks_with_kwargs))
    return hooks


def _pre_hooks(module: nn.Module) -> list[tuple[Any, bool]]:
    hooks = [(h, False) for h in _module_mod._global_forward_pre_hooks.values()]
    for hid, h in module._forward_pre_hooks.items():
        hooks.append((h, hid in module._forward_pre_hooks_with_kwargs))
    return hooks


class _Hooked(torch.fx.Interpreter):
    """Runs a captured graph node by node, calling submodule hooks at call boundaries."""

    def __init__(self, root: nn.Module, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)  # hooks read inputs after their use
        self.root = root
        self.starts: dict[torch.fx.Node, list[_Call]] = {}
        self.ends: dict[torch.fx.Node, list[_Call]] = {}
        for call in module_calls(gm.graph):
            call.module = _lookup(root, call.path)
            if call.module is None or call.module is root:
                continue
            self.starts.setdefault(call.nodes[0], []).append(call)
            self.ends.setdefault(call.nodes[-1], []).append(call)
        for ending in self.ends.values():  # inner calls end first, as their hooks run first
            ending.sort(key=lambda c: -c.path.count("."))
        for starting in self.starts.values():
            starting.sort(key=lambda c: c.path.count("."))

    def fetch_attr(self, target: str) -> Any:
        found = _lookup_attr(self.root, target)
        return found if found is not None else super().fetch_attr(target)

    def _values(self, nodes: list[torch.fx.Node]) -> tuple:
        return tuple(
            self.env[n] for n in nodes if n in self.env and isinstance(self.env[n], torch.Tensor)
        )

    def run_node(self, n: torch.fx.Node) -> Any:
        for call in self.starts.get(n, ()):
            inputs = self._values(call.inputs)
            for hook, with_kwargs in _pre_hooks(call.module):
                got = hook(call.module, inputs, {}) if with_kwargs else hook(call.module, inputs)
                if got is not None:
                    raise RuntimeError(
                        f"a forward pre-hook of '{call.path}' returned new inputs; a captured "
                        "model's submodule cannot take replaced inputs (return None, or "
                        "change the tensors in place)"
                    )
        result = super().run_node(n)
        for call in self.ends.get(n, ()):
            self.env[n] = result
            outs = [o for o in call.outputs if isinstance(self.env.get(o), torch.Tensor)]
            if not outs:
                continue
            inputs = self._values(call.inputs)
            output = self.env[outs[0]] if len(outs) == 1 else tuple(self.env[o] for o in outs)
            for hook, with_kwargs in _forward_hooks(call.module):
                if with_kwargs:
                    got = hook(call.module, inputs, {}, output)
                else:
                    got = hook(call.module, inputs, output)
                if got is not None:
                    if len(outs) != 1:
                        got = tuple(got)
                        for o, value in zip(outs, got):
                            self.env[o] = value
                    else:
                        self.env[outs[0]] = got
                    output = got
            result = self.env[n]
        return result


def _lookup(root: nn.Module, path: str) -> nn.Module | None:
    mod: Any = root
    for part in path.split("."):
        mod = mod._modules.get(part) if isinstance(mod, nn.Module) else None
        if mod is None:
            return None
    return mod


def _lookup_attr(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def run_hooked(root: nn.Module, gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> Any:
    """Run ``gm`` (a graph of the captured model ``root``) on one call's inputs, calling the
    forward pre-hooks and forward hooks of ``root``'s submodules at their calls."""
    flat = _bind_flat(gm, args, kwargs)
    out = _Hooked(root, gm).run(*flat, enable_io_processing=False)  # flat in, flat out
    return tree_unflatten(list(out), gm._out_spec)


__all__ = ["adopt", "copy_tree", "has_hooks", "module_calls", "run_hooked"]
