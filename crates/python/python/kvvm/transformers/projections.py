"""Sibling projections of one input run as one matrix multiply.

A Llama-style decoder layer projects the same hidden states three times for attention
(``q_proj``, ``k_proj``, ``v_proj``) and twice for its MLP (``gate_proj``, ``up_proj``). In a
decode step each of those is a skinny matrix multiply that reads its weights once: K and V of
a grouped-query model are small enough that the GPU streams them well below its bandwidth,
and each costs a launch (two with cuBLAS's split-K reduction). :func:`fuse_projections`
concatenates each group's weights into one tensor (the original ``Linear`` modules keep
working on views of it: no second copy) and puts small modules in their place that compute
the group's product once per input and hand each caller its slice::

    fused = fuse_projections(model)     # before compiling or capturing the step
    step = DecodeGraph(model, cache)
    ...
    fused.restore()                     # the original modules back (weights stay fused)

The attention and MLP code of the model is unchanged: it still calls ``self.q_proj(x)``,
``self.k_proj(x)``, ``self.v_proj(x)`` in turn, and the first call of a group with a new input
computes the whole product. Outputs are the same products over the same weights (each
output element is one row of the concatenated weight against the input).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import InvalidArgumentError

__all__ = ["DEFAULT_GROUPS", "FusedProjections", "Group", "fuse_projections", "halves_of"]

#: The sibling projections of transformers' Llama-family decoders (Llama, Mistral, Qwen2, ...).
DEFAULT_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Group(nn.Module):
    """One group's concatenated weight (and bias) and the product of the last input,
    computed by ``linear`` (``torch.nn.functional.linear``; :func:`kvvm.transformers.tuned_products`
    sets kvvm's tuned product)."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, parts: int) -> None:
        super().__init__()
        # Buffers, not parameters: the members' weights are the parameters (views of these).
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.parts = parts
        self.linear: Callable[..., torch.Tensor] = nn.functional.linear
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._served = 0

    def product(self, x: torch.Tensor, part: int) -> torch.Tensor:
        """The group's product for ``x``: computed when ``x`` is not the input of the last
        one or when ``part`` was served from it already (a new forward), else reused; it is
        dropped once every part has been served."""
        if self._output is None or self._input is not x or self._served & (1 << part):
            self._input, self._output, self._served = x, self.linear(x, self.weight, self.bias), 0
        out = self._output
        self._served |= 1 << part
        if self._served == (1 << self.parts) - 1:
            self._input, self._output, self._served = None, None, 0
        return out


class _Part(nn.Module):
    """What a group's member becomes: its slice of the group's product."""

    def __init__(self, group: Group, part: int, lo: int, hi: int, original: nn.Linear) -> None:
        super().__init__()
        self.group = [group]  # in a list: not a submodule (the group is the layer's child)
        self.part, self.lo, self.hi = part, lo, hi
        self.in_features, self.out_features = original.in_features, original.out_features
        self.weight = original.weight
        self.bias = original.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This projection's columns ``[lo, hi)`` of its group's fused product of ``x``."""
        return self.group[0].product(x, self.part)[..., self.lo : self.hi]


def halves_of(first: object, second: object) -> Group | None:
    """The group ``first`` and ``second`` are the two parts of, ``first``'s rows the first
    half of its product and ``second``'s the second (equal halves, as a gated MLP's gate and
    up projections fused by :func:`fuse_projections`); None otherwise."""
    if not (isinstance(first, _Part) and isinstance(second, _Part)):
        return None
    group = first.group[0]
    rows = group.weight.shape[0]
    if second.group[0] is not group or group.parts != 2 or 2 * first.hi != rows:
        return None
    return group if (first.lo, second.lo, second.hi) == (0, first.hi, rows) else None


@dataclass
class FusedProjections:
    """What :func:`fuse_projections` changed: ``groups`` fused (``"module.path: a+b+c"``);
    :meth:`restore` puts the original modules back."""

    groups: list[str] = field(default_factory=list)
    #: (owner, attribute, what it was: None where it was added).
    _undo: list[tuple[nn.Module, str, nn.Module | None]] = field(default_factory=list, repr=False)

    def restore(self) -> None:
        """The original ``Linear`` modules back in place (their weights stay views of the
        concatenated ones: no memory is freed or copied)."""
        for owner, name, module in reversed(self._undo):
            if module is None:
                delattr(owner, name)
            else:
                setattr(owner, name, module)
        self._undo.clear()
        self.groups.clear()


def fuse_projections(model: nn.Module, groups: tuple[tuple[str, ...], ...] = DEFAULT_GROUPS) -> FusedProjections:
    """Fuses every module's sibling projections named in ``groups`` (children of one module,
    plain ``nn.Linear`` of one input size, dtype and device, all with or all without a bias).

    Returns what was fused (possibly nothing: a model without such siblings is left as it
    is). Call it once the model is on its device and in its dtype (moving it afterwards
    moves the members and the group apart: twice the memory), and before compiling or
    capturing (a step compiled before keeps running the separate projections).

    Raises:
        InvalidArgumentError: ``groups`` names a group of fewer than two projections.
    """
    if any(len(g) < 2 for g in groups):
        raise InvalidArgumentError(f"a group fuses at least two projections: {groups}")
    fused = FusedProjections()
    for path, owner in list(model.named_modules()):
        for names in groups:
            linears = [getattr(owner, n, None) for n in names]
            if not _fusable(linears):
                continue
            _fuse(owner, names, linears, fused)  # type: ignore[arg-type]
            fused.groups.append(f"{path or '<model>'}: {'+'.join(names)}")
    return fused


def _fusable(linears: list[Any]) -> bool:
    if not all(type(m) is nn.Linear for m in linears):
        return False
    first = linears[0]
    same = all(
        m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device
        and (m.bias is None) == (first.bias is None)
        for m in linears
    )
    return same and first.weight.dtype.is_floating_point


@torch.no_grad()
def _fuse(owner: nn.Module, names: tuple[str, ...], linears: list[nn.Linear], fused: FusedProjections) -> None:
    weight = torch.cat([m.weight for m in linears])
    bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
    group = Group(weight, bias, len(linears))
    lo = 0
    for part, (name, m) in enumerate(zip(names, linears, strict=True)):
        hi = lo + m.out_features
        # The original module keeps working, over its rows of the concatenated weight.
        m.weight = nn.Parameter(weight[lo:hi], requires_grad=m.weight.requires_grad)
        if bias is not None:
            m.bias = nn.Parameter(bias[lo:hi], requires_grad=m.bias.requires_grad)
        setattr(owner, name, _Part(group, part, lo, hi, m))
        fused._undo.append((owner, name, m))
        lo = hi
    # The group is a child of the layer; its members' weights are views of its buffers.
    group_name = "_kvvm_fused_" + "_".join(names)
    owner.add_module(group_name, group)
    fused._undo.append((owner, group_name, None))
