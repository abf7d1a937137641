"""bench/sim_sizing_hourly.py's plans, from measurements given by hand (`--replan`, no
simulation): the hour-by-hour replica counts of separate pools and the fewest replica-hours
of one pool that carry the day's batch, worked out below."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NAME = "llama-3-70b / H200 TP4"  # peak 20 requests/s, 200,000 batch requests a day, TP 4

# Per replica: 5 requests/s within the targets, alone or beside batch; batch alone 1,000
# tok/s; beside interactive, the full 1,000 up to 2.5 requests/s, then down to 0 at 5.
MEASURED = {
    "interactive_capacity": 5.0,
    "priority_capacity": 5.0,
    "batch_alone_tokens_s": 1000.0,
    "runs": [
        {"batch": True, "rate_per_replica": 2.5, "batch_tokens_per_replica_s": 1000.0},
        {"batch": True, "rate_per_replica": 5.0, "batch_tokens_per_replica_s": 0.0},
        {"batch": False, "rate_per_replica": 4.0, "batch_tokens_per_replica_s": 0.0},
    ],
}
# ceil(20 x curve[h] / 5), at least 1: the interactive pool, and the one pool's floor.
INTERACTIVE = [1, 1, 1, 1, 1, 2, 2, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 3, 3, 3, 2, 2, 2]


def test_replan_gives_the_fewest_replica_hours(tmp_path: Path) -> None:
    given = tmp_path / "given.json"
    given.write_text(
        json.dumps(
            {"results": [{"deployment": NAME, "measured": MEASURED, "verification_runs": []}]}
        )
    )
    done = subprocess.run(
        [
            sys.executable,
            "bench/sim_sizing_hourly.py",
            "--replan",
            str(given),
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "sim_sizing_hourly.png").stat().st_size > 0
    [result] = json.loads((tmp_path / "sim_sizing_hourly.json").read_text())["results"]
    plan = result["plan"]
    daily_tokens = plan["daily_batch_tokens"]
    assert 23 * 3600 * 1000 < daily_tokens <= 24 * 3600 * 1000  # ~421 tokens a request
    # Separate: 67 interactive replica-hours; the batch pool's 24 at 1,000 tok/s, one an hour.
    assert plan["separate"] == {"interactive": INTERACTIVE, "batch": [1] * 24}
    # One pool: a replica-hour beside rate x per replica harvests 1,000 tok/s x
    # (n if n >= R/2.5 else 2n - 0.4R) in an hour of R requests/s. At the floor that is
    # 15.52 replica-hours' worth, against the day's 23.38: 4 more replicas, each +2 (none
    # gives more than 2, so 3 would not do).
    assert sum(plan["one_pool"]) == sum(INTERACTIVE) + 4 == 71
    assert all(n >= low for n, low in zip(plan["one_pool"], INTERACTIVE, strict=True))
    assert sum(plan["one_pool_batch_planned"]) >= daily_tokens
    assert plan["accelerator_hours"] == {"separate": 4 * 91, "one_pool": 4 * 71}
    # Fixed all day: 4 + 1 replicas separate; one pool of 4 (its 9 hours under 10 requests/s
    # harvest 36 replica-hours' worth).
    assert plan["fixed_accelerator_hours"] == {"separate": 24 * 4 * 5, "one_pool": 24 * 4 * 4}
    assert result["verified"]["separate"]["hours_verified"] == 0  # nothing was run
