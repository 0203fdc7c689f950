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

The classes are made by the native module itself when it is imported
(``crates/python/src/exceptions.rs``: their bases, docs and attributes), and the native code
raises them directly; this module is their public home. ``docs/python.md`` has the table of
what raises which.
"""

from __future__ import annotations

from ._native import (
    BackpressureError,
    BusyError,
    DriverError,
    GraphsAliveError,
    InvalidArgumentError,
    KvvmError,
    NeverFitsError,
    NotCommittedError,
    NotShareableError,
    OutOfMemoryError,
    PrefixNotWrittenError,
    ReleasedError,
    TooManyTokensError,
    UnavailableError,
    ViewsAliveError,
    WriteIntoSharedPrefixError,
)

__all__ = [
    "KvvmError", "BackpressureError", "NeverFitsError", "BusyError", "UnavailableError",
    "InvalidArgumentError", "TooManyTokensError", "DriverError", "OutOfMemoryError", "ViewsAliveError",
    "GraphsAliveError", "ReleasedError", "NotCommittedError", "WriteIntoSharedPrefixError",
    "NotShareableError", "PrefixNotWrittenError",
]
