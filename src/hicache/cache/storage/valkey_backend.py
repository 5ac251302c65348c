"""The ``valkey`` backend: objects as string values in a Valkey (or Redis) server.

Every key is stored as ``prefix + key``; batches go out as MGET / MSET (or a SET EX
pipeline when ``ttl_s`` is set), chunked to ``batch_size`` keys so one reply stays a few
tens of MB. ``exists_prefix`` pipelines EXISTS a chunk at a time and stops at the first gap.

Failure model: the constructor PINGs and raises :class:`StorageError` if the server does
not answer (``check_at_open``); afterwards connection and timeout errors become
StorageError after one try (no client-side retries, short timeouts), so a down server
costs callers about ``connect_timeout_s`` per call instead of hanging them. The server's own eviction
(``maxmemory-policy``) and ``ttl_s`` bound its size; ``evictions`` in stats stays 0 since
the server does not tell us.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import re
from typing import Iterator

from .base import RemoteStore, RemoteStoreOptions, StorageError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValkeyOptions(RemoteStoreOptions):
    """A Valkey server at ``host:port`` / ``db`` (``password``: AUTH, None for none).

    ``ttl_s``: expire objects this many seconds after their last write (None = never).
    ``connect_timeout_s`` / ``timeout_s``: socket timeouts in seconds for connecting and for
    each command (a 128-page batch of 368 KB objects is ~47 MB: allow for it).
    ``batch_size``: most keys per MGET / MSET / pipeline round trip. ``check_at_open``: PING the
    server in the constructor (with False the constructor never connects).
    """

    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    ttl_s: float | None = None
    password: str | None = None
    timeout_s: float = 10.0


class ValkeyBackend(RemoteStore):
    """Page objects in a Valkey server (:class:`ValkeyOptions`) under its ``prefix``.

    Thread safety: the client's connection pool hands each thread its own connection.
    """

    name = "valkey"
    options_type = ValkeyOptions

    def __init__(self, options: ValkeyOptions = ValkeyOptions()) -> None:
        try:
            import valkey
            from valkey.backoff import NoBackoff
            from valkey.retry import Retry
        except ImportError as e:  # pragma: no cover - dependency is declared
            raise StorageError("the valkey backend needs the 'valkey' package") from e
        super().__init__(options)
        o = options
        self.host, self.port, self.db = o.host, int(o.port), int(o.db)
        self.ttl_ms = None if o.ttl_s is None else max(1, int(float(o.ttl_s) * 1000))
        self._valkey_error = valkey.exceptions.ValkeyError
        self._client = valkey.Valkey(host=o.host, port=self.port, db=self.db, password=o.password,
                                     socket_connect_timeout=o.connect_timeout_s, socket_timeout=o.timeout_s,
                                     retry=Retry(NoBackoff(), 0),  # fail fast: the cache degrades to recompute
                                     retry_on_timeout=False, health_check_interval=0)
        state = "not checked"
        if o.check_at_open:
            try:
                self._client.ping()
                state = "reachable"
            except self._valkey_error as e:
                self._client.close()
                raise StorageError(f"valkey server at {o.host}:{self.port} is unreachable: {e}") from e
        log.info("valkey storage opened at %s:%d db %d prefix %r ttl %s: %s", o.host, self.port, self.db, o.prefix,
                 "none" if o.ttl_s is None else f"{o.ttl_s}s", state)

    @contextlib.contextmanager
    def _calls(self, op: str) -> Iterator[None]:
        """The server's errors inside the block as one counted StorageError naming ``op``."""
        try:
            yield
        except self._valkey_error as e:
            raise self._fail(f"valkey {op} at {self.host}:{self.port} failed: {e}") from e

    # -- StorageBackend -------------------------------------------------------------------
    def exists_prefix(self, keys: list[str]) -> int:
        with self._calls("EXISTS"):
            for start, chunk in self._chunks(keys):
                pipe = self._client.pipeline(transaction=False)
                for key in chunk:
                    pipe.exists(key)
                for i, found in enumerate(pipe.execute()):
                    if not found:
                        return start + i
        return len(keys)

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        with self._calls("MGET"):
            out = [v for _, chunk in self._chunks(keys) for v in self._client.mget(chunk)]
        return self._count_gets(len(keys), out)

    def batch_set(self, keys: list[str], values: list[bytes]) -> int:
        with self._calls("SET"):
            for start, chunk in self._chunks(keys):
                vs = values[start : start + self.batch_size]
                if self.ttl_ms is None:
                    self._client.mset(dict(zip(chunk, vs)))
                else:
                    pipe = self._client.pipeline(transaction=False)
                    for k, v in zip(chunk, vs):
                        pipe.set(k, v, px=self.ttl_ms)
                    pipe.execute()
                self._count_sets(vs)
        return len(keys)

    def delete(self, keys: list[str]) -> None:
        with self._calls("UNLINK"):
            for _, chunk in self._chunks(keys):
                self._client.unlink(*chunk)

    def clear(self) -> None:
        """Remove every key under ``prefix`` (SCAN + UNLINK; never FLUSHDB, the db may be
        shared with other users)."""
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self.prefix) + "*"  # glob characters escaped: a literal prefix
        with self._calls("clear"):
            found = self._client.scan_iter(match=pattern, count=1000)
            n = sum(self._client.unlink(*batch) for batch in iter(lambda: list(itertools.islice(found, 1000)), []))
        log.info("valkey storage at %s:%d cleared %d keys under %r", self.host, self.port, n, self.prefix)

    def _extra(self) -> dict:
        return {"server": f"{self.host}:{self.port}", "db": self.db, "prefix": self.prefix}

    def close(self) -> None:
        self._client.close()
