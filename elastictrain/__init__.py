"""elastictrain: elastic, fault-tolerant multi-node PyTorch training.

The public API for your own training script (docs/api.md):

    import elastictrain as et

    with et.Worker(seed=0) as w:                       # process group, device mesh, heartbeats, SIGTERM
        model = fully_shard(build_model(), mesh=w.mesh)
        optim = torch.optim.AdamW(model.parameters())
        sampler = et.ElasticSampler(len(dataset), global_batch_size=64, micro_batch_size=8)
        state = et.TrainState(model=model, optim=optim, data=sampler)
        for step in w.steps(1000, state, checkpoint="s3://bucket/run", every_steps=100):
            for mb in sampler.micro_batches():
                ...

Names are loaded on first use, so `import elastictrain` stays cheap for the command line (no torch import).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Worker": "elastictrain.runtime.worker",
    "TrainState": "elastictrain.runtime.train_state",
    "ElasticSampler": "elastictrain.runtime.sampler",
    "MicroBatch": "elastictrain.runtime.sampler",
    "CheckpointConfig": "elastictrain.config",
    "ElastictrainError": "elastictrain.errors",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from elastictrain.config import CheckpointConfig as CheckpointConfig
    from elastictrain.errors import ElastictrainError as ElastictrainError
    from elastictrain.runtime.sampler import ElasticSampler as ElasticSampler
    from elastictrain.runtime.sampler import MicroBatch as MicroBatch
    from elastictrain.runtime.train_state import TrainState as TrainState
    from elastictrain.runtime.worker import Worker as Worker


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'elastictrain' has no attribute {name!r}; the public API is: {', '.join(__all__)}")


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
