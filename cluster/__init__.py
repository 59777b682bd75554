"""Cluster-level configuration: NCCL profiles and replica placement."""
