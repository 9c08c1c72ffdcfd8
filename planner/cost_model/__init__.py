"""Cost model: hardware figures, cluster layout, collective times per mesh axis (analytic or profiled),
resharding and compute costs."""
from planner.cost_model.cluster import Cluster, Link
from planner.cost_model.collectives import COLLECTIVES, AxisLink, ring_bytes
from planner.cost_model.fit import Curve, Fit, fit_alpha_beta
from planner.cost_model.hardware import (
    DEFAULT_HARDWARE,
    PRESETS,
    Hardware,
    get_hardware,
    hardware_for_device_kind,
    hardware_with_links,
    peak_flops,
    xla_flags,
)
from planner.cost_model.model import CostModel, profiled_hardware
from planner.cost_model.profile_db import ProfileDB, ProfileWarning, load_profile

__all__ = [
    "COLLECTIVES", "AxisLink", "Cluster", "CostModel", "Curve", "DEFAULT_HARDWARE", "Fit", "Hardware", "Link",
    "PRESETS", "ProfileDB", "ProfileWarning", "fit_alpha_beta", "get_hardware", "hardware_for_device_kind",
    "hardware_with_links",
    "load_profile", "peak_flops", "profiled_hardware", "ring_bytes", "xla_flags",
]
