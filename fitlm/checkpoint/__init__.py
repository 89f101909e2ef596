"""Resumable distributed checkpoints (torch.distributed.checkpoint), inspection and merging."""
