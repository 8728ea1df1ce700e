"""bench/serve_load.py (the load side of bench_vllm_serve) without vLLM: the seeded workload, the
streaming client against a small stand-in of vLLM's `/v1/completions` (server-sent events with
`token_id:N` logprobs), cancellation, errors, and the solo comparison's divergences and noise."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import serve_load as sl


def _next(prompt, j):
    return (sum(prompt) + 7 * j) % 500 + 3


class Completions(BaseHTTPRequestHandler):
    """Greedy stand-in: token j of a prompt is a fixed function of it; top-2 logprobs per token."""

    disconnects: list[int] = []
    short: bool = False

    def log_message(self, *a):
        pass

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not req["prompt"] or req["max_tokens"] < 1:
            self._send(400, {"error": {"message": "bad request", "code": 400}})
            return
        toks = [_next(req["prompt"], j) for j in range(req["max_tokens"] - (1 if self.short else 0))]
        tops = [{f"token_id:{t}": -0.5, f"token_id:{t + 1}": -1.5} for t in toks]
        if not req["stream"]:
            lp = {"tokens": [f"token_id:{t}" for t in toks], "top_logprobs": tops}
            self._send(200, {"choices": [{"logprobs": lp}]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for t, top in zip(toks, tops):
                ev = {"choices": [{"logprobs": {"tokens": [f"token_id:{t}"], "top_logprobs": [top]}}]}
                self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            self.disconnects.append(len(toks))

    def _send(self, status, obj):
        raw = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@pytest.fixture
def port():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Completions)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    Completions.short = False


def test_workload_is_seeded_and_bounded():
    a, b = sl.workload(200, 4032, seed=3), sl.workload(200, 4032, seed=3)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    lens = [len(r.prompt) for r in a]
    assert min(lens) >= 1 and max(lens) <= 4032 and sum(n < 4 for n in lens) >= 10
    assert all(8 <= r.max_tokens <= 64 for r in a)
    assert all(r.cancel_after is None or 1 <= r.cancel_after < r.max_tokens for r in a)
    shared = [r for r in a if r.shared_prefix]
    assert len(shared) >= 30 and len({tuple(r.prompt[:1024]) for r in shared}) == 1
    assert 15 <= sum(r.cancel_after is not None for r in a) <= 45
    assert all(3 <= t < 512 for r in a for t in r.prompt)


def test_streamed_requests_cancellations_and_solo(port):
    reqs = [sl.Request(0, [5, 6, 7], 6, None, False), sl.Request(1, [9] * 40, 30, 2, False)]
    done, cancelled = sl.run_clients(port, "m", reqs, clients=2, timeout=30)
    assert done.status == "done" and done.tokens == [_next([5, 6, 7], j) for j in range(6)]
    assert done.top[0] == {done.tokens[0]: -0.5, done.tokens[0] + 1: -1.5} and done.ttft is not None
    assert cancelled.status == "cancelled" and len(cancelled.tokens) == 2
    alone = sl.solo(port, "m", reqs[0], timeout=30)
    assert alone.status == "done" and alone.tokens == done.tokens
    c = sl.compare([done, cancelled], {0: alone, 1: sl.solo(port, "m", reqs[1], timeout=30)})
    assert (c.compared, c.equal, c.divergences, c.noise()) == (2, 2, [], 0.0)


def test_errors_are_reported_not_raised(port):
    bad = sl.stream_one(port, "m", sl.Request(0, [], 4, None, False), timeout=30)
    assert bad.status == "error" and bad.error.startswith("HTTP 400")
    status, answer = sl.post(port, sl.body("m", [1], 0, stream=False), timeout=30)
    assert status == 400 and answer["error"]["message"] == "bad request"
    Completions.short = True  # a stream that ends before max_tokens
    short = sl.stream_one(port, "m", sl.Request(0, [1, 2], 5, None, False), timeout=30)
    assert short.status == "error" and "after 4 of 5 tokens" in short.error
    dead = sl.stream_one(sl_free_port(), "m", sl.Request(0, [1], 2, None, False), timeout=5)
    assert dead.status == "error" and "ConnectionRefused" in dead.error


def sl_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _result(i, tokens, tops, status="done"):
    r = sl.Result(i, status=status)
    r.tokens, r.top = list(tokens), [dict(t) for t in tops]
    return r


def test_divergence_margins_and_noise():
    # Position 0 agrees (logprobs differ by 0.05: noise); at 1 the runs choose 10 vs 11.
    load = _result(0, [4, 10], [{4: -0.2, 5: -2.0}, {10: -0.60, 11: -0.65, 12: -3.0}])
    alone = _result(0, [4, 11], [{4: -0.25, 5: -2.0}, {11: -0.62, 10: -0.70, 12: -3.0}])
    far = _result(1, [7], [{7: -0.1, 8: -4.0}])
    far_alone = _result(1, [8], [{8: -0.1, 9: -4.5}])  # 7 not in the solo run's top: margin >= 4.4
    c = sl.compare([load, far], {0: alone, 1: far_alone})
    assert c.compared == 2 and c.equal == 0
    (d0, d1) = c.divergences
    assert (d0["position"], d1["position"]) == (1, 0)
    assert d0["margin_load"] == pytest.approx(0.05) and d0["margin_solo"] == pytest.approx(0.08)
    assert d1["margin_solo"] == pytest.approx(4.4)
    # Noise: every token both runs list, up to and with the divergence position (same context there).
    assert sl.compare([load], {0: alone}).noise() == pytest.approx(0.10)  # token 10 at 1: -0.60 vs -0.70
    assert c.noise() == pytest.approx(3.9)  # token 8 at position 0 of the second: -4.0 vs -0.1
    assert c.beyond(0.1) == [d1] and c.beyond(5.0) == []
    hung = _result(2, [], [], status="hung")
    assert sl.compare([hung], {2: alone}).compared == 0
