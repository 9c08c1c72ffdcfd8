"""experiments/bench_suite.py (the plan beside every named baseline): which configurations it runs where,
and how its goal summary counts them (synthetic rows: nothing is planned here)."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

# One worker runs the whole module, so its module-scoped fixtures are made once (`make test`: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_bench_suite")


@pytest.fixture(scope="module")
def suite():
    path = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "bench_suite.py"
    spec = importlib.util.spec_from_file_location("bench_suite", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pipeline_rows_on_clusters_of_several_hosts_split_between_default_and_full(suite):
    assert "megatron-tp+pp2" in suite.configs_of("gpt3-1.3b", "8x8")
    assert "planner-1stage" in suite.configs_of("gpt3-1.3b", "128x8")
    assert not any("+pp" in c or c == "planner-1stage" for c in suite.configs_of("gpt3-1.3b", "2x4"))
    assert not any("+pp" in c for c in suite.configs_of("gpt-tiny", "2x4"))  # compiled rows: one stage
    runs = [(m, c, k) for m, c, ks in suite.DEFAULT + suite.FULL for k in ks]
    assert len(runs) == len(set(runs))  # no configuration in both sets
    for m, c in {(m, c) for m, c, _ in runs}:
        assert sorted(k for mm, cc, k in runs if (mm, cc) == (m, c)) == sorted(suite.configs_of(m, c))
    assert any("+pp" in k for _, _, ks in suite.DEFAULT for k in ks)  # `make bench` has pipeline rows


def _row(config, step, fits="yes", **kw):
    return {"model": "m", "cluster": "8x8", "mode": "abstract", "config": config, "step_time_s": str(step),
            "fits": fits, **kw}


def test_summary_counts_pp_baselines_and_checks_the_pipeline_search(suite):
    rows = [
        _row("planner", 0.20, stages="1", microbatches="1", pp_candidates="1:0.27:1;4:0.30:2;32:0.26:9"),
        _row("planner-1stage", 0.18),  # faster than the pipeline-auto plan: reported, not a baseline
        _row("dp", 0.25),
        _row("megatron-tp+pp2", 0.21, stages="2", microbatches="4"),  # faster than the search at B=4
        _row("dp+pp2", 0.15, fits="no", stages="2", microbatches="2"),  # does not fit: ignored
        _row("fsdp+pp2", 0.40, stages="2", microbatches="32"),
    ]
    lines, recs = suite.summarize(rows)
    (rec,) = recs
    assert rec["best"] == "megatron-tp+pp2" and rec["no_slower"] and not rec["faster10"]
    assert rec["vs_single"] is False
    text = "\n".join(lines)
    assert "single-stage plan (`planner-1stage`) in 0 of 1 groups; m 8x8: 0.2 vs 0.18 s" in text
    assert "no slower in 1 of 2; m 8x8 megatron-tp+pp2 (B=4): 0.21 s, search 0.3 s" in text


def test_write_renders_csv_report_and_plots(suite, tmp_path):
    rows = [_row("planner", 0.2, memory_bytes="1e9", stages="1", microbatches="1", plan_s="3.0", ops="100",
                 pp_candidates="1:0.2:1;2:0.3:2"),
            _row("dp", 0.25, memory_bytes="2e9", plan_s="1.0", ops="100"),
            _row("megatron-tp+pp2", 0.3, memory_bytes="5e8", stages="2", microbatches="2", plan_s="2.0", ops="100")]
    suite.write(rows, "# header", tmp_path)
    text = (tmp_path / "suite.md").read_text()
    assert "| m | 8x8 | abstract | 0.2 | dp | 0.25 | 1.250 | yes | yes |" in text
    assert (tmp_path / "suite.csv").read_text().count("\n") == 4
    assert (tmp_path / "suite_memory_m.png").exists() and (tmp_path / "suite_planning_time.png").exists()
