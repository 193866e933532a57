"""The injectors of scheduled faults, which any chaos target can call; each returns ``(detail, heal)``.

``detail`` says what was done ("SIGKILL pid 1234 (rank 1)"); ``heal`` undoes the fault (continue a stopped worker,
start a killed node again, unmount a read-only bind mount) or is None when there is nothing to undo. A heal may
return a line that says what it did ("re-launched pid 5678, log ..."); the runner records it as ``heal_detail``.

Processes are found and signalled by pid (:mod:`elastictrain.chaos.process_signals`). A killed or drained node,
or a killed server, is started again with the command line, working directory and environment captured with psutil
*before* the fault (:class:`ProcessSpec`), in a session of its own, its output appended to the file its stdout went to.
Storage faults on a directory mount over it (we run as root, so permissions would not stop a write): a
read-only bind mount (writes fail with EROFS) or an overlay whose upper layer is a full tmpfs (existing
checkpoints stay readable, writes fail with ENOSPC); the heal unmounts, leaving the directory as it was.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import psutil

from elastictrain.chaos import process_signals
from elastictrain.chaos.runner import UnsupportedFault
from elastictrain.checkpoint.discovery import list_checkpoints
from elastictrain.checkpoint.manifest import DCP_METADATA_NAME
from elastictrain.checkpoint.storage import open_storage

log = logging.getLogger(__name__)

Heal = Callable[[], Optional[str]]
Result = tuple[str, Optional[Heal]]

_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", ""}

RELAUNCH_LOG_DIR = os.path.join(tempfile.gettempdir(), "elastictrain-chaos")
"""Where a re-launched process writes when its original output did not go to a file."""


def is_gone(pid: int) -> bool:
    """The process exited and released what it held (a zombie counts once its last thread is gone).

    A killed multi-threaded process (Go's rclone, etcd) is a zombie as soon as its main thread exits, while other
    threads still hold its sockets: its port is free only when those are gone too."""
    try:
        if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            return False
    except psutil.NoSuchProcess:
        return True
    try:
        return len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


def cmdline_of(pid: int) -> list[str]:
    """The command line of `pid`, empty when it is gone or unreadable."""
    try:
        return psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait up to `timeout` seconds for `pid` to exit; True when it did."""
    deadline = time.monotonic() + timeout
    while not is_gone(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _netns_of(pid: int) -> Optional[str]:
    """The name (under /var/run/netns) of the network namespace `pid` runs in, None when it is ours.

    UnsupportedFault when it runs in another namespace that has no name, since `ip netns exec` could not re-enter it."""
    try:
        theirs = os.stat(f"/proc/{pid}/ns/net").st_ino
        if theirs == os.stat("/proc/self/ns/net").st_ino:
            return None
    except OSError:
        return None
    for name in sorted(os.listdir("/var/run/netns")) if os.path.isdir("/var/run/netns") else []:
        try:
            if os.stat(os.path.join("/var/run/netns", name)).st_ino == theirs:
                return name
        except OSError:
            continue
    raise UnsupportedFault(f"pid {pid} runs in a network namespace without a name under /var/run/netns; "
                           f"it could not be started there again")


def listening_pid(address: str) -> Optional[int]:
    """The pid of the process listening on `address` ("host:port" or a URL) on this machine, else None."""
    hostport = address.rpartition("://")[2].split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    if not port.isdigit() or host.strip("[]") not in _LOCAL_HOSTS | {socket.gethostname()}:
        return None
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == int(port) and c.pid:
            return c.pid
    return None


@dataclass
class ProcessSpec:
    """What it takes to start a process again: command line, working directory, environment and output file."""

    pid: int
    cmdline: list[str]
    cwd: str
    env: dict[str, str]
    log_path: str
    netns: Optional[str] = None
    started: list[int] = field(default_factory=list)
    """Pids of the copies start() launched."""

    @classmethod
    def capture(cls, pid: int, log_path: Optional[str] = None) -> "ProcessSpec":
        """Read `pid`'s command line, cwd and environment now (before a fault kills it).

        Output goes to `log_path`, else to the regular file the process's stdout went to, else to a file under
        RELAUNCH_LOG_DIR."""
        try:
            p = psutil.Process(pid)
            cmdline, cwd, env = p.cmdline(), p.cwd(), p.environ()
        except psutil.NoSuchProcess:
            raise UnsupportedFault(f"process {pid} is gone; nothing to capture for a re-launch") from None
        except psutil.AccessDenied:
            raise UnsupportedFault(f"cannot read the command line of pid {pid} (run as its user or root)") from None
        if not cmdline:
            raise UnsupportedFault(f"pid {pid} has no command line (a kernel thread or a zombie)")
        if log_path is None:
            try:
                out = os.readlink(f"/proc/{pid}/fd/1")
                if os.path.isfile(out):
                    log_path = out
            except OSError:
                pass
        if log_path is None:
            os.makedirs(RELAUNCH_LOG_DIR, exist_ok=True)
            log_path = os.path.join(RELAUNCH_LOG_DIR, f"relaunch-{pid}.log")
        return cls(pid=pid, cmdline=cmdline, cwd=cwd, env=env, log_path=log_path, netns=_netns_of(pid))

    def start(self) -> subprocess.Popen:
        """Start the captured command again in a new session, output appended to `log_path`."""
        cmd = (["ip", "netns", "exec", self.netns] if self.netns else []) + self.cmdline
        with open(self.log_path, "ab") as out:
            out.write(f"\n===== elastictrain chaos: re-launched pid {self.pid}'s command\n".encode())
            out.flush()
            proc = subprocess.Popen(cmd, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.started.append(proc.pid)
        log.info("chaos: re-launched pid %d's command as pid %d (log %s)", self.pid, proc.pid, self.log_path)
        return proc


def _relaunch_heal(spec: ProcessSpec, what: str, *, exit_timeout: float,
                   should_relaunch: Optional[Callable[[], bool]]) -> Heal:
    """A heal that waits for the old process to exit, then starts its command again."""

    def heal() -> str:
        if not wait_gone(spec.pid, exit_timeout):
            return f"{what} pid {spec.pid} still runs after {exit_timeout:g}s; not re-launched"
        if should_relaunch is not None and not should_relaunch():
            return f"{what} not re-launched: the job has finished"
        proc = spec.start()
        return f"re-launched {what} as pid {proc.pid} (log {spec.log_path})"

    return heal


def choose_worker(agent_pid: int, rank: Optional[int], rng: Optional[random.Random],
                  wait_s: float = 30.0) -> tuple[int, int]:
    """(rank, pid) of a training worker below `agent_pid`: `rank`, else a seeded choice; waits for workers."""
    deadline = time.monotonic() + wait_s
    while not (pids := process_signals.worker_pids(agent_pid)):
        if is_gone(agent_pid):
            raise UnsupportedFault(f"agent pid {agent_pid} is gone; it has no workers to hit")
        if time.monotonic() >= deadline:
            raise UnsupportedFault(f"agent pid {agent_pid} has had no training workers for {wait_s:g}s")
        time.sleep(0.2)
    if rank is None:
        rank = (rng or random.Random()).choice(sorted(pids))
    elif rank not in pids:
        raise UnsupportedFault(f"no worker of rank {rank} below agent pid {agent_pid} (it has ranks "
                               f"{sorted(pids)})")
    return rank, pids[rank]


def kill_worker(agent_pid: int, rank: Optional[int] = None, rng: Optional[random.Random] = None) -> Result:
    """SIGKILL one worker; nothing to heal (the agent restarts the group)."""
    rank, pid = choose_worker(agent_pid, rank, rng)
    os.kill(pid, signal.SIGKILL)
    return f"SIGKILL worker pid {pid} (rank {rank})", None


def stop_worker(agent_pid: int, rank: Optional[int] = None, rng: Optional[random.Random] = None) -> Result:
    """SIGSTOP one worker (a hang); heal: SIGCONT, if the agent has not replaced it meanwhile."""
    rank, pid = choose_worker(agent_pid, rank, rng)
    detail, heal = stall_process(pid, what="worker")
    return f"{detail} (rank {rank})", heal


def kill_node(agent_pid: int, *, log_path: Optional[str] = None, relaunch: bool = True,
              should_relaunch: Optional[Callable[[], bool]] = None) -> Result:
    """SIGKILL an agent and every process below it; heal: start the agent's command again (it re-joins)."""
    spec = ProcessSpec.capture(agent_pid, log_path) if relaunch else None
    killed = process_signals.kill_node(agent_pid)
    detail = f"SIGKILL agent pid {agent_pid} and {len(killed) - 1} process(es) below it"
    if spec is None:
        return detail, None
    return detail, _relaunch_heal(spec, "agent", exit_timeout=30.0, should_relaunch=should_relaunch)


def drain_node(agent_pid: int, *, log_path: Optional[str] = None, relaunch: bool = True,
               exit_timeout: float = 120.0, should_relaunch: Optional[Callable[[], bool]] = None) -> Result:
    """SIGTERM an agent (a graceful drain: its workers save and it leaves); heal: start it again once it exited."""
    spec = ProcessSpec.capture(agent_pid, log_path) if relaunch else None
    process_signals.drain_node(agent_pid)
    detail = f"SIGTERM agent pid {agent_pid} (drain)"
    if spec is None:
        return detail, None
    return detail, _relaunch_heal(spec, "agent", exit_timeout=exit_timeout, should_relaunch=should_relaunch)


def shell_restart(command: str, log_path: Optional[str] = None) -> Heal:
    """A heal that runs a shell command in a new session (e.g. the user's `--etcd-restart-cmd`)."""

    def heal() -> str:
        path = log_path or os.path.join(RELAUNCH_LOG_DIR, "restart.log")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "ab") as out:
            proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return f"ran {command!r} as pid {proc.pid} (log {path})"

    return heal


def restart_server(pid: int, restart: Optional[Heal] = None, *, sig: signal.Signals = signal.SIGKILL,
                   what: str = "server", log_path: Optional[str] = None) -> Result:
    """Kill a server (etcd, an S3 server) with `sig`; heal: `restart()`, else start its captured command again."""
    if restart is None:
        spec = ProcessSpec.capture(pid, log_path)
        restart = _relaunch_heal(spec, what, exit_timeout=30.0, should_relaunch=None)
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise UnsupportedFault(f"{what} pid {pid} is not running") from None
    after_exit = restart

    def heal() -> Optional[str]:
        wait_gone(pid, 30.0)  # the old one must free its port before a new one can take it
        return after_exit()

    return f"{signal.Signals(sig).name} {what} pid {pid}", heal


def stall_process(pid: int, what: str = "server") -> Result:
    """SIGSTOP a process (a server then accepts connections but never answers; a worker hangs); heal: SIGCONT."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        raise UnsupportedFault(f"{what} pid {pid} is not running") from None

    def heal() -> str:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return f"{what} pid {pid} is gone"
        return f"SIGCONT {what} pid {pid}"

    return f"SIGSTOP {what} pid {pid}", heal


def _mount(*args: str) -> None:
    """Run mount(8); UnsupportedFault when mounting is not permitted here."""
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise UnsupportedFault(f"mount {' '.join(args)} failed ({r.stderr.strip() or r.returncode}); storage "
                               f"faults on a directory need root and permission to mount (CAP_SYS_ADMIN)")


def _umount(path: str) -> None:
    """Unmount `path`; lazily when busy (a writer still holds a file open below it)."""
    r = subprocess.run(["umount", path], capture_output=True, text=True)
    if r.returncode != 0:
        log.warning("chaos: umount %s failed (%s); detaching it lazily", path, r.stderr.strip())
        subprocess.run(["umount", "-l", path], check=True, capture_output=True)


def _directory(url: str) -> str:
    """The local directory of a checkpoint URL (a path or file://); UnsupportedFault for object stores."""
    path = url.removeprefix("file://")
    if "://" in path:
        raise UnsupportedFault(f"{url} is not a directory; directory storage faults need a path or file:// URL")
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    return path


def storage_readonly(path: str) -> Result:
    """Make a directory read-only for everyone (a read-only bind mount over itself); heal: unmount."""
    d = _directory(path)
    _mount("--bind", d, d)
    try:
        _mount("-o", "remount,bind,ro", d)
    except UnsupportedFault:
        _umount(d)
        raise

    def heal() -> str:
        _umount(d)
        return f"unmounted the read-only bind mount on {d}"

    return f"read-only bind mount on {d} (writes fail with EROFS)", heal


def storage_full(path: str, size: str = "256k") -> Result:
    """Make a directory full: an overlay whose upper layer is a full tmpfs; existing files stay readable.

    Heal: unmount both; whatever was half-written meanwhile vanishes with the overlay."""
    d = _directory(path)
    scratch = tempfile.mkdtemp(prefix="elastictrain-chaos-full-")
    try:
        _mount("-t", "tmpfs", "-o", f"size={size},nr_inodes=64,mode=0755", "elastictrain-chaos-full", scratch)
    except UnsupportedFault:
        os.rmdir(scratch)
        raise
    try:
        os.makedirs(os.path.join(scratch, "upper"))
        os.makedirs(os.path.join(scratch, "work"))
        with open(os.path.join(scratch, "filler"), "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass  # ENOSPC: the layer is full, as wanted
        _mount("-t", "overlay", "elastictrain-chaos-full", "-o",
               f"lowerdir={d},upperdir={scratch}/upper,workdir={scratch}/work", d)
    except BaseException:
        _umount(scratch)
        shutil.rmtree(scratch, ignore_errors=True)
        raise

    def heal() -> str:
        _umount(d)
        _umount(scratch)
        os.rmdir(scratch)
        return f"unmounted the full overlay on {d}"

    return f"full overlay on {d} (writes fail with ENOSPC)", heal


def corrupt_checkpoint(url: str, storage_options: Optional[dict] = None, rng: Optional[random.Random] = None,
                       nbytes: int = 64) -> Result:
    """Flip `nbytes` bytes in one data file of the newest committed checkpoint (sizes unchanged, checksum not).

    Loading verifies checksums against the manifest, so the job must reject this checkpoint and fall back to an
    older one. Nothing to heal."""
    storage = open_storage(url, storage_options)
    newest = next((c for c in list_checkpoints(storage) if c.valid), None)
    if newest is None or newest.manifest is None:
        raise UnsupportedFault(f"no committed checkpoint under {storage.url} yet; fire corrupt-checkpoint after "
                               f"the first save (e.g. @step=<a multiple of checkpoint.every_steps>)")
    data_files = sorted(f.name for f in newest.manifest.files if f.size > 0 and
                        os.path.basename(f.name) != DCP_METADATA_NAME)
    if not data_files:
        data_files = sorted(f.name for f in newest.manifest.files if f.size > 0)
    if not data_files:
        raise UnsupportedFault(f"checkpoint {newest.url} lists no non-empty file to corrupt")
    name = (rng or random.Random()).choice(data_files)
    data = bytearray(storage.read_bytes(newest.dirname, name))
    start = len(data) // 2
    end = min(len(data), start + nbytes)
    for i in range(start, end):
        data[i] ^= 0xFF
    storage.write_bytes(bytes(data), newest.dirname, name)
    return f"flipped {end - start} bytes at offset {start} of {newest.url}/{name} (step {newest.step})", None
