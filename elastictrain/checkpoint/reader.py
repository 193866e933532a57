"""DCP's fsspec reader for checkpoints with or without blobs (checkpoint/blobs.py): items of a delta checkpoint
are stored at `../blobs/<name>` relative to its directory, a path an object store would take literally."""

from __future__ import annotations

import os
import posixpath
from typing import Any

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader


class _NormalizingFileSystem(_FsspecFileSystem):
    """DCP's fsspec FileSystem that resolves `..` in joined paths (an object store takes `a/../b` literally)."""

    def concat_path(self, path: Any, suffix: str) -> Any:
        joined = super().concat_path(path, suffix)
        if ".." not in suffix:
            return joined
        s = os.fspath(joined)
        proto, sep, rest = s.partition("://")
        if not sep:
            return posixpath.normpath(s)
        return f"{proto}://{posixpath.normpath(rest)}"


class BlobReader(FsspecReader):
    """DCP's fsspec reader for checkpoints with or without blobs (items stored at `../blobs/<name>`)."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _NormalizingFileSystem()
        self.path = self.fs.init_path(path, **kwargs)
