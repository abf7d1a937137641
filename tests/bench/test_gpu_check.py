"""bench/gpu_check.py, the prepared accelerator check, runs whole on the CPU with its tiny
shape: the engine, the random-weight model and every figure it reports at 1, 64 and 256
sequences, so that the GPU run, when a device is lent, is not its first run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

# The tiny shape (gpu_check.TINY): 2 layers of hidden 64, 4 heads and 2 KV heads of 16,
# intermediate 128, vocabulary 512, untied, in bfloat16 (2 bytes).
LAYER_PARAMS = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 2 * 128 + 128 * 64 + 2 * 64
WEIGHT_BYTES = 2 * (2 * LAYER_PARAMS + 64 + 512 * 64)  # the embedding is not read whole
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 2  # layers, K and V, KV heads, head dim, bytes
STEPS = 5
CONTEXT = 64


def test_tiny_run_reports_every_batch_size(tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--tiny", "--num-threads", "1", "--steps", str(STEPS)]
    argv += ["--warmup-steps", "1", "--copy-mib", "16", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", *argv],  # as the docs run it
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "gpu_check.png").stat().st_size > 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["device"] == {"type": "cpu"}
    assert result["model"]["shape"] == "tiny"
    assert result["weight_bytes"] == WEIGHT_BYTES
    assert result["kv_bytes_per_token"] == KV_BYTES_PER_TOKEN
    assert result["bandwidth_copy_gbs"] > 0
    # On the CPU the roofline is the measured copy's.
    assert result["bandwidth_nominal_gbs"] == result["bandwidth_copy_gbs"]
    rows = result["rows"]
    assert [r["seqs"] for r in rows] == [1, 64, 256]
    for row in rows:
        n = row["seqs"]
        assert "skipped" not in row and "error" not in row, row
        assert row["timed_steps"] == STEPS
        assert row["preemptions"] == 0
        # Each sequence's context: its prompt, plus what it decoded through the prefill
        # of the others and the warm-up, plus the step's own token.
        assert CONTEXT + 2 <= row["context"] <= CONTEXT + 2 * STEPS + 20, row
        assert row["weight_bytes"] == WEIGHT_BYTES
        assert row["kv_read_bytes"] == pytest.approx(
            row["context"] * n * KV_BYTES_PER_TOKEN, rel=1e-3
        )
        expected_roofline = (WEIGHT_BYTES + row["kv_read_bytes"]) / (
            result["bandwidth_nominal_gbs"] * 1e9
        )
        assert row["roofline_s"] == pytest.approx(expected_roofline, rel=1e-6)
        # On the CPU the forward's three figures are one; the step holds it and more.
        assert row["forward_host_s"] == row["forward_span_s"] == row["forward_kernels_s"]
        assert 0 < row["forward_span_s"] < row["step_s"]
        assert row["wait_launch_share"] == 0
        assert 0 < row["wait_engine_share"] < 1
        assert row["busy_share"] == pytest.approx(1 - row["wait_engine_share"])
        for key in ("step_over_roofline", "kernels_over_roofline", "tokens_per_s"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
