"""Test set-up: 8 simulated CPU devices, configured before JAX initialises."""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


def skip_if_fewer_devices(n: int) -> None:
    """Skips the calling test when fewer than `n` devices are visible."""
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, found {len(jax.devices())}")


@pytest.fixture
def devices8():
    skip_if_fewer_devices(8)
    return jax.devices()[:8]
