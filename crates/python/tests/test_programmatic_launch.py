"""The switch for programmatic dependent launches (``kvvm.kernels.device``): off by default,
never on for a CPU tensor's device, both switches (kvvm's and PyTorch's compiler's) set
within ``programmatic_launches`` and as they were after, even when the block raises. The
launches themselves are tested on a GPU (``test_cuda_programmatic_launch.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch", reason="skipped: no torch")

from kvvm.kernels import device  # noqa: E402


def test_the_switch_is_off_unless_asked_and_never_on_for_a_cpu() -> None:
    assert not device.programmatic(torch.device("cpu"))
    before = device.set_programmatic_launch(True)
    try:
        assert device.set_programmatic_launch(True) is True, "returns the switch as it was"
        assert not device.programmatic(torch.device("cpu")), "a CPU tensor's kernels never launch so"
        assert device.launch_options(True) == {"launch_pdl": True}
        assert device.launch_options(False) == {}, "no option at all: the interpreter takes none"
    finally:
        device.set_programmatic_launch(before)


def test_programmatic_launches_sets_both_switches_and_restores_them() -> None:
    from torch._inductor import config

    kvvm_before, inductor_before = device.set_programmatic_launch(False), config.triton.enable_pdl
    try:
        with pytest.raises(RuntimeError, match="inside"):
            with device.programmatic_launches():
                assert device._Switch.on and config.triton.enable_pdl
                raise RuntimeError("inside")
        assert not device._Switch.on and config.triton.enable_pdl == inductor_before
        config.triton.enable_pdl = True
        with device.programmatic_launches(False):
            assert not config.triton.enable_pdl
        assert config.triton.enable_pdl, "as it was before the block"
    finally:
        device.set_programmatic_launch(kvvm_before)
        config.triton.enable_pdl = inductor_before


def test_the_engine_captures_its_step_with_programmatic_launches_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's runner makes its ``DecodeGraph`` (where the step is captured) inside
    ``programmatic_launches`` when made with ``programmatic_launches=True``, outside it
    otherwise; both switches as they were after."""
    from torch._inductor import config

    import kvvm.transformers.graph as graph
    from kvvm.serving.runner import ModelRunner

    seen: list[tuple[bool, bool]] = []

    class Captured:
        """Records both switches as the step is captured."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            seen.append((device._Switch.on, bool(config.triton.enable_pdl)))

        def replay(self, last: torch.Tensor) -> str:
            return "logits"

    class Kv:
        cache = None

        def prepare_decode(self, slots: list[int]) -> None:
            pass

    monkeypatch.setattr(graph, "DecodeGraph", Captured)
    # Set and put back by hand: the compiler's config takes no monkeypatch (its undo would
    # delete the setting).
    kvvm_before, inductor_before = device.set_programmatic_launch(False), config.triton.enable_pdl
    config.triton.enable_pdl = False
    try:
        for on in (False, True):
            runner = ModelRunner(object(), slots=2, device=torch.device("cpu"), compile=False, programmatic_launches=on)
            runner.device = torch.device("cuda")  # the captured path, without a GPU
            assert runner._decode_step([0, 1], Kv()) == "logits"  # type: ignore[arg-type]
        assert seen == [(False, False), (True, True)]
        assert not device._Switch.on and not config.triton.enable_pdl, "as they were"
    finally:
        device.set_programmatic_launch(kvvm_before)
        config.triton.enable_pdl = inductor_before
