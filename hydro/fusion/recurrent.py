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
          w_hr_t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
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


class _LSTMLayer(torch.autograd.Function):
    """One LSTM layer-direction (no projection) for all trials, forward and backward by hand.

    Autograd over the step loop records ~10 nodes a step and replays them one by one; here the
    forward keeps each step's activated gates and cell state, and the backward runs the same
    recurrence in reverse with a fixed number of ops a step (backpropagation through time), the
    recurrent weight's gradient then coming from one ``bmm`` over every step. Same arithmetic as
    autograd's, so the same gradients to rounding.
    """

    @staticmethod
    def forward(ctx, gi, h0, c0, w_hh, b_hh, reverse):  # noqa: ANN001, ANN205
        steps, n, batch, four = gi.shape  # time-major: every step's slice is contiguous
        hid = four // 4
        w_t = w_hh.transpose(1, 2)
        order = range(steps - 1, -1, -1) if reverse else range(steps)
        pre_all = gi if b_hh is None else gi + b_hh.unsqueeze(1)  # once, not once a step
        acts = gi.new_empty(gi.shape)
        cs = gi.new_empty(steps, n, batch, hid)
        tcs = gi.new_empty(steps, n, batch, hid)  # tanh(c), which the backward reads
        hs = gi.new_empty(steps, n, batch, hid)
        h, c = h0, c0
        for t in order:
            pre = torch.baddbmm(pre_all[t], h, w_t)
            act = acts[t]
            torch.sigmoid(pre, out=act)
            torch.tanh(pre[..., 2 * hid : 3 * hid], out=act[..., 2 * hid : 3 * hid])
            i, f, g, o = act.chunk(4, -1)
            torch.mul(f, c, out=cs[t])
            c = cs[t].addcmul_(i, g)
            torch.tanh(c, out=tcs[t])
            h = torch.mul(o, tcs[t], out=hs[t])
        ctx.save_for_backward(acts, cs, tcs, hs, h0, c0, w_hh)
        ctx.reverse, ctx.has_bias = reverse, b_hh is not None
        return hs, h.clone(), c.clone()

    @staticmethod
    def backward(ctx, grad_hs, grad_h, grad_c):  # noqa: ANN001, ANN205
        acts, cs, tcs, hs, h0, c0, w_hh = ctx.saved_tensors
        steps, hid = acts.shape[0], hs.shape[-1]
        order = list(range(steps - 1, -1, -1) if ctx.reverse else range(steps))
        # each gate's derivative and o * tanh'(c), for every step at once
        slope = acts * (1 - acts)
        g = acts[..., 2 * hid : 3 * hid]
        slope[..., 2 * hid : 3 * hid] = 1 - g * g
        o_slope = acts[..., 3 * hid :] * (1 - tcs * tcs)
        dh = torch.zeros_like(h0) if grad_h is None else grad_h.clone()
        dc = torch.zeros_like(c0) if grad_c is None else grad_c.clone()
        dgates = torch.empty_like(acts)
        grad_hs = None if grad_hs is None else grad_hs.contiguous()
        for k in range(steps - 1, -1, -1):
            t = order[k]
            before = order[k - 1] if k else None
            c_prev = c0 if before is None else cs[before]
            if grad_hs is not None:
                dh = dh + grad_hs[t]
            dc = torch.addcmul(dc, dh, o_slope[t])
            i, f, g, _ = acts[t].chunk(4, -1)
            dg = dgates[t]
            di, df, dgg, do = dg.chunk(4, -1)
            torch.mul(dc, g, out=di)
            torch.mul(dc, c_prev, out=df)
            torch.mul(dc, i, out=dgg)
            torch.mul(dh, tcs[t], out=do)
            dg.mul_(slope[t])
            dc = dc * f
            dh = torch.bmm(dg, w_hh)
        # the h each step read, in time order, for the weight's gradient: one op
        first = h0.unsqueeze(0)
        prev_h = torch.cat([hs[1:], first]) if ctx.reverse else torch.cat([first, hs[:-1]])
        _, n, batch, four = dgates.shape
        rows = dgates.transpose(0, 1).reshape(n, steps * batch, four)
        dw = torch.bmm(rows.transpose(1, 2), prev_h.transpose(0, 1).reshape(n, steps * batch, -1))
        db = rows.sum(1) if ctx.has_bias else None
        return dgates, dh, dc, dw, db, None


def _direction(kind: str, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None,
               weights: Sequence[torch.Tensor | None], reverse: bool) -> Step:  # fmt: skip
    """One layer in one direction over ``x`` ``[n, T, B, in]``: its outputs ``[n, T, B, H_out]``
    and last ``(h, c)``."""
    w_ih, w_hh, b_ih, b_hh, w_hr = weights
    n, steps, batch, _ = x.shape
    rows = x.reshape(n, steps * batch, x.shape[-1])
    gi = torch.matmul(rows, w_ih.transpose(1, 2))
    if b_ih is not None:
        gi = gi + b_ih.unsqueeze(1)
    gi = gi.view(n, steps, batch, -1)
    if kind == "lstm" and w_hr is None:  # the common case: a hand-written backward
        hs, h, c = _LSTMLayer.apply(gi.transpose(0, 1).contiguous(), h, c, w_hh, b_hh, reverse)
        return hs.transpose(0, 1), h, c
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
) -> tuple[torch.Tensor, ...]:
    """``aten.lstm``/``gru``/``rnn_tanh``/``rnn_relu`` for ``n`` trials, each with its own
    weights (``[n, ...]``) and inputs; outputs in the layouts ``out_specs`` (no dropout between
    layers: the handler refuses it)."""
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
                                 reverse=d == 1)  # fmt: skip
            outs.append(y)
            h_n.append(h)
            c_n.append(c)
        xs = outs[0] if dirs == 1 else torch.cat(outs, -1)
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
                              for w, s in zip(weights, weight_specs))  # fmt: skip
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
