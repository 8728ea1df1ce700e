"""The load side of bench/bench_vllm_serve.py: a seeded workload, concurrent streaming clients over
loopback (stdlib http.client, one thread per client), the solo references and their comparison.

Requests go to vLLM's OpenAI-compatible `/v1/completions` as token ids, greedy, `ignore_eos`,
streamed, with the top `LOGPROBS` logprobs of every generated position as token ids
(`return_tokens_as_token_ids`). A cancelling client closes its connection after a set number of
tokens (the server sees the disconnect and aborts the request).

Comparison (`compare`): a request's tokens against the same prompt served alone; the first index
where they differ is a divergence. Up to it both runs saw the same context, so the difference of
their logprobs for the same token there is the noise of batching (`noise`: the largest over all
those positions and their top tokens). A divergence lies within noise when the token each run chose
beat the other's by at most `bound` nats in both runs (a flip needs both margins that small: each
logprob moves by at most the noise, so a margin above twice it cannot flip).
"""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

LOGPROBS = 5  # top logprobs per position: where the other run's token ranks below, its margin is bounded


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_tokens: int
    cancel_after: int | None  # close the stream after this many tokens (None: read to the end)
    shared_prefix: bool


@dataclass
class Result:
    index: int
    status: str = "pending"  # done | cancelled | error | hung
    tokens: list[int] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)  # per position: token id -> logprob
    ttft: float | None = None
    seconds: float = 0.0
    error: str = ""


def workload(
    n: int, max_len: int, seed: int = 0, prefix_share: float = 0.3, cancel_share: float = 0.15, vocab: int = 512
) -> list[Request]:
    """`n` requests, prompts of 1..max_len tokens: a tenth 1-3 tokens (shorter than the CSA ratio),
    `prefix_share` one common prefix (half of max_len, at most 1024 tokens) and a random rest, the
    others half uniform, half log-uniform in length; 8-64 new tokens; `cancel_share` cancelled
    after 1..max_tokens-1 tokens. Token ids 3..vocab-1."""
    g = np.random.default_rng(seed)
    common = g.integers(3, vocab, min(1024, max(1, max_len // 2))).tolist()
    out = []
    for i in range(n):
        u = g.random()
        shared = False
        if u < 0.1:
            length = int(g.integers(1, 4))
        elif u < 0.1 + prefix_share and max_len > len(common):
            shared = True
            length = int(g.integers(len(common) + 1, max_len + 1))
        elif g.random() < 0.5:
            length = int(g.integers(4, max_len + 1))
        else:
            length = int(np.exp(g.uniform(np.log(4), np.log(max_len))))
        length = max(1, min(length, max_len))
        prompt = (common if shared else []) + g.integers(3, vocab, length - (len(common) if shared else 0)).tolist()
        k = int(g.integers(8, 65))
        cancel = int(g.integers(1, k)) if g.random() < cancel_share else None
        out.append(Request(i, prompt, k, cancel, shared))
    return out


def body(model: str, prompt: list[int], max_tokens: int, stream: bool) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": LOGPROBS,
        "return_tokens_as_token_ids": True,
        "stream": stream,
    }


def _token_id(s: str) -> int:
    if not s.startswith("token_id:"):
        raise ValueError(f"expected 'token_id:N' (return_tokens_as_token_ids), got {s!r}")
    return int(s[len("token_id:") :])


def _read_logprobs(lp: dict, res: Result) -> None:
    for tok, top in zip(lp["tokens"], lp["top_logprobs"]):
        res.tokens.append(_token_id(tok))
        res.top.append({_token_id(k): float(v) for k, v in (top or {}).items()})


def post(port: int, payload: dict, timeout: float) -> tuple[int, dict]:
    """A non-streamed POST to /v1/completions: (HTTP status, JSON body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(payload), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, {"raw": raw[:500].decode(errors="replace")}
    finally:
        conn.close()


def stream_one(port: int, model: str, req: Request, timeout: float) -> Result:
    """One streamed request; closes the connection after `req.cancel_after` tokens."""
    res = Result(req.index)
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = json.dumps(body(model, req.prompt, req.max_tokens, stream=True))
        conn.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            res.status, res.error = "error", f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            return res
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                res.status, res.error = "error", f"stream error: {ev['error']}"
                return res
            for ch in ev.get("choices", []):
                if ch.get("logprobs"):
                    _read_logprobs(ch["logprobs"], res)
            if res.tokens and res.ttft is None:
                res.ttft = time.perf_counter() - t0
            if req.cancel_after is not None and len(res.tokens) >= req.cancel_after:
                res.status = "cancelled"
                return res
        if len(res.tokens) != req.max_tokens:
            res.status, res.error = "error", f"stream ended after {len(res.tokens)} of {req.max_tokens} tokens"
        else:
            res.status = "done"
    except TimeoutError:
        res.status, res.error = "hung", f"no answer within {timeout:.0f} s"
    except (OSError, http.client.HTTPException, ValueError) as e:
        res.status, res.error = "error", f"{type(e).__name__}: {e}"
    finally:
        res.seconds = time.perf_counter() - t0
        conn.close()  # a cancelling client disconnects here, mid-stream
    return res


def run_clients(port: int, model: str, requests: list[Request], clients: int, timeout: float) -> list[Result]:
    """`clients` threads, each sending the next request from a shared queue as soon as its last one ended."""
    work: queue.Queue = queue.Queue()
    for r in requests:
        work.put(r)
    results: list[Result | None] = [None] * len(requests)

    def client():
        while True:
            try:
                r = work.get_nowait()
            except queue.Empty:
                return
            results[r.index] = stream_one(port, model, r, timeout)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results  # type: ignore[return-value]


def solo(port: int, model: str, req: Request, timeout: float) -> Result:
    """The same prompt served alone (nothing else in flight), not streamed, to its full length."""
    res = Result(req.index)
    t0 = time.perf_counter()
    try:
        status, out = post(port, body(model, req.prompt, req.max_tokens, stream=False), timeout)
    except TimeoutError:
        res.status, res.error = "hung", f"no answer within {timeout:.0f} s"
        return res
    res.seconds = time.perf_counter() - t0
    if status != 200:
        res.status, res.error = "error", f"HTTP {status}: {str(out)[:300]}"
        return res
    _read_logprobs(out["choices"][0]["logprobs"], res)
    res.status = "done"
    return res


def _margin(top: dict[int, float], mine: int, other: int) -> float:
    """How much `mine` beat `other` here; where `other` is not among the top LOGPROBS, at least the
    gap to the last listed one (a lower bound, so a divergence is never called noise wrongly)."""
    return top[mine] - (top[other] if other in top else min(top.values()))


@dataclass
class Comparison:
    compared: int = 0  # requests compared (done, or cancelled: the tokens they got)
    equal: int = 0
    divergences: list[dict] = field(default_factory=list)  # index, position, margins
    deltas: list[float] = field(default_factory=list)  # |logprob difference| before divergences

    def noise(self) -> float:
        return max(self.deltas, default=0.0)

    def beyond(self, bound: float) -> list[dict]:
        return [d for d in self.divergences if max(d["margin_load"], d["margin_solo"]) > bound]


def compare(results: list[Result], alone: dict[int, Result]) -> Comparison:
    c = Comparison()
    for r in results:
        if r.status not in ("done", "cancelled") or r.index not in alone:
            continue
        s = alone[r.index]
        c.compared += 1
        n = min(len(r.tokens), len(s.tokens))
        first = next((i for i in range(n) if r.tokens[i] != s.tokens[i]), None)
        for i in range(n if first is None else first + 1):
            for tok in set(r.top[i]) & set(s.top[i]):
                c.deltas.append(abs(r.top[i][tok] - s.top[i][tok]))
        if first is None:
            c.equal += 1
            continue
        a, b = r.tokens[first], s.tokens[first]
        c.divergences.append(
            {
                "request": r.index,
                "position": first,
                "margin_load": _margin(r.top[first], a, b),
                "margin_solo": _margin(s.top[first], b, a),
            }
        )
    return c


def percentile(x, q: float) -> float | None:
    return float(np.percentile(np.asarray(x, dtype=float), q)) if len(x) else None
