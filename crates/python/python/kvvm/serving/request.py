"""A request of the serving engine, what the engine counts, and the checks a request passes at
submission (:func:`check_request`): what is refused there is never queued, so that one bad
request can never fail a step of the others.

Torch-free: the scheduler and its tests use it without a model.
"""

from __future__ import annotations

import collections
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    import numpy
    import numpy.typing
    import torch

from ..errors import InvalidArgumentError
from .params import SamplingParams
from .channel import OutputChannel, TokenLogprob

#: A prompt's token ids as :func:`check_token_ids` accepts them: a list or tuple of ints, or a
#: 1-D integer torch tensor or numpy array.
TokenIds = Union[Sequence[int], "torch.Tensor", "numpy.typing.NDArray[numpy.integer[Any]]"]

__all__ = [
    "HIT_TIMES_KEPT",
    "EngineStats",
    "Request",
    "TokenIds",
    "check_eos",
    "check_positive",
    "check_temperature",
    "check_token_ids",
]

#: Prefix-hit timings :class:`EngineStats` keeps.
HIT_TIMES_KEPT = 4096


@dataclass(eq=False)
class Request:
    """One request and what became of it. ``tokens`` grows as the engine generates;
    ``finish_reason`` is ``"stop"`` (an end token, a stop token or a stop string),
    ``"length"`` (``max_new_tokens`` or the cache's length), ``"memory"`` (its prompt can
    never fit the budget, or, alone in the batch, it still could not grow), ``"cancelled"``
    (:meth:`Engine.cancel <kvvm.serving.engine.Engine.cancel>`) or ``"error"`` (the engine's
    background loop failed; :attr:`error` says how).

    ``sampling`` says how its tokens are chosen (``temperature`` is its temperature, kept for
    the callers that read it); ``logprobs`` holds, per token, its log-probability and the
    top alternatives when ``sampling.logprobs`` asks for them; ``text`` is the detokenized
    output when the engine has a tokenizer and the request wants text (cut before a stop
    string). A consumer reads a consistent state through :attr:`channel`
    (``docs/engine.md``, streaming)."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    eos: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    #: Prompt tokens found in the prefix cache at the last admission.
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    slot: int | None = None
    #: The tokens to prefill (the prompt, then after a preemption the prompt and the tokens
    #: generated so far) and how many of them are in the cache.
    _context: list[int] = field(default_factory=list)
    _filled: int = 0
    #: The admission's rank (-1: never admitted); the youngest running request has the
    #: highest.
    _admitted: int = -1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: The seed of its sampling noise (the request's own, or one drawn from the engine's).
    seed: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    #: Whether the engine detokenizes its output into :attr:`text` (needs a tokenizer).
    detokenize: bool = False
    text: str = ""
    #: Why the engine's loop failed, for ``finish_reason == "error"``.
    error: BaseException | None = None
    #: What consumers read: the published state and the wake-ups (``stream.py``).
    channel: OutputChannel = field(default_factory=OutputChannel)
    #: Called from the engine's loop with each :class:`~kvvm.serving.stream.Delta`.
    on_output: Callable[[Request, Any], None] | None = None
    #: ``time.monotonic()`` at submission and at its last token (the engine's metrics).
    submitted_at: float = 0.0
    last_token_at: float = 0.0

    def __post_init__(self) -> None:
        if not self._context:
            self._context = list(self.prompt)
        if self.temperature and self.sampling.temperature != self.temperature:
            self.sampling = SamplingParams(temperature=self.temperature)

    @property
    def done(self) -> bool:
        """Whether the request finished."""
        return self.finish_reason is not None

    @property
    def prefilled(self) -> bool:
        """Whether its context is all in the cache (it decodes); False while it waits or
        prefills."""
        return self.slot is not None and self._filled >= len(self._context)

    @property
    def remaining_prefill(self) -> int:
        """Context tokens still to prefill."""
        return len(self._context) - self._filled


@dataclass
class EngineStats:
    """What the engine did so far."""

    steps: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    #: Forwards those chunks took (requests in consecutive slots whose chunks have one length
    #: share one).
    prefill_forwards: int = 0
    generated_tokens: int = 0
    admitted: int = 0
    finished: int = 0
    preempted: int = 0
    #: Preemptions that swapped the request's KV to the host (the rest recompute it), swaps
    #: brought back at admission, and swaps that failed on the way back (recomputed).
    swapped_out: int = 0
    swapped_in: int = 0
    swap_fallbacks: int = 0
    #: Host milliseconds the swaps out and back took (their copies waited for).
    swap_out_ms: float = 0.0
    swap_in_ms: float = 0.0
    admission_refusals: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    #: Of those, the hits (and their tokens) copied back from the prefix cache's host level
    #: instead of mapped from the device.
    prefix_host_hits: int = 0
    prefix_host_hit_tokens: int = 0
    #: Requests finished by :meth:`Engine.cancel <kvvm.serving.engine.Engine.cancel>`
    #: (waiting or running).
    cancelled: int = 0
    #: Admissions put off because the request's prefix was being prefilled by another.
    prefix_waits: int = 0
    #: The last :data:`HIT_TIMES_KEPT` prefix-cache lookups that hit: (tokens hit, ms the
    #: admission's lookup and mapping took on the host, the rest of the prompt's commit
    #: included). Bounded: an engine that serves for days keeps the recent ones only.
    prefix_hit_ms: collections.deque[tuple[int, float]] = field(
        default_factory=lambda: collections.deque(maxlen=HIT_TIMES_KEPT)
    )


def _is_int(x: object) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _array_ids(token_ids: Any) -> list[Any] | None:
    """The ids of a 1-D integer torch tensor or numpy array, as a list (None: not an array).
    Anything else with dimensions is refused."""
    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    if torch is not None and isinstance(token_ids, torch.Tensor):
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise InvalidArgumentError(f"token ids must be integers, not a tensor of {token_ids.dtype}")
    elif numpy is not None and isinstance(token_ids, numpy.ndarray):
        if token_ids.dtype.kind not in "iu":
            raise InvalidArgumentError(f"token ids must be integers, not an array of {token_ids.dtype}")
    else:
        return None
    if token_ids.ndim != 1:
        raise InvalidArgumentError(
            f"token ids must be one dimension (one request's prompt), not a shape of {tuple(token_ids.shape)}: "
            "pass input_ids[0] for one row of a batch"
        )
    return list(token_ids.tolist())


def check_token_ids(token_ids: Any, vocab_size: int | None, what: str = "token ids") -> list[int]:
    """``token_ids`` as a new list of Python ints, each in ``[0, vocab_size)``.

    Accepted: a list or tuple of integers, or a 1-D integer torch tensor or numpy array
    (converted with ``tolist()``, copied off the device). Refused with
    :class:`~kvvm.errors.InvalidArgumentError`: a string or bytes, any other iterable, a
    float, a bool, an id out of the vocabulary, an empty prompt."""
    ids = _array_ids(token_ids)
    if ids is None:
        if not isinstance(token_ids, (list, tuple)):
            raise InvalidArgumentError(
                f"{what} must be a list of ints (or a 1-D integer tensor), not {type(token_ids).__name__}"
            )
        ids = list(token_ids)
    if ids and set(map(type, ids)) == {int} and min(ids) >= 0 and (vocab_size is None or max(ids) < vocab_size):
        return ids  # the common case, checked at C speed
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise InvalidArgumentError(f"{what}[{i}] is {t!r} ({type(t).__name__}), not an int")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise InvalidArgumentError(f"{what}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in ids]


def check_eos(eos: Any, vocab_size: int | None) -> frozenset[int]:
    """End tokens: None (none), an int, or a list, tuple or set of ints, each in the
    vocabulary."""
    if eos is None:
        return frozenset()
    if _is_int(eos):
        eos = [eos]
    elif isinstance(eos, (set, frozenset)):
        eos = sorted(eos)
    elif not isinstance(eos, (list, tuple)):
        raise InvalidArgumentError(f"eos_token_ids must be an int or a list of ints, not {type(eos).__name__}")
    return frozenset(check_token_ids(list(eos), vocab_size, "eos_token_ids"))


def check_positive(value: Any, name: str, minimum: int = 1) -> int:
    """``value`` as an int of at least ``minimum`` (an int, not a float or a bool)."""
    if not _is_int(value):
        raise InvalidArgumentError(f"{name} must be an int, not {value!r} ({type(value).__name__})")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be at least {minimum}, not {value}")
    return int(value)


def check_temperature(temperature: Any) -> float:
    """A finite, non-negative sampling temperature (0: greedy)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise InvalidArgumentError(f"temperature must be a number, not {type(temperature).__name__}")
    t = float(temperature)
    if not math.isfinite(t) or t < 0:
        raise InvalidArgumentError(f"temperature must be finite and non-negative, not {temperature}")
    return t

