"""A disk cache of exported programs, so that capturing a model again skips ``torch.export``.

``torch.export`` takes seconds per mode (more on a process's first call), and a search captures
the same model many times: every ``hydro tune`` run and resume, and every executor worker. The
program it returns depends only on what this module puts in the key:

* the code the model runs: for each class of the model and of its submodules (outside torch),
  the code of its methods, and the functions, classes and constants of each module (file)
  defining a ``forward``, read from memory (what runs, even if the file changed since);
* the model's state other than tensor values: every submodule's path, class and plain
  attributes (``n_head``, dropout ``p``, a config object, ``training``), the names, shapes,
  dtypes and devices of its parameters and buffers (values are never stored: the loaded
  program is given the live model's tensors);
* the example inputs' structure, shapes and dtypes (and non-tensor values), the dynamic
  dimensions, grad mode and default dtype;
* the torch, Python and Hydro versions and this cache's schema.

(The key is :mod:`hydro.fx.cache_key`'s; this module reads, writes and checks entries.)

A model whose state cannot be read as data (a hook, an object without attributes) is not
cached. An entry is one file, ``<key>.hydro-ep``, written whole (temporary file, then
``os.replace``) by whichever process captured first; two writers of one key each write a
complete file. It holds the exported graph module as JSON (:mod:`hydro.fx.serial`: its nodes,
ops named in ``torch.ops.aten``, their arguments and the shapes Hydro's passes read; rebuilt
without torch's deserializer, no pickle), the constants the graph made (tensors only, read back
with ``weights_only``) and the names and shapes of the model's tensors it reads; an entry that
cannot be read, does not match its key or does not fit the live model is captured again and
overwritten, with one warning.

An entry is bound to what produced it: it carries an HMAC, keyed by a secret this user's Hydro
keeps in the directory (``.hydro-cache-key``, mode 0600), of its key and every byte it holds;
one that does not carry the right one (changed since it was written, written by anyone else, or
by anything but Hydro) is captured again, never trained. The directory itself must belong to
this user and be writable by nobody else (as a checkpoint directory): otherwise the cache is
neither read nor written, with one warning saying what to do.

Beside a program's entries, ``<key>.hydro-wa`` holds a width analysis of them
(:func:`analysis_key`, :func:`load_analysis`, :func:`store_analysis`): the values of the
fake runs ``hydro.scale`` makes of the target's graphs, as JSON, written once a surrogate built
from them passed its shape check, so that a second ``scale`` of the same programs, inputs and
options runs neither the analysis's fake runs nor the check's.

Location: ``$HYDRO_CACHE_DIR``, else ``$XDG_CACHE_HOME/hydro/capture``, else
``~/.cache/hydro/capture``. ``HYDRO_CACHE=0`` (or ``capture(..., cache=False)``) turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import io
import json
import os
import secrets
import stat
import tempfile
import warnings
import zipfile
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hydro.errors import HydroError, HydroWarning
from hydro.fx import serial
from hydro.fx.cache_key import (  # noqa: F401 - key and model_state: the cache's API
    SCHEMA,
    ModelState,
    _hydro_version,
    _Walk,
    key,
    model_state,
)
from hydro_fluid.executors.scratch import check_private

SUFFIX = ".hydro-ep"
ANALYSIS_SUFFIX = ".hydro-wa"  # a width analysis's fake runs (see analysis_key)
ENV_DIR, ENV_SWITCH = "HYDRO_CACHE_DIR", "HYDRO_CACHE"
KEY_FILE = ".hydro-cache-key"  # this user's secret: every entry carries an HMAC made with it
_OFF = ("0", "false", "no", "off")

stats = {"hits": 0, "misses": 0, "writes": 0, "rebuilt": 0,
         "analysis_hits": 0, "analysis_misses": 0, "analysis_writes": 0}
"""Counts in this process: entries loaded, keys not found, entries written, entries rebuilt
(programs and analyses), and the same for width analyses."""

_warned: set[str] = set()


def enabled(cache: bool | None = None) -> bool:
    """Whether to use the cache: ``cache`` if given, else unless ``$HYDRO_CACHE`` is 0/off."""
    if cache is not None:
        return bool(cache)
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in _OFF


def for_task(task: Any) -> bool | None:
    """``capture(..., cache=)`` for a task (:class:`hydro.Task`): ``False`` where its ``cache``
    is off (whatever ``$HYDRO_CACHE`` says), else ``None`` (as ``$HYDRO_CACHE`` says)."""
    return None if getattr(task, "cache", True) else False


def directory() -> str:
    """Where entries live (see the module docstring)."""
    path = os.environ.get(ENV_DIR)
    if not path:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(base, "hydro", "capture")
    return os.path.abspath(os.path.expanduser(path))


def clear() -> int:
    """Remove every entry (``hydro.fx.cache.clear()``); returns how many were removed."""
    folder, n = directory(), 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(folder):
            if name.endswith((SUFFIX, ANALYSIS_SUFFIX)):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, name))
                    n += 1
    return n


# --- the key ----------------------------------------------------------------------------------


def _path(k: str) -> str:
    return os.path.join(directory(), k + SUFFIX)


def is_private() -> bool:
    """Whether the cache directory, if it exists, is this user's alone: whoever else can write
    there could plant a graph that training would run. If not, warned once: not used."""
    folder = directory()
    if not os.path.isdir(folder):
        return True
    try:
        check_private(folder, "capture cache directory", holds="captured graphs",
                      other=f"another {ENV_DIR} (or set {ENV_SWITCH}=0)")
    except PermissionError as exc:
        if folder not in _warned:
            _warned.add(folder)
            warnings.warn(HydroWarning(f"{exc}; capturing without the cache until then"),
                          stacklevel=4)
        return False
    return True


def _secret(create: bool = False) -> bytes | None:
    """This user's secret for the cache directory (made by the first writer if ``create``), or
    ``None``: none yet, or a file this user did not write alone (then replaced if ``create``)."""
    path = os.path.join(directory(), KEY_FILE)
    secret = _read_secret(path)
    if secret is not None or not create:
        return secret
    fd, tmp = tempfile.mkstemp(prefix=f"{KEY_FILE}.", dir=directory())  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        try:
            os.link(tmp, path)  # only where there is none: racing writers agree on the first
        except OSError:
            if _read_secret(path) is None:  # not one of ours, or no hard links here
                os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    return _read_secret(path)


def _read_secret(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        mine = not hasattr(os, "getuid") or st.st_uid == os.getuid()
        if not (mine and stat.S_ISREG(st.st_mode)) or st.st_mode & 0o077:
            return None
        data = f.read(33)
    return data if len(data) == 32 else None


def _mac(secret: bytes, k: str, *parts: bytes) -> str:
    """The HMAC binding an entry's bytes to its key (each part length-prefixed)."""
    h = hmac.new(secret, k.encode(), hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _check_mac(k: str, mac: Any, *parts: bytes) -> None:
    secret = _secret()
    if secret is None or not isinstance(mac, str) \
            or not hmac.compare_digest(mac, _mac(secret, k, *parts)):
        raise ValueError("was not written by this user's Hydro, or changed since")


def _warn(path: str, why: str, again: str = "capturing the model again") -> None:
    if path in _warned:
        return
    _warned.add(path)
    warnings.warn(HydroWarning(
        f"capture cache entry {path} {why}; {again} and rewriting it "
        f"(remove {os.path.dirname(path)} to clear the cache)"
    ), stacklevel=2)


def _live(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


def _meta(t: torch.Tensor) -> list:
    return [list(t.shape), str(t.dtype)]


def load(k: str, model: nn.Module, name: str = "GraphModule") -> torch.fx.GraphModule | None:
    """The graph module stored under key ``k`` (as :func:`store` got it), reading ``model``'s
    live tensors, or ``None`` (not there, or not usable: then warned, and the caller exports and
    stores again)."""
    path = _path(k)
    if not is_private():
        stats["misses"] += 1
        return None
    try:
        archive = zipfile.ZipFile(path)
    except FileNotFoundError:
        stats["misses"] += 1
        return None
    except (OSError, zipfile.BadZipFile) as exc:
        _rebuilt(path, f"cannot be read ({type(exc).__name__})")
        return None
    try:
        with archive:
            parts = [archive.read(n) for n in ("meta.json", "graph.json", "constants.pt")]
            _check_mac(k, archive.read("mac").decode(), *parts)
            meta = json.loads(parts[0])
            if meta.get("key") != k or meta.get("schema") != SCHEMA:
                raise ValueError("was written for another key or cache version")
            if meta.get("torch") != torch.__version__ or meta.get("hydro") != _hydro_version():
                raise ValueError("was written by another torch or Hydro version")
            graph = json.loads(parts[1])
            consts = parts[2]
        live = _live(model)
        attrs: dict[str, torch.Tensor] = {}
        for target, want in meta["tensors"].items():  # the graph reads these from the model
            if target not in live or _meta(live[target]) != want:
                raise ValueError(f"does not fit the model's tensor {target!r}")
            attrs[target] = live[target]
        constants = torch.load(io.BytesIO(consts), weights_only=True) if consts else {}
        if not isinstance(constants, dict) or set(constants) != set(meta["devices"]):
            raise ValueError("holds constants of the wrong kind")
        for target, device in meta["devices"].items():  # stored from the CPU
            if target in attrs or not isinstance(constants[target], torch.Tensor):
                raise ValueError(f"holds a bad constant {target!r}")
            attrs[target] = constants[target].to(device)
        if not isinstance(graph, dict) or sorted(graph.get("attrs", ())) != sorted(attrs):
            raise ValueError("reads other tensors than it lists")
        gm = serial.decode(graph, attrs, name)
    except Exception as exc:  # any failure: never trusted, captured again
        _rebuilt(path, f"is stale or damaged ({type(exc).__name__}: {str(exc)[:80]})")
        return None
    stats["hits"] += 1
    return gm


def _rebuilt(path: str, why: str, again: str = "capturing the model again") -> None:
    stats["rebuilt"] += 1
    _warn(path, why, again)


def store(k: str, gm: torch.fx.GraphModule, model: nn.Module) -> bool:
    """Store ``gm`` (``model``'s exported program as a module, guards stripped) under key
    ``k``; ``False`` when it holds what the entry cannot (an op outside aten, a tensor that is
    not plain data: it is then not stored) or the directory cannot be written."""
    try:
        return _store(k, gm, model)
    except Exception:  # the cache only ever saves time: a capture never fails here
        return False


def _store(k: str, gm: torch.fx.GraphModule, model: nn.Module) -> bool:
    try:
        graph = serial.encode(gm)
    except serial.Unsupported:
        return False
    live = _live(model)
    tensors, own = {}, {}
    for target in graph["attrs"]:
        value = _attr(gm, target)
        if target in live and live[target] is value:  # the model's own: re-attached at load
            tensors[target] = _meta(value)
        elif type(value) is torch.Tensor and not value.is_meta and target not in live:
            own[target] = value.detach().cpu()  # a constant the graph made
        else:
            return False  # a tensor subclass, a copy of the model's: not plain data
    consts = io.BytesIO()
    torch.save(own, consts)
    meta = {"schema": SCHEMA, "key": k, "torch": torch.__version__, "hydro": _hydro_version(),
            "tensors": tensors,
            "devices": {t: str(_attr(gm, t).device) for t in own}}

    def write(tmp: str, secret: bytes) -> None:
        parts = (json.dumps(meta).encode(), json.dumps(graph, separators=(",", ":")).encode(),
                 consts.getvalue())
        with zipfile.ZipFile(tmp, "w") as z:
            for name, part in zip(("meta.json", "graph.json", "constants.pt"), parts):
                z.writestr(name, part)
            z.writestr("mac", _mac(secret, k, *parts))

    if not write_entry(_path(k), write):
        return False
    stats["writes"] += 1
    return True


def write_entry(path: str, write: Any) -> bool:
    """``write(tmp, secret)`` a whole entry, then put it at ``path``; ``False`` (warned once)
    when the directory cannot be written or is not this user's alone."""
    from hydro.files import replacing

    folder = directory()
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        secret = _secret(create=True) if is_private() else None
        if secret is None:
            return False
        with replacing(path) as tmp:
            write(tmp, secret)
    except (OSError, HydroError) as exc:
        if folder not in _warned:
            _warned.add(folder)
            warnings.warn(HydroWarning(
                f"cannot write the capture cache in {folder} ({exc}); set {ENV_DIR} to a "
                f"folder you can write, or {ENV_SWITCH}=0"
            ), stacklevel=4)
        return False
    return True


def _attr(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


# --- width analyses ---------------------------------------------------------------------------
#
# ``hydro.scale`` runs each captured graph of the target on fake tensors (every node's shape and
# dtype, what the width rules read) and, once the surrogate is rebuilt, each of the surrogate's
# graphs again to check its shapes against the plan. Both depend only on the programs, the
# example inputs' shapes, the scaling options and Hydro's own analysis code: an entry keyed by
# those holds the target's fake-run values, and exists only once a surrogate built from them
# passed the shape check, so a hit replays both.

_ANALYSIS_CODE = ("fx", "scaling.py", "parametrize.py")


@functools.cache
def _analysis_code() -> str:
    """A hash of the source of Hydro's width analysis, rebuild and parametrization (what an
    analysis finds and a shape check passes follow them)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = []
    for part in _ANALYSIS_CODE:
        path = os.path.join(root, part)
        if part.endswith(".py"):
            files.append(path)
            continue
        for folder, _, names in os.walk(path):
            files.extend(os.path.join(folder, n) for n in names if n.endswith(".py"))
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(os.path.relpath(f, root).encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def analysis_key(
    cap: nn.Module, args: tuple, kwargs: Mapping[str, Any], options: Mapping[str, Any]
) -> str | None:
    """The key of the width analysis and shape check of captured model ``cap`` (a
    :class:`hydro.fx.capture.Captured` whose graphs came from the cache or were stored in it) on
    inputs shaped like ``(args, kwargs)`` under the scaling ``options`` (ratio, head policy,
    parametrization...); ``None`` when a graph's program has no key (then nothing is cached)."""
    graphs = getattr(cap, "graphs", None)
    if not graphs:
        return None
    programs = sorted((mode, getattr(gm, "hydro_cache_key", None)) for mode, gm in graphs.items())
    if any(k is None for _, k in programs):
        return None
    try:
        walk = _Walk()
        parts = [
            ("analysis", SCHEMA, torch.__version__, _hydro_version(), _analysis_code()),
            ("programs", programs),
            ("inputs", walk.inputs((tuple(args), dict(kwargs)))),
            ("options", walk.value(dict(options))),
        ]
    except Exception:  # an option that cannot be keyed: not cached
        return None
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def _analysis_path(k: str) -> str:
    return os.path.join(directory(), k + ANALYSIS_SUFFIX)


def _graphs_of(cap: nn.Module) -> dict[str, torch.fx.Graph]:
    """Every graph a fake run of ``cap`` walks: each mode's, and its ``with`` regions'."""
    out = {}
    for mode, gm in cap.graphs.items():
        out[mode] = gm.graph
        for name, sub in gm.named_children():
            if isinstance(sub, torch.fx.GraphModule):
                out[f"{mode}/{name}"] = sub.graph
    return out


def _encode_values(values: Mapping[torch.fx.Node, Any], cap: nn.Module) -> dict:
    writer = serial._Writer()
    out, covered = {}, 0
    for where, graph in _graphs_of(cap).items():
        part = {}
        for node in graph.nodes:
            if node.op == "get_attr":  # the model's own tensor (or a subgraph): read at load
                covered += node in values
                continue
            if node not in values:
                raise serial.Unsupported(f"no value for node {node.name}")
            part[node.name] = writer.value(values[node])
            covered += 1
        out[where] = part
    if covered != len(values) or writer.symbols:
        raise serial.Unsupported("values of other graphs, or symbolic sizes")
    return out


def _decode_values(data: Any, cap: nn.Module) -> dict[torch.fx.Node, Any]:
    reader = serial._Reader({"symbols": {}})

    def value(v: Any) -> Any:  # a fake tensor per node, as a fake run makes them
        if isinstance(v, dict) and len(v) == 1 and "T" in v:
            return reader.tensor(v["T"])
        if isinstance(v, dict) and len(v) == 1 and ("l" in v or "t" in v):
            (kind, items), = v.items()
            serial._check(isinstance(items, list), "a bad list")
            out = [value(x) for x in items]
            return out if kind == "l" else tuple(out)
        return reader.value(v)

    graphs = _graphs_of(cap)
    if not isinstance(data, dict) or set(data) != set(graphs):
        raise ValueError("holds other graphs than the model's")
    values: dict[torch.fx.Node, Any] = {}
    for where, graph in graphs.items():
        part, n = data[where], 0
        if not isinstance(part, dict):
            raise ValueError("holds a bad graph")
        for node in graph.nodes:
            if node.op == "get_attr":  # as the fake run reads it: a fake of the model's tensor
                attr = _attr(cap, node.target)
                is_tensor = isinstance(attr, torch.Tensor)
                # static: the reader's mode has a ShapeEnv, which would make every size a symbol
                fake = is_tensor and reader.mode.from_tensor(attr, static_shapes=True)
                values[node] = fake if is_tensor else attr
                continue
            if node.name not in part:
                raise ValueError(f"lacks node {node.name!r}")
            values[node] = value(part[node.name])
            n += 1
        if n != len(part):
            raise ValueError("holds nodes the graphs lack")
    return values


def _same(a: Any, b: Any) -> bool:
    """Two fake-run values alike in everything a width rule may read."""
    if type(a) is not type(b):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_tensor(a, b)
    if isinstance(a, torch.Tensor):
        return _same_tensor(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)  # NaN literals


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    concrete = all(type(d) is int for t in (a, b) for d in (*t.shape, *t.stride()))
    return (concrete and type(a) is type(b) and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset() and a.dtype == b.dtype
            and a.device == b.device and a.requires_grad == b.requires_grad)


def load_analysis(k: str, cap: nn.Module) -> dict[torch.fx.Node, Any] | None:
    """The fake-run values of ``cap``'s graphs stored under analysis key ``k``
    (:func:`analysis_key`), each node's as a fresh fake run gives it, or ``None`` (not there,
    or not usable: then warned, and the caller runs the analysis and stores it again)."""
    path = _analysis_path(k)
    again = "running the width analysis again"
    if not is_private():
        stats["analysis_misses"] += 1
        return None
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        stats["analysis_misses"] += 1
        return None
    except OSError as exc:
        _rebuilt(path, f"cannot be read ({type(exc).__name__})", again)
        return None
    try:
        mac, _, text = text.partition(b"\n")  # the HMAC's line, then the entry's JSON
        _check_mac(k, mac.decode(), text)
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("key") != k or data.get("schema") != SCHEMA:
            raise ValueError("was written for another key or cache version")
        if data.get("torch") != torch.__version__ or data.get("hydro") != _hydro_version():
            raise ValueError("was written by another torch or Hydro version")
        values = _decode_values(data.get("values"), cap)
    except Exception as exc:  # any failure: never trusted, analyzed again
        _rebuilt(path, f"is stale or damaged ({type(exc).__name__}: {str(exc)[:80]})", again)
        return None
    stats["analysis_hits"] += 1
    return values


def store_analysis(k: str, cap: nn.Module, values: Mapping[torch.fx.Node, Any]) -> bool:
    """Store the fake-run values of ``cap``'s graphs under analysis key ``k``; call it only once
    a surrogate built from them passed its shape check (a hit skips that check). ``False`` when
    a value is one the entry cannot hold exactly (then nothing is stored)."""
    try:
        data = _encode_values(values, cap)
        back = _decode_values(json.loads(json.dumps(data)), cap)
        if any(not _same(values[n], back[n]) for n in values):
            return False
    except Exception:  # the cache only ever saves time
        return False
    entry = {"schema": SCHEMA, "key": k, "torch": torch.__version__, "hydro": _hydro_version(),
             "values": data}

    def write(tmp: str, secret: bytes) -> None:
        text = json.dumps(entry, separators=(",", ":")).encode()
        with open(tmp, "wb") as f:
            f.write(_mac(secret, k, text).encode() + b"\n" + text)

    if not write_entry(_analysis_path(k), write):
        return False
    stats["analysis_writes"] += 1
    return True


__all__ = [
    "analysis_key",
    "clear",
    "directory",
    "enabled",
    "key",
    "load",
    "load_analysis",
    "stats",
    "store",
    "store_analysis",
]
