"""Recurrent layers: ``aten.lstm``/``gru``/``rnn_tanh``/``rnn_relu`` (``nn.LSTM``, ``nn.GRU``,
``nn.RNN``) and their cells (``nn.LSTMCell``, ``nn.GRUCell``, ``nn.RNNCell``).

A layer of hidden size ``H`` has ``G`` gate blocks (4 for an LSTM, 3 for a GRU, 1 for a plain RNN):
``weight_ih [G*H, in]``, ``weight_hh [G*H, H_out]``, biases ``[G*H]`` and, with ``proj_size``,
``weight_hr [H_out, H]`` (else ``H_out = H``). ``G*H`` is a product with a constant, so the gates
keep their ``G`` blocks and each block shrinks with ``H``. Layers after the first read the
previous layer's output, ``H_out`` (``2 * H_out`` bidirectional). The input size, ``H`` and
``H_out`` are widths unless the graph fixes them (an input's features, a pinned output).

muP roles follow from the shapes, as for linear layers: ``weight_ih`` of the first layer over
fixed input features is an input weight (fan-in fixed, fan-out ``G*H``); ``weight_hh``,
``weight_ih`` of later layers and ``weight_hr`` are hidden weights (both dimensions width: their
init std scales as ``fan_in ** -1/2`` and their Adam learning rate as ``1/m``, as a hidden
``nn.Linear``'s: the recurrence is a matrix product over the hidden width, applied once a step);
biases are vectors.
"""

from __future__ import annotations

from typing import Any

from hydro.errors import ScaleError
from hydro.fx.rules.common import TensorSyms, bound, op_name

GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


def _times(a: Any, node: Any, whole: int, part: int, k: int) -> None:
    """``whole == k * part`` (gate blocks, a bidirectional concatenation)."""
    if k == 1:
        a.union(whole, part, node)
    else:
        a.derived_syms.add(whole)
        a.product(node, [whole], [part], 1, k)


def layout(n_params: int, layers: int, dirs: int, has_biases: bool) -> tuple[int, bool]:
    """``(tensors per layer and direction, has a projection)`` from the length of ``params``."""
    base = 4 if has_biases else 2
    for per, proj in ((base, False), (base + 1, True)):
        if n_params == layers * dirs * per:
            return per, proj
    raise ValueError(f"{n_params} weights for {layers} layers x {dirs} directions")


def _layer(a, node, gates, syms, hidden, out, x_in, has_biases, proj) -> list:
    """Relate one layer-direction's weights (``syms``: their symbols in ``params`` order);
    ``(index, fan-in dims, fan-out dims)`` of each weight matrix, for its muP role."""
    w_ih, w_hh = syms[0], syms[1]
    _times(a, node, w_ih[0], hidden, gates)
    a.union(w_hh[0], w_ih[0], node)
    a.union(w_hh[1], out, node)
    if x_in is not None:
        a.union(w_ih[1], x_in, node)
    if has_biases:
        a.union(syms[2][0], w_ih[0], node)
        a.union(syms[3][0], w_ih[0], node)
    if proj:
        w_hr = syms[-1]
        a.union(w_hr[1], hidden, node)
        a.union(w_hr[0], out, node)
    roles = [(0, (1,), (0,)), (1, (1,), (0,))] + ([(len(syms) - 1, (1,), (0,))] if proj else [])
    return roles


def sequence(a, node, out) -> None:
    """``lstm.input``/``gru.input``/``rnn_*.input``: a stack of recurrent layers over a sequence."""
    b = bound(node)
    if "input" not in b:
        raise ScaleError(f"node '{node.name}' ({node.target}): a packed sequence "
                         "(nn.utils.rnn.pack_padded_sequence) has no width rule; pad the "
                         "batch and pass the padded tensor")
    gates = GATES[op_name(node)]
    x = a.syms_of(b["input"])
    hx = b["hx"] if isinstance(b["hx"], (list, tuple)) else [b["hx"]]
    layers, dirs = b["num_layers"], 2 if b["bidirectional"] else 1
    params = list(b["params"])
    try:
        per, proj = layout(len(params), layers, dirs, b["has_biases"])
    except ValueError as exc:
        raise ScaleError(f"node '{node.name}' ({node.target}): an unexpected list of "
                         f"weights ({exc})") from exc
    syms = [a.syms_of(p) for p in params]
    if not all(isinstance(s, TensorSyms) for s in syms):
        return
    h_out = syms[1][1]  # weight_hh's fan-in: the hidden size, or proj_size
    hidden = syms[per - 1][1] if proj else h_out  # weight_hr [proj, hidden]
    for layer in range(layers):
        for d in range(dirs):
            i = (layer * dirs + d) * per
            group = syms[i : i + per]
            roles = _layer(a, node, gates, group, hidden, h_out, x[-1] if layer == 0 else None,
                           b["has_biases"], proj)
            if layer > 0:  # the layer below's output, both directions side by side
                _times(a, node, group[0][1], h_out, dirs)
            for k, fan_in, fan_out in roles:
                a.use_param(params[i + k], node, fan_in, fan_out, act=None)
    y = out[0]
    _times(a, node, y[-1], h_out, dirs)
    a.tie_all(y[:-1], x[:-1], node)
    # h_n (and c_n): [layers * dirs, batch, H_out] (c_n: H), as the initial states given
    batch = None if len(x) == 2 else x[0] if b["batch_first"] else x[1]  # (unbatched: none)
    for k, state in enumerate(out[1:]):
        a.union(state[-1], h_out if k == 0 else hidden, node)
        if batch is not None:
            a.union(state[-2], batch, node)
        h0 = a.syms_of(hx[k]) if k < len(hx) else None
        if isinstance(h0, TensorSyms):
            a.tie_all(state, h0, node)


def cell(a, node, out) -> None:
    """``lstm_cell``/``gru_cell``/``rnn_*_cell``: one step of one layer."""
    b = bound(node)
    name = op_name(node).removesuffix("_cell")
    gates = GATES[name]
    x = a.syms_of(b["input"])
    hx = b["hx"] if isinstance(b["hx"], (list, tuple)) else [b["hx"]]
    h = [a.syms_of(t) for t in hx]
    w_ih, w_hh = a.syms_of(b["w_ih"]), a.syms_of(b["w_hh"])
    hidden = w_hh[1]
    _times(a, node, w_ih[0], hidden, gates)
    a.union(w_hh[0], w_ih[0], node)
    a.union(w_ih[1], x[-1], node)
    for key in ("b_ih", "b_hh"):
        if b.get(key) is not None:
            a.union(a.syms_of(b[key])[0], w_ih[0], node)
    outs = [out] if isinstance(out, TensorSyms) else list(out)  # (h, c) of an LSTM cell
    for k, o in enumerate(outs):
        a.union(o[-1], hidden, node)
        a.tie_all(o[:-1], x[:-1], node)
        if k < len(h) and isinstance(h[k], TensorSyms):
            a.tie_all(o, h[k], node)
    for w in ("w_ih", "w_hh"):
        a.use_param(b[w], node, (1,), (0,), act=None)


RULES = {**{f: sequence for f in GATES}, **{f"{f}_cell": cell for f in GATES}}
