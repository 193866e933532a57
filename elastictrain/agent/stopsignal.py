"""The agent's stop signals, raised as an exception that no `except Exception` can swallow.

torch's elastic agent turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into its `SignalException`, raised in whatever the
agent's main thread runs at that moment, and ends the run when it reaches `run()`. But `SignalException` is an
`Exception`: every best-effort handler on the main thread (an etcd call during an outage, a listener, a rendezvous
step) catches it with the error it was written for, and the stop is lost. Seen: an agent signalled while it retried
a rendezvous watch logged the signal as an etcd error and trained on until it was SIGKILLed 60 s later. A scheduler's
SIGTERM is a node's only chance to drain; it must not depend on where it lands.

So, like Python's own KeyboardInterrupt: while the agent runs, the handler torch installs (again at every worker
start) is replaced by one that raises `AgentSignalled`, a `BaseException`. It passes through every `except
Exception` between the signal and `_invoke_run`, where `as_torch_signal` turns it back into torch's
`SignalException`: torch's run then stops the workers with that signal (a drain: they finish their step and save)
and the callers that handle a stop (launch, job) see what they always saw. Outside the agent's run torch's handler
is put back.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from torch.distributed.elastic.multiprocessing import api as _mp_api
from torch.distributed.elastic.multiprocessing.api import SignalException

ENV_TORCH_SIGNALS = "TORCHELASTIC_SIGNALS_TO_HANDLE"
"""torch's own setting of the signals it handles (default SIGTERM,SIGINT,SIGHUP,SIGQUIT): ours follows it."""


def _signals() -> list[signal.Signals]:
    names = os.environ.get(ENV_TORCH_SIGNALS, "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",")
    return [getattr(signal, n.strip()) for n in names if isinstance(getattr(signal, n.strip(), None), signal.Signals)]


class AgentSignalled(BaseException):
    """A stop signal on its way to the agent's run (a BaseException: best-effort handlers let it pass)."""

    def __init__(self, sigval: signal.Signals) -> None:
        super().__init__(f"Process {os.getpid()} got signal: {sigval}")
        self.sigval = sigval


def _raise(signum: int, frame: object) -> None:
    raise AgentSignalled(signal.Signals(signum))


def _swap(old: Any, new: Any) -> None:
    """Install `new` for each handled signal whose handler is `old` (on the main thread only, as Python requires)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _signals():
        if signal.getsignal(sig) is old:
            signal.signal(sig, new)


def install() -> None:
    """Put ours where torch's handler is installed (cheap; call after anything that may start workers)."""
    torch_handler = getattr(_mp_api, "_terminate_process_handler", None)
    if torch_handler is not None:
        _swap(torch_handler, _raise)


def uninstall() -> None:
    """Put torch's handler back where ours is: outside the agent's run a signal is torch's `SignalException`."""
    torch_handler = getattr(_mp_api, "_terminate_process_handler", None)
    if torch_handler is not None:
        _swap(_raise, torch_handler)


@contextmanager
def as_torch_signal() -> Iterator[None]:
    """Where torch's code and ours expect torch's `SignalException`, give them that."""
    try:
        yield
    except AgentSignalled as e:
        raise SignalException(str(e), sigval=e.sigval) from None
