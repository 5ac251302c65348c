"""Start the server: ``hicache serve`` (foreground) or :class:`ServerThread` (in-process, tests)."""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from typing import Any, Callable

import uvicorn

from ..frontend.engine import Engine
from ..frontend.loop import EngineLoop
from .app import create_app
from .metrics import ServerMetrics
from .options import ServerOptions

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 10  # on stop, open requests get this long before their connections close


def build(engine: Engine, opts: ServerOptions, on_death: Callable[[BaseException], None] | None = None):
    """(app, loop): a started EngineLoop over ``engine`` and the app serving it (the model's name
    where ``opts`` names none)."""
    metrics = ServerMetrics()
    loop = EngineLoop(engine, on_finish=metrics.observe_finished, on_death=on_death).start()
    opts = dataclasses.replace(opts, served_model_name=opts.served_model_name or engine.config.model)
    return create_app(loop, metrics, opts), loop


def run_server(engine: Engine, host: str, port: int, opts: ServerOptions, log_level: str = "warning") -> int:
    """Serve until interrupted or until the engine fails (blocks); then stop the engine in order
    (pending host and storage writes finish, rank processes exit). Returns the exit status:
    0 after an orderly stop, 1 when the engine failed (so a supervisor restarts the server)."""
    server: uvicorn.Server | None = None

    def engine_died(error: BaseException) -> None:
        logger.error("the engine failed (%s); answering open requests with 503 and exiting", error)
        if server is not None:
            server.should_exit = True

    app, loop = build(engine, opts, on_death=engine_died)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                           timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    logger.warning("hicache serving %s on http://%s:%d%s", app.state.hicache.opts.served_model_name, host, port,
                   " (API key required)" if opts.api_key else "")
    if threading.current_thread() is threading.main_thread():
        # uvicorn stops gracefully on SIGTERM, then re-raises it: with the default action the
        # process would die there, before the engine stops (rank processes left running).
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        server.run()
    finally:
        app.state.hicache.close()
        loop.stop()
        engine.shutdown()
    return 1 if loop.error is not None else 0


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


class ServerThread:
    """Uvicorn in a background thread on 127.0.0.1 (port 0 = any free port)."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0,
                 on_death: Callable[[BaseException], None] | None = None, **options: Any) -> None:
        """``options``: :class:`ServerOptions` fields."""
        self.app, self.loop = build(engine, ServerOptions(**options), on_death)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level="warning",
                                                    access_log=False, lifespan="off"))
        self._thread = threading.Thread(target=self.server.run, name="hicache-http", daemon=True)
        self.host = host

    def start(self, timeout: float = 30.0) -> str:
        """Start and return the base URL (``http://host:port``)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start.")
            time.sleep(0.01)
        self.base_url = f"http://{self.host}:{self.server.servers[0].sockets[0].getsockname()[1]}"  # (the port taken)
        return self.base_url

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self.app.state.hicache.close()
        self.loop.stop()
