"""Where torch's agent puts its workers' error files when the user named no log folder (a module of its own: it
imports torch, which the operator CLI's modules must not)."""

from __future__ import annotations

import os
import shutil
from typing import Optional

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsDest

from elastictrain.agent.scratch import make_scratch_dir


class ScratchLogsSpecs(DefaultLogsSpecs):
    """torch's log folder when the user named none and redirected nothing into it: it holds only the workers' error
    files (how a worker's exception reaches the agent). torch's `DefaultLogsSpecs` makes a `torchelastic_*` folder
    in the temp directory as it is constructed (also when a command line is only parsed) and never removes it; this
    one makes a "logs" scratch folder at its first use, which `close()` removes (the agent, at exit) and the next
    agent's sweep removes after a SIGKILL."""

    def __init__(self) -> None:
        super().__init__(log_dir=os.devnull)  # devnull: torch makes nothing now; the folder comes at the first reify
        self._scratch: Optional[str] = None

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        if self._scratch is None:
            self._scratch = self._root_log_dir = make_scratch_dir("logs")
        return super().reify(envs)

    def close(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch, self._root_log_dir, self._run_log_dir = None, os.devnull, None
