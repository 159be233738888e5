"""bench/cold_start.py on the CPU: a fresh `core serve` of the default model with empty kernel
caches, then a restart; the phases it reports add up (marked slow: two server starts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))


@pytest.mark.slow
def test_cold_start_reports_each_phase_and_fills_fresh_caches(tmp_path, capsys):
    import cold_start

    out = tmp_path / "cold.json"
    assert cold_start.main(["--device", "cpu", "--runs", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["runs"]) == 2
    for run in report["runs"]:
        assert "error" not in run, run
        assert run["first_token_text"]  # a token was served
        client, engine = run["client_phases_s"], run["engine_phases_s"]
        assert any(k.startswith("weights loaded") for k in engine)
        assert sum(client.values()) <= run["spawn_to_ready_s"] + 1e-3
        assert run["before_the_phases_s"] >= 0 and run["engine_before_its_phases_s"] >= 0
        assert run["total_to_first_token_s"] == pytest.approx(
            run["spawn_to_ready_s"] + run["ready_to_first_token_s"], abs=2e-3)
    assert [r["triton_cache_entries"] for r in report["runs"]] == [0, 0]  # the CPU plan
    # the first server compiled the C kernels into the fresh cache the runs were given
    assert any((Path(report["caches"]) / "kernels").iterdir())
    assert "spawn to the first token" in capsys.readouterr().out
