"""Test set-up: 8 simulated CPU devices, configured before JAX initialises."""
from __future__ import annotations

import os
import shutil
import tempfile

# One compilation cache per test run, shared by the xdist workers and the CLI / multi-process
# tests they start (through the environment): the suite compiles the same programs (the unsharded
# reference steps of the zoo models, the same plans in different tests) many times, and XLA:CPU takes
# seconds per transformer step. Each run starts empty, so nothing carries over between runs.
# Made by the first process (the xdist controller, whose environment the workers inherit), removed by it
# at the end; a directory the caller set is used and kept.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="planner-tests-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

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


@pytest.fixture
def mesh_2x4(devices8):
    """A jax mesh of 8 devices, 2x4, axes ("x", "y"), both Auto."""
    return jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def gpt_tiny():
    """The zoo's gpt-tiny: bundle, optimizer, state, batch and its unsharded first step (`ReferenceStep`)."""
    from tests.helpers import reference_step  # here: tests that need no planner collect while it does not import

    return reference_step("gpt-tiny")


# The longest tests start first, so that two workers do not end on one long test each.
_FIRST = ("test_multihost.py", "test_zoo_numerics.py", "test_pipeline_runtime.py", "test_large_models.py",
          "test_stages_planning.py", "test_numerics.py", "test_memory.py")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:  # the process that made it: the controller, after every worker is done
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return _FIRST.index(name) if name in _FIRST else len(_FIRST)

    items.sort(key=rank)  # stable: order within a file is kept
