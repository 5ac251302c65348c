"""A live server for tests: ``hicache serve``'s app (uvicorn in a thread) over an in-process Engine."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from hicache import Engine
from hicache.server.serve import ServerThread


@contextlib.contextmanager
def serving(model: str = "random:tiny", name: str = "tiny", server: dict[str, Any] | None = None,
            **engine_options: Any) -> Iterator[ServerThread]:
    """``Engine(model, dtype float32, **engine_options)`` served as ``name`` with the serve options
    ``server``; stopped and shut down on exit."""
    engine = Engine(model, **{"dtype": "float32", **engine_options})
    srv = ServerThread(engine, served_model_name=name, **(server or {}))
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
        engine.shutdown()
