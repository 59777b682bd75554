"""torch.compile's Inductor cache, packed on one GPU node and unpacked on a new one.

Why: the hf engine compiles its decode, prefill and mixed passes before a
replica reports ready. On an H200 with the 7B engine that took 319-421 s on a
bare machine, and 148 s on a fresh machine given the cache packed on another
one (docs/gpu_notes.md runs 90-92; every FX graph and AOT autograd entry a
hit). A node the autoscaler adds under load is such a bare machine. The
cluster files already keep the cache across restarts of one node
(``TORCHINDUCTOR_CACHE_DIR`` in ``worker_start_ray_commands``); this seeds it
on new nodes too, from parts an operator packed once
(``seekserve cluster compile-cache pack``) and put into the mounted
``configs/compile-cache/`` folder. The cache's keys hold the GPU, CUDA,
Triton and torch versions, so a node of another image or GPU misses it and
compiles as before: seeding never serves a wrong kernel, at worst none.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

PART_NAME = "inductor-cache.tar.xz.part"


def _write_tar_xz(cache: Path, whole: Path) -> None:
    # The xz binary, where there is one, compresses on every core: the 7B engine's 72 MiB cache took 10 s
    # with 28 s of CPU on the H200 host (machine AE), about what Python's lzma, on one core, would take.
    xz = shutil.which("xz")
    if xz is None:
        with tarfile.open(whole, "w:xz") as tar:
            tar.add(cache, arcname=".")
        return
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "cache.tar"
        with tarfile.open(plain, "w") as tar:
            tar.add(cache, arcname=".")
        with whole.open("wb") as f:
            subprocess.run([xz, "-T0", "-6", "-c", str(plain)], stdout=f, check=True)


def pack(cache: Path, out: Path, part_mib: float = 15.0, max_mib: float | None = None) -> list[Path]:
    """The cache folder as xz-compressed tar parts ``out/inductor-cache.tar.xz.partNN`` of at most ``part_mib``
    MiB each; none if the whole is over ``max_mib`` (then a ValueError says how big it is)."""
    if not cache.is_dir():
        raise ValueError(f"no Inductor cache at {cache}")
    part_bytes = int(part_mib * 2**20)
    if part_bytes < 1:
        raise ValueError(f"part size must be positive, got {part_mib} MiB")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "cache.tar.xz"
        _write_tar_xz(cache, whole)
        size = whole.stat().st_size
        if max_mib is not None and size > max_mib * 2**20:
            raise ValueError(f"the packed cache is {size / 2**20:.1f} MiB, over {max_mib:g}: not written")
        # stale parts of an earlier, longer pack would be joined onto this one
        for old in out.glob(f"{PART_NAME}*"):
            old.unlink()
        parts = []
        with whole.open("rb") as f:
            while chunk := f.read(part_bytes):
                parts.append(out / f"{PART_NAME}{len(parts):02d}")
                parts[-1].write_bytes(chunk)
    return parts


def _part_index(path: Path) -> int:
    # by number, not by name: part100 comes after part99, where sorting names would put it after part10
    m = re.fullmatch(re.escape(PART_NAME) + r"(\d+)", path.name)
    return int(m.group(1)) if m else -1


def unpack(parts_dir: Path, cache: Path) -> int:
    """The parts in ``parts_dir`` joined in order and unpacked into ``cache``; returns how many files it holds
    (0, and nothing done, where there are no parts or no such folder: the node compiles cold)."""
    parts = sorted((p for p in parts_dir.glob(f"{PART_NAME}*") if _part_index(p) >= 0), key=_part_index)
    if not parts:
        return 0
    if [_part_index(p) for p in parts] != list(range(len(parts))):
        raise ValueError(f"cache parts in {parts_dir} are not numbered 00..{len(parts) - 1:02d}: one is missing")
    with tempfile.TemporaryDirectory() as tmp:
        whole, staged = Path(tmp) / "cache.tar.xz", Path(tmp) / "cache"
        with whole.open("wb") as f:
            for part in parts:
                f.write(part.read_bytes())
        try:
            # unpacked aside first: a truncated part then leaves the cache as it was, not with half a kernel
            with tarfile.open(whole, "r:xz") as tar:
                tar.extractall(staged, filter="data")  # paths stay inside the folder
                files = sum(1 for m in tar.getmembers() if m.isfile())
        except (tarfile.TarError, EOFError, OSError) as e:
            raise ValueError(f"cache parts in {parts_dir} do not unpack ({e}): a part is truncated or foreign") from e
        cache.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staged, cache, dirs_exist_ok=True)
    return files


def cache_mib(cache: Path) -> float:
    """The unpacked cache's size in MiB."""
    return sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) / 2**20
