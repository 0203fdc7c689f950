"""Sampling on the device, per request (:class:`Sampler`): one batched pass over a step's rows
of logits, each row with its own :class:`~kvvm.serving.params.SamplingParams`.

In order, for the rows that ask for each:

1. **penalties**: repetition (CTRL's rule over the prompt's and the output's tokens),
   presence and frequency (over the output's), from per-slot state kept on the device (a
   count of each output token, a mask of the prompt's), set when a request's first token is
   sampled and moved by every token sampled after;
2. **greedy** rows take the argmax of the penalized logits;
3. the others are divided by their **temperature**, cut by **top-k**, **top-p** (one sort of
   the vocabulary, only when a row asks for either) and **min-p**, and sampled by the
   Gumbel-max rule: the argmax of the logits plus Gumbel noise. The noise of a token is a hash
   of (the request's seed, the token's index in the output, the token id): a request with a
   seed samples the same tokens whatever else runs beside it, in whichever slot, and across a
   preemption;
4. **log-probabilities** (the log-softmax of the raw logits) of the chosen token and the
   ``top_logprobs`` likeliest, when a row asks for them.

No step of it reads the device from the host: the tokens (and log-probabilities) of every
row of a step are read back in one copy (:func:`to_host`), the engine's one sync a step. A
row whose scaled logits are not finite (a temperature so small that they overflow) takes its
greedy token: one request's numbers never fail the step of the others.

Requires torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request
from .channel import TokenLogprob

__all__ = ["Sampled", "Sampler", "to_host"]

_MASK32 = 0xFFFFFFFF


def _mix(seed: int, index: int) -> int:
    """A 32-bit hash of a request's seed and a token's index in its output (host side)."""
    x = (seed ^ (seed >> 32)) & _MASK32
    x = (x * 0x9E3779B1 + index * 0x85EBCA77 + 0x165667B1) & _MASK32
    x ^= x >> 15
    return (x * 0x2C1B3C6D) & _MASK32


def gumbel_noise(bases: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` Gumbel noise, a pure function of each row's 32-bit base and the token
    id (a lowbias32-style integer hash in int64: every product stays below 2**63)."""
    ids = torch.arange(vocab, device=bases.device, dtype=torch.int64)
    x = (bases[:, None] + ids[None] * 0x27D4EB2F) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    x = x ^ (x >> 16)
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


@dataclass
class Sampled:
    """A step's sampled rows on the device: ``tokens`` ``[rows]`` and, when a row asked for
    them, ``logprobs`` ``[rows, 1 + 2 * top]`` (the chosen token's log-probability, then the
    ``top`` likeliest ids and theirs); ``asks[i]``: how many alternatives row ``i`` wants
    (-1: no log-probabilities)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None
    asks: list[int]


def to_host(parts: list[Sampled]) -> list[tuple[list[int], list[TokenLogprob | None]]]:
    """Each part's tokens and log-probabilities on the host, in one copy off the device."""
    if not parts:
        return []
    if all(p.logprobs is None for p in parts):
        joined = parts[0].tokens if len(parts) == 1 else torch.cat([p.tokens for p in parts])
        flat: list[int] = joined.tolist()  # int64: Python ints
        out: list[tuple[list[int], list[TokenLogprob | None]]] = []
        at = 0
        for p in parts:
            n = len(p.asks)
            out.append((flat[at : at + n], [None] * n))
            at += n
        return out
    top = max((p.logprobs.shape[1] - 1) // 2 for p in parts if p.logprobs is not None)
    rows = []
    for p in parts:
        n = len(p.asks)
        lp = p.logprobs if p.logprobs is not None else torch.zeros(n, 1, device=p.tokens.device, dtype=torch.float64)
        have = (lp.shape[1] - 1) // 2
        pad = torch.zeros(n, top - have, device=lp.device, dtype=torch.float64)
        rows.append(torch.cat([p.tokens[:, None].to(torch.float64), lp[:, :1], lp[:, 1 : 1 + have], pad,
                               lp[:, 1 + have :], pad], dim=1))
    table = torch.cat(rows).tolist()
    result, at = [], 0
    for p in parts:
        tokens: list[int] = []
        lps: list[TokenLogprob | None] = []
        for row, ask in zip(table[at : at + len(p.asks)], p.asks, strict=True):
            token = int(row[0])
            tokens.append(token)
            if ask < 0:
                lps.append(None)
                continue
            ids, vals = row[2 : 2 + top], row[2 + top :]
            lps.append(TokenLogprob(token, float(row[1]), tuple((int(i), float(v)) for i, v in zip(ids[:ask], vals[:ask], strict=True))))
        result.append((tokens, lps))
        at += len(p.asks)
    return result


class Sampler:
    """Samples the rows of a step (see the module's text) and keeps the per-slot penalty
    state on ``device``.

    Args:
        slots: the engine's slots (rows of the penalty state).
        device: where the logits are.
        seed: the engine's seed (requests without one draw theirs from it, at submission).
    """

    def __init__(self, slots: int, device: torch.device) -> None:
        self.slots = slots
        self.device = device
        #: Each slot's count of every output token and mask of its prompt's tokens
        #: (``[slots, vocab]``), made when a request first asks for a penalty.
        self._counts: torch.Tensor | None = None
        self._prompt: torch.Tensor | None = None

    def start(self, slot: int, r: Request, vocab: int) -> None:
        """Sets ``slot``'s penalty state for ``r`` before its first token is sampled (its
        prompt's tokens; after a preemption, the output it had too)."""
        if not r.sampling.penalized:
            return
        if self._counts is None or self._counts.shape[1] != vocab:
            self._counts = torch.zeros(self.slots, vocab, dtype=torch.float32, device=self.device)
            self._prompt = torch.zeros(self.slots, vocab, dtype=torch.bool, device=self.device)
        assert self._prompt is not None
        self._counts[slot].zero_()
        self._prompt[slot].zero_()
        self._prompt[slot, torch.tensor(r.prompt, device=self.device)] = True
        if r.tokens:
            self._counts[slot].index_add_(0, torch.tensor(r.tokens, device=self.device),
                                          torch.ones(len(r.tokens), device=self.device))

    def sample(self, logits: torch.Tensor, slots: list[int], reqs: list[Request], indices: list[int]) -> Sampled:
        """Samples row ``i`` of ``logits`` (``[rows, vocab]``) for ``reqs[i]`` in
        ``slots[i]``, as its output's token ``indices[i]``."""
        params = [r.sampling for r in reqs]
        if all(p.plain for p in params):
            # Greedy rows without penalties or log-probabilities: the argmax alone.
            tokens = logits.argmax(-1)
            self._count(tokens, slots)
            return Sampled(tokens, None, [-1] * len(params))
        asks = [p.top_logprobs if p.logprobs else -1 for p in params]
        slot_index = torch.tensor(slots, device=logits.device) if self._counts is not None else None
        simple = all(p.greedy and not p.penalized for p in params)
        x = logits if simple else logits.float()
        if not simple and any(p.penalized for p in params):
            x = self._penalize(x, slot_index, params)
        greedy = x.argmax(-1)
        tokens = greedy if all(p.greedy for p in params) else self._draw(x, greedy, params, reqs, indices)
        self._count(tokens, slots, slot_index)
        return Sampled(tokens, self._logprobs(logits, tokens, asks) if max(asks) >= 0 else None, asks)

    def _count(self, tokens: torch.Tensor, slots: list[int], index: torch.Tensor | None = None) -> None:
        """Counts each slot's token in its penalty state (once a request asked for one);
        ``index``: ``slots`` on the device, when made already."""
        if self._counts is not None:
            index = torch.tensor(slots, device=tokens.device) if index is None else index
            self._counts.index_put_((index, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)

    def _penalize(self, x: torch.Tensor, slot_index: torch.Tensor | None, params: list) -> torch.Tensor:
        """Repetition, presence and frequency penalties from the slots' state."""
        assert self._counts is not None and self._prompt is not None and slot_index is not None
        counts = self._counts.index_select(0, slot_index)
        made = counts > 0
        seen = made | self._prompt.index_select(0, slot_index)
        dev = x.device
        rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
        freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        return x - freq * counts - pres * made.float()

    def _draw(self, x: torch.Tensor, greedy: torch.Tensor, params: list, reqs: list[Request], indices: list[int]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then Gumbel-max; greedy rows (and rows whose
        scaled logits are not finite) keep ``greedy``."""
        dev = x.device
        vocab = x.shape[-1]
        temp = torch.tensor([p.temperature or 1.0 for p in params], device=dev)[:, None]
        xt = x / temp
        finite = torch.isfinite(xt).all(-1)
        if any(p.truncated for p in params):
            xt = self._truncate(xt, params)
        elif any(p.min_p > 0 for p in params):
            probs = torch.softmax(xt, -1)
            min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
            xt = xt.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
        bases = torch.tensor([_mix(r.seed, i) for r, i in zip(reqs, indices, strict=True)], device=dev, dtype=torch.int64)
        drawn = (xt + gumbel_noise(bases, vocab)).argmax(-1)
        hot = torch.tensor([not p.greedy for p in params], device=dev) & finite
        return torch.where(hot, drawn, greedy)

    def _truncate(self, xt: torch.Tensor, params: list) -> torch.Tensor:
        """Top-k, top-p and min-p over one sort of each row (the likeliest token always
        stays)."""
        dev = xt.device
        vocab = xt.shape[-1]
        ordered, order = xt.sort(-1, descending=True)
        probs = torch.softmax(ordered, -1)
        ranks = torch.arange(vocab, device=dev)[None]
        k = torch.tensor([p.top_k or vocab for p in params], device=dev)[:, None]
        top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
        min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
        cut = (ranks >= k) | ((probs.cumsum(-1) - probs) >= top_p) | (probs < min_p * probs[:, :1])
        cut[:, 0] = False
        ordered = ordered.masked_fill(cut, float("-inf"))
        return torch.full_like(xt, float("-inf")).scatter_(1, order, ordered)

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, asks: list[int]) -> torch.Tensor:
        """``[rows, 1 + 2 * top]``: the chosen token's log-probability, the ``top`` likeliest
        ids and their log-probabilities (float64, read back with the tokens)."""
        lp = torch.log_softmax(logits.float(), -1)
        chosen = lp.gather(1, tokens[:, None])
        top = max(asks)
        if top <= 0:
            return chosen.to(torch.float64)
        vals, ids = lp.topk(top, dim=-1)
        return torch.cat([chosen.double(), ids.double(), vals.double()], dim=1)
