"""The exception hierarchy the native module makes: every class of ``kvvm.errors`` is the native
module's own, with the bases, attributes and defaults the docs promise, and the native code
raises them with their attributes filled."""

from __future__ import annotations

import inspect
import pickle

import pytest

import kvvm
from kvvm import _native, errors
from conftest import MiB, tiny_geometry

#: Each class: its kvvm parent, its builtin base (if any) and its attributes' defaults.
HIERARCHY: dict[str, tuple[str | None, type | None, dict[str, object]]] = {
    "KvvmError": (None, None, {}),
    "BackpressureError": (
        "KvvmError", None, {"retry_after": 0.0, "needed_bytes": 0, "available_bytes": 0, "device": 0},
    ),
    "NeverFitsError": (
        "KvvmError", None, {"needed_bytes": 0, "limit_bytes": 0, "limit": "budget", "limit_kind": "device_budget"},
    ),
    "BusyError": ("KvvmError", None, {}),
    "UnavailableError": ("KvvmError", None, {}),
    "InvalidArgumentError": ("KvvmError", ValueError, {}),
    "TooManyTokensError": ("InvalidArgumentError", None, {"tokens": 0, "max_tokens": 0}),
    "DriverError": ("KvvmError", None, {"op": "", "kind": "", "code": 0, "code_name": ""}),
    "OutOfMemoryError": ("DriverError", MemoryError, {"op": "", "kind": "", "code": 0, "code_name": ""}),
    "ViewsAliveError": ("KvvmError", None, {"views": 0}),
    "GraphsAliveError": ("ViewsAliveError", None, {"views": 0, "graphs": 0}),
    "ReleasedError": ("KvvmError", None, {}),
    "NotCommittedError": ("KvvmError", IndexError, {}),
    "WriteIntoSharedPrefixError": ("KvvmError", PermissionError, {}),
    "NotShareableError": ("KvvmError", None, {}),
    "PrefixNotWrittenError": ("KvvmError", None, {}),
}


def test_every_class_is_made_by_the_native_module_with_its_bases() -> None:
    assert sorted(errors.__all__) == sorted(HIERARCHY)
    for name, (parent, builtin, _) in HIERARCHY.items():
        cls = getattr(errors, name)
        assert cls is getattr(_native, name) is getattr(kvvm, name)
        assert cls.__module__ == "kvvm.errors" and cls.__qualname__ == name
        assert cls.__doc__, name
        want = [getattr(errors, parent) if parent else Exception] + ([builtin] if builtin else [])
        assert list(cls.__bases__) == want, name
        assert issubclass(cls, errors.KvvmError) and issubclass(cls, Exception)


def test_attributes_take_their_defaults_keywords_and_positions() -> None:
    for name, (_, _, defaults) in HIERARCHY.items():
        cls = getattr(errors, name)
        e = cls("what happened")
        assert str(e) == "what happened" and e.args == ("what happened",)
        assert {k: getattr(e, k) for k in defaults} == defaults, name
    e = errors.BackpressureError("short", 1.5, needed_bytes=3 * MiB, available_bytes=MiB, device=1)
    assert (e.retry_after, e.needed_bytes, e.available_bytes, e.device) == (1.5, 3 * MiB, MiB, 1)
    assert list(inspect.signature(errors.NeverFitsError).parameters) == [
        "message", "needed_bytes", "limit_bytes", "limit", "limit_kind",
    ]
    g = errors.GraphsAliveError("graphs", graphs=2)
    assert isinstance(g, errors.ViewsAliveError) and (g.views, g.graphs) == (0, 2)
    with pytest.raises(TypeError):
        errors.TooManyTokensError("x", tokens="many")  # type: ignore[arg-type]


def test_an_error_pickles_with_its_attributes() -> None:
    e = errors.DriverError("map failed", op="map", kind="invalid value", code=1, code_name="CUDA_ERROR_INVALID_VALUE")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is errors.DriverError and back.args == e.args
    assert (back.op, back.kind, back.code, back.code_name) == ("map", "invalid value", 1, "CUDA_ERROR_INVALID_VALUE")


def test_the_native_code_raises_the_classes_with_their_attributes(sim: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(max_tokens=64), "seq-major", sim.granule)
    seq = kvvm.Sequence(sim, plan)
    with pytest.raises(errors.TooManyTokensError) as many:
        seq.ensure(65)
    assert (many.value.tokens, many.value.max_tokens) == (65, 64)
    assert isinstance(many.value, ValueError)
    with pytest.raises(IndexError):
        seq.read_tokens(0, 1)
    small = kvvm.Manager("sim", budget_bytes=4 * MiB)
    big = kvvm.Sequence(small, kvvm.LayoutPlan(tiny_geometry(max_tokens=1 << 16), "seq-major", small.granule))
    with pytest.raises(errors.NeverFitsError) as never:
        big.ensure(1 << 16)
    assert never.value.limit == "budget" and never.value.needed_bytes > never.value.limit_bytes > 0
