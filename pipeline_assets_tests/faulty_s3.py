"""A flaky object store on loopback: a proxy in front of moto's S3 server that answers chosen
requests for one object with ``503 SlowDown``, as a throttled or failing S3 does, or lets them
through and loses their answer, as a connection that drops after the store acted does. Everything
else passes through."""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultyS3:
    """``fails(n)`` decides whether the n-th ``method`` request (1-based) for ``key`` is answered
    with a 503; with ``lose_answer``, that request reaches the store first."""

    def __init__(
        self,
        upstream: str,
        key: str,
        fails: Callable[[int], bool],
        *,
        method: str = "GET",
        lose_answer: bool = False,
    ):
        self.key, self.fails, self.method, self.lose_answer = key, fails, method, lose_answer
        self.requests = 0
        self._upstream = urlsplit(upstream)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "FaultyS3":
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _should_fail(self, method: str, path: str) -> bool:
        if method != self.method or not urlsplit(path).path.endswith("/" + self.key):
            return False
        with self._lock:
            self.requests += 1
            return self.fails(self.requests)

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                failing = proxy._should_fail(self.command, self.path)
                if failing and not proxy.lose_answer:
                    self._slow_down()
                    return
                upstream = http.client.HTTPConnection(
                    proxy._upstream.hostname, proxy._upstream.port, timeout=30
                )
                upstream.request(self.command, self.path, body=body, headers=dict(self.headers))
                response = upstream.getresponse()
                payload = response.read()
                headers = {
                    k: v
                    for k, v in response.getheaders()
                    if k.lower() not in ("transfer-encoding", "connection", "server", "date")
                }
                if self.command != "HEAD":
                    headers["Content-Length"] = str(len(payload))
                upstream.close()
                if failing:
                    self._slow_down()
                    return
                self._answer(response.status, headers, payload)

            def _slow_down(self) -> None:
                self._answer(
                    503,
                    {"Content-Type": "application/xml", "Content-Length": str(len(_SLOW_DOWN))},
                    _SLOW_DOWN,
                )

            def _answer(self, status: int, headers: dict, payload: bytes) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

            def log_message(self, *args) -> None:  # quiet
                pass

        return Handler
