"""Error hierarchy: every message names what was wrong and what to do about it."""


class ElastictrainError(Exception):
    """Base class of every error this package raises on purpose."""

    restartable = False
    """Whether restarting the worker can fix it; a worker ends with EXIT_FATAL on one that cannot."""


class ConfigError(ElastictrainError):
    """The job configuration is invalid (a field, a type, or a combination)."""


class DataError(ElastictrainError):
    """The training data cannot be read or does not fit the configuration."""


class CheckpointError(ElastictrainError):
    """A checkpoint cannot be written, found, verified or loaded."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not match the configured model or job."""


class StorageError(CheckpointError):
    """Checkpoint storage (a path or an object store) is unreachable or misconfigured."""


class StorageUnreachableError(StorageError):
    """The storage endpoint does not answer: an outage that may pass, not a misconfiguration."""

    restartable = True


class SnapshotError(CheckpointError):
    """An in-memory snapshot could not be restored on some rank and no durable checkpoint is there to fall back to;
    the bad snapshot is dropped, so the restart that follows starts over cleanly."""

    restartable = True


class SnapshotReplicaError(CheckpointError):
    """A snapshot could not be copied to or from a peer node's agent: unreachable, refused, or its bytes did not
    match their checksum. Replication and restore treat it as "no replica" (local-only, or the durable tier)."""


class StorageFullError(StorageError):
    """Checkpoint storage has no space left: a condition that may pass, not a misconfiguration."""

    restartable = True


class RendezvousError(ElastictrainError):
    """The rendezvous store (etcd) is unreachable, misconfigured, or refused us."""


class AgentError(ElastictrainError):
    """The elastic agent gave up (restart budget spent, crash loop, irrecoverable fault)."""
