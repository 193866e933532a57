"""checkpoint/buffers.py: large buffers that are written before they are read are allocated without torch's
deterministic fill."""

import psutil
import pytest
import torch
import torch.utils.deterministic as det

from elastictrain.checkpoint.buffers import unfilled


def test_unfilled_buffers_touch_no_memory_under_deterministic_algorithms():
    """With deterministic algorithms on, torch writes every new tensor (a pass over fresh memory: 5 s for a 150M
    model's 1.8 GB receive buffer on this VM). A buffer made `unfilled()` costs no memory until it is written; the
    setting comes back afterwards, also when the block raises."""
    size = 256 << 20
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    rss = psutil.Process().memory_info
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        start = rss().rss
        with unfilled():
            quiet = torch.empty(size, dtype=torch.uint8)
        assert rss().rss - start < size // 4, "the buffer was written"
        filled = torch.empty(size, dtype=torch.uint8)  # torch's fill, as before
        assert rss().rss - start > size * 3 // 4
        assert det.fill_uninitialized_memory
        with pytest.raises(RuntimeError), unfilled():
            raise RuntimeError("inside")
        assert det.fill_uninitialized_memory
        del quiet, filled
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
