"""Runtime functions of fused graphs: n trials of one ATen op at once.

Layouts. Inside a fused graph every tensor is in one of four layouts (see ``rewrite.py``):

* ``"F"`` (folded): a value that carries the batch, with the ``n`` per-trial batches stacked
  trial-major where the batch is, so ``B`` simply reads ``n * B`` and the model's own shape code
  (``view(B, T, H, D)``, attention, pooling) runs unchanged. Its spec ``("F", dim, outer)`` says
  that dimension ``dim`` of one trial's value is ``outer * B * inner`` (the batch merged with
  other dimensions by a ``view``); the trials sit just inside ``outer``.
* ``"T"`` (trial): a per-trial value with no batch, stacked as ``[n, ...]`` (a parameter, a
  per-trial loss).
* ``"S"`` (shared): one value for every trial, as in the original model (``arange``, a mask).
* ``"SB"``: a shared value that carries the batch (a model input fed to every trial), expanded to
  ``"F"`` only where an op needs each trial's own copy.

A folded value whose batch leads (``[n * B, C, H, W]``) may instead be held *channel-stacked*,
``[B, n * C, H, W]`` (HFTA's layout): convolutions, BatchNorm and GroupNorm run on it as one
grouped kernel, and the channel-wise ops between them (pointwise ops, pooling, padding, spatial
means, permutes that keep the batch first) keep it, so a stack of layers converts only where an
op needs the folded value (``rewrite.py`` decides, per value). ``cdim`` names the dimension that
holds the trials' channels (3 after ConvNeXt's ``permute(0, 2, 3, 1)``).

Every function here runs a fixed number of ATen ops whatever ``n`` is: per-trial values are
broadcast over a leading trial dimension, never looped over in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_unflatten

from hydro.fusion import random as _random

Spec = tuple | None  # ("F", dim, outer) | ("SB", dim, outer) | ("T",) | ("S",) | None


def to_trials(x: torch.Tensor, n: int, spec: Spec) -> torch.Tensor:
    """Any layout -> ``[n, *one trial's shape]`` (``"SB"`` as ``[1, ...]``, ``"S"`` as is)."""
    kind = spec[0] if spec else None
    if kind == "F":
        _, d, outer = spec
        if outer == 1:
            t = x.unflatten(d, (n, -1))
            return t.movedim(d, 0) if d else t  # an identity permute is still an op (a launch)
        return x.unflatten(d, (outer, n, -1)).movedim(d + 1, 0).flatten(d + 1, d + 2)
    if kind == "SB":
        return x.unsqueeze(0)
    return x


def from_trials(y: torch.Tensor, spec: Spec) -> torch.Tensor:
    """``[n, *one trial's shape]`` -> folded, for a value of spec ``("F", dim, outer)``."""
    _, d, outer = spec
    if outer == 1:
        return (y.movedim(0, d) if d else y).flatten(d, d + 1)
    return y.unflatten(d + 1, (outer, -1)).movedim(0, d + 1).flatten(d, d + 2)


def expand_shared(x: torch.Tensor, n: int, spec: Spec) -> torch.Tensor:
    """A shared batched value (``"SB"``) as a folded one: every trial its own copy."""
    grown = x.unsqueeze(0).expand(n, *x.shape)
    return from_trials(grown, ("F", spec[1], spec[2]))


def expand_trials(x: torch.Tensor, n: int) -> torch.Tensor:
    """A shared value (a frozen parameter stored once) as a per-trial one, ``[n, ...]`` (a view)."""
    return x.unsqueeze(0).expand(n, *x.shape)


def lift(x: object, n: int, spec: Spec, rank: int) -> object:
    """An operand of a broadcasting op as ``[n | 1, 1, ..., *its shape]`` of ``rank + 1`` dims."""
    if not isinstance(x, torch.Tensor) or spec is None or spec[0] == "S":
        return x
    t = to_trials(x, n, spec)
    missing = rank + 1 - t.dim()
    return t.view(t.shape[0], *([1] * missing), *t.shape[1:]) if missing > 0 else t


def settle(y: torch.Tensor, spec: Spec) -> torch.Tensor:
    """A result ``[n, ...]`` in its layout: folded if it carries the batch, else as is."""
    return from_trials(y, spec) if spec and spec[0] == "F" else y


def shared_size(size: int, n: int) -> int:
    """The batch size of a shared batched input as the folded graph reads it."""
    return size * n


def pointwise(
    op: Callable, n: int, specs: Sequence[Spec], out: Spec, rank: int, /, *args: object,
    **kwargs: object,
) -> torch.Tensor:
    """A broadcasting op with per-trial operands, run once over an explicit trial dimension."""
    lifted = [lift(a, n, s, rank) for a, s in zip(args, specs)]
    return settle(op(*lifted, **kwargs), out)


def _flat_rows(x: torch.Tensor, n: int, spec: Spec) -> torch.Tensor:
    t = to_trials(x, n, spec)
    if spec and spec[0] in ("S", "SB"):
        t = t.expand(n, *t.shape[1:]) if spec[0] == "SB" else t.expand(n, *t.shape)
    return t


class _BatchedLinear(torch.autograd.Function):
    """``y[k] = x[k] @ w[k] + b[k]`` as one ``baddbmm``, ``w`` given ``[n, in, out]``.

    A custom backward gives the weight gradient in the layout the weight is stored in (``[n,
    out, in]`` for ``linear``), where autograd's own would transpose a copy of it every step.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, transposed):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.transposed = bias is not None, transposed
        ctx.bias_dtype = bias.dtype if bias is not None else None
        w = weight.transpose(1, 2) if transposed else weight
        return torch.bmm(x, w) if bias is None else torch.baddbmm(bias.unsqueeze(1), x, w)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        # under autocast the forward's GEMM ran in a lower precision (bf16/fp16) and the
        # backward, outside the autocast region, gets its gradient in that precision: the
        # GEMMs here run in it too, as autocast's own linear backward does, and each gradient
        # comes back in its input's dtype
        low = grad.dtype
        xs, ws = x.to(low), weight.to(low)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.bmm(grad, ws if ctx.transposed else ws.transpose(1, 2)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            if ctx.transposed:
                grad_w = torch.bmm(grad.transpose(1, 2), xs)
            else:
                grad_w = torch.bmm(xs.transpose(1, 2), grad)
            grad_w = grad_w.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(dim=1).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None


# widest shared input that ``trial_linear`` reads through a view per trial rather than with one GEMM
NARROW_SHARED = 64


def trial_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    spec: Spec,
    out: Spec,
    transposed: bool = True,
) -> torch.Tensor:
    """``linear`` (``transposed``: weight ``[n, out, in]``) or ``addmm``/``mm`` (``[n, in,
    out]``) with a per-trial weight and bias.

    A shared input meets every trial's weights in one GEMM (read once, not ``n`` times).
    """
    if spec is not None and spec[0] in ("S", "SB"):
        w = weight if transposed else weight.transpose(1, 2)
        k, out_f, in_f = w.shape
        if in_f <= NARROW_SHARED and spec[0] == "SB" and spec[1:] == (0, 1) and out == ("F", 0, 1):
            # a narrow shared input: every trial reads it through a stride-0 view, and the
            # result comes out trial-major as the folded layout wants it (the one GEMM below
            # gives ``[B, n * out]``, a copy to fold and another in the backward)
            rows = x.reshape(1, -1, in_f).expand(k, -1, in_f)
            y = _BatchedLinear.apply(rows, weight, bias, transposed)
            return y.view(k * x.shape[0], *x.shape[1:-1], out_f)
        y = F.linear(x, w.reshape(k * out_f, in_f), None if bias is None else bias.reshape(-1))
        return settle(y.unflatten(-1, (k, out_f)).movedim(-2, 0), out)
    if spec is not None and spec[0] == "F" and spec[1:] == (0, 1) and out == spec:
        # the batch leads, trial-major: ``[n * B, ..., in]`` is ``[n, rows, in]`` as it lies,
        # one view there and one back (``to_trials``/``settle`` would take four)
        y = _BatchedLinear.apply(x.reshape(n, -1, x.shape[-1]), weight, bias, transposed)
        return y.view(*x.shape[:-1], y.shape[-1])
    t = to_trials(x, n, spec)
    rows = t.reshape(n, -1, t.shape[-1])
    y = _BatchedLinear.apply(rows, weight, bias, transposed)
    return settle(y.view(*t.shape[:-1], y.shape[-1]), out)


def trial_embedding(
    weight: torch.Tensor, ids: torch.Tensor, padding_idx: int, n: int, spec: Spec, out: Spec
) -> torch.Tensor:
    """``n`` embedding tables looked up as one, with per-trial row offsets."""
    vocab = weight.shape[1]
    t = to_trials(ids, n, spec)
    if spec is None or spec[0] == "S":
        t = t.unsqueeze(0)
    offsets = torch.arange(n, device=ids.device) * vocab
    shifted = t + offsets.view(n, *([1] * (t.dim() - 1)))
    y = F.embedding(shifted, weight.flatten(0, 1))
    if padding_idx is not None and padding_idx >= 0:
        # as aten.embedding: the padding row is read but receives no gradient
        pad = (t == padding_idx).expand_as(shifted).unsqueeze(-1)
        y = torch.where(pad, y.detach(), y)
    return settle(y, out)


def trial_norm(
    kind: str,
    x: torch.Tensor,
    shape: object,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    n: int,
    spec: Spec,
    wspec: Spec,
    bspec: Spec,
    out: Spec,
    rank: int,
) -> torch.Tensor:
    """``layer_norm``/``rms_norm``: normalize once, then each trial's affine transform."""
    if kind == "layer":
        y = F.layer_norm(x, shape, None, None, eps)
    else:
        y = F.rms_norm(x, shape, None, eps)
    if spec and spec[0] == "SB" and out and out[0] == "F":
        y = expand_shared(y, n, spec)
        spec = ("F", spec[1], spec[2])
    yt = lift(y, n, spec, rank)
    if spec is None or spec[0] == "S":
        yt = yt.unsqueeze(0)
    if weight is not None:
        yt = yt * lift(weight, n, wspec, rank)
    if bias is not None:
        yt = yt + lift(bias, n, bspec, rank)
    return settle(yt, out)


def _channels(v: torch.Tensor | None) -> torch.Tensor | None:
    return None if v is None else v.reshape(-1)


def to_channels(x: torch.Tensor, n: int, cdim: int = 1) -> torch.Tensor:
    """Folded ``[n * B, C, ...]`` -> channel-stacked ``[B, n * C, ...]`` (trial-major channels in
    dimension ``cdim``: ``[B, H, W, n * C]`` for ``cdim`` 3)."""
    return x.unflatten(0, (n, -1)).movedim(0, cdim).flatten(cdim, cdim + 1)


def from_channels(y: torch.Tensor, n: int, cdim: int = 1) -> torch.Tensor:
    """Channel-stacked (trials in dimension ``cdim``) -> folded ``[n * B, C, ...]``."""
    return y.unflatten(cdim, (n, -1)).movedim(cdim, 0).flatten(0, 1)


def stacked_cat(parts: Sequence[torch.Tensor], n: int, cdim: int = 1) -> torch.Tensor:
    """``cat`` along the channels of channel-stacked values: trial ``k``'s channels of every
    part, in order, make trial ``k``'s block of the result."""
    blocks = [p.unflatten(cdim, (n, -1)) for p in parts]
    return torch.cat(blocks, dim=cdim + 1).flatten(cdim, cdim + 1)


def shared_to_channels(x: torch.Tensor, n: int, cdim: int = 1) -> torch.Tensor:
    """A shared batched value ``[B, C, ...]`` channel-stacked: every trial its own copy."""
    grown = x.unsqueeze(cdim).expand(*x.shape[:cdim], n, *x.shape[cdim:])
    return grown.flatten(cdim, cdim + 1)


def stack_operand(
    x: object, n: int, spec: Spec, cdim: int, channels: int, rank: int
) -> object:
    """A batch-free operand of a broadcasting op whose result is channel-stacked.

    A per-trial value (``"T"``, ``[n, ...]``: a layer scale ``gamma.view(1, -1, 1, 1)``, a
    per-trial literal) puts its trials on dimension ``cdim``, expanded to ``channels`` first when
    it is one value per trial; a shared per-channel value is repeated once per trial.
    """
    if not isinstance(x, torch.Tensor) or spec is None:
        return x
    if spec[0] == "T":
        t = lift(x, n, spec, rank)
        if t.shape[cdim + 1] != channels:
            sizes = list(t.shape)
            sizes[cdim + 1] = channels
            t = t.expand(sizes)
        return t.movedim(0, cdim).flatten(cdim, cdim + 1)
    pos = cdim - (rank - x.dim())
    if pos >= 0 and x.shape[pos] != 1:
        reps = [1] * x.dim()
        reps[pos] = n
        return x.repeat(reps)
    return x


def stacked_pointwise(
    op: Callable, n: int, cdim: int, rank: int, specs: Sequence[Spec | str | None], /,
    *args: object, **kwargs: object,
) -> torch.Tensor:
    """A broadcasting op on channel-stacked values (spec ``"stacked"``) with per-trial or shared
    operands. The channel count is read from the stacked operand at run time: a surrogate's
    recorded shapes are those of the model it was scaled from."""
    stacked = next(a for a, s in zip(args, specs) if s == "stacked")
    channels = stacked.shape[cdim] // n
    lifted = [
        a if s == "stacked" else stack_operand(a, n, s, cdim, channels, rank)
        for a, s in zip(args, specs)
    ]
    return op(*lifted, **kwargs)


def stacked_layer_norm(
    x: torch.Tensor, channels: int, weight, bias, eps: float, n: int, per_trial: bool
) -> torch.Tensor:
    """``layer_norm`` over the last dimension of a value channel-stacked there
    (``[B, H, W, n * C]``, ConvNeXt's channels-last norm): each trial's ``C`` channels
    normalized, then its own affine (``per_trial``: ``[n, C]``) or the shared one."""
    y = x.unflatten(-1, (n, channels))
    if per_trial:
        y = F.layer_norm(y, [channels], None, None, eps)
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
    else:
        y = F.layer_norm(y, [channels], weight, bias, eps)
    return y.flatten(-2)


def trial_group_norm(
    x: torch.Tensor, groups: int, weight, bias, eps: float, n: int
) -> torch.Tensor:
    """``group_norm`` on channel-stacked ``[B, n * C, ...]``: each trial's groups are groups of
    the stacked value (statistics per sample and group), then per-trial affine parameters."""
    y = F.group_norm(x, n * groups, None, None, eps)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y


def trial_batch_norm(
    x, weight, bias, running_mean, running_var, training, momentum, eps
) -> torch.Tensor:
    """``n`` BatchNorms as one on channel-stacked ``[B, n * C, ...]``; running statistics update
    in place (the flattened buffers are views of the ``[n, C]`` ones)."""
    return F.batch_norm(
        x, _channels(running_mean), _channels(running_var), _channels(weight), _channels(bias),
        training, momentum, eps,
    )


def _pair(v: object) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[-1]))


def _conv_out(size: int, k: int, stride: int, pad: int, dil: int) -> int:
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1


def conv_as_bmm(x: torch.Tensor, weight: object, stride, padding, dilation) -> bool:
    """Whether a 2-D convolution of channel-stacked ``x`` runs as one batched GEMM over
    unfolded patches rather than as a grouped convolution: on a CPU, a 1x1 convolution or one
    with at most 16 output positions per image. Measured (``benchmarks/fusion.py --convs``,
    n = 8, batch 4, one thread): oneDNN's grouped convolution is 1.5-16x slower than the GEMM
    there (3x3 convolutions at 1x1 to 4x4 maps, 1x1 convolutions), and 2x faster on 3x3
    convolutions over 8x8 maps and larger."""
    if x.device.type != "cpu" or x.dim() != 4 or isinstance(padding, str):
        return False
    kh, kw = weight.shape[-2:]
    if kh * kw == 1:
        return True
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    positions = _conv_out(x.shape[2], kh, sh, ph, dh) * _conv_out(x.shape[3], kw, sw, pw, dw)
    return positions <= 16


def bmm_conv(x, weight, bias, stride, padding, dilation, n: int) -> torch.Tensor:
    """``n`` 2-D convolutions (``groups`` 1) of channel-stacked ``x`` as one ``baddbmm``:
    trial ``k``'s filters ``[C_out, C_in * kh * kw]`` times its unfolded patches."""
    b, _, h, w = x.shape
    _, c_out, c_in, kh, kw = weight.shape
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    cols = F.unfold(x, (kh, kw), (dh, dw), (ph, pw), (sh, sw))  # [B, n * C_in * kh * kw, L]
    rows = cols.unflatten(1, (n, -1)).permute(1, 2, 0, 3).flatten(2)  # [n, C_in*kh*kw, B*L]
    filters = weight.reshape(n, c_out, -1)
    if bias is None:
        y = torch.bmm(filters, rows)
    else:
        y = torch.baddbmm(bias.reshape(n, c_out, 1), filters, rows)
    ho, wo = _conv_out(h, kh, sh, ph, dh), _conv_out(w, kw, sw, pw, dw)
    return y.view(n, c_out, b, ho, wo).permute(2, 0, 1, 3, 4).reshape(b, n * c_out, ho, wo)


def trial_conv(
    dims: int, x, weight, bias, stride, padding, dilation, groups: int, n: int, shared: bool
) -> torch.Tensor:
    """``n`` convolutions as one, channel-stacked ``[B, n * C_out, ...]`` out (trial ``k`` is
    group block ``k``): a grouped convolution on channel-stacked ``x`` (or a batched GEMM over
    unfolded patches where :func:`conv_as_bmm` says so), or (``shared``) one convolution with all
    trials' filters over a shared input ``[B, C_in, ...]``."""
    gemm = not shared and dims == 2 and groups == 1
    if gemm and conv_as_bmm(x, weight, stride, padding, dilation):
        return bmm_conv(x, weight, bias, stride, padding, dilation, n)
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
    w = weight.flatten(0, 1)
    b = None if bias is None else bias.flatten()
    return fn(x, w, b, stride, padding, dilation, groups if shared else n * groups)


def trial_conv_transpose(
    dims: int, x, weight, bias, stride, padding, output_padding, groups: int, dilation, n: int
) -> torch.Tensor:
    """``n`` transposed convolutions as one grouped one on channel-stacked ``[B, n * C_in, ...]``
    (weights ``[n, C_in, C_out / groups, ...]``), channel-stacked out."""
    fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[dims]
    b = None if bias is None else bias.flatten()
    return fn(x, weight.flatten(0, 1), b, stride, padding, output_padding, n * groups, dilation)


def trial_dropout(
    x: torch.Tensor, p: float | torch.Tensor, train: bool, n: int, spec: Spec, keys: torch.Tensor
) -> torch.Tensor:
    """Dropout with one rate or a per-trial rate ``p[n]``; each trial draws its mask from its
    own stream (``keys``: this op's ``[2, n]`` from :func:`hydro.fusion.random.stream_keys`),
    indexed by position in that trial's own tensor, not in the fused batch."""
    if not train:
        return x
    return settle(_random.dropout(to_trials(x, n, spec), p, keys), spec)


def trial_random(
    kind: str, x: torch.Tensor, n: int, spec: Spec, keys: torch.Tensor, p: object = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``rand_like``/``randn_like``/``bernoulli`` of ``x`` from each trial's own stream (``x``'s
    values matter only as ``bernoulli``'s probabilities when ``p`` is ``None``)."""
    t = to_trials(x, n, spec)
    dtype = dtype or x.dtype
    if kind == "rand":
        y = _random.uniform(keys, t.shape[1:], dtype)
    elif kind == "randn":
        y = _random.normal(keys, t.shape[1:], dtype)
    else:
        y = _random.bernoulli(keys, t.shape[1:], t if p is None else p, dtype)
    return settle(y, spec)


def trial_attention(
    q, k, v, mask, p, causal: bool, scale, gqa: bool, n: int, spec: Spec, keys: torch.Tensor,
    mask_spec: Spec = None,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with dropout (the math form): one rate or a per-trial
    rate ``p[n]``, each trial's attention weights dropped from its own stream (``keys``). A
    per-trial mask (``mask_spec`` ``("T",)``, ``[n, ...]``) meets each trial's own scores."""
    d = q.shape[-1]
    if gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else d**-0.5)
    if causal:
        tq, tk = q.shape[-2], k.shape[-2]
        keep = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
        scores = scores.masked_fill(~keep, float("-inf"))
    per_trial = mask is not None and mask_spec == ("T",)
    if per_trial:  # over an explicit trial dimension, folded back after
        scores = to_trials(scores, n, spec)
        mask = lift(mask, n, mask_spec, scores.dim() - 1)
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf"))
            if mask.dtype == torch.bool
            else (scores + mask)
        )
    if per_trial:
        scores = settle(scores, spec)
    att = trial_dropout(torch.softmax(scores, dim=-1), p, True, n, spec, keys)
    return att @ v


def _heads_folded(x: torch.Tensor, n: int, spec: Spec) -> torch.Tensor:
    """A folded attention operand, ``[lead0, *rest, L, E]`` per trial, as ``[lead0, n *
    prod(rest), L, E]``: the trials inside the head dimension, trial-major, so a grouped-query
    layout (``n * H_kv`` heads serving ``n * H_q``) still pairs heads within a trial."""
    t = to_trials(x, n, spec)
    return t.movedim(0, 1).flatten(1, t.dim() - 3)


def trial_masked_attention(
    q, k, v, mask, causal: bool, scale, gqa: bool, n: int, specs: Sequence[Spec], out: Spec
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with a per-trial mask or additive bias ``[n, ...]`` (a
    learned relative-position table read per trial) over folded ``q``, ``k``, ``v``: one call to
    torch's kernel with the trials folded into the heads, so the bias needs no copy per sample
    and its gradient flows through torch's own backward. A boolean mask stays boolean."""
    qs, ks, vs = (_heads_folded(x, n, s) for x, s in zip((q, k, v), specs))
    one = list(q.shape)  # one trial's shape: folded values keep the rank
    if specs[0][0] == "F":
        one[specs[0][1]] //= n
    heads = one[1:-2]  # the dimensions between the leading one and the sequence
    m = lift(mask, n, ("T",), len(one)).movedim(0, 1)  # [m0, n, *heads or 1s, Lq | 1, Lk | 1]
    if heads:  # a mask broadcast over the heads is broadcast per trial only (a small copy)
        m = m.expand(m.shape[0], n, *heads, *m.shape[-2:])
    m = m.flatten(1, m.dim() - 3)
    y = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=m, is_causal=causal, scale=scale,
                                       enable_gqa=gqa)
    return settle(y.unflatten(1, (n, *heads)).movedim(1, 0), out)


def trial_reduce(op_name: str, x: torch.Tensor, n: int, spec: Spec) -> torch.Tensor:
    """A full ``sum``/``mean`` of a batched value, one per trial: ``[n]``."""
    rows = _flat_rows(x, n, spec).reshape(n, -1)
    return rows.sum(1) if op_name == "sum" else rows.mean(1)


def trial_loss_op(
    op: Callable, n: int, specs: Sequence[Spec], reduction: int, ignore_index: int | None,
    target_pos: int, weight_pos: int | None, *args: object,
) -> torch.Tensor:
    """A loss op over folded values as each trial's own loss ``[n]``.

    ``args`` are the op's arguments with ``reduction`` already set to ``none``; the per-sample
    losses are reduced per trial as the op's ``mean`` (``reduction`` 1) or ``sum`` (2) would:
    class-index losses divide by each trial's own count of counted targets (``ignore_index`` and
    class weights), as torch's ``mean`` does.
    """
    expanded = [expand_shared(a, n, s) if s and s[0] == "SB" else a for a, s in zip(args, specs)]
    per = op(*expanded)
    batched = [s for s in (specs[target_pos], specs[0]) if s and s[0] in ("F", "SB")]
    rows = to_trials(per, n, _as_folded(batched[0])).reshape(n, -1)
    if reduction == 2:
        return rows.sum(1)
    target = expanded[target_pos]
    if ignore_index is None or target.is_floating_point():
        return rows.mean(1)
    target = to_trials(target, n, _as_folded(specs[target_pos])).reshape(n, -1)
    counted = target != ignore_index
    weight = expanded[weight_pos] if weight_pos is not None else None
    if weight is not None:
        denom = (weight[target.clamp_min(0)] * counted).sum(1)
    else:
        denom = counted.sum(1).to(rows.dtype)
    return rows.sum(1) / denom


def _as_folded(spec: Spec) -> Spec:
    return ("F", spec[1], spec[2]) if spec and spec[0] == "SB" else spec


def vmap_call(
    op: Callable, n: int, specs: Sequence[Spec], outs: Sequence[Spec], treespec, *leaves
) -> object:
    """Fallback: run the op once per trial under ``torch.func.vmap``, trial dimension leading."""
    mapped = [i for i, s in enumerate(specs) if s and s[0] in ("F", "SB", "T")]
    values = list(leaves)

    def one(*xs: torch.Tensor) -> object:
        vals = list(values)
        for i, x in zip(mapped, xs):
            vals[i] = x
        args, kwargs = tree_unflatten(vals, treespec)
        return op(*args, **kwargs)

    xs = []
    for i in mapped:
        s = specs[i]
        t = to_trials(values[i], n, s)
        xs.append(t.expand(n, *t.shape[1:]) if s[0] == "SB" else t)
    result = torch.func.vmap(one, randomness="different")(*xs)
    flat, spec = tree_flatten(result)
    flat = [settle(y, o) if isinstance(y, torch.Tensor) else y for y, o in zip(flat, outs)]
    return tree_unflatten(flat, spec)
