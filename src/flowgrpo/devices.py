"""GPU memory shared by several processes (rollout and trainer on one GPU, docs/colocated.md), and
host tensors copied to a GPU without making the host wait."""

from __future__ import annotations

import time

import torch


def release_cached_memory(device: str) -> float:
    """Give this process's cached, unused GPU memory back to the device, so another process on
    the same GPU can allocate it; returns the seconds it took (0 on a CPU). The caching
    allocator allocates again on the next call that needs it: that cost shows up there."""
    if not device.startswith("cuda"):
        return 0.0
    started = time.perf_counter()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return time.perf_counter() - started


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; a host tensor goes to a GPU from page-locked memory, without the
    host waiting: a copy from pageable memory makes the host wait until the stream has run
    everything queued before it, and the GPU then idles while the host launches what follows
    (a training micro-batch made several such copies). The page-locked copy is PyTorch's
    caching host allocator's, kept until the transfer is done."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
