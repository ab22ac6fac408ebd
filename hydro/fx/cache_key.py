"""What a capture-cache entry's key covers (:mod:`hydro.fx.cache`): the code the model runs,
its state other than tensor values, the example inputs' structure, and the versions.

:func:`key` digests them (:class:`_Walk` reads a model's classes, functions, constants and
attributes as data); a model whose state cannot be read as data is not cached
(:class:`_Uncacheable`). :func:`model_state` snapshots that state before a capture's first
forward, so every mode of one capture gets the key of the model as the caller built it.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import json
import os
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hydro._version import __version__

SCHEMA = 5  # bump when what an entry holds, or what the key covers, changes
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


class _Uncacheable(Exception):
    """Something the exported program may depend on that cannot be read as data."""


_MODULE_STATE = frozenset(nn.Module().__dict__) - {"training"}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
          "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
# attributes that differ between processes and that no forward reads: HuggingFace's generation
# config keeps the hash() of itself (strings hash differently in every process)
_VOLATILE = frozenset({"_original_object_hash"})
_MAX_ITEMS = 200_000  # a walk this long is not a model's configuration: not cached


@dataclass(frozen=True)
class ModelState:
    """A model's part of a cache key (its modules' attributes, tensors' shapes and classes),
    taken before a capture runs its forward: a forward may set attributes (BERT sets
    ``config.problem_type`` on its first call with labels), and a capture whose first program
    was loaded from the cache never ran it, so every program of one capture is keyed on the
    model as the capture found it."""

    model: list
    classes: dict


def model_state(model: nn.Module) -> ModelState | None:
    """``model``'s part of the key in its current mode; ``None`` when it cannot be keyed."""
    try:
        walk = _Walk()
        return ModelState(walk.model(model), dict(walk.classes))
    except Exception:  # state that breaks the walk: not cached, never an error
        return None


def key(model: nn.Module, args: tuple, kwargs: Mapping[str, Any], dynamic: Any,
        state: ModelState | None = None) -> str | None:
    """The cache key of exporting ``model`` on ``(args, kwargs)`` with ``dynamic`` shapes in its
    current mode, or ``None`` when the model cannot be keyed (then it is not cached).
    ``state``: :func:`model_state` taken earlier (before an earlier export of the same capture
    ran the forward); by default the model as it is now."""
    try:
        walk = _Walk()
        if state is None:
            model_part = walk.model(model)
        else:
            model_part = state.model
            walk.classes.update(state.classes)
        parts = [
            ("schema", SCHEMA, torch.__version__, sys.version_info[:3], _hydro_version()),
            ("modes", torch.is_grad_enabled(), str(torch.get_default_dtype()), _autocast()),
            ("model", model_part),
            ("inputs", walk.inputs((tuple(args), dict(kwargs)))),
            ("dynamic", walk.value(dynamic)),
        ]
        parts.append(("code", walk.code_of_classes()))  # of every class the walk met
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            raise _Uncacheable("a global forward hook")
    except _Uncacheable:
        return None
    except Exception:  # state that breaks the walk: not cached, never an error
        return None
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def _autocast() -> list:
    """Autocast in force around the capture (export records its casts)."""
    return [(d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d)))
            for d in ("cpu", "cuda")]


def _hydro_version() -> str:
    return __version__


def _user_class(cls: type) -> bool:
    file = getattr(sys.modules.get(cls.__module__), "__file__", None) or ""
    return cls.__module__ not in ("builtins",) and not os.path.abspath(file).startswith(_TORCH_DIR)


class _Walk:
    """One key's walk over a model, its inputs and the code they run."""

    def __init__(self) -> None:
        self.items = 0
        self.classes: dict[str, type] = {}
        self.stack: set[int] = set()

    def _count(self) -> None:
        self.items += 1
        if self.items > _MAX_ITEMS:
            raise _Uncacheable("too much state")

    def model(self, model: nn.Module) -> list:
        out = []
        for path, mod in model.named_modules(remove_duplicate=False):
            if any(getattr(mod, h, None) for h in _HOOKS):
                raise _Uncacheable(f"a forward hook on {path or 'the model'}")
            self._class(type(mod))
            attrs = {
                k: self.value(v)
                for k, v in sorted(mod.__dict__.items())
                if k not in _MODULE_STATE and k not in _HOOKS
            }
            tensors = [
                (kind, name, self._tensor_meta(t))
                for kind, items in (("p", mod._parameters), ("b", mod._buffers))
                for name, t in items.items()
            ]
            extra = sorted(mod._non_persistent_buffers_set)
            out.append((path, _qualname(type(mod)), attrs, tensors, extra))
        return out

    def inputs(self, value: Any) -> list:
        leaves, spec = tree_flatten(value)
        return [str(spec)] + [
            self._tensor_meta(x) if isinstance(x, torch.Tensor) else self.value(x) for x in leaves
        ]

    @staticmethod
    def _tensor_meta(t: torch.Tensor | None) -> Any:
        if t is None:
            return None
        return (tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad,
                str(t.layout), isinstance(t, nn.Parameter), type(t).__name__)

    def _class(self, cls: type) -> None:
        for c in cls.__mro__:
            if _user_class(c):
                self.classes.setdefault(_qualname(c), c)

    def code_of_classes(self) -> list:
        """Each user class's own code, and the globals of the modules whose classes define a
        ``forward`` (one level: the functions, classes and constants such a file names; a
        library's other files hold state of their own, a session id, that no forward reads)."""
        out, modules = [], {}
        for name, cls in sorted(self.classes.items()):
            out.append((name, self._class_dict(cls)))
            mod = sys.modules.get(cls.__module__)
            if mod is not None and "forward" in vars(cls):
                modules[cls.__module__] = mod
        for name, mod in sorted(modules.items()):
            out.append((name, self._globals(mod)))
        return out

    def _class_dict(self, cls: type) -> list:
        out = []
        for k, v in sorted(vars(cls).items()):
            if k in ("__dict__", "__weakref__", "__doc__", "__module__", "__annotations__"):
                continue
            if isinstance(v, (staticmethod, classmethod)):
                v = v.__func__
            if isinstance(v, property):
                v = (v.fget, v.fset)
            with contextlib.suppress(_Uncacheable):  # a descriptor the forward does not read
                out.append((k, self.value(v, shallow=True)))
        return out

    def _globals(self, mod: types.ModuleType) -> list:
        out = []
        for k, v in sorted(vars(mod).items()):
            if k.startswith("__") and k.endswith("__"):
                continue
            if isinstance(v, types.ModuleType):
                out.append((k, v.__name__))
            elif isinstance(v, type):
                out.append((k, _qualname(v), self._class_dict(v) if _user_class(v) else None))
            else:
                with contextlib.suppress(_Uncacheable):  # what a forward cannot use as data
                    out.append((k, self.value(v, shallow=True)))
        return out

    def value(self, v: Any, shallow: bool = False, depth: int = 0) -> Any:
        """A JSON-able fingerprint of a value a forward may read."""
        self._count()
        if depth > 12:
            raise _Uncacheable("nested too deep")
        if isinstance(v, _PLAIN):
            return [type(v).__name__, repr(v)]
        if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return ["torch", str(v)]
        if isinstance(v, enum.Enum):
            return ["enum", _qualname(type(v)), v.name]
        if isinstance(v, torch.Tensor):  # a plain tensor attribute becomes a graph constant
            if v.is_meta or type(v) not in (torch.Tensor, nn.Parameter):
                raise _Uncacheable("a tensor of a subclass")
            data = v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            return ["tensor", self._tensor_meta(v), hashlib.sha256(data).hexdigest()]
        if isinstance(v, type):
            if _user_class(v) and not shallow:
                self._class(v)
            return ["type", _qualname(v)]
        if isinstance(v, types.FunctionType):
            return ["fn", v.__module__, v.__qualname__, _code(v.__code__),
                    None if shallow else self._closure(v, depth)]
        if isinstance(v, types.MethodType):
            owner = v.__self__
            return ["method", self.value(v.__func__, shallow, depth + 1),
                    ["self"] if id(owner) in self.stack else _qualname(type(owner))]
        if _builtin(v):
            return ["builtin", getattr(v, "__module__", None), getattr(v, "__qualname__", repr(v))]
        if isinstance(v, functools.partial):
            return ["partial", self.value(v.func, shallow, depth + 1),
                    self.value(v.args, shallow, depth + 1),
                    self.value(v.keywords, shallow, depth + 1)]
        if shallow:
            raise _Uncacheable("an object")  # globals: plain data and code only
        if id(v) in self.stack:
            return ["cycle"]
        self.stack.add(id(v))
        try:
            return self._container(v, depth)
        finally:
            self.stack.discard(id(v))

    def _container(self, v: Any, depth: int) -> Any:
        d = depth + 1
        if isinstance(v, (tuple, list)):
            return [type(v).__name__, [self.value(x, depth=d) for x in v]]
        if isinstance(v, (set, frozenset)):
            return [type(v).__name__, sorted(json.dumps(self.value(x, depth=d)) for x in v)]
        if isinstance(v, Mapping):
            items = [(json.dumps(self.value(k, depth=d)), self.value(x, depth=d))
                     for k, x in v.items() if k not in _VOLATILE]
            return [_qualname(type(v)), sorted(items, key=lambda kv: kv[0])]
        if isinstance(v, nn.Module):  # held as a plain attribute, not a submodule
            self._class(type(v))
            state = {k: x for k, x in v.__dict__.items() if k not in _MODULE_STATE}
            tensors = {k: self._tensor_meta(t) for k, t in v.named_parameters()}
            return ["module", _qualname(type(v)), self.value(state, depth=d), tensors]
        attrs = getattr(v, "__dict__", None)
        slots = [s for c in type(v).__mro__ for s in getattr(c, "__slots__", ())]
        if attrs is None and not slots:
            raise _Uncacheable(f"a {type(v).__name__} object")
        if _user_class(type(v)):
            self._class(type(v))
        state = dict(attrs or {})
        for s in slots:
            if isinstance(s, str) and hasattr(v, s):
                state[s] = getattr(v, s)
        return ["obj", _qualname(type(v)), self.value(state, depth=d)]

    def _closure(self, fn: types.FunctionType, depth: int) -> Any:
        cells = [c.cell_contents for c in fn.__closure__ or () if _filled(c)]
        return [self.value(cells, depth=depth + 1), self.value(fn.__defaults__, depth=depth + 1),
                self.value(fn.__kwdefaults__, depth=depth + 1)]


def _builtin(v: Any) -> bool:
    """A function in C, or a stateless callable of torch's (``torch.ops.aten.add``)."""
    if isinstance(v, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        return True
    torch_callable = callable(v) and type(v).__module__.startswith("torch")
    return torch_callable and not isinstance(v, nn.Module)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _code(code: types.CodeType) -> str:
    """A hash of what a code object does and where its lines are (stack traces name them)."""
    h = hashlib.sha256()

    def feed(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars,
                       c.co_firstlineno, c.co_filename, c.co_argcount,
                       c.co_kwonlyargcount, c.co_flags)).encode())
        h.update(getattr(c, "co_linetable", b"") or b"")
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                feed(const)
            else:
                h.update(_const(const).encode())

    feed(code)
    return h.hexdigest()[:24]


def _const(c: Any) -> str:
    """A code constant's text, the same in every process (a frozenset's order follows string
    hashing, which differs between processes)."""
    if isinstance(c, frozenset):
        return "frozenset(" + ",".join(sorted(_const(x) for x in c)) + ")"
    if isinstance(c, tuple):
        return "(" + ",".join(_const(x) for x in c) + ")"
    return repr(c)


# --- entries ----------------------------------------------------------------------------------
