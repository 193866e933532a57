"""The time ledger kept beside the checkpoints, so that it survives a full restart (issue #18).

The agents keep the job's history in etcd, and the time ledger (`ledger.py`) is computed from it. A job started
again on an etcd that holds none of it (`elastictrain run` without `--rdzv-endpoint` starts an empty embedded etcd;
a wiped cluster) would start a new ledger. So the agent at group rank 0 keeps the ledger's totals
(`ledger.carry_record`) in `<checkpoint.url>/ledger.json`, through fsspec as the checkpoints are: at its first
round, every `PERSIST_EVERY_S`, after a checkpoint save or a fault's cost (at most every `PERSIST_GAP_S`), and
when it stops.

At its first round it reads that file first. When the file is this job's (same run id and config fingerprint), and
its history began before anything this etcd knows (the etcd is new, not a node re-joining), it appends the file as
one `ledger_carried` event, which every reader's `ledger.compute` adds to what this etcd saw. Until that check has
succeeded it writes nothing: it would overwrite the history it has not carried yet.

Best effort and off the training path: its own thread, one round at a time; a failed read or write is a warning
(once, then at debug level until a round works again), never an error. Not covered: the time between the last write
and a crash of the whole job (the full restart counts it as down time, not as the training it may have been; as the
file is written after each save, that training is mostly what the restart throws away anyway), and a checkpoint root
shared by two different runs (each overwrites the other's file; neither carries the other's).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from typing import Any, Callable, Optional, Protocol

from elastictrain.agent.ledger import CARRIED_EVENT, Ledger, carry_record
from elastictrain.checkpoint.storage import Storage, open_storage

log = logging.getLogger(__name__)

LEDGER_FILE = "ledger.json"
PERSIST_EVERY_S = 30.0
"""How often the agent at group rank 0 rewrites the file (also at its end)."""
PERSIST_GAP_S = 5.0
"""After a checkpoint save or a fault_cost event it rewrites it sooner, but not twice within this."""


class JobRecords(Protocol):
    """The job's records in etcd, as the agent's status publisher reads and writes them (`status.py`)."""

    def job(self) -> Any:
        """The JobRecord (run_id, checkpoint_url, fingerprint, started), None when absent."""

    def events(self) -> list[Any]:
        """The event log (status.Event: time, node, kind, fields), oldest first."""

    def ledger(self, events: list[Any], job: Any) -> Ledger:
        """The time ledger of those records now (`ledger.for_job`)."""

    def append(self, kind: str, fields: dict[str, Any]) -> None:
        """Write one event to the log now (raises when etcd does not take it)."""


class LedgerKeeper:
    """Keeps `<checkpoint.url>/ledger.json` up to date for one agent; carries it into a new etcd once."""

    def __init__(self, records: JobRecords, *, every_s: float = PERSIST_EVERY_S, gap_s: float = PERSIST_GAP_S):
        self.records = records
        self.every_s, self.gap_s = every_s, gap_s
        self._checked = False
        """The file was read and carried into etcd (or there was nothing to carry)."""
        self._storage: Optional[Storage] = None
        self._url: Optional[str] = None
        self._last = -1e18
        self._failing = False
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self.on_carried: Optional[Callable[[], None]] = None
        """Called after the file was carried into etcd (the publisher then reports the full restart's cost)."""

    def poke(self, soon: bool = False, *, now: bool = False) -> None:
        """A round on the keeper's thread if one is due (`soon`: `gap_s` after the last; `now`: at once), unless
        one is running."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            if not now and time.monotonic() - self._last < (self.gap_s if soon else self.every_s):
                return
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self.run_once, name="elastictrain-ledger-file", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """A last round (the job's end), waited for at most `timeout` seconds (each)."""
        with self._lock:
            running = self._thread
        if running is not None:
            running.join(timeout)
        self.poke(now=True)
        with self._lock:
            last = self._thread
        if last is not None and last is not running:
            last.join(timeout)

    def run_once(self) -> bool:
        """Carry the file into etcd (first round), then write the ledger to it; False when it could not."""
        try:
            job = self.records.job()
            if job is None or not job.checkpoint_url:
                return False
            if self._storage is None or self._url != job.checkpoint_url:
                self._storage, self._url = open_storage(job.checkpoint_url), job.checkpoint_url
            storage = self._storage
            events = self.records.events()
            if not self._checked:
                if self._carry(storage, job, events):
                    events = self.records.events()
                    if self.on_carried is not None:
                        self.on_carried()
                self._checked = True
            led = self.records.ledger(events, job)
            record = carry_record(led, job.run_id, storage.url_for(LEDGER_FILE))
            record["fingerprint"] = job.fingerprint
            _write(storage, json.dumps(record).encode())
        except Exception as e:  # noqa: BLE001 - storage or etcd down: training goes on, the next round tries again
            (log.debug if self._failing else log.warning)(
                "could not keep the time ledger beside the checkpoints (%s; a full restart would start it anew "
                "until this works): %s", LEDGER_FILE, e)
            self._failing = True
            return False
        if self._failing:
            log.info("the time ledger is kept in %s again", storage.url_for(LEDGER_FILE))
        self._failing = False
        return True

    def _carry(self, storage: Storage, job: Any, events: list[Any]) -> bool:
        """Append the file's totals as a `ledger_carried` event when this etcd began after them; True if it did."""
        try:
            raw = json.loads(storage.read_bytes(LEDGER_FILE))
        except FileNotFoundError:
            return False
        except (ValueError, UnicodeDecodeError) as e:  # torn or foreign: it will be overwritten
            log.warning("ignoring %s (not a time ledger: %s); this job's ledger starts here",
                        storage.url_for(LEDGER_FILE), e)
            return False
        if not isinstance(raw, dict) or raw.get("run_id") != job.run_id or \
                (raw.get("fingerprint") and job.fingerprint and raw.get("fingerprint") != job.fingerprint):
            log.info("%s is another run's time ledger: not carried", storage.url_for(LEDGER_FILE))
            return False
        if any(e.kind == CARRIED_EVENT for e in events):
            return False  # carried already, by an earlier group rank 0 of this etcd's life
        began = min([job.started, *(e.time for e in events)])
        started = raw.get("started")
        if not isinstance(started, (int, float)) or started >= began - 1.0:
            return False  # this etcd saw that life: a node re-joining, not a full restart
        self.records.append(CARRIED_EVENT, raw)
        log.info("continuing the time ledger of run %s from %s: %.0f s of earlier wall time, %d fault(s)",
                 job.run_id, storage.url_for(LEDGER_FILE), raw.get("wall_s") or 0, len(raw.get("faults") or []))
        return True


def _write(storage: Storage, data: bytes) -> None:
    """Replace the file whole: a local one through a renamed temporary file, an object in one PUT."""
    if not storage.is_local:
        storage.write_bytes(data, LEDGER_FILE)
        return
    tmp = f"{LEDGER_FILE}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        storage.write_bytes(data, tmp)
        os.replace(storage.path(tmp), storage.path(LEDGER_FILE))
    finally:
        if os.path.exists(storage.path(tmp)):
            os.unlink(storage.path(tmp))


__all__ = ["LEDGER_FILE", "PERSIST_EVERY_S", "PERSIST_GAP_S", "JobRecords", "LedgerKeeper"]
