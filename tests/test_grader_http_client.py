"""The judge's HTTP client against a scripted OpenAI-compatible server on 127.0.0.1."""
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gagar_jax.rollout.grading import http_client

SEEN = []


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def handle(self):
        try:
            super().handle()
        except OSError:        # the client gave up (timeout) or we dropped the connection
            pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        SEEN.append((self.path, body, self.headers.get("Authorization")))
        mode = body["messages"][0]["content"]
        if mode == "slow":
            time.sleep(1.0)
        if mode == "drop":
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if mode == "500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"boom")
            return
        out = {"choices": [{"message": {"content": "{}"}}]} if mode != "empty" else {}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def url():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def test_chat_sends_schema_and_key_and_returns_content(url):
    schema = {"type": "object"}
    out = http_client.chat(url, "judge", [{"role": "user", "content": "ok"}], schema=schema,
                           api_key="k")
    assert out == "{}"
    path, body, auth = SEEN[-1]
    assert path == "/v1/chat/completions" and auth == "Bearer k"
    assert body["model"] == "judge"
    assert body["response_format"]["json_schema"]["schema"] == schema


@pytest.mark.parametrize("mode,msg", [("slow", "timed out"), ("drop", "127.0.0.1"),
                                      ("500", "HTTP 500"), ("empty", "without choices")])
def test_chat_failures_raise_a_named_error(url, mode, msg):
    with pytest.raises(http_client.JudgeHTTPError, match=msg):
        http_client.chat(url, "judge", [{"role": "user", "content": mode}], timeout_s=0.3)


def test_chat_to_a_closed_port_fails():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(http_client.JudgeHTTPError, match="127.0.0.1"):
        http_client.chat(f"http://127.0.0.1:{port}/v1", "m", [], timeout_s=1.0)
