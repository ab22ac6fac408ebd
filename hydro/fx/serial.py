"""A captured graph as plain JSON data, and back, for the capture cache.

torch's own serializer (``torch.export.save``) rebuilds a whole ``ExportedProgram``, each node's
symbolic shapes through the fake-tensor dispatcher: about 0.35 s per program on an idle core.
What Hydro reads downstream is less: the ``GraphModule`` that ``ep.module()`` returns (its
nodes, their ops and arguments, the pytree calling convention) and three entries of each
node's ``meta``: ``val`` (a fake tensor whose sizes are ints or symbolic sizes, or a
``SymInt``), ``nn_module_stack`` and ``stack_trace``.
:func:`encode` writes exactly that as JSON-able data; :func:`decode` rebuilds the graph with
``torch.fx.Graph.create_node`` and the values as fake tensors over a fresh ``ShapeEnv`` holding
the captured symbols and their ranges, one fake tensor per distinct description.

Nothing read back is run as code of its own: ops are looked up by name in ``torch.ops.aten``
and ``torch.ops.prims`` (OpOverloads only), a few higher-order ops and a fixed table of Python
operators; names and attribute paths must be identifiers; strings that reach the generated
code (stack traces, in its comments) must hold no line breaks other than ``\\n``; symbolic
sizes are rebuilt from a tree of sums, products and floor divisions (never ``sympify``, which
evaluates text). Anything else makes :class:`Unsupported` (at writing: not cached) or
:class:`Invalid` (at reading: the entry is rebuilt).
"""

from __future__ import annotations

import json
import keyword
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import sympy
import torch
import torch.fx
from torch import nn

from hydro.fx.paths import register_at


class Unsupported(Exception):
    """A graph (or value) this format cannot hold: the program is not cached."""


class Invalid(Exception):
    """Data that is not what :func:`encode` writes: the entry is not trusted."""


# Python callables an exported graph calls (sizes, items of multi-output ops)
_FUNCTIONS: dict[str, Callable] = {
    f"operator.{n}": getattr(operator, n)
    for n in ("getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow",
              "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_")
}
_FUNCTIONS.update({f"torch.{n}": getattr(torch, n)
                   for n in ("sym_float", "sym_int", "sym_max", "sym_min", "sym_not",
                             "sym_ite", "sym_sqrt") if hasattr(torch, n)})
_FUNCTIONS.update({"math.ceil": math.ceil, "math.floor": math.floor, "math.sqrt": math.sqrt})
_FUNCTION_NAMES = {id(f): n for n, f in _FUNCTIONS.items()}
_NAMESPACES = ("aten", "prims")
_HIGHER_ORDER = ("wrap_with_set_grad_enabled", "wrap_with_autocast")
_OPS = ("placeholder", "get_attr", "call_function", "output")
_BAD_CHARS = {c for c in map(chr, range(32)) if c not in "\n\t"} | {"\x7f", "\x85", "\u2028",
                                                                       "\u2029"}


def identifier(name: Any) -> bool:
    """A Python name that is not a keyword."""
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)


def _public(name: Any) -> bool:
    """A name looked up on a torch namespace: an identifier, not a dunder."""
    return identifier(name) and not name.startswith("__")


def _op_named(ns: Any, op: Any, overload: Any) -> bool:
    """``ns::op.overload`` names a registered ATen/prims operator: a public name, or a dunder
    that is itself an operator's name (``aten.__and__.Tensor``, what ``&`` on tensors records;
    checked against the registry before any attribute is looked up)."""
    if ns not in _NAMESPACES or not _public(overload):
        return False
    if _public(op):
        return True
    return identifier(op) and bool(torch._C._jit_get_schemas_for_operator(f"{ns}::{op}"))


def attr_path(path: Any) -> bool:
    """A dotted attribute path of identifiers or digits (``h.0.attn``, ``0.weight``)."""
    if not isinstance(path, str) or not path:
        return False
    return all(identifier(p) or (p.isascii() and p.isdigit()) for p in path.split("."))


# --- writing ----------------------------------------------------------------------------------


def encode(gm: torch.fx.GraphModule) -> dict:
    """``gm`` (an exported graph module, guards stripped) as JSON-able data; its get_attr
    targets other than subgraphs are listed in ``"attrs"``, to be supplied when decoding.

    Raises:
        Unsupported: an op, argument or value this format does not hold.
    """
    return _Writer().module(gm)


class _Writer:
    def __init__(self) -> None:
        self.symbols: dict[str, list] = {}

    def module(self, gm: torch.fx.GraphModule, top: bool = True) -> dict:
        subs = {}
        for name, sub in gm.named_children():
            if isinstance(sub, torch.fx.GraphModule):
                subs[name] = self.module(sub, top=False)
        codegen = gm.graph._codegen
        if type(codegen) is torch.fx.graph.CodeGen:
            pytree = None
        elif type(codegen) is torch.fx.graph._PyTreeCodeGen:
            info = codegen.pytree_info
            pytree = {"args": list(info.orig_args),
                      "in": torch.utils._pytree.treespec_dumps(info.in_spec),
                      "out": None if info.out_spec is None
                      else torch.utils._pytree.treespec_dumps(info.out_spec)}
        else:
            raise Unsupported(f"a graph with {type(codegen).__name__}")
        nodes, attrs = [], []
        for node in gm.graph.nodes:
            if node.op not in _OPS:
                raise Unsupported(f"a {node.op} node")
            if node.op == "get_attr" and node.target not in subs:
                attrs.append(node.target)
            nodes.append([node.op, node.name, self.target(node), self.arg(node.args),
                          [[k, self.arg(v)] for k, v in node.kwargs.items()],
                          self.meta(node.meta)])
        out = {"nodes": nodes, "pytree": pytree, "subgraphs": subs, "attrs": attrs}
        if top:
            out["symbols"] = self.symbols
        elif attrs:  # a `with` region's subgraph takes its tensors as operands
            raise Unsupported("a subgraph that reads tensors of its own")
        return out

    def target(self, node: torch.fx.Node) -> Any:
        t = node.target
        if node.op != "call_function":
            return t
        if isinstance(t, torch._ops.OpOverload):
            ns = t.namespace
            if ns not in _NAMESPACES:
                raise Unsupported(f"an op of namespace {ns}")
            op = t._schema.name.split("::", 1)[1]
            if not _op_named(ns, op, t._overloadname):  # what the reader would refuse
                raise Unsupported(f"the op {t}")
            return ["op", ns, op, t._overloadname]
        if isinstance(t, torch._ops.HigherOrderOperator):
            if t.name() not in _HIGHER_ORDER:
                raise Unsupported(f"the higher-order op {t.name()}")
            return ["hop", t.name()]
        name = _FUNCTION_NAMES.get(id(t))
        if name is None:
            raise Unsupported(f"a call of {t!r}")
        return ["fn", name]

    def arg(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return {"n": a.name}
        if a is None or isinstance(a, (bool, str)):
            return a
        if type(a) is int:
            return a
        if type(a) is float:
            return {"f": a.hex()}
        if isinstance(a, (list, tuple)):
            return {"l" if isinstance(a, list) else "t": [self.arg(x) for x in a]}
        if isinstance(a, torch.dtype):
            return {"dtype": str(a).removeprefix("torch.")}
        if isinstance(a, torch.device):
            return {"device": str(a)}
        if isinstance(a, torch.layout):
            return {"layout": str(a).removeprefix("torch.")}
        if isinstance(a, torch.memory_format):
            return {"memory_format": str(a).removeprefix("torch.")}
        raise Unsupported(f"an argument of type {type(a).__name__}")

    def meta(self, meta: Mapping[str, Any]) -> dict:
        out: dict[str, Any] = {}
        if "val" in meta:
            out["val"] = self.value(meta["val"])
        stack = meta.get("nn_module_stack")
        if stack is not None:
            out["nn_module_stack"] = [[k, path, kind if isinstance(kind, str) else
                                       f"{kind.__module__}.{kind.__qualname__}"]
                                      for k, (path, kind) in stack.items()]
        if meta.get("stack_trace") is not None:
            out["stack_trace"] = meta["stack_trace"]
        return out

    def value(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if v.layout is not torch.strided:
                raise Unsupported(f"a {v.layout} tensor")
            return {"T": [[self.size(s) for s in v.shape], [self.size(s) for s in v.stride()],
                          self.size(v.storage_offset()), str(v.dtype).removeprefix("torch."),
                          str(v.device), bool(v.requires_grad)]}
        if isinstance(v, torch.SymInt):
            return {"S": self.size(v)}
        if v is None or isinstance(v, (bool, int)):
            return v
        if type(v) is float:
            return {"f": v.hex()}
        if isinstance(v, (list, tuple)):
            return {"l" if isinstance(v, list) else "t": [self.value(x) for x in v]}
        raise Unsupported(f"a value of type {type(v).__name__}")

    def size(self, s: Any) -> Any:
        if type(s) is int:
            return s
        if not isinstance(s, torch.SymInt):
            raise Unsupported(f"a size of type {type(s).__name__}")
        node = s.node
        return self.expr(node.expr, node.shape_env)

    def expr(self, e: Any, env: Any) -> Any:
        from torch.utils._sympy.functions import FloorDiv, Max, Min

        if e.is_Integer:
            return int(e)
        if e.is_Symbol:
            name = str(e)
            if name not in self.symbols:
                vr = env.var_to_range.get(e)
                hints = getattr(env, "backed_var_to_val", None)  # torch >= 2.9
                hints = env.var_to_val if hints is None else hints
                if vr is None or e not in hints or not identifier(name):
                    raise Unsupported(f"a symbol {name} without a range or hint")
                lo, hi = (int(b) if isinstance(b, sympy.Integer) else None
                          for b in (vr.lower, vr.upper))
                self.symbols[name] = [lo, hi, int(hints[e])]
            return {"s": name}
        if e.is_Add:
            return {"+": [self.expr(a, env) for a in e.args]}
        if e.is_Mul:
            return {"*": [self.expr(a, env) for a in e.args]}
        if isinstance(e, FloorDiv):
            return {"//": [self.expr(a, env) for a in e.args]}
        if e.is_Pow and e.args[1].is_Integer and int(e.args[1]) > 0:
            return {"**": [self.expr(e.args[0], env), int(e.args[1])]}
        if isinstance(e, (Min, Max)):  # a stride of a reshaped broadcast, a clamped slice end
            return {"min" if isinstance(e, Min) else "max": [self.expr(a, env) for a in e.args]}
        raise Unsupported(f"a symbolic size {e}")


# --- reading ----------------------------------------------------------------------------------


def decode(data: Any, attrs: Mapping[str, Any], name: str = "GraphModule") -> torch.fx.GraphModule:
    """The graph module :func:`encode` wrote, its get_attr targets taken from ``attrs``
    (``{dotted path: tensor}``, each listed one required).

    Raises:
        Invalid: anything :func:`encode` does not write.
    """
    try:
        return _Reader(data).module(data, attrs, name)
    except Invalid:
        raise
    except Exception as exc:  # malformed data of any other shape
        raise Invalid(f"{type(exc).__name__}: {exc}") from exc


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise Invalid(what)


class _Reader:
    def __init__(self, data: Any) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        from torch.utils._sympy.numbers import int_oo
        from torch.utils._sympy.value_ranges import ValueRanges

        _check(isinstance(data, dict) and isinstance(data.get("symbols"), dict), "no symbols")
        self.env = ShapeEnv()
        self.mode = FakeTensorMode(shape_env=self.env, allow_non_fake_inputs=True)
        self.symbols: dict[str, sympy.Symbol] = {}
        self.hints: dict[sympy.Symbol, int] = {}
        hints = getattr(self.env, "backed_var_to_val", None)  # torch >= 2.9
        hints = self.env.var_to_val if hints is None else hints
        for sym_name, (lo, hi, hint) in data["symbols"].items():
            _check(identifier(sym_name) and all(x is None or type(x) is int for x in (lo, hi))
                   and type(hint) is int, "a bad symbol")
            sym = sympy.Symbol(sym_name, integer=True, positive=True)
            self.env.var_to_range[sym] = ValueRanges(-int_oo if lo is None else lo,
                                                     int_oo if hi is None else hi)
            hints[sym] = sympy.Integer(hint)
            self.symbols[sym_name], self.hints[sym] = sym, hint
        self.tensors: dict[str, torch.Tensor] = {}

    def module(self, data: Any, attrs: Mapping[str, Any], name: str) -> torch.fx.GraphModule:
        _check(isinstance(data, dict), "not a graph")
        root = nn.Module()
        subs = data["subgraphs"]
        _check(isinstance(subs, dict), "bad subgraphs")
        for sub_name, sub in subs.items():
            _check(identifier(sub_name), f"a bad subgraph name {sub_name!r}")
            root.add_module(sub_name, self.module(sub, {}, "GraphModule"))
        for path in data["attrs"]:
            _check(attr_path(path) and path in attrs, f"an unknown attribute {path!r}")
            _set(root, path, attrs[path])
        graph = torch.fx.Graph()
        pytree = data["pytree"]
        if pytree is not None:
            from torch.utils._pytree import treespec_loads

            args = pytree["args"]
            _check(isinstance(args, list) and all(map(identifier, args)), "bad arguments")
            out = None if pytree["out"] is None else treespec_loads(pytree["out"])
            graph._codegen = torch.fx.graph._PyTreeCodeGen(
                torch.fx.graph._PyTreeInfo(args, treespec_loads(pytree["in"]), out)
            )
        env: dict[str, torch.fx.Node] = {}
        for op, node_name, target, args, kwargs, meta in data["nodes"]:
            _check(op in _OPS and identifier(node_name) and node_name not in env,
                   f"a bad node {node_name!r}")
            if op == "call_function":
                target = self.target(target)
            elif op == "get_attr":
                _check(target in subs or target in data["attrs"], f"an unknown target {target!r}")
            else:
                _check(identifier(target), f"a bad target {target!r}")
            a = self.arg(args, env)
            kw = {}
            for k, v in kwargs:
                _check(identifier(k), f"a bad keyword {k!r}")
                kw[k] = self.arg(v, env)
            _check(isinstance(a, tuple), "arguments not a tuple")
            node = graph.create_node(op, target, a, kw, name=node_name)
            _check(node.name == node_name, f"a node name taken twice: {node_name!r}")
            node.meta.update(self.meta(meta))
            env[node_name] = node
        graph.lint()
        gm = torch.fx.GraphModule(root, graph, name)
        if pytree is not None:
            gm._in_spec, gm._out_spec = graph._codegen.pytree_info[1:]
        return gm

    def target(self, t: Any) -> Any:
        _check(isinstance(t, list) and t and isinstance(t[0], str), f"a bad call {t!r}")
        kind = t[0]
        if kind == "op":
            _, ns, op, overload = t
            _check(_op_named(ns, op, overload), f"a bad op {t!r}")
            packet = getattr(getattr(torch.ops, ns), op)
            found = getattr(packet, overload)
            ok = isinstance(found, torch._ops.OpOverload)
            ok = ok and (found._schema.name, found._overloadname) == (f"{ns}::{op}", overload)
            _check(ok, f"not an op: {t!r}")
            return found
        if kind == "hop":
            _check(len(t) == 2 and t[1] in _HIGHER_ORDER, f"a bad higher-order op {t!r}")
            found = getattr(torch.ops.higher_order, t[1])
            _check(isinstance(found, torch._ops.HigherOrderOperator), f"not an op: {t!r}")
            return found
        _check(kind == "fn" and len(t) == 2 and t[1] in _FUNCTIONS, f"a bad function {t!r}")
        return _FUNCTIONS[t[1]]

    def arg(self, a: Any, env: dict) -> Any:
        if a is None or isinstance(a, (bool, str)) or type(a) is int:
            return a
        _check(isinstance(a, dict) and len(a) == 1, f"a bad argument {a!r}")
        (kind, v), = a.items()
        if kind == "n":
            _check(v in env, f"a node used before it is made: {v!r}")
            return env[v]
        if kind == "f":
            return float.fromhex(v)
        if kind in ("l", "t"):
            _check(isinstance(v, list), "a bad list")
            items = [self.arg(x, env) for x in v]
            return items if kind == "l" else tuple(items)
        return _torch_value(kind, v)

    def meta(self, m: Any) -> dict:
        _check(isinstance(m, dict) and set(m) <= {"val", "nn_module_stack", "stack_trace"},
               "bad metadata")
        out: dict[str, Any] = {}
        if "val" in m:
            out["val"] = self.value(m["val"])
        if "nn_module_stack" in m:
            stack = {}
            for k, path, kind in m["nn_module_stack"]:
                _check(all(isinstance(x, str) for x in (k, path, kind)), "a bad module stack")
                stack[k] = (path, kind)
            out["nn_module_stack"] = stack
        if "stack_trace" in m:
            text = m["stack_trace"]
            # it reaches the generated code, in a comment: no other line breaks
            _check(isinstance(text, str) and not _BAD_CHARS.intersection(text), "a bad trace")
            out["stack_trace"] = text
        return out

    def value(self, v: Any) -> Any:

        if v is None or isinstance(v, bool) or type(v) is int:
            return v
        _check(isinstance(v, dict) and len(v) == 1, f"a bad value {v!r}")
        (kind, x), = v.items()
        if kind == "T":
            # one fake tensor per distinct description (most nodes repeat a few shapes: making
            # each one's symbolic sizes is most of a load); Hydro's passes share values too
            memo = json.dumps(x, separators=(",", ":"))
            if memo not in self.tensors:
                self.tensors[memo] = self.tensor(x)
            return self.tensors[memo]
        if kind == "S":
            s = self.size(x)
            return s
        if kind == "f":
            return float.fromhex(x)
        if kind in ("l", "t"):
            items = [self.value(y) for y in x]
            return items if kind == "l" else tuple(items)
        raise Invalid(f"a bad value kind {kind!r}")

    def tensor(self, x: Any) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        shape, stride, offset, dtype, device, grad = x
        sizes = [self.size(s) for s in shape]
        strides = [self.size(s) for s in stride]
        _check(len(sizes) == len(strides) and type(grad) is bool, "a bad tensor")
        dev = _torch_value("device", device)
        elem = torch.empty_strided(sizes, strides, dtype=_torch_value("dtype", dtype),
                                   device="meta")
        off = self.size(offset)
        if not (type(off) is int and off == 0):
            elem = elem.as_strided(sizes, strides, off)
        t = FakeTensor(self.mode, elem, dev)
        if grad:
            t.requires_grad_(True)
        return t

    def size(self, s: Any) -> Any:
        from torch.fx.experimental.sym_node import SymNode

        if type(s) is int:
            return s
        e = self.expr(s)
        if e.is_Integer:
            return int(e)
        hint = int(e.xreplace(self.hints))
        return torch.SymInt(SymNode(e, self.env, int, hint))

    def expr(self, s: Any) -> Any:
        from torch.utils._sympy.functions import FloorDiv, Max, Min

        if type(s) is int:
            return sympy.Integer(s)
        _check(isinstance(s, dict) and len(s) == 1, f"a bad size {s!r}")
        (kind, x), = s.items()
        if kind == "s":
            _check(x in self.symbols, f"an unknown symbol {x!r}")
            return self.symbols[x]
        if kind == "**":
            base, n = x
            _check(type(n) is int and 0 < n < 64, "a bad power")
            return sympy.Pow(self.expr(base), n)
        _check(kind in ("+", "*", "//", "min", "max") and isinstance(x, list) and x,
               f"a bad size {s!r}")
        parts = [self.expr(y) for y in x]
        if kind in ("min", "max"):
            return (Min if kind == "min" else Max)(*parts)
        if kind == "+":
            return sympy.Add(*parts)
        if kind == "*":
            return sympy.Mul(*parts)
        _check(len(parts) == 2, "a bad floor division")
        return FloorDiv(*parts)


def _torch_value(kind: str, v: Any) -> Any:
    _check(isinstance(v, str), f"a bad {kind}")
    if kind == "device":
        return torch.device(v)
    types = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}
    _check(kind in types and _public(v), f"a bad argument kind {kind!r}")
    found = getattr(torch, v, None)
    _check(isinstance(found, types[kind]), f"not a {kind}: {v!r}")
    return found


def _set(root: nn.Module, path: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise Invalid(f"attribute {path!r} is not a tensor")
    register_at(root, path, value, "param" if isinstance(value, nn.Parameter) else "buffer")


__all__ = ["Invalid", "Unsupported", "attr_path", "decode", "encode", "identifier"]
