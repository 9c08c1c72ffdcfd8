"""The --html report: self-contained, drawn correctly, and visibly non-blank in a real browser."""
from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import shutil
import subprocess

import pytest

from planner import cli
from planner.present.html_report import (
    communication_by_layer,
    layer_of,
    mesh_figure,
    pipeline_figure,
    render_html,
    schedule,
    simulate,
)
from planner.present.report import PlanView

# One worker runs the whole module, so its module-scoped fixtures are made once (`make test`: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_html")

_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _browser() -> str | None:
    return next((shutil.which(b) for b in _BROWSERS if shutil.which(b)), None)


@pytest.fixture(scope="session")
def chromium() -> str:
    """Path of a headless-capable Chromium. The README's setup (`make test`, target `browser`) installs
    the Debian package where it can; tests never install system packages themselves."""
    found = _browser()
    if not found:
        pytest.skip("no chromium on PATH: the page cannot be rendered here "
                    "(`make browser` installs it with apt-get where that is possible)")
    return found
    if shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed and apt-get is not available to install it")
    if os.geteuid() != 0:
        pytest.skip("chromium is not installed and installing it needs root (apt-get install -y chromium)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        proc = subprocess.run(["apt-get", "install", "-y", "chromium"], capture_output=True, text=True,
                              timeout=900, env=env)
        if proc.returncode != 0:
            subprocess.run(["apt-get", "update"], capture_output=True, timeout=300, env=env)
            proc = subprocess.run(["apt-get", "install", "-y", "chromium"], capture_output=True, text=True,
                                  timeout=900, env=env)
    except subprocess.TimeoutExpired:
        pytest.skip("installing chromium with apt-get timed out")
    found = _browser()
    if not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"chromium could not be installed (apt-get install -y chromium: {tail[0]})")
    return found


def _plan(tmp, *argv) -> tuple[PlanView, str]:
    path, page = tmp / "plan.json", tmp / "plan.html"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(["plan", "--quiet", "--json", str(path), "--html", str(page), *argv]) == 0
    return PlanView.load(str(path)), str(page)


@pytest.fixture(scope="module")
def cluster_plan(tmp_path_factory):
    return _plan(tmp_path_factory.mktemp("html"), "--model", "gpt-tiny", "--cluster", "2x4", "--mesh", "8")


def test_page_is_self_contained(cluster_plan):
    _, page = cluster_plan
    text = open(page).read()
    assert text.startswith("<!DOCTYPE html>")
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    assert len(images) == 4  # mesh, pipeline, memory, communication
    for data in images:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    assert not re.search(r'(src|href)="(https?:)?//', text)  # nothing fetched from a network
    for heading in ("Mesh and axis assignments", "Pipeline schedule", "Memory per device", "Communication per layer",
                    "Per-layer shardings", "Logical axis rules"):
        assert heading in text


def test_layers_of_collectives(cluster_plan):
    view, _ = cluster_plan
    assert layer_of("dot_general transpose(jvp(GPT))/blocks_3/mlp/fc_in") == "blocks_3"
    assert layer_of("add jvp(GPT)/ln_f") == "ln_f"
    assert layer_of("reduce_sum jvp()") == "(no module)"
    by_layer = communication_by_layer(view)
    assert sum(sum(v.values()) for v in by_layer.values()) > 0


def test_pipeline_schedules_have_the_textbook_length():
    for kind in ("1f1b", "gpipe"):
        tasks = simulate(schedule(4, 8, kind), [1.0] * 4)
        assert sum(len(row) for row in tasks) == 4 * 8 * 2
        assert max(end for row in tasks for *_, end in row) == pytest.approx((8 + 4 - 1) * 3.0)
    order = schedule(4, 8, "1f1b")
    assert order[0][:4] == [("F", 0), ("F", 1), ("F", 2), ("F", 3)]  # warm-up of the first stage
    assert order[3][:2] == [("F", 0), ("B", 0)]  # the last stage alternates at once


def test_pipeline_figure_draws_stages(cluster_plan):
    view, _ = cluster_plan
    data = json.loads(json.dumps(view.data))
    data["stages"] = [{"layers": ["blocks_0"], "submesh": [1, 4], "mesh": {"x": 4}},
                      {"layers": ["blocks_1"], "submesh": [1, 4], "mesh": {"x": 4}}]
    data["options"]["num_microbatches"] = 4
    staged = PlanView.from_dict(data)
    fig = pipeline_figure(staged)
    assert "2 stages x 4 microbatches" in fig.axes[0].get_title()
    assert len(fig.axes[0].patches) == 2 * 4 * 2
    assert "crosses hosts" in "".join(t.get_text() for t in mesh_figure(view).axes[0].texts)
    assert "<img" in render_html(staged)


def _screenshot(browser: str, page: str, tmp) -> str:
    png = str(tmp / "shot.png")
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp / 'profile'}", f"--screenshot={png}", "--window-size=1200,1600",
           "file://" + os.path.abspath(page)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert os.path.exists(png), f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr[-500:]}"
    return png


def test_page_renders_non_blank_in_chromium(chromium, cluster_plan, tmp_path):
    import matplotlib.image
    import numpy as np

    _, page = cluster_plan
    img = matplotlib.image.imread(_screenshot(chromium, page, tmp_path))
    assert img.shape[:2] == (1600, 1200)
    rgb = img[..., :3]
    non_white = float(np.mean(np.any(rgb < 0.94, axis=-1)))
    colours = len(np.unique((rgb * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    assert non_white > 0.05, f"screenshot is almost blank ({non_white:.1%} non-white pixels)"
    assert colours > 50, f"screenshot has only {colours} distinct colours"
    # the mesh diagram's device boxes (host colours) are on screen
    blue = np.mean(np.all(np.abs(rgb - np.array([0x4C, 0x72, 0xB0]) / 255) < 0.03, axis=-1))
    assert blue > 0.002
