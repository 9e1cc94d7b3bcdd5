"""The minimal non-streamed HTTP path: raw engine throughput, with nothing of the rollout client in it.

Each of `concurrency` threads keeps one keep-alive `http.client` connection and posts whole requests;
the answers are read once, at the end. This is what in-loop rollouts are held against (in-loop
throughput >= 95% of raw on the same request set).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit


def post_all(base_url: str, path: str, bodies: list[dict[str, Any]], concurrency: int,
             timeout_s: float) -> list[tuple[float, dict[str, Any] | str]]:
    """POST every body; -> per body (seconds until its answer, the parsed JSON answer or an error text)."""
    url = urlsplit(base_url)
    local = threading.local()

    def connection() -> http.client.HTTPConnection:
        if getattr(local, "conn", None) is None:
            local.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
        return local.conn

    def one(body: dict[str, Any]) -> tuple[float, dict[str, Any] | str]:
        t0 = time.perf_counter()
        conn = connection()
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            local.conn = None  # a broken connection is not reused
            return time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"
        elapsed = time.perf_counter() - t0
        if response.status != 200:
            return elapsed, f"HTTP {response.status}: {payload[:500].decode(errors='replace')}"
        try:
            return elapsed, json.loads(payload)
        except ValueError as exc:
            return elapsed, f"not JSON: {exc}"

    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(bodies)))) as pool:
        return list(pool.map(one, bodies))
