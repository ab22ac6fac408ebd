"""Tracing a user model into a torch.fx graph, with errors that say where and what to do.

Built-in layers with parameters (Linear, Conv, norms, Embedding, MultiheadAttention) stay leaves
of the graph: later passes know their rules. Everything else, user modules and the Transformer
containers of ``torch.nn`` included, is traced through so that their ``forward`` code becomes
graph nodes whose shapes can be analysed and rewritten.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import traceback
from collections.abc import Iterable, Iterator
from unittest import mock

import torch
import torch.fx
from torch import nn
from torch.nn.modules import transformer as transformer_module

from hydro.errors import TraceError

# torch.nn modules that are plain Python compositions of leaves: tracing through them exposes
# their attention and feed-forward blocks to width analysis.
TRACE_THROUGH: tuple[type[nn.Module], ...] = (
    nn.Sequential,
    nn.ModuleList,
    nn.ModuleDict,
    nn.TransformerEncoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoder,
    nn.TransformerDecoderLayer,
    nn.Transformer,
)

_TORCH_DIR = os.path.dirname(torch.__file__)


class _HydroProxy(torch.fx.Proxy):
    # torch.nn's Transformer code asks `src.is_nested` before anything else; traced inputs are
    # ordinary dense tensors, so answering here keeps that code traceable.
    @property
    def is_nested(self) -> bool:
        return False


class HydroTracer(torch.fx.Tracer):
    """An fx tracer that keeps ``torch.nn`` layers as leaves and remembers which module it is in.

    Args:
        leaf_modules: extra module types to keep as opaque leaves (for code that cannot be traced,
            e.g. a block with data-dependent control flow but no width-carrying parameters).
    """

    def __init__(self, leaf_modules: Iterable[type[nn.Module]] = ()) -> None:
        super().__init__()
        self.record_stack_traces = True
        # buffers read in forward (a causal mask sliced to the sequence length) become graph
        # nodes rather than constants, so they can be sliced by traced sizes and scaled
        self.proxy_buffer_attributes = True
        self.extra_leaves = tuple(leaf_modules)
        self.hydro_scope: list[str] = []
        self.failed_scope: str | None = None

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _HydroProxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self.extra_leaves and isinstance(m, self.extra_leaves):
            return True
        if isinstance(m, TRACE_THROUGH):
            return False
        return m.__module__.startswith("torch.nn") and not isinstance(m, torch.fx.GraphModule)

    def call_module(self, m, forward, args, kwargs):  # noqa: ANN001 - fx signature
        self.hydro_scope.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_scope is None:
                self.failed_scope = self.hydro_scope[-1]
            raise
        finally:
            self.hydro_scope.pop()


def _traced_seq_len(src: torch.Tensor, batch_first: bool) -> torch.Tensor:
    # Traced inputs are batched: (B, S, E) or (S, B, E). The original asks len(src.size()),
    # which a proxy cannot answer; the value only feeds causal-mask detection.
    return src.size(1 if batch_first else 0)


@contextlib.contextmanager
def _traceable_torch_nn() -> Iterator[None]:
    """Make torch.nn's Transformer containers traceable for the duration of a trace.

    They ask tensor questions (``src.dim()``, ``len(src.size())``) to choose an inference fast
    path; with the fast path off they are plain compositions of leaves.
    """
    backends = getattr(torch.backends, "mha", None)
    can_toggle = backends is not None and hasattr(backends, "set_fastpath_enabled")
    was = backends.get_fastpath_enabled() if can_toggle else None
    if can_toggle:
        backends.set_fastpath_enabled(False)
    try:
        with mock.patch.object(transformer_module, "_get_seq_len", _traced_seq_len):
            yield
    finally:
        if can_toggle:
            backends.set_fastpath_enabled(was)


def _user_frame(tb: traceback.StackSummary) -> traceback.FrameSummary | None:
    """The innermost frame of user code (not torch, not hydro) in a traceback."""
    hydro_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for frame in reversed(tb):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH_DIR) or path.startswith(hydro_dir):
            continue
        if frame.filename.startswith("<"):
            continue
        return frame
    return None


def _reason(exc: BaseException) -> tuple[str, str]:
    """A plain-words reason for a tracing failure and what the user can do about it."""
    msg = str(exc)
    if "control flow" in msg:
        return (
            "data-dependent control flow: an `if`/`while` on a tensor value or shape",
            "rewrite the branch with tensor ops (torch.where, masking), move it out of forward, "
            "or pass the module type in `leaf_modules=` if it holds no width-carrying parameters",
        )
    if "iterate" in msg or "iteration" in msg or "__len__" in msg or "len(" in msg:
        return (
            "iterating over (or taking len() of) a traced tensor, whose length is unknown",
            "index with explicit slices or use torch.unbind/split with a fixed count",
        )
    if "Proxy" in msg or "proxy" in msg:
        return (
            "a traced value reached a Python function that needs a concrete number "
            "(.item(), int(), float(), math.*, numpy)",
            "use tensor ops instead (e.g. `x.size(-1) ** -0.5` rather than "
            "`1 / math.sqrt(x.size(-1))`), or mark the module as a leaf with `leaf_modules=`",
        )
    return (
        f"{type(exc).__name__}: {msg}",
        "make forward traceable by torch.fx (see torch.fx 'Limitations of Symbolic Tracing'), "
        "or mark the offending module type as a leaf with `leaf_modules=`",
    )


def trace(
    model: nn.Module,
    *,
    leaf_modules: Iterable[type[nn.Module]] = (),
    concrete_args: dict | None = None,
) -> torch.fx.GraphModule:
    """Trace ``model`` into a ``GraphModule`` that shares its parameters and buffers.

    Args:
        model: the model to trace.
        leaf_modules: extra module types to keep as opaque leaves.
        concrete_args: arguments of ``forward`` to fix while tracing (as in
            ``torch.fx.symbolic_trace``), e.g. ``{"mask": None}``.

    Returns:
        The traced ``GraphModule``.

    Raises:
        TraceError: naming the module path, the source line and the reason, with what to do.
    """
    if not isinstance(model, nn.Module):
        raise TraceError(
            f"expected an nn.Module to trace, got {type(model).__name__}; pass the model instance "
            "(not its class or a factory)"
        )
    if isinstance(model, torch.fx.GraphModule):
        return model
    tracer = HydroTracer(leaf_modules)
    try:
        with _traceable_torch_nn():
            graph = tracer.trace(model, concrete_args=concrete_args)
    except TraceError:
        raise
    except Exception as exc:  # fx raises TraceError, TypeError, RuntimeError, AttributeError...
        where = tracer.failed_scope or ""
        module = where or "<root>"
        frame = _user_frame(traceback.extract_tb(exc.__traceback__))
        reason, todo = _reason(exc)
        location = ""
        if frame is not None:
            line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
            location = f" at {frame.filename}:{frame.lineno} (`{line}`)"
        raise TraceError(
            f"cannot trace module '{module}' ({type(model.get_submodule(where)).__name__})"
            f"{location}: {reason}. To fix: {todo}."
        ) from exc
    name = type(model).__name__
    return torch.fx.GraphModule(tracer.root, graph, name)
