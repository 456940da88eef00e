"""Throughput and model FLOPs utilisation, measured between log steps."""

from __future__ import annotations

import time

import torch

# Dense bf16 tensor-core peaks (FLOP/s), from the vendors' data sheets.
_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def peak_flops(device: torch.device) -> float:
    """The device's bf16 peak, or 0 where unknown (CPUs): MFU is then not reported."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _PEAK_BF16.items() if key in name), 0.0)


class Throughput:
    def __init__(self, tokens_per_step: int, flops_per_token: float, peak_flops: float):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._steps = 0
        self._since = time.perf_counter()

    def restart(self) -> None:
        """Leave out what is not training (validation, checkpoint saves) from the next
        measurement."""
        self._steps, self._since = 0, time.perf_counter()

    def add_step(self) -> None:
        self._steps += 1

    def take(self) -> dict:
        """tokens/s (and MFU where the peak is known) since the last call; then start counting
        again."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = max(time.perf_counter() - self._since, 1e-9)
        tokens_per_second = self._steps * self.tokens_per_step / elapsed
        self._steps, self._since = 0, time.perf_counter()
        values = {"tokens_per_second": tokens_per_second}
        if self.peak_flops:
            values["mfu"] = tokens_per_second * self.flops_per_token / self.peak_flops
        return values
