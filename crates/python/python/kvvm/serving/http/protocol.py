"""OpenAI's request bodies, checked and turned into engine requests (:class:`Job`), and the
response and chunk bodies built from what the engine produced (``docs/server.md``).

Every refusal is an :class:`~kvvm.serving.http.errors.ApiError` naming the field at fault.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from ..params import MAX_TOP_LOGPROBS, SamplingParams
from ..stream import TokenLogprob
from .errors import ApiError, invalid

__all__ = ["Job", "parse_chat", "parse_completion", "logprobs_chat", "logprobs_completion"]

#: The most sequences one request may ask for (``n``, times its prompts).
MAX_CHOICES = 128
#: The most stop strings (OpenAI's limit).
MAX_STOP = 4


@dataclass
class Job:
    """One HTTP request as the engine takes it: its prompts (token ids), each sampled ``n``
    times with ``sampling`` for at most ``max_tokens`` tokens."""

    prompts: list[list[int]]
    max_tokens: int
    n: int
    stream: bool
    include_usage: bool
    sampling: SamplingParams
    #: Alternatives per token (-1: no log-probabilities).
    top_logprobs: int
    return_token_ids: bool


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not lo <= float(value) <= hi:
        raise invalid(f"{key} must be a number in [{lo}, {hi}], not {value!r}", key)
    return float(value)


def _int(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise invalid(f"{key} must be an integer {bound}, not {value!r}", key)
    return value


def _bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"{key} must be a boolean, not {value!r}", key)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise invalid(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    return tuple(stop)


def _unsupported(body: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = body.get(key)
        if value not in (None, False, [], {}, ""):
            raise invalid(f"{key} is not supported by this server", key, "unsupported_parameter")


def _sampling(body: dict[str, Any], top: int, tokenizer: Any) -> SamplingParams:
    stop = _stop(body)
    if stop and tokenizer is None:
        raise invalid("stop strings need a tokenizer; this model has none (use stop_token_ids)", "stop")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise invalid("stop_token_ids must be a list of non-negative integers", "stop_token_ids")
    top_k = _int(body, "top_k", 0, -1)
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=0 if top_k in (None, -1) else int(top_k),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-6, 100.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        seed=_int(body, "seed", None, -(2**63), 2**63 - 1),
        stop_token_ids=tuple(ids),
        stop=stop,
        ignore_eos=_bool(body, "ignore_eos"),
        logprobs=top >= 0,
        top_logprobs=max(top, 0),
    )


def _check_length(prompts: list[list[int]], max_tokens: int, max_len: int) -> None:
    for p in prompts:
        if not p:
            raise invalid("a prompt must hold at least one token", "prompt")
        if len(p) + max_tokens > max_len:
            raise invalid(
                f"this model's context is {max_len} tokens; the prompt holds {len(p)} and max_tokens asks for "
                f"{max_tokens} more", "max_tokens" if len(p) < max_len else "prompt", "context_length_exceeded",
            )


def _common(body: dict[str, Any], prompts: list[list[int]], default_max: int | None, max_len: int, top: int,
            tokenizer: Any, max_key: str = "max_tokens") -> Job:
    n = _int(body, "n", 1, 1, MAX_CHOICES)
    assert n is not None
    if n * len(prompts) > MAX_CHOICES:
        raise invalid(f"at most {MAX_CHOICES} sequences a request (prompts x n)", "n")
    longest = max((len(p) for p in prompts), default=0)
    fallback = default_max if default_max is not None else max(1, max_len - longest)
    max_tokens = _int(body, max_key, None, 1) if body.get(max_key) is not None else _int(body, "max_tokens", fallback, 1)
    assert max_tokens is not None
    _check_length(prompts, max_tokens, max_len)
    stream = _bool(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or (options and not stream):
        raise invalid("stream_options needs stream: true and is an object", "stream_options")
    best_of = body.get("best_of")
    if best_of not in (None, n):
        raise invalid("best_of is not supported (only best_of == n)", "best_of", "unsupported_parameter")
    return Job(prompts, max_tokens, n, stream, bool(options.get("include_usage")), _sampling(body, top, tokenizer),
               top, _bool(body, "return_token_ids"))


def _prompts(prompt: Any, tokenizer: Any) -> list[list[int]]:
    """A completion's ``prompt``: a string, a list of strings, a list of token ids, or a list
    of lists of token ids."""
    def ids(p: Any) -> list[int]:
        if isinstance(p, str):
            if tokenizer is None:
                raise invalid("this model has no tokenizer: send the prompt as token ids", "prompt")
            return list(tokenizer(p)["input_ids"])
        if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        raise invalid("prompt must be a string, a list of strings, token ids or lists of token ids", "prompt")

    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return [ids(prompt)]
    if isinstance(prompt, list) and prompt:
        return [ids(p) for p in prompt]
    raise invalid("prompt must be a non-empty string or list", "prompt")


def parse_completion(body: dict[str, Any], tokenizer: Any, max_len: int) -> Job:
    """A ``/v1/completions`` body."""
    _unsupported(body, ("echo", "suffix", "logit_bias"))
    if "prompt" not in body:
        raise invalid("prompt is required", "prompt")
    top = _int(body, "logprobs", -1, 0, MAX_TOP_LOGPROBS)
    assert top is not None
    return _common(body, _prompts(body["prompt"], tokenizer), 16, max_len, top, tokenizer)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise invalid(f"messages[{i}] needs a role of system, developer, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise invalid(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise invalid(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


def parse_chat(body: dict[str, Any], tokenizer: Any, max_len: int) -> Job:
    """A ``/v1/chat/completions`` body: its messages through the tokenizer's chat template."""
    _unsupported(body, ("tools", "functions", "tool_choice", "function_call", "logit_bias", "audio", "prediction"))
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise invalid("response_format: only {\"type\": \"text\"} is supported", "response_format", "unsupported_parameter")
    messages = _messages(body)
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise invalid("this model has no chat template: use /v1/completions", "messages")
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    wants = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) if wants else -1
    if not wants and body.get("top_logprobs") is not None:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    assert top is not None
    return _common(body, [list(enc["input_ids"])], None, max_len, top, tokenizer, "max_completion_tokens")


def token_text(tokenizer: Any, token: int) -> str:
    """A token as OpenAI's logprobs show it: its text, or ``token_id:N`` without a tokenizer."""
    return f"token_id:{token}" if tokenizer is None else str(tokenizer.decode([token]))


def logprobs_completion(tokenizer: Any, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The ``logprobs`` of a completion choice (or chunk) starting at text ``offset``."""
    tokens = [token_text(tokenizer, lp.token) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t) if tokenizer is not None else 0
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{token_text(tokenizer, i): v for i, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def logprobs_chat(tokenizer: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    """The ``logprobs`` of a chat choice (or chunk)."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in lps]}
