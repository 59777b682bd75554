"""Compare autoscaling policies on a simulated diurnal + burst trace.

    python benchmarks/autoscale_sim.py [--hours 4] [--seed 7]

Prints a table last and writes results/autoscale_sim.json. Model and policies:
autoscale/sim.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autoscale.sim import SimConfig, policies, simulate  # noqa: E402
from benchmarks.loadgen import print_table  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hours", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=str(ROOT / "results" / "autoscale_sim.json"))
    args = p.parse_args()
    cfg = SimConfig(duration_s=args.hours * 3600, diurnal_period_s=args.hours * 3600, seed=args.seed)
    rows = [simulate(cfg, name, pol).as_dict() for name, pol in policies(cfg).items()]
    ref = next(r for r in rows if r["policy"] == "ray default (target_ongoing=2)")
    for r in rows:
        r["replica_s_vs_ray_default_pct"] = 100.0 * (r["replica_seconds"] / ref["replica_seconds"] - 1.0)
        r["slo_pct"] = 100.0 * r["slo_attainment"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": asdict(cfg), "rows": rows}, indent=2))
    print_table(rows, ["policy", "requests", "slo_pct", "ttft_p95_s", "replica_seconds",
                       "replica_s_vs_ray_default_pct", "scale_events", "direction_flips", "flaps"])


if __name__ == "__main__":
    main()
