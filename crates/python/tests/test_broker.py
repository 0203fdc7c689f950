"""A manager whose budget is a lease from the node's memory broker (``kvvm broker``): managers
of two tenants in one budget, a tenant's ceiling, the bytes one gives back reaching the other,
and the arguments a broker excludes. The broker is the ``kvvm`` binary (``KVVM_BIN``, or the
workspace's build); the host backend holds the memory."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cuda_available, kvvm_binary, needs_host

import kvvm
from model_checks import run_broker

MiB = 1 << 20
#: One window of the geometry below: 2 MiB (the host's granule) of 256-byte tokens.
WINDOW_TOKENS = 8192


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Path]:
    """A broker of 8 MiB: tenant ``a`` between 2 and 6 MiB, tenant ``b`` anything left."""
    yield from run_broker(tmp_path / "broker.sock", "--budget-bytes", "8MiB", "--tenant", "a:2MiB:6MiB", "--tenant", "b")


@pytest.fixture
def prefix_broker(tmp_path: Path) -> Iterator[Path]:
    """A broker of 12 MiB, tenants ``a`` (between 2 and 6 MiB) and ``b``: room for a prefix of
    two windows and its tail beside its publisher's lease and a reader's copy of the tail."""
    yield from run_broker(
        tmp_path / "prefix.sock", "--budget-bytes", "12MiB", "--tenant", "a:2MiB:6MiB", "--tenant", "b"
    )


def _sequence(mgr: kvvm.Manager) -> kvvm.Sequence:
    geometry = kvvm.KvGeometry(layers=1, kv_heads=1, head_dim=64, max_tokens=16 * WINDOW_TOKENS)
    plan = kvvm.LayoutPlan(geometry, "token-major", mgr.granule)
    assert plan.mapped_tokens(1) == WINDOW_TOKENS
    return kvvm.Sequence(mgr, plan, 16 * WINDOW_TOKENS)


@needs_host
def test_two_tenants_share_one_budget_and_bytes_given_back_reach_the_other(broker: Path) -> None:
    a = kvvm.Manager("host", broker=broker, tenant="a", lease_batch_bytes=2 * MiB)
    b = kvvm.Manager("host", broker=broker, tenant="b", lease_batch_bytes=2 * MiB)
    assert a.budget_bytes is None and a.leased_bytes == 0
    assert kvvm.Manager("host").lease_stats is None
    sa = _sequence(a)
    sa.ensure(3 * WINDOW_TOKENS)
    assert a.snapshot().committed == 6 * MiB and (a.leased_bytes or 0) >= 6 * MiB
    stats = a.lease_stats
    assert stats is not None and stats["grants"] >= 1 and stats["top_ups"] >= 1, stats
    assert stats["local_grants"] + stats["top_ups"] >= stats["grants"] and stats["top_up_max_us"] > 0, stats
    with pytest.raises((kvvm.BackpressureError, kvvm.NeverFitsError)):
        _sequence(a).ensure(1)  # past a's ceiling of 6 MiB
    sb = _sequence(b)
    sb.ensure(WINDOW_TOKENS)
    more = _sequence(b)
    with pytest.raises(kvvm.BackpressureError):
        more.ensure(WINDOW_TOKENS)  # the node's 8 MiB are all in use
    assert more.is_empty
    # a lets go: its lease above two batches goes back to the broker (a message its socket
    # carries without an answer, so b asks again until the broker has read it).
    sa.release()
    a.trim_pool(0)
    assert (a.leased_bytes or 0) <= 4 * MiB
    deadline = time.monotonic() + 20
    while True:
        try:
            more.ensure(WINDOW_TOKENS)
            break
        except kvvm.BackpressureError:
            assert time.monotonic() < deadline, "the bytes a gave back never reached b"
            time.sleep(0.01)
    assert b.snapshot().committed == 4 * MiB
    for s in (sb, more):
        s.release()


def test_a_broker_and_a_local_budget_exclude_each_other(tmp_path: Path) -> None:
    with pytest.raises(kvvm.InvalidArgumentError, match="exclude each other"):
        kvvm.Manager("sim", broker=tmp_path / "broker.sock", budget_bytes=MiB)
    with pytest.raises(kvvm.InvalidArgumentError, match="lease_batch_bytes"):
        kvvm.Manager("sim", broker=tmp_path / "broker.sock", lease_batch_bytes=0)


def test_a_broker_that_is_not_there_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(kvvm.UnavailableError, match="memory broker"):
        kvvm.Manager("sim", broker=tmp_path / "nobody.sock", tenant="a")
    assert kvvm.Manager("sim").leased_bytes is None


#: The reader of :func:`test_a_prefix_published_by_one_process_is_mapped_read_only_by_another`,
#: run as its own process: opens the prefix, checks every byte and what it is billed, tries a
#: write, prints what it saw.
_READER = """
import sys, kvvm
socket, tenant, tokens, n, backend = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
mgr = kvvm.Manager(backend, broker=socket, tenant=tenant, lease_batch_bytes=2 << 20)
geometry = kvvm.KvGeometry(layers=1, kv_heads=1, head_dim=64, max_tokens=n)
plan = kvvm.LayoutPlan(geometry, "token-major", mgr.granule)
try:
    prefix = kvvm.SharedPrefix.open(mgr, "system-prompt", plan)
except kvvm.InvalidArgumentError as e:
    print("refused", e)
    sys.exit(0)
seq = kvvm.Sequence(mgr, plan, n)
prefix.attach(seq)
data = seq.read_tokens(0, prefix.tokens)
ok = all(b == (i * 7 + i // 251) % 256 for i, b in enumerate(data))
try:
    seq.write_tokens(0, bytes(geometry.bytes_per_token))
    wrote = "wrote"
except kvvm.KvvmError as e:
    wrote = type(e).__name__
snap = mgr.snapshot()
print("opened", prefix.tokens, ok, snap.committed, snap.shared, mgr.leased_bytes, wrote, flush=True)
"""


def _pattern(n: int) -> bytes:
    return bytes((i * 7 + i // 251) % 256 for i in range(n))


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("host", marks=needs_host),
        pytest.param("cuda", marks=pytest.mark.skipif(not cuda_available(), reason="skipped: no CUDA driver")),
    ],
)
def test_a_prefix_published_by_one_process_is_mapped_read_only_by_another(prefix_broker: Path, backend: str) -> None:
    """One process prefills (writes) a prefix and publishes it; a second process of the same
    tenant opens it, maps it read-only and reads every byte, billed nothing; a process of
    another tenant cannot open it; once the publisher has released every handle of its own
    (sequence, prefix, pool), the descriptors the broker holds alone keep the memory for the
    next reader; the broker frees it with its last user. On CUDA the descriptors are the
    driver's POSIX fds of its allocations, on the host memfds."""
    import sys

    n = 4 * WINDOW_TOKENS
    mgr = kvvm.Manager(backend, broker=prefix_broker, tenant="b", lease_batch_bytes=2 * MiB)
    geometry = kvvm.KvGeometry(layers=1, kv_heads=1, head_dim=64, max_tokens=n)
    plan = kvvm.LayoutPlan(geometry, "token-major", mgr.granule)
    owner = kvvm.Sequence(mgr, plan, n)
    tokens = 2 * WINDOW_TOKENS + 100
    shared = owner.own_prefix(tokens)
    owner.write_tokens(0, _pattern(tokens * geometry.bytes_per_token))
    with pytest.raises(kvvm.PrefixNotWrittenError):
        shared.publish(mgr, "system-prompt")  # not sealed yet
    shared.seal()
    leased = mgr.leased_bytes or 0
    # Two whole windows and the tail (100 tokens past them, one more window).
    assert shared.publish(mgr, "system-prompt") == 6 * MiB
    assert (mgr.leased_bytes or 0) == leased - 6 * MiB, "the prefix left the publisher's lease"
    with pytest.raises(kvvm.InvalidArgumentError, match="refused"):
        shared.publish(mgr, "system-prompt")  # the key is taken

    def reader(tenant: str) -> str:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run(
            [sys.executable, "-c", _READER, str(prefix_broker), tenant, str(tokens), str(n), backend],
            capture_output=True, text=True, timeout=120, env=env,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert reader("a").startswith("refused"), "another tenant's prefix is not found"
    # The publisher lets go of its own mapping, sequence and pool: only the descriptors the
    # broker holds keep the memory.
    owner.release()
    del shared, owner
    mgr.trim_pool(0)
    snap = mgr.snapshot()
    assert (snap.committed, snap.shared, snap.pooled, snap.quarantined) == (0, 0, 0, 0), snap
    # The reader receives every token: two windows mapped, the tail copied into a window of its
    # own (its only commit, leased from the broker).
    assert reader("b") == f"opened {tokens} True {2 * MiB} 0 {2 * MiB} WriteIntoSharedPrefixError"
    # The reader process is gone (its use dropped with its socket); the publisher's own use
    # is the last one.
    assert mgr.close_prefix("system-prompt") == 0
    with pytest.raises(kvvm.InvalidArgumentError):
        mgr.close_prefix("system-prompt")
    with pytest.raises(kvvm.InvalidArgumentError, match="no broker"):
        kvvm.SharedPrefix.open(kvvm.Manager("host"), "system-prompt", plan)


def _frame(message: dict[str, object]) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack("<I", len(body)) + body


def _answer(sock: socket.socket) -> dict[str, object]:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "the broker closed the connection"
            data += chunk
        return data

    (n,) = struct.unpack("<I", exactly(4))
    answer: dict[str, object] = json.loads(exactly(n))
    return answer


def _publish_raw(path: Path, tenant: str, key: str, size: int, meta: str) -> socket.socket:
    """A tenant-mate speaking the protocol itself: publishes ``size`` bytes of sealed memfd
    under ``key`` with whatever ``meta`` it likes; its connection is returned (the prefix
    lives while it stays open)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(str(path))
    sock.sendall(_frame({"op": "hello", "id": 1, "tenant": tenant, "token": None, "version": 2}))
    assert _answer(sock)["op"] == "welcome"
    sock.sendall(_frame({"op": "acquire", "id": 2, "device": 0, "need": size, "want": size}))
    assert _answer(sock)["op"] == "held"
    fd = os.memfd_create("kvvm-test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    publish = {"op": "publish", "id": 3, "device": 0, "key": key, "sizes": [size], "meta": meta}
    socket.send_fds(sock, [_frame(publish)], [fd])
    os.close(fd)
    assert _answer(sock)["op"] == "held"
    return sock


#: A reader that opens the prefix ``bad``, says what happened, and stays (connected) until told.
_BAD_READER = """
import sys, kvvm
mgr = kvvm.Manager("host", broker=sys.argv[1], tenant="b", lease_batch_bytes=2 << 20)
geometry = kvvm.KvGeometry(layers=1, kv_heads=1, head_dim=64, max_tokens=4 * 8192)
plan = kvvm.LayoutPlan(geometry, "token-major", mgr.granule)
try:
    kvvm.SharedPrefix.open(mgr, "bad", plan)
    print("opened", flush=True)
except kvvm.KvvmError as e:
    print("refused", type(e).__name__, flush=True)
sys.stdin.readline()
"""


@needs_host
@pytest.mark.parametrize("meta", ["not a descriptor", "kvvm-prefix/2 0 0 4000000000 4000000000 0:4000000000 |"])
def test_a_prefix_whose_descriptor_cannot_be_read_is_let_go_by_its_reader(broker: Path, meta: str) -> None:
    """A tenant-mate publishes a prefix with a descriptor that does not decode, or that claims
    four billion windows: the reader refuses it (without allocating for the windows, in its
    own process here: it would die of it) and lets go of its use at once, so the prefix goes
    with its publisher's connection."""
    import sys

    publisher = _publish_raw(broker, "b", "bad", 2 * MiB, meta)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    reader = subprocess.Popen(
        [sys.executable, "-c", _BAD_READER, str(broker)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    assert reader.stdout is not None and reader.stdin is not None
    said = reader.stdout.readline().strip()
    try:
        assert said.startswith("refused"), (said, reader.stderr.read() if reader.poll() is not None and reader.stderr else "")
        publisher.close()
        # The reader is still connected; were its use open, the prefix would be there still.
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(20)
        probe.connect(str(broker))
        probe.sendall(_frame({"op": "hello", "id": 1, "tenant": "b", "token": None, "version": 2}))
        assert _answer(probe)["op"] == "welcome"
        deadline = time.monotonic() + 20
        while True:  # the publisher's end reaches the broker without an answer: ask again
            probe.sendall(_frame({"op": "open", "id": 2, "key": "bad"}))
            answer = _answer(probe)
            if answer["op"] == "prefix":
                # Opened before the broker saw the publisher go: let go of this use at once
                # (held, it would keep the prefix), then ask again.
                probe.sendall(_frame({"op": "close", "id": 3, "key": "bad"}))
                _answer(probe)
            elif answer["op"] != "error" or answer["code"] != "rate_limited":
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)  # asking again at once would be refused for its rate
        assert answer["op"] == "error" and answer["code"] == "not_held", answer
        probe.close()
    finally:
        reader.stdin.write("\n")
        reader.stdin.flush()
        assert reader.wait(timeout=60) == 0


@pytest.fixture
def roomy_broker(tmp_path: Path) -> Iterator[Path]:
    """A broker of 256 MiB, tenant ``t``."""
    yield from run_broker(tmp_path / "roomy.sock", "--budget-bytes", "256MiB", "--tenant", "t")


@needs_host
def test_a_published_prompt_prefix_serves_another_clients_cache_with_the_reference_logits(roomy_broker: Path) -> None:
    """``KvvmPrefix.build`` + ``publish`` in one client, ``KvvmPrefix.open`` +
    ``KvvmCache.from_prefix`` in another (another process in production; two clients of the
    broker here): the opened prefix holds the tokens of its whole windows, the rest of the
    prompt is prefilled, and the logits equal a DynamicCache forward over the whole prompt."""
    torch = pytest.importorskip("torch", reason="skipped: no torch")
    transformers = pytest.importorskip("transformers", reason="skipped: no transformers")
    from kvvm.transformers import KvvmCache
    from kvvm.prefix import KvvmPrefix

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=1000, max_position_embeddings=8192,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    # fp32, 2 layers x {K, V} x 2 KV heads x 32: 1 KiB a token, 2048 tokens a window.
    prompt = torch.randint(0, 1000, (1, 2100 + 9), generator=torch.Generator().manual_seed(1))
    publisher = kvvm.Manager("host", broker=roomy_broker, tenant="t", lease_batch_bytes=4 * MiB)
    built = KvvmPrefix.build(model, prompt[:, :2100], manager=publisher, max_cache_len=2400)
    # Its whole window and its tail (the 52 tokens past it), both published.
    assert built.publish("system") == built.bytes == 4 * MiB
    reader = kvvm.Manager("host", broker=roomy_broker, tenant="t", lease_batch_bytes=4 * MiB)
    opened = KvvmPrefix.open(model, "system", manager=reader, max_cache_len=2400)
    assert opened.tokens == 2100 and opened.cache is None
    with pytest.raises(kvvm.InvalidArgumentError):
        # Another plan (fp16: half the bytes a token, so 2048 tokens fill no window).
        KvvmPrefix.open(model, "system", manager=reader, max_cache_len=2400, dtype=torch.float16)
    cache = KvvmCache.from_prefix(opened, 2, 2400)
    assert reader.snapshot().shared == 0, "the prefix is billed to its publisher"
    rest = prompt[:, 2100:].expand(2, -1)
    with torch.no_grad():
        pos = torch.arange(2100, prompt.shape[1])[None].expand(2, -1)
        got = model(input_ids=rest, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]
        want = model(input_ids=prompt, use_cache=True, past_key_values=transformers.DynamicCache(config=cfg)).logits[:, -1]
    torch.testing.assert_close(got, want.expand(2, -1), rtol=1e-4, atol=1e-4)
    del got
    cache.release()
    assert reader.close_prefix("system") == 1, "the publisher still uses it"
    assert publisher.close_prefix("system") == 0


@needs_host
def test_the_engines_benchmark_holds_the_prompt_once_with_a_broker_and_once_per_process_without(tmp_path: Path) -> None:
    """``python -m kvvm_bench engines`` on a CPU: two decode processes under a broker map one
    published system prompt (its bytes billed once, to the prefix), two with fixed fractions
    each hold their own."""
    pytest.importorskip("transformers", reason="skipped: no transformers")
    import json

    import kvvm_bench

    binary = kvvm_binary()
    if binary is None:
        pytest.skip("skipped: no kvvm binary (cargo build --release -p kvvm-cli, or set KVVM_BIN)")
    out = tmp_path / "engines.json"
    rc = kvvm_bench.main(
        [
            "engines", "--processes", "2", "--tiny", "--device", "cpu", "--backend", "host", "--prefix", "2100",
            "--suffix", "16", "--batch", "2", "--steps", "4", "--budget-bytes", str(256 * MiB),
            "--lease-batch-bytes", str(4 * MiB), "--kvvm-bin", binary, "--json", str(out),
        ]
    )
    assert rc == 0
    runs = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    shared = runs["broker"]["workers"]
    # 4 layers x {K, V} x 2 KV heads x 32 x 4 bytes: 2 KiB a token, 1024 tokens a window: the
    # prompt is two whole windows and a tail of 52 tokens (one more window).
    assert [w["shared"] for w in shared] == [6 * MiB, 0], "the publisher holds the prompt, the other maps it"
    assert shared[1]["prefix_tokens_mapped"] == 2100 and shared[1]["committed"] > 0
    assert runs["broker"]["held"]['kvvm_broker_prefix_bytes{tenant="engines",device="0"}'] == 6 * MiB
    assert all(w["lease"]["grants"] > 0 for w in shared)
    assert [w["shared"] for w in runs["fraction"]["workers"]] == [6 * MiB, 6 * MiB], "each its own"
    assert all(r["tokens_per_s"] > 0 for r in runs.values())


@needs_host
def test_an_engine_serves_requests_from_a_system_prompt_another_process_published(roomy_broker: Path) -> None:
    """The publisher (another process in production, another client here) prefills a system
    prompt and publishes it; an engine opens it and adds it to its prefix cache: every request
    that opens with it maps it (no prefill of those tokens, billed to the publisher) and gets
    the reference's greedy tokens."""
    torch = pytest.importorskip("torch", reason="skipped: no torch")
    transformers = pytest.importorskip("transformers", reason="skipped: no transformers")
    from kvvm.engine import Engine
    from kvvm.prefix import KvvmPrefix

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=1000, max_position_embeddings=8192, eos_token_id=None,
    )
    cfg._attn_implementation = "sdpa"
    ref = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(2)
    system = torch.randint(0, 1000, (2100,), generator=gen).tolist()
    publisher = kvvm.Manager("host", broker=roomy_broker, tenant="t", lease_batch_bytes=4 * MiB)
    built = KvvmPrefix.build(ref, torch.tensor([system]), manager=publisher, max_cache_len=2400)
    built.publish("system")

    mgr = kvvm.Manager("host", broker=roomy_broker, tenant="t", lease_batch_bytes=4 * MiB, precommit=True)
    engine = Engine(model, slots=2, max_len=2400, manager=mgr, prefill_chunk=512, prefix_cache_bytes=64 * MiB)
    opened = KvvmPrefix.open(model, "system", manager=mgr, max_cache_len=2400)
    assert engine.add_prefix(system, opened) == 2100
    tails = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (5, 30, 9)]
    reqs = [engine.submit(system + t, 4) for t in tails]
    engine.run()
    # The system prompt's whole blocks of 16 tokens: its first window mapped, the rest copied.
    assert engine.stats.prefix_hits == 3 and all(r.prefix_hit_tokens == 2096 for r in reqs)
    for r in reqs:
        ids = torch.tensor([r.prompt])
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        assert r.tokens == want[0, len(r.prompt) :].tolist()
    # The system prompt is billed to its publisher: what the engine holds as shared is only
    # what it cached of its requests' own prompts past it.
    assert engine.prefix_cache is not None
    assert mgr.snapshot().shared == engine.prefix_cache.stats()["cached_bytes"] - opened.bytes
    with pytest.raises(kvvm.InvalidArgumentError):
        engine.add_prefix(system[:100], opened)
    engine.close()
    assert mgr.close_prefix("system") == 1 and publisher.close_prefix("system") == 0
