"""Reference recipe: causal-LM pretraining with FSDP2, written on elastictrain's public API.

Run under torchrun (`torchrun --nproc-per-node 2 -m elastictrain.recipes.lm --config configs/tiny-cpu.yaml`)
or through `elastictrain run`. Every step is a pure function of (config, seed, step, data cursor): the same
world size gives bitwise-identical runs, another world size consumes exactly the same samples.

Everything elastic (resume, saves, heartbeats, pause/drain/stop, the exactly-once cursor) comes from
`elastictrain.Worker`, `TrainState` and `ElasticSampler`, as in any user's script (examples/); what is left here
is the model, the data and the loss.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from elastictrain import ElasticSampler, TrainState, Worker
from elastictrain.config import JobConfig, load_config
from elastictrain.errors import ElastictrainError
from elastictrain.logs import setup_logging
from elastictrain.recipes.adapters import adapter_metadata, has_frozen, job_fingerprint
from elastictrain.recipes.model import build_optimizer, build_sharded, fill_weights
from elastictrain.runtime.chat import IGNORE
from elastictrain.runtime.data import TokenSource, build_source
from elastictrain.runtime.exitcodes import exit_fatal
from elastictrain.runtime.packing import PackedSampler, PackedSource

log = logging.getLogger("elastictrain.recipes.lm")  # also when run as __main__


@dataclass
class RunSummary:
    """Written by rank 0 to `<output_dir>/summary.json` at the end of a run."""

    world_size: int
    start_step: int
    final_step: int
    samples_consumed: int
    final_loss: Optional[float]
    tokens_per_s: float
    step_time_s_median: float
    wall_s: float
    stopped_early: bool
    stopped_by_peer: bool
    """Another rank (a draining node) asked to stop; this rank's node goes on in a re-formed group."""
    param_digest: str
    optim_digest: str
    """sha256 of the final full optimizer state (see `optim_digest`); "" with train.param_digest off."""
    resumed_from: Optional[str] = None
    losses: dict[int, float] = field(default_factory=dict)


def train(cfg: JobConfig, w: Worker) -> RunSummary:
    """Train under `cfg` on the started worker `w`; every rank returns the run's summary."""
    t, d = cfg.train, cfg.data
    setup_started = time.monotonic()
    # Weights are initialised (model.init: random or pretrained) only on a fresh start (`init` below): a resume
    # loads into the shards and never reads model.path's weights. Unless some are frozen (model.lora, model.freeze):
    # checkpoints then hold only the trained ones, and the frozen base is filled on every start, before a resume.
    model = build_sharded(cfg.model, w.mesh, t, w.device)
    hf_config = model.config
    optimizer, scheduler = build_optimizer(model, cfg.optim, t.steps)

    def rebuild() -> TrainState:
        """The world shrank in place (a node lost for good): the model sharded over the new mesh, its optimizer and
        scheduler; the loop loads them from the in-memory snapshots. The step below reads them from `state`."""
        new = build_sharded(cfg.model, w.mesh, t, w.device)
        if has_frozen(new):
            fill_weights(new, cfg.model, t.seed)  # the frozen base: not in the snapshots
        new_optimizer, new_scheduler = build_optimizer(new, cfg.optim, t.steps)
        return TrainState(model=new, optim=new_optimizer, scheduler=new_scheduler, trainable_only=has_frozen(new))
    source = build_source(d, int(hf_config.vocab_size), t.seed, cfg.model.path)
    sampler = (PackedSampler(source.packs, global_batch_size=d.global_batch_size,
                             micro_batch_size=d.micro_batch_size, seed=t.seed) if isinstance(source, PackedSource)
               else ElasticSampler(source.num_samples, global_batch_size=d.global_batch_size,
                                   micro_batch_size=d.micro_batch_size, seed=t.seed))
    trainable_only = has_frozen(model)
    state = TrainState(model=model, optim=optimizer, scheduler=scheduler, data=sampler, trainable_only=trainable_only)
    del model, optimizer, scheduler  # the state's (a smaller world in place replaces them: `rebuild`)
    log.debug("model and data set up in %.2fs", time.monotonic() - setup_started)

    end = min(t.steps, t.stop_at) if t.stop_at else t.steps
    tokens_per_step = d.global_batch_size * d.seq_len
    losses: dict[int, float] = {}
    bar = None

    def after_step(step: int, metrics: dict[str, float]) -> None:
        losses[step] = loss = metrics["loss"]
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
        if step % t.log_every == 0 or step == end:
            st = statistics.median(loop.step_times[-t.log_every:])
            log.info("step %d/%d loss %.4f lr %.2e step_time %.3fs tokens/s %.0f", step, t.steps, loss,
                     state.extras["scheduler"].get_last_lr()[0], st, tokens_per_step / st)

    if trainable_only:
        # A section: the agent's init allowance, then 5 x its longest run, not the start-up timeout.
        with w.section("frozen_base"):
            fill_weights(state.model, cfg.model, t.seed)
    loop = w.steps(end, state, checkpoint=cfg.checkpoint if cfg.checkpoint.url else None,
                   fingerprint=job_fingerprint(cfg, trainable_only),
                   metadata={"hf_config": hf_config.to_dict(), **adapter_metadata(cfg.model)},
                   audit_dir=str(Path(t.output_dir) / "samples") if t.audit_samples else None, on_step=after_step,
                   init=None if trainable_only else (lambda: fill_weights(state.model, cfg.model, t.seed)),
                   rebuild=rebuild)
    if w.is_main and t.progress and sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=t.steps, desc="train", unit="step", dynamic_ncols=True)
    first_step: Optional[float] = None
    for _ in loop:
        if first_step is None:
            first_step = time.monotonic()
            if bar is not None:
                bar.update(state.step)
        with w.guard():  # elastic.in_place: a peer's failure pauses this process here instead of ending it
            train_step(state, sampler, source, cfg, w, tokens_per_step)
    wall = time.monotonic() - first_step if first_step is not None else 0.0
    if bar is not None:
        bar.close()
    digests = state.digest() if t.param_digest else {}
    med = statistics.median(loop.step_times) if loop.step_times else 0.0
    return RunSummary(
        world_size=w.world_size, start_step=loop.start_step, final_step=state.step,
        samples_consumed=sampler.samples_consumed, final_loss=losses.get(state.step),
        tokens_per_s=(tokens_per_step / med) if med else 0.0, step_time_s_median=med, wall_s=wall,
        stopped_early=loop.stopped, stopped_by_peer=loop.stopped_by_peer, param_digest=digests.get("model", ""),
        optim_digest=digests.get("optim", ""), resumed_from=loop.resumed_from, losses=losses)


def train_step(state: TrainState, sampler: ElasticSampler | PackedSampler, source: TokenSource | PackedSource,
               cfg: JobConfig, w: Worker, tokens_per_step: int) -> None:
    """One optimizer step on this rank's share of the global batch. A function of its own: when a peer's failure
    ends it early (in place), its frame, the only other holder of the model and optimizer, goes with it, so that a
    smaller world's `rebuild` does not hold two models at once."""
    d = cfg.data
    model, optimizer = state.model, state.optim
    assert model is not None and optimizer is not None
    # Summed token losses / the global batch's count of target tokens (the same at any world size); FSDP
    # averages gradients over the ranks, which mb.weight undoes. `norm` is that count per micro-batch.
    targets = (max(1, source.targets(sampler.step_sequences())) if isinstance(sampler, PackedSampler)
               else d.global_batch_size * d.seq_len)
    norm = targets * d.micro_batch_size / d.global_batch_size
    for mb in sampler.micro_batches():
        model.set_requires_gradient_sync(mb.last)
        loss = token_loss(model, source, mb.indices, w.device)
        (loss * (mb.weight / norm)).backward()
        # tokens: summed over micro-batches and ranks, the global batch's (the dashboard's tokens/s)
        w.report(loss=loss.detach() * (mb.fraction / norm), tokens=mb.fraction * tokens_per_step)
    if cfg.optim.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    optimizer.step()
    state.extras["scheduler"].step()
    optimizer.zero_grad(set_to_none=True)


def token_loss(model: torch.nn.Module, source: TokenSource | PackedSource, indices: list[int],
               device: torch.device) -> torch.Tensor:
    """Summed next-token cross-entropy of these samples (of their response tokens, for packed chat data)."""
    if isinstance(source, PackedSource):
        b = source.batch(indices).to(device)
        # No attention mask and no cache: transformers then derives a per-sample (block-diagonal) causal mask from
        # the position ids, which restart at every sample (runtime/packing.py).
        logits = model(input_ids=b.input_ids, position_ids=b.position_ids, use_cache=False).logits[:, :-1]
        targets = b.labels[:, 1:]
    else:
        tokens = source.batch(indices).to(device, non_blocking=True)
        logits, targets = model(input_ids=tokens[:, :-1]).logits, tokens[:, 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


def write_summary(summary: RunSummary, output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=1))
    log.info("done: steps %d..%d on %d rank(s), final loss %s, %.0f tokens/s, median step %.3fs, wall %.1fs",
             summary.start_step, summary.final_step, summary.world_size,
             f"{summary.final_loss:.4f}" if summary.final_loss is not None else "n/a",
             summary.tokens_per_s, summary.step_time_s_median, summary.wall_s)
    log.info("summary written to %s", output_dir / "summary.json")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="elastictrain.recipes.lm", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML job file (configs/tiny-cpu.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field, e.g. --set train.steps=200 (repeatable)")
    return p.parse_args(argv)


def prewarm(argv: list[str]) -> None:
    """Import what `main(argv)` will need, for a pre-warmed spare worker (runtime/warmstart.py)."""
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    from fsspec import get_filesystem_class
    from fsspec.core import split_protocol

    import elastictrain.runtime.worker  # noqa: F401
    from elastictrain.recipes.model import preload

    preload(cfg.model)
    if cfg.checkpoint.url:
        get_filesystem_class(split_protocol(cfg.checkpoint.url)[0] or "file")  # imports s3fs for s3://


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ElastictrainError as e:
        sys.stderr.write(f"elastictrain: error: {e}\n")
        return exit_fatal(str(e))
    setup_logging(cfg.logging.level, cfg.logging.json)
    t = cfg.train
    try:
        # Leaving the block turns a drain by another node into EXIT_REFORM and an error that restarting cannot fix
        # into EXIT_FATAL (SystemExit); a restartable one is logged there and ends this worker with 1.
        with Worker(seed=t.seed, device=t.device, deterministic=t.deterministic,
                    collective_timeout_s=t.collective_timeout_s) as w:
            summary = train(cfg, w)
            if w.is_main:
                write_summary(summary, Path(t.output_dir))
    except ElastictrainError:
        return 1
    return 0


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown, once everything the run wrote is closed.

    torch's C++ destructors (gloo, thread pools) took ~3 s after a finished run here, and every restart, re-form
    and job end waited for them. By the time `main` returns, checkpoints are saved, the ledger and summary are
    closed and the process group is destroyed; only the log streams need a flush.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as e:  # EXIT_REFORM / EXIT_FATAL from the Worker
        code = e.code if isinstance(e.code, int) else 1
    exit_now(code)
