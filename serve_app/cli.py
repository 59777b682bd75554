"""``seekserve`` command line."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


def _load(path: str):
    from serve_app.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from e


def cmd_config_validate(args) -> int:
    cfg = _load(args.config)
    print(f"{args.config}: ok ({len(cfg.models)} model(s), "
          f"{sum(len(m.variants) for m in cfg.models)} variant(s))")
    return 0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from e
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0; got {text}")
    return value


def cmd_config_memory(args) -> int:
    """Each hf variant's weights and KV cache per GPU against ``--gpu-memory-gib``, and whether its engine's
    start-up check would pass; exit 1 if any would not."""
    from transformers import AutoConfig

    from serve_app.engines.memory import GB, count_weights, plan_hf
    from serve_app.engines.model_store import ModelNotAvailableError, resolve_model_dir
    from serve_app.engines.options import HFEngineOptions

    cfg = _load(args.config)
    gpu_bytes = int(args.gpu_memory_gib * 2**30)
    rows, errors = [], []
    for model in cfg.models:
        for v in model.variants:
            name = f"{model.name}/{v.name}"
            opts = v.engine.options
            if v.engine.backend != "hf" or opts.get("device") == "cpu":
                where = "the CPU: checked at start" if v.engine.backend == "hf" else f"backend {v.engine.backend}"
                rows.append((name, where, "", "", "", "", ""))
                continue
            options = HFEngineOptions.model_validate(opts)
            try:
                model_dir = resolve_model_dir(options.model)
                plan = plan_hf(options, AutoConfig.from_pretrained(model_dir, local_files_only=True),
                               count_weights(model_dir), gpu_bytes, v.tensor_parallel_size)
            except (ModelNotAvailableError, OSError) as e:
                print(f"error: {name}: cannot read the model: {e}", file=sys.stderr)
                return 2
            rows.append((name, f"{options.quantization} x{v.tensor_parallel_size}", f"{plan.weights_bytes / GB:.2f}",
                         plan.kv_what, f"{plan.kv_bytes / GB:.2f}", f"{plan.budget_bytes / GB:.2f}",
                         "no" if plan.error else "yes"))
            if plan.error:
                errors.append(f"{name}: {plan.error}")
    head = ("variant", "quant x ranks", "weights GB", "KV cache (tokens)", "KV GB", "budget GB", "fits")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    print(f"per GPU of {args.gpu_memory_gib:g} GiB ({gpu_bytes / GB:.1f} GB); budget = gpu_memory_utilization x "
          "the GPU, for weights + KV cache")
    for r in [head] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


def cmd_serve(args) -> int:
    cfg = _load(args.config)
    import ray
    from ray import serve

    from cluster.launcher import HAPROXY_ENV, select_http_proxy
    from serve_app.app import deploy

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.address is None:
        select_http_proxy(args.http_proxy)  # before the local Ray starts: Serve reads it once
    elif args.http_proxy != "python":
        print(f"--http-proxy applies to a Ray this command starts; a running cluster uses what its `ray start` "
              f"environment set ({HAPROXY_ENV})", file=sys.stderr)
    ray.init(address=args.address, include_dashboard=False, log_to_driver=not args.quiet)
    print(f"deploying {args.config} (first start dequantises the embedded model: ~30 s)", flush=True)
    deploy(cfg)
    _warn_bind(cfg)
    url = f"http://{cfg.server.host}:{cfg.server.http_port}"
    model = cfg.models[0].name
    print(f"\nseekserve is serving at {url}/v1  (models: {', '.join(m.name for m in cfg.models)})")
    print("try:")
    print(
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{json.dumps({'model': model, 'messages': [{'role': 'user', 'content': 'What is the capital of France?'}]})}'"
    )
    print("Ctrl-C stops it.", flush=True)
    if args.detach:
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0


def cmd_status(args) -> int:
    import ray

    from serve_app import status

    ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
    stats = None
    if args.url:
        import httpx

        try:
            raw = httpx.get(args.url.rstrip("/") + "/admin/engine-stats", timeout=10).json()
            from serve_app.app import llm_deployment_name

            stats = {llm_deployment_name(*k.split("/", 1)): v for k, v in raw.items()}
        except Exception as e:  # status must still show what Serve knows
            print(f"(engine stats unavailable: {e})", file=sys.stderr)
    rows = status.collect(args.app, stats)
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=2, default=str))
    else:
        print(status.render(rows))
    return 0


def _print_report(title: str, report) -> int:
    print(title)
    print(report.render())
    return 1 if report.errors else 0


def cmd_cluster_validate(args) -> int:
    from cluster.launcher import validate_cluster_file

    return _print_report(f"{args.file}:", validate_cluster_file(args.file))


def cmd_cluster_preflight(args) -> int:
    from cluster.launcher import preflight

    return _print_report("preflight of this node:", preflight(dict(os.environ)))


def cmd_cluster_compile_cache(args) -> int:
    from cluster.compile_cache import cache_mib, pack, unpack

    cache = Path(os.path.expanduser(args.cache))
    try:
        if args.action == "pack":
            parts = pack(cache, Path(args.out), args.part_mib, args.max_mib)
            print(f"packed {cache} ({cache_mib(cache):.1f} MiB) into {len(parts)} part(s) in {args.out}, "
                  f"{sum(x.stat().st_size for x in parts) / 2**20:.1f} MiB")
        else:
            n = unpack(Path(os.path.expanduser(args.parts)), cache)
            # no parts is the usual case on a cluster that never packed one: the node compiles as before
            print(f"unpacked {n} files into {cache}" if n else f"no compile-cache parts in {args.parts}: "
                  "the engine compiles cold")
    except ValueError as e:
        print(f"compile-cache: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_keys_hash(args) -> int:
    from serve_app.auth import hash_key

    print(f"{args.name}:{hash_key(sys.stdin.readline().strip())}")
    return 0


def cmd_trace_top(args) -> int:
    from serve_app.trace_top import render

    print(render(args.file, args.root, args.k))
    return 0


def cmd_deploy(args) -> int:
    """Deploy (or update in place) the app on a running Ray cluster."""
    cfg = _load(args.config)
    import ray

    from serve_app.app import deploy

    ray.init(address=args.address, log_to_driver=False)
    deploy(cfg)
    print(f"deployed {args.config}: http://{cfg.server.host}:{cfg.server.http_port}/v1, "
          f"grpc {cfg.server.host}:{cfg.server.grpc_port}")
    _warn_bind(cfg)
    return 0


def _warn_bind(cfg) -> None:
    from cluster.placement import cluster_node_gpus
    from serve_app.app import bind_warning

    warning = bind_warning(cfg.server.host, len(cluster_node_gpus()))
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    from cluster.launcher import HTTP_PROXIES

    p = argparse.ArgumentParser(prog="seekserve", description="Ray Serve LLM serving cluster.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start a local Ray (or join one) and serve the app")
    s.add_argument("--config", default=str(DEFAULT_CONFIG), help="app config YAML")
    s.add_argument("--address", default=None, help="Ray address to join; default: start a local Ray")
    s.add_argument("--detach", action="store_true", help="return once deployed (cluster keeps serving)")
    s.add_argument("--quiet", action="store_true", help="do not stream worker logs to the console")
    s.add_argument("--http-proxy", choices=HTTP_PROXIES, default="python",
                   help="Ray Serve's HTTP data path for the local Ray this starts: its Python proxy actor "
                        "(default) or HAProxy straight to the ingress replicas (docs/operations.md)")
    s.set_defaults(func=cmd_serve)

    k = sub.add_parser("keys", help="client API keys")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    kh = ksub.add_parser("hash", help="print the 'name:sha256' line to store for a secret read from stdin")
    kh.add_argument("name")
    kh.set_defaults(func=cmd_keys_hash)

    d = sub.add_parser("deploy", help="deploy or update the app on a running Ray cluster (in place)")
    d.add_argument("config", help="app config YAML")
    d.add_argument("--address", default="auto", help="Ray address (default: the running cluster)")
    d.set_defaults(func=cmd_deploy)

    cl = sub.add_parser("cluster", help="cluster-launcher files and node checks")
    clsub = cl.add_subparsers(dest="cluster_command", required=True)
    cv = clsub.add_parser("validate", help="validate a `ray up` file against Ray's schema and seekserve's rules")
    cv.add_argument("file")
    cv.set_defaults(func=cmd_cluster_validate)
    cp = clsub.add_parser("preflight", help="GPUs, driver, NVLink topology, NCCL env and ports of this node")
    cp.set_defaults(func=cmd_cluster_preflight)
    cc = clsub.add_parser("compile-cache", help="pack this node's torch.compile cache, or seed a new node from "
                          "packed parts (the hf engine's start: minutes cold, ~2.5 min seeded on an H200)")
    cc.add_argument("action", choices=["pack", "unpack"])
    cc.add_argument("--cache", default=os.environ.get("TORCHINDUCTOR_CACHE_DIR", "~/.cache/seekserve/inductor"),
                    help="the Inductor cache folder (default: $TORCHINDUCTOR_CACHE_DIR, else the cluster files' "
                         "~/.cache/seekserve/inductor)")
    cc.add_argument("--out", default="configs/compile-cache", help="pack: where the parts go (the folder "
                    "cluster.yaml mounts on every node with configs/)")
    cc.add_argument("--part-mib", type=float, default=64.0, help="pack: the size of each part")
    cc.add_argument("--max-mib", type=float, default=None, help="pack: write nothing if the packed cache is larger")
    cc.add_argument("--parts", default="~/seekserve/configs/compile-cache",
                    help="unpack: the folder of parts (where cluster.yaml mounts configs/compile-cache)")
    cc.set_defaults(func=cmd_cluster_compile_cache)

    st = sub.add_parser("status", help="replicas, queue, GPU and autoscaler decisions per variant")
    st.add_argument("--address", default="auto", help="Ray address (default: the running cluster)")
    st.add_argument("--app", default=None, help="only this Serve application")
    st.add_argument("--url", default="http://127.0.0.1:8000", help="ingress URL for engine stats ('' to skip)")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    t = sub.add_parser("trace", help="trace tools")
    tsub = t.add_subparsers(dest="trace_command", required=True)
    top = tsub.add_parser("top", help="top leaf spans by share of the root's time (OTLP JSON lines)")
    top.add_argument("file")
    top.add_argument("--root", default="", help="root span name prefix, e.g. 'chat'")
    top.add_argument("-k", type=int, default=3)
    top.set_defaults(func=cmd_trace_top)

    from rollout.cli import add_parser as add_rollout_parser

    add_rollout_parser(sub)

    c = sub.add_parser("config", help="configuration tools")
    csub = c.add_subparsers(dest="config_command", required=True)
    v = csub.add_parser("validate", help="validate an app config YAML")
    v.add_argument("config")
    v.set_defaults(func=cmd_config_validate)
    m = csub.add_parser("memory", help="each hf variant's weights and KV cache per GPU, and whether they fit")
    m.add_argument("config")
    m.add_argument("--gpu-memory-gib", type=_positive_float, required=True,
                   help="memory of one GPU in GiB, nvidia-smi's total MiB / 1024 (an H100 80GB: 79.6)")
    m.set_defaults(func=cmd_config_memory)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
