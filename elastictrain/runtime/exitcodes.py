"""Worker exit codes the agent acts on (shared by the worker and agent sides)."""

EXIT_OK = 0
EXIT_CONFIG = 2
"""Bad config or unusable input: restarting cannot help."""
EXIT_REFORM = 75
"""Stopped cleanly (state saved) because a rank on another node was asked to stop (a drain): the agent
re-forms the group without charging the restart budget, instead of finishing the job."""
