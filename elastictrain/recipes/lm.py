"""Reference recipe: causal-LM pretraining with FSDP2 over the elastic data cursor.

Run under torchrun (`torchrun --nproc-per-node 2 -m elastictrain.recipes.lm --config configs/tiny-cpu.yaml`)
or through `elastictrain run`. Every step is a pure function of (config, seed, step, data cursor): the same
world size gives bitwise-identical runs, another world size consumes exactly the same samples.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import pickle
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from elastictrain.chaos.in_worker import maybe_inject
from elastictrain.config import JobConfig, load_config
from elastictrain.errors import CheckpointError, ElastictrainError
from elastictrain.logs import setup_logging
from elastictrain.recipes.model import build_model, build_optimizer, shard_model
from elastictrain.runtime.audit import SampleLedger
from elastictrain.runtime.control import WorkerControl
from elastictrain.runtime.cursor import ElasticCursor, GlobalOrder
from elastictrain.runtime.data import build_source
from elastictrain.runtime.determinism import (
    capture_rng_state,
    configure_determinism,
    derive_seed,
    restore_rng_state,
    seed_everything,
)
from elastictrain.runtime.exitcodes import EXIT_REFORM, exit_fatal
from elastictrain.runtime.heartbeat import Heartbeat
from elastictrain.runtime.session import Session
from elastictrain.runtime.train_state import CallbackState, ModelState, OptimizerState, rng_key

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


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _hash_tensor(h: hashlib._Hash, name: str, value: Any) -> None:
    h.update(name.encode())
    if isinstance(value, torch.Tensor):
        h.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    else:  # a plain number (e.g. an optimizer's step kept as a float)
        h.update(repr(value).encode())


def param_digest(model: torch.nn.Module) -> str:
    """sha256 over the full (unsharded) parameters; a collective: every rank must call it."""
    full = get_model_state_dict(model, options=_FULL)
    h = hashlib.sha256()
    for name in sorted(full):
        _hash_tensor(h, name, full[name])
    return h.hexdigest()


def optim_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over the full (unsharded) optimizer state; a collective: every rank must call it.

    Every parameter's state (AdamW: exp_avg, exp_avg_sq, step) by FQN, then the param groups' hyperparameters
    (lr as the scheduler left it, betas, weight decay), so a resume that restores the parameters but not the
    optimizer or the LR schedule gives another digest.
    """
    full = get_optimizer_state_dict(model, optimizer, options=_FULL)
    h = hashlib.sha256()
    state = full.get("state", {})
    for fqn in sorted(state):
        for key in sorted(state[fqn]):
            _hash_tensor(h, f"{fqn}/{key}", state[fqn][key])
    h.update(json.dumps(full.get("param_groups", []), sort_keys=True).encode())
    return h.hexdigest()


_PAUSE_POLL_S = 0.5
"""While paused, ranks agree on resume/stop this often."""


class _StopFlag:
    """Set by SIGTERM/SIGINT; acted on at the next step boundary, agreed by all ranks."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True


class Trainer:
    def __init__(self, cfg: JobConfig, session: Session, checkpointer: Any = None,
                 heartbeat: Optional[Heartbeat] = None, control: Optional[WorkerControl] = None):
        self.cfg, self.session, self.checkpointer = cfg, session, checkpointer
        self.heartbeat = heartbeat or Heartbeat(None)
        self.control = control or WorkerControl(None)
        t, d = cfg.train, cfg.data
        configure_determinism(t.deterministic)
        seed_everything(derive_seed(t.seed, "rank", session.rank))
        self.model = build_model(cfg.model, t.seed)
        self.vocab_size = int(self.model.config.vocab_size)
        self.model = shard_model(self.model, session.mesh, t, session.device)
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg.optim, t.steps)
        self.source = build_source(d, self.vocab_size, t.seed)
        self.cursor = ElasticCursor(GlobalOrder(self.source.num_samples, t.seed), d.global_batch_size,
                                    d.micro_batch_size)
        self.step = 0
        self.stop = _StopFlag()
        self.output_dir = Path(t.output_dir)
        self.ledger: Optional[SampleLedger] = None
        # Identifies this launch in the sample ledger; newer launches (after a restart) supersede older ones.
        seq = torch.tensor([time.time_ns()], dtype=torch.int64)
        dist.broadcast(seq, src=0)
        self.launch_seq = int(seq.item())
        if t.audit_samples:
            self.ledger = SampleLedger(self.output_dir / "samples", session.rank, f"{self.launch_seq:x}")

    # --- checkpointable state -------------------------------------------------------------------------

    def _trainer_state(self) -> dict[str, Any]:
        return {"step": self.step, "world_size": self.session.world_size, **self.cursor.state_dict()}

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.cursor.load_state_dict(state)

    def _rng_state(self) -> dict[str, Any]:
        return {"blob": pickle.dumps(capture_rng_state())}

    def _load_rng_state(self, state: dict[str, Any]) -> None:
        restore_rng_state(pickle.loads(state["blob"]))

    def state(self, include_rng: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": ModelState(self.model),
            "optim": OptimizerState(self.model, self.optimizer),
            "scheduler": CallbackState(self.scheduler.state_dict, self.scheduler.load_state_dict),
            "trainer": CallbackState(self._trainer_state, self._load_trainer_state),
        }
        if include_rng:
            out[rng_key(self.session.rank)] = CallbackState(self._rng_state, self._load_rng_state)
        return out

    def reseed_for_new_world(self) -> None:
        """At a world size other than the checkpoint's, per-rank RNG is re-derived from (seed, step, rank)."""
        seed_everything(derive_seed(self.cfg.train.seed, "resume", self.step, self.session.rank))

    def verify_consistent_start(self, resumed_from: Optional[str]) -> None:
        """Fail loudly unless every rank starts from the same step, config fingerprint and checkpoint."""
        mine = (self.step, self.cursor.samples_consumed, json.dumps(self.cfg.fingerprint(), sort_keys=True),
                resumed_from)
        views: list[Any] = [None] * self.session.world_size
        dist.all_gather_object(views, mine)
        if any(v != views[0] for v in views):
            detail = "; ".join(f"rank {r}: step {v[0]}, samples {v[1]}, checkpoint {v[3]}" for r, v in enumerate(views))
            raise CheckpointError(f"ranks disagree on the starting state after (re)load: {detail}. Check that "
                                  f"every node uses the same config and checkpoint.url")

    # --- the step --------------------------------------------------------------------------------------

    def train_step(self) -> torch.Tensor:
        """One optimizer step over this rank's share of the global batch; returns [loss, stop, ckpt, pause] summed."""
        W, rank, dev = self.session.world_size, self.session.rank, self.session.device
        d = self.cfg.data
        maybe_inject(self.step, rank)
        plan = self.cursor.plan(self.step, rank, W)
        # Sum of token losses over the global batch / its token count; FSDP averages gradients over W ranks.
        scale = W / (d.global_batch_size * d.seq_len)
        loss_sum = torch.zeros((), device=dev, dtype=torch.float32)
        n = len(plan.micro_batches)
        for i, mb in enumerate(plan.micro_batches):
            self.model.set_requires_gradient_sync(i == n - 1)
            if mb is None:  # padding: same collectives as the others, zero weight
                tokens = torch.zeros((d.micro_batch_size, d.seq_len + 1), dtype=torch.long)
            else:
                tokens = self.source.batch(mb.samples)
            tokens = tokens.to(dev, non_blocking=True)
            logits = self.model(input_ids=tokens[:, :-1]).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1),
                                   reduction="sum")
            (loss * (scale if mb is not None else 0.0)).backward()
            if mb is not None:
                loss_sum += loss.detach()
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ledger is not None:
            self.ledger.record(self.step, W, self.launch_seq, plan.samples)
        self.cursor.advance()
        self.step += 1
        # One small collective per step: the global loss, whether any rank was asked to stop, whether rank 0
        # relays a "checkpoint now" and whether any rank was asked to pause (see runtime/control.py).
        self.control.poll()
        flags = [self.stop.requested, rank == 0 and self.control.ckpt_requested, self.control.paused]
        red = torch.cat([loss_sum.reshape(1), torch.tensor([float(f) for f in flags], device=dev)])
        dist.all_reduce(red)
        return red

    def pause(self) -> bool:
        """Wait at this step boundary until no rank is asked to pause; True when a stop was agreed meanwhile.

        Every rank loops in lockstep on a small all_reduce, so all leave at the same iteration. A "checkpoint
        now" while paused is saved at once (pause, save, then drain is the planned-maintenance sequence).
        """
        if self.session.is_main:
            log.warning("paused at step %d by operator request", self.step)
        dev = self.session.device
        while True:
            self.heartbeat.beat(self.step, "paused")
            time.sleep(_PAUSE_POLL_S)
            self.control.poll()
            ckpt = self.session.rank == 0 and self.control.ckpt_requested
            red = torch.tensor([float(self.control.paused), float(self.stop.requested), float(ckpt)], device=dev)
            dist.all_reduce(red)
            paused, stop, ckpt_now = red.tolist()
            if ckpt_now:
                if self.checkpointer is not None:
                    self.checkpointer.save_now(self)
                self.control.ckpt_handled()
            if stop or not paused:
                if self.session.is_main:
                    log.warning("%s at step %d", "stop requested while paused" if stop else "resumed", self.step)
                self.heartbeat.beat(self.step, "train")
                return bool(stop)

    # --- the run ---------------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        t, d, s = self.cfg.train, self.cfg.data, self.session
        self.stop.install()
        resumed_from = None
        if self.checkpointer is not None:
            self.heartbeat.beat(self.step, "load")
            loading = time.monotonic()
            resumed_from = self.checkpointer.restore(self)
            log.debug("checkpoint restore took %.2fs", time.monotonic() - loading)
        self.verify_consistent_start(resumed_from)
        start_step = self.step
        tokens_per_step = d.global_batch_size * d.seq_len
        losses: dict[int, float] = {}
        step_times: list[float] = []
        bar = None
        if s.is_main and t.progress and sys.stderr.isatty():
            from tqdm import tqdm
            bar = tqdm(total=t.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        t0 = time.monotonic()
        stopped_early = stopped_by_peer = False
        end = min(t.steps, t.stop_at) if t.stop_at else t.steps
        if self.step >= end and s.is_main:
            log.warning("already at step %d of %d (resumed from %s): nothing to train; to start over, use "
                        "--set checkpoint.resume=never or another checkpoint.url", self.step, end, resumed_from)
        while self.step < end:
            ts = time.monotonic()
            red = self.train_step()
            loss_sum, stop, ckpt_now, pause = red.tolist()
            step_times.append(time.monotonic() - ts)
            self.heartbeat.beat(self.step, "train")
            loss = loss_sum / tokens_per_step
            losses[self.step] = loss
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}")
            if self.step % t.log_every == 0 or self.step == end:
                recent = step_times[-t.log_every:]
                st = statistics.median(recent)
                log.info("step %d/%d loss %.4f lr %.2e step_time %.3fs tokens/s %.0f", self.step, t.steps, loss,
                         self.scheduler.get_last_lr()[0], st, tokens_per_step / st)
            if self.checkpointer is not None:
                self.checkpointer.after_step(self, final=self.step == end, stopping=bool(stop))
                if ckpt_now and not stop:
                    self.checkpointer.save_now(self)
            if ckpt_now:
                self.control.ckpt_handled()
            if pause and not stop and self.step < end:
                stop = self.pause()
                if stop and self.checkpointer is not None:
                    self.checkpointer.after_step(self, final=False, stopping=True)
            if stop:
                stopped_early = True
                stopped_by_peer = not self.stop.requested
                log.warning("stop requested%s: leaving at step %d", " by another rank" if stopped_by_peer else "",
                            self.step)
                break
        wall = time.monotonic() - t0
        self.heartbeat.beat(self.step, "done")  # the final save and digest are not a hang
        if self.checkpointer is not None:
            self.checkpointer.close()
        digest = opt_digest = ""
        if t.param_digest:
            digest, opt_digest = param_digest(self.model), optim_digest(self.model, self.optimizer)
        if self.ledger is not None:
            self.ledger.close()
        med = statistics.median(step_times) if step_times else 0.0
        return RunSummary(
            world_size=s.world_size, start_step=start_step, final_step=self.step,
            samples_consumed=self.cursor.samples_consumed, final_loss=losses.get(self.step),
            tokens_per_s=(tokens_per_step / med) if med else 0.0, step_time_s_median=med, wall_s=wall,
            stopped_early=stopped_early, stopped_by_peer=stopped_by_peer, param_digest=digest,
            optim_digest=opt_digest, resumed_from=resumed_from, losses=losses)


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

    import elastictrain.recipes.checkpointing  # noqa: F401
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
    started = time.monotonic()
    control = WorkerControl.from_env()  # before the first heartbeat: the agent rings only workers that beat
    heartbeat = Heartbeat.from_env()  # ties this worker's life to its agent's
    session = Session(cfg.train).start()
    try:
        from elastictrain.recipes.checkpointing import make_checkpointer
        pg_ready = time.monotonic()
        trainer = Trainer(cfg, session, heartbeat=heartbeat, control=control)
        trainer.checkpointer = make_checkpointer(cfg, trainer, session)
        log.debug("worker set up in %.2fs: process group %.2fs, model and data %.2fs", time.monotonic() - started,
                  pg_ready - started, time.monotonic() - pg_ready)
        summary = trainer.run()
        if session.is_main:
            write_summary(summary, Path(cfg.train.output_dir))
        if summary.stopped_by_peer:
            return EXIT_REFORM
    except ElastictrainError as e:
        log.error("%s", e)
        return 1 if e.restartable else exit_fatal(str(e))
    finally:
        session.close()
        heartbeat.close()
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
    exit_now(main())
