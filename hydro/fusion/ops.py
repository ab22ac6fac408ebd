"""Fused layers: one module that runs the same layer for ``n`` trials at once.

Layouts. Inside a fused graph every tensor is in one of three layouts (see ``rewrite.py``):

* ``"F"`` (folded): a per-trial batch ``[B, ...]`` of every trial, stacked trial-major into
  ``[n * B, ...]``. Batch-wise user code (``view(B, T, H, D)``, attention, pooling) runs on it
  unchanged because ``B`` simply reads ``n * B``.
* ``"T"`` (trial): a per-trial value with no batch dimension, stacked as ``[n, ...]`` (a parameter,
  an embedding of positions).
* ``"S"`` (shared): one value for every trial, as in the original model (a model input fed to every
  trial, a causal mask, ``arange``). Layers reading it avoid copying it ``n`` times.

A fused layer is called as ``layer(x, layout=...)``. For ``"F"`` and ``"T"`` inputs it returns the
same layout; for an ``"S"`` input it returns a trial-stacked ``[n, ...]`` tensor and the graph
rewrite folds it when the result carries the batch.

Every fused layer holds its parameters and buffers with a leading trial dimension, under the same
names as the layer it replaces, so ``state_dict`` keys match the original model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hydro.errors import FuseError
from hydro.parametrize import Multiplier

Layout = str  # "F", "T" or "S"


def stack_param(tensors: Sequence[torch.Tensor]) -> nn.Parameter:
    """Stack one parameter of every trial into a fused ``[n, ...]`` parameter."""
    stacked = torch.stack([t.detach() for t in tensors]).clone()
    return nn.Parameter(stacked, requires_grad=tensors[0].requires_grad)


def stack_buffer(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Stack one buffer of every trial (``None`` stays ``None``)."""
    if tensors[0] is None:
        return None
    return torch.stack([t.detach() for t in tensors]).clone()


def unfold(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[n * B, ...]`` -> ``[n, B, ...]``."""
    return x.unflatten(0, (n, -1))


def to_channels(x: torch.Tensor, n: int) -> torch.Tensor:
    """Folded ``[n * B, C, ...]`` -> channel-stacked ``[B, n * C, ...]`` for grouped kernels."""
    return x.unflatten(0, (n, -1)).transpose(0, 1).flatten(1, 2)


def from_channels(y: torch.Tensor, n: int) -> torch.Tensor:
    """Channel-stacked ``[B, n * C, ...]`` -> folded ``[n * B, C, ...]``."""
    return y.unflatten(1, (n, -1)).transpose(0, 1).flatten(0, 1)


def per_trial(v: torch.Tensor, ndim: int) -> torch.Tensor:
    """View a ``[n, *s]`` tensor as ``[n, 1, ..., 1, *s]`` with ``ndim`` dimensions in all."""
    return v.view(v.shape[0], *([1] * (ndim - v.dim())), *v.shape[1:])


class _BatchedLinear(torch.autograd.Function):
    """``y[k] = x[k] @ weight[k].T + bias[k]`` for every trial ``k``, as one ``baddbmm``.

    A custom backward only to produce the weight gradient directly in the weight's ``[n, out,
    in]`` layout (``grad.T @ x``); autograd's transpose-of-``x.T @ grad`` would need an extra
    copy of every weight gradient per step.
    """

    @staticmethod
    def forward(ctx, x, weight, bias):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        wt = weight.transpose(1, 2)
        return torch.bmm(x, wt) if bias is None else torch.baddbmm(bias.unsqueeze(1), x, wt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        grad_x = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_w = torch.bmm(grad.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(dim=1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class FusedModule(nn.Module):
    """Base class of fused layers: knows ``n`` and how to drop trials."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def select_trials(self, index: torch.Tensor) -> None:
        """Keep only the trials in ``index`` for state that is not a parameter or buffer."""
        self.n = len(index)

    def trial_attributes(self, k: int) -> dict[str, object]:
        """Per-trial plain attributes (e.g. dropout ``p``) to set on trial ``k``'s module."""
        return {}

    def set_trial_attribute(self, k: int, name: str, value: object) -> None:
        """Set trial ``k``'s plain attribute ``name`` (one of :meth:`trial_attributes`)."""
        raise KeyError(name)


class FusedLinear(FusedModule):
    """``n`` ``nn.Linear`` layers as one batched matmul (``baddbmm``)."""

    def __init__(self, n: int, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__(n)
        self.weight = weight  # [n, out, in]
        self.bias = bias  # [n, out] or None

    @classmethod
    def from_trials(
        cls, mods: Sequence[nn.Linear], param: Callable, buffer: Callable
    ) -> FusedLinear:
        return cls(len(mods), param("weight"), param("bias"))

    def forward(self, x: torch.Tensor, layout: Layout = "F") -> torch.Tensor:
        return trial_linear(x, self.weight, self.bias, layout=layout)


def trial_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: Layout = "F"
) -> torch.Tensor:
    """``F.linear`` with per-trial ``weight[n, out, in]`` and ``bias[n, out]``.

    Also what the rewrite calls for a functional ``F.linear(x, w)`` whose weight is per trial
    (e.g. an output head tied to an embedding table).
    """
    n, out_f, in_f = weight.shape
    if layout == "S":
        # One GEMM against all trials' weights side by side: x is read once, not n times.
        w = weight.reshape(n * out_f, in_f)
        y = F.linear(x, w, None if bias is None else bias.reshape(-1))
        return y.unflatten(-1, (n, out_f)).movedim(-2, 0)
    y = _BatchedLinear.apply(x.reshape(n, -1, in_f), weight, bias)
    return y.view(*x.shape[:-1], out_f)


_CONV_FN = {
    (False, 1): F.conv1d,
    (False, 2): F.conv2d,
    (False, 3): F.conv3d,
    (True, 1): F.conv_transpose1d,
    (True, 2): F.conv_transpose2d,
    (True, 3): F.conv_transpose3d,
}


class FusedConv(FusedModule):
    """``n`` convolutions (1d/2d/3d, grouped, transposed) as one grouped convolution.

    Trial ``k``'s channels become group block ``k`` of a convolution with ``n * groups`` groups.
    """

    def __init__(self, n: int, template: nn.modules.conv._ConvNd, weight, bias) -> None:
        super().__init__(n)
        self.weight, self.bias = weight, bias
        self.transposed = template.transposed
        self.dims = len(template.kernel_size)
        self.stride, self.padding = template.stride, template.padding
        self.dilation, self.groups = template.dilation, template.groups
        self.output_padding = template.output_padding
        self.padding_mode = template.padding_mode
        self.pre_pad = getattr(template, "_reversed_padding_repeated_twice", None)

    @classmethod
    def from_trials(cls, mods, param: Callable, buffer: Callable) -> FusedConv:
        return cls(len(mods), mods[0], param("weight"), param("bias"))

    def _conv(self, x: torch.Tensor, weight: torch.Tensor, bias, groups: int) -> torch.Tensor:
        fn = _CONV_FN[(self.transposed, self.dims)]
        if self.transposed:
            return fn(
                x, weight, bias, self.stride, self.padding, self.output_padding, groups,
                self.dilation,
            )  # fmt: skip
        padding = self.padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self.pre_pad, mode=self.padding_mode)
            padding = 0
        return fn(x, weight, bias, self.stride, padding, self.dilation, groups)

    def forward(self, x: torch.Tensor, layout: Layout = "F") -> torch.Tensor:
        n = self.n
        w = self.weight.flatten(0, 1)
        b = None if self.bias is None else self.bias.flatten()
        if layout == "S" and self.groups == 1 and not self.transposed:
            # All trials' filters as one convolution over the shared input.
            y = self._conv(x, w, b, 1)
            return y.unflatten(1, (n, -1)).movedim(1, 0)
        if layout == "S":
            x = x.unsqueeze(0).expand(n, *x.shape).flatten(0, 1)
        y = self._conv(to_channels(x, n), w, b, n * self.groups)
        out = from_channels(y, n)
        return unfold(out, n) if layout == "S" else out


class FusedBatchNorm(FusedModule):
    """``n`` BatchNorm layers: per-trial affine parameters and running statistics."""

    def __init__(self, n: int, template: nn.modules.batchnorm._BatchNorm, param, buffer) -> None:
        super().__init__(n)
        self.weight, self.bias = param("weight"), param("bias")
        self.register_buffer("running_mean", buffer("running_mean"))
        self.register_buffer("running_var", buffer("running_var"))
        self.register_buffer("num_batches_tracked", buffer("num_batches_tracked"))
        self.momentum, self.eps = template.momentum, template.eps
        self.track_running_stats = template.track_running_stats

    @classmethod
    def from_trials(cls, mods, param: Callable, buffer: Callable) -> FusedBatchNorm:
        return cls(len(mods), mods[0], param, buffer)

    def forward(self, x: torch.Tensor, layout: Layout = "F") -> torch.Tensor:
        n = self.n
        if layout == "S":
            x = x.unsqueeze(0).expand(n, *x.shape).flatten(0, 1)
        factor = 0.0
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as nn.BatchNorm
                factor = 1.0 / float(self.num_batches_tracked.max())
            else:
                factor = self.momentum
        elif self.momentum is not None:
            factor = self.momentum
        use_batch_stats = self.training or self.running_mean is None
        keep_stats = not self.training or self.track_running_stats

        def flat(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.view(-1)  # a view: updates land in the buffer

        y = F.batch_norm(
            to_channels(x, n),
            flat(self.running_mean) if keep_stats else None,
            flat(self.running_var) if keep_stats else None,
            flat(self.weight),
            flat(self.bias),
            use_batch_stats,
            factor,
            self.eps,
        )
        out = from_channels(y, n)
        return unfold(out, n) if layout == "S" else out


class FusedLayerNorm(FusedModule):
    """``n`` LayerNorm layers: normalize once, then apply each trial's affine transform."""

    def __init__(self, n: int, template: nn.LayerNorm, param: Callable) -> None:
        super().__init__(n)
        self.normalized_shape = tuple(template.normalized_shape)
        self.eps = template.eps
        self.weight, self.bias = param("weight"), param("bias")

    @classmethod
    def from_trials(cls, mods, param: Callable, buffer: Callable) -> FusedLayerNorm:
        return cls(len(mods), mods[0], param)

    def forward(self, x: torch.Tensor, layout: Layout = "F") -> torch.Tensor:
        y = F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        if self.weight is None and self.bias is None:
            return y.unsqueeze(0).expand(self.n, *y.shape) if layout == "S" else y
        # Give y a trial dimension: shared -> [1, ...] (broadcast), folded -> [n, B, ...].
        yt = y.unsqueeze(0) if layout == "S" else (unfold(y, self.n) if layout == "F" else y)
        if self.weight is not None:
            yt = yt * per_trial(self.weight, yt.dim())
        if self.bias is not None:
            yt = yt + per_trial(self.bias, yt.dim())
        return yt.flatten(0, 1) if layout == "F" else yt


class FusedGroupNorm(FusedModule):
    """``n`` GroupNorm layers: per-sample statistics, per-trial affine parameters."""

    def __init__(self, n: int, template: nn.GroupNorm, param: Callable) -> None:
        super().__init__(n)
        self.num_groups, self.eps = template.num_groups, template.eps
        self.weight, self.bias = param("weight"), param("bias")

    @classmethod
    def from_trials(cls, mods, param: Callable, buffer: Callable) -> FusedGroupNorm:
        return cls(len(mods), mods[0], param)

    def forward(self, x: torch.Tensor, layout: Layout = "F") -> torch.Tensor:
        y = F.group_norm(x, self.num_groups, None, None, self.eps)
        # [n, B, C, *spatial]; shared input -> [1, B, C, ...] broadcast over trials.
        yt = y.unsqueeze(0) if layout == "S" else unfold(y, self.n)
        shape = (self.n, 1, -1) + (1,) * (y.dim() - 2)
        if self.weight is not None:
            yt = yt * self.weight.view(shape)
        if self.bias is not None:
            yt = yt + self.bias.view(shape)
        return yt if layout == "S" else yt.flatten(0, 1)


class FusedEmbedding(FusedModule):
    """``n`` embedding tables, looked up as one table with per-trial row offsets."""

    def __init__(self, n: int, template: nn.Embedding, param: Callable) -> None:
        super().__init__(n)
        if template.max_norm is not None or template.scale_grad_by_freq or template.sparse:
            raise FuseError(
                "nn.Embedding with max_norm, scale_grad_by_freq or sparse=True has no fused form; "
                "use a plain embedding"
            )
        self.weight = param("weight")  # [n, V, D]
        self.padding_idx = template.padding_idx

    @classmethod
    def from_trials(cls, mods, param: Callable, buffer: Callable) -> FusedEmbedding:
        return cls(len(mods), mods[0], param)

    def forward(self, ids: torch.Tensor, layout: Layout = "F") -> torch.Tensor:
        n, vocab = self.n, self.weight.shape[1]
        offsets = torch.arange(n, device=ids.device) * vocab
        if layout == "S":
            trial_ids = ids.unsqueeze(0) + per_trial(offsets, ids.dim() + 1)
        elif layout == "F":
            trial_ids = unfold(ids, n) + per_trial(offsets, ids.dim() + 1)
        else:
            trial_ids = ids + per_trial(offsets, ids.dim())
        out = F.embedding(trial_ids, self.weight.flatten(0, 1))
        if self.padding_idx is not None:
            # As nn.Embedding: the padding row reads normally but receives no gradient.
            pad = trial_ids - per_trial(offsets, trial_ids.dim()) == self.padding_idx
            out = torch.where(pad.unsqueeze(-1), out.detach(), out)
        return out.flatten(0, 1) if layout == "F" else out


def _dropout(x: torch.Tensor, p: torch.Tensor, n: int, training: bool) -> torch.Tensor:
    """Dropout with a per-trial rate ``p[n]`` on a folded or trial-stacked tensor."""
    if not training:
        return x
    keep = 1.0 - p.to(x.dtype)
    shape = (n,) + (1,) * x.dim()
    xt = unfold(x, n)
    mask = torch.rand_like(xt) < keep.view(shape)
    scale = torch.where(keep > 0, 1.0 / keep.clamp_min(1e-12), torch.zeros_like(keep))
    return (xt * mask * scale.view(shape)).flatten(0, 1)


class FusedDropout(FusedModule):
    """``n`` dropout layers with independent masks and a per-trial drop probability ``p``."""

    def __init__(self, n: int, p: Sequence[float]) -> None:
        super().__init__(n)
        self.register_buffer("p", torch.tensor(list(p), dtype=torch.float64), persistent=False)

    @classmethod
    def from_trials(cls, mods, param: Callable, buffer: Callable) -> FusedDropout:
        if any(m.inplace for m in mods):
            raise FuseError("nn.Dropout(inplace=True) cannot be fused; use inplace=False")
        return cls(len(mods), [m.p for m in mods])

    def trial_attributes(self, k: int) -> dict[str, object]:
        return {"p": float(self.p[k])}

    def set_trial_attribute(self, k: int, name: str, value: object) -> None:
        self.p[k] = float(value)

    def forward(self, x: torch.Tensor, layout: Layout = "F") -> torch.Tensor:
        if layout == "S":
            x = x.unsqueeze(0).expand(self.n, *x.shape).flatten(0, 1)
        if not self.training or bool((self.p == self.p[0]).all()):
            # One rate: plain dropout over the folded tensor already draws independent masks.
            out = F.dropout(x, float(self.p[0]), self.training)
        else:
            out = _dropout(x, self.p, self.n, self.training)
        return unfold(out, self.n) if layout == "S" else out


class FusedMultiplier(FusedModule):
    """``n`` muP multipliers (:class:`hydro.parametrize.Multiplier`), one ``scale`` per trial."""

    def __init__(self, n: int, scale: Sequence[float]) -> None:
        super().__init__(n)
        self.register_buffer("scale", torch.tensor(list(scale), dtype=torch.float64),
                             persistent=False)  # fmt: skip

    @classmethod
    def from_trials(cls, mods, param: Callable, buffer: Callable) -> FusedMultiplier:
        return cls(len(mods), [m.scale for m in mods])

    def trial_attributes(self, k: int) -> dict[str, object]:
        return {"scale": float(self.scale[k])}

    def set_trial_attribute(self, k: int, name: str, value: object) -> None:
        self.scale[k] = float(value)

    def forward(self, x: torch.Tensor, layout: Layout = "F") -> torch.Tensor:
        if bool((self.scale == self.scale[0]).all()):
            out = x * float(self.scale[0])  # one value: exactly the original module's op
            return out.unsqueeze(0).expand(self.n, *out.shape) if layout == "S" else out
        if layout == "S":
            x = x.unsqueeze(0).expand(self.n, *x.shape)
        trials = x if layout in ("S", "T") else unfold(x, self.n)
        # a float32 tensor times a Python float rounds the float to float32 first: so here
        scale = self.scale.to(x.dtype).view(self.n, *([1] * (trials.dim() - 1)))
        out = trials * scale
        return out if layout in ("S", "T") else out.flatten(0, 1)


class _FusedOutProj(nn.Module):
    """Holds ``out_proj.weight``/``out_proj.bias`` so that state_dict keys match."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias


class FusedMultiheadAttention(FusedModule):
    """``n`` ``nn.MultiheadAttention`` layers (``batch_first=True``), batched over trials.

    Projections run as batched matmuls; attention itself runs on the folded ``[n * B, heads, ...]``
    tensor, through ``scaled_dot_product_attention`` unless attention weights are requested.
    """

    def __init__(self, n: int, template: nn.MultiheadAttention, param: Callable, p) -> None:
        super().__init__(n)
        if not template.batch_first:
            raise FuseError(
                "nn.MultiheadAttention(batch_first=False) cannot be fused: the batch must be the "
                "leading dimension; build it with batch_first=True"
            )
        if not template._qkv_same_embed_dim or template.bias_k is not None:
            raise FuseError(
                "nn.MultiheadAttention with kdim/vdim != embed_dim or add_bias_kv has no fused form"
            )
        if template.add_zero_attn:
            raise FuseError("nn.MultiheadAttention(add_zero_attn=True) has no fused form")
        self.num_heads, self.embed_dim = template.num_heads, template.embed_dim
        self.in_proj_weight, self.in_proj_bias = param("in_proj_weight"), param("in_proj_bias")
        self.out_proj = _FusedOutProj(param("out_proj.weight"), param("out_proj.bias"))
        self.register_buffer("p", torch.tensor(list(p), dtype=torch.float64), persistent=False)

    @classmethod
    def from_trials(cls, mods, param: Callable, buffer: Callable) -> FusedMultiheadAttention:
        return cls(len(mods), mods[0], param, [m.dropout for m in mods])

    def trial_attributes(self, k: int) -> dict[str, object]:
        return {"dropout": float(self.p[k])}

    def set_trial_attribute(self, k: int, name: str, value: object) -> None:
        self.p[k] = float(value)

    def _project(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        x3 = x.reshape(self.n, -1, x.shape[-1])
        y = (
            torch.bmm(x3, w.transpose(1, 2))
            if b is None
            else torch.baddbmm(b, x3, w.transpose(1, 2))
        )
        return y.view(*x.shape[:-1], w.shape[1])

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        layout: Layout = "F",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if layout != "F":
            raise FuseError("fused MultiheadAttention expects batched inputs")
        e, h = self.embed_dim, self.num_heads
        w, b = self.in_proj_weight, self.in_proj_bias
        bias = [None] * 3 if b is None else [c.unsqueeze(1) for c in b.chunk(3, dim=1)]
        if query is key and key is value:
            qkv = self._project(query, w, None if b is None else b.unsqueeze(1))
            q, k, v = qkv.chunk(3, dim=-1)
        else:
            ws = w.chunk(3, dim=1)
            q, k, v = (self._project(t, ws[i], bias[i]) for i, t in enumerate((query, key, value)))
        nb, tq, tk = q.shape[0], q.shape[1], k.shape[1]
        q, k, v = (t.reshape(nb, -1, h, e // h).transpose(1, 2) for t in (q, k, v))

        mask = _merge_masks(attn_mask, key_padding_mask, nb, h, tq, tk, q.dtype)
        p_all = self.p if self.training else torch.zeros_like(self.p)
        one_rate = bool((p_all == p_all[0]).all())
        weights = None
        if not need_weights and one_rate:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=float(p_all[0]),
                is_causal=is_causal and mask is None,
            )  # fmt: skip
        else:
            if is_causal and mask is None:
                raise FuseError("is_causal=True needs an attn_mask when attention weights are used")
            scores = (q * (e // h) ** -0.5) @ k.transpose(-2, -1)
            if mask is not None:
                scores = scores + mask
            att = F.softmax(scores, dim=-1)
            weights = att.mean(dim=1) if average_attn_weights else att
            if self.training and bool((p_all > 0).any()):
                att = _dropout(att, p_all, self.n, True)
            y = att @ v
        y = y.transpose(1, 2).reshape(nb, tq, e)
        out = self._project(y, self.out_proj.weight, self._out_bias())
        return out, (weights if need_weights else None)

    def _out_bias(self) -> torch.Tensor | None:
        return None if self.out_proj.bias is None else self.out_proj.bias.unsqueeze(1)


def _merge_masks(attn_mask, key_padding_mask, nb, heads, tq, tk, dtype):
    """One additive float mask ``[nb, heads, tq, tk]`` (broadcastable), as MultiheadAttention."""

    def as_float(m: torch.Tensor) -> torch.Tensor:
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
        return m.to(dtype)

    mask = None
    if attn_mask is not None:
        m = as_float(attn_mask)
        mask = m if m.dim() == 2 else m.view(nb, heads, tq, tk)
    if key_padding_mask is not None:
        kpm = as_float(key_padding_mask).view(nb, 1, 1, tk)
        mask = kpm if mask is None else mask + kpm
    return mask


# Module type -> fused class. Subclasses match too (e.g. NonDynamicallyQuantizableLinear).
FUSED_LAYERS: list[tuple[type[nn.Module], type[FusedModule]]] = [
    (nn.Linear, FusedLinear),
    (nn.modules.conv._ConvNd, FusedConv),
    (nn.modules.batchnorm._BatchNorm, FusedBatchNorm),
    (nn.LayerNorm, FusedLayerNorm),
    (nn.GroupNorm, FusedGroupNorm),
    (nn.Embedding, FusedEmbedding),
    (nn.MultiheadAttention, FusedMultiheadAttention),
    (nn.Dropout, FusedDropout),
    (Multiplier, FusedMultiplier),
]


def fused_class(module: nn.Module) -> type[FusedModule] | None:
    """The fused class for ``module``'s type, or ``None`` when it has none."""
    for kind, cls in FUSED_LAYERS:
        if type(module) is kind or (isinstance(module, kind) and kind is not nn.Dropout):
            return cls
    return None
