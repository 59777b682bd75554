"""Carry torch.compile's Inductor cache from one device machine to the next.

    python3 benchmarks/inductor_cache.py pack --out $OUT [--cache DIR] [--part-mib 15] [--max-mib 56]
    python3 benchmarks/inductor_cache.py unpack --parts .inductor_cache [--cache DIR]

Why: every device machine starts bare, and a cold start of the 7B engine spends
~380 s of its ~420 s compiling (decode 83, prefill 170, mixed 130 s on machine
AD; ready in 130-170 s on a warm cache), a fifth of a session's 1,800 s of
device time for each fresh machine. `pack`, at the end of a call, writes the cache as xz parts small enough
to come back from $OUT (at most 8 files of 16 MiB, 64 MiB in all); copied here
into the ignored `.inductor_cache/` and carried by a later call (the working
tree travels in 64 MiB, the Ray bundle takes 46 of them), `unpack` puts it back
before the engine starts. The cache's keys hold the GPU, CUDA, Triton and torch
versions, so a machine of another image misses it and compiles as before.
`--cache` defaults to $TORCHINDUCTOR_CACHE_DIR. Nothing is written if the
packed cache is over --max-mib: it would not come back, or not fit a call.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PART_NAME = "inductor-cache.tar.xz.part"


def _write_tar_xz(cache: Path, whole: Path) -> None:
    # The xz binary, where there is one, compresses on every core: the 7B engine's 72 MiB cache took 10 s
    # with 28 s of CPU on the H200 host (machine AE), about what Python's lzma, on one core, would take
    # at the end of a call that may have seconds to spare.
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


def pack(cache: Path, out: Path, part_mib: float = 15.0, max_mib: float = 56.0) -> list[Path]:
    """The cache folder as xz-compressed tar parts ``out/inductor-cache.tar.xz.partNN`` of at most ``part_mib``
    MiB each; none if the whole is over ``max_mib`` (then a ValueError says how big it is)."""
    if not cache.is_dir():
        raise ValueError(f"no Inductor cache at {cache}")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "cache.tar.xz"
        _write_tar_xz(cache, whole)
        size = whole.stat().st_size
        if size > max_mib * 2**20:
            raise ValueError(f"the packed cache is {size / 2**20:.1f} MiB, over {max_mib:g}: not written")
        part_bytes = int(part_mib * 2**20)
        if part_bytes < 1:
            raise ValueError(f"--part-mib must be positive, got {part_mib}")
        parts = []
        with whole.open("rb") as f:
            while chunk := f.read(part_bytes):
                parts.append(out / f"{PART_NAME}{len(parts):02d}")
                parts[-1].write_bytes(chunk)
    return parts


def unpack(parts_dir: Path, cache: Path) -> int:
    """The parts in ``parts_dir`` joined in order and unpacked into ``cache``; returns how many files it holds
    (0, and nothing done, where there are no parts: the first machine of a session compiles cold)."""
    parts = sorted(parts_dir.glob(f"{PART_NAME}*"))
    if not parts:
        return 0
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "cache.tar.xz"
        with whole.open("wb") as f:
            for part in parts:
                f.write(part.read_bytes())
        with tarfile.open(whole, "r:xz") as tar:
            tar.extractall(cache, filter="data")  # paths stay inside the cache folder
            return sum(1 for m in tar.getmembers() if m.isfile())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    default_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    pk = sub.add_parser("pack", help="write the cache as parts that come back from $OUT")
    pk.add_argument("--cache", default=default_cache, required=default_cache is None)
    pk.add_argument("--out", required=True)
    pk.add_argument("--part-mib", type=float, default=15.0, help="size of each part (16 MiB come back at most)")
    pk.add_argument("--max-mib", type=float, default=56.0, help="write nothing if the packed cache is larger")
    up = sub.add_parser("unpack", help="put carried parts back into the cache folder")
    up.add_argument("--parts", required=True)
    up.add_argument("--cache", default=default_cache, required=default_cache is None)
    args = p.parse_args()
    try:
        if args.cmd == "pack":
            parts = pack(Path(args.cache), Path(args.out), args.part_mib, args.max_mib)
            raw_mib = sum(f.stat().st_size for f in Path(args.cache).rglob("*") if f.is_file()) / 2**20
            print(f"packed {args.cache} ({raw_mib:.1f} MiB) into {len(parts)} parts, "
                  f"{sum(x.stat().st_size for x in parts) / 2**20:.1f} MiB: {', '.join(x.name for x in parts)}")
        else:
            n = unpack(Path(args.parts), Path(args.cache))
            print(f"unpacked {n} files into {args.cache}" if n else f"no cache parts in {args.parts}: a cold compile")
    except ValueError as e:
        print(f"inductor_cache: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
