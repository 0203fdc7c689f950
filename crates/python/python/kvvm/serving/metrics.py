"""What the engine measures for an operator (:class:`EngineMetrics`), in the Prometheus text
format (version 0.0.4), as ``kvvm serve`` and the broker write theirs.

The engine's loop records each request's arrival, first token, each later token and its end;
the HTTP server adds its own counters and renders both (``docs/server.md``, metrics).
Torch-free; thread-safe (the loop records, another thread renders).
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Iterable

__all__ = ["EngineMetrics", "Histogram", "render_counter", "render_gauge"]

#: Buckets (seconds) of the time to first token.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
#: Buckets (seconds) of the time between two tokens of a request.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
#: Buckets (seconds) of a request's whole time, arrival to end.
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def _num(value: float) -> str:
    """A sample value, exact (an integer as an integer, never in exponent form)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


def render_counter(name: str, help_text: str, values: Iterable[tuple[dict[str, str], float]]) -> str:
    """A counter family in the text format."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
    lines += [f"{name}{_labels(labels)} {_num(value)}" for labels, value in values]
    return "\n".join(lines) + "\n"


def render_gauge(name: str, help_text: str, value: float) -> str:
    """One gauge in the text format."""
    return f"# HELP {name} {help_text}\n# TYPE {name} gauge\n{name} {_num(value)}\n"


class Histogram:
    """A Prometheus histogram: cumulative buckets, sum and count."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Counts ``value`` in the first bucket whose bound it does not exceed (past the
        last bound: the ``+Inf`` bucket) and adds it to the sum."""
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        """Values observed so far."""
        return sum(self.counts)

    def render(self, name: str, help_text: str) -> str:
        """The histogram in Prometheus's text format under ``name``: its help and type lines,
        a cumulative ``_bucket`` line a bound (``+Inf`` last), ``_sum`` and ``_count``."""
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        total = 0
        for bound, n in zip(self.buckets, self.counts, strict=False):
            total += n
            lines.append(f'{name}_bucket{{le="{bound:g}"}} {total}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.sum:.6f}")
        lines.append(f"{name}_count {self.count}")
        return "\n".join(lines) + "\n"


class EngineMetrics:
    """Requests, tokens and latencies the engine's loop recorded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.submitted = 0
        self.finished: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def on_submit(self, prompt_tokens: int) -> None:
        """Records a request submitted with ``prompt_tokens`` tokens of prompt."""
        with self._lock:
            self.submitted += 1
            self.prompt_tokens += prompt_tokens

    def on_tokens(self, new: int, first: bool, since: float) -> None:
        """``new`` tokens of one request arrived ``since`` seconds after its previous one (its
        submission for the first): the first is its TTFT, the others share the gap."""
        self.record([(new, first, since)], [])

    def on_finish(self, reason: str, seconds: float) -> None:
        """A request finished with ``reason``, ``seconds`` after its submission."""
        self.record([], [(reason, seconds)])

    def record(self, tokens: list[tuple[int, bool, float]], finished: list[tuple[str, float]]) -> None:
        """A step's :meth:`on_tokens` (``(new, first, since)`` each) and :meth:`on_finish`
        (``(reason, seconds)`` each) of every request, under one lock."""
        if not tokens and not finished:
            return
        with self._lock:
            for new, first, since in tokens:
                self._tokens(new, first, since)
            for reason, seconds in finished:
                self.finished[reason] += 1
                self.e2e.observe(seconds)

    def _tokens(self, new: int, first: bool, since: float) -> None:
        if new <= 0:
            return
        self.generated_tokens += new
        if first:
            self.ttft.observe(since)
            new -= 1
            since = 0.0
        if new == 1:
            self.itl.observe(since)  # a decode step's token: its whole gap
            return
        for _ in range(new):
            self.itl.observe(since / new)

    def render(self, prefix: str = "kvvm_engine") -> str:
        """The engine's counters and histograms in the text format."""
        with self._lock:
            return "".join([
                render_counter(f"{prefix}_requests_submitted_total", "Requests accepted by the engine.", [({}, self.submitted)]),
                render_counter(f"{prefix}_requests_finished_total", "Requests finished, by finish reason.",
                               [({"reason": k}, v) for k, v in sorted(self.finished.items())] or [({"reason": "stop"}, 0)]),
                render_counter(f"{prefix}_prompt_tokens_total", "Prompt tokens of the requests accepted.", [({}, self.prompt_tokens)]),
                render_counter(f"{prefix}_generation_tokens_total", "Tokens generated.", [({}, self.generated_tokens)]),
                self.ttft.render(f"{prefix}_time_to_first_token_seconds", "Submission to first token."),
                self.itl.render(f"{prefix}_inter_token_seconds", "Time between two tokens of a request."),
                self.e2e.render(f"{prefix}_request_seconds", "Submission to finish."),
            ])
