"""Type stubs of the native module ``kvvm._native`` (built from crates/python/src)."""

import os
from collections.abc import Callable
from typing import Any, Self, final

__all__ = [
    "Backend",
    "Manager",
    "MemorySnapshot",
    "KvGeometry",
    "LayoutPlan",
    "Sequence",
    "SequenceBatch",
    "SharedPrefix",
    "PrefixCache",
    "TensorView",
    "HostTier",
    "SwappedKv",
    "BACKEND_NAMES",
    "PREFIX_META_BYTES",
    "__version__",
    "KvvmError",
    "BackpressureError",
    "NeverFitsError",
    "BusyError",
    "UnavailableError",
    "InvalidArgumentError",
    "TooManyTokensError",
    "DriverError",
    "OutOfMemoryError",
    "ViewsAliveError",
    "GraphsAliveError",
    "ReleasedError",
    "NotCommittedError",
    "WriteIntoSharedPrefixError",
    "NotShareableError",
    "PrefixNotWrittenError",
]

BACKEND_NAMES: list[str]
PREFIX_META_BYTES: int
__version__: str

@final
class Backend:
    """A driver backend opened by name (``auto``, ``cuda``, ``hip``, ``host``, ``sim``)."""

    def __new__(cls, name: str = "auto") -> Self: ...
    @property
    def name(self) -> str: ...
    @property
    def notice(self) -> str | None: ...
    @property
    def addressable(self) -> bool: ...
    def devices(self) -> list[dict[str, Any]]: ...

@final
class MemorySnapshot:
    """The governor's books for one device, in bytes."""

    committed: int
    pooled: int
    shared: int
    quarantined: int
    pending: int
    used: int
    budget: int | None
    free: int | None

@final
class Manager:
    """A byte-budgeted manager of one device's virtual memory."""

    def __new__(
        cls,
        backend: Backend | str | None = None,
        device: int = 0,
        budget_bytes: int | None = None,
        pool_cap_bytes: int | None = None,
        park_released: bool = False,
        granularity: str = "recommended",
        precommit: bool = False,
        headroom_tokens: int = 64,
        max_headroom_bytes: int = 1 << 30,
        poll_interval_us: int = 1000,
        broker: str | os.PathLike[str] | None = None,
        tenant: str = "default",
        broker_token: str | None = None,
        lease_batch_bytes: int = 1 << 28,
        host_budget_bytes: int | None = None,
    ) -> Self: ...
    @property
    def leased_bytes(self) -> int | None: ...
    def close_prefix(self, key: str) -> int: ...
    @property
    def lease_stats(self) -> dict[str, Any] | None: ...
    @property
    def backend(self) -> str: ...
    @property
    def device(self) -> int: ...
    @property
    def granule(self) -> int: ...
    @property
    def budget_bytes(self) -> int | None: ...
    @property
    def precommit(self) -> bool: ...
    @property
    def addressable(self) -> bool: ...
    def snapshot(self) -> MemorySnapshot: ...
    def available_bytes(self) -> int | None: ...
    def host_snapshot(self) -> MemorySnapshot: ...
    def trim_pool(self, keep_bytes: int = 0) -> int: ...
    def precommit_stats(self) -> dict[str, int] | None: ...
    def wait_precommit_idle(self) -> Self: ...
    def stop_precommit(self) -> None: ...
    def synchronize(self) -> None: ...

@final
class KvGeometry:
    """The shape of one sequence's KV cache."""

    def __new__(
        cls, layers: int, kv_heads: int, head_dim: int, max_tokens: int, dtype: str = "bf16"
    ) -> Self: ...
    @staticmethod
    def preset(name: str, max_tokens: int, dtype: str = "bf16") -> KvGeometry: ...
    @staticmethod
    def preset_names() -> list[str]: ...
    @property
    def layers(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def dtype_bytes(self) -> int: ...
    @property
    def bytes_per_token(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    def with_max_tokens(self, max_tokens: int) -> KvGeometry: ...

@final
class LayoutPlan:
    """A geometry laid out under ``head-major``, ``seq-major`` or ``token-major``."""

    def __new__(cls, geometry: KvGeometry, layout: str, granule: int) -> Self: ...
    @property
    def geometry(self) -> KvGeometry: ...
    @property
    def layout(self) -> str: ...
    @property
    def granule(self) -> int: ...
    @property
    def reservation_bytes(self) -> int: ...
    @property
    def padding_bytes(self) -> int: ...
    @property
    def fragments(self) -> int: ...
    def strides(self) -> dict[str, int]: ...
    def committed_bytes_for_tokens(self, tokens: int) -> int: ...
    def mapped_tokens(self, tokens: int) -> int: ...
    def shareability(self, prefix_tokens: int) -> dict[str, Any]: ...

@final
class TensorView:
    """A zero-copy DLPack view of one layer's K or V."""

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def strides(self) -> list[int]: ...
    @property
    def data_ptr(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def readonly(self) -> bool: ...

@final
class SharedPrefix:
    """A prefix one sequence owns and others attach (whole windows read-only, the rest copied)."""

    def seal(self) -> None: ...
    @property
    def sealed(self) -> bool: ...
    @property
    def tokens(self) -> int: ...
    @property
    def shared_tokens(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    def publish(self, manager: Manager, key: str, meta: str = "") -> int: ...
    @staticmethod
    def open(manager: Manager, key: str, plan: LayoutPlan | Callable[[str], LayoutPlan]) -> SharedPrefix: ...
    def attach(self, sequence: Sequence, first: int | None = None) -> int: ...

@final
class Sequence:
    """One request's KV cache."""

    def __new__(
        cls,
        manager: Manager,
        plan: LayoutPlan,
        max_tokens: int | None = None,
        precommit: bool = False,
    ) -> Self: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def committed_tokens(self) -> int: ...
    @property
    def committed_bytes(self) -> int: ...
    @property
    def owned_bytes(self) -> int: ...
    @property
    def shared_tokens(self) -> int: ...
    @property
    def forgotten_tokens(self) -> int: ...
    @property
    def prefix_tokens(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def views(self) -> int: ...
    @property
    def precommitted(self) -> bool: ...
    @property
    def is_empty(self) -> bool: ...
    def ensure(self, tokens: int) -> int: ...
    def shrink(self, tokens: int) -> int: ...
    def forget_before(self, tokens: int) -> int: ...
    def release(self) -> int: ...
    def mark_written(self, tokens: int) -> Self: ...
    # `data`: any bytes-like object (the buffer protocol: bytes, bytearray, memoryview, numpy).
    def write_tokens(self, first: int, data: Any) -> None: ...
    def read_tokens(self, first: int, count: int) -> bytes: ...
    def view(
        self,
        layer: int,
        kind: str = "key",
        start: int = 0,
        end: int | None = None,
        allow_uncommitted: bool = False,
    ) -> TensorView: ...
    def own_prefix(self, tokens: int) -> SharedPrefix: ...
    # `after`: the torch stream that wrote the tokens (None: the device is synchronized).
    def swap_out(self, tier: HostTier, tokens: int, after: Any = None) -> SwappedKv: ...
    def finish_swap_out(self, swap: SwappedKv) -> int: ...
    def swap_in(self, swap: SwappedKv) -> None: ...
    def finish_swap_in(self, swap: SwappedKv) -> int: ...

@final
class HostTier:
    """Page-locked host memory for one manager's KV windows, under its host budget."""

    def __new__(
        cls,
        manager: Manager,
        slab_windows: int = 16,
        keep_pooled_bytes: int | None = None,
        max_copy_bytes: int | None = 67108864,
    ) -> Self: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def manager(self) -> Manager: ...
    def prewarm(self, bytes: int) -> int: ...
    def trim(self, keep_bytes: int = 0) -> int: ...
    def stats(self) -> dict[str, int]: ...

@final
class SwappedKv:
    """A sequence's tokens on their way to the host tier, there, or on their way back."""

    @property
    def phase(self) -> str: ...
    @property
    def tokens(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def copies(self) -> int: ...
    def is_done(self) -> bool: ...

@final
class SequenceBatch:
    """Sequences in the slots of one strided reservation."""

    def __new__(
        cls,
        manager: Manager,
        plan: LayoutPlan,
        slots: int,
        max_tokens: int | None = None,
        precommit: bool = False,
        window_handles: bool = False,
    ) -> Self: ...
    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> Sequence: ...
    @property
    def slot_stride(self) -> int: ...
    @property
    def committed_bytes(self) -> int: ...
    @property
    def owned_bytes(self) -> int: ...
    def ensure(self, tokens: int, first: int = 0, count: int | None = None) -> int: ...
    def ensure_each(self, tokens: list[int], first: int = 0) -> int: ...
    def forget_each(self, tokens: list[int], first: int = 0) -> int: ...
    def release(self) -> int: ...
    def view(
        self,
        layer: int,
        kind: str = "key",
        start: int = 0,
        end: int | None = None,
        first: int = 0,
        count: int | None = None,
        allow_uncommitted: bool = False,
    ) -> TensorView: ...
    def slab(self) -> TensorView: ...
    def view_all(
        self,
        start: int = 0,
        end: int | None = None,
        first: int = 0,
        count: int | None = None,
        allow_uncommitted: bool = False,
    ) -> TensorView: ...
    def store(
        self,
        layer: int,
        start: int,
        keys: Any,
        values: Any,
        stream: Any = None,
        first: int = 0,
        count: int | None = None,
    ) -> None:
        """Writes tokens ``start..start+T`` of layer ``layer`` of every slot from ``keys`` and
        ``values`` (``[slots, kv_heads, T, head_dim]``, torch tensors on the manager's device or
        numpy arrays on the host backend) with one strided row copy each, queued on ``stream``
        (a ``torch.cuda.Stream``; None: the default stream)."""
    def can_store(self, tokens: int) -> bool:
        """Whether :meth:`store` can write ``tokens`` tokens per slot with this layout."""

@final
class PrefixCache:
    """An automatic prefix cache over token ids."""

    def __new__(
        cls,
        manager: Manager,
        plan: LayoutPlan,
        max_cached_bytes: int | None = None,
        block_tokens: int = 16,
        handle_windows: int = 1,
    ) -> Self: ...
    @property
    def block_tokens(self) -> int: ...
    def attach_host_tier(self, tier: HostTier) -> None: ...
    def admit(self, sequence: Sequence, token_ids: list[int], host_min_tokens: int | None = 1) -> dict[str, int]: ...
    def publish(self, sequence: Sequence) -> str: ...
    def segments(self, token_ids: list[int]) -> list[SharedPrefix] | None: ...
    def insert(self, token_ids: list[int], segments: list[SharedPrefix]) -> str: ...
    def stats(self) -> dict[str, int]: ...
    def evict(self, bytes: int) -> int: ...
    def clear(self) -> int: ...

# The exception hierarchy, made by the module when it is imported (src/exceptions.rs) and
# re-exported by `kvvm.errors` (their `__module__`).

class KvvmError(Exception):
    """Base class of every error kvvm raises."""

class BackpressureError(KvvmError):
    """The memory budget cannot grant the request now; freeing memory can help."""

    retry_after: float
    needed_bytes: int
    available_bytes: int
    device: int
    def __init__(
        self,
        message: str,
        retry_after: float = 0.0,
        needed_bytes: int = 0,
        available_bytes: int = 0,
        device: int = 0,
    ) -> None: ...

class NeverFitsError(KvvmError):
    """The request is larger than a limit that no amount of freeing can lift."""

    needed_bytes: int
    limit_bytes: int
    limit: str
    limit_kind: str
    def __init__(
        self,
        message: str,
        needed_bytes: int = 0,
        limit_bytes: int = 0,
        limit: str = "budget",
        limit_kind: str = "device_budget",
    ) -> None: ...

class BusyError(KvvmError):
    """A window is being committed or given back by another thread right now."""

class UnavailableError(KvvmError):
    """The backend cannot be used on this machine."""

class InvalidArgumentError(KvvmError, ValueError):
    """An argument is out of range or does not fit the object's state."""

class TooManyTokensError(InvalidArgumentError):
    """More tokens than the sequence (or the geometry) can hold."""

    tokens: int
    max_tokens: int
    def __init__(self, message: str, tokens: int = 0, max_tokens: int = 0) -> None: ...

class DriverError(KvvmError):
    """A driver call failed."""

    op: str
    kind: str
    code: int
    code_name: str
    def __init__(
        self, message: str, op: str = "", kind: str = "", code: int = 0, code_name: str = ""
    ) -> None: ...

class OutOfMemoryError(DriverError, MemoryError):
    """The driver itself ran out of physical memory or address space."""

class ViewsAliveError(KvvmError):
    """The memory is still viewed by tensors and cannot be unmapped."""

    views: int
    def __init__(self, message: str, views: int = 0) -> None: ...

class GraphsAliveError(ViewsAliveError):
    """A CUDA graph captured over the memory is alive and may be replayed into it."""

    graphs: int
    def __init__(self, message: str, graphs: int = 0) -> None: ...  # type: ignore[override]

class ReleasedError(KvvmError):
    """The object was closed (released for good) and cannot be used any more."""

class NotCommittedError(KvvmError, IndexError):
    """Tokens were read or written past the committed ones."""

class WriteIntoSharedPrefixError(KvvmError, PermissionError):
    """A write into the read-only shared prefix of a sequence."""

class NotShareableError(KvvmError):
    """The prefix cannot be shared under this layout and granule."""

class PrefixNotWrittenError(KvvmError):
    """A prefix was published or attached before its tokens were written and sealed."""
