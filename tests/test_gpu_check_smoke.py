"""The one GPU check's decode sections run on this CPU at tiny shapes (``--smoke``, the Triton
interpreter and CPU FlexAttention), so a session lent a GPU does not spend its minutes on a
script error: every shape yields a row, the fused merge equals the separate one, and
FlexAttention with beta in its ``score_mod`` matches the float reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_decode_and_flex_sections_run_at_smoke_shapes(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "VLLM_COMPACTION_TUNE": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--smoke"]
        + ["--sections", "decode,flex", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sections = json.loads(out.read_text())["sections"]
    for name in ("decode", "flex"):
        assert "error" not in sections[name], sections[name]
        assert len(sections[name]["shapes"]) == 2
    for row in sections["decode"]["shapes"]:
        assert row["prefix_10pct_fused_max_abs_diff"] < 1e-2, row
        assert row["prefix_10pct_fused_ms"] > 0
        assert len(row["prefix_10pct_fused_sweep_ms"]) == 1
    for row in sections["flex"]["shapes"]:
        assert "error" not in row, row
        # bf16 inputs, a float32 reference
        assert row["flex_dense_max_abs_diff"] < 2e-2, row
        assert row["flex_10pct_max_abs_diff"] < 2e-2, row
        assert row["flex_10pct_ms"] > 0
