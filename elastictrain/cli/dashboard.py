"""`elastictrain dashboard [--port]`: a small read-only status page on localhost.

A sampler thread reads the job every `--interval` seconds (the same snapshot as `elastictrain status`, with its
time ledger) and keeps the steps over time; the page (`dashboard.html`, static, no external assets) polls
`/api/status` and redraws. Every panel comes from one read: the checkpoint header and table from the same listing,
the fault markers and the time-lost bar from the same ledger, and the page shows that read's age.
Endpoints: `/` the page, `/api/status` JSON {view, history, checkpoints, read_at, age_s, error}. Only the
standard library.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Optional

from elastictrain.agent.jobstate import CheckpointView, collect
from elastictrain.cli import target as tgt

log = logging.getLogger(__name__)

HISTORY_POINTS = 600
"""Samples of (time, node, step) kept for the steps-over-time chart."""


def _list_checkpoints(url: Optional[str]) -> list[dict[str, Any]]:
    if not url:
        return []
    from elastictrain.checkpoint.discovery import list_checkpoints
    from elastictrain.checkpoint.storage import open_storage

    try:
        infos = list_checkpoints(open_storage(url))
    except Exception as e:  # storage down: the page says so through `error`-free empty list; status has more
        log.debug("listing %s failed: %s", url, e)
        return []
    return [{"step": i.step, "status": i.status, "url": i.url, "bytes": i.nbytes,
             "created": i.manifest.metadata.created_at if i.manifest is not None else None,
             "world_size": i.manifest.metadata.world_size if i.manifest is not None else None}
            for i in sorted(infos, key=lambda i: i.step, reverse=True)[:20]]


class Sampler:
    """Reads the job periodically; thread-safe access to the latest state for the HTTP handlers."""

    def __init__(self, target: tgt.JobConnection, interval_s: float):
        self.target, self.interval_s = target, interval_s
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_POINTS)
        self.view: Optional[dict[str, Any]] = None
        self.checkpoints: list[dict[str, Any]] = []
        self.read_at: Optional[float] = None
        self.error = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dashboard-sampler", daemon=True)

    def start(self) -> "Sampler":
        self.sample()
        self._thread.start()
        return self

    def sample(self) -> None:
        try:
            view = collect(self.target, events=30, checkpoint=False)
            # The header's "last checkpoint" comes from this listing too: read apart, they contradicted each other
            # (header step 100, table only up to step 50).
            ckpts = _list_checkpoints(view.checkpoint_url)
        except Exception as e:  # etcd down: keep the last view, say why
            with self._lock:
                self.error = f"{type(e).__name__}: {e}"
            return
        newest = next((c for c in ckpts if c["status"] == "valid"), None)
        if newest is not None:
            view.checkpoint = CheckpointView(step=newest["step"], url=newest["url"], age_s=round(
                view.time - newest["created"], 1) if newest["created"] else 0.0)
        view.checkpoint_checked = bool(view.checkpoint_url)
        with self._lock:
            self.view, self.error, self.read_at = view.to_dict(), "", view.time
            self.history.append({"time": view.time, "steps": {m.node: m.step for m in view.members
                                                              if m.step is not None and m.state != "gone"}})
            self.checkpoints = ckpts

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"view": self.view, "history": list(self.history), "checkpoints": self.checkpoints,
                    "read_at": self.read_at, "age_s": None if self.read_at is None else round(
                        time.time() - self.read_at, 1), "error": self.error}

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def page() -> bytes:
    return resources.files("elastictrain.cli").joinpath("dashboard.html").read_bytes()


def make_server(sampler: Sampler, host: str, port: int) -> ThreadingHTTPServer:
    html = page()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", html)
            elif path == "/api/status":
                self._send(200, "application/json", json.dumps(sampler.snapshot(), default=str).encode())
            else:
                self._send(404, "text/plain", b"not found\n")

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("dashboard: " + fmt, *args)

    return ThreadingHTTPServer((host, port), Handler)


def _cmd_dashboard(args: argparse.Namespace) -> int:
    target = tgt.connect(args)
    sampler = Sampler(target, args.interval).start()
    server = make_server(sampler, args.host, args.port)
    print(f"dashboard of run {target.settings.run_id} on http://{args.host}:{server.server_port}/ (Ctrl-C stops)",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        sampler.close()
        target.close()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="a read-only status page on localhost (refreshes itself)",
                       description=__doc__.split("\n\n")[0])
    tgt.add_target_args(p)
    p.add_argument("--port", type=int, default=8642, help="port (default %(default)s; 0 picks a free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between reads of the job")
    p.set_defaults(func=_cmd_dashboard)
