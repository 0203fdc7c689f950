"""A model's linear layers run through kvvm's tuned skinny products.

:func:`tuned_products` puts :class:`TunedLinear` in place of every plain ``nn.Linear`` of a
model (the same parameters, no copy) and has the groups :func:`fuse_projections` made run
their product the same way: each product then runs through ``kvvm::linear``
(:mod:`kvvm.kernels.products`), which measures, the first time it meets a shape, whether
cuBLAS or kvvm's Triton kernel reads that weight faster at a decode step's few rows, and
keeps the faster. A product of more rows (a prefill) runs through PyTorch as before::

    fused = fuse_projections(model)      # first: it fuses plain nn.Linear siblings only
    tuned = tuned_products(model)        # before compiling or capturing the step
    step = DecodeGraph(model, cache)
    ...
    tuned.restore()                      # the original modules back

The first step of each new shape is slower (each candidate compiled and timed once); a
captured step replays the choice. Off CUDA the products run through PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
        return torch.ops.kvvm.linear(x, self.weight, self.bias)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@dataclass
class TunedProducts:
    """What :func:`tuned_products` changed: the layers' paths (``layers``) and the fused
    groups' (``groups``); :meth:`restore` puts the original modules back."""

    layers: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    _undo: list[tuple[nn.Module, str, object]] = field(default_factory=list, repr=False)

    def restore(self) -> None:
        """The original modules (and the fused groups' product) back in place."""
        for owner, name, before in reversed(self._undo):
            setattr(owner, name, before)
        self._undo.clear()
        self.layers.clear()
        self.groups.clear()


def tuned_products(model: nn.Module) -> TunedProducts:
    """Runs every plain ``nn.Linear`` of ``model`` (subclasses are left alone: they may
    compute something else) and every group :func:`fuse_projections` made through
    ``kvvm::linear``. Returns what it changed (possibly nothing). Call it after fusing and
    before compiling or capturing the step."""
    import kvvm.kernels.products  # noqa: F401  (registers kvvm::linear)

    from .projections import Group

    tuned = TunedProducts()
    for path, owner in list(model.named_modules()):
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
