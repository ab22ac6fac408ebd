"""The fused form of recurrent layers: ``n`` trials' ``nn.LSTM``/``nn.GRU``/``nn.RNN`` stacks as
one loop over time of batched matrix products.

PyTorch's ``aten.lstm`` has no batching rule (``torch.func.vmap`` fails on it), and ``n``
separate calls would launch ``n`` times the kernels. Here each layer and direction runs its input
projection for every step at once (one ``matmul`` over the trials' ``[n, T * B, in]`` rows),
then one ``baddbmm`` and a few pointwise ops per step for all trials together, whatever ``n``
is. The cell's arithmetic is PyTorch's own (``aten/src/ATen/native/RNN.cpp``):

- LSTM: ``gates = (x W_ih^T + b_ih) + (h W_hh^T + b_hh)``, chunks ``i, f, g, o``;
  ``c' = sigmoid(f) c + sigmoid(i) tanh(g)``, ``h' = sigmoid(o) tanh(c')``, then ``h' W_hr^T``
  with ``proj_size``;
- GRU: ``r = sigmoid(i_r + h_r)``, ``z = sigmoid(i_z + h_z)``, ``n = tanh(i_n + r h_n)``,
  ``h' = (1 - z) n + z h`` (``h_*`` include ``b_hh``);
- RNN: ``h' = tanh(x W_ih^T + b_ih + h W_hh^T + b_hh)`` (or ``relu``).

Autograd differentiates the loop, so each trial's gradient is the one it gets alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hydro.fusion import random as _random
from hydro.fusion.ops import Spec, from_trials, to_trials


def per_trial(x: torch.Tensor, n: int, spec: Spec) -> torch.Tensor:
    """Any layout as ``[n, *one trial's shape]``, a shared value expanded (a view)."""
    t = to_trials(x, n, spec)
    if spec is None or spec[0] in ("S", "SB"):
        t = t if spec is not None and spec[0] == "SB" else t.unsqueeze(0)
        t = t.expand(n, *t.shape[1:])
    return t


def back(y: torch.Tensor, spec: Spec) -> torch.Tensor:
    """``[n, ...]`` in the layout ``spec`` asks for (``("T",)`` is already it)."""
    if isinstance(spec, tuple) and spec[0] == "F":
        return from_trials(y, spec)
    return y


def _cell(kind: str, gi: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None,
          w_hh_t: torch.Tensor, b_hh: torch.Tensor | None,
          w_hr_t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One step for every trial: ``gi`` ``[n, B, G*H]`` (input projection with ``b_ih``), ``h``
    ``[n, B, H_out]``; the new ``(h, c)``."""
    gh = torch.bmm(h, w_hh_t) if b_hh is None else torch.baddbmm(b_hh, h, w_hh_t)
    if kind == "lstm":
        i, f, g, o = (gi + gh).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return (h if w_hr_t is None else torch.bmm(h, w_hr_t)), c
    if kind == "gru":
        i_r, i_z, i_n = gi.chunk(3, -1)
        h_r, h_z, h_n = gh.chunk(3, -1)
        r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
        new = torch.tanh(i_n + r * h_n)
        return (1 - z) * new + z * h, None
    pre = gi + gh
    return (torch.tanh(pre) if kind == "rnn_tanh" else torch.relu(pre)), None


Step = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _lstm_slopes(acts: torch.Tensor, big_c: torch.Tensor, tanh_c: torch.Tensor,
                 c0: torch.Tensor, reverse: bool) -> None:
    """The gates' local derivatives for every step at once, written over the values the LSTM's
    forward left (a fresh whole-sequence tensor costs page faults on the CPU, more than the
    arithmetic): d/dc for i, f and the doubled g into the gate slots of ``acts`` (g i(1-i),
    c_prev f(1-f), 2 i u(1-u)), d/dh for o (tanh(c) o(1-o)) into ``big_c`` (which held
    ``C = 2c``) and dh/dc (o (1 - tanh^2 c)) into o's slot."""
    i, f, u, o = acts.unbind(-2)
    torch.addcmul(f, f, f, value=-1, out=f)  # times the c each step read: C / 2 or c0
    before, after = slice(1, None), slice(None, -1)
    now, prev, first = (after, before, -1) if reverse else (before, after, 0)
    f[now].mul_(big_c[prev])
    f[first].mul_(c0 * 2)
    f.mul_(0.5)
    g = torch.mul(u, 2, out=big_c).sub_(1)  # C is read no more: its buffer holds g
    torch.addcmul(u, u, u, value=-1, out=u).mul_(i).mul_(2)
    torch.addcmul(i, i, i, value=-1, out=i).mul_(g)
    torch.addcmul(o, o, o, value=-1, out=big_c).mul_(tanh_c)
    o.mul_(tanh_c.mul_(tanh_c).neg_().add_(1))


class _LSTMLayer(torch.autograd.Function):
    """One LSTM layer-direction (no projection) for all trials, forward and backward by hand.

    ``gi`` is the input projection with both biases, ``[n, T, B, 4H]`` as the batched matmul
    over the trials' ``[n, T * B, in]`` rows leaves it, so no layout is copied: the outputs are
    ``[n, T, B, H]`` (the next layer's rows as a view) and ``gi``'s gradient is written in that
    layout. The ``g`` block of ``gi`` and ``w_hh`` comes in doubled (see :func:`_lstm_layer`):
    on the CPU ``torch.tanh`` costs about five times ``torch.sigmoid``, and
    ``tanh(x) = 2 sigmoid(2x) - 1`` lets one sigmoid activate all four gates of a step; the cell
    state is kept doubled too (``C = 2c``, so ``tanh(c) = 2 sigmoid(C) - 1``). Both doublings are
    exact in floating point, so the values are PyTorch's to rounding.

    Autograd over the step loop would record ~10 nodes a step and replay them one by one; here
    the backward runs the recurrence in reverse with four pointwise ops and one ``baddbmm`` a
    step (the gates' local derivatives, which need no recurrence, are computed for every step at
    once before the loop, over the forward's buffers: :func:`_lstm_slopes`), and the recurrent
    weight's gradient is one ``bmm`` over every step.
    """

    @staticmethod
    def forward(ctx, gi, h0, c0, w_hh, reverse):
        n, steps, batch, four = gi.shape
        hid = four // 4
        w_t = w_hh.transpose(1, 2)
        order = range(steps - 1, -1, -1) if reverse else range(steps)
        # time-major buffers (each step's slice contiguous), the output trial-major
        acts = gi.new_empty(steps, n, batch, 4, hid)  # sigmoid of i, f, 2g, o
        big_c = gi.new_empty(steps, n, batch, hid)  # C = 2c
        tanh_c = gi.new_empty(steps, n, batch, hid)  # tanh(c) = 2 sigmoid(C) - 1
        hs = gi.new_empty(n, steps, batch, hid)
        gis, act_t, h_t = gi.unbind(1), acts.view(steps, n, batch, four).unbind(0), hs.unbind(1)
        i_t, f_t, u_t, o_t = (acts[..., k, :].unbind(0) for k in range(4))
        c_t, s_t = big_c.unbind(0), tanh_c.unbind(0)
        h, c = h0, c0 * 2
        for t in order:
            torch.sigmoid(torch.baddbmm(gis[t], h, w_t), out=act_t[t])
            i, o = i_t[t], o_t[t]
            # C' = f C + 2 i g = f C + 4 i u - 2 i
            c = torch.mul(f_t[t], c, out=c_t[t]).addcmul_(i, u_t[t], value=4).sub_(i, alpha=2)
            # h = o tanh(c), tanh(c) = 2 sigmoid(C) - 1
            h = torch.mul(o, torch.sigmoid(c, out=s_t[t]).mul_(2).sub_(1), out=h_t[t])
        ctx.save_for_backward(hs, h0, c0, w_hh)
        # intermediates, not inputs or outputs: held by ctx itself, since the backward turns
        # them into the gates' derivatives in place (once, however many backwards run)
        ctx.acts, ctx.big_c, ctx.tanh_c, ctx.f = acts, big_c, tanh_c, None
        ctx.reverse = reverse
        return hs, h.clone(), c / 2

    @staticmethod
    def backward(ctx, grad_hs, grad_h, grad_c):
        hs, h0, c0, w_hh = ctx.saved_tensors
        acts, big_c = ctx.acts, ctx.big_c
        steps, n, batch, _, hid = acts.shape
        four = 4 * hid
        order = list(range(steps - 1, -1, -1) if ctx.reverse else range(steps))
        if ctx.f is None:  # the first backward through this node (retain_graph: more follow)
            ctx.f = acts[..., 1, :].clone()  # the loop reads f itself
            _lstm_slopes(acts, big_c, ctx.tanh_c, c0, ctx.reverse)
        f_t = ctx.f.unbind(0)
        dgates = acts.new_empty(n, steps, batch, four)  # gi's layout
        dg_t, ghs = dgates.unbind(1), grad_hs.unbind(1)
        sl_t = acts[..., :3, :].unbind(0)
        os_t, cl_t = big_c.unbind(0), acts[..., 3, :].unbind(0)
        dh, dc, dg = grad_h + ghs[order[-1]], grad_c, None
        for k in range(steps - 1, -1, -1):
            t = order[k]
            if dg is not None:
                dh = torch.baddbmm(ghs[t], dg, w_hh)
            dc = torch.addcmul(dc, dh, cl_t[t])
            dg = dg_t[t]
            torch.mul(dc.unsqueeze(-2), sl_t[t], out=dg[..., : 3 * hid].unflatten(-1, (3, hid)))
            torch.mul(dh, os_t[t], out=dg[..., 3 * hid :])
            dc = dc * f_t[t]
        dh0 = torch.bmm(dg, w_hh)
        # the weight's gradient, sum over steps of h read^T dgates: the steps that read an
        # output of this layer in one bmm (views, no copy), then the one that read h0
        read, wrote, start = (1, -1, -1) if ctx.reverse else (-1, 1, 0)
        outs = hs[:, read:] if ctx.reverse else hs[:, :read]
        gates = dgates[:, :wrote] if ctx.reverse else dgates[:, wrote:]
        dw = torch.bmm(outs.reshape(n, -1, hid).transpose(1, 2), gates.reshape(n, -1, four))
        dw.baddbmm_(h0.transpose(1, 2), dgates[:, start])
        return dgates, dh0, dc, dw.transpose(1, 2), None


def _lstm_layer(x: torch.Tensor, h: torch.Tensor, c: torch.Tensor,
                weights: Sequence[torch.Tensor | None], reverse: bool) -> Step:
    """An LSTM layer-direction without projection over ``x`` ``[n, T, B, in]`` by
    :class:`_LSTMLayer`: the input projection of every step in one batched matmul, both biases
    added by it, and the ``g`` gate's rows of the weights and bias doubled (by autograd ops, so
    their gradients come back through the doubling)."""
    w_ih, w_hh, b_ih, b_hh, _ = weights
    n, steps, batch, _ = x.shape
    hid = w_hh.shape[-1]
    scale = w_hh.new_ones(4, hid)
    scale[2] = 2
    scale = scale.view(-1)
    rows = x.reshape(n, steps * batch, x.shape[-1])
    w_in = (w_ih * scale[:, None]).transpose(1, 2)
    bias = b_ih if b_hh is None else b_hh if b_ih is None else b_ih + b_hh
    gi = (torch.matmul(rows, w_in) if bias is None
          else torch.baddbmm((bias * scale).unsqueeze(1), rows, w_in))
    gi = gi.view(n, steps, batch, -1)
    return _LSTMLayer.apply(gi, h, c, w_hh * scale[:, None], reverse)


def _direction(kind: str, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None,
               weights: Sequence[torch.Tensor | None], reverse: bool) -> Step:
    """One layer in one direction over ``x`` ``[n, T, B, in]``: its outputs ``[n, T, B, H_out]``
    and last ``(h, c)``."""
    w_ih, w_hh, b_ih, b_hh, w_hr = weights
    n, steps, batch, _ = x.shape
    rows = x.reshape(n, steps * batch, x.shape[-1])
    if kind == "lstm" and w_hr is None:  # the common case: a hand-written backward
        return _lstm_layer(x, h, c, weights, reverse)
    gi = torch.matmul(rows, w_ih.transpose(1, 2))
    if b_ih is not None:
        gi = gi + b_ih.unsqueeze(1)
    gi = gi.view(n, steps, batch, -1)
    w_hh_t = w_hh.transpose(1, 2)
    w_hr_t = None if w_hr is None else w_hr.transpose(1, 2)
    b_hh = None if b_hh is None else b_hh.unsqueeze(1)
    outs: list[torch.Tensor | None] = [None] * steps
    for t in range(steps - 1, -1, -1) if reverse else range(steps):
        h, c = _cell(kind, gi[:, t], h, c, w_hh_t, b_hh, w_hr_t)
        outs[t] = h
    return torch.stack(outs, 1), h, c


def trial_rnn(
    kind: str,
    x: torch.Tensor,
    hx: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    has_biases: bool,
    layers: int,
    bidirectional: bool,
    batch_first: bool,
    n: int,
    x_spec: Spec,
    hx_specs: Sequence[Spec],
    param_specs: Sequence[Spec],
    out_specs: Sequence[Spec],
    dropout: tuple[float | torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """``aten.lstm``/``gru``/``rnn_tanh``/``rnn_relu`` for ``n`` trials, each with its own
    weights (``[n, ...]``) and inputs; outputs in the layouts ``out_specs``.

    ``dropout``, in training, is ``(rate, keys)``: one rate or each trial's ``[n]``, and the
    op's per-trial stream keys ``[2, n]`` (:mod:`hydro.fusion.random`). As ``nn.LSTM`` does,
    every layer's output but the last is dropped out; the masks of all those layers are one
    draw over ``[layers - 1, T, B, H_out]`` per trial, indexed in that trial's own tensor, so a
    trial's masks are the same in any group and slot."""
    dirs = 2 if bidirectional else 1
    xs = per_trial(x, n, x_spec)
    unbatched = xs.dim() == 3
    xs = xs.unsqueeze(2) if unbatched else xs.transpose(1, 2) if batch_first else xs
    states = [per_trial(h, n, s) for h, s in zip(hx, hx_specs)]
    states = [s.unsqueeze(2) if unbatched else s for s in states]  # [n, L*D, B, H]
    ws = [per_trial(p, n, s) for p, s in zip(params, param_specs)]
    per = len(ws) // (layers * dirs)
    proj = per in (3, 5)
    h_n, c_n = [], []
    for layer in range(layers):
        outs = []
        for d in range(dirs):
            group = ws[(layer * dirs + d) * per : (layer * dirs + d + 1) * per]
            w_ih, w_hh = group[0], group[1]
            b_ih, b_hh = (group[2], group[3]) if has_biases else (None, None)
            w_hr = group[-1] if proj else None
            k = layer * dirs + d
            c0 = states[1][:, k] if kind == "lstm" else None
            y, h, c = _direction(kind, xs, states[0][:, k], c0, (w_ih, w_hh, b_ih, b_hh, w_hr),
                                 reverse=d == 1)
            outs.append(y)
            h_n.append(h)
            c_n.append(c)
        xs = outs[0] if dirs == 1 else torch.cat(outs, -1)
        if dropout is not None and layer < layers - 1:
            if layer == 0:  # every layer's mask (scaled by 1 / (1 - p)) in one draw
                ones = xs.new_ones(n, layers - 1, *xs.shape[1:])
                masks = _random.dropout(ones, dropout[0], dropout[1])
            xs = xs * masks[:, layer]
    y = xs.squeeze(2) if unbatched else xs.transpose(1, 2) if batch_first else xs
    finals = [torch.stack(h_n, 1)] + ([torch.stack(c_n, 1)] if kind == "lstm" else [])
    finals = [f.squeeze(2) if unbatched else f for f in finals]
    return tuple(back(v, s) for v, s in zip([y, *finals], out_specs))


def trial_cell(
    kind: str,
    x: torch.Tensor,
    hx: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor | None],
    n: int,
    x_spec: Spec,
    hx_specs: Sequence[Spec],
    weight_specs: Sequence[Spec],
    out_specs: Sequence[Spec],
) -> tuple[torch.Tensor, ...]:
    """``aten.lstm_cell``/``gru_cell``/``rnn_*_cell`` (one step of ``nn.LSTMCell``...) for ``n``
    trials: ``weights`` are ``w_ih, w_hh, b_ih, b_hh`` (biases may be ``None``)."""
    xs = per_trial(x, n, x_spec)
    unbatched = xs.dim() == 2
    xs = xs.unsqueeze(1) if unbatched else xs
    states = [per_trial(h, n, s) for h, s in zip(hx, hx_specs)]
    states = [s.unsqueeze(1) if unbatched else s for s in states]
    w_ih, w_hh, b_ih, b_hh = (None if w is None else per_trial(w, n, s)
                              for w, s in zip(weights, weight_specs))
    gi = torch.bmm(xs, w_ih.transpose(1, 2))
    if b_ih is not None:
        gi = gi + b_ih.unsqueeze(1)
    c0 = states[1] if kind == "lstm" else None
    b_hh = None if b_hh is None else b_hh.unsqueeze(1)
    h, c = _cell(kind, gi, states[0], c0, w_hh.transpose(1, 2), b_hh, None)
    outs = [h, c] if kind == "lstm" else [h]
    outs = [o.squeeze(1) if unbatched else o for o in outs]
    return tuple(back(v, s) for v, s in zip(outs, out_specs))


__all__ = ["trial_cell", "trial_rnn"]
