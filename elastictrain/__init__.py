"""elastictrain: elastic, fault-tolerant multi-node PyTorch training."""

__version__ = "0.1.0"
