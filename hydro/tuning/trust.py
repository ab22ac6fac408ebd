"""Which callables a config may name: your own code, and the installed packages it trusts.

A config is code: naming ``module:callable`` imports that module and calls it with the config's
arguments. Installed libraries hold functions that run whatever their argument says
(``sympy:sympify``, ``yaml:unsafe_load``, ``torch:load``, ``numpy:load``,
``torch.utils.cpp_extension:load_inline``), so no list of bad names can be complete. The rule is
the other way round: a config may name

* **your own code**: modules found outside the installed packages and the standard library
  (the config's folder, the working directory, your ``PYTHONPATH``, a package installed in
  editable mode from your own checkout), and
* **the installed packages it trusts by name**: ``trust: [timm, transformers]`` in the config,
  or ``--trust timm`` on the command line. An entry trusts a package and its submodules
  (``torchvision.models`` trusts ``torchvision.models.resnet``, not ``torchvision.io``).

Anything else is refused before its module is imported, and a callable is judged by its home
(the module that defines it), so ``mymod:sympify`` after ``from sympy import sympify`` in
``mymod`` is sympy's. The standard library is never trusted.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import site
import sys
import sysconfig
import types
from collections.abc import Iterable, Sequence
from typing import Any

from hydro.errors import ConfigError

_HOW = ("A config runs code like a Python script: trust only packages whose functions you would "
        "run on this config's arguments.")


def check_trust(entries: Any, where: str = "trust") -> tuple[str, ...]:
    """The trusted packages: a list of dotted package names (a single name is one entry).

    >>> check_trust(["timm", "torchvision.models"])
    ('timm', 'torchvision.models')
    """
    if entries is None:
        return ()
    if isinstance(entries, str):
        entries = [entries]
    if not isinstance(entries, (list, tuple)):
        raise ConfigError(f"{where} must be a list of package names (e.g. [timm, transformers]), "
                          f"got {entries!r}")
    for entry in entries:
        if not isinstance(entry, str) or not all(p.isidentifier() for p in entry.split(".")):
            raise ConfigError(f"{where}: {entry!r} is not a package name (e.g. timm, "
                              "torchvision.models)")
        if _is_stdlib(entry):
            raise ConfigError(f"{where}: {entry!r} is a module of the standard library, which a "
                              "config never names")
    return tuple(entries)


def check_callable_name(spec: Any, where: str) -> tuple[str, str]:
    """Split ``module:attribute``; refuse a malformed name, the standard library, a private name.

    A model, data set or loss never comes from the standard library, and a shared config that
    names ``os:system`` or ``builtins:eval`` is an attack, not a typo.
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ConfigError(f"{where} must look like 'package.module:callable', got {spec!r}")
    module_name, attr = spec.split(":", 1)
    if (
        not module_name
        or not attr
        or not all(part.isidentifier() for part in [*module_name.split("."), *attr.split(".")])
    ):
        raise ConfigError(f"{where} must look like 'package.module:callable', got {spec!r}")
    if _is_stdlib(module_name):
        raise ConfigError(f"{where}: {spec!r} names the standard library module "
                          f"{module_name.split('.')[0]!r}; a config names your own code or a "
                          "package it trusts (e.g. mypkg.model:build)")
    if any(part.startswith("_") for part in attr.split(".")):
        raise ConfigError(f"{where}: {spec!r} names a private attribute; name a public callable")
    return module_name, attr


def resolve_callable(
    spec: Any, where: str, folders: Sequence[str] = (), trust: Iterable[str] = ()
) -> Any:
    """Import ``package.module:attribute`` and return it if the config may name it.

    Checked in this order, each before anything it would run: the name
    (:func:`check_callable_name`); where the module lives, found without importing it (your own
    code, or a package in ``trust``); every attribute on the way (a module reached through an
    attribute, as in ``torch:os.system``, goes around the first two checks; a property would run
    its getter); and the object found: callable, not a module, and defined in your own code or a
    trusted package. ``folders`` go on ``sys.path`` first (the config's and the working folder).
    """
    module_name, attr = check_callable_name(spec, where)
    trust = tuple(trust)
    for folder in folders:
        if folder not in sys.path:
            sys.path.insert(0, folder)
    _check_location(module_name, spec, where, trust)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{where}: cannot import module {module_name!r} ({exc}). Run from the directory "
            "that contains it, or install it."
        ) from exc
    parts = attr.split(".")
    for i, part in enumerate(parts):
        if not isinstance(obj, (types.ModuleType, type)) and isinstance(
            inspect.getattr_static(obj, part, None), (property, functools.cached_property)
        ):  # reading it would run its getter: code called before any check of what it returns
            raise ConfigError(f"{where}: {spec!r} reads the property {part!r} of an object; "
                              "name a function or class")
        if not hasattr(obj, part):
            raise ConfigError(f"{where}: module {module_name!r} has no attribute {part!r}")
        obj = getattr(obj, part)
        if isinstance(obj, types.ModuleType):
            name = obj.__name__
            if _is_stdlib(name):
                raise ConfigError(f"{where}: {spec!r} reaches the standard library module "
                                  f"{name.split('.')[0]!r} through the attribute {part!r}; a "
                                  "config names your own code or a package it "
                                  "trusts")
            rest = ".".join(parts[i + 1 :])
            hint = f"name it {name}:{rest}" if rest else f"name a callable in it, {name}:NAME"
            raise ConfigError(f"{where}: {spec!r} reaches the module {name!r} through an "
                              f"attribute; a module goes before the colon: {hint}")
    home = _home(obj)
    if home is not None and _is_stdlib(home):
        raise ConfigError(f"{where}: {spec!r} is a callable of the standard library module "
                          f"{home.split('.')[0]!r}; a config names your own code or a package "
                          "it trusts")
    if home is not None and home != module_name:
        _check_location(home, spec, where, trust, reexport=True)
    if not callable(obj):
        raise ConfigError(f"{where}: {spec} is not callable")
    return obj


def trusted(module_name: str, trust: Iterable[str]) -> bool:
    """Whether ``module_name`` is one of the ``trust`` entries or inside one."""
    return any(module_name == t or module_name.startswith(t + ".") for t in trust)


def is_own_code(module_name: str) -> bool:
    """Whether the top-level package of ``module_name`` is found outside the installed packages
    and the standard library (found on the current ``sys.path``, not imported)."""
    top = module_name.split(".")[0]
    if _is_stdlib(top):
        return False
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return True  # not found anywhere: the import that follows says so
    places = [spec.origin] if spec.origin and os.path.isabs(spec.origin) else []
    places += list(spec.submodule_search_locations or [])
    if not places:  # built in, frozen: part of the interpreter
        return False
    roots = _installed_roots()
    return not any(_under(os.path.realpath(p), roots) for p in places)


def _check_location(
    module_name: str, spec: str, where: str, trust: tuple[str, ...], reexport: bool = False
) -> None:
    if trusted(module_name, trust) or is_own_code(module_name):
        return
    top = module_name.split(".")[0]
    what = (f"is a callable of the installed package {top!r} (defined in {module_name})"
            if reexport else f"names the installed package {top!r}")
    raise ConfigError(f"{where}: {spec!r} {what}, which this config does not trust: add "
                      f"'trust: [{top}]' to the config or pass --trust {top}. {_HOW}")


@functools.cache
def _installed_roots() -> tuple[str, ...]:
    """Folders that hold installed packages or the standard library."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(getattr(site, "getsitepackages", lambda: [])())
    roots.add(site.getusersitepackages())
    roots.update(p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages"))
    return tuple(sorted({os.path.realpath(r) for r in roots if r}))


def _under(path: str, roots: Sequence[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _is_stdlib(module_name: str) -> bool:
    top = module_name.split(".")[0]
    return top in sys.stdlib_module_names or top in sys.builtin_module_names


def _home(obj: Any) -> str | None:
    """The module a callable comes from: a partial's function's, a bound method's function's,
    a C method's class's (``dict.get``) or its object's (``{}.get``, ``os.system``)."""
    while isinstance(obj, functools.partial):
        obj = obj.func
    if inspect.ismethod(obj):
        obj = obj.__func__
    home = getattr(obj, "__module__", None)
    if isinstance(home, str):
        return home
    owner = getattr(obj, "__objclass__", None) or getattr(obj, "__self__", None)
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    if owner is not None:
        home = getattr(owner if isinstance(owner, type) else type(owner), "__module__", None)
    return home if isinstance(home, str) else None
