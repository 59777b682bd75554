"""The first-use probe (benchmarks/gpu_first_use_probe.py) runs end to end on the CPU: each arm in a process
of its own, every shape timed twice or its refusal kept as a result. Its timings need a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_first_use_probe import ARMS, CPU_DIMS, SHAPES, run_arm

ROOT = Path(__file__).resolve().parent.parent


def test_every_arm_times_every_shape_in_a_process_of_its_own(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_first_use_probe.py"), "--device", "cpu",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "gpu_first_use_probe.json").read_text())
    assert [a["arm"] for a in res["arms"]] == list(ARMS)
    for arm in res["arms"]:
        assert len(arm["rows"]) == len(SHAPES), arm
        for row in arm["rows"]:
            # timed twice, or refused (cuDNN and the efficient kernel have no CPU form): never silently dropped
            assert ("first_ms" in row and "second_ms" in row and row["first_ms"] >= 0) or "error" in row, row
    timed = {a["arm"] for a in res["arms"] if all("first_ms" in r for r in a["rows"])}
    assert {"sdpa_default", "sdpa_engine", "sdpa_engine_compiled", "gemm", "alloc"} <= timed
    assert all("steady_ms" in r for a in res["arms"] for r in a["rows"] if "first_ms" in r)
    assert proc.stdout.splitlines()[1].split()[:2] == ["arm", "prompts"]  # the table, last


def test_an_unknown_arm_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="valid: sdpa_default"):
        run_arm("sdpa_flash2", "cpu", ((2, 8),), CPU_DIMS)
