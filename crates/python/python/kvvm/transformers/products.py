"""A model's linear layers run through kvvm's tuned skinny products.

:func:`tuned_products` puts :class:`TunedLinear` in place of every plain ``nn.Linear`` of a
model (the same parameters, no copy) and has the groups :func:`fuse_projections` made run
their product the same way: each product then runs through ``kvvm::linear``
(:mod:`kvvm.kernels.products`), which measures, the first time it meets a shape, whether
cuBLAS or kvvm's Triton kernel reads that weight faster at a decode step's few rows, and
keeps the faster. A gated MLP whose gate and up projections were fused (transformers' Llama,
Mistral, Qwen2 and the other MLPs computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
with a SiLU) runs its down projection through ``kvvm::gated_linear`` over the fused product:
the activation is computed as the down projection's kernel loads its input where that was
measured faster, else in one kernel of its own before the down projection's product as
tuned. A product of more rows (a prefill) runs through PyTorch as before::

    fused = fuse_projections(model)      # first: it fuses plain nn.Linear siblings only
    tuned = tuned_products(model)        # before compiling or capturing the step
    step = DecodeGraph(model, cache)
    ...
    tuned.restore()                      # the original modules back

The first step of each new shape is slower (each candidate compiled and timed once); a
captured step replays the choice. Off CUDA the products run through PyTorch.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["TunedLinear", "TunedProducts", "tuned_products"]


class TunedLinear(nn.Module):
    """An ``nn.Linear``'s parameters, its product run by ``kvvm::linear``."""

    def __init__(self, original: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = original.in_features, original.out_features
        self.weight = original.weight
        self.bias = original.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` through ``kvvm::linear`` (the tuned skinny product)."""
        return torch.ops.kvvm.linear(x, self.weight, self.bias)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        """The layer's sizes and whether it has a bias, as ``nn.Linear`` shows them."""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


#: What :meth:`TunedProducts.restore` deletes instead of setting back (an attribute of the
#: instance that was not there: a gated MLP's ``forward``).
_ABSENT = object()


@dataclass
class TunedProducts:
    """What :func:`tuned_products` changed: the layers' paths (``layers``), the fused
    groups' (``groups``) and the gated MLPs' (``mlps``); :meth:`restore` puts the original
    modules back."""

    layers: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    mlps: list[str] = field(default_factory=list)
    _undo: list[tuple[nn.Module, str, object]] = field(default_factory=list, repr=False)

    def restore(self) -> None:
        """The original modules (the fused groups' product, the MLPs' own forward) back in
        place."""
        for owner, name, before in reversed(self._undo):
            if before is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        self._undo.clear()
        self.layers.clear()
        self.groups.clear()
        self.mlps.clear()


# The forward of transformers' gated MLPs (Llama, Mistral, Qwen2, ...): its code is compared with a
# class's, never run.
def _gated_forward_shape(self: Any, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover (never called)
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj  # type: ignore[no-any-return]


def _is_gated_mlp(module: nn.Module) -> bool:
    """Whether ``module`` computes ``down_proj(silu(gate_proj(x)) * up_proj(x))`` with its
    gate and up projections fused side by side: its class's ``forward`` is that very code
    (transformers' Llama-family MLPs), its activation a SiLU, its down projection a plain
    linear layer (or one :func:`tuned_products` made) of the gate's width."""
    from transformers.activations import SiLUActivation

    from .projections import halves_of

    forward = getattr(type(module).forward, "__code__", None)
    shape = _gated_forward_shape.__code__
    if forward is None or (forward.co_code, forward.co_names) != (shape.co_code, shape.co_names):
        return False
    down = getattr(module, "down_proj", None)
    group = halves_of(getattr(module, "gate_proj", None), getattr(module, "up_proj", None))
    return (
        group is not None
        and isinstance(getattr(module, "act_fn", None), (nn.SiLU, SiLUActivation))
        and isinstance(down, (nn.Linear, TunedLinear))
        and type(down) in (nn.Linear, TunedLinear)  # not a subclass: it may compute something else
        and down.in_features * 2 == group.weight.shape[0]
    )


def _gated_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP's forward through ``kvvm::gated_linear`` over its fused gate and up
    product (its class's own forward once they are fused no more)."""
    from .projections import halves_of

    group = halves_of(self.gate_proj, self.up_proj)
    if group is None:
        return type(self).forward(self, x)  # type: ignore[no-any-return]
    gate_up = group.linear(x, group.weight, group.bias)
    down: Any = self.down_proj
    return torch.ops.kvvm.gated_linear(gate_up, down.weight, down.bias)  # type: ignore[no-any-return]


def tuned_products(model: nn.Module) -> TunedProducts:
    """Runs every plain ``nn.Linear`` of ``model`` (subclasses are left alone: they may
    compute something else) and every group :func:`fuse_projections` made through
    ``kvvm::linear``, and every gated MLP whose gate and up projections it fused through
    ``kvvm::gated_linear`` (see the module's text). Returns what it changed (possibly
    nothing). Call it after fusing and before compiling or capturing the step."""
    import kvvm.kernels.products  # noqa: F401  (registers kvvm::linear)

    from .projections import Group

    tuned = TunedProducts()
    for path, owner in list(model.named_modules()):
        if "forward" not in vars(owner) and _is_gated_mlp(owner):
            owner.forward = types.MethodType(_gated_forward, owner)
            tuned._undo.append((owner, "forward", _ABSENT))
            tuned.mlps.append(path)
        if isinstance(owner, Group) and owner.linear is nn.functional.linear:
            tuned._undo.append((owner, "linear", owner.linear))
            owner.linear = torch.ops.kvvm.linear
            tuned.groups.append(path)
        for name, child in list(owner.named_children()):
            if type(child) is nn.Linear:
                setattr(owner, name, TunedLinear(child))
                tuned._undo.append((owner, name, child))
                tuned.layers.append(f"{path}.{name}" if path else name)
    return tuned
