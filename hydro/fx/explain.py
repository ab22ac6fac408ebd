"""Why capturing a model failed, in the user's terms: the module, file and line of their code
that failed, and what to do (data-dependent control flow, a random branch such as layerdrop, a
packed sequence into a recurrent layer, or a model that does not run on its example inputs)."""

from __future__ import annotations

import linecache
import os
import re
from typing import Any

import torch
from torch import nn

from hydro.fx import host_random

_TORCH_DIR = os.path.dirname(torch.__file__)
_HYDRO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DATA_DEPENDENT = ("data-dependent", "GuardOnDataDependentSymNode", "DataDependent",
                   "could not guard on data-dependent", "Could not extract specialized integer",
                   "unbacked")


def explain(exc: BaseException, model: nn.Module) -> str:
    """Why capturing ``model`` failed: the module, file and line of the user's code, and what to
    do about it."""
    frame = None
    tb = exc.__traceback__
    while tb is not None:  # the innermost frame outside torch and hydro is the user's code
        f = tb.tb_frame
        path = os.path.abspath(f.f_code.co_filename)
        user = not f.f_code.co_filename.startswith("<")  # generated code has no line to show
        if user and not path.startswith(_TORCH_DIR) and not path.startswith(_HYDRO_DIR):
            frame = (f, tb.tb_lineno)
        tb = tb.tb_next
    where = ""
    if frame is not None:
        f, line = frame
        owner = f.f_locals.get("self")
        if isinstance(owner, nn.Module):
            names = {id(m): n for n, m in model.named_modules()}
            path = names.get(id(owner))
            label = f"'{path}' ({type(owner).__name__})" if path else type(owner).__name__
            where = f" in module {label}"
        code = linecache.getline(f.f_code.co_filename, line).strip()
        where += f" at {f.f_code.co_filename}:{line}" + (f" (`{code}`)" if code else "")
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    data_dependent = any(k in str(exc) or k in type(exc).__name__ for k in _DATA_DEPENDENT)
    if _packed(exc):
        advice = (
            "a recurrent layer (nn.LSTM/GRU/RNN) is called on a PackedSequence "
            "(pack_padded_sequence or pack_sequence): its per-step batch sizes are data, "
            "computed from the lengths, which capture by example cannot record, and Hydro's "
            "fused recurrent form has no packed variant. Call the layer on the padded tensor "
            "instead and leave the padded steps out of the loss (their targets set to the "
            "loss's ignore_index, or a mask); a last hidden state is then the output at each "
            "sequence's length (`out[torch.arange(B), lengths - 1]`, one direction)"
        )
    elif data_dependent and frame is not None and _random_branch(*frame):
        f, line = frame
        what = host_random.probability_to_zero(f.f_code.co_filename, line, f.f_code.co_firstlineno)
        advice = (
            "a random branch taken only in training (layerdrop: a layer skipped when a draw "
            "falls below a probability) cannot be captured, since capture records one run; "
            f"{what} for tuning"
        )
    elif data_dependent:
        advice = (
            "the code reads a value computed from the input data as a Python number or "
            "branches on it (`.item()`, `float(t)`, `if t.sum() > 0`: data-dependent control "
            "flow). Capture by example records one run, so such a decision would be frozen. "
            "Compute it with tensor ops instead (torch.where, masks, clamp), or move it out of "
            "forward"
        )
    else:
        advice = (
            "the model could not run on the example inputs under torch.export; check that "
            "it runs on them as given (shapes, dtypes, keyword names), and that forward uses "
            "only tensor operations on its inputs"
        )
    return f"cannot capture {type(model).__name__}{where}: {advice}. ({text})"


def _packed(exc: BaseException) -> bool:
    """Whether the failure happened while a ``PackedSequence`` was being run or built (a frame
    of the traceback holds one, or the user's line packs one)."""
    from torch.nn.utils.rnn import PackedSequence

    tb = exc.__traceback__
    while tb is not None:
        f = tb.tb_frame
        if any(isinstance(v, PackedSequence) for v in f.f_locals.values()):
            return True
        if re.search(
            r"\bpack_(padded_)?sequence\(", linecache.getline(f.f_code.co_filename, tb.tb_lineno)
        ):
            return True
        tb = tb.tb_next
    return False


def _random_branch(frame: Any, line: int) -> bool:
    """Whether the function at ``frame`` draws a random number before ``line`` (the branch it
    failed on then decides on a draw, as layerdrop does)."""
    first = frame.f_code.co_firstlineno
    lines = (linecache.getline(frame.f_code.co_filename, n) for n in range(first, line + 1))
    return any(re.search(r"\brand\w*\(|\brandom\.", text) for text in lines)


__all__ = ["explain"]
