"""Finding checkpoints: one recursive listing of the root, then marker + manifest reads, newest first.

Cost on S3: one paginated LIST for the whole root (sizes included), then two small GETs (marker,
manifest) per committed checkpoint inspected; `find_latest_valid` stops at the first valid one, so a
healthy root costs one LIST + two GETs. Missing and truncated files are caught from the listing alone;
checksums (a full read of the checkpoint) only when asked (`verify_files`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Optional

from elastictrain.checkpoint.blobs import is_blob, verify_blob
from elastictrain.checkpoint.manifest import (
    MANIFEST_NAME,
    MARKER_NAME,
    CommitMarker,
    Manifest,
    parse_step_dir,
    sha256_bytes,
    sha256_stream,
    step_dir_name,
)
from elastictrain.checkpoint.storage import Storage

log = logging.getLogger(__name__)

Status = Literal["valid", "torn", "corrupt"]


@dataclass
class CheckpointInfo:
    """One step directory and what is known about it."""

    step: int
    dirname: str
    url: str
    status: Status
    reason: str = ""
    manifest: Optional[Manifest] = None
    files: dict[str, int] = field(default_factory=dict)
    """Files found in the directory by the listing (name -> size)."""

    @property
    def valid(self) -> bool:
        return self.status == "valid"

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())


def _group_by_step_dir(files: dict[str, int]) -> dict[str, dict[str, int]]:
    groups: dict[str, dict[str, int]] = {}
    for name, size in files.items():
        top, sep, rest = name.partition("/")
        if not sep or parse_step_dir(top) is None:
            continue
        groups.setdefault(top, {})[rest] = size
    return groups


def _blob_listing(files: dict[str, int]) -> dict[str, int]:
    return {name: size for name, size in files.items() if is_blob(name)}


def inspect_dir(storage: Storage, dirname: str, files: dict[str, int],
                blobs: Optional[dict[str, int]] = None) -> CheckpointInfo:
    """Classify one step directory from its listing, its marker and its manifest (no data reads); `blobs`: the
    listing of the root's blobs (name -> size), to check the ones the manifest references (None: not checked)."""
    step = parse_step_dir(dirname)
    if step is None:
        raise ValueError(f"{dirname!r} is not a checkpoint directory name")
    info = CheckpointInfo(step=step, dirname=dirname, url=storage.url_for(dirname), status="torn", files=files)
    if MARKER_NAME not in files:
        info.reason = "no commit marker (save interrupted or in progress)"
        return info
    info.status = "corrupt"
    if MANIFEST_NAME not in files:
        info.reason = "commit marker without manifest"
        return info
    try:
        marker = CommitMarker.from_bytes(storage.read_bytes(dirname, MARKER_NAME))
        raw = storage.read_bytes(dirname, MANIFEST_NAME)
        manifest = Manifest.from_bytes(raw)
    except FileNotFoundError:
        info.reason = "marker or manifest vanished while reading (deleted concurrently)"
        return info
    except (ValueError, KeyError, TypeError) as e:
        info.reason = f"unreadable marker or manifest ({e})"
        return info
    if marker.manifest_sha256 != sha256_bytes(raw):
        info.reason = "manifest does not match the commit marker's checksum"
        return info
    if marker.step != step or manifest.metadata.step != step:
        info.reason = f"step in marker/manifest ({marker.step}/{manifest.metadata.step}) differs from directory"
        return info
    info.manifest = manifest
    problem = _size_problem("file", manifest.files, files) or (
        _size_problem("blob", manifest.blobs, blobs,
                      " (deleted by hand, or by a retention that did not know of it)") if blobs is not None else None)
    if problem:
        info.reason = problem
        return info
    info.status = "valid"
    return info


def _size_problem(what: str, entries: Any, sizes: dict[str, int], missing_why: str = "") -> Optional[str]:
    """The first of `entries` (name, size) that `sizes` lacks or has at another size, said in one line."""
    for entry in entries:
        found = sizes.get(entry.name)
        if found is None:
            return f"missing {what} {entry.name}{missing_why}"
        if found != entry.size:
            return f"{what} {entry.name} has {found} bytes, manifest says {entry.size} (truncated?)"
    return None


def list_checkpoints(storage: Storage, files: Optional[dict[str, int]] = None) -> list[CheckpointInfo]:
    """Every step directory below the root, newest first, each classified (valid / torn / corrupt)."""
    if files is None:
        files = storage.list_files()
    groups = _group_by_step_dir(files)
    blobs = _blob_listing(files)
    out = [inspect_dir(storage, d, groups[d], blobs) for d in groups]
    return sorted(out, key=lambda c: c.step, reverse=True)


def verify_files(storage: Storage, info: CheckpointInfo, names: Optional[Iterable[str]] = None) -> list[str]:
    """Read files of a checkpoint back and compare size + sha256 with the manifest, the blobs it references too
    (by the sha256 of their decoded bytes; `names` may list blob names, `blobs/...`); returns the problems."""
    if info.manifest is None:
        return [f"{info.dirname}: no manifest"]
    wanted = set(names) if names is not None else None
    problems = []
    for blob in info.manifest.blobs:
        if wanted is None or blob.name in wanted:
            problem = verify_blob(storage, blob)
            if problem:
                problems.append(problem)
    for entry in info.manifest.files:
        if wanted is not None and entry.name not in wanted:
            continue
        try:
            with storage.fs.open(storage.path(info.dirname, entry.name), "rb") as f:
                size, digest = sha256_stream(f)
        except FileNotFoundError:
            problems.append(f"{entry.name}: missing")
            continue
        if size != entry.size:
            problems.append(f"{entry.name}: {size} bytes, manifest says {entry.size}")
        elif digest != entry.sha256:
            problems.append(f"{entry.name}: sha256 mismatch (corrupt)")
    return problems


def find_latest_valid(storage: Storage, verify: bool = False,
                      checkpoints: Optional[list[CheckpointInfo]] = None) -> Optional[CheckpointInfo]:
    """The newest valid checkpoint; torn or corrupt newer ones are skipped with a warning."""
    if checkpoints is None:
        files = storage.list_files()
        groups = _group_by_step_dir(files)
        blobs = _blob_listing(files)
        # Inspect lazily, newest first: a healthy root costs one listing plus two small reads.
        candidates = (inspect_dir(storage, d, groups[d], blobs)
                      for d in sorted(groups, key=lambda n: parse_step_dir(n) or -1, reverse=True))
    else:
        candidates = iter(checkpoints)
    for info in candidates:
        if info.valid and verify:
            problems = verify_files(storage, info)
            if problems:
                info.status = "corrupt"
                info.reason = "; ".join(problems)
        if info.valid:
            return info
        log.warning("skipping checkpoint %s: %s", info.url, info.reason)
    return None


def open_checkpoint(storage: Storage, verify: bool = False) -> CheckpointInfo:
    """Inspect the checkpoint whose directory is the storage root itself (a `resume` URL)."""
    from elastictrain.errors import CheckpointError

    files = storage.list_files()
    parent, _, dirname = storage.root.rstrip("/").rpartition("/")
    if parse_step_dir(dirname) is None:
        raise CheckpointError(f"{storage.url} is not a checkpoint directory (expected .../{step_dir_name(0)}); "
                              f"point checkpoint.resume at one, or use 'auto'")
    # Re-root one level up so that names and URLs come out as for discovered checkpoints.
    up = Storage(url=storage.url.rstrip("/").rsplit("/", 1)[0], fs=storage.fs, root=parent,
                 protocol=storage.protocol, options=storage.options)
    info = inspect_dir(up, dirname, files)
    if info.valid and verify:
        problems = verify_files(up, info)
        if problems:
            info.status, info.reason = "corrupt", "; ".join(problems)
    return info
