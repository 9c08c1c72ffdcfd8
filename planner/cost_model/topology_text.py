"""The texts that describe a topology, recognised without building one (`cost_model.topology` builds
it; `hardware.get_hardware` reads the preset such a text names)."""
from __future__ import annotations

import json
import re

# Topology descriptions (`cost_model.topology`): "[SLICESx]GEN:AxBxC" TPU slices, "gb200-nvl72[:RACKS]",
# or the JSON of a topology's levels (with its "hardware").
TPU_SLICE_PATTERN = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(tpu-)?(v4|v5p|v5e|v6e)\s*:\s*(\d+(?:\s*x\s*\d+){1,2})\s*$",
                               re.IGNORECASE)
NVL72_PATTERN = re.compile(r"^\s*gb200-nvl72(?:\s*:\s*(\d+))?\s*$", re.IGNORECASE)


def is_topology(text: object) -> bool:
    """Whether `text` names a topology (`v5p:8x8x8`, `2xv5p:8x8x8`, `gb200-nvl72:2`, or the JSON of
    its levels, `topology.levels_text`)."""
    if not isinstance(text, str):
        return False
    if text.lstrip().startswith("{"):
        return '"levels"' in text
    return TPU_SLICE_PATTERN.match(text) is not None or NVL72_PATTERN.match(text) is not None


def topology_preset(text: str) -> str | None:
    """The hardware preset a topology description names (None: not one, or a levels JSON naming
    none, which means the default hardware)."""
    if not is_topology(text):
        return None
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text).get("hardware")  # None: the default hardware
        except (json.JSONDecodeError, AttributeError):
            return None
    m = TPU_SLICE_PATTERN.match(text)
    return f"tpu-{m.group(3).lower()}" if m else "gb200"
