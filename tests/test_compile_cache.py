"""torch.compile's Inductor cache packed on one machine and unpacked on another (cluster/compile_cache.py, used by
`seekserve cluster compile-cache` on new GPU nodes and by benchmarks/inductor_cache.py between device machines):
a compile there finds it (a real compile on the CPU, in fresh processes), and parts that are missing or
truncated are refused with the cache left as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cluster.compile_cache import PART_NAME, pack, unpack

COMPILE = """
import json, torch
from torch._dynamo.utils import counters
torch.compile(lambda x: torch.nn.functional.silu(x) * 3 + x.sum())(torch.randn(16, 16))
print(json.dumps(dict(counters["inductor"])))
"""


def compile_in_fresh_process(cache, before: str = "") -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", before + COMPILE], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_flash_prompt_attention_is_in_the_compile_caches_key(tmp_path):
    # the engine's prompt_attention 'flash' turns cuDNN's SDPA off before compiling; torch's caches do not key on
    # the SDPA backend (pytorch#185449), so a cache warmed under cuDNN must miss, not hand back cuDNN's graph
    choose = ("import torch; from serve_app.engines.slot_kv import use_prompt_attention\n"
              "use_prompt_attention({!r}, 'cuda'); assert torch.backends.cuda.cudnn_sdp_enabled() is {}\n")
    cache = tmp_path / "cache"
    assert compile_in_fresh_process(cache).get("fxgraph_cache_miss", 0) >= 1
    flash = compile_in_fresh_process(cache, choose.format("flash", False))
    assert flash.get("fxgraph_cache_miss", 0) >= 1 and not flash.get("fxgraph_cache_hit"), flash
    again = compile_in_fresh_process(cache, choose.format("flash", False))  # and its own entry is found
    assert again.get("fxgraph_cache_hit", 0) >= 1 and not again.get("fxgraph_cache_miss"), again
    auto = compile_in_fresh_process(cache, choose.format("auto", True))  # 'auto' changes nothing
    assert auto.get("fxgraph_cache_hit", 0) >= 1 and not auto.get("fxgraph_cache_miss"), auto


def test_the_backends_of_several_prompts_passes_are_in_the_compile_caches_key_through_the_graph(tmp_path):
    # 'flash_multi_prompt' narrows the backends inside the traced pass (sdpa_kernel becomes graph nodes), with no
    # tag: AOTAutograd's cache, keyed before the backend is chosen, is bypassed, and Inductor's is keyed on the
    # lowered graph, which names the kernel. On the CPU, torch's pick and the engine's list both lower to the
    # CPU's flash; the math kernel stands in for a kernel other than torch's pick (on Hopper: flash for cuDNN)
    attend = ("import json, torch\nfrom torch._dynamo.utils import counters\n"
              "from torch.nn.attention import SDPBackend\nfrom serve_app.engines import slot_kv\n"
              "slot_kv.use_prompt_attention({!r}, 'cuda')\n{}\n"
              "q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)\n"
              "torch.compile(lambda q, k: slot_kv.slot_attention(None, q, k, k, None, scaling=0.3)[0])(q, k)\n"
              "print(json.dumps({{**counters['inductor'], **counters['aot_autograd']}}))\n")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}

    def compile_with(choice: str, backends: str = "") -> dict:
        narrow = f"slot_kv._MULTI_PROMPT_BACKENDS = [{backends}]" if backends else ""
        out = subprocess.run([sys.executable, "-c", attend.format(choice, narrow)], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-1500:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert compile_with("auto").get("fxgraph_cache_miss", 0) >= 1
    math = compile_with("flash_multi_prompt", "SDPBackend.MATH")
    assert math.get("fxgraph_cache_miss", 0) >= 1 and not math.get("fxgraph_cache_hit"), math
    assert not math.get("autograd_cache_hit"), math
    again = compile_with("flash_multi_prompt", "SDPBackend.MATH")
    assert again.get("fxgraph_cache_hit", 0) >= 1 and not again.get("fxgraph_cache_miss"), again
    # the engine's own list lowers to what torch picks on the CPU, and finds that entry
    same = compile_with("flash_multi_prompt")
    assert same.get("fxgraph_cache_hit", 0) >= 1 and not same.get("fxgraph_cache_miss"), same


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

    from cluster import compile_cache

    if xz_binary and shutil.which("xz") is None:
        pytest.skip("no xz binary on this machine: only Python's lzma runs here")
    if not xz_binary:
        monkeypatch.setattr(compile_cache.shutil, "which", lambda name: None)
    cache = tmp_path / "cache"
    (cache / "fxgraph" / "ab").mkdir(parents=True)
    files = {"fxgraph/ab/entry": b"graph " * 5_000, "triton.cubin": os.urandom(30_000)}
    for name, data in files.items():
        (cache / name).write_bytes(data)
    pack(cache, tmp_path / "out", part_mib=0.01)
    assert unpack(tmp_path / "out", tmp_path / "back") == len(files)
    assert {n: (tmp_path / "back" / n).read_bytes() for n in files} == files


def seekserve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serve_app.cli", "cluster", "compile-cache", *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_the_cli_seeds_a_new_node_and_a_node_without_parts_compiles_cold(tmp_path):
    node_a = tmp_path / "node_a"
    (node_a / "fxgraph").mkdir(parents=True)
    (node_a / "fxgraph" / "entry").write_bytes(b"kernel " * 20_000)
    out = tmp_path / "configs" / "compile-cache"
    out.mkdir(parents=True)
    (out / f"{PART_NAME}07").write_bytes(b"stale part of an earlier, longer pack")
    packed = seekserve("pack", "--cache", str(node_a), "--out", str(out), "--part-mib", "0.01")
    assert packed.returncode == 0, packed.stderr
    assert not (out / f"{PART_NAME}07").exists()  # gone, or it would be joined onto the new parts
    seeded = seekserve("unpack", "--cache", str(tmp_path / "node_b"), "--parts", str(out))
    assert seeded.returncode == 0 and "unpacked 1 files" in seeded.stdout
    assert (tmp_path / "node_b" / "fxgraph" / "entry").read_bytes() == (node_a / "fxgraph" / "entry").read_bytes()
    # the cluster files run unpack on every new node: with no parts mounted it is a cold start, not a failure
    cold = seekserve("unpack", "--cache", str(tmp_path / "node_c"), "--parts", str(tmp_path / "nothing-here"))
    assert cold.returncode == 0 and "compiles cold" in cold.stdout and not (tmp_path / "node_c").exists()


def test_missing_or_truncated_parts_are_refused_and_the_cache_is_left_as_it_was(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "blob").write_bytes(os.urandom(60_000))  # does not compress: several parts
    parts = pack(cache, tmp_path / "parts", part_mib=0.02)
    assert len(parts) >= 3
    node = tmp_path / "node"
    node.mkdir()
    (node / "own-entry").write_text("compiled here before")

    parts[-1].write_bytes(parts[-1].read_bytes()[:100])  # a copy cut short
    truncated = seekserve("unpack", "--cache", str(node), "--parts", str(tmp_path / "parts"))
    assert truncated.returncode == 2 and "do not unpack" in truncated.stderr
    parts[1].unlink()
    missing = seekserve("unpack", "--cache", str(node), "--parts", str(tmp_path / "parts"))
    assert missing.returncode == 2 and "one is missing" in missing.stderr
    assert sorted(p.name for p in node.iterdir()) == ["own-entry"]  # nothing half-unpacked
