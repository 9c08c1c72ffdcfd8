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


# The longest tests start first, so that two workers do not end on one long test each.
_FIRST = ("test_multihost.py", "test_zoo_numerics.py", "test_pipeline_runtime.py", "test_large_models.py",
          "test_stages_planning.py", "test_numerics.py", "test_memory.py")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return _FIRST.index(name) if name in _FIRST else len(_FIRST)

    items.sort(key=rank)  # stable: order within a file is kept
