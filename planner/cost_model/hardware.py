"""Hardware figures the analytic cost model starts from, as data.

Issue-level presets (H100, TPU, ...) extend `PRESETS`; the default is an A100-80GB-class GPU node,
a common, well-documented target (NVIDIA A100 datasheet: 19.5 TFLOP/s FP32, 312 TFLOP/s BF16 dense,
2.0 TB/s HBM2e, NVLink3 600 GB/s bidirectional = 300 GB/s per direction; 200 Gb/s HDR InfiniBand).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType


@dataclasses.dataclass(frozen=True, slots=True)
class Hardware:
    """Per-device peak figures and link figures of one accelerator kind.

    Attributes:
      name: preset name.
      flops_f32 / flops_bf16: peak FLOP/s for float32 and 16-bit matmuls.
      memory_bytes: device memory capacity.
      memory_bandwidth: device memory bandwidth, bytes/s.
      intra_bandwidth / intra_latency: one direction of the link between devices of one host (bytes/s, s).
      inter_bandwidth / inter_latency: per-device share of the link between hosts (bytes/s, s).
    """

    name: str
    flops_f32: float
    flops_bf16: float
    memory_bytes: float
    memory_bandwidth: float
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "name" and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"hardware {self.name}: {f.name}={v!r} must be a positive number")


A100_80GB = Hardware(
    name="a100-80gb",
    flops_f32=19.5e12,
    flops_bf16=312e12,
    memory_bytes=80e9,
    memory_bandwidth=2.0e12,
    intra_bandwidth=300e9,
    intra_latency=1e-6,
    inter_bandwidth=25e9,
    inter_latency=10e-6,
)

PRESETS: Mapping[str, Hardware] = MappingProxyType({A100_80GB.name: A100_80GB})
DEFAULT_HARDWARE = A100_80GB


def get_hardware(name_or_hw: str | Hardware | None) -> Hardware:
    """Looks up a preset by name (case-insensitive); passes a `Hardware` through."""
    if name_or_hw is None:
        return DEFAULT_HARDWARE
    if isinstance(name_or_hw, Hardware):
        return name_or_hw
    key = str(name_or_hw).lower()
    if key not in PRESETS:
        raise ValueError(f"unknown hardware {name_or_hw!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[key]
