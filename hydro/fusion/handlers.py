"""The fused forms of single ops: one handler per op kind, looked up in :data:`HANDLERS`.

A handler ``(rw, node, found, kinds) -> bool`` is given one node of one trial's captured graph
while :mod:`hydro.fusion.rewrite` walks it (``rw`` is the walk's state: ``env``, ``spec``,
``folded``, ``as_trial``...), ``found`` the node's operand nodes and ``kinds`` their layouts. It
either emits the node's fused form (a function of :mod:`hydro.fusion.ops` over the trials'
stacked parameters and folded values), records its new value and layout in ``rw`` and returns
``True``, or returns ``False`` and the rewrite's general rules apply (run unchanged on the folded
batch, broadcast over the trials, or the vmap fallback). Linear layers, embeddings, norms,
convolutions, dropout and other random ops (each trial's own stream), and attention live here.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx

from hydro.fusion import factories, ops, recurrent
from hydro.fusion import random as rng

if TYPE_CHECKING:
    from hydro.fusion.rewrite import _Rewriter

Node = torch.fx.Node
aten = torch.ops.aten


def arg(node: Node, pos: int, name: str, default: object = None) -> object:
    """Argument ``pos`` (keyword ``name``) of ``node``, ``default`` where it is left out."""
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def _linear(rw: _Rewriter, node: Node, found: list[Node], kinds: set) -> bool:
    t = node.target
    if t is aten.linear.default:
        x, w, b = node.args[0], node.args[1], arg(node, 2, "bias")
        transposed = True
    elif t is aten.addmm.default:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return False
        b, x, w = node.args[:3]
        transposed = False
    elif t in (aten.mm.default, aten.matmul.default):
        x, w, b = node.args[0], node.args[1], None
        transposed = False
    else:
        return False
    ws, bs = rw.spec.get(w), None if b is None else rw.spec.get(b)
    if w.meta["val"].dim() != 2 or ("T",) not in (ws, bs):
        return False  # no per-trial operand (a frozen shared layer): runs as it is
    if ws not in (("T",), ("S",)) or bs not in (None, ("T",), ("S",)):
        return False
    xs = rw.spec.get(x)
    if not isinstance(xs, tuple) or xs[0] not in ("F", "SB", "S", "T"):
        return False
    out = rw.out_spec(node)
    out = ("T",) if out == "?" else out
    bias = rw.as_trial(b)
    rw.env[node] = rw.fn(ops.trial_linear, rw.env[x], rw.as_trial(w), bias, rw.n, xs, out,
                         transposed)
    rw.spec[node] = out
    return True


def _embedding(rw: _Rewriter, node: Node, found: list[Node], kinds: set) -> bool:
    w, ids = node.args[0], node.args[1]
    if rw.spec.get(w) != ("T",):
        return False
    if arg(node, 3, "scale_grad_by_freq", False) or arg(node, 4, "sparse", False):
        raise rw.error(node, "embeddings with scale_grad_by_freq or sparse have no fused form")
    pad = arg(node, 2, "padding_idx", -1)
    out = rw.out_spec(node)
    out = ("T",) if out == "?" else out
    rw.env[node] = rw.fn(ops.trial_embedding, rw.env[w], rw.env[ids], pad, rw.n,
                         rw.spec.get(ids), out)
    rw.spec[node] = out
    return True


def _norm(rw: _Rewriter, node: Node, found: list[Node], kinds: set) -> bool:
    if "T" not in kinds:
        return False
    layer = node.target is aten.layer_norm.default
    x, shape = node.args[0], node.args[1]
    w = arg(node, 2, "weight")
    b = arg(node, 3, "bias") if layer else None
    eps = arg(node, 4 if layer else 3, "eps", 1e-5 if layer else None)
    if rw.spec.get(x) == ("T",) and x in found and rw.spec[x][0] == "T":
        pass
    out = rw.out_spec(node)
    out = ("T",) if out == "?" else out
    rank = node.meta["val"].dim()
    rw.env[node] = rw.fn(
        ops.trial_norm, "layer" if layer else "rms", rw.env[x], shape,
        None if w is None else rw.env[w], None if b is None else rw.env[b], eps, rw.n,
        rw.spec.get(x), None if w is None else rw.spec[w], None if b is None else rw.spec[b],
        out, rank,
    )
    rw.spec[node] = out
    return True


def _batched_input(rw: _Rewriter, node: Node, x: Node, what: str) -> tuple:
    s = rw.spec.get(x)
    if not (isinstance(s, tuple) and s[0] in ("F", "SB") and s[1] == 0 and s[2] == 1):
        raise rw.error(node, f"{what} needs the batch as the leading dimension of its input")
    return s


def _group_norm(rw: _Rewriter, node: Node, found: list[Node], kinds: set) -> bool:
    if "T" not in kinds:
        return False
    x, groups = node.args[0], node.args[1]
    w, b = arg(node, 2, "weight"), arg(node, 3, "bias")
    eps = arg(node, 4, "eps", 1e-5)
    _batched_input(rw, node, x, "group_norm")
    new = rw.fn(ops.trial_group_norm, rw.stacked_value(x, 1), groups, rw.as_trial(w),
                rw.as_trial(b), eps, rw.n)
    rw.set_stacked(node, new, 1)
    return True


def _batch_norm(rw: _Rewriter, node: Node, found: list[Node], kinds: set) -> bool:
    x, w, b, rm, rv, training, momentum, eps = node.args[:8]
    s = _batched_input(rw, node, x, "batch_norm")
    shared = all(a is None or rw.spec.get(a) == ("S",) for a in (w, b, rm, rv))
    # Frozen and equal in every trial, nothing written (evaluation mode, or no running
    # statistics): on the shared input it runs once; in evaluation mode it is per sample
    if shared and s[0] == "SB" and (not training or rm is None):
        return False
    if shared and not training:
        return False
    args = [rw.as_trial(a) for a in (w, b, rm, rv)]
    new = rw.fn(ops.trial_batch_norm, rw.stacked_value(x, 1), *args, training, momentum, eps)
    rw.set_stacked(node, new, 1)
    return True


def _conv(rw: _Rewriter, node: Node, found: list[Node], kinds: set) -> bool:
    w = node.args[1]
    if "T" not in kinds:  # a frozen shared convolution: runs as it is
        return False
    x = node.args[0]
    s = _batched_input(rw, node, x, "a convolution")
    dims = {
        aten.conv1d.default: 1,
        aten.conv2d.default: 2,
        aten.conv3d.default: 3,
        aten.conv1d.padding: 1,
        aten.conv2d.padding: 2,
        aten.conv3d.padding: 3,
    }[node.target]
    b = arg(node, 2, "bias")
    k = dims
    stride = arg(node, 3, "stride", [1] * k)
    padding = arg(node, 4, "padding", [0] * k)
    dilation = arg(node, 5, "dilation", [1] * k)
    groups = arg(node, 6, "groups", 1)
    shared = s[0] == "SB" and groups == 1 and not isinstance(padding, str)
    # all trials' filters over the shared input in one convolution, else a grouped one over the
    # channel-stacked input; the result stays channel-stacked for the layers that follow
    xin = rw.env[x] if shared else rw.stacked_value(x, 1)
    new = rw.fn(ops.trial_conv, dims, xin, rw.as_trial(w), rw.as_trial(b), stride, padding,
                dilation, groups, rw.n, shared)
    rw.set_stacked(node, new, 1)
    return True


def _conv_transpose(rw: _Rewriter, node: Node, found: list[Node], kinds: set) -> bool:
    if "T" not in kinds:
        return False
    x, w = node.args[0], node.args[1]
    _batched_input(rw, node, x, "a transposed convolution")
    k = w.meta["val"].dim() - 2
    args = [arg(node, i, name, default) for i, name, default in (
        (2, "bias", None), (3, "stride", [1] * k), (4, "padding", [0] * k),
        (5, "output_padding", [0] * k), (6, "groups", 1), (7, "dilation", [1] * k),
    )]
    args[0] = rw.as_trial(args[0])
    new = rw.fn(ops.trial_conv_transpose, k, rw.stacked_value(x, 1), rw.as_trial(w), *args, rw.n)
    rw.set_stacked(node, new, 1)
    return True


def draws(node: Node) -> bool:
    """A node that may draw random numbers: its rank among these is its stream's salt, the same
    in every graph of the architecture (whatever the rates, train or eval)."""
    return node.op == "call_function" and (
        node.target in (aten.dropout.default, aten.scaled_dot_product_attention.default)
        or node.target in SAMPLERS
        # a stack of recurrent layers: its dropout between layers (rate 0 or not)
        or (node.target in RECURRENT and len(node.args) > 4 and node.args[4] > 1)
    )


SAMPLERS = {  # op: (kind, position of a scalar probability or None)
    aten.rand_like.default: ("rand", None), aten.randn_like.default: ("randn", None),
    aten.bernoulli.default: ("bernoulli", None), aten.bernoulli.p: ("bernoulli", 1),
    aten.bernoulli_.float: ("bernoulli", 1),
}


def _sample(rw: _Rewriter, node: Node, found: list[Node], kinds: set) -> bool:
    """Random numbers shaped like a value (``bernoulli_`` on a fresh ``new_empty``: timm's
    drop-path): each trial's from its own stream, as a new value (in place on a fresh tensor
    is the same to its readers)."""
    kind, pos = SAMPLERS[node.target]
    x = node.args[0]
    s = rw.spec.get(x)
    if not isinstance(s, tuple) or any(k in node.kwargs for k in ("generator", "memory_format")):
        return False
    if s[0] == "S":  # each trial its own numbers
        new, s = rw.as_trial(x), ("T",)
    else:
        new, s = rw.folded(x), ("F", s[1], s[2]) if s[0] == "SB" else s
    p = None
    if pos is not None:
        p = rw.literal(node, pos)
        p = arg(node, pos, "p", 0.5) if p is None else p
    dtype = node.kwargs.get("dtype")
    rw.env[node] = rw.fn(ops.trial_random, kind, new, rw.n, s, _stream(rw, node), p, dtype)
    rw.spec[node] = s
    return True


def _stream(rw: _Rewriter, node: Node) -> Node:
    """``node``'s per-trial keys ``[2, n]`` (:mod:`hydro.fusion.random`): every random node's
    keys come from one computation per forward, over the trials' seed and step buffers."""
    if not hasattr(rw, "hydro_keys"):
        if rng.SEED not in rw.tensors or rng.STEP not in rw.tensors:
            raise rw.error(node, "a random op needs the fused model's per-trial seed and step "
                           "buffers; build the graph through hydro.fuse")
        salts = {m: j for j, m in enumerate(m for m in rw.template.graph.nodes if draws(m))}
        bufs = []
        for name in (rng.SEED, rng.STEP):
            rw.owners[name] = rw.tensors[name]
            bufs.append(rw.graph.get_attr(name))
        rw.hydro_keys = (rw.fn(rng.stream_keys, *bufs, len(salts)), salts)
    keys, salts = rw.hydro_keys
    return rw.fn(operator.getitem, keys, salts[node])


def _dropout(rw: _Rewriter, node: Node, found: list[Node], kinds: set) -> bool:
    p = rw.literal(node, 1)
    x, train = node.args[0], arg(node, 2, "train", True)
    if p is None:  # one rate for all: nothing drawn at 0 or in eval mode (aten's identity)
        p = arg(node, 1, "p", 0.5)
        if not train or p == 0:
            return False
    s = rw.spec.get(x)
    if not isinstance(s, tuple):
        return False
    if s[0] == "S":  # a value without the batch: each trial drops its own copy
        new, s = rw.as_trial(x), ("T",)
    else:
        new, s = rw.folded(x), ("F", s[1], s[2]) if s[0] == "SB" else s
    keys = _stream(rw, node) if train else None
    rw.env[node] = rw.fn(ops.trial_dropout, new, p, train, rw.n, s, keys)
    rw.spec[node] = s
    return True


def _attention(rw: _Rewriter, node: Node, found: list[Node], kinds: set) -> bool:
    q, k, v = node.args[:3]
    mask = arg(node, 3, "attn_mask")
    # a per-trial mask (an additive bias from each trial's learned table) over batched q, k, v
    per_trial = isinstance(mask, Node) and rw.spec.get(mask) == ("T",)
    batched = all(_batched(rw.spec.get(a)) for a in (q, k, v)) and q.meta["val"].dim() >= 3
    if "T" in kinds and not (per_trial and batched):
        return False  # per-trial q, k or v (a learned query): torch.func.vmap
    p = rw.literal(node, 4)
    causal, scale = arg(node, 5, "is_causal", False), arg(node, 6, "scale")
    gqa = arg(node, 7, "enable_gqa", False)
    s = rw.out_spec(node)
    if p is None:
        p = arg(node, 4, "dropout_p", 0.0)
        if p == 0 and not per_trial:  # nothing drawn: aten's own kernel on folded values
            return False
        if p == 0:  # nothing drawn: torch's kernel, the trials folded into the heads
            specs = [_as_folded(rw.spec[a]) for a in (q, k, v)]
            rw.env[node] = rw.fn(
                ops.trial_masked_attention, rw.folded(q), rw.folded(k), rw.folded(v),
                rw.env[mask], causal, scale, gqa, rw.n, specs, s,
            )
            rw.spec[node] = s
            return True
    rw.env[node] = rw.fn(
        ops.trial_attention, rw.folded(q), rw.folded(k), rw.folded(v),
        None if mask is None else rw.folded(mask), p, causal, scale, gqa, rw.n, s,
        _stream(rw, node), ("T",) if per_trial else None,
    )
    rw.spec[node] = s
    return True


def _recurrent(rw: _Rewriter, node: Node, found: list[Node], kinds: set) -> bool:
    """``nn.LSTM``/``nn.GRU``/``nn.RNN``: every trial's stack in one loop over time
    (:func:`hydro.fusion.recurrent.trial_rnn`)."""
    x, hx, params, has_biases, layers, dropout, train, bidir, batch_first = node.args[:9]
    # dropout between the layers, in training: each trial's rate (a per-trial literal when the
    # trials' rates differ) and its own stream, as aten.dropout's handler draws
    rate = rw.literal(node, 5)
    drop = None
    if train and layers > 1 and (rate is not None or dropout):
        drop = (dropout if rate is None else rate, _stream(rw, node))
    hx = list(hx) if isinstance(hx, (list, tuple)) else [hx]
    out = [("T",) if s in ("?", None) else s for s in rw.out_spec(node)]
    kind = node.target.overloadpacket.__name__
    rw.env[node] = rw.fn(
        recurrent.trial_rnn, kind, rw.env[x], [rw.env[h] for h in hx],
        [rw.env[p] for p in params], has_biases, layers, bidir, batch_first, rw.n,
        rw.spec.get(x), [rw.spec.get(h) for h in hx], [rw.spec.get(p) for p in params], out,
        drop,
    )
    rw.spec[node] = out
    return True


def _recurrent_cell(rw: _Rewriter, node: Node, found: list[Node], kinds: set) -> bool:
    """``nn.LSTMCell``/``nn.GRUCell``/``nn.RNNCell``: one step for every trial at once."""
    x, hx, w_ih, w_hh = node.args[:4]
    biases = [arg(node, 4, "b_ih"), arg(node, 5, "b_hh")]
    hx = list(hx) if isinstance(hx, (list, tuple)) else [hx]
    out = rw.out_spec(node)
    out = [("T",) if s in ("?", None) else s for s in (out if isinstance(out, list) else [out])]
    weights = [w_ih, w_hh, *biases]
    kind = node.target.overloadpacket.__name__.removesuffix("_cell")
    new = rw.fn(
        recurrent.trial_cell, kind, rw.env[x], [rw.env[h] for h in hx],
        [None if w is None else rw.env[w] for w in weights], rw.n, rw.spec.get(x),
        [rw.spec.get(h) for h in hx], [rw.spec.get(w) for w in weights], out,
    )
    if kind == "lstm":
        rw.env[node], rw.spec[node] = new, out
    else:  # a single tensor
        rw.env[node], rw.spec[node] = rw.fn(operator.getitem, new, 0), out[0]
    return True


def _batched(spec: object) -> bool:
    return isinstance(spec, tuple) and spec[0] in ("F", "SB")


def _as_folded(spec: tuple) -> tuple:
    return ("F", spec[1], spec[2])


RECURRENT = (aten.lstm.input, aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input)

HANDLERS = {
    aten.linear.default: _linear,
    aten.addmm.default: _linear,
    aten.mm.default: _linear,
    aten.matmul.default: _linear,
    aten.embedding.default: _embedding,
    aten.layer_norm.default: _norm,
    aten.rms_norm.default: _norm,
    aten.group_norm.default: _group_norm,
    aten.batch_norm.default: _batch_norm,
    aten.conv1d.default: _conv,
    aten.conv2d.default: _conv,
    aten.conv3d.default: _conv,
    aten.conv1d.padding: _conv,
    aten.conv2d.padding: _conv,
    aten.conv3d.padding: _conv,
    aten.conv_transpose1d.default: _conv_transpose,
    aten.conv_transpose2d.input: _conv_transpose,
    aten.conv_transpose3d.input: _conv_transpose,
    aten.dropout.default: _dropout,
    **dict.fromkeys(SAMPLERS, _sample),
    aten.scaled_dot_product_attention.default: _attention,
    aten.lstm.input: _recurrent,
    aten.gru.input: _recurrent,
    aten.rnn_tanh.input: _recurrent,
    aten.rnn_relu.input: _recurrent,
    aten.lstm_cell.default: _recurrent_cell,
    aten.gru_cell.default: _recurrent_cell,
    aten.rnn_tanh_cell.default: _recurrent_cell,
    aten.rnn_relu_cell.default: _recurrent_cell,
    **factories.HANDLERS,
}
