"""Per-request sampling: the sampler alone on hand-made logits (truncations keep only what
they allow, the Gumbel-max draw follows the distribution, penalties move what they should),
then through the engine on a tiny random Llama on the host backend (a seed reproduces a
request's tokens whatever runs beside it, truncations that keep one token are greedy,
log-probabilities are the reference's, stop tokens and ``n`` sequences sharing their prompt),
and the detokenizer's stop strings over a byte-level tokenizer. Every draw is seeded: each
test gives the same result on every run."""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING

import pytest

import kvvm
from conftest import host_available

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch", reason="skipped: no torch")
    pytest.importorskip("transformers", reason="skipped: no transformers")

from kvvm.engine import Engine  # noqa: E402
from kvvm.serving.params import SamplingParams  # noqa: E402
from kvvm.serving.request import Request  # noqa: E402
from kvvm.serving.sampling import Sampler, to_host  # noqa: E402
from kvvm.serving.text import Detokenizer  # noqa: E402
from test_engine import VOCAB, prompts, reference, tiny  # noqa: E402

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")

CPU = torch.device("cpu")


def _rows(probs: list[float], rows: int) -> torch.Tensor:
    return torch.tensor([probs] * rows).log()


def _draw(logits: torch.Tensor, params: SamplingParams, seeds: list[int] | None = None) -> list[int]:
    n = logits.shape[0]
    reqs = [Request(i, [0], 1, sampling=params, seed=(seeds[i] if seeds else i)) for i in range(n)]
    sampler = Sampler(n, CPU)
    tokens, _ = to_host([sampler.sample(logits, list(range(n)), reqs, [0] * n)])[0]
    return tokens


def test_the_gumbel_draw_follows_the_distribution() -> None:
    counts = collections.Counter(_draw(_rows([0.5, 0.3, 0.2], 4000), SamplingParams(temperature=1.0)))
    for token, p in enumerate([0.5, 0.3, 0.2]):
        assert abs(counts[token] / 4000 - p) < 0.04, counts
    # Temperature 0.5 squares the odds: 25:9:4.
    counts = collections.Counter(_draw(_rows([0.5, 0.3, 0.2], 4000), SamplingParams(temperature=0.5)))
    assert abs(counts[0] / 4000 - 25 / 38) < 0.04, counts


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
        (SamplingParams(temperature=1.0, top_p=0.6), {0, 1}),
        (SamplingParams(temperature=1.0, top_p=0.4), {0}),
        (SamplingParams(temperature=1.0, min_p=0.5), {0, 1}),
        (SamplingParams(temperature=1.0, min_p=0.5, top_k=3), {0, 1}),
    ],
)
def test_truncations_keep_only_what_they_allow(params: SamplingParams, allowed: set[int]) -> None:
    got = collections.Counter(_draw(_rows([0.45, 0.3, 0.15, 0.1], 600), params))
    assert set(got) == allowed, got


def test_penalties_move_the_tokens_already_seen() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.5, -1.0]])
    sampler = Sampler(2, CPU)

    def greedy_after(params: SamplingParams, prompt: list[int], output: list[int]) -> int:
        r = Request(0, prompt, 4, sampling=params, tokens=list(output))
        sampler.start(1, r, 4)
        tokens, _ = to_host([sampler.sample(logits, [1], [r], [len(output)])])[0]
        return tokens[0]

    assert greedy_after(SamplingParams(), [1], []) == 1
    assert greedy_after(SamplingParams(repetition_penalty=2.0), [1], []) == 2  # 2.0 / 2 < 1.5
    assert greedy_after(SamplingParams(repetition_penalty=2.0), [0], []) == 1
    assert greedy_after(SamplingParams(frequency_penalty=0.3), [0], [1, 1]) == 2  # 2.0 - 0.6 < 1.5
    assert greedy_after(SamplingParams(presence_penalty=0.6), [0], [1]) == 2  # 2.0 - 0.6 < 1.5
    assert greedy_after(SamplingParams(presence_penalty=0.6), [0], [2]) == 1
    # A token sampled moves the slot's counts on the device.
    r = Request(0, [0], 4, sampling=SamplingParams(frequency_penalty=0.3))
    sampler.start(0, r, 4)
    for _ in range(2):
        sampler.sample(logits, [0], [r], [0])
    assert sampler._counts is not None and sampler._counts[0].tolist() == [0.0, 2.0, 0.0, 0.0]


def test_a_step_of_plain_rows_takes_the_argmax_and_still_counts_the_tokens() -> None:
    # Greedy rows with no penalty and no log-probabilities take the argmax alone (the
    # sampler's fast path); top-k and top-p change nothing for a greedy row.
    assert SamplingParams().plain and SamplingParams(top_k=2, top_p=0.5).plain
    for params in [SamplingParams(temperature=0.5), SamplingParams(repetition_penalty=1.1),
                   SamplingParams(presence_penalty=0.1), SamplingParams(logprobs=True)]:
        assert not params.plain, params
    logits = torch.tensor([[0.0, 2.0, 1.5, -1.0], [3.0, 0.0, 1.0, 2.0]])
    sampler = Sampler(3, CPU)
    penalized = Request(0, [0], 4, sampling=SamplingParams(frequency_penalty=0.3))
    sampler.start(2, penalized, 4)
    plain = [Request(i, [0], 4) for i in (1, 2)]
    sampled = sampler.sample(logits, [0, 1], plain, [0, 0])
    assert sampled.logprobs is None and sampled.asks == [-1, -1]
    assert to_host([sampled]) == [([1, 0], [None, None])]
    # Once a request asked for a penalty, every slot's tokens are counted, plain rows' too.
    assert sampler._counts is not None
    assert sampler._counts[:2].tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_bad_sampling_parameters_are_refused_at_submit() -> None:
    model, _ = tiny()
    engine = Engine(model, slots=1, max_len=32, backend="host", compile=False)
    for params, message in [
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(presence_penalty=3.0), "presence_penalty"),
        (SamplingParams(top_logprobs=21), "top_logprobs"),
        (SamplingParams(stop_token_ids=(VOCAB,)), "stop_token_ids"),
        (SamplingParams(stop=("x",)), "tokenizer"),
        (SamplingParams(temperature=math.nan), "temperature"),
    ]:
        with pytest.raises(kvvm.InvalidArgumentError, match=message):
            engine.submit([1, 2], 3, sampling=params)
    with pytest.raises(kvvm.InvalidArgumentError, match="n must be"):
        engine.submit_n([1, 2], 3, 0)
    assert engine.idle
    engine.close()


def test_a_seed_gives_a_request_its_tokens_whatever_runs_beside_it() -> None:
    model, ref = tiny()
    p, q, s = prompts([12, 7, 20], seed=8)
    hot = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = Engine(model, slots=3, max_len=96, backend="host", compile=False)
    a = alone.submit(p, 12, sampling=hot)
    alone.run()
    alone.close()
    crowded = Engine(model, slots=3, max_len=96, backend="host", compile=False)
    others = [crowded.submit(q, 9, sampling=SamplingParams(temperature=0.8, seed=9)), crowded.submit(s, 3)]
    b = crowded.submit(p, 12, sampling=hot)  # another slot, another step for each token
    c = crowded.submit(p, 12, sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=4321))
    greedy_by_k = crowded.submit(q, 6, sampling=SamplingParams(temperature=1.0, top_k=1, seed=5))
    crowded.run()
    assert b.tokens == a.tokens and c.tokens != a.tokens
    assert greedy_by_k.tokens == reference(ref, q, 6) and others[0].finish_reason == "length"
    crowded.close()


def test_logprobs_are_the_references_and_stop_tokens_stop() -> None:
    model, ref = tiny()
    p = prompts([10], seed=9)[0]
    want = reference(ref, p, 8)
    engine = Engine(model, slots=2, max_len=64, backend="host", compile=False)
    r = engine.submit(p, 8, sampling=SamplingParams(logprobs=True, top_logprobs=3))
    stop = engine.submit(p, 8, sampling=SamplingParams(stop_token_ids=(want[3],)))
    engine.run()
    with torch.no_grad():
        logits = ref(torch.tensor([p + want[:-1]])).logits[0, len(p) - 1 :].float()
    lp = torch.log_softmax(logits, -1)
    assert r.tokens == want and len(r.logprobs) == 8
    for i, entry in enumerate(r.logprobs):
        assert entry.token == want[i]
        assert entry.logprob == pytest.approx(float(lp[i, want[i]]), abs=1e-4)
        top_ids = [t for t, _ in entry.top]
        assert top_ids == lp[i].topk(3).indices.tolist() and top_ids[0] == want[i]
    assert stop.finish_reason == "stop" and stop.tokens == want[: want.index(want[3]) + 1]
    engine.close()


def test_n_sequences_share_their_prompt_through_the_prefix_cache() -> None:
    """``submit_n``: the first sequence prefills the prompt and publishes it; the others map
    its whole blocks read-only (a hit each) instead of prefilling them; each sequence is the
    one its seed gives alone."""
    model, _ = tiny()
    p = prompts([40], seed=10)[0]
    params = SamplingParams(temperature=1.0, seed=77)
    engine = Engine(model, slots=3, max_len=96, backend="host", compile=False, prefix_cache_bytes=16 << 20)
    reqs = engine.submit_n(p, 6, 3, sampling=params)
    engine.run()
    assert engine.stats.prefix_hits == 2 and all(r.prefix_hit_tokens == 32 for r in reqs[1:])
    assert [r.seed for r in reqs] == [77, 78, 79]
    assert len({tuple(r.tokens) for r in reqs}) == 3
    engine.close()
    for i, r in enumerate(reqs):
        alone = Engine(model, slots=1, max_len=96, backend="host", compile=False)
        again = alone.submit(p, 6, sampling=params.with_seed(77 + i))
        alone.run()
        alone.close()
        assert again.tokens == r.tokens


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255): a character of several bytes spans tokens."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_the_detokenizer_holds_back_partial_characters_and_stop_strings() -> None:
    text = "héllo wörld STOP never"
    ids = list(text.encode())
    d = Detokenizer(ByteTokenizer(), list(b"prompt "), ("STOP", "xyz"))
    published = []
    for i, t in enumerate(ids):
        stopped = d.add([t])
        published.append(d.text[: d.safe_length(stopped)])
        assert "\ufffd" not in d.text
        if stopped:
            break
    assert d.text == "héllo wörld " and d.stopped_at == len("héllo wörld ")
    assert all("S" not in p for p in published), published
    assert all(a == b[: len(a)] for a, b in zip(published, published[1:], strict=False)), "the published text only grows"
    free = Detokenizer(ByteTokenizer(), [], ())
    free.add(ids)
    assert free.text == text and free.safe_length(False) == len(text)
