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
The 7B engine's (machine AE): 72 MiB, one 4.1-MiB part; a fresh machine
seeded with it was ready in 148 s (docs/gpu_notes.md run 92). The packing
is cluster/compile_cache.py's, which seeds new GPU nodes the same way.
On the device it packs fast (xz -6 on every core, 8 MiB dictionaries); here, where time is free, repacking with
xz's largest dictionary halves it, since the FX-graph entries repeat one another across files (the bf16 and FP8
engines' 207 MiB: 12.0 MiB -> 5.6 MiB, 2026-12-05), which keeps it inside a call beside the Ray bundle:

    mkdir /tmp/c && cat <fetched parts> | xz -dc | tar -x -C /tmp/c
    tar -C /tmp/c -cf - . | xz -9e -T2 > .inductor_cache/inductor-cache.tar.xz.part00   # one part

(AS's bf16 + FP8 gemm + epilogue caches, 298 MiB: 17.2 MB from the device; xz -9e 8 MiB dictionaries would not
reach across them, while `tar --sort=name ... | xz --lzma2=preset=9e,dict=320MiB -T1` made 4.2 MB in 200 s
here, 2026-12-06: the same kernels sit far apart in the tar. With AX's H200 kernels added, 501 MiB: 29.4 MB from
the device, 6.1 MB with dict=512MiB, which leaves the Ray bundle, the cache and the tree at 62.0 MiB.)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the packing and its report are the cluster's (`seekserve cluster compile-cache`, which seeds new GPU nodes);
# this script only sets the device calls' defaults: parts that come back from $OUT, a cache that fits a call
from serve_app.cli import cmd_cluster_compile_cache  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    default_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    pk = sub.add_parser("pack", help="write the cache as parts that come back from $OUT")
    pk.add_argument("--cache", default=default_cache, required=default_cache is None)
    pk.add_argument("--out", required=True)
    pk.add_argument("--part-mib", type=float, default=15.0, help="size of each part (16 MiB come back at most)")
    pk.add_argument("--max-mib", type=float, default=56.0, help="write nothing if the packed cache is larger")
    up = sub.add_parser("unpack", help="put carried parts back into the cache folder")
    up.add_argument("--parts", required=True)
    up.add_argument("--cache", default=default_cache, required=default_cache is None)
    sys.exit(cmd_cluster_compile_cache(p.parse_args()))


if __name__ == "__main__":
    main()
