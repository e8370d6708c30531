"""An HTTP front on 127.0.0.1 for tests against a local object-store server (fake-gcs-server).

The client under test is pointed at the front (TENSORSTORE_GCS_HTTP_URL, ...) instead of the
server. The front forwards each request to the server and records it; a test may answer in the
server's place (a refusal, a hang), change the server's answer (a wrong crc32c), or hold an answer
back until it has done something (killed a process at a known point). Requests are forwarded whole,
at the HTTP level: for faults inside a request's bytes, the TCP proxies of the tests that need
them cut or flip bytes instead.

    with HttpFront(server_url, answer=lambda m, path, headers: (403, b"{}") if "fields=" in path else None) as f:
        run_ckpt(..., env={"TENSORSTORE_GCS_HTTP_URL": f.url})
    f.records  # [{"method", "path", "range", "status", "received", "by_tensorstore"}, ...]
"""
from __future__ import annotations

import http.client
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional, Union

# (status, body): answered in the server's place, as JSON; "hang": never answered (the connection
# is closed after 30 s, past any deadline under test); None: forwarded
Answer = Union[None, str, tuple[int, bytes]]
# headers of one connection, not passed on (RFC 9110 7.6.1), and the lengths the front sets itself
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection",
        "upgrade", "te", "trailer", "host"}


def by_tensorstore(headers: Any) -> bool:
    """Whether a request came from tensorstore: curl's User-Agent names it; http.client (ckpt's own
    requests) sends none. `headers`: a request's headers, or the dict `answer` is given."""
    agent = next((v for k, v in headers.items() if k.lower() == "user-agent"), "")
    return "tensorstore" in agent


class HttpFront:
    """Forwards 127.0.0.1:PORT (`url`) to `upstream` (an http:// URL), request by request.

    answer(method, path, headers): what to answer instead of the server (Answer), asked first;
    rewrite(method, path, headers, body): the server's answer's body as the client gets it;
    hold(record): called with the request's record before its answer is sent; may block.
    records: each request's method, path, Range header, status (None: not answered), length of
    the body answered, and whether tensorstore sent it, in the order their answers were ready.
    """

    def __init__(self, upstream: str, *, answer: Optional[Callable[[str, str, dict[str, str]], Answer]] = None,
                 rewrite: Optional[Callable[[str, str, dict[str, str], bytes], bytes]] = None,
                 hold: Optional[Callable[[dict[str, Any]], None]] = None) -> None:
        self.records: list[dict[str, Any]] = []
        self.answer = answer or (lambda method, path, headers: None)
        self.rewrite = rewrite
        netloc = urllib.parse.urlsplit(upstream).netloc
        lock = threading.Lock()
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                instead = front.answer(self.command, self.path, headers)
                if instead == "hang":
                    with lock:
                        front.records.append(self._record(None, b""))
                    time.sleep(30)
                    self.close_connection = True
                    return
                if instead is not None:
                    status, answer_headers, data = instead[0], [("Content-Type", "application/json")], instead[1]
                else:
                    conn = http.client.HTTPConnection(netloc, timeout=60)
                    try:
                        conn.request(self.command, self.path, body=body, headers=headers)
                        resp = conn.getresponse()
                        status, answer_headers, data = resp.status, resp.getheaders(), resp.read()
                    finally:
                        conn.close()
                    if front.rewrite is not None:
                        data = front.rewrite(self.command, self.path, headers, data)
                record = self._record(status, data)
                with lock:
                    front.records.append(record)
                if hold is not None:
                    hold(record)
                self.send_response(status)
                for k, v in answer_headers:
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _record(self, status: Optional[int], data: bytes) -> dict[str, Any]:
                return {"method": self.command, "path": self.path, "range": self.headers.get("Range"),
                        "status": status, "received": len(data), "by_tensorstore": by_tensorstore(self.headers)}

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _handle

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client gone mid-request (a killed process): nothing to report

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "HttpFront":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
