"""Exceptions raised by kvvm.

Every error kvvm raises is a :class:`KvvmError`. The subclasses mirror what a caller can do
about it, as the Rust library's error kinds do:

* :class:`BackpressureError`: memory is short *now*; retry after ``retry_after`` seconds or
  shed load (a server answers 429 with ``Retry-After``).
* :class:`NeverFitsError`: the request is larger than the budget or the device; retrying
  cannot help (a server answers 413/422).
* :class:`UnavailableError`: the backend cannot be used here; choose another one.
* :class:`InvalidArgumentError` (also a :class:`ValueError`): a bug in the caller, such as
  a negative size, a token count past the maximum or an unknown layout.
* :class:`DriverError`: the driver failed; ``op``, ``code`` and ``code_name`` say where.
* :class:`ViewsAliveError`, :class:`ReleasedError`, :class:`NotCommittedError`,
  :class:`WriteIntoSharedPrefixError`, :class:`NotShareableError`,
  :class:`PrefixNotWrittenError`: state errors with their own remedy.

The native module raises these very classes: it imports this module once, on its first error,
and keeps every class object (``crates/python/src/error_class.rs`` lists the classes it raises).
"""

from __future__ import annotations

__all__ = [
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


class KvvmError(Exception):
    """Base class of every error kvvm raises."""


class BackpressureError(KvvmError):
    """The memory budget cannot grant the request now; freeing memory can help.

    Attributes:
        retry_after: seconds after which a retry is likely to succeed.
        needed_bytes: bytes the request asked for.
        available_bytes: bytes that could have been granted.
        device: the device ordinal.
    """

    def __init__(
        self,
        message: str,
        retry_after: float = 0.0,
        needed_bytes: int = 0,
        available_bytes: int = 0,
        device: int = 0,
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.device = device


class NeverFitsError(KvvmError):
    """The request is larger than a limit that no amount of freeing can lift.

    Attributes:
        needed_bytes: bytes the request needs.
        limit_bytes: the most that limit could ever grant (a budget less the bytes in
            quarantine, which never come back; or the device's memory).
        limit: which limit (``"budget"`` or ``"device"``).
        limit_kind: the precise limit: ``"device_budget"``, ``"process_budget"`` or
            ``"device_memory"``.
    """

    def __init__(
        self,
        message: str,
        needed_bytes: int = 0,
        limit_bytes: int = 0,
        limit: str = "budget",
        limit_kind: str = "device_budget",
    ) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.limit_bytes = limit_bytes
        self.limit = limit
        self.limit_kind = limit_kind


class BusyError(KvvmError):
    """A window is being committed or given back by another thread right now (a background
    commit in flight); nothing was done. Retry once it is done."""


class UnavailableError(KvvmError):
    """The backend cannot be used on this machine (library, symbol or device missing)."""


class InvalidArgumentError(KvvmError, ValueError):
    """An argument is out of range or does not fit the object's state: a bug in the caller."""


class TooManyTokensError(InvalidArgumentError):
    """More tokens than the sequence (or the geometry) can hold.

    Attributes:
        tokens: tokens asked for.
        max_tokens: the most the sequence holds.
    """

    def __init__(self, message: str, tokens: int = 0, max_tokens: int = 0) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.max_tokens = max_tokens


class DriverError(KvvmError):
    """A driver call failed.

    Attributes:
        op: the driver operation (``"map"``, ``"create"``, ...).
        kind: the neutral kind (``"out of memory"``, ``"invalid value"``, ...).
        code: the vendor's numeric code (0 when the backend raised it itself).
        code_name: the vendor's name for the code.
    """

    def __init__(
        self, message: str, op: str = "", kind: str = "", code: int = 0, code_name: str = ""
    ) -> None:
        super().__init__(message)
        self.op = op
        self.kind = kind
        self.code = code
        self.code_name = code_name


class OutOfMemoryError(DriverError, MemoryError):
    """The driver itself ran out of physical memory or address space."""


class ViewsAliveError(KvvmError):
    """The memory is still viewed by tensors (DLPack exports) and cannot be unmapped.

    Attributes:
        views: live views (tensor exports and view objects) of the sequence.
    """

    def __init__(self, message: str, views: int = 0) -> None:
        super().__init__(message)
        self.views = views


class GraphsAliveError(ViewsAliveError):
    """A CUDA graph captured over the memory is alive and may be replayed into it: release
    is refused until the graph is dropped (``DecodeGraph.close()``, or the graph object
    deleted)."""

    def __init__(self, message: str, graphs: int = 0) -> None:
        super().__init__(message, views=0)
        self.graphs = graphs


class ReleasedError(KvvmError):
    """The object was closed (released for good) and cannot be used any more."""


class NotCommittedError(KvvmError, IndexError):
    """Tokens were read or written past the committed ones (call ``ensure`` first)."""


class WriteIntoSharedPrefixError(KvvmError, PermissionError):
    """A write into the read-only shared prefix of a sequence (no copy-on-write)."""


class NotShareableError(KvvmError):
    """The prefix cannot be shared under this layout and granule; the message says why."""


class PrefixNotWrittenError(KvvmError):
    """A prefix was published or attached before its tokens were written and sealed."""
