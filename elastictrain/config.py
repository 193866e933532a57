"""Typed job configuration: dataclasses loaded from YAML, overridden with `--set a.b=c`, validated up front.

Every default lives here, in one place. `load_config` returns a validated `JobConfig` or raises a
`ConfigError` whose one-line message names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from elastictrain.errors import ConfigError

DEFAULT_MODEL_OVERRIDES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}


@dataclass
class LoraSettings:
    """A LoRA adapter (peft's LoraConfig) on the model's `target_modules`; everything else is frozen."""

    r: int = 8
    """The adapter's rank."""
    alpha: float = 16.0
    """Scale: the adapter's output is multiplied by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter's input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Module names (a name's last part, as peft matches them) that get an adapter: q_proj, k_proj, v_proj,
    o_proj, gate_proj, up_proj, down_proj for llama/qwen2; c_attn for gpt2."""


@dataclass
class ModelConfig:
    """Which causal LM to build: a transformers model type plus overrides, or a local config directory."""

    name: str = "llama"
    """A transformers `model_type` (e.g. llama, gpt2, qwen2, mistral) built from its default config."""
    path: Optional[str] = None
    """A local directory holding a transformers `config.json`; takes precedence over `name`."""
    overrides: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_MODEL_OVERRIDES))
    """Config attributes set on top of the base config (sizes, vocab, dropout...). The tiny defaults apply to
    `name: llama` only, never to a `path`."""
    attn_implementation: str = "sdpa"
    init: Optional[Literal["random", "pretrained"]] = None
    """How a fresh start fills the weights (a resume loads its checkpoint instead): `pretrained` reads the
    safetensors weights in `path`, each rank only its own shards (docs/finetuning.md); `random` initialises from
    the seed. None: `pretrained` when `path` holds *.safetensors files, else `random`."""
    lora: Optional[LoraSettings] = None
    """Train a LoRA adapter instead of the weights (None: off). Checkpoints then hold only the adapter and its
    optimizer state; the base comes from `init` on every start (docs/finetuning.md)."""
    freeze: list[str] = field(default_factory=list)
    """Glob patterns (fnmatch) of parameter names whose parameters are not trained, e.g. `model.embed_tokens.*`,
    `model.layers.[0-5].*`; each must match a parameter. Checkpoints then hold only the trained ones."""


DATASET_SOURCES = ("jsonl", "parquet", "hf_disk")
"""Sources of rows (text or chat) that a tokenizer turns into samples (docs/finetuning.md)."""


@dataclass
class DataConfig:
    source: Literal["synthetic", "text", "tokens", "jsonl", "parquet", "hf_disk"] = "synthetic"
    """synthetic: a deterministic learnable token stream; text: a UTF-8 file read as bytes (vocab 256);
    tokens: a flat binary file of token ids (`token_dtype`); jsonl / parquet / hf_disk: rows of a local JSON-lines
    file, a Parquet file (or directory), or a `datasets` directory written by `save_to_disk`, tokenized with
    `tokenizer` in the `format` below (docs/finetuning.md)."""
    path: Optional[str] = None
    """File for `text` / `tokens` sources (`sample` means the corpus shipped with the package); the file or
    directory of a jsonl / parquet / hf_disk source."""
    tokenizer: Optional[str] = None
    """A local directory with tokenizer.json / tokenizer_config.json for the dataset sources; None: model.path."""
    format: Literal["text", "chat"] = "chat"
    """Dataset rows are `text` (loss on every token) or `chat` (`messages_field`, or `prompt_field` +
    `response_field`; loss on the assistant's tokens only)."""
    text_field: str = "text"
    messages_field: str = "messages"
    """A list of {"role": ..., "content": ...}; used when the rows have it, else prompt_field/response_field."""
    prompt_field: str = "prompt"
    response_field: str = "response"
    split: str = "train"
    """The split of an hf_disk directory that holds several (a DatasetDict)."""
    packing: bool = True
    """Dataset sources: pack several samples into each seq_len sequence (position ids restart per sample, no
    attention across samples); false: one sample per sequence, padded."""
    token_dtype: Literal["uint8", "uint16", "uint32"] = "uint16"
    seq_len: int = 64
    global_batch_size: int = 16
    """Samples consumed by one optimizer step, whatever the world size."""
    micro_batch_size: int = 4
    """Samples in one forward/backward; a step is global_batch_size / micro_batch_size micro-batches."""
    synthetic_samples: int = 1_000_000
    """Length of one epoch of the synthetic source."""

    def fingerprint_part(self) -> dict[str, Any]:
        """The fields a checkpoint must agree with; the dataset sources' fields only for those sources, so that
        checkpoints of the other sources written before those fields existed still resume."""
        part = dataclasses.asdict(self)
        if self.source not in DATASET_SOURCES:
            for name in DATASET_FIELDS:
                del part[name]
        return part


DATASET_FIELDS = ("tokenizer", "format", "text_field", "messages_field", "prompt_field", "response_field", "split",
                  "packing")
"""DataConfig fields that only the dataset sources read."""


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 10
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""


@dataclass
class TrainConfig:
    steps: int = 100
    seed: int = 1234
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto: bf16 parameters with fp32 reduction on CUDA, fp32 on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every: int = 10
    progress: bool = True
    """A progress bar on rank 0 (only when stderr is a terminal)."""
    deterministic: Union[bool, Literal["strict"]] = True
    """Fixed seeds everywhere and torch.use_deterministic_algorithms: true: warn-only (on CUDA the attention
    backward stays non-deterministic, so runs are not bitwise there); "strict": deterministic kernels or torch's
    error naming the op without one (bitwise on CUDA too); false: neither."""
    collective_timeout_s: float = 600.0
    """Process-group timeout; the agent's hang detection usually fires long before."""
    output_dir: str = "runs/default"
    """Where the run writes its summary (JSON) and, with audit_samples, its sample ledger."""
    stop_at: int = 0
    """Leave (saving a checkpoint) once this global step is done, e.g. before maintenance; the LR schedule
    still spans train.steps. 0: run to train.steps."""
    param_digest: bool = True
    """sha256 of the final full parameters and of the full optimizer state in the summary (`param_digest`,
    `optim_digest`; full gathers: off for big models)."""
    audit_samples: bool = False
    """Append every step's consumed sample ids per rank to <output_dir>/samples/ (exactly-once audits)."""


DEFAULT_STORAGE_WAIT_S = 300.0
"""The longest start-up wait for unreachable checkpoint storage when `checkpoint.storage_wait_s` is left open."""
DEFAULT_SNAPSHOT_FS_FRACTION = 0.5
"""`checkpoint.snapshot_memory` when left open: this fraction of the RAM file system that holds the snapshots."""


@dataclass
class CheckpointConfig:
    url: Optional[str] = None
    """Where checkpoints go: a path, file:///path, s3://bucket/prefix, or any fsspec URL. None disables them."""
    every_steps: int = 0
    """Save every N steps (0: off)."""
    every_seconds: float = 0.0
    """Save when this much wall time passed since the last save (0: off)."""
    snapshot_every_steps: Union[int, Literal["auto"]] = 0
    """In-memory snapshot of every rank's state every N steps, in node RAM (/dev/shm) that outlives the worker: a
    worker restarted by our agent resumes from it without a storage read (0: off; `auto`: every step if that costs
    training at most 5%, else the smallest interval that does, measured over the first steps; docs/checkpoints.md)."""
    snapshot_memory: Union[int, float, str, None] = None
    """The most RAM the snapshots may take on one node: bytes (an integer, or a size such as 8GiB or 500MB) or,
    as a number in (0, 1], a fraction of the node's RAM (or of its container's memory limit, when lower). None:
    DEFAULT_SNAPSHOT_FS_FRACTION (half) of the RAM file system that holds them (/dev/shm), leaving the rest to
    what else uses it (NCCL's shared-memory transport, DataLoader workers). Checked before the first snapshot:
    two slots per local rank, plus a peer's replica when replicated, must fit in it and in the file system's free
    space (checkpoint/snapshot_budget.py)."""
    keep_last: int = 3
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0: off)."""
    dedup: bool = False
    """Delta checkpoints: each tensor of 256 KiB or more is stored once as a content-addressed blob (`<url>/blobs/`)
    that later checkpoints reference while its bytes are unchanged (frozen parameters saved in full state); off by
    default: when every tensor changes each step (full fine-tuning, pre-training) it saves nothing and costs a hash
    of the whole state per save plus a file per tensor. docs/checkpoints.md "Delta checkpoints"."""
    dedup_min_bytes: int = 256 << 10
    """With dedup: tensors (a rank's shard of one) smaller than this stay in the rank's file instead of a blob of
    their own (a file, an object-store PUT and HEAD each, for a few KB: LoRA matrices, norms, biases)."""
    compression: Literal["none", "zstd"] = "none"
    """zstd: compress every item of the checkpoint (torch's own DCP ZStandard transform; needs `zstandard`, the
    `zstd` extra). Trained fp32 weights and Adam moments compress little (8-10% measured); see docs/checkpoints.md."""
    async_save: bool = True
    async_mode: Literal["thread", "process"] = "thread"
    save_on_exit: bool = True
    """Save at the end of training and on SIGTERM (after finishing the current step)."""
    max_consecutive_failures: int = 0
    """Stop the job cleanly after this many failed saves in a row (0: never, keep training)."""
    resume: str = "auto"
    """auto: newest valid checkpoint under `url` if any; never: start fresh; or a checkpoint URL."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to fsspec (for s3: endpoint_url, key, secret, client_kwargs={region_name: ...})."""
    storage_wait_s: Optional[float] = None
    """At start-up (a first start, or a restart during an object-store outage), how long to wait for an
    unreachable storage endpoint to come back before failing. None: half of train.collective_timeout_s, at
    most DEFAULT_STORAGE_WAIT_S. Must stay below train.collective_timeout_s (the other ranks wait in a
    collective)."""


@dataclass
class ReplicaTLSConfig:
    """Mutual TLS for the peer replicas of in-memory snapshots (docs/checkpoints.md, "Over TLS"): PEM
    files on this node, all three or none. None: plain HTTP with a per-node token (a trusted network)."""

    cert: Optional[str] = None
    """This node's certificate, issued by `ca` (its address as a subjectAltName when `check_hostname`)."""
    key: Optional[str] = None
    """The certificate's private key."""
    ca: Optional[str] = None
    """The CA every node's certificate comes from: the only one a server or client trusts."""
    check_hostname: bool = True
    """Whether a server's certificate must name the address it published; false for one job-wide certificate."""


@dataclass
class HangConfig:
    """Hang detection (the agent's rule, docs/agent.md "Hang rule"); flags `--heartbeat-*` override each field."""

    floor_s: float = 5.0
    """Floor of the train-phase timeout max(floor_s, step_time_multiplier x p99 step time, 1.5 x the longest step);
    0 turns hang detection off."""
    step_time_multiplier: float = 5.0
    startup_timeout_s: float = 300.0
    """Time a worker may take to send its first heartbeat (see `expect_heartbeats`)."""
    expect_heartbeats: Optional[bool] = None
    """Whether the workers send heartbeats from their start (our worker API does). None: true for the recipe,
    false for a user's script, whose workers are held to `startup_timeout_s` only once one of this agent's
    workers has sent a beat (a script that never beats is never judged hung; exits are still seen at once)."""
    warmup_timeout_s: float = 600.0
    """Train-phase timeout until the step time is calibrated."""
    init_timeout_s: float = 600.0
    """Allowance for the init and paused phases."""
    load_timeout_s: float = 900.0
    save_timeout_s: float = 900.0
    done_timeout_s: float = 600.0
    """Allowance for the done phase: final save, summary, teardown."""


@dataclass
class ElasticConfig:
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 2
    max_restarts: int = 3
    """Restart budget for the whole job (not per agent)."""
    crash_loop_restarts: int = 3
    """End the job when this many restarts in a row failed at the same step (0: off)."""
    max_no_progress_restarts: int = 5
    """End the job when this many restarts in a row committed no checkpoint newer than the one they resumed from
    (0: off)."""
    restart_backoff_s: float = 1.0
    """Wait before the 2nd restart in a row without progress, doubling for each further one (the 1st is
    immediate; 0: no backoff)."""
    restart_backoff_max_s: float = 60.0
    restart_backoff_jitter: float = 0.25
    """Each wait varies by up to this fraction either way (the same on every node of a job)."""
    rdzv_endpoint: Optional[str] = None
    """host:port[,host:port...] of etcd; None starts an embedded local etcd."""
    run_id: str = "elastictrain"
    lease_ttl_s: float = 5.0
    presence_link: bool = True
    """Each agent holds an idle TCP connection to a few peer agents on the rendezvous address (--local-addr, else the
    host name); when one ends and the peer's port refuses a new one, its agent died (SIGKILL, OOM, crash) and its
    etcd lease is revoked at once: a dead node is lost within milliseconds instead of `lease_ttl_s`. A host that loses
    power or its network is still noticed by its lease. False: the lease alone (rdzv-conf `presence`)."""
    heartbeat_timeout_s: Optional[float] = None
    """Deprecated name of `hang.floor_s` (read into it with a warning)."""
    hang: HangConfig = field(default_factory=HangConfig)
    join_grace_s: float = 10.0
    """How long a forming round waits for more nodes once `min_nodes` joined (torch's last call): at the first
    formation for any node; when re-forming, only for nodes alive in etcd that have not joined yet."""
    rejoin_wait_s: float = 0.0
    """When re-forming and every live node has joined, how long to still wait for a lost node to come back
    (at most `join_grace_s`). 0: re-form at once; a node that comes back later joins through a scale-up
    restart (about a second with warm spares). With `in_place`, also how long a lost node's place in the running
    round is held for a node started again to take over in place, the survivors paused meanwhile."""
    rdzv_timeout_s: float = 120.0
    warm_spares: bool = True
    """Keep one pre-warmed spare worker per local rank (about 350 MB of host memory each) so that a restart
    does not wait for Python, torch and the model code to import."""
    prewarm: list[str] = field(default_factory=list)
    """Modules a spare imports before it waits (`--prewarm a,b`); a user's script's spares also import torch."""
    replica_bandwidth: Union[int, str, None] = None
    """The most bytes per second the peer replicas of in-memory snapshots may send from this node (an integer, or a
    size such as 200MB): on a CPU node they take cores from training; None: as fast as they go."""
    replica_tls: ReplicaTLSConfig = field(default_factory=ReplicaTLSConfig)
    """TLS between the agents' replica servers and their clients (cert, key, ca; unset: plain HTTP)."""
    worker_malloc: Literal["tuned", "default"] = "tuned"
    """The workers' host memory allocator (glibc malloc; runtime/allocator.py): `tuned` keeps freed memory in the
    worker for reuse (CPU training steps 5-8 % faster at 50M-150M parameters on 2 ranks here, resident memory at its
    peak instead of falling between steps); `default` leaves glibc as it is. A worker whose environment sets glibc's
    malloc variables itself is left as it is."""
    worker_huge_pages: bool = False
    """Back the workers' host tensors of 2 MiB or more with transparent huge pages (torch's `THP_MEM_ALLOC_ENABLE`,
    runtime/allocator.py). Measured on CPU training here (docs/benchmarks.md "Huge pages"): steps 9-15 % faster at
    50M-150M parameters, resident memory 25-35 % higher, and the allocation of a smaller world's bigger shards in
    place 3-6x slower when both ranks of a node did it at once (fresh huge pages, the kernel compacting memory for
    them). Takes effect where the kernel's policy is `always` or `madvise`; a worker whose environment sets
    `THP_MEM_ALLOC_ENABLE` itself is left as it is."""
    straggler_margin: float = 0.2
    """A rank later than this fraction of the median step time (and 20 ms) is slow (docs/agent.md, Stragglers)."""
    straggler_steps: int = 20
    """Slow steps in a row before a rank is named a straggler (and steps below half the margin before it is cleared)."""
    replace_stragglers: bool = False
    """Act on a straggler still slow `straggler_replace_after_steps` steps after it was named: restart the group's
    workers at a step boundary (state saved), or drain its node when that host straggled again (docs/agent.md)."""
    straggler_replace_after_steps: int = 20
    """Steps in a row a named straggler must stay slow before it is replaced."""
    straggler_drain_window_s: float = 3600.0
    """A host whose rank was restarted as a straggler within this long is drained the next time (0: never drain)."""
    in_place: bool = False
    """Pause in place: when a worker dies, only it is replaced; the other workers keep their processes and state, wait
    at the step boundary, rebuild the process group and continue from the newest in-memory snapshot. Needs a step loop
    inside `Worker.guard()` (the recipe has one) and `checkpoint.snapshot_every_steps` (docs/agent.md). Anything that
    fails on that path falls back to restarting every worker."""
    in_place_timeout_s: float = 60.0
    """The longest the surviving workers wait for a replacement before they fall back to a restart of every worker."""
    in_place_shrink: bool = True
    """With `in_place`: a node lost for good (no place held, or nobody took it within `rejoin_wait_s`) is dropped from
    the running round, and the survivors re-form a smaller world inside their processes (the model rebuilt on the new
    mesh by the step loop's `rebuild`, the state re-sharded from the snapshots and the lost node's replica), while at
    least `min_nodes` nodes are left. False (or a script without `rebuild`): every worker restarts in a new round."""


@dataclass
class LoggingConfig:
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    json: bool = False


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> dict[str, str]:
        """Hashes of the parts that a checkpoint must agree with (model and data layout), per section."""
        # model.init only says how a fresh start fills the weights: a resume never reads it (nor the weights).
        # The adapter and the frozen patterns are parts of their own, readable, so that a refused resume names them.
        parts: dict[str, Any] = {
            "model": {k: v for k, v in self.to_dict()["model"].items() if k not in ("init", "lora", "freeze")},
            "data": self.data.fingerprint_part(),
            "seed": self.train.seed,
        }
        m = self.model
        if m.lora is not None:
            parts["adapter"] = (f"lora r={m.lora.r} alpha={m.lora.alpha:g} dropout={m.lora.dropout:g} "
                                f"targets={','.join(m.lora.target_modules)}")
        if m.freeze:
            parts["freeze"] = ",".join(m.freeze)
        return fingerprint_parts(parts)


def fingerprint_parts(parts: dict[str, Any]) -> dict[str, str]:
    """A checkpoint fingerprint from plain data: strings as given, any other value as a short hash of its JSON."""
    return {str(k): v if isinstance(v, str) else
            hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:16]
            for k, v in parts.items()}


# ---------------------------------------------------------------------------------------------------------
# building dataclasses from plain data, with type checking


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, choices))}; "
                              f"set {where} to one of them")
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:  # Optional[X]: X's own error names the field (an unknown key of a section, say)
            raise errors[0]
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of fields of {tp.__name__}, got {value!r}")
        return _build(tp, value, where)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {type(value).__name__} {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
    raise ConfigError(f"{where}: unsupported type {tp!r}")  # a bug in this module, not in the user's file


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            close = [n for n in names if n.startswith(str(key)[:3])]
            hint = f" (did you mean {', '.join(sorted(close))}?)" if close else ""
            raise ConfigError(f"{where + '.' if where else ''}{key}: unknown field{hint}; "
                              f"known fields: {', '.join(sorted(names))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _coerce(data[f.name], hints[f.name], f"{where + '.' if where else ''}{f.name}")
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------------------
# loading, overrides, validation


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one `section.field=value` (value parsed as YAML) to raw config data, in place."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected section.field=value, e.g. --set train.steps=200")
    path, _, raw = assignment.partition("=")
    keys = [k for k in path.strip().split(".") if k]
    if not keys:
        raise ConfigError(f"--set {assignment!r}: empty field name; expected section.field=value")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {assignment!r}: {k} is not a section")
    node[keys[-1]] = _parse_scalar(raw)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass --config with a YAML file "
                          f"(see configs/tiny-cpu.yaml)")
    try:
        loaded = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {str(p)!r} is not valid YAML{at}: {getattr(e, 'problem', e)}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(p)!r}: expected a mapping of sections (model, data, train...)")
    return loaded


def load_config(path: Optional[str | Path] = None, overrides: tuple[str, ...] | list[str] = ()) -> JobConfig:
    """Read a YAML job file (or the defaults), apply `--set` overrides, and validate."""
    data: dict[str, Any] = _read_yaml(path) if path is not None else {}
    for o in overrides:
        apply_override(data, o)
    cfg = _build(JobConfig, data, "")
    if "model" in data and "overrides" in (data.get("model") or {}):
        merged = dict(DEFAULT_MODEL_OVERRIDES) if cfg.model.path is None and cfg.model.name == "llama" else {}
        merged.update(data["model"]["overrides"] or {})
        cfg.model.overrides = merged
    elif cfg.model.path is not None:
        cfg.model.overrides = {}
    validate(cfg)
    return cfg


def load_elastic(path: Optional[str | Path] = None, overrides: tuple[str, ...] | list[str] = ()) -> ElasticConfig:
    """Only the `elastic` section of a YAML file (or the defaults) with `--set elastic.*` overrides, validated.

    What `elastictrain run script.py` reads: the script owns its training config, so the other sections of the
    file are not read and a `--set` of another section is an error.
    """
    for o in overrides:
        if not o.strip().startswith("elastic."):
            raise ConfigError(f"--set {o!r}: a script owns its own training config; with a script, --set takes "
                              f"only elastic.* fields (pass the script's own options after the script)")
    data = {"elastic": (_read_yaml(path).get("elastic") or {}) if path is not None else {}}
    for o in overrides:
        apply_override(data, o)
    e = _build(ElasticConfig, data["elastic"], "elastic")
    validate_elastic(e)
    return e


def config_from_dict(data: dict[str, Any]) -> JobConfig:
    """Build and validate a JobConfig from plain data (as written by `JobConfig.to_dict`)."""
    cfg = _build(JobConfig, data, "")
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Check values and combinations (and fill in derived defaults); raise ConfigError naming the field and the fix."""
    d, t, o, c, e = cfg.data, cfg.train, cfg.optim, cfg.checkpoint, cfg.elastic
    positive = {
        "train.steps": t.steps, "data.seq_len": d.seq_len, "data.global_batch_size": d.global_batch_size,
        "data.micro_batch_size": d.micro_batch_size, "train.log_every": t.log_every,
        "elastic.nproc_per_node": e.nproc_per_node, "elastic.min_nodes": e.min_nodes,
        "elastic.max_nodes": e.max_nodes, "data.synthetic_samples": d.synthetic_samples,
    }
    for name, v in positive.items():
        if v <= 0:
            raise ConfigError(f"{name} must be > 0 (got {v}); set it with --set {name}=<positive number>")
    if d.global_batch_size % d.micro_batch_size:
        raise ConfigError(
            f"data.global_batch_size={d.global_batch_size} is not divisible into micro-batches of "
            f"data.micro_batch_size={d.micro_batch_size}; make global_batch_size a multiple of micro_batch_size")
    if e.min_nodes > e.max_nodes:
        raise ConfigError(f"elastic.min_nodes={e.min_nodes} > elastic.max_nodes={e.max_nodes}; "
                          f"set min_nodes <= max_nodes")
    if o.lr <= 0:
        raise ConfigError(f"optim.lr must be > 0 (got {o.lr})")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1] (got {o.min_lr_ratio})")
    if o.warmup_steps < 0 or o.grad_clip < 0 or o.weight_decay < 0:
        raise ConfigError("optim.warmup_steps, optim.grad_clip and optim.weight_decay must be >= 0")
    if d.source in ("text", "tokens") and not d.path:
        raise ConfigError(f"data.source={d.source!r} needs data.path (a local file, or 'sample' for the "
                          f"bundled corpus)")
    if d.source == "synthetic" and d.path:
        raise ConfigError("data.path is set but data.source is 'synthetic'; set data.source to 'text' or "
                          "'tokens', or remove data.path")
    validate_dataset(d, cfg.model)
    validate_checkpoint(c, t.collective_timeout_s)
    if t.stop_at < 0:
        raise ConfigError(f"train.stop_at must be >= 0 (got {t.stop_at}); 0 runs to train.steps")
    if t.collective_timeout_s <= 0:
        raise ConfigError(f"train.collective_timeout_s must be > 0 (got {t.collective_timeout_s})")
    validate_elastic(e)
    Timeouts.of(cfg).check()
    validate_model(cfg.model)


def validate_dataset(d: DataConfig, m: ModelConfig) -> None:
    """Check the fields of the jsonl / parquet / hf_disk sources (the files themselves are read by the workers)."""
    if d.source not in DATASET_SOURCES:
        if d.tokenizer is not None:
            raise ConfigError(f"data.tokenizer is set but data.source={d.source!r} reads no text through a "
                              f"tokenizer; set data.source to one of {', '.join(DATASET_SOURCES)}, or remove it")
        return
    if not d.path:
        raise ConfigError(f"data.source={d.source!r} needs data.path (a local "
                          f"{'directory written by save_to_disk' if d.source == 'hf_disk' else 'file'})")
    if d.tokenizer is None and m.path is None:
        raise ConfigError(f"data.source={d.source!r} needs a tokenizer: set data.tokenizer (or model.path) to a "
                          f"local directory holding tokenizer.json / tokenizer_config.json")
    fields = ("text_field",) if d.format == "text" else ("messages_field", "prompt_field", "response_field")
    for name in fields:
        if not getattr(d, name):
            raise ConfigError(f"data.{name} must name a column of the dataset (got an empty string)")


def validate_model(m: ModelConfig) -> None:
    """Check `model.path` and resolve `model.init` (None: pretrained when the path holds safetensors weights).

    An explicit `pretrained` is not checked against the files here: only a fresh start reads them (and says so
    when they are missing), and a resume must go on where the weights have been moved or were never copied.
    """
    if m.path is not None and not Path(m.path).is_dir():
        raise ConfigError(f"model.path={m.path!r} is not a directory; point it at a local directory "
                          f"holding a transformers config.json, or remove it to use model.name")
    if m.init == "pretrained" and m.path is None:
        raise ConfigError("model.init=pretrained needs model.path, a local transformers directory with "
                          "*.safetensors weights; set it, or set model.init=random")
    if m.init is None:
        weights = safetensors_files(m.path) if m.path is not None else []
        if m.path is not None and not weights and torch_weight_files(m.path):
            raise ConfigError(f"model.path={m.path!r} holds PyTorch .bin weights but no *.safetensors; convert "
                              f"them to safetensors, or set model.init=random to train from random weights")
        m.init = "pretrained" if weights else "random"
    validate_lora(m.lora)
    for i, pattern in enumerate(m.freeze):
        if not pattern.strip():
            raise ConfigError(f"model.freeze[{i}] is empty; give a glob of parameter names such as "
                              f"'model.embed_tokens.*', or remove it")


def validate_lora(lora: Optional[LoraSettings]) -> None:
    """Check `model.lora` (None: off)."""
    if lora is None:
        return
    if lora.r < 1:
        raise ConfigError(f"model.lora.r must be >= 1 (got {lora.r}); typical ranks are 8-64, or remove model.lora "
                          f"to train the weights themselves")
    if not lora.alpha > 0:
        raise ConfigError(f"model.lora.alpha must be > 0 (got {lora.alpha}); it scales the adapter by alpha / r "
                          f"(commonly 2 x r)")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"model.lora.dropout must be in [0, 1) (got {lora.dropout})")
    if not lora.target_modules or not all(t.strip() for t in lora.target_modules):
        raise ConfigError(f"model.lora.target_modules must list module names (got {lora.target_modules!r}); "
                          f"e.g. [q_proj, v_proj] for llama or qwen2")


def safetensors_files(path: str | Path) -> list[str]:
    """The *.safetensors weight files directly in `path`, sorted."""
    return sorted(p.name for p in Path(path).glob("*.safetensors") if p.is_file())


def torch_weight_files(path: str | Path) -> list[str]:
    """The PyTorch *.bin files in `path` (not read: only safetensors are)."""
    return sorted(p.name for p in Path(path).glob("*.bin") if p.is_file())


def validate_checkpoint(c: CheckpointConfig, collective_timeout_s: float) -> None:
    """Check the `checkpoint` section (and fill in `storage_wait_s`); raise ConfigError naming the field."""
    snapshots = 0 if c.snapshot_every_steps == "auto" else c.snapshot_every_steps
    for name, v in {"checkpoint.every_steps": c.every_steps, "checkpoint.every_seconds": c.every_seconds,
                    "checkpoint.keep_every": c.keep_every, "checkpoint.snapshot_every_steps": snapshots,
                    "checkpoint.max_consecutive_failures": c.max_consecutive_failures,
                    "checkpoint.dedup_min_bytes": c.dedup_min_bytes}.items():
        if v < 0:
            raise ConfigError(f"{name} must be >= 0 (got {v}); 0 turns it off")
    parse_memory_size(c.snapshot_memory, "checkpoint.snapshot_memory")
    if c.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last must be >= 1 (got {c.keep_last}): the newest valid checkpoint "
                          f"is always kept")
    if c.url is None and (c.every_steps or c.every_seconds or c.snapshot_every_steps):
        raise ConfigError("checkpoint.every_steps/every_seconds/snapshot_every_steps is set but checkpoint.url is "
                          "not; set checkpoint.url (a path or s3://bucket/prefix)")
    if c.storage_wait_s is None:
        c.storage_wait_s = min(DEFAULT_STORAGE_WAIT_S, collective_timeout_s / 2)
    if not 0 <= c.storage_wait_s < collective_timeout_s:
        raise ConfigError(f"checkpoint.storage_wait_s={c.storage_wait_s:g} must be >= 0 and below "
                          f"train.collective_timeout_s ({collective_timeout_s:g}): the other ranks wait for "
                          f"rank 0's storage check in a collective")
    if c.compression == "zstd" and importlib.util.find_spec("zstandard") is None:
        raise ConfigError("checkpoint.compression=zstd needs the zstandard package on every node: pip install "
                          "'elastictrain[zstd]' (or zstandard), or set checkpoint.compression: none")
    if c.resume not in ("auto", "never") and "://" not in c.resume and not c.resume.startswith("/"):
        raise ConfigError(f"checkpoint.resume={c.resume!r}: expected auto, never, or a checkpoint URL/path")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_UNIT = {"b": 1, **{f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgt")},
         **{f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgt")}}


def _size_parts(value: Union[int, float, str]) -> tuple[Optional[float], str]:
    """(number, lower-case unit or "") of a memory setting; (None, "") when it is neither a number nor a size."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), ""
    m = _SIZE.match(value) if isinstance(value, str) else None
    return (float(m[1]), (m[2] or "").lower()) if m else (None, "")


def parse_memory_size(value: Union[int, float, str, None], where: str) -> Union[int, float, None]:
    """A memory setting as bytes (an int) or a fraction of the node's RAM (a float in (0, 1]); None stays None.

    A plain number up to 1 is a fraction and a bigger one is bytes, whatever its YAML type (`1` and `1.0`
    alike: a budget of one byte is never what was meant); a size with a unit (B, KB..TB, KiB..TiB) is bytes.
    """
    if value is None:
        return None
    number, unit = _size_parts(value)
    if number is not None and math.isfinite(number) and number > 0:
        if not unit and number <= 1:
            return number
        nbytes = number * _UNIT[unit or "b"]
        if unit or nbytes.is_integer():  # 1.5 bytes is a typo; 1.5GiB is a size
            return int(nbytes)
    raise ConfigError(f"{where}={value!r}: expected bytes (an integer, or a size such as 8GiB or 500MB) or a "
                      f"fraction of the node's RAM in (0, 1] such as 0.25; e.g. --set {where}=8GiB")


def replica_rate(e: ElasticConfig) -> Optional[int]:
    """`elastic.replica_bandwidth` as bytes per second (None: no limit); ConfigError when it is not a size."""
    if e.replica_bandwidth is None:
        return None
    try:
        value = parse_memory_size(e.replica_bandwidth, "elastic.replica_bandwidth")
    except ConfigError:
        value = None
    if not isinstance(value, int):
        raise ConfigError(f"elastic.replica_bandwidth={e.replica_bandwidth!r}: expected bytes per second (an integer, "
                          f"or a size such as 200MB); e.g. --set elastic.replica_bandwidth=200MB")
    return value


def _check_replica_tls(t: ReplicaTLSConfig) -> None:
    """All three files or none. The agent loads them at its start (checkpoint/replica_tls.py: a missing or wrong file
    is a ConfigError there); a config read elsewhere (an operator's machine) need not hold them."""
    given = {name: getattr(t, name) for name in ("cert", "key", "ca")}
    if not any(given.values()):
        return
    missing = [name for name, v in given.items() if not v]
    if missing:
        raise ConfigError(f"elastic.replica_tls needs cert, key and ca together (missing: {', '.join(missing)}): every "
                          f"agent serves and connects, so each node needs its certificate, its key and the job's CA; "
                          f"e.g. --set elastic.replica_tls.{missing[0]}=/path/to/{missing[0]}.pem")


def checkpoint_config(data: dict[str, Any], collective_timeout_s: float = 600.0) -> CheckpointConfig:
    """A validated CheckpointConfig from plain data (the public API's `Worker.steps(checkpoint=..., **options)`)."""
    c = _build(CheckpointConfig, data, "checkpoint")
    validate_checkpoint(c, collective_timeout_s)
    return c


@dataclass(frozen=True)
class Timeouts:
    """The effective timeouts that must nest (docs/agent.md "Timeout hierarchy"); None: not known here (a user's
    script sets its own collective timeout)."""

    hang_floor_s: float
    """0: hang detection off (no rule involving it applies)."""
    lease_ttl_s: float
    join_grace_s: float
    rejoin_wait_s: float
    rdzv_timeout_s: float
    collective_timeout_s: Optional[float] = None

    @classmethod
    def of(cls, cfg: "JobConfig") -> "Timeouts":
        e = cfg.elastic
        return cls(hang_floor_s=e.hang.floor_s, lease_ttl_s=e.lease_ttl_s, join_grace_s=e.join_grace_s,
                   rejoin_wait_s=e.rejoin_wait_s, rdzv_timeout_s=e.rdzv_timeout_s,
                   collective_timeout_s=cfg.train.collective_timeout_s)

    def check(self) -> None:
        """Refuse a pair that nests the wrong way, in one line naming both settings, why, and the fix.
        (checkpoint.storage_wait_s < train.collective_timeout_s is checked with the checkpoint section.)"""
        rules: list[tuple[str, Optional[float], str, Optional[float], str]] = [
            # (smaller, its value, larger, its value, what goes wrong otherwise)
            ("elastic.hang.floor_s (--heartbeat-timeout)", self.hang_floor_s or None, "train.collective_timeout_s",
             self.collective_timeout_s, "a hung rank's peers time out in their collective first and exit with a "
             "timeout error: the hang is never attributed to the rank that stopped"),
            ("elastic.lease_ttl_s (rdzv-conf lease_ttl)", self.lease_ttl_s,
             "elastic.rdzv_timeout_s (rdzv-conf join_timeout)", self.rdzv_timeout_s,
             "a lost node still counts as alive when a re-forming round gives up: the job ends instead of "
             "re-forming without it"),
            ("elastic.join_grace_s (rdzv-conf last_call_timeout)", self.join_grace_s,
             "elastic.rdzv_timeout_s (rdzv-conf join_timeout)", self.rdzv_timeout_s,
             "the last call for more nodes outlasts the round's deadline: a round waiting for a late node fails"),
        ]
        for small, a, large, b, why in rules:
            if a is not None and b is not None and not a < b:
                raise ConfigError(f"{small} = {a:g}s must be below {large} = {b:g}s: otherwise {why}; lower the "
                                  f"first or raise the second (docs/agent.md, \"Timeout hierarchy\")")
        if self.rejoin_wait_s > self.join_grace_s:
            raise ConfigError(f"elastic.rejoin_wait_s (rdzv-conf rejoin_wait) = {self.rejoin_wait_s:g}s is longer "
                              f"than elastic.join_grace_s (rdzv-conf last_call_timeout) = {self.join_grace_s:g}s, "
                              f"which ends the wait: a lost node would get only "
                              f"{self.join_grace_s:g}s to come back; raise join_grace_s to at least rejoin_wait_s "
                              f"(docs/agent.md, \"Timeout hierarchy\")")


def validate_elastic(e: ElasticConfig) -> None:
    """Check the `elastic` section; read the deprecated `heartbeat_timeout_s` into `hang.floor_s`."""
    if e.heartbeat_timeout_s is not None:
        warnings.warn(f"elastic.heartbeat_timeout_s is deprecated: it is the floor of the hang timeout; set "
                      f"elastic.hang.floor_s: {e.heartbeat_timeout_s:g} instead", FutureWarning, stacklevel=3)
        e.hang.floor_s, e.heartbeat_timeout_s = e.heartbeat_timeout_s, None
    if min(e.lease_ttl_s, e.rdzv_timeout_s, e.join_grace_s) <= 0 or e.rejoin_wait_s < 0:
        raise ConfigError("elastic timeouts (lease_ttl_s, rdzv_timeout_s, join_grace_s) must "
                          "be > 0 and rejoin_wait_s >= 0")
    for name in ("max_restarts", "crash_loop_restarts", "max_no_progress_restarts"):
        if getattr(e, name) < 0:
            raise ConfigError(f"elastic.{name} must be >= 0 (got {getattr(e, name)})")
    if not 0 <= e.restart_backoff_s <= e.restart_backoff_max_s:
        raise ConfigError(f"elastic.restart_backoff_s={e.restart_backoff_s:g} must be >= 0 and at most "
                          f"elastic.restart_backoff_max_s={e.restart_backoff_max_s:g}")
    if not 0 <= e.restart_backoff_jitter < 1:
        raise ConfigError(f"elastic.restart_backoff_jitter={e.restart_backoff_jitter:g} must be in [0, 1)")
    replica_rate(e)
    _check_replica_tls(e.replica_tls)
    if not 0 < e.straggler_margin <= 10:
        raise ConfigError(f"elastic.straggler_margin must be in (0, 10] (got {e.straggler_margin:g}): the lateness, "
                          f"as a fraction of the median step time, that makes a rank slow; 0.2 is 20%")
    if e.straggler_steps < 1:
        raise ConfigError(f"elastic.straggler_steps must be >= 1 (got {e.straggler_steps}): the slow steps in a "
                          f"row before a rank is named a straggler")
    if e.straggler_replace_after_steps < 1:
        raise ConfigError(f"elastic.straggler_replace_after_steps must be >= 1 (got "
                          f"{e.straggler_replace_after_steps}); to never replace stragglers set "
                          f"elastic.replace_stragglers: false")
    if not e.in_place_timeout_s > 0:
        raise ConfigError(f"elastic.in_place_timeout_s must be > 0 (got {e.in_place_timeout_s:g}); it bounds how long "
                          f"survivors wait in place for a replacement")
    if e.straggler_drain_window_s < 0:
        raise ConfigError(f"elastic.straggler_drain_window_s must be >= 0 (got {e.straggler_drain_window_s:g}); "
                          f"0 never drains a straggler's node (its workers are only restarted)")
    h = e.hang
    if h.floor_s < 0:
        raise ConfigError(f"elastic.hang.floor_s must be >= 0 (got {h.floor_s:g}); 0 turns hang detection off")
    for name in ("step_time_multiplier", "startup_timeout_s", "warmup_timeout_s", "init_timeout_s",
                 "load_timeout_s", "save_timeout_s", "done_timeout_s"):
        if getattr(h, name) <= 0:
            raise ConfigError(f"elastic.hang.{name} must be > 0 (got {getattr(h, name):g}); to turn hang "
                              f"detection off set elastic.hang.floor_s: 0")
