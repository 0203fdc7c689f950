"""A request's output as text: incremental detokenization and stop strings
(:class:`Detokenizer`).

A token is decoded in the context of the few tokens before it (the prompt's last ones at
first), as text-generation-inference and vLLM do: the text a new token adds is the decode of
the window with it less the decode of the window without it, and a token that ends inside a
multi-byte character (the decode ends with U+FFFD) adds nothing until the character is whole.
So the streamed text is the decode of the output, piece by piece, whatever the tokenizer's
pre-tokenizer does with spaces.

Stop strings are looked for in the text as it grows (a string that straddles tokens is
found); the text is cut before the first match. Until the request finishes, the last
``longest stop string - 1`` characters are held back from the published text: they could be
the start of a stop string.

Torch-free; the tokenizer is a transformers tokenizer (``decode``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Detokenizer"]

#: Prompt tokens decoded before the first output token (its leading space, a merged byte).
CONTEXT_TOKENS = 5


class Detokenizer:
    """Decodes one request's output as it grows and finds its stop strings.

    Args:
        tokenizer: has ``decode(ids, skip_special_tokens=...)``.
        prompt: the request's prompt (its last tokens are the first context).
        stop: the stop strings (may be empty).
        skip_special_tokens: leave special tokens (an end token) out of the text.
    """

    def __init__(self, tokenizer: Any, prompt: list[int], stop: tuple[str, ...], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip = skip_special_tokens
        self._ids = list(prompt[-CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""
        #: Where the text was cut by a stop string (None: no stop string matched).
        self.stopped_at: int | None = None
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._searched = 0
        #: Output tokens taken so far.
        self.added = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip))

    def add(self, tokens: list[int]) -> bool:
        """Appends ``tokens``' text; returns True when a stop string matched (the text is then
        cut before it and nothing more is added)."""
        self.added += len(tokens)
        if self.stopped_at is not None:
            return True
        for t in tokens:
            self._ids.append(t)
            before = self._decode(self._ids[self._prefix : self._read])
            after = self._decode(self._ids[self._prefix :])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before) :]
                self._prefix, self._read = self._read, len(self._ids)
            if self.stop and self._find_stop():
                return True
        return False

    def _find_stop(self) -> bool:
        """Cuts the text before the first stop string in it, if any."""
        start = max(0, self._searched - self._hold)
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        self._searched = len(self.text)
        if not found:
            return False
        self.stopped_at = min(found)
        self.text = self.text[: self.stopped_at]
        return True

    def safe_length(self, finished: bool) -> int:
        """How much of the text can be published: all of it once finished, else all but the
        characters that could open a stop string."""
        if finished or self.stopped_at is not None:
            return len(self.text)
        return max(0, len(self.text) - self._hold)
