"""A pre-warmed spare worker: imports the worker's code ahead of time, then becomes a worker when told.

Most of a restart is a new worker's start-up (Python, torch, transformers, the recipe: 3-4 s on a 2-core machine),
not the rendezvous. The agent keeps one spare per local rank, started as

    python [flags] -m elastictrain.runtime.warmstart [flags] -m <module> <args...>

with the worker's own command after ``warmstart``. The spare imports the modules listed in ``$ELASTICTRAIN_PREWARM``
(comma-separated: torch for a user's script, and `--prewarm`'s), then ``<module>`` (and calls its ``prewarm(argv)``
when it has one; a script is not run ahead: it may train at import), then blocks on one JSON line on stdin:
``{"env": {...}, "args": [...], "stdout": path|null, "stderr": path|null}``. It then takes that environment and
those streams and runs the module (or script) as ``__main__``, exactly like ``python -m <module> <args...>``
would. End of input before an assignment means the pool closed: exit 0.

The spare is the agent's child from the start, so exit codes, signals, process groups and PDEATHSIG work as for a
worker started cold. ``/proc/<pid>/environ`` keeps the spare's start-up environment, so the agent writes the
assigned rank to ``$ELASTICTRAIN_WARM_DIR/<pid>.rank`` for tools that look workers up by process
(``assigned_rank``).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import runpy
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NoReturn, Optional, Sequence

from elastictrain.runtime.allocator import tune_malloc
from elastictrain.runtime.heartbeat import die_with_parent

log = logging.getLogger(__name__)

ENV_WARM_DIR = "ELASTICTRAIN_WARM_DIR"
ENV_PREWARM = "ELASTICTRAIN_PREWARM"
ENV_IMPORT_NICE = "ELASTICTRAIN_SPARE_IMPORT_NICE"
"""Set for a spare started while the job trains (a refill): import at this much lower CPU priority (`import_nicely`)."""
MODULE = "elastictrain.runtime.warmstart"
RUN_NOW = "--run-now"
"""First argument of a worker started cold through this module (`cold_command`): run the command that follows."""


@dataclass(frozen=True)
class Target:
    """What a worker command line runs: a module (``-m``) or a script, with its arguments."""

    module: Optional[str]
    script: Optional[str]
    argv: list[str]
    unbuffered: bool


def parse_command(args: Sequence[str]) -> Target:
    """Split ``[interpreter flags] (-m module | script) args...`` the way the interpreter would."""
    args = list(args)
    unbuffered = False
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-m":
        unbuffered |= args[i] == "-u"
        i += 1
    if i < len(args) and args[i] == "-m" and i + 1 < len(args):
        return Target(module=args[i + 1], script=None, argv=args[i + 2:], unbuffered=unbuffered)
    if i < len(args):
        return Target(module=None, script=args[i], argv=args[i + 1:], unbuffered=unbuffered)
    raise ValueError(f"no module or script in worker command {args!r}")


def rank_file(warm_dir: str, pid: int) -> str:
    return os.path.join(warm_dir, f"{pid}.rank")


def ready_file(warm_dir: str, pid: int) -> str:
    return os.path.join(warm_dir, f"{pid}.ready")


def idle_spares(launcher_pid: int) -> tuple[int, int]:
    """(ready, total) idle spares below a launcher process: a ready one has finished its imports."""
    import psutil

    ready = total = 0
    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return 0, 0
    for p in children:
        try:
            if MODULE not in p.cmdline() or p.status() == psutil.STATUS_ZOMBIE:
                continue
            warm_dir = p.environ().get(ENV_WARM_DIR, "")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if not warm_dir or os.path.exists(rank_file(warm_dir, p.pid)):
            continue  # already a worker
        total += 1
        ready += os.path.exists(ready_file(warm_dir, p.pid))
    return ready, total


def assigned_rank(pid: int, environ: Mapping[str, str]) -> Optional[int]:
    """The global rank a process runs as: RANK from its start-up environment, else its spare assignment."""
    if "RANK" in environ:
        return int(environ["RANK"])
    warm_dir = environ.get(ENV_WARM_DIR)
    if not warm_dir:
        return None
    try:
        with open(rank_file(warm_dir, pid)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None  # an idle spare


def _prewarm(target: Target, modules: Sequence[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - a module the script needs fails in its own run, not here
            log.warning("pre-warming: cannot import %s (%s)", name, e)
    if target.module is None:
        return
    try:
        mod = importlib.import_module(target.module)
        hook = getattr(mod, "prewarm", None)
        if callable(hook):
            hook(list(target.argv))
    except BaseException as e:  # noqa: BLE001 - the real run reports it, in the worker's own log
        log.debug("pre-warming %s failed (%s); the worker will import it cold", target.module, e)


def import_nicely(nice: str) -> Callable[[], None]:
    """Lower this thread's CPU priority by `nice` and put it under Linux's SCHED_IDLE policy (a refill's imports,
    several CPU-seconds, then take the cores only when the training workers leave them idle); returns what puts both
    back, called when the spare is assigned or dismissed. Only where the priority can be raised again (root,
    CAP_SYS_NICE or RLIMIT_NICE; tried first in a throwaway thread: Linux keeps the nice value and the policy per
    thread): an unprivileged process cannot, and a worker left at a low priority would hold back the whole group.
    Elsewhere the spare imports at normal priority, as before. An assignment that arrives while the imports still
    run restores the priority at once (a thread waits for it).

    Why SCHED_IDLE as well as nice 19: a nice-19 task still runs out its time slice when a training worker wakes on
    its core, and a small model's step wakes its worker dozens of times (one per collective): with a refill importing
    beside it, the tiny model's steps ran at half their pace for the 8-9 s of the imports (goodput.py, seed 7, each
    refill; the time ledger called it training). A waking task preempts a SCHED_IDLE one at once."""
    def nothing() -> None:
        return None

    if not nice.strip().isdigit() or int(nice) <= 0 or not _can_raise_priority_again():
        return nothing
    import select
    import threading

    base = os.getpriority(os.PRIO_PROCESS, 0)
    main = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, main, min(19, base + int(nice)))
    except OSError:
        return nothing
    # Linux only (os.SCHED_IDLE): elsewhere the probe says no and nice alone applies.
    idle = _can_leave_idle_policy() and os.sched_getscheduler(main) == os.SCHED_OTHER
    if idle:
        try:
            os.sched_setscheduler(main, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            idle = False
    restored = threading.Lock()

    def restore() -> None:
        if not restored.acquire(blocking=False):
            return
        # Every thread: those the imports started (one, from torch) inherited the lower priority and the policy.
        for tid in [main, *(int(t) for t in _tasks() if int(t) != main)]:
            try:
                if idle and os.sched_getscheduler(tid) == os.SCHED_IDLE:
                    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                if os.getpriority(os.PRIO_PROCESS, tid) > base:
                    os.setpriority(os.PRIO_PROCESS, tid, base)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
            except OSError as e:  # the probe said it could: log it, the worker runs on at the lower priority
                log.warning("spare worker could not restore the CPU priority %d of thread %d: %s", base, tid, e)

    def on_assignment() -> None:  # an assignment (or the end of input) while still importing: at full speed now
        try:
            select.select([sys.stdin.buffer], [], [])
        except (OSError, ValueError):
            pass
        restore()

    threading.Thread(target=on_assignment, name="spare-priority", daemon=True).start()
    return restore


def _tasks() -> list[str]:
    try:
        return os.listdir("/proc/self/task")
    except OSError:
        return []


def _can_raise_priority_again() -> bool:
    """Whether a thread of this process can lower its nice value and raise it back (root, CAP_SYS_NICE, RLIMIT_NICE)."""
    def probe() -> None:  # this thread's nice value only (who=0 is the calling thread on Linux)
        base = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, base + 1)
        os.setpriority(os.PRIO_PROCESS, 0, base)

    return _in_throwaway_thread(probe, "nice-probe")


def _can_leave_idle_policy() -> bool:
    """Whether a thread of this process can go under SCHED_IDLE and back to SCHED_OTHER (Linux only; root,
    CAP_SYS_NICE, or Linux >= 2.6.39 with RLIMIT_NICE allowing the nice value)."""
    import threading

    def probe() -> None:
        tid = threading.get_native_id()
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))

    return _in_throwaway_thread(probe, "idle-probe")


def _in_throwaway_thread(probe: Callable[[], None], name: str) -> bool:
    """Whether `probe` ran without error in a thread of its own (Linux keeps the nice value and the scheduling
    policy per thread: whatever it changes and cannot undo ends with that thread)."""
    import threading

    result: list[bool] = []

    def run() -> None:
        try:
            probe()
            result.append(True)
        except (OSError, AttributeError):  # AttributeError: no os.SCHED_IDLE / sched_setscheduler here
            result.append(False)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    return bool(result and result[0])


def _redirect(fd: int, path: Optional[str]) -> None:
    if path:
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)


def _become(assignment: dict[str, Any]) -> None:
    """Take the worker's environment, streams and arguments."""
    sys.stdout.flush()
    sys.stderr.flush()
    _redirect(1, assignment.get("stdout"))
    _redirect(2, assignment.get("stderr"))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(assignment["env"])
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def _path_as_python_sets_it(target: Target) -> None:
    """sys.path[0] as `python script.py` sets it: the script's directory (symlinks resolved), so that a script's
    sibling modules (`from model import Net`) import in a warm spare as they do cold. Under `-m` it stays the
    working directory, as `python -m` has it."""
    if target.module is None and target.script:
        sys.path[0] = os.path.dirname(os.path.realpath(target.script))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parent = os.getppid()
    die_with_parent(parent)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [RUN_NOW]:  # a worker started cold: no assignment to wait for, the environment is its own
        work = parse_command(argv[1:])
        _path_as_python_sets_it(work)
        return _run(work)
    target = parse_command(argv)
    _path_as_python_sets_it(target)
    restore = import_nicely(os.environ.pop(ENV_IMPORT_NICE, ""))
    _prewarm(target, [m for m in os.environ.get(ENV_PREWARM, "").split(",") if m])
    warm_dir = os.environ.get(ENV_WARM_DIR)
    if warm_dir:
        open(ready_file(warm_dir, os.getpid()), "w").close()
    line = sys.stdin.buffer.readline()
    restore()
    if not line.strip():
        return 0
    assignment = json.loads(line)
    work = parse_command(assignment["args"])
    _path_as_python_sets_it(work)
    _become(assignment)
    return _run(work)


def cold_command(args: Sequence[str]) -> list[str]:
    """The arguments (after the interpreter) that start a worker cold through this module, so that it leaves as a
    spare does (`_leave`): `[-u] -m warmstart --run-now <the worker's own command>`. A command
    with other interpreter options (`-c code`, `-W arg`: this module's parsing does not know their arguments) is
    left as it is."""
    args = [str(a) for a in args]
    lead = next((i for i, a in enumerate(args) if not a.startswith("-") or a == "-m"), len(args))
    if any(a != "-u" for a in args[:lead]) or lead == len(args):
        return args
    return [*args[:lead], "-m", MODULE, RUN_NOW, *args]


def _run(work: Target) -> NoReturn:
    """Run the worker's module or script as `__main__`, then leave as `python` would (`_leave`), with its exit code;
    a failed script's process groups are aborted first."""
    tune_malloc()  # elastic.worker_malloc, as the agent set it in the environment the worker took
    try:
        if work.module is not None:
            sys.argv = [work.module, *work.argv]
            # Like `python -m`: the module runs as __main__, a copy apart from the pre-imported one (whose imports
            # it reuses). Left in sys.modules, runpy would warn about exactly that.
            sys.modules.pop(work.module, None)
            runpy.run_module(work.module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [work.script, *work.argv]
            runpy.run_path(work.script, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the same exit code
        sys.excepthook(*sys.exc_info())
        code = 1
    else:
        code = 0
    if code != 0:
        abort_process_groups()
    _leave(code)


def _exit_code(e: SystemExit) -> int:
    """The exit status the interpreter gives `sys.exit(e.code)` (a message is printed, and means 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)  # noqa: T201 - what the interpreter prints for sys.exit("message")
    return 1


def _leave(code: int) -> NoReturn:
    """The script's exit, at once, in the interpreter's order: it waits for the script's non-daemon threads, runs
    its atexit handlers (the script's process groups still there, as under `python script.py`: a handler may use or
    destroy them) and flushes every file it left open; then it destroys the groups the script left and exits,
    skipping the interpreter's teardown of torch's objects. That teardown aborted now and then with torch 2.13, with
    a gloo group alive and even after the script destroyed its group itself (a TCPStore client: SIGABRT for a
    script that had finished, CI), and it takes seconds: meanwhile a peer that saw this rank's groups close exits
    first, and its agent, stopping this process, records SIGTERM instead of this exit code (a `sys.exit(2)` that
    was to end the job)."""
    import atexit
    import gc
    import io
    import threading

    try:  # as the interpreter does first: wait for the script's non-daemon threads (executors shut down first)
        threading._shutdown()  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 - a private helper of the interpreter's own exit
        log.debug("waiting for the script's threads at exit: %s", e)
    atexit._run_exitfuncs()
    for obj in gc.get_objects():  # what the teardown would have flushed: files the script never closed
        try:
            if isinstance(obj, io.IOBase) and not obj.closed and obj.writable():
                obj.flush()
        except Exception:  # noqa: BLE001, S112 - a stream that cannot flush now would not at teardown either
            continue
    destroy_process_groups()
    logging.shutdown()
    os._exit(code)


def _groups() -> Any:
    """torch.distributed if the script initialised a process group that is still there, else None."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist if dist is not None and dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - a half-imported torch at exit
        return None


def abort_process_groups() -> None:
    """After a failed script, before anything else waits at its exit: abort the groups it left, so that a collective
    still pending (one of its threads, a peer that never answers, on NCCL) returns at once instead of holding the
    exit; the groups are destroyed at the end of `_leave`."""
    dist = _groups()
    if dist is None:
        return
    from torch.distributed import distributed_c10d as c10d

    for pg in list(c10d._world.pg_map):
        try:
            pg.abort()
        except Exception as e:  # noqa: BLE001 - a backend without abort
            log.debug("abort of a process group at exit: %s", e)


def destroy_process_groups() -> None:
    """Destroy the process groups a script left (a plain torch script seldom destroys its own) before the process
    exits: with torch 2.13, a process that exits with a gloo group alive now and then aborts in the interpreter's
    teardown ("terminate called without an active exception"), and its agent sees SIGABRT instead of the script's
    exit code: a `sys.exit(2)` (stop the job) became a restart. Reproduced with two plain gloo processes: 2 of 12
    exits aborted, 0 of 12 after a destroy."""
    dist = _groups()
    if dist is None:
        return
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - leaving anyway: the exit code matters more
        log.debug("could not destroy the process groups at exit: %s", e)


if __name__ == "__main__":
    sys.exit(main())
