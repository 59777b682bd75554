"""A bounded closed-loop load generator on loopback (count- and time-limited)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def add_http_proxy_arg(p, many: bool = False) -> None:
    """--http-proxy for a benchmark that starts its own Ray (pass the value to select_http_proxy first)."""
    from cluster.launcher import HTTP_PROXIES

    if many:
        p.add_argument("--http-proxy", choices=HTTP_PROXIES, nargs="+", default=["python"],
                       help="Ray Serve's HTTP data path: its Python proxy actor, HAProxy, or both one after "
                            "the other (Ray restarts between them)")
    else:
        p.add_argument("--http-proxy", choices=HTTP_PROXIES, default="python",
                       help="Ray Serve's HTTP data path: its Python proxy actor or HAProxy (set before Ray starts)")


INGRESS_MODES = ("separate", "direct")


def add_ingress_arg(p, many: bool = False) -> None:
    """--ingress: an Ingress deployment in front of the LLMServer, or the LLMServer serving the API itself
    (server.direct_streaming); with many, several one after the other."""
    p.add_argument("--ingress", choices=INGRESS_MODES, nargs="+" if many else None,
                   default=["separate"] if many else "separate",
                   help="'separate': an Ingress deployment in front of the LLMServer (--ingress-replicas of it); "
                        "'direct': server.direct_streaming, the LLMServer replica serves the API itself")


def ingress_server_keys(ingress: str, ingress_replicas: int) -> dict:
    """The `server` keys of a benchmark config for one --ingress choice."""
    return {"direct_streaming": True} if ingress == "direct" else {"ingress_replicas": ingress_replicas}


def add_user_code_loop_arg(p, many: bool = False) -> None:
    """--user-code-loop: server.user_code_loop's choices and default (the app's); with many, several one
    after the other."""
    import typing

    from serve_app.config import ServerConfig

    field = ServerConfig.model_fields["user_code_loop"]
    p.add_argument("--user-code-loop", choices=typing.get_args(field.annotation), nargs="+" if many else None,
                   default=[field.default] if many else field.default,
                   help="server.user_code_loop: our code on Serve's user-code thread ('separate'), on the "
                        "replica's main loop ('shared'), or as the layout picks ('auto', the app's default)"
                        + ("; several one after the other, Ray restarted between" if many else ""))


def add_access_log_arg(p) -> None:
    """--access-log on|off: server.access_log for the benchmark's deployment, the app's default unless given
    (read it as ``args.access_log == "on"``)."""
    from serve_app.config import ServerConfig

    p.add_argument("--access-log", choices=("on", "off"),
                   default="on" if ServerConfig.model_fields["access_log"].default else "off",
                   help="server.access_log: Serve's per-request log line in the replica (default: the app's)")


def add_engine_process_arg(p, help_text: str, default: str = "inline") -> None:
    """--engine-process: engine.process values to run, in the order given."""
    from serve_app.engines.options import ENGINE_PROCESSES

    p.add_argument("--engine-process", choices=ENGINE_PROCESSES, nargs="+", default=[default], help=help_text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_json(path, obj) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(obj, indent=2))


def stat_cpu_s(stat_path: str) -> float:
    """User + system CPU seconds from a /proc ``stat`` file: a process's (/proc/PID/stat) or one thread's
    (/proc/PID/task/TID/stat). The command name in parentheses may hold spaces, so fields count from its end."""
    fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(xs, p):
    """Nearest-rank percentile; NaN for no samples."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


@dataclass
class LoadResult:
    concurrency: int
    requests: int = 0
    errors: int = 0
    status: dict = field(default_factory=dict)
    latencies_s: list = field(default_factory=list)
    ttft_s: list = field(default_factory=list)
    output_tokens: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict:
        return {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "errors": self.errors,
            "status": self.status,
            "rps": self.requests / self.wall_s if self.wall_s else 0.0,
            "p50_ms": 1000 * percentile(self.latencies_s, 50),
            "p99_ms": 1000 * percentile(self.latencies_s, 99),
            "mean_ms": 1000 * statistics.fmean(self.latencies_s) if self.latencies_s else float("nan"),
            "ttft_p50_ms": 1000 * percentile(self.ttft_s, 50),
            "ttft_p95_ms": 1000 * percentile(self.ttft_s, 95),
            "output_tok_s": self.output_tokens / self.wall_s if self.wall_s else 0.0,
            "wall_s": self.wall_s,
        }


async def run_load(
    url: str,
    body: dict,
    concurrency: int,
    max_requests: int,
    max_duration_s: float,
    stream: bool = False,
    warmup_requests: int = 0,
) -> LoadResult:
    """Each of `concurrency` workers sends requests back to back until either bound is hit."""
    res = LoadResult(concurrency=concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for _ in range(warmup_requests):
            await client.post(url, json=body)
        issued = 0
        deadline = time.monotonic() + max_duration_s

        async def one():
            t0 = time.perf_counter()
            if not stream:
                r = await client.post(url, json=body)
                dt = time.perf_counter() - t0
                res.status[r.status_code] = res.status.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    res.latencies_s.append(dt)
                    res.ttft_s.append(dt)
                    res.output_tokens += r.json().get("usage", {}).get("completion_tokens", 0)
                else:
                    res.errors += 1
                return
            first = None
            tokens = 0
            async with client.stream("POST", url, json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as r:
                res.status[r.status_code] = res.status.get(r.status_code, 0) + 1
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if first is None:
                        first = time.perf_counter() - t0
                    obj = json.loads(line[6:])
                    if obj.get("usage"):
                        tokens = obj["usage"]["completion_tokens"]
                    if "error" in obj:
                        res.errors += 1
            if r.status_code != 200:
                res.errors += 1
                return
            res.latencies_s.append(time.perf_counter() - t0)
            res.ttft_s.append(first if first is not None else float("nan"))
            res.output_tokens += tokens

        async def worker():
            nonlocal issued
            while issued < max_requests and time.monotonic() < deadline:
                issued += 1
                try:
                    await one()
                    res.requests += 1
                except Exception:
                    res.errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        res.wall_s = time.perf_counter() - t0
    return res


# the kernel's TCP counters that a stalled connection or request leaves (Linux; both files are
# "Prefix: names" / "Prefix: values" line pairs): a full accept queue drops SYNs, each retried after 1 s.
# In the order a report prints them: the ones that mean a stall first
TCP_COUNTERS = {"TcpExt": ("ListenOverflows", "ListenDrops", "TCPSynRetrans", "TCPTimeouts"),
                "Tcp": ("RetransSegs", "ActiveOpens", "AttemptFails", "EstabResets")}


def tcp_counters() -> dict[str, int]:
    """This host's (network namespace's) TCP counters of :data:`TCP_COUNTERS` now; {} where /proc has none."""
    out = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            continue
        for names, values in zip(lines[::2], lines[1::2]):
            prefix, names = names.split(":", 1)
            wanted = TCP_COUNTERS.get(prefix, ())
            for name, value in zip(names.split(), values.split(":", 1)[1].split()):
                if name in wanted:
                    out[name] = int(value)
    return out


def tcp_counters_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if k in before}


class BareClient:
    """Streamed completions from a bare asyncio client: a hand-written HTTP/1.1 request on a kept-alive
    connection per stream (``send(stream, body)``; a stream sends one request at a time), the response's bytes
    scanned, not parsed, but for the usage chunk's token count. The floor under what an HTTP client adds to the
    stack's first token and to a closed loop's way back; httpx, which the loads and the openai package use,
    builds each request and parses each response in Python (on the CPU box ~1.3 ms of an idle request's first
    chunk: docs/benchmarks.md, twenty-fourth session)."""

    def __init__(self, url: str):
        from urllib.parse import urlsplit

        u = urlsplit(url)
        self._host, self._port, self._netloc, self._path = u.hostname, u.port, u.netloc, u.path
        self._conns: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}

    async def send(self, stream: int, body: dict) -> dict:
        """``{ttft_s, ttft_text_s, e2e_s, tokens}`` (the first SSE data message: an SSE chunk carries text) with
        the legs of gpu_stack.client_legs (``new_connection``, ``sent_s``, ``headers_s``), or ``{ttft_s: None,
        tokens: 0, status}`` for an error status or a stream that ends in an error message."""
        payload = json.dumps(body).encode()
        head = (f"POST {self._path} HTTP/1.1\r\nHost: {self._netloc}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode()
        t0, first = time.perf_counter(), None
        new_connection = stream not in self._conns
        if new_connection:
            self._conns[stream] = await asyncio.open_connection(self._host, self._port)
        reader, writer = self._conns[stream]
        try:
            writer.write(head + payload)
            sent = time.perf_counter()
            buf = await reader.readuntil(b"\r\n\r\n")  # the status line and headers
            legs = {"new_connection": new_connection, "sent_s": sent - t0, "headers_s": time.perf_counter() - sent}
            status = buf.split(b" ", 2)[1].decode(errors="replace")
            if status != "200":  # an error's body is not chunked: drop the connection rather than read it
                self._drop(stream)
                return {"ttft_s": None, "tokens": 0, "status": int(status) if status.isdigit() else 0}
            while not buf.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's last chunk
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("the server closed the connection mid-response")
                buf += data
                if first is None and b"data: {" in buf:
                    first = time.perf_counter() - t0
        except BaseException:
            self._drop(stream)
            raise
        e2e_s = time.perf_counter() - t0
        if b'data: {"error"' in buf:  # the headers had gone out: the error came in the stream (as http_one: 500)
            return {"ttft_s": None, "tokens": 0, "status": 500, "in_band_error": True}
        counts = re.findall(rb'"completion_tokens":\s*(\d+)', buf)
        return {"ttft_s": first, "ttft_text_s": first, "e2e_s": e2e_s, "tokens": int(counts[-1]) if counts else 0,
                **legs}

    def _drop(self, stream: int) -> None:
        conn = self._conns.pop(stream, None)
        if conn is not None:
            conn[1].close()

    def close(self) -> None:
        for stream in list(self._conns):
            self._drop(stream)


async def bare_client_ttft_s(url: str, body: dict, n: int) -> list[float]:
    """Time to the first SSE data message of ``n`` streamed requests sent one after another from a
    :class:`BareClient`; a failed one raises."""
    client = BareClient(url)
    out = []
    try:
        for _ in range(n):
            r = await client.send(0, body)
            if r["ttft_s"] is None:
                raise RuntimeError("the stream ended with an error message" if r.get("in_band_error")
                                   else f"the streamed request failed: status {r['status']}")
            out.append(r["ttft_s"])
    finally:
        client.close()
    return out


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in cols))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)
