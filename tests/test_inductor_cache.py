"""Carrying torch.compile's Inductor cache between device machines (benchmarks/inductor_cache.py): packed into
parts, joined and unpacked elsewhere, a compile there finds it (a real compile on the CPU, in fresh processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.inductor_cache import PART_NAME, pack, unpack

COMPILE = """
import json, torch
from torch._dynamo.utils import counters
torch.compile(lambda x: torch.nn.functional.silu(x) * 3 + x.sum())(torch.randn(16, 16))
print(json.dumps(dict(counters["inductor"])))
"""


def compile_in_fresh_process(cache) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_packed_cache_unpacked_on_another_machine_serves_the_same_compile(tmp_path):
    first = compile_in_fresh_process(tmp_path / "machine_a")
    assert first.get("fxgraph_cache_miss", 0) >= 1 and not first.get("fxgraph_cache_hit")
    # small parts, so that joining them in order is part of what is checked
    parts = pack(tmp_path / "machine_a", tmp_path / "out", part_mib=0.02)
    assert len(parts) > 1 and all(p.name.startswith(PART_NAME) for p in parts)
    assert unpack(tmp_path / "out", tmp_path / "machine_b") > 0
    second = compile_in_fresh_process(tmp_path / "machine_b")
    assert second.get("fxgraph_cache_hit", 0) >= 1 and not second.get("fxgraph_cache_miss")


def test_a_cache_too_big_to_come_back_is_not_written_and_no_parts_is_a_cold_start(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "blob").write_bytes(os.urandom(200_000))  # random bytes do not compress
    with pytest.raises(ValueError, match="over 0.1: not written"):
        pack(cache, tmp_path / "out", max_mib=0.1)
    assert not list((tmp_path / "out").glob(f"{PART_NAME}*"))
    assert unpack(tmp_path / "out", tmp_path / "elsewhere") == 0 and not (tmp_path / "elsewhere").exists()
    with pytest.raises(ValueError, match="no Inductor cache"):
        pack(tmp_path / "missing", tmp_path / "out")


@pytest.mark.parametrize("xz_binary", [True, False], ids=["xz-binary", "python-lzma"])
def test_both_compressors_round_trip_every_file(tmp_path, monkeypatch, xz_binary):
    import shutil

    from benchmarks import inductor_cache

    if xz_binary and shutil.which("xz") is None:
        pytest.skip("no xz binary on this machine: only Python's lzma runs here")
    if not xz_binary:
        monkeypatch.setattr(inductor_cache.shutil, "which", lambda name: None)
    cache = tmp_path / "cache"
    (cache / "fxgraph" / "ab").mkdir(parents=True)
    files = {"fxgraph/ab/entry": b"graph " * 5_000, "triton.cubin": os.urandom(30_000)}
    for name, data in files.items():
        (cache / name).write_bytes(data)
    pack(cache, tmp_path / "out", part_mib=0.01)
    assert unpack(tmp_path / "out", tmp_path / "back") == len(files)
    assert {n: (tmp_path / "back" / n).read_bytes() for n in files} == files
