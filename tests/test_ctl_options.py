"""omnictl load sends the options given, falsy ones (--gpu 0) included, and no others."""

from __future__ import annotations

import json
import socketserver
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

BODIES: list[dict] = []  # what the fake omnid was sent


class _Recorder(BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers["Content-Length"])
        BODIES.append(json.loads(self.rfile.read(length)))
        answer = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def address_string(self):  # a Unix socket has no (host, port)
        return "omnid"

    def log_message(self, *args):
        pass


def test_load_sends_gpu_zero_and_leaves_unset_options_out(tmp_path):
    with tempfile.TemporaryDirectory() as short:  # AF_UNIX paths are limited to ~100 bytes
        sock = Path(short) / "omnid.sock"
        server = socketserver.UnixStreamServer(str(sock), _Recorder)
        thread = threading.Thread(target=server.handle_request, daemon=True)
        thread.start()
        BODIES.clear()
        argv = ["--socket", str(sock), "load", "m", str(tmp_path), "--gpu", "0", "--quota", "4GiB"]
        done = subprocess.run(
            [sys.executable, "-m", "omni.ctl", *argv], capture_output=True, text=True, timeout=30
        )
        thread.join(5)
        server.server_close()
    assert done.returncode == 0, done.stderr
    (body,) = BODIES
    assert body["gpu"] == 0 and body["gpu"] is not False
    assert body["quota"] == "4GiB"
    assert body["name"] == "m" and body["path"] == str(tmp_path.resolve())
    assert not {"permits", "cold", "memory"} & set(body)
