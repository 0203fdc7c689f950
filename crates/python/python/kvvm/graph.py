"""One decode step of a transformers model over a :class:`~kvvm.transformers.KvvmCache`,
captured once as a CUDA graph and replayed at every length.

The cache's K/V never move and each request's length is read on the device, so one capture
serves every step; :class:`DecodeGraph` adds the host's side of each step: before a replay it
makes every request's next token committed and claimed (a growth the budget cannot grant is
raised as :class:`~kvvm.errors.BackpressureError` then, before anything is launched).

::

    use_kvvm_attention(model)
    cache = KvvmCache(model.config, batch_size=16, max_cache_len=8192, backend="cuda")
    for slot, prompt in enumerate(prompts):                    # each request its own length
        with cache.select(slot):
            logits = model(input_ids=prompt[None], past_key_values=cache).logits
        first[slot] = logits[0, -1].argmax()
    step = DecodeGraph(model, cache)                            # compiled, then captured
    tokens = first
    for _ in range(128):
        tokens = step(tokens).argmax(-1)                        # no host sync, no allocation
    step.close()
    cache.release()

Requires torch with CUDA and transformers.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import InvalidArgumentError, ReleasedError
from .transformers import KvvmCache

__all__ = ["DecodeGraph"]


class DecodeGraph:
    """A captured decode step: one token per request of ``cache``, every request at its own
    length.

    Args:
        model: a transformers causal LM attending with the kvvm attention
            (:func:`~kvvm.attention.use_kvvm_attention`).
        cache: its KvvmCache (CUDA), every request already prefilled.
        compile: compile the step with ``torch.compile`` first (fuses the pointwise
            kernels; the graph then replays the compiled kernels). Without it the eager
            step is captured.
        warmup: eager runs before the capture, each of the next token (taken back after
            each: the warm-up needs the windows of one step only).
        slots: the requests the warm-up steps prepare (default: all); the others must be free
            or suspended. Any set of requests may decode afterwards (``slots`` of a call).

    Calling the object runs one step and returns the logits of every request's new token
    (``[batch, vocab]``, a tensor the next call overwrites). :meth:`close` drops the graph
    (until then the cache refuses :meth:`~kvvm.transformers.KvvmCache.release`).
    """

    def __init__(
        self,
        model: Any,
        cache: KvvmCache,
        *,
        compile: bool = True,
        mode: str | None = None,
        warmup: int = 2,
        slots: list[int] | None = None,
    ) -> None:
        if not cache.device_lengths:
            raise InvalidArgumentError(
                "DecodeGraph needs the model to attend with the kvvm attention (use_kvvm_attention(model))"
            )
        device = cache.state.device
        if device.type != "cuda":
            raise InvalidArgumentError(f"DecodeGraph captures CUDA graphs; the cache is on {device}")
        self.model = model
        self.cache = cache
        self.batch = cache.batch_size
        self.tokens = torch.zeros((self.batch, 1), dtype=torch.long, device=device)
        self._fn = torch.compile(self._forward, dynamic=False, mode=mode) if compile else self._forward
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits = self._capture(warmup, slots)

    @torch.no_grad()
    def _forward(self) -> torch.Tensor:
        positions = self.cache.state.positions(1)
        out = self.model(
            input_ids=self.tokens,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def _capture(self, warmup: int, slots: list[int] | None) -> torch.Tensor:
        state = self.cache.state
        snap = state.snapshot()
        side = torch.cuda.Stream(device=state.device)
        side.wait_stream(torch.cuda.current_stream(state.device))
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup)):
                # Each warm-up step writes the same next token (its counts are taken back):
                # the warm-up needs the windows of one step, no more.
                self.cache.prepare(1, slots)
                self._fn()
                self.cache.step_done()
                state.restore(snap)
        torch.cuda.current_stream(state.device).wait_stream(side)
        torch.cuda.synchronize(state.device)
        graph = torch.cuda.CUDAGraph()
        with self.cache.capture(graph), torch.cuda.graph(graph):
            logits = self._fn()
        self.graph = graph
        return logits

    def __call__(self, tokens: torch.Tensor | None = None, slots: list[int] | None = None) -> torch.Tensor:
        """One step: ``tokens`` (``[batch]`` or ``[batch, 1]``, each request's last token;
        default: what is in :attr:`tokens`) in, the next token's logits out. ``slots``: the
        requests that decode (default: all); the others must be free or suspended (the
        step neither writes nor reads them; their logits mean nothing)."""
        if self.graph is None:
            raise ReleasedError("the DecodeGraph was closed")
        self.cache.prepare(1, slots)
        return self.replay(tokens)

    def replay(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One step whose host side is prepared already (``cache.prepare(1, slots)``, which
        is where a growth the budget cannot grant is refused): what :meth:`__call__` runs
        after preparing. A replay nothing prepared writes nothing past the committed windows
        (see :meth:`~kvvm.transformers.KvvmCache.check`)."""
        if self.graph is None:
            raise ReleasedError("the DecodeGraph was closed")
        if tokens is not None:
            self.tokens.copy_(tokens.view(self.batch, 1))
        self.graph.replay()
        self.cache.step_done()
        return self.logits

    def close(self) -> None:
        """Drops the graph: the cache may be released afterwards."""
        if self.graph is not None:
            self.cache.forget_graph(self.graph)
            self.graph.reset()
            self.graph = None

    def __enter__(self) -> DecodeGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
