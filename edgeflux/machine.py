"""The machine a measured speed belongs to: a samples/s means nothing on another CPU, thread count or torch."""
from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's name as the kernel reports it (x86: "model name"; ARM boards: "Hardware" or "CPU model")."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def speed_identity(device: str | torch.device) -> dict:
    """What a timing on ``device`` depends on besides the work: the processor, torch's intra-op threads, torch."""
    device = torch.device(device)
    processor = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return {"device": device.type, "processor": processor, "threads": torch.get_num_threads(),
            "torch": torch.__version__}
