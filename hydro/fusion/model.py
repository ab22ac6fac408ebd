"""``FusedModel``: n trials of one architecture trained as one module, and ``trial_loss``."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from hydro.errors import FuseError
from hydro.fusion.ops import FusedModule, fused_class, stack_buffer, stack_param
from hydro.fusion.rewrite import batch_facts, fuse_graph
from hydro.fx import trace
from hydro.fx.paths import get_path, has_path


def _set_path(root: nn.Module, path: str, value: object, buffer: bool = False) -> None:
    """Register ``value`` (module, parameter or buffer) at a dotted ``path``, making containers."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        if not hasattr(node, name):
            node.add_module(name, nn.Module())
        node = getattr(node, name)
    if buffer:
        node.register_buffer(leaf, value)
    else:
        setattr(node, leaf, value)


class FusedModel(nn.Module):
    """``n`` trials of one architecture, trained together as one module.

    Every parameter and buffer has a leading trial dimension ``[n, ...]`` and the same name as in
    the original model. Build it with :func:`fuse`.

    Call it as ``fused(x)`` with inputs shaped for one model (the same batch for every trial) or
    ``fused(xs, shared=False)`` with ``xs[n, ...]`` (each trial its own batch); every output gets
    a leading ``[n, ...]``.

    Example:
        >>> import torch
        >>> from hydro.fusion import fuse
        >>> fused = fuse(torch.nn.Linear(3, 2), n=4)
        >>> fused(torch.randn(5, 3)).shape
        torch.Size([4, 5, 2])
        >>> fused.trial(1).weight.shape
        torch.Size([2, 3])
    """

    def __init__(self, models: Sequence[nn.Module]) -> None:
        super().__init__()
        if not models:
            raise FuseError("fuse() needs at least one model")
        original = copy.deepcopy(models[0])
        template = trace(copy.deepcopy(models[0]))
        _check_same_architecture(models)
        sources = list(models)
        n = len(models)
        # Kept out of the module tree: the traced graph, and the module that trial(k) copies.
        object.__setattr__(self, "_template", template)
        object.__setattr__(self, "_original", original)
        self._graphs: dict[tuple, torch.fx.GraphModule] = {}

        # One fused parameter per distinct source parameter: ties (a shared embedding) survive.
        params: dict[str, nn.Parameter] = {}
        canonical: dict[int, nn.Parameter] = {}
        for name, p in original.named_parameters(remove_duplicate=False):
            if id(p) not in canonical:
                trials = [m.get_parameter(name) for m in sources]
                fused = stack_param(trials)
                if hasattr(trials[0], "infshape"):
                    fused.infshape = trials[0].infshape  # muP metadata for hydro.optim
                canonical[id(p)] = fused
            params[name] = canonical[id(p)]

        def param_of(prefix: str) -> Callable[[str], nn.Parameter | None]:
            return lambda name: params.get(f"{prefix}.{name}")

        def buffer_of(prefix: str) -> Callable[[str], torch.Tensor | None]:
            return lambda name: stack_buffer([m.get_buffer(f"{prefix}.{name}") for m in sources])

        self.fused_layers: dict[str, FusedModule] = {}
        covered: set[str] = set()
        for node in template.graph.nodes:
            if node.op != "call_module" or node.target in self.fused_layers:
                continue
            module = template.get_submodule(node.target)
            cls = fused_class(module)
            if cls is None:
                continue
            mods = [m.get_submodule(node.target) for m in sources]
            layer = cls.from_trials(mods, param_of(node.target), buffer_of(node.target))
            _set_path(self, node.target, layer)
            self.fused_layers[node.target] = layer
            covered.update(f"{node.target}.{k}" for k in module.state_dict(keep_vars=True))

        # Everything else (get_attr tensors, unused weights) is stacked under its own name.
        self.shared_tensors: set[str] = set()
        for name, p in params.items():
            if name not in covered:
                _set_path(self, name, p)
        constants = any(
            node.op == "get_attr" and not has_path(original, node.target)
            for node in template.graph.nodes
        )
        for name, _ in original.named_buffers(remove_duplicate=False):
            if name in covered:
                continue
            trials = [m.get_buffer(name) for m in sources]
            _set_path(self, name, stack_buffer(trials), buffer=True)
            if all(torch.equal(t, trials[0]) for t in trials):
                self.shared_tensors.add(name)  # e.g. a causal mask: read once, not per trial
            elif constants:
                raise FuseError(
                    f"buffer '{name}' differs between the models, but the traced graph reads "
                    "buffers as constants (trial 0's values); make it equal in every model or "
                    "a parameter with requires_grad=False"
                )
        self.register_buffer("diverged", torch.zeros(n, dtype=torch.bool))
        for p in self.parameters():
            p.hydro_diverged = self.diverged  # lets hydro.optim freeze diverged trials

    @property
    def n(self) -> int:
        """The number of trials."""
        return int(self.diverged.shape[0])

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module signature
        out = super()._apply(fn, recurse)
        # The unregistered copies follow (dtype, device), for shape propagation and trial(k).
        self._template._apply(fn, recurse)
        self._original._apply(fn, recurse)
        self._graphs.clear()  # buffers may have been replaced
        for p in self.parameters():
            p.hydro_diverged = self.diverged
        return out

    def _graph_for(self, args: tuple, shared: bool) -> torch.fx.GraphModule:
        key = (shared, tuple(a.dim() if isinstance(a, torch.Tensor) else None for a in args))
        if key not in self._graphs:
            one = (
                args if shared else tuple(a[0] if isinstance(a, torch.Tensor) else a for a in args)
            )
            facts = batch_facts(self._template, one)
            # Every weight the graph reads directly (a tied head reads a fused layer's weight too).
            targets = [n.target for n in self._template.graph.nodes if n.op == "get_attr"]
            tensors = {t: get_path(self, t) for t in targets if has_path(self, t)}
            self._graphs[key] = fuse_graph(
                self._template, facts, self.n, shared, self.fused_layers, tensors,
                self.shared_tensors,
            )  # fmt: skip
        return self._graphs[key]

    def forward(self, *args: object, shared: bool = True, **kwargs: object) -> object:
        """Run every trial. ``shared=False``: each input carries a leading ``n`` (own batches)."""
        placeholders = [n for n in self._template.graph.nodes if n.op == "placeholder"]
        bound = list(args)
        for node in placeholders[len(args) :]:
            if node.target in kwargs:
                bound.append(kwargs.pop(node.target))
            elif node.args:
                bound.append(node.args[0])
            else:
                raise TypeError(f"missing input '{node.target}'")
        if kwargs:
            raise TypeError(f"unexpected inputs {sorted(kwargs)}")
        if not shared:
            for a in bound:
                if isinstance(a, torch.Tensor) and a.shape[0] != self.n:
                    raise ValueError(
                        f"shared=False expects inputs with a leading trial dimension of {self.n}, "
                        f"got shape {tuple(a.shape)}"
                    )
        gm = self._graph_for(tuple(bound), shared)
        frozen = self.diverged.nonzero().flatten() if bool(self.diverged.any()) else None
        if frozen is None:
            return gm(*bound)
        # A diverged trial is frozen: undo what this forward did to its buffers (BatchNorm stats).
        saved = [(b, b[frozen].clone()) for b in self.buffers() if b is not self.diverged]
        out = gm(*bound)
        for b, old in saved:
            # Through .data: autograd saved these buffers (BatchNorm's backward takes them) and
            # must not see a version bump; the trials it differentiates are untouched anyway.
            b.data[frozen] = old
        return out

    # --- trials in and out ------------------------------------------------------------------

    def trial(self, k: int) -> nn.Module:
        """Trial ``k`` as a standalone module of the original architecture (a copy).

        Its ``state_dict`` has the same keys as the original model's; muP ``infshape`` metadata
        and per-trial dropout probabilities come along.
        """
        k = self._check_index(k)
        module = copy.deepcopy(self._original)
        module.load_state_dict(
            {name: t[k] for name, t in self.state_dict().items() if name != "diverged"}
        )
        src = dict(self.named_parameters(remove_duplicate=False))
        for name, p in module.named_parameters(remove_duplicate=False):
            if hasattr(src[name], "infshape"):
                p.infshape = src[name].infshape
        for path, layer in self.fused_layers.items():
            for attr, value in layer.trial_attributes(k).items():
                setattr(module.get_submodule(path), attr, value)
        module.train(self.training)
        return module

    def load_trial(self, k: int, module: nn.Module) -> None:
        """Overwrite trial ``k``'s weights and buffers with ``module``'s (same architecture)."""
        k = self._check_index(k)
        mine = self.state_dict(keep_vars=True)
        theirs = module.state_dict()
        missing = set(mine) - {"diverged"} - set(theirs)
        if missing or set(theirs) - set(mine):
            raise FuseError(
                f"load_trial: the module's state_dict keys differ from the fused model's "
                f"(missing {sorted(missing)[:5]}, unexpected {sorted(set(theirs) - set(mine))[:5]})"
            )
        with torch.no_grad():
            for name, value in theirs.items():
                mine[name][k].copy_(value)
        for path, layer in self.fused_layers.items():
            source = module.get_submodule(path)
            for attr in layer.trial_attributes(k):
                layer.set_trial_attribute(k, attr, getattr(source, attr))
        self.diverged[k] = False

    def select(self, indices: Sequence[int] | torch.Tensor) -> FusedModel:
        """Keep only the trials ``indices`` (in that order), in place, and return ``self``.

        Parameters keep their identity (only their data shrinks), so an optimizer over them stays
        valid after ``opt.select(indices)`` with the same indices. Call it between steps, once the
        last step's outputs and losses are gone (``del out, loss``): autograd keeps the old
        parameter shapes for as long as a graph that used them is alive.
        """
        index = torch.as_tensor(list(indices) if not torch.is_tensor(indices) else indices)
        index = index.to(torch.long)
        for i in index.tolist():
            self._check_index(i)
        with torch.no_grad():
            for p in self.parameters():
                grad = p.grad
                p.data = p.data[index.to(p.device)]
                if grad is not None:
                    p.grad = grad[index.to(p.device)]
            for b in self.buffers():
                b.data = b.data[index.to(b.device)]
        for layer in self.fused_layers.values():
            layer.select_trials(index)
        self._graphs.clear()
        return self

    def _check_index(self, k: int) -> int:
        if not -self.n <= k < self.n:
            raise IndexError(f"trial {k} out of range for {self.n} fused trials")
        return k % self.n


def _check_same_architecture(models: Sequence[nn.Module]) -> None:
    ref = models[0]
    # By name: every GraphModule (a Hydro surrogate) has a class of its own.
    ref_types = [(name, type(m).__name__) for name, m in ref.named_modules()]
    ref_shapes = {k: v.shape for k, v in ref.state_dict().items()}
    for i, m in enumerate(models[1:], start=1):
        if [(name, type(sub).__name__) for name, sub in m.named_modules()] != ref_types:
            raise FuseError(
                f"model {i} does not have the same modules as model 0; fuse needs one architecture"
            )
        shapes = {k: v.shape for k, v in m.state_dict().items()}
        if shapes != ref_shapes:
            diff = sorted(
                k for k in shapes.keys() | ref_shapes.keys() if shapes.get(k) != ref_shapes.get(k)
            )
            raise FuseError(
                f"model {i} has different parameter/buffer shapes than model 0: {diff[:5]}"
            )


def _reinitialize(model: nn.Module, generator_seed: int | None = None) -> nn.Module:
    """A copy of ``model`` with freshly drawn weights at the scale of the original's.

    Each layer's own ``reset_parameters`` draws new values, which are then rescaled per tensor to
    the standard deviation of ``model``'s tensor: a custom init scale (GPT-2's 0.02, muP's
    width-scaled std) carries over. Constant tensors (norm weights, zero biases, a layer scale)
    and tensors of layers without ``reset_parameters`` keep ``model``'s values.
    """
    fresh = copy.deepcopy(model)
    for m in fresh.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    with torch.no_grad():
        for (_, old), (_, new) in zip(model.named_parameters(), fresh.named_parameters()):
            if old.numel() < 2:
                new.copy_(old)
                continue
            std_old, std_new = old.float().std(), new.float().std()
            if std_old == 0 or std_new == 0:
                new.copy_(old)
            else:
                new.mul_(std_old / std_new)
    return fresh


def fuse(
    models: nn.Module | Sequence[nn.Module],
    n: int | None = None,
    *,
    init: Callable[[nn.Module], nn.Module] | None = None,
) -> FusedModel:
    """Fuse trials of one architecture into a :class:`FusedModel`.

    Args:
        models: a list of modules of the same architecture (their weights are copied in), or one
            module together with ``n``.
        n: with a single module, the number of trials. Trial 0 keeps the module's weights; the
            others are independent initializations (see ``init``).
        init: with a single module, a function returning a freshly initialized copy of it. By
            default each layer's ``reset_parameters`` is used, rescaled per tensor to the original
            tensor's standard deviation so custom and muP init scales carry over.

    Returns:
        The fused model. Dropout probabilities may differ between the given models: each trial
        keeps its own.

    Raises:
        FuseError: the models differ in architecture, or an op has no fused form (naming it).

    Example:
        >>> import torch
        >>> from hydro.fusion import fuse
        >>> models = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
        ...           torch.nn.Linear(8, 1)) for _ in range(3)]
        >>> fused = fuse(models)
        >>> fused(torch.randn(16, 4)).shape
        torch.Size([3, 16, 1])
    """
    if isinstance(models, nn.Module):
        if n is None:
            raise FuseError("fuse(model) needs n=, the number of trials (or pass a list of models)")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise FuseError(f"fuse(model, n=...) needs n >= 1 trials, got {n!r}")
        make = init or _reinitialize
        models = [models] + [make(models) for _ in range(n - 1)]
    elif n is not None and n != len(models):
        raise FuseError(f"fuse got {len(models)} models but n={n}")
    return FusedModel(list(models))


def trial_loss(
    loss_fn: Callable[..., torch.Tensor],
    output: torch.Tensor,
    target: torch.Tensor,
    *,
    shared: bool = True,
) -> torch.Tensor:
    """Each trial's own loss: ``[n]``, with ``loss_fn`` applied to every trial's output alone.

    Backpropagating ``trial_loss(...).sum()`` gives every trial exactly the gradient it would get
    trained alone (the loss convention: the sum over trials of each trial's own mean loss).

    Args:
        loss_fn: a loss for one model, e.g. ``torch.nn.functional.cross_entropy``.
        output: a fused model's output ``[n, ...]``.
        target: one model's target, the same for every trial; with ``shared=False``, ``[n, ...]``
            with each trial's own target.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> from hydro.fusion import fuse, trial_loss
        >>> fused = fuse(torch.nn.Linear(4, 3), n=2)
        >>> trial_loss(F.cross_entropy, fused(torch.randn(8, 4)), torch.randint(0, 3, (8,))).shape
        torch.Size([2])
    """
    if loss_fn is F.cross_entropy and output.dim() >= 3:  # batched logits [n, B, C, ...]
        return _cross_entropy(output, target, shared)
    in_dims = (0, None if shared else 0)
    try:
        return torch.func.vmap(loss_fn, in_dims=in_dims)(output, target)
    except Exception:  # noqa: BLE001 - a loss vmap cannot batch: one call per trial instead
        targets = [target] * output.shape[0] if shared else list(target)
        return torch.stack([loss_fn(o, t) for o, t in zip(output, targets)])


def _cross_entropy(output: torch.Tensor, target: torch.Tensor, shared: bool) -> torch.Tensor:
    """Per-trial mean cross-entropy in one call over the folded batch (no vmap)."""
    n = output.shape[0]
    if shared:
        target = target.unsqueeze(0).expand(n, *target.shape)
    losses = F.cross_entropy(output.flatten(0, 1), target.flatten(0, 1), reduction="none")
    if target.is_floating_point():  # class probabilities: the mean over samples
        return losses.view(n, -1).mean(dim=1)
    # class indices: the mean over targets that are not ignore_index (-100), as torch's "mean"
    return losses.view(n, -1).sum(dim=1) / (target != -100).view(n, -1).sum(dim=1)
