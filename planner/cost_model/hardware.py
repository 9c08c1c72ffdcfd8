"""Hardware figures the analytic cost model starts from, as data.

Each preset gives per-device peaks (datasheet numbers, dense, no sparsity) and the links a device
uses: `intra_*` inside a host / NVLink domain / ICI slice, `inter_*` between hosts (InfiniBand or
data-center network), both as one direction of the per-device share. Latencies are not datasheet
figures: they are the order of magnitude of small-message collective latency reported by NCCL-tests
and Cloud TPU benchmarks (a few microseconds on NVLink / ICI, ~10 us across InfiniBand, ~30 us
across DCN); a profile database (`planner profile`) replaces them with measured values.

The default is an A100-80GB-class GPU node, a common, well-documented target.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from planner.core.errors import InvalidArgumentError
from planner.core.units import parse_link
from planner.cost_model.topology_text import is_topology, topology_preset

_NUMERIC = ("flops_f32", "flops_bf16", "memory_bytes", "memory_bandwidth", "intra_bandwidth", "intra_latency",
            "inter_bandwidth", "inter_latency")


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
      devices_per_host: devices one host (node, TPU VM) usually holds; the cluster default.
      device_kind: regular expression matching `jax.Device.device_kind` of this hardware
        (case-insensitive, searched); empty for hardware JAX cannot name.
      kernel_launch_s: the least time one kernel (a dot, a convolution) takes however small its
        work: launch and scheduling cost between kernels of one compiled program (`CostModel.
        compute_time`); `planner profile` measures it (`measurements.measure_kernel_launch`).
      default_dtype: the compute dtype people train with on this hardware (mixed precision: 16-bit
        compute, float32 master parameters and optimizer state); `planner plan --dtype` defaults to it.
      platform: "gpu", "tpu" or "cpu": which XLA flags a plan assumes (`xla_flags`); XLA:CPU runs
        collectives synchronously, so nothing overlaps there.
      matmul_efficiency: the fraction of the peak that large matmuls reach (the best measured
        rate over many GEMM shapes divided by the datasheet peak); contractions run at
        `peak x matmul_efficiency` where no curve of their dtype class exists (`matmul_rate`);
        1.0 only for a profile's measured peak, which is an achieved rate already.
      matmul_curve: achieved matmul rates by size, `((dtype class, ((flops per kernel, FLOP/s),
        ...)), ...)` with dtype class "16bit" or "float32" and points sorted by FLOPs: a preset's
        cited 16-bit curve (see `rates_source`), or a profile's measured sweep.
      attention_curve: measured rates of batched narrow GEMMs, the shapes of attention's two
        matmuls (`[g, s, d] x [g, s, d] -> [g, s, s]` and `[g, s, s] x [g, s, d] -> [g, s, d]`, head
        dimension d): `((dtype class, d, ((flops per kernel, FLOP/s), ...)), ...)`, points sorted
        by FLOPs. A batched contraction whose narrowest dimension is at most `NARROW_GEMM_DIM` runs
        at the curve of the nearest measured d (`matmul_rate`); empty for presets and for profiles
        made before `planner profile` swept these shapes (the square curve then applies).
      host_bandwidth: one direction of one device's link to its host's memory (bytes/s): what
        host offload (`planner.ilp.offload`) moves optimizer state over (PCIe, NVLink-C2C); None where
        no figure is known, which makes host offload unavailable on that hardware.
      host_memory_bytes: memory of one host (node) of `devices_per_host` devices, where plans keep
        offloaded values (optimizer state, master parameters, activations), `host_memory_per_device`
        each; None where no figure is known (host-kept bytes are then not checked).
      memory_efficiency: the fraction of `memory_bandwidth` that streaming kernels reach; memory-bound
        work runs at `achieved_bandwidth` (1.0 where `memory_bandwidth` is itself a measured rate).
      rates_source: where the achieved compute and memory rates come from, in one line (a preset's
        cited measurement, a stand-in labelled as such, or a profile); printed with every plan.
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
    devices_per_host: int = 8
    device_kind: str = ""
    kernel_launch_s: float = 0.0
    default_dtype: str = "bfloat16"
    platform: str = "gpu"
    matmul_efficiency: float = 1.0
    matmul_curve: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    attention_curve: tuple[tuple[str, int, tuple[tuple[float, float], ...]], ...] = ()
    host_bandwidth: float | None = None
    memory_efficiency: float = 1.0
    rates_source: str = ""
    host_memory_bytes: float | None = None

    @property
    def host_memory_per_device(self) -> float:
        """The host's memory shared evenly between its devices (infinite where it is not known)."""
        return math.inf if self.host_memory_bytes is None else self.host_memory_bytes / self.devices_per_host

    @property
    def achieved_bandwidth(self) -> float:
        """Bytes/s memory-bound work streams at: the datasheet figure times `memory_efficiency`."""
        return self.memory_bandwidth * self.memory_efficiency

    def __post_init__(self):
        for name in _NUMERIC:
            v = getattr(self, name)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"hardware {self.name}: {name}={v!r} must be a positive number")
        v = self.kernel_launch_s
        if isinstance(v, bool) or not (isinstance(v, (int, float)) and v >= 0):
            raise ValueError(f"hardware {self.name}: kernel_launch_s={v!r} must be a number >= 0")
        if self.platform not in ("gpu", "tpu", "cpu"):
            raise ValueError(f"hardware {self.name}: platform={self.platform!r} must be gpu, tpu or cpu")
        if self.default_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"hardware {self.name}: default_dtype={self.default_dtype!r} must be float32, bfloat16 "
                             "or float16")
        for field in ("matmul_efficiency", "memory_efficiency"):
            e = getattr(self, field)
            if isinstance(e, bool) or not (isinstance(e, (int, float)) and 0 < e <= 1):
                raise ValueError(f"hardware {self.name}: {field}={e!r} must be in (0, 1]")
        curves = [("matmul_curve", cls, points) for cls, points in self.matmul_curve]
        for cls, d, points in self.attention_curve:
            if isinstance(d, bool) or not (isinstance(d, int) and d > 0):
                raise ValueError(f"hardware {self.name}: attention_curve[{cls!r}] head dimension {d!r} must be an "
                                 "int > 0")
            curves.append(("attention_curve", cls, points))
        for field, cls, points in curves:
            if cls not in ("16bit", "float32") or not points or any(
                    not (f > 0 and r > 0) for f, r in points) or list(points) != sorted(points):
                raise ValueError(f"hardware {self.name}: {field}[{cls!r}] must be FLOPs-sorted positive "
                                 "(flops, FLOP/s) points of class '16bit' or 'float32'")
        for name in ("host_bandwidth", "host_memory_bytes"):
            h = getattr(self, name)
            if h is not None and (isinstance(h, bool) or not (isinstance(h, (int, float)) and h > 0)):
                raise ValueError(f"hardware {self.name}: {name}={h!r} must be a positive number or None")
        if not (isinstance(self.devices_per_host, int) and self.devices_per_host >= 1):
            raise ValueError(f"hardware {self.name}: devices_per_host={self.devices_per_host!r} must be an int >= 1")

    def matches_device_kind(self, kind: str) -> bool:
        """Whether a `jax.Device.device_kind` string names this hardware."""
        return bool(self.device_kind) and re.search(self.device_kind, kind, re.IGNORECASE) is not None


_GB = 1e9
_TB = 1e12
_GIB = 2.0**30

# Kernel launch floor of the GPU presets. NVIDIA Technical Blog, "Getting Started with CUDA Graphs"
# (A. Gray, 2019, developer.nvidia.com/blog/cuda-graphs): a short kernel (2.9 us of work) issued
# back to back from one stream on a V100 takes about 3.8 us per kernel, the launch cost of a few
# microseconds setting the pace of small kernels. Hopper and Ampere launch at the same order.
_CUDA_KERNEL_LAUNCH_S = 3.8e-6

# Achieved rates. No preset prices work at its datasheet peak: every one carries an achieved 16-bit
# matmul curve by GEMM size (`Hardware.matmul_curve`), an achieved fraction for other contractions
# (`matmul_efficiency`: float32 ones) and an achieved fraction of HBM bandwidth (`memory_efficiency`).
#
# Measured sweeps (`planner profile`, square bf16 GEMMs of n = 128 .. 8192 timed inside one program, the
# difference between k = 1 and k = 9 dependent copies, experiments/results/profile_h100.json and
# profile_h200.json, jax 0.11.2): one H100 SXM 80GB HBM3 (2026-11-26) and one H200 (2026-11-26),
# (n, FLOP/s) below. Streaming bandwidth in the same runs: H100 2.783 TB/s of the datasheet's 3.35
# (83.1%), H200 3.994 of 4.8 (83.2%).
_H100_BF16_SWEEP = ((128, 1.2e12), (256, 10.7e12), (512, 46.5e12), (1024, 243.3e12), (2048, 622.4e12),
                    (4096, 737.6e12), (8192, 813.1e12))
_H200_BF16_SWEEP = ((128, 1.5e12), (256, 10.6e12), (512, 41.5e12), (1024, 255.2e12), (2048, 626.0e12),
                    (4096, 757.2e12))
_HOPPER_MEMORY_EFFICIENCY = 2.783 / 3.35  # the H100's measured share; the H200's is the same to 0.1%

# Large-GEMM plateaus (`matmul_efficiency`, used for float32 contractions): S. Bekman, "Machine Learning
# Engineering Open Book", compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison
# table" (github.com/stas00/ml-engineering; BF16 `torch.matmul`, best of a brute-force shape search,
# CUDA 12.1-12.5): A100 SXM 267.9 of 312 TFLOP/s (85.9%), H100 SXM 792.1 of 989 (80.1%), GH200 SXM
# 821.0 of 989 (83.0%).
_MAMF_A100 = 267.9 / 312
_MAMF_H100 = 792.1 / 989
_MAMF_GH200 = 821.0 / 989


def _sweep_curve(sweep: tuple[tuple[int, float], ...], peak_ratio: float = 1.0) -> tuple:
    """A square-GEMM sweep (n, FLOP/s) as a 16-bit `matmul_curve` (2 n^3 FLOPs per kernel).

    For other hardware (the stand-in where no sweep is published), the sweep is scaled by the ratio of
    the datasheet peaks `peak_ratio` in rate *and* in FLOPs: each measured kernel time holds for
    `peak_ratio` times its work, so a slower device reaches the same fraction of its peak at
    proportionally smaller GEMMs (what fixed per-kernel costs, launch and the last wave of tiles,
    make of a small GEMM)."""
    return (("16bit", tuple((2.0 * n ** 3 * peak_ratio, r * peak_ratio) for n, r in sweep)),)


_STAND_IN = ("no published GEMM sweep or bandwidth measurement: the H100 sweep scaled by the datasheet "
             "peak ratio (rates and sizes), and the H100's measured 83% of HBM bandwidth (a stand-in; "
             "`planner profile` on the device replaces it)")

# Host links (`Hardware.host_bandwidth`, one direction per device). PCI-SIG base specifications: a
# x16 link moves 16 GT/s per lane at 128b/130b encoding in PCIe 4.0 (31.5 GB/s per direction), 32
# GT/s in PCIe 5.0 (63 GB/s), 8 GT/s in PCIe 3.0 (15.75 GB/s). The NVIDIA datasheets give the same
# as bidirectional totals: A100 "PCIe Gen4: 64 GB/s", H100 SXM and H200 SXM "PCIe Gen5: 128 GB/s",
# V100 SXM2 "PCIe 32 GB/s" (Gen3). (A GH200 superchip's NVLink-C2C would give 450 GB/s per
# direction, 900 GB/s bidirectional by its datasheet; no preset here.)
_PCIE3_X16 = 15.75 * 1e9
_PCIE4_X16 = 31.5 * 1e9
_PCIE5_X16 = 63.0 * 1e9

# NVIDIA H100 SXM5 80GB datasheet: FP32 67 TFLOP/s, BF16 989 TFLOP/s dense (1979 with sparsity),
# 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s bidirectional (450 GB/s per direction).
# DGX H100 (its datasheet): 8 GPUs, 8x ConnectX-7 400 Gb/s NDR (50 GB/s per GPU), 2 TB system memory.
H100_SXM = Hardware("h100-sxm", flops_f32=67e12, flops_bf16=989e12, memory_bytes=80 * _GB,
                    memory_bandwidth=3.35e12, intra_bandwidth=450 * _GB, intra_latency=2e-6,
                    inter_bandwidth=50 * _GB, inter_latency=10e-6, devices_per_host=8, device_kind=r"h100", kernel_launch_s=_CUDA_KERNEL_LAUNCH_S,
                    matmul_efficiency=_MAMF_H100, host_bandwidth=_PCIE5_X16, host_memory_bytes=2 * _TB,
                    matmul_curve=_sweep_curve(_H100_BF16_SWEEP), memory_efficiency=_HOPPER_MEMORY_EFFICIENCY,
                    rates_source="measured on an H100 SXM (planner profile: bf16 GEMM sweep, 83% of HBM bandwidth); "
                                 "float32 GEMMs at Bekman's MAMF plateau")

# NVIDIA H200 SXM datasheet: same Hopper compute as H100 SXM (FP32 67, BF16 989 TFLOP/s dense),
# 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s bidirectional; DGX H200 datasheet: 8x CX-7 400 Gb/s, 2 TB RAM.
H200 = Hardware("h200", flops_f32=67e12, flops_bf16=989e12, memory_bytes=141 * _GB, memory_bandwidth=4.8e12,
                intra_bandwidth=450 * _GB, intra_latency=2e-6, inter_bandwidth=50 * _GB, inter_latency=10e-6,
                devices_per_host=8, device_kind=r"h200", kernel_launch_s=_CUDA_KERNEL_LAUNCH_S,
                matmul_efficiency=_MAMF_GH200, host_bandwidth=_PCIE5_X16, host_memory_bytes=2 * _TB,  # GH200: the same H200-class Hopper die
                matmul_curve=_sweep_curve(_H200_BF16_SWEEP), memory_efficiency=3.994 / 4.8,
                rates_source="measured on an H200 (planner profile: bf16 GEMM sweep, 83% of HBM bandwidth); "
                             "float32 GEMMs at Bekman's GH200 MAMF plateau")

# A100: Bekman's table measures its large-GEMM plateau (267.9 TFLOP/s); no sweep by size is published
# with its method, so 16-bit GEMMs run at that plateau at every size above the launch floor (as float32
# ones at its fraction). The H100 sweep scaled to the A100 (by the peak ratio, or levelled onto the
# plateau) was tried as the size curve: it put Megatron-LM's SC21 rows 5-10% further below their
# measured throughput (experiments/results/published.md), so the plateau stays. HBM at the H100's
# measured 83% (a stand-in).
_A100_SOURCE = ("GEMMs at Bekman's measured A100 plateau (85.9% of peak; no published sweep by size), the launch "
                "floor below; HBM at the H100's measured 83% (a stand-in)")

# NVIDIA A100 datasheet (SXM4 40GB): FP32 19.5 TFLOP/s, BF16 312 TFLOP/s dense, 40 GB HBM2 at
# 1,555 GB/s, NVLink 3 600 GB/s bidirectional (300 per direction). DGX A100: 8x 200 Gb/s HDR
# InfiniBand for compute traffic, i.e. 25 GB/s per GPU. System memory (NVIDIA DGX A100 datasheet): 1 TB
# in the DGX A100 320GB (40 GB GPUs), 2 TB in the DGX A100 640GB (80 GB GPUs).
A100_40GB = Hardware("a100-40gb", flops_f32=19.5e12, flops_bf16=312e12, memory_bytes=40 * _GB,
                     memory_bandwidth=1.555e12, intra_bandwidth=300 * _GB, intra_latency=2e-6,
                     inter_bandwidth=25 * _GB, inter_latency=10e-6, devices_per_host=8,
                     device_kind=r"a100.*40\s*gb", kernel_launch_s=_CUDA_KERNEL_LAUNCH_S,
                     matmul_efficiency=_MAMF_A100, host_bandwidth=_PCIE4_X16, host_memory_bytes=1 * _TB,
                     memory_efficiency=_HOPPER_MEMORY_EFFICIENCY,
                     rates_source=_A100_SOURCE)

# NVIDIA A100 datasheet (SXM4 80GB): as the 40 GB part but 80 GB HBM2e at 2,039 GB/s.
A100_80GB = Hardware("a100-80gb", flops_f32=19.5e12, flops_bf16=312e12, memory_bytes=80 * _GB,
                     memory_bandwidth=2.039e12, intra_bandwidth=300 * _GB, intra_latency=2e-6,
                     inter_bandwidth=25 * _GB, inter_latency=10e-6, devices_per_host=8,
                     device_kind=r"a100.*80\s*gb", kernel_launch_s=_CUDA_KERNEL_LAUNCH_S,
                     matmul_efficiency=_MAMF_A100, host_bandwidth=_PCIE4_X16, host_memory_bytes=2 * _TB,
                     memory_efficiency=_HOPPER_MEMORY_EFFICIENCY,
                     rates_source=_A100_SOURCE)

# NVIDIA V100 datasheet (SXM2 16GB): FP32 15.7 TFLOP/s; no bfloat16, so the 16-bit figure is the
# FP16 tensor-core peak of 125 TFLOP/s; 16 GB HBM2 at 900 GB/s; NVLink 2 300 GB/s bidirectional
# (150 per direction). DGX-1: 4x 100 Gb/s EDR InfiniBand for 8 GPUs, i.e. 6.25 GB/s per GPU; system
# memory 512 GB (NVIDIA DGX-1 with Tesla V100 datasheet; AWS's p3.16xlarge, Alpa's testbed, 488 GiB).
V100_16GB = Hardware("v100-16gb", flops_f32=15.7e12, flops_bf16=125e12, memory_bytes=16 * _GB,
                     memory_bandwidth=900 * _GB, intra_bandwidth=150 * _GB, intra_latency=3e-6,
                     inter_bandwidth=6.25 * _GB, inter_latency=10e-6, devices_per_host=8, device_kind=r"v100",
                     kernel_launch_s=_CUDA_KERNEL_LAUNCH_S, default_dtype="float16", host_bandwidth=_PCIE3_X16,
                     host_memory_bytes=512 * _GB,
                     matmul_curve=_sweep_curve(_H100_BF16_SWEEP, 125 / 989), matmul_efficiency=_MAMF_H100,
                     memory_efficiency=_HOPPER_MEMORY_EFFICIENCY, rates_source=_STAND_IN)

# TPU presets. A TPU program runs its ops from one on-chip instruction stream with no per-kernel
# host launch; no published per-op floor is known, so none is modelled (kernel_launch_s = 0) unless
# a profile measures one. No TPU preset has a host link figure (none is published per chip in the
# Cloud TPU system-architecture pages), so host offload is unavailable on them until one is given
# (`dataclasses.replace(preset, host_bandwidth=...)`). JAX's default matmul precision runs float32 matmuls as one bfloat16 MXU pass on
# TPU, so the float32 peak is the bfloat16 peak. A mesh axis maps to one torus dimension, whose
# ring uses two ICI links per chip (one each way round), so `intra_bandwidth` is two links' worth
# of one direction. Hosts (TPU VMs) hold 4 chips (v4, v5p) or 8 (v5e).
#
# Cloud TPU v4 docs: 275 TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s, 3D torus of 6 ICI links per chip;
# the TPU v4 paper (Jouppi et al., ISCA 2023) gives ~50 GB/s per link per direction. The docs give no
# per-chip DCN figure for v4; assumed equal to v5p's 50 Gb/s per chip.
TPU_V4 = Hardware("tpu-v4", flops_f32=275e12, flops_bf16=275e12, memory_bytes=32 * _GIB,
                  memory_bandwidth=1.2e12, intra_bandwidth=100 * _GB, intra_latency=5e-6,
                  inter_bandwidth=6.25 * _GB, inter_latency=30e-6, devices_per_host=4, device_kind=r"^tpu v4",
                  platform="tpu", matmul_curve=_sweep_curve(_H100_BF16_SWEEP, 275 / 989), matmul_efficiency=_MAMF_H100,
                  memory_efficiency=_HOPPER_MEMORY_EFFICIENCY, rates_source=_STAND_IN)

# Cloud TPU v5e docs: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, ICI 1,600 Gb/s per chip over 4
# ports of a 2D torus (50 GB/s per port per direction), 8 chips per host with 2x 100 Gb/s NICs
# (25 GB/s per host, 3.125 GB/s per chip).
TPU_V5E = Hardware("tpu-v5e", flops_f32=197e12, flops_bf16=197e12, memory_bytes=16 * _GB,
                   memory_bandwidth=819 * _GB, intra_bandwidth=100 * _GB, intra_latency=5e-6,
                   inter_bandwidth=3.125 * _GB, inter_latency=30e-6, devices_per_host=8,
                   device_kind=r"^tpu v5 ?(lite|e)", platform="tpu",
                   matmul_curve=_sweep_curve(_H100_BF16_SWEEP, 197 / 989), matmul_efficiency=_MAMF_H100,
                   memory_efficiency=_HOPPER_MEMORY_EFFICIENCY, rates_source=_STAND_IN)

# Cloud TPU v5p docs: 459 TFLOP/s bf16, 95 GB HBM2e at 2,765 GB/s, ICI 4,800 Gb/s (1,200 GB/s
# bidirectional) per chip over 6 ports of a 3D torus (100 GB/s per port per direction), DCN 50 Gb/s
# per chip (6.25 GB/s), 4 chips per host.
TPU_V5P = Hardware("tpu-v5p", flops_f32=459e12, flops_bf16=459e12, memory_bytes=95 * _GB,
                   memory_bandwidth=2.765e12, intra_bandwidth=200 * _GB, intra_latency=5e-6,
                   inter_bandwidth=6.25 * _GB, inter_latency=30e-6, devices_per_host=4,
                   device_kind=r"^tpu v5p?$", platform="tpu",
                   matmul_curve=_sweep_curve(_H100_BF16_SWEEP, 459 / 989), matmul_efficiency=_MAMF_H100,
                   memory_efficiency=_HOPPER_MEMORY_EFFICIENCY, rates_source=_STAND_IN)

# Cloud TPU v6e (Trillium) docs, "System architecture": 918 TFLOP/s bf16, 32 GB HBM at 1,638 GB/s,
# bidirectional ICI 800 GB/s per chip over 4 ports of a 2D torus (100 GB/s per port per direction),
# 8 chips per host, 256-chip pods (16x16). The page gives no per-host NIC figure; the DCN link is
# assumed equal to v5e's 2 x 100 Gb/s per 8-chip host (3.125 GB/s per chip), an assumption stated
# here until a multislice profile (`planner profile`) measures it. As for the other TPU presets,
# `intra_bandwidth` is one torus dimension's ring (two ports' worth of one direction); a
# topology (`v6e:16x16`, `cost_model.topology`) prices each axis by the torus dimensions it spans.
TPU_V6E = Hardware("tpu-v6e", flops_f32=918e12, flops_bf16=918e12, memory_bytes=32 * _GB,
                   memory_bandwidth=1.638e12, intra_bandwidth=200 * _GB, intra_latency=5e-6,
                   inter_bandwidth=3.125 * _GB, inter_latency=30e-6, devices_per_host=8,
                   device_kind=r"^tpu v6", platform="tpu",
                   matmul_curve=_sweep_curve(_H100_BF16_SWEEP, 918 / 989), matmul_efficiency=_MAMF_H100,
                   memory_efficiency=_HOPPER_MEMORY_EFFICIENCY, rates_source=_STAND_IN)

# Blackwell. NVIDIA Blackwell architecture technical brief, as tabulated by G. Lockwood
# (glennklockwood.com/garden/processors/B200): HGX B200 at 1,000 W: FP32 80 TFLOP/s, BF16 2,250
# TFLOP/s dense; the GB200 part at 1,200 W: FP32 90, BF16 2,500 dense; HBM3e at 8 TB/s. Memory: DGX
# B200 datasheet 1,440 GB for 8 GPUs (180 GB each); GB200 NVL72 datasheet 13.4 TB for 72 GPUs (186
# GB each, as MLPerf's GB200 system descriptions list it). NVLink 5: 1.8 TB/s bidirectional per GPU
# (900 GB/s per direction) to every GPU of the NVLink domain, through NVLink switches: 8 GPUs in
# an HGX B200, 72 across the 18 compute trays of a GB200 NVL72 (4 GPUs per tray). Between domains:
# DGX B200 8x ConnectX-7 400 Gb/s, and a GB200 compute tray 4x ConnectX-7 for its 4 GPUs (MLPerf
# Inference v6.1, Crusoe GB200-NVL72 system description): 50 GB/s per GPU either way. Host links:
# HGX B200 hosts are PCIe Gen5 x16 (63 GB/s per direction); a GB200 superchip joins one Grace CPU to
# its two GPUs by NVLink-C2C, 900 GB/s bidirectional (GB200 datasheet), 225 GB/s per GPU per
# direction. Host memory: DGX B200 datasheet 2 TB (configurable to 4 TB); a GB200 NVL72 compute tray's
# two Grace CPUs hold up to 480 GB of LPDDR5X each (GB200 NVL72 datasheet: up to 17 TB for 36 Grace
# CPUs), 960 GB for its 4 GPUs. No GEMM sweep of Blackwell is published with the H100 sweep's method: the H100 sweep
# scaled by the peak ratio stands in (`_STAND_IN`).
B200 = Hardware("b200", flops_f32=80e12, flops_bf16=2250e12, memory_bytes=180 * _GB, memory_bandwidth=8e12,
                intra_bandwidth=900 * _GB, intra_latency=2e-6, inter_bandwidth=50 * _GB, inter_latency=10e-6,
                devices_per_host=8, device_kind=r"^nvidia b200", kernel_launch_s=_CUDA_KERNEL_LAUNCH_S,
                matmul_efficiency=_MAMF_H100, host_bandwidth=_PCIE5_X16, host_memory_bytes=2 * _TB,
                matmul_curve=_sweep_curve(_H100_BF16_SWEEP, 2250 / 989), memory_efficiency=_HOPPER_MEMORY_EFFICIENCY,
                rates_source=_STAND_IN)
GB200 = Hardware("gb200", flops_f32=90e12, flops_bf16=2500e12, memory_bytes=186 * _GB, memory_bandwidth=8e12,
                 intra_bandwidth=900 * _GB, intra_latency=2e-6, inter_bandwidth=50 * _GB, inter_latency=10e-6,
                 devices_per_host=4, device_kind=r"gb200", kernel_launch_s=_CUDA_KERNEL_LAUNCH_S,
                 matmul_efficiency=_MAMF_H100, host_bandwidth=225 * _GB, host_memory_bytes=960 * _GB,
                 matmul_curve=_sweep_curve(_H100_BF16_SWEEP, 2500 / 989), memory_efficiency=_HOPPER_MEMORY_EFFICIENCY,
                 rates_source=_STAND_IN)

# This development machine: a 2-vCPU AMD EPYC (Zen 5, AVX-512, 2.6 GHz; `lscpu`) split into 8 XLA
# host devices (`--xla_force_host_platform_device_count=8`), so each device gets 1/8 of the host.
# Peak: 2 cores x 2.6 GHz x 64 f32 FLOP/cycle (two 512-bit FMA pipes) / 8 = 41.6 GFLOP/s per device
# (`planner profile` measures ~34: the achieved fraction); XLA:CPU runs bfloat16 dots in float32, hence the
# same 16-bit peak.
# There is no datasheet for a shared cloud VM: memory and link figures are the fits `planner profile`
# measured here (experiments/bench_collectives.py): ~5.6 GB/s streaming per device; in-process
# collectives ~10 us per ring step and ~3 GB/s; across 2 processes (gloo over loopback TCP, the
# "inter-host" link) ~500 us per step and ~0.5 GB/s. Kernel launch floor: 3.7-5.1 us per dot in
# three runs of `measurements.measure_kernel_launch` (8 devices). Users of XLA:CPU train in float32
# (it runs bfloat16 dots in float32 anyway). Host offload: XLA:CPU's "pinned_host" memory is the same
# DRAM, and a copy between two buffers streams at the measured per-device rate (5.6 GB/s); XLA:CPU in
# fact compiles no copy (a fusion reads a host-placed argument in place, tests/test_offload.py), so
# this prices the copy a GPU would make. No host memory figure: `memory_bytes` shares out the same DRAM.
CPU = Hardware("cpu", flops_f32=41.6e9, flops_bf16=41.6e9, memory_bytes=24 * _GB / 8,
               memory_bandwidth=5.6 * _GB, intra_bandwidth=3 * _GB, intra_latency=10e-6,
               inter_bandwidth=0.5 * _GB, inter_latency=500e-6, devices_per_host=8, device_kind=r"^cpu$",
               kernel_launch_s=4.5e-6, default_dtype="float32", platform="cpu", host_bandwidth=5.6 * _GB,
               matmul_efficiency=34 / 41.6,
               rates_source="measured on this development machine (planner profile: ~34 of 41.6 GFLOP/s per "
                            "device; the memory figure is the measured streaming rate)")

PRESETS: Mapping[str, Hardware] = MappingProxyType(
    {hw.name: hw for hw in (H100_SXM, H200, A100_40GB, A100_80GB, V100_16GB, TPU_V4, TPU_V5E, TPU_V5P, TPU_V6E, B200,
                            GB200, CPU)}
)
_ALIASES: Mapping[str, str] = MappingProxyType(
    {"h100": "h100-sxm", "a100": "a100-80gb", "v100": "v100-16gb", "v4": "tpu-v4", "v5e": "tpu-v5e",
     "v5p": "tpu-v5p", "v6e": "tpu-v6e",
     "trillium": "tpu-v6e"}
)
DEFAULT_HARDWARE = A100_80GB


# "HOSTSxDEVICES[:PRESET]", a cluster description (see `cluster.Cluster.parse`).
CLUSTER_PATTERN = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*(?::\s*([\w.-]+))?\s*$", re.IGNORECASE)


def get_hardware(name_or_hw: str | Hardware | None) -> Hardware:
    """Looks up a preset by name or alias (case-insensitive); passes a `Hardware` through.

    A cluster description such as "4x8:h100" (hosts x devices per host : preset) names its preset.
    """
    if name_or_hw is None:
        return DEFAULT_HARDWARE
    if isinstance(name_or_hw, Hardware):
        return name_or_hw
    m = CLUSTER_PATTERN.match(str(name_or_hw))
    if m:
        return get_hardware(m.group(3)) if m.group(3) else DEFAULT_HARDWARE
    if is_topology(name_or_hw):
        return get_hardware(topology_preset(str(name_or_hw)))
    key = str(name_or_hw).lower()
    key = _ALIASES.get(key, key)
    if key not in PRESETS:
        raise ValueError(f"unknown hardware {name_or_hw!r}; known presets: {', '.join(sorted(PRESETS))} "
                         "(or a cluster such as '4x8:h100' or 'v5p:8x8x8')")
    return PRESETS[key]


def _itemsize(dtype: Any) -> int | None:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        pass
    if isinstance(dtype, str):  # "bfloat16" and the float8 names, which JAX registers
        import jax.numpy as jnp

        try:
            return jnp.dtype(dtype).itemsize
        except TypeError:
            return None
    return None  # extended dtypes (PRNG keys) have no arithmetic rate


def peak_flops(hardware: Hardware | Mapping[str, float], dtypes: Iterable[Any]) -> float:
    """Peak FLOP/s of arithmetic on values of `dtypes`: the one rule every compute estimate uses
    (the ILP's strategies, hence the plan's prediction and stage costs, and the CLI's MFU).

    The 16-bit (tensor-core / MXU) peak applies when every value is 16 bits or narrower; one wider
    value means the float32 peak (XLA promotes mixed operands of a dot to the wider type before
    running it). For a dot or convolution the values are its *operands*: the accumulator type
    (`preferred_element_type=float32`) does not set the rate, a bf16 x bf16 -> f32 matmul runs on
    the bf16 tensor cores. For other ops they are the results. No known dtype means float32.

    Args:
      hardware: a `Hardware`, or a mapping with its "flops_f32" and "flops_bf16" figures.
      dtypes: numpy dtypes or dtype names ("bfloat16", "float32").
    """
    low = rate_class(dtypes) == "16bit"
    if isinstance(hardware, Mapping):
        return float(hardware["flops_bf16"] if low else hardware["flops_f32"])
    return hardware.flops_bf16 if low else hardware.flops_f32


def rate_class(dtypes: Iterable[Any]) -> str:
    """"16bit" when every value is 16 bits or narrower, else "float32" (the rule of `peak_flops`)."""
    sizes = [n for n in map(_itemsize, dtypes) if n is not None]
    return "16bit" if sizes and max(sizes) <= 2 else "float32"


# A batched contraction whose narrowest dimension (rows, columns or contracted length of one batch
# element) is at most this runs at the attention curve (`Hardware.attention_curve`): attention's head
# dimensions are 64-128, and a GEMM with so short a side reuses each loaded tile too little to run at
# the square GEMMs' rate.
NARROW_GEMM_DIM = 256


def matmul_rate(hardware: Hardware, dtypes: Iterable[Any], flops: float, narrow: int | None = None) -> float:
    """FLOP/s of one contraction (dot, convolution) of `flops` FLOPs on operands of `dtypes`.

    `narrow`: for a batched contraction, its narrowest dimension (`gemm_narrow_dim`); None otherwise.
    With a measured attention curve for the dtype class (`Hardware.attention_curve`) and `narrow`
    at most `NARROW_GEMM_DIM`: the curve of the measured head dimension nearest to `narrow` (in
    log scale). Otherwise, with a measured square-GEMM curve for the class (`Hardware.matmul_curve`):
    that curve. A curve's rate is interpolated linearly in log(FLOPs) between the measured points,
    held at the end points outside them (a measured small matmul's rate already includes its
    launch time). Without either: `peak_flops x matmul_efficiency`.
    """
    dtypes = tuple(dtypes)
    cls = rate_class(dtypes)
    curve = None
    if narrow is not None and narrow <= NARROW_GEMM_DIM:
        heads = [(d, points) for c, d, points in hardware.attention_curve if c == cls]
        if heads:
            curve = min(heads, key=lambda h: (abs(np.log2(h[0]) - np.log2(max(narrow, 1))), h[0]))[1]
    if curve is None:
        curve = dict(hardware.matmul_curve).get(cls)
    if not curve:
        return peak_flops(hardware, dtypes) * hardware.matmul_efficiency
    xs = np.log([f for f, _ in curve])
    ys = [r for _, r in curve]
    return float(np.interp(np.log(max(flops, 1.0)), xs, ys))


def hardware_for_device_kind(kind: str) -> Hardware | None:
    """The preset whose `device_kind` pattern matches a `jax.Device.device_kind`, if any."""
    for hw in PRESETS.values():
        if hw.matches_device_kind(kind):
            return hw
    return None


def hardware_with_links(hardware: str | Hardware | None, inter_host: Any = None, intra_host: Any = None,
                        devices_per_host: int | None = None) -> Hardware:
    """`hardware` with the links of a cluster as it is, instead of the preset's (a DGX network).

    Args:
      hardware: a preset name, cluster description or `Hardware`.
      inter_host: one host's network bandwidth, shared by its devices: bytes/s or a string with
        units ("25Gbit", "12.5GB/s"), optionally with a latency ("25Gbit,10us"). Alpa's testbed,
        8 V100 per host on 25 Gbit/s, gives each device 3.125 GB/s / 8 = 0.39 GB/s.
      intra_host: one device's link to the others of its host (one direction), same forms.
      devices_per_host: devices sharing the host's network (default: the hardware's).

    Raises:
      InvalidArgumentError: a value that is not a bandwidth (one line).
    """
    hw = get_hardware(hardware)
    per_host = devices_per_host or hw.devices_per_host
    changes: dict[str, float] = {}
    if inter_host is not None:
        bandwidth, latency = parse_link(inter_host, "inter_host")
        changes["inter_bandwidth"] = bandwidth / per_host
        if latency is not None:
            changes["inter_latency"] = latency
    if intra_host is not None:
        bandwidth, latency = parse_link(intra_host, "intra_host")
        changes["intra_bandwidth"] = bandwidth
        if latency is not None:
            changes["intra_latency"] = latency
    if not changes:
        return hw
    for name in ("inter_latency", "intra_latency"):
        if changes.get(name) == 0:
            raise InvalidArgumentError(f"{name.replace('_latency', '_host')} latency must be positive (every message "
                                       "pays some); write e.g. '25Gbit,10us'")
    return dataclasses.replace(hw, **changes)


def xla_flags(hardware: Hardware, overlap: bool, combine_threshold_bytes: int = 0) -> tuple[str, ...]:
    """The XLA flags under which a prediction with overlapped gradient reductions holds.

    GPU: the latency-hiding scheduler (runs collectives asynchronously beside independent compute)
    and collective combiner thresholds of `combine_threshold_bytes` (the largest gradient reduction
    of the plan), so gradients are combined per layer and issued as each layer's backward ends,
    not all at the end of the step. TPU: the same scheduler (XLA:TPU combines on its own; the flag
    goes in LIBTPU_INIT_ARGS). XLA:CPU runs collectives synchronously: no flags, and nothing is
    predicted to overlap. Flag names: XLA's debug options (xla/debug_options_flags.cc).
    """
    if not overlap or hardware.platform == "cpu":
        return ()
    if hardware.platform == "tpu":
        return ("--xla_tpu_enable_latency_hiding_scheduler=true",)
    flags = ["--xla_gpu_enable_latency_hiding_scheduler=true"]
    if combine_threshold_bytes > 0:
        flags += [f"--xla_gpu_{kind}_combine_threshold_bytes={int(combine_threshold_bytes)}"
                  for kind in ("all_reduce", "reduce_scatter", "all_gather")]
    return tuple(flags)
