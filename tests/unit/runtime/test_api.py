"""The public worker API as a user meets it: `import elastictrain`, ElasticSampler, TrainState, Worker.steps.

Everything here runs in one process (`Worker` makes a one-rank process group without torchrun); what only two
ranks can show (disagreeing report names, a SIGTERM to one rank) is in tests/integration/test_api_worker.py.
The import-graph rule (the worker side never imports the agent side) is tests/unit/test_layers.py's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import elastictrain as et
from elastictrain.checkpoint.discovery import list_checkpoints
from elastictrain.checkpoint.storage import open_storage
from elastictrain.errors import CheckpointMismatchError, ConfigError, StorageUnreachableError
from elastictrain.runtime.cursor import GlobalOrder
from elastictrain.runtime.exitcodes import ENV_ERROR_FILE, EXIT_FATAL

# --- import elastictrain ---------------------------------------------------------------------------------------


def test_import_elastictrain_exposes_only_the_declared_api_and_does_not_import_torch():
    # A fresh interpreter: this test process has loaded torch already.
    probe = textwrap.dedent("""
        import json, sys
        import elastictrain as et
        out = {"torch_loaded": "torch" in sys.modules, "dir": dir(et), "all": list(et.__all__),
               "version": et.__version__}
        try:
            et.NoSuchName
        except AttributeError as e:
            out["unknown"] = str(e)
        print(json.dumps(out))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(done.stdout)
    assert not out["torch_loaded"], "`import elastictrain` imported torch: the CLI would pay for it on every call"
    assert sorted(out["dir"]) == sorted([*out["all"], "__version__"])
    assert set(out["all"]) >= {"Worker", "TrainState", "ElasticSampler", "MicroBatch", "CheckpointConfig",
                               "ElastictrainError"}
    # Resolving a name loads torch: done here, where torch is loaded already.
    assert {n: getattr(et, n).__name__ for n in et.__all__} == {n: n for n in out["all"]}
    assert "NoSuchName" in out["unknown"] and all(n in out["unknown"] for n in out["all"])
    assert out["version"]


# --- ElasticSampler ----------------------------------------------------------------------------------------------

N, G, M = 100, 49, 7
"""7 micro-batches a step (a multiple of no world size 2..5; G not divisible by any either); 100 samples, so
the steps below cross two epoch boundaries."""


def _step_shares(sampler: et.ElasticSampler, world: int) -> list[list[et.MicroBatch]]:
    return [sampler.micro_batches(rank, world) for rank in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_sampler_deals_each_step_of_the_global_order_over_any_world_size(world):
    sampler = et.ElasticSampler(N, global_batch_size=G, micro_batch_size=M, seed=7)
    order = GlobalOrder(N, seed=7)
    per_rank = -(-(G // M) // world)
    for step in range(5):
        shares = _step_shares(sampler, world)
        assert [len(s) for s in shares] == [per_rank] * world, "every rank runs as many micro-batches"
        real = [mb for share in shares for mb in share if not mb.padding]
        assert len(real) == G // M
        got = Counter(i for mb in real for i in mb.indices)
        assert got == Counter(order.lookup(range(step * G, (step + 1) * G)))
        for share in shares:
            assert [mb.last for mb in share] == [False] * (per_rank - 1) + [True]
            for mb in share:
                assert len(mb.indices) == M and all(0 <= i < N for i in mb.indices)
                if mb.padding:
                    assert (mb.weight, mb.fraction) == (0.0, 0.0)
                else:
                    assert mb.weight == pytest.approx(world * M / G)
                    assert mb.fraction == pytest.approx(M / G)
        assert sum(mb.fraction for share in shares for mb in share) == pytest.approx(1.0)
        sampler.advance()


def test_sampler_uses_every_sample_once_per_epoch():
    sampler = et.ElasticSampler(N, global_batch_size=20, micro_batch_size=5, seed=1)
    seen = []
    for _ in range(N // 20):
        seen += [i for share in _step_shares(sampler, 3) for mb in share if not mb.padding for i in mb.indices]
        sampler.advance()
    assert sorted(seen) == list(range(N))


def _advanced(steps: int, **kw: Any) -> et.ElasticSampler:
    sampler = et.ElasticSampler(kw.pop("num_samples", N), global_batch_size=kw.pop("global_batch_size", G),
                                micro_batch_size=M, seed=kw.pop("seed", 3))
    for _ in range(steps):
        sampler.advance()
    return sampler


def test_sampler_state_round_trips():
    saved = _advanced(3)
    restored = _advanced(0)
    restored.load_state_dict(saved.state_dict())
    assert restored.state_dict() == saved.state_dict()
    for world in (1, 3):
        assert _step_shares(restored, world) == _step_shares(saved, world)


@pytest.mark.parametrize("field,kw", [("num_samples", {"num_samples": N + 1}), ("seed", {"seed": 4})])
def test_sampler_refuses_a_state_of_another_dataset_or_seed(field, kw):
    with pytest.raises(CheckpointMismatchError, match=field):
        _advanced(0, **kw).load_state_dict(_advanced(3).state_dict())


def test_sampler_accepts_a_state_saved_with_another_global_batch_size():
    resumed = _advanced(0, global_batch_size=2 * M)
    resumed.load_state_dict(_advanced(3).state_dict())
    real = [i for share in _step_shares(resumed, 2) for mb in share if not mb.padding for i in mb.indices]
    assert Counter(real) == Counter(GlobalOrder(N, seed=3).lookup(range(3 * G, 3 * G + 2 * M)))


# --- TrainState -------------------------------------------------------------------------------------------------


class _Counter:
    """A user's own Stateful extra."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def test_train_state_refuses_an_optimizer_without_its_model():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="model="):
        et.TrainState(optim=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("name", ["trainer", "rng", "my/extra", "my.extra"])
def test_train_state_refuses_reserved_or_unusable_extra_names(name):
    with pytest.raises(ConfigError, match=f"{name!r} is not a usable name"):
        et.TrainState(**{name: _Counter()})


def test_train_state_refuses_an_extra_that_cannot_be_saved():
    with pytest.raises(ConfigError, match="lookup=dict has no state_dict"):
        et.TrainState(lookup={"a": 1})


def test_train_state_checkpoint_holds_model_optim_extras_progress_and_this_ranks_rng():
    model = torch.nn.Linear(2, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1)
    sampler = et.ElasticSampler(10, global_batch_size=2, micro_batch_size=1)
    state = et.TrainState(model=model, optim=optim, scheduler=sched, data=sampler, counter=_Counter())
    assert set(state.checkpoint_state(rank=3)) == {"model", "optim", "scheduler", "data", "counter", "trainer",
                                                   "rng/rank3"}
    assert "rng/rank3" not in state.checkpoint_state(rank=3, include_rng=False)
    assert state.samplers == [sampler]


# --- Worker, one process ----------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _one_process_world(monkeypatch):
    """No torchrun, no agent, no injected faults; the Worker's signal handlers do not outlive the test."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 ENV_ERROR_FILE, "ELASTICTRAIN_HEARTBEAT_ADDR", "ELASTICTRAIN_AGENT_PID",
                 "ELASTICTRAIN_CONTROL_FILE", "ELASTICTRAIN_CHAOS"):
        monkeypatch.delenv(name, raising=False)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    assert not dist.is_initialized(), "leaving the Worker block destroys the process group"


_g = torch.Generator().manual_seed(0)
X = torch.randn(64, 4, generator=_g)
Y = X.sum(dim=1, keepdim=True).tanh()


@dataclass
class Run:
    steps: list[int]
    """The step indices the loop yielded."""
    start_step: int
    end_step: int
    stopped: bool
    digest: dict[str, str]


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))


def _train(ckpt: Optional[Path], total: int, *, sigterm_at: Optional[int] = None, break_at: Optional[int] = None,
           fingerprint: Optional[dict[str, Any]] = None, inits: Optional[list[int]] = None) -> Run:
    """A complete user script: FSDP2 MLP with dropout (so RNG matters), AdamW, an LR schedule, the sampler.

    `inits`: build the model on the meta device and initialise it in the loop's `init` only (appending to `inits`).
    """
    seen: list[int] = []
    options: dict[str, Any] = {"every_steps": 3} if ckpt is not None else {}
    with et.Worker(seed=0) as w:
        torch.manual_seed(0)
        if inits is None:
            model = _mlp()
            fully_shard(model, mesh=w.mesh)
        else:
            with torch.device("meta"):
                model = _mlp()
            fully_shard(model, mesh=w.mesh)
            model.to_empty(device="cpu")

            def init() -> None:
                inits.append(1)
                torch.manual_seed(0)
                full = _mlp().state_dict()
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        p.to_local().copy_(full[name])  # one rank: the shard is the whole tensor
            options["init"] = init
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
        sampler = et.ElasticSampler(len(X), global_batch_size=8, micro_batch_size=4, seed=0)
        state = et.TrainState(model=model, optim=optim, scheduler=sched, data=sampler)
        loop = w.steps(total, state, checkpoint=str(ckpt) if ckpt else None, fingerprint=fingerprint, **options)
        for step in loop:
            seen.append(step)
            for mb in sampler.micro_batches():
                model.set_requires_gradient_sync(mb.last)
                loss = torch.nn.functional.mse_loss(model(X[mb.indices]), Y[mb.indices])
                (loss * mb.weight).backward()
                w.report(loss=loss.detach() * mb.fraction)
            optim.step()
            sched.step()
            optim.zero_grad()
            if step == sigterm_at:
                os.kill(os.getpid(), signal.SIGTERM)
            if step == break_at:
                break
        return Run(seen, loop.start_step, state.step, w.stopped, state.digest())


def _saved_steps(ckpt: Path) -> list[int]:
    return [c.step for c in list_checkpoints(open_storage(str(ckpt))) if c.status == "valid"]


def test_sigterm_saves_and_ends_the_loop_and_the_resume_is_bitwise_identical(tmp_path):
    full = _train(tmp_path / "full", 8)
    assert full.steps == list(range(8)) and not full.stopped

    stopped = _train(tmp_path / "run", 8, sigterm_at=4)
    assert stopped.stopped and stopped.end_step == 5, "the step in progress finishes, then the loop ends"
    assert max(_saved_steps(tmp_path / "run")) == 5, "the stop saved the step it ended at"
    resumed = _train(tmp_path / "run", 8)
    assert resumed.start_step == 5 and resumed.steps == [5, 6, 7]
    assert resumed.digest == full.digest and set(full.digest) == {"model", "optim"}


def test_leaving_the_loop_early_resumes_from_the_last_periodic_save_bitwise(tmp_path):
    full = _train(None, 8)
    left = _train(tmp_path, 8, break_at=4)
    assert left.end_step == 4 and not left.stopped, "break: no stop, no save of step 5"
    assert max(_saved_steps(tmp_path)) == 3
    resumed = _train(tmp_path, 8)
    assert resumed.steps == [3, 4, 5, 6, 7]
    assert resumed.digest == full.digest


def test_init_runs_on_a_fresh_start_only_and_a_meta_built_model_resumes_bitwise(tmp_path):
    """A model built on the meta device is initialised by the loop's `init` on a fresh start; a resume loads into
    it without initialising it (a restart does not pay for weights the load overwrites)."""
    full = _train(None, 8)
    inits: list[int] = []
    left = _train(tmp_path, 8, break_at=4, inits=inits)
    assert inits == [1], "a fresh start initialises once"
    resumed = _train(tmp_path, 8, inits=inits)
    assert inits == [1], "a resume does not initialise"
    assert resumed.steps == [3, 4, 5, 6, 7] and left.end_step == 4
    assert resumed.digest == full.digest, "init + load give the same weights as a model built with them"


def test_resume_with_another_fingerprint_is_refused_naming_the_part(tmp_path, monkeypatch):
    _train(tmp_path, 2, fingerprint={"model": {"hidden": 16}, "dataset": "v1"})
    monkeypatch.setenv(ENV_ERROR_FILE, str(tmp_path / "error.json"))
    with pytest.raises(SystemExit) as leaving:
        _train(tmp_path, 4, fingerprint={"model": {"hidden": 32}, "dataset": "v1"})
    assert leaving.value.code == EXIT_FATAL, "restarting cannot fix it: the agent ends the job"
    assert isinstance(leaving.value.__context__, CheckpointMismatchError)
    cause = json.loads((tmp_path / "error.json").read_text())["message"]
    assert "model (checkpoint" in cause and "dataset" not in cause


def test_reported_values_are_summed_into_metrics_and_on_step():
    seen: list[tuple[int, dict[str, float]]] = []
    with et.Worker(seed=0) as w:
        for _ in w.steps(3, et.TrainState(), on_step=lambda step, metrics: seen.append((step, dict(metrics)))):
            w.report(loss=1.5, tokens=torch.tensor(2.0))
            w.report(loss=torch.tensor(0.25))
        assert w.metrics == {"loss": 1.75, "tokens": 2.0}
    assert seen == [(s, {"loss": 1.75, "tokens": 2.0}) for s in (1, 2, 3)], "on_step gets the steps done"


def test_reporting_more_names_than_the_reduction_holds_is_a_config_error():
    with et.Worker(seed=0) as w:
        with pytest.raises(ConfigError, match="9 names in one step .* at most 8"):
            for _ in w.steps(2, et.TrainState()):
                w.report(**{f"m{i}": 1.0 for i in range(9)})


@pytest.mark.parametrize("options,fragments", [
    ({"every_step": 2}, ["checkpoint.every_step: unknown field", "every_steps"]),
    ({"keep_last": -1}, ["checkpoint.keep_last must be >= 1"]),
    ({"every_seconds": -1.0}, ["checkpoint.every_seconds must be >= 0"]),
])
def test_bad_checkpoint_options_are_config_errors_naming_the_field(tmp_path, options, fragments):
    with et.Worker(seed=0) as w:
        with pytest.raises(ConfigError) as caught:
            w.steps(2, et.TrainState(), checkpoint=str(tmp_path), **options)
        assert all(f in str(caught.value) for f in fragments), caught.value


def test_checkpoint_options_without_a_checkpoint_url_are_a_config_error():
    with et.Worker(seed=0) as w:
        with pytest.raises(ConfigError, match="every_steps given but no checkpoint URL"):
            w.steps(2, et.TrainState(), every_steps=2)
        with pytest.raises(ConfigError, match="either in the CheckpointConfig or as keywords"):
            w.steps(2, et.TrainState(), checkpoint=et.CheckpointConfig(url="/tmp/x"), every_steps=2)


def test_a_fatal_error_in_the_block_exits_2_and_records_its_cause(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_ERROR_FILE, str(tmp_path / "error.json"))
    with pytest.raises(SystemExit) as leaving:
        with et.Worker(seed=0):
            raise ConfigError("model.hidden must be > 0; fix the config")
    assert leaving.value.code == EXIT_FATAL
    assert json.loads((tmp_path / "error.json").read_text())["message"] == "model.hidden must be > 0; fix the config"


def test_a_restartable_error_leaves_the_block_as_itself():
    with pytest.raises(StorageUnreachableError):
        with et.Worker(seed=0):
            raise StorageUnreachableError("s3 endpoint down")


def test_a_world_that_shrank_for_a_script_without_rebuild_exits_for_a_free_re_form():
    """The in-place path found the world smaller and no `rebuild`: the worker leaves for a re-form in a new round
    (the agent charges no restart for it, as for a drain), not as a failure of the in-place path."""
    from elastictrain.runtime.exitcodes import EXIT_REFORM
    from elastictrain.runtime.inplace import WorldShrank

    with pytest.raises(SystemExit) as leaving:
        with et.Worker(seed=0):
            raise WorldShrank("the world shrank in place to 1 ranks")
    assert leaving.value.code == EXIT_REFORM


def test_a_doorbell_after_the_worker_block_is_ignored_not_fatal(tmp_path, monkeypatch):
    """The agent rings a worker once after its first heartbeat; for a short run that can be as the process exits,
    where the interpreter puts SIGUSR1's default action (death) back. After the block, the doorbell is ignored."""
    import os
    import signal

    from elastictrain.runtime.control import DOORBELL, ENV_CONTROL_FILE, ControlState

    path = tmp_path / "control.json"
    ControlState().write(str(path))
    monkeypatch.setenv(ENV_CONTROL_FILE, str(path))
    before = signal.getsignal(DOORBELL)
    try:
        with et.Worker(seed=0):
            assert callable(signal.getsignal(DOORBELL))
        assert signal.getsignal(DOORBELL) == signal.SIG_IGN
        os.kill(os.getpid(), DOORBELL)  # would end this test process with the default action
    finally:
        signal.signal(DOORBELL, before)
