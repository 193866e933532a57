"""Worker exit codes the agent acts on (shared by the worker and agent sides), and how a worker says why."""

from __future__ import annotations

import json
import logging
import os
import time

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FATAL = 2
"""An error that restarting cannot fix (bad config or input, a checkpoint that does not fit the model): the agent
ends the job on the first such exit, on every node, with the cause the worker recorded (`exit_fatal`)."""
EXIT_REFORM = 75
"""Stopped cleanly (state saved) because a rank on another node was asked to stop (a drain): the agent
re-forms the group without charging the restart budget, instead of finishing the job."""

EXIT_NO_IN_PLACE = 76
"""With `elastic.in_place`: this worker could not recover in place (no replacement joined in time, the group did not
re-form, a peer failure outside `Worker.guard()`): its agent restarts every worker instead of replacing it."""

ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
"""Where torch's agent reads a failed worker's cause (set per worker by torch.distributed.elastic)."""


def exit_fatal(cause: str) -> int:
    """Record `cause` where the agent reads it and return `EXIT_FATAL` for the worker to exit with.

    The record is torch's error-file format with a plain-string message, so our agent and a stock torchrun both
    report the one-line cause instead of "exited with code 2".
    """
    path = os.environ.get(ENV_ERROR_FILE)
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": cause, "timestamp": int(time.time())}, f)
        except OSError as e:
            log.warning("could not record the cause in %s: %s", path, e)
    return EXIT_FATAL
