"""How one request is sampled: :class:`SamplingParams`, checked once at submission.

Torch-free: the scheduler, the HTTP front and their tests use it without a model. The runner's
:class:`~kvvm.serving.sampling.Sampler` applies it on the device.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import InvalidArgumentError

__all__ = ["MAX_TOP_LOGPROBS", "SamplingParams"]

#: The most alternatives :attr:`SamplingParams.top_logprobs` may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


def _number(value: Any, name: str, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``value`` as a finite float in ``[lo, hi]`` (``(lo, hi]`` when ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a number, not {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise InvalidArgumentError(f"{name} must be finite and in {bound}, not {value}")
    return v


def _int(value: Any, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{name} must be an int, not {value!r} ({type(value).__name__})")
    v = int(value)
    if v < lo or (hi is not None and v > hi):
        raise InvalidArgumentError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], not {value}")
    return v


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are chosen, and when it stops.

    The default is greedy decoding. Every field is checked by :meth:`checked` (the engine calls
    it at ``submit``); a refusal is an :class:`~kvvm.errors.InvalidArgumentError` naming the
    field.

    Attributes:
        temperature: 0 (greedy) or a positive divisor of the logits.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (1: all).
        top_k: keep the ``top_k`` likeliest tokens (0: all).
        min_p: keep the tokens at least ``min_p`` times as likely as the likeliest (0: all).
        repetition_penalty: logits of tokens in the prompt or the output so far are divided
            by it when positive and multiplied by it when negative (1: none; CTRL's rule).
        presence_penalty: subtracted once from the logit of every token already generated.
        frequency_penalty: subtracted from a token's logit once per time it was generated.
        seed: the request's own seed: the same request with the same seed samples the same
            tokens, whatever runs beside it (None: one drawn from the engine's seed).
        stop_token_ids: tokens that end the request (besides the engine's end tokens),
            finish reason ``"stop"``; the token is kept in ``tokens``.
        stop: strings that end the request when its text contains one (needs the engine's
            tokenizer); the text is cut before the string.
        ignore_eos: do not stop at the engine's end tokens (``stop_token_ids`` still stop).
        logprobs: record the log-probability of each chosen token.
        top_logprobs: with it, the ``top_logprobs`` likeliest tokens and theirs (0 to 20).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        """Whether the token is the argmax of the (penalized) logits."""
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any repetition, presence or frequency penalty applies."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @functools.cached_property
    def plain(self) -> bool:
        """Whether a row of this request needs nothing but the argmax of its raw logits:
        greedy, no penalty, no log-probabilities (the sampler's fast path; computed once)."""
        return self.greedy and not self.penalized and not self.logprobs

    @property
    def truncated(self) -> bool:
        """Whether top-p or top-k cut the distribution (they need a sort of the vocabulary)."""
        return self.top_p < 1.0 or self.top_k > 0

    def with_seed(self, seed: int) -> SamplingParams:
        """A copy with ``seed`` (a sibling sequence of ``n`` takes ``seed + i``)."""
        return replace(self, seed=seed)

    def checked(self, vocab_size: int | None = None) -> SamplingParams:
        """A copy with every field checked and normalised (floats as floats, stop strings
        and tokens as tuples); :class:`~kvvm.errors.InvalidArgumentError` otherwise."""
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise InvalidArgumentError("stop must be a string or a list of strings")
        if any(not s for s in stop):
            raise InvalidArgumentError("a stop string must not be empty")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise InvalidArgumentError("stop_token_ids must be a list of ints")
        checked_ids = tuple(_int(t, "stop_token_ids[]", 0, None if vocab_size is None else vocab_size - 1) for t in ids)
        seed = None if self.seed is None else _int(self.seed, "seed", -(2**63), 2**63 - 1)
        if not isinstance(self.logprobs, bool) or not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError("logprobs and ignore_eos must be booleans")
        return SamplingParams(
            temperature=_number(self.temperature, "temperature", 0.0, math.inf),
            top_p=_number(self.top_p, "top_p", 0.0, 1.0, lo_open=True),
            top_k=_int(self.top_k, "top_k", 0),
            min_p=_number(self.min_p, "min_p", 0.0, 1.0),
            repetition_penalty=_number(self.repetition_penalty, "repetition_penalty", 0.0, math.inf, lo_open=True),
            presence_penalty=_number(self.presence_penalty, "presence_penalty", -2.0, 2.0),
            frequency_penalty=_number(self.frequency_penalty, "frequency_penalty", -2.0, 2.0),
            seed=seed,
            stop_token_ids=checked_ids,
            stop=tuple(stop),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            top_logprobs=_int(self.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS),
        )
