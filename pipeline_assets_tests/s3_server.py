"""moto's S3 server on loopback, with the one guarantee of S3's that moto's threads break: a
conditional write is atomic.

moto checks ``If-Match`` / ``If-None-Match`` and then writes. Two of its server's threads can both
pass the check before either writes, and both clients then hold the same lease
(``lib/test_locks.py`` races four clients for one). Here a conditional request runs alone.
"""

from __future__ import annotations

import threading

from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import make_server

_CONDITIONS = ("HTTP_IF_MATCH", "HTTP_IF_NONE_MATCH")


class _ConditionalRequestsOneAtATime:
    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ, start_response):
        if not any(condition in environ for condition in _CONDITIONS):
            return self.app(environ, start_response)
        with self.lock:
            return list(self.app(environ, start_response))  # the write happens inside the lock


class S3Server:
    """``with S3Server(port) as endpoint:`` serves S3 at ``http://127.0.0.1:<port>``."""

    def __init__(self, port: int):
        app = _ConditionalRequestsOneAtATime(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(
            "127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler
        )
        self.endpoint = f"http://127.0.0.1:{port}"

    def __enter__(self) -> str:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self.endpoint

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
