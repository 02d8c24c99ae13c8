"""A real HTTP server for LoRA packs in the tests, with routes that misbehave on purpose."""

from __future__ import annotations

import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class PackServer:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.hits: Counter = Counter()
        self.redirects: dict[str, str] = {}  # request path -> Location, set by tests
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                server.hits[self.path] += 1
                name = self.path.rsplit("/", 1)[-1]
                if self.path in server.redirects:
                    self.send_response(302)
                    self.send_header("Location", server.redirects[self.path])
                    self.end_headers()
                    return
                if self.path.startswith("/packs/slow/"):
                    data = (server.root / name).read_bytes()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    for i in range(0, len(data), 1024):
                        self.wfile.write(data[i:i + 1024])
                        self.wfile.flush()
                        time.sleep(0.5)
                    return
                if self.path.startswith("/packs/redirect-out/"):
                    self.send_response(302)
                    self.send_header("Location", f"http://localhost:{server.port}/elsewhere/{name}")
                    self.end_headers()
                    return
                if self.path.startswith("/packs/redirect-in/"):
                    self.send_response(302)
                    self.send_header("Location", f"/packs/{name}")
                    self.end_headers()
                    return
                path = server.root / name
                if not self.path.startswith("/packs/") or not path.is_file():
                    self.send_response(404)
                    self.end_headers()
                    return
                data = path.read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> PackServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
