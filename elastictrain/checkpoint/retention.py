"""Retention: which checkpoints to delete (a pure plan), and deleting them.

Rules, in order of precedence:
- nothing is deleted while a save is in flight (`save_in_flight=True`), and never the newest valid one;
- valid checkpoints: keep the newest `keep_last`, plus every one whose step is a multiple of `keep_every`;
- torn or corrupt leftovers: deleted only when older than the newest valid checkpoint (anything newer
  may be a save in progress, here or in another process) and not listed in `in_flight_steps`;
- blobs (`checkpoint.dedup`): deleted once no remaining checkpoint's manifest references them, never while a save
  is in flight (it may be about to reference one it found); blobs are only collected when a valid checkpoint
  remains (a root whose manifests cannot be read keeps its blobs).
"""

from __future__ import annotations

import logging
from typing import Collection

from elastictrain.checkpoint import blobs as blob_store
from elastictrain.checkpoint.discovery import CheckpointInfo, list_checkpoints
from elastictrain.checkpoint.manifest import MARKER_NAME
from elastictrain.checkpoint.storage import Storage

log = logging.getLogger(__name__)


def plan_retention(checkpoints: list[CheckpointInfo], keep_last: int, keep_every: int = 0, *,
                   save_in_flight: bool = False, in_flight_steps: Collection[int] = ()) -> list[CheckpointInfo]:
    """The checkpoints to delete under the rules above (inputs in any order)."""
    if save_in_flight:
        return []
    valid = sorted((c for c in checkpoints if c.valid), key=lambda c: c.step, reverse=True)
    if not valid:
        return []
    newest = valid[0]
    keep = {c.dirname for c in valid[:max(1, keep_last)]}
    keep.add(newest.dirname)
    if keep_every > 0:
        keep.update(c.dirname for c in valid if c.step % keep_every == 0)
    doomed = [c for c in valid if c.dirname not in keep]
    doomed += [c for c in checkpoints
               if not c.valid and c.step < newest.step and c.step not in set(in_flight_steps)]
    return sorted(doomed, key=lambda c: c.step)


def apply_retention(storage: Storage, keep_last: int, keep_every: int = 0, *, save_in_flight: bool = False,
                    in_flight_steps: Collection[int] = ()) -> list[str]:
    """List the root, delete what `plan_retention` says, return the deleted URLs."""
    files = storage.list_files()
    checkpoints = list_checkpoints(storage, files)
    doomed = plan_retention(checkpoints, keep_last, keep_every, save_in_flight=save_in_flight,
                            in_flight_steps=in_flight_steps)
    deleted = []
    for c in doomed:
        # The marker goes first: a half-deleted checkpoint must read as torn, never as valid.
        try:
            storage.fs.rm(storage.path(c.dirname, MARKER_NAME))
        except FileNotFoundError:
            pass
        storage.remove_dir(c.dirname)
        log.info("retention: deleted %s (%s)", c.url, "valid, beyond keep_last" if c.valid else c.reason)
        deleted.append(c.url)
    gone = {c.dirname for c in doomed}
    remaining = [c for c in checkpoints if c.dirname not in gone]
    if not save_in_flight and any(c.valid for c in remaining) and any(blob_store.is_blob(n) for n in files):
        # A corrupt checkpoint that stays (newer than the newest valid one) may still be read back with its
        # manifest; its blobs are kept too. Torn ones have no manifest: a save in progress writes its blobs
        # before its manifest, which is why nothing is collected while a save is in flight.
        keep = blob_store.referenced(c.manifest for c in remaining)
        blob_store.collect(storage, keep, files)
    return deleted
