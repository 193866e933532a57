"""Atomic commit of a DCP checkpoint, inside DCP's own save protocol.

`CommittingWriter` is DCP's fsspec writer with two additions:

1. every file is checksummed while it is written (one pass, no read-back); each rank hands its
   (name, size, sha256) list to the coordinator inside its DCP write results;
2. `finish()`, which DCP calls on the coordinator only after *every* rank reported a successful write,
   first lets DCP write `.metadata`, then writes `manifest.json`, then the `COMMITTED` marker, last.

An error anywhere (one rank's write, .metadata, manifest, marker) becomes DCP's CheckpointException on
every rank, so a save future that completes without error means the checkpoint is committed, on every
rank, with no extra barrier. Nothing is renamed on object stores (DCP's own .metadata rename is a
copy there; the marker is what makes the checkpoint visible, not the rename).

`PHASE_HOOK` lets fault tests stop a save in a chosen phase: `before_data`, `after_data`,
`after_dcp_metadata`, `after_manifest`, `after_marker` (called with the phase, the rank and the step).
"""

from __future__ import annotations

import io
import logging
import os
import posixpath
from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.filesystem import _item_size, _StorageInfo, _write_item
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from elastictrain.checkpoint import blobs as blob_store
from elastictrain.checkpoint.manifest import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    MARKER_NAME,
    CheckpointMetadata,
    CommitMarker,
    FileEntry,
    HashingWriter,
    Manifest,
    sha256_bytes,
)
from elastictrain.checkpoint.storage import Storage

log = logging.getLogger(__name__)

PHASE_HOOK: Optional[Callable[[str, int, int], None]] = None
"""Fault injection for tests: called at each phase of a save with (phase, rank, step)."""

_FILES_FQN = "__elastictrain_files__"
_BLOBS_FQN = "__elastictrain_blobs__"
BLOB_FORMAT = 2
"""Manifest format of a checkpoint that references blobs (an elastictrain that reads only format 1 refuses it)."""


def _phase(name: str, rank: int, step: int) -> None:
    hook = PHASE_HOOK
    if hook is not None:
        hook(name, rank, step)


class _HashingFileSystem(_FsspecFileSystem):
    """DCP's fsspec FileSystem whose write streams record (name, size, sha256) of each file on close."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[FileEntry] = []

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            # list.append is atomic under the GIL: DCP may write several files from several threads.
            stream = HashingWriter(raw, posixpath.basename(os.fspath(path)), self.written.append)
            try:
                yield stream
            finally:
                stream.close()


def _cpu_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What DCP's loader writes: the tensor on the CPU, cloned when a view (torch.save writes the whole storage)."""
    t = tensor.detach().cpu()
    if t.untyped_storage().size() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _serialize(tensor: torch.Tensor) -> bytes:
    """DCP's serialization of one tensor item (torch.save: deterministic for equal bytes, dtype and shape)."""
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def write_commit(storage: Storage, dirname: str, manifest: Manifest, rank: int = 0) -> CommitMarker:
    """Write manifest.json, then the commit marker naming its sha256 (the marker is always last)."""
    data = manifest.to_bytes()
    storage.write_bytes(data, dirname, MANIFEST_NAME)
    _phase("after_manifest", rank, manifest.metadata.step)
    marker = CommitMarker(step=manifest.metadata.step, manifest_sha256=sha256_bytes(data))
    storage.write_bytes(marker.to_bytes(), dirname, MARKER_NAME)
    _phase("after_marker", rank, manifest.metadata.step)
    return marker


class CommittingWriter(FsspecWriter):
    """DCP storage writer for one checkpoint directory that checksums its files and commits on finish."""

    def __init__(self, storage: Storage, dirname: str, metadata: CheckpointMetadata, *,
                 thread_count: int = 1, dedup: bool = False, compression: Optional[str] = None,
                 dedup_min_bytes: int = blob_store.DEDUP_MIN_BYTES) -> None:
        # sync_files=False: DCP's own fsync falls back to a machine-wide os.sync() on object stores;
        # HashingWriter fsyncs local files itself and an object-store close is the durable upload.
        extensions = None
        if compression == "zstd":
            from torch.distributed.checkpoint._extension import ZStandard

            extensions = [ZStandard()]
        elif compression not in (None, "none"):
            raise ValueError(f"unknown checkpoint.compression {compression!r} (none or zstd)")
        super().__init__(storage.url_for(dirname), single_file_per_rank=True, sync_files=False,
                         thread_count=thread_count, overwrite=True, _extensions=extensions, **storage.options)
        self.dedup = dedup
        self.dedup_min_bytes = dedup_min_bytes
        self.compressed = extensions is not None
        self.fs = _HashingFileSystem()
        self.path = self.fs.init_path(storage.url_for(dirname), **storage.options)
        self.storage = storage
        self.dirname = dirname
        self.metadata = metadata
        self.committed: Optional[CommitMarker] = None

    def _rank(self) -> int:
        return self.rank if self.rank is not None else 0

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Re-saving into a directory that once held a committed checkpoint: un-commit it before any
        # rank writes, so that a crash half-way cannot leave an old marker over new data.
        for name in (MARKER_NAME, MANIFEST_NAME):
            p = self.storage.path(self.dirname, name)
            if self.storage.fs.exists(p):
                self.storage.fs.rm(p)
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        _phase("before_data", self._rank(), self.metadata.step)
        self.fs.written = []
        if self.dedup:
            results, used = self._write_dedup(plan, planner)
            results.append(WriteResult(index=MetadataIndex(_BLOBS_FQN), size_in_bytes=0, storage_data=used))
        else:
            results = super().write_data(plan, planner).value()
        entries = [e for e in self.fs.written if not e.name.endswith(".tmp")]
        results.append(WriteResult(index=MetadataIndex(_FILES_FQN), size_in_bytes=0, storage_data=entries))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_dedup(self, plan: SavePlan, planner: SavePlanner) -> tuple[list[WriteResult], list[FileEntry]]:
        """This rank's items: the small ones (< dedup_min_bytes) into its `__N_0.distcp`, each large tensor as a
        content-addressed blob, written only when no blob of the same bytes exists yet (`blobs` module docstring)."""
        file_name = f"{plan.storage_data.prefix}0.distcp"
        small = [i for i in plan.items if i.type == WriteItemType.BYTE_IO or _item_size(i) < self.dedup_min_bytes]
        large = [i for i in plan.items if i not in small]
        results: list[WriteResult] = []
        with self.fs.create_stream(self.fs.concat_path(self.path, file_name), "wb") as stream:
            for item in small:
                data = planner.resolve_data(item)
                if isinstance(data, torch.Tensor):
                    data = _cpu_tensor(data)
                results.append(_write_item(self.transforms, stream, data, item, file_name, self.serialization_format))
        used: dict[str, FileEntry] = {}
        for item in large:
            raw = _serialize(_cpu_tensor(planner.resolve_data(item)))
            digest = sha256_bytes(raw)
            name = blob_store.blob_name(digest, self.compressed)
            size = blob_store.stored_size(self.storage, name)
            if size is None:
                data = blob_store.compress(raw) if self.compressed else raw
                blob_store.write_blob(self.storage, name, data)
                size = len(data)
            used[name] = FileEntry(name, size, digest)
            descriptors = [e.get_descriptor() for e in reversed(self.transforms.extensions)] or None
            results.append(WriteResult(index=item.index, size_in_bytes=size,
                                       storage_data=_StorageInfo("../" + name, 0, size, descriptors)))
        return results, list(used.values())

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        rank = self._rank()
        entries: list[FileEntry] = []
        blob_entries: dict[str, FileEntry] = {}
        dcp_results: list[list[WriteResult]] = []
        for per_rank in results:
            keep = []
            for wr in per_rank:
                if isinstance(wr.index, MetadataIndex) and wr.index.fqn == _FILES_FQN:
                    entries.extend(wr.storage_data)
                elif isinstance(wr.index, MetadataIndex) and wr.index.fqn == _BLOBS_FQN:
                    blob_entries.update((b.name, b) for b in wr.storage_data)
                else:
                    keep.append(wr)
            dcp_results.append(keep)
        _phase("after_data", rank, self.metadata.step)
        super().finish(metadata, dcp_results)
        _phase("after_dcp_metadata", rank, self.metadata.step)
        # .metadata went through a .tmp + rename; it is small, so hash what is actually there.
        md = self.storage.read_bytes(self.dirname, DCP_METADATA_NAME)
        entries.append(FileEntry(DCP_METADATA_NAME, len(md), sha256_bytes(md)))
        entries.sort(key=lambda e: e.name)
        blob_list = sorted(blob_entries.values(), key=lambda e: e.name)
        manifest = Manifest(metadata=self.metadata, files=entries, blobs=blob_list,
                            format=BLOB_FORMAT if self.dedup else 1)
        self.committed = write_commit(self.storage, self.dirname, manifest, rank)
        blob_note = (f"; {len(blob_list)} blobs referenced, {sum(b.size for b in blob_list) / 1e6:.1f} MB"
                     if self.dedup else "")
        log.info("committed checkpoint %s (%d files, %.1f MB%s)", self.storage.url_for(self.dirname),
                 len(entries), sum(e.size for e in entries) / 1e6, blob_note)
