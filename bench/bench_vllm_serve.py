"""`dsv4-vllm-serve` (vLLM's OpenAI-compatible server + the plugin) under a bounded, seeded load.

    .venv-vllm-cpu/bin/python -m bench.bench_vllm_serve [--requests 200] [--clients 32] [--rounds 3]
        [--kernels dsv4,vllm] [--runs base,preempt,prefix] [--preempt-blocks 560] [--json out.json]
    (`make bench-vllm-serve`; `--quick`: the short version tests/vllm_cpu/test_serve.py runs)

For each prefill kernel (ours "dsv4", vLLM's own "vllm": DSV4_PREFILL_VLLM_CPU_PREFILL) and each
run, a server is started on 127.0.0.1 with the small official-format checkpoint of
`tools.official_checkpoint.vllm_cpu_config` (or --checkpoint), max-model-len 4096, 1024 batched
tokens, 16 sequences, and shut down afterwards (SIGINT, then its process group):
- base: prefix caching off, the KV cache of VLLM_CPU_KVCACHE_SPACE; --rounds rounds of the load
  (the server's RSS, all its processes, after each: it must not grow from round 2 on);
- preempt: the KV cache cut to --preempt-blocks blocks (`--num-gpu-blocks-override`): vLLM must
  preempt (its counter `vllm:num_preemptions` is read) and recompute;
- prefix: prefix caching on (vLLM's hit counters are read and printed).
The load (bench/serve_load.py): --requests requests from --clients concurrent streaming clients,
prompts of 1..max-len tokens (a tenth 1-3 tokens), a share behind one common 1024-token prefix,
greedy, 8-64 new tokens, a share of clients closing the stream mid-way. Then every request's
prompt is served alone (nothing else in flight) and compared token by token: a divergence must lie
within the noise vLLM with its own prefill kernel shows on the same load (bound: twice the largest
logprob difference it shows between load and solo runs before any divergence). Also sent: an empty
prompt, a prompt over max-model-len, max_tokens 0: each must get a 4xx. Checked: 0 server errors,
0 crashes, 0 hung requests. Printed: throughput, TTFT p50/p99, per kernel and run. Exit status 1
when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import serve_load as sl

MODEL = "dsv4"
MAX_MODEL_LEN = 4096
SERVER_ARGS = ["--max-num-batched-tokens", "1024", "--max-num-seqs", "16", "--enforce-eager", "--dtype", "bfloat16"]
RUNS = ("base", "preempt", "prefix")
RSS_SLACK = 0.05  # from round 2 on, RSS may grow by this share (allocator noise), never steadily
RSS_FLOOR = 64 << 20  # ... or this many bytes, whichever is larger


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(how: str) -> list[str]:
    """The documented ways to start the server: the console command, or the module."""
    if how == "script":
        script = Path(sys.executable).with_name("dsv4-vllm-serve")
        if not script.exists():
            raise SystemExit(f"{script} missing: install this package into the venv (`pip install -e .`)")
        return [str(script)]
    return [sys.executable, "-m", "dsv4_torch.vllm.serve"]


class Server:
    """One server process (own session: its engine and worker processes are its process group)."""

    def __init__(self, checkpoint, kernel: str, run: str, args, log_dir: Path):
        self.port = free_port()
        self.log_path = log_dir / f"server-{kernel}-{run}.log"
        cmd = launcher(args.launcher) + [str(checkpoint), "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0", *SERVER_ARGS]
        cmd += ["--enable-prefix-caching" if run == "prefix" else "--no-enable-prefix-caching"]
        if run == "preempt":
            cmd += ["--num-gpu-blocks-override", str(args.preempt_blocks)]
        env = dict(os.environ, DSV4_PREFILL_VLLM_CPU_PREFILL=kernel)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kvcache_gib))
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.cmd = cmd

    def get(self, path: str, timeout: float = 10) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as r:
                return r.status, r.read().decode()
        except OSError as e:
            return getattr(e, "code", 0) or 0, str(e)

    def wait_ready(self, timeout: float) -> None:
        t = time.time()
        while time.time() - t < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}) while starting:\n{self.tail()}")
            if self.get("/health", 5)[0] == 200:
                return
            time.sleep(2)
        raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{self.tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None and self.get("/health", 30)[0] == 200

    def metric(self, name: str) -> float:
        """Sum of a Prometheus counter over its label sets (0 when absent)."""
        text = self.get("/metrics", 30)[1]
        return sum(float(m) for m in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M))

    def rss(self) -> int:
        """Resident bytes of every process in the server's session (API server, engine core, workers)."""
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == self.proc.pid:  # session id
                    total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError, ValueError):
                continue
        return total

    def tail(self, n: int = 40) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def fatal_lines(self) -> list[str]:
        """Engine failures logged while serving (the abort at shutdown logs an EngineDeadError too)."""
        text = self.log_path.read_text(errors="replace").split("shutdown triggered", 1)[0]
        return [ln for ln in text.splitlines() if re.search(r"EngineDeadError|fatal error|Traceback|IndexError", ln)]

    def prefix_caching_lines(self) -> list[str]:
        """What the server logged about prefix caching (vLLM says when it turns it off for a model)."""
        text = self.log_path.read_text(errors="replace")
        return [ln.strip()[-200:] for ln in text.splitlines() if re.search(r"prefix.caching", ln, re.I)][:4]

    def kv_tokens(self) -> int | None:
        m = re.search(r"KV cache size: ([0-9,]+) tokens", self.log_path.read_text(errors="replace"))
        return int(m.group(1).replace(",", "")) if m else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                pass
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)  # what is left of its session (engine core, workers)
            except ProcessLookupError:
                break
            time.sleep(1)
            if self.proc.poll() is None:
                try:
                    self.proc.wait(wait)
                except subprocess.TimeoutExpired:
                    continue
        self.log.close()


def bad_requests(port: int) -> list[dict]:
    cases = {
        "empty prompt": sl.body(MODEL, [], 8, stream=False),
        f"prompt of {MAX_MODEL_LEN + 1} tokens": sl.body(MODEL, [5] * (MAX_MODEL_LEN + 1), 8, stream=False),
        "max_tokens 0": sl.body(MODEL, [5, 6, 7], 0, stream=False),
    }
    out = []
    for name, payload in cases.items():
        status, answer = sl.post(port, payload, 120)
        message = (answer.get("error") or {}).get("message", str(answer))[:160] if isinstance(answer, dict) else ""
        out.append({"case": name, "status": status, "message": message, "ok": 400 <= status < 500})
    return out


def load_round(server: Server, requests, args) -> dict:
    t = time.perf_counter()
    results = sl.run_clients(server.port, MODEL, requests, args.clients, args.request_timeout)
    wall = time.perf_counter() - t
    done = [r for r in results if r.status in ("done", "cancelled")]
    prompt = sum(len(requests[r.index].prompt) for r in done)
    out_tokens = sum(len(r.tokens) for r in done)
    ttft = [r.ttft for r in done if r.ttft is not None]
    return {
        "results": results,
        "wall_s": wall,
        "done": sum(r.status == "done" for r in results),
        "cancelled": sum(r.status == "cancelled" for r in results),
        "errors": [f"#{r.index}: {r.error}" for r in results if r.status == "error"],
        "hung": [f"#{r.index}: {r.error}" for r in results if r.status == "hung"],
        "prompt_tok_s": prompt / wall,
        "output_tok_s": out_tokens / wall,
        "requests_s": len(done) / wall,
        "ttft_p50": sl.percentile(ttft, 50),
        "ttft_p99": sl.percentile(ttft, 99),
        "rss": server.rss(),
    }


def serve_run(checkpoint, kernel: str, run: str, requests, args, log_dir: Path) -> dict:
    rounds = args.rounds if run == "base" else 1
    server = Server(checkpoint, kernel, run, args, log_dir)
    rec = {"kernel": kernel, "run": run, "command": " ".join(server.cmd), "log": str(server.log_path)}
    try:
        t = time.perf_counter()
        server.wait_ready(args.startup_timeout)
        rec["startup_s"] = time.perf_counter() - t
        rec["kv_cache_tokens"] = server.kv_tokens()
        rec["bad_requests"] = bad_requests(server.port)
        pre0, hit0, q0 = (
            server.metric(f"vllm:{m}_total") for m in ("num_preemptions", "prefix_cache_hits", "prefix_cache_queries")
        )
        rec["rounds"] = []
        for i in range(rounds):
            rnd = load_round(server, requests, args)
            print(
                f"  {kernel:>4} {run:<7} round {i + 1}/{rounds}: {rnd['done']} done, {rnd['cancelled']} cancelled, "
                f"{len(rnd['errors'])} errors, {len(rnd['hung'])} hung, {rnd['wall_s']:.1f} s, RSS {rnd['rss'] / 2**20:.0f} MiB",
                flush=True,
            )
            rec["rounds"].append(rnd)
        rec["preemptions"] = server.metric("vllm:num_preemptions_total") - pre0
        q = server.metric("vllm:prefix_cache_queries_total") - q0
        rec["prefix_hit_rate"] = (server.metric("vllm:prefix_cache_hits_total") - hit0) / q if q else None
        rec["prefix_caching_log"] = server.prefix_caching_lines()
        alone = {}
        for r in requests:  # served alone: one at a time, nothing else in flight
            alone[r.index] = sl.solo(server.port, MODEL, r, args.request_timeout)
        rec["solo_errors"] = [f"#{i}: {s.error}" for i, s in alone.items() if s.status != "done"]
        rec["comparison"] = [sl.compare(rnd["results"], alone) for rnd in rec["rounds"]]
        rec["alive"] = server.alive()
    except RuntimeError as e:
        rec["startup_error"] = str(e)
        rec["alive"] = False
    finally:
        server.stop()
        rec["fatal_lines"] = server.fatal_lines()[:10]
    return rec


# ----------------------------------------------------------------------------- checks and report


def noise_bounds(records, fixed: float | None) -> dict[str, float | None]:
    """Per run: twice the largest load-vs-solo logprob difference vLLM's own kernel shows (or --noise-bound)."""
    out = {}
    for rec in records:
        if rec["kernel"] == "vllm" and "comparison" in rec:
            out[rec["run"]] = 2 * max(c.noise() for c in rec["comparison"])
    return {run: (fixed if fixed is not None else out.get(run)) for run in {r["run"] for r in records}}


def checks(rec: dict, bound: float | None, require_preemption: bool = True) -> list[tuple[str, bool, str]]:
    out = [("started", "startup_error" not in rec, rec.get("startup_error", "")[-300:])]
    if "startup_error" in rec:
        return out
    out.append(
        ("alive, no fatal log line", rec["alive"] and not rec["fatal_lines"], "; ".join(rec["fatal_lines"])[:300])
    )
    bad = [b for b in rec["bad_requests"] if not b["ok"]]
    out.append(("bad requests get 4xx", not bad, "; ".join(f"{b['case']}: HTTP {b['status']}" for b in bad)))
    errors = [e for rnd in rec["rounds"] for e in rnd["errors"]] + rec["solo_errors"]
    out.append(("0 server errors", not errors, "; ".join(errors[:5])))
    hung = [h for rnd in rec["rounds"] for h in rnd["hung"]]
    out.append(("0 hung requests", not hung, "; ".join(hung[:5])))
    if rec["run"] == "preempt" and require_preemption:
        out.append(("preempted", rec["preemptions"] > 0, f"{rec['preemptions']:.0f} preemptions"))
    rss = [rnd["rss"] for rnd in rec["rounds"]]
    if len(rss) >= 3:
        grow = max(rss[2:]) - rss[1]
        ok = grow <= max(RSS_SLACK * rss[1], RSS_FLOOR)
        out.append(("RSS flat from round 2", ok, f"+{grow / 2**20:.0f} MiB after round 2"))
    if bound is not None:
        beyond = [d for c in rec["comparison"] for d in c.beyond(bound)]
        out.append(("divergences within the noise bound", not beyond, json.dumps(beyond[:3])))
    return out


def rss_list(rounds) -> str:
    return ", ".join(f"{r['rss'] / 2**20:.0f}" for r in rounds)


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def report(records, bounds, require_preemption: bool = True) -> bool:
    ok_all = True
    print(
        "\n| kernel | run | KV cache (tokens) | done | cancelled | errors | hung | preempt. | prefix hits | compared | equal | "
        "divergences (beyond bound) | noise max (nats) | prompt tok/s | output tok/s | TTFT p50 / p99 (s) | RSS per round (MiB) |"
    )
    print("|" + "---|" * 17)
    for rec in records:
        if "startup_error" in rec:
            print(f"| {rec['kernel']} | {rec['run']} | server did not start |" + " |" * 14)
        else:
            rounds, comp = rec["rounds"], rec["comparison"]
            bound = bounds.get(rec["run"])
            n_div = sum(len(c.divergences) for c in comp)
            n_beyond = sum(len(c.beyond(bound)) for c in comp) if bound is not None else None
            last = rounds[-1]
            print(
                f"| {rec['kernel']} | {rec['run']} | {_fmt(rec['kv_cache_tokens'], ',')} | {sum(r['done'] for r in rounds)} | {sum(r['cancelled'] for r in rounds)} | "
                f"{sum(len(r['errors']) for r in rounds)} | {sum(len(r['hung']) for r in rounds)} | {rec['preemptions']:.0f} | "
                f"{_fmt(rec['prefix_hit_rate'], '.1%')} | {sum(c.compared for c in comp)} | {sum(c.equal for c in comp)} | "
                f"{n_div} ({_fmt(n_beyond, 'd')}) | {max(c.noise() for c in comp):.3f} | {last['prompt_tok_s']:.0f} | "
                f"{last['output_tok_s']:.1f} | {_fmt(last['ttft_p50'])} / {_fmt(last['ttft_p99'])} | "
                f"{rss_list(rounds)} |"
            )
    print()
    for run, b in sorted(bounds.items()):
        print(
            f"noise bound, run {run}: {_fmt(b, '.3f')} nats (twice the largest load-vs-solo logprob difference of vLLM's own kernel)"
        )
    for rec in records:
        if rec["run"] == "prefix" and not rec.get("prefix_hit_rate"):
            print(
                f"note: {rec['kernel']} prefix: no prefix-cache hits; the server logged: {rec.get('prefix_caching_log')}"
            )
        for name, ok, detail in checks(rec, bounds.get(rec["run"]), require_preemption):
            ok_all &= ok
            if not ok:
                print(f"FAIL {rec['kernel']} {rec['run']}: {name}: {detail}")
        for b in rec.get("bad_requests", []):
            print(f"  {rec['kernel']} {rec['run']} bad request, {b['case']}: HTTP {b['status']} {b['message']!r}")
    print("all checks passed" if ok_all else "SOME CHECKS FAILED")
    return ok_all


def to_json(records, bounds, args) -> dict:
    def rnd(r):
        return {k: v for k, v in r.items() if k != "results"} | {
            "statuses": [x.status for x in r["results"]],
            "ttft": [x.ttft for x in r["results"]],
        }

    recs = []
    for rec in records:
        d = {k: v for k, v in rec.items() if k not in ("rounds", "comparison")}
        d["rounds"] = [rnd(r) for r in rec.get("rounds", [])]
        d["comparison"] = [
            {
                "compared": c.compared,
                "equal": c.equal,
                "divergences": c.divergences,
                "noise_max": c.noise(),
                "noise_p99": sl.percentile(c.deltas, 99),
            }
            for c in rec.get("comparison", [])
        ]
        d["checks"] = [
            {"check": n, "ok": ok, "detail": det}
            for n, ok, det in checks(rec, bounds.get(rec["run"]), args.require_preemption)
        ]
        recs.append(d)
    return {"args": vars(args), "noise_bounds": bounds, "runs": recs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--checkpoint", help="a DeepSeek-V4 checkpoint (official format); default: the small one, written to a temp dir"
    )
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-len", type=int, default=MAX_MODEL_LEN - 64, help="longest prompt (tokens)")
    p.add_argument("--prefix-share", type=float, default=0.3)
    p.add_argument("--cancel-share", type=float, default=0.15)
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds of the load in the base run (RSS checked from round 2)"
    )
    p.add_argument("--kernels", default="vllm,dsv4")
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--preempt-blocks", type=int, default=560, help="--num-gpu-blocks-override of the preempt run")
    p.add_argument("--kvcache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE when not set")
    p.add_argument("--noise-bound", type=float, help="nats; default: measured from vLLM's own kernel's run")
    p.add_argument("--launcher", choices=("script", "module"), default="script")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=1800)
    p.add_argument("--request-timeout", type=float, default=1800)
    p.add_argument(
        "--quick",
        action="store_true",
        help="32 requests, 8 clients, prompts up to 2048, preempt run (preemption counted, not required)",
    )
    p.add_argument("--json")
    args = p.parse_args(argv)
    args.require_preemption = True
    if args.quick:
        # Preemption is counted, not required, at this size: on vllm-cpu 0.32 this load preempted
        # in one run of four at 560 blocks, and neither 48 requests from 16 clients (prompts up to
        # 1536 or 4032 tokens) nor 480 blocks (the fewest that hold a 4096-token request) made it
        # preempt; the step shape of a recomputed request is tested without a server
        # (tests/torch/test_vllm_cpu_step_shapes.py).
        args.require_preemption = False
        args.requests, args.clients, args.max_len, args.rounds, args.runs = 32, 8, 2048, 1, "preempt"
        args.cancel_share = max(args.cancel_share, 0.25)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    for r in runs:
        if r not in RUNS:
            p.error(f"--runs: {r!r} is not one of {RUNS}")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-serve-") as tmp:
        tmp = Path(tmp)
        checkpoint = args.checkpoint
        if checkpoint is None:
            from tools.official_checkpoint import vllm_cpu_config, write_official_checkpoint

            checkpoint = write_official_checkpoint(tmp / "ckpt", seed=0, config=vllm_cpu_config())
        requests = sl.workload(args.requests, args.max_len, args.seed, args.prefix_share, args.cancel_share)
        print(
            f"{len(requests)} requests from {args.clients} clients: prompts {min(len(r.prompt) for r in requests)}.."
            f"{max(len(r.prompt) for r in requests)} tokens ({sum(len(r.prompt) for r in requests)} in all), "
            f"{sum(r.shared_prefix for r in requests)} behind a common prefix, "
            f"{sum(r.cancel_after is not None for r in requests)} cancelled mid-stream; kernels {kernels}, runs {runs}",
            flush=True,
        )
        log_dir = Path(args.json).parent if args.json else tmp
        records = []
        for run in runs:
            for kernel in kernels:
                records.append(serve_run(checkpoint, kernel, run, requests, args, log_dir))
        bounds = noise_bounds(records, args.noise_bound)
        ok = report(records, bounds, args.require_preemption)
        if args.json:
            Path(args.json).write_text(json.dumps(to_json(records, bounds, args), indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
