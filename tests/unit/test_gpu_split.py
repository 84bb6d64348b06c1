"""Splitting one GPU into logical GPUs for --replicas N: each gets an equal share of 90% of the
card's memory (never under 256 MB), the card's size from nvidia-smi, or 8 GiB when it cannot tell."""

from __future__ import annotations

import shutil

from server.worker.replicas import UNKNOWN_GPU_MEMORY_MB, gpu_memory_mb, split_memory_mb


def test_each_logical_gpu_gets_an_equal_share() -> None:
    assert split_memory_mb(81_559, 2) == 36_701  # an H100's 80 GB, two replicas
    assert split_memory_mb(16_000, 4) == 3_600
    assert split_memory_mb(1_000, 8) == 256


def test_without_nvidia_smi_the_card_is_taken_to_hold_8_gib() -> None:
    if shutil.which("nvidia-smi") is None:
        assert gpu_memory_mb() == UNKNOWN_GPU_MEMORY_MB == 8192
    else:
        assert gpu_memory_mb() > 0
