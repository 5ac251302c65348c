"""``python -m llama_cpp.server`` (same flags), plus one request rewrite: ``ignore_eos``.

Run by ``.venv-peers/bin/python`` for part (d) of ``bench_peers.py``. ``hicache bench`` sends
``"ignore_eos": true`` so every turn produces ``max_tokens`` tokens; llama-cpp-python's server
ignores that field but has ``min_tokens`` (EOS banned until that many tokens are out). This
wrapper sets ``min_tokens = max_tokens`` on completion requests that ask for ``ignore_eos``
and leaves everything else (model loading, RAM cache, scheduling, streaming) to the server.
"""

from __future__ import annotations

import json

import llama_cpp.server.__main__ as server_main

_create_app = server_main.create_app


def ignore_eos_shim(app):
    """ASGI middleware: POST .../completions bodies with ``ignore_eos`` get ``min_tokens``."""

    async def shim(scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith("completions"):
            return await app(scope, receive, send)
        body, more = b"", True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return await app(scope, receive, send)
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        try:
            obj = json.loads(body)
            if isinstance(obj, dict) and obj.get("ignore_eos") and obj.get("max_tokens") and "min_tokens" not in obj:
                obj["min_tokens"] = obj["max_tokens"]
                body = json.dumps(obj).encode()
        except ValueError:
            pass
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        first = True

        async def replay():
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later messages: the client's disconnect

        await app(dict(scope, headers=headers), replay, send)

    return shim


def create_app(*args, **kwargs):
    return ignore_eos_shim(_create_app(*args, **kwargs))


if __name__ == "__main__":
    server_main.create_app = create_app
    server_main.main()
