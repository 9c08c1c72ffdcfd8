"""Cost model: hardware figures, collective times per mesh axis, resharding and compute costs."""
from planner.cost_model.collectives import COLLECTIVES, AxisLink, ring_bytes
from planner.cost_model.hardware import DEFAULT_HARDWARE, PRESETS, Hardware, get_hardware
from planner.cost_model.model import CostModel

__all__ = ["COLLECTIVES", "AxisLink", "CostModel", "DEFAULT_HARDWARE", "Hardware", "PRESETS", "get_hardware", "ring_bytes"]
