"""The channel-stacked layout: activations stay ``[B, n * C, H, W]`` between convolutions.

A fused CNN converts between the folded layout ``[n * B, C, H, W]`` and the channel-stacked one
only where an op needs the folded value (the flatten before the classifier), never between two
convolutions; and a residual CNN whose channel-wise ops all run stacked (BatchNorm, GroupNorm,
pointwise ops with per-trial and shared per-channel operands, in-place residual adds, pooling,
padding, upsampling, an SE gate, a channels-last LayerNorm) trains exactly like separate models.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hydro.fusion import fuse, ops
from tests import zoo
from tests.fusion.exactness import build, train_and_compare
from tests.real_models import build as build_real
from tests.real_models import timm_available

CONVERSIONS = (ops.to_channels, ops.from_channels, ops.shared_to_channels)
CHANNEL_OPS = (ops.trial_conv, ops.trial_batch_norm, ops.trial_group_norm)


class StackedNet(nn.Module):
    """Every op between the stem and the pooling before the head works per channel."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(width)
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, groups=2)
        self.bn2 = nn.BatchNorm2d(width)
        self.scale = nn.Parameter(torch.rand(width, 1, 1) + 0.5)  # per trial, per channel
        # shared (equal in every trial, never written), per channel
        self.register_buffer("shift", torch.linspace(-0.2, 0.2, width).view(width, 1, 1))
        self.se = nn.Conv2d(width, width, 1)
        self.gn = nn.GroupNorm(2, width)
        self.ln = nn.LayerNorm(width)
        self.down = nn.Conv2d(width, 2 * width, 1, stride=2)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        x = F.relu(self.bn0(self.stem(x)))
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h)) * self.scale + self.shift
        h += x  # residual, in place
        x = F.relu_(h)
        x = x * torch.sigmoid(self.se(x.mean((2, 3), keepdim=True)))  # squeeze-excite gate
        x = F.max_pool2d(F.pad(x, (1, 1, 1, 1)), 2)
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        x = F.silu(self.gn(x))
        x = self.ln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # channels-last norm
        x = self.up(F.avg_pool2d(self.down(x), 1))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def stacked_net(seed: int = 0, batch: int = 3) -> zoo.Case:
    g = torch.Generator().manual_seed(seed + 1000)
    torch.manual_seed(seed)
    x = torch.randn(batch, 3, 8, 8, generator=g)
    return zoo.Case(StackedNet(), (x,), torch.randint(0, 5, (batch,), generator=g), F.cross_entropy)


def _graph(fused, *inputs) -> torch.fx.Graph:
    fused(*inputs)
    (gm,) = fused._graphs.values()
    return gm.graph


def _calls(graph: torch.fx.Graph, fns: tuple) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target in fns]


def _assert_stacked_between_channel_ops(graph: torch.fx.Graph) -> None:
    """No channel op reads a converted value, and the only conversion is the last one."""
    convs = _calls(graph, CHANNEL_OPS)
    assert convs
    for node in convs:
        for a in node.all_input_nodes:
            assert a.target not in CONVERSIONS, f"{node.name} reads a layout conversion {a.name}"
    conversions = _calls(graph, CONVERSIONS)
    assert [c.target for c in conversions] == [ops.from_channels], conversions
    # ... and that one feeds the classifier, after every convolution
    order = {node: i for i, node in enumerate(graph.nodes)}
    assert order[conversions[0]] > max(order[c] for c in convs)


def test_resnet_converts_once_before_the_head() -> None:
    case = zoo.ZOO["resnet"](width=8, batch=4)
    graph = _graph(fuse(case.model, n=3), *case.inputs)
    _assert_stacked_between_channel_ops(graph)


def test_stacked_net_graph_has_one_conversion() -> None:
    case = stacked_net()
    graph = _graph(fuse(case.model, n=3), *case.inputs)
    _assert_stacked_between_channel_ops(graph)
    assert _calls(graph, (ops.stacked_pointwise,))  # the per-trial scale and shared shift
    assert _calls(graph, (ops.stacked_layer_norm,))
    assert not fuse(case.model, n=2).fallbacks


def test_dispatched_ops_have_no_transposes_between_convolutions() -> None:
    """Counted at the ATen level: the forward's layout moves do not grow with the depth."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.moves = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.permute.default, torch.ops.aten.transpose.int):
                self.moves += 1
            return func(*args, **(kwargs or {}))

    def moves(depth: int) -> int:
        layers = [nn.Conv2d(3, 8, 3, padding=1)]
        for _ in range(depth):
            layers += [nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)]
        model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
        fused = fuse(model, n=4)
        x = torch.randn(2, 3, 6, 6)
        fused(x)
        with Count() as count:
            fused(x)
        return count.moves

    assert moves(1) == moves(4)


@pytest.fixture
def stacked_zoo(monkeypatch):
    monkeypatch.setitem(zoo.ZOO, "stacked", stacked_net)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_stacked_residual_cnn_exact(stacked_zoo, opt: str) -> None:
    run, cases = build("stacked", 3, opt)
    train_and_compare(run, cases, steps=3, shared=True)


def test_stacked_residual_cnn_exact_per_trial_batches(stacked_zoo) -> None:
    run, cases = build("stacked", 3, "sgd")
    train_and_compare(run, cases, steps=2, shared=False)


class SkipNet(nn.Module):
    """U-Net and DenseNet joins: a skip connection concatenated along the channels after an
    upsampling, and features concatenated with the input of their block."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.down = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.fuse = nn.Conv2d(2 * width, width, 3, padding=1)  # reads cat([skip, up])
        self.dense = nn.Conv2d(width, width, 1)
        self.head = nn.Linear(2 * width, 5)

    def forward(self, x):
        skip = F.relu(self.bn(self.stem(x)))
        h = self.up(F.relu(self.down(skip)))
        h = F.relu(self.fuse(torch.cat([skip, h], dim=1)))
        h = torch.cat([h, self.dense(h)], 1)  # dense connection
        h = torch.cat([h[:, :, :2], h[:, :, 2:]], dim=2)  # along a spatial dimension
        return self.head(h.mean((2, 3)))


def skip_net(seed: int = 0, batch: int = 3) -> zoo.Case:
    g = torch.Generator().manual_seed(seed + 2000)
    torch.manual_seed(seed)
    x = torch.randn(batch, 3, 8, 8, generator=g)
    return zoo.Case(SkipNet(), (x,), torch.randint(0, 5, (batch,), generator=g), F.cross_entropy)


def test_channel_concatenation_stays_stacked(monkeypatch) -> None:
    case = skip_net()
    graph = _graph(fuse(case.model, n=3), *case.inputs)
    assert len(_calls(graph, (ops.stacked_cat,))) == 2
    assert [c.target for c in _calls(graph, CONVERSIONS)] == [ops.from_channels]
    monkeypatch.setitem(zoo.ZOO, "skip", skip_net)
    for opt in ("sgd", "adamw"):
        run, cases = build("skip", 3, opt)
        train_and_compare(run, cases, steps=3, shared=True)
    run, cases = build("skip", 3, "sgd")
    train_and_compare(run, cases, steps=2, shared=False)


class WrittenAfterView(nn.Module):
    """A stacked value read folded (a view) and then written in place: the view sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 16, 3)

    def forward(self, x):
        h = self.bn(self.conv(x))
        flat = h.view(h.shape[0], -1)  # a view of h, before the write
        h.mul_(2.0)
        return self.head(flat) + h.mean((2, 3)).sum(1, keepdim=True)


def test_in_place_write_reaches_a_folded_view() -> None:
    models = []
    for k in range(3):
        torch.manual_seed(k)
        models.append(WrittenAfterView().double())
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    fused = fuse([m for m in models])
    out = fused(x)
    for k, m in enumerate(models):
        torch.testing.assert_close(out[k], m(x), rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not timm_available(), reason="timm needs an importable torchvision")
@pytest.mark.parametrize("name", ["timm_resnet18", "timm_convnext_atto"])
def test_timm_cnns_convert_once(name: str) -> None:
    model, make = build_real(name)
    args, kwargs = make(2, torch.Generator().manual_seed(0))
    fused = fuse(model, n=2)
    fused(*args, **kwargs)
    (gm,) = fused._graphs.values()
    _assert_stacked_between_channel_ops(gm.graph)


@pytest.mark.parametrize(
    "shape",
    [
        # (C_in, C_out, kernel, stride, padding, dilation, H, W, runs as a GEMM)
        (3, 5, 1, 1, 0, 1, 6, 5, True),
        (4, 6, 1, 2, 0, 1, 7, 7, True),
        (4, 6, 3, 1, 1, 1, 4, 3, True),
        (3, 4, 3, 2, 1, 1, 5, 5, True),
        (2, 3, 3, 1, 2, 2, 2, 2, True),
        (3, 4, 3, 1, 1, 1, 9, 9, False),
    ],
)
def test_trial_conv_forms_equal_per_trial_convolutions(shape: tuple) -> None:
    c_in, c_out, k, stride, pad, dil, h, w, gemm = shape
    n, b = 3, 2
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(n, b, c_in, h, w, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(n, c_out, c_in, k, k, dtype=torch.float64, generator=g,
                         requires_grad=True)
    bias = torch.randn(n, c_out, dtype=torch.float64, generator=g, requires_grad=True)
    stacked = ops.to_channels(xs.flatten(0, 1), n)
    y = ops.trial_conv(2, stacked, weight, bias, [stride] * 2, [pad] * 2, [dil] * 2, 1, n, False)
    expected = torch.stack([
        F.conv2d(xs[t], weight[t], bias[t], stride, pad, dil) for t in range(n)
    ])
    got = ops.from_channels(y, n).unflatten(0, (n, b))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    (got * expected.detach().cos()).sum().backward()
    grads = [t.grad.clone() for t in (xs, weight, bias)]
    for t in (xs, weight, bias):
        t.grad = None
    (expected * expected.detach().cos()).sum().backward()
    for got_grad, t in zip(grads, (xs, weight, bias)):
        torch.testing.assert_close(got_grad, t.grad, rtol=1e-12, atol=1e-12)
    uses_gemm = ops.conv_as_bmm(stacked, weight, [stride] * 2, [pad] * 2, [dil] * 2)
    assert uses_gemm == gemm
