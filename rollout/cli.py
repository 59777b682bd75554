"""``seekserve rollout ...``: the admin API from the command line.

The token comes from $SEEKSERVE_ADMIN_TOKEN; the ingress URL from --url."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx
import yaml


class AdminClient:
    def __init__(self, url: str, token: str | None):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def call(self, method: str, path: str, body=None):
        r = httpx.request(method, self.url + path, json=body, headers=self.headers, timeout=30)
        data = r.json() if r.content else None
        if r.status_code >= 400:
            msg = (data or {}).get("error", {}).get("message", r.text) if isinstance(data, dict) else r.text
            raise SystemExit(f"error {r.status_code}: {msg}")
        return data


def render(view: dict) -> str:
    p, s, w = view["plan"], view["state"], view["weights"]
    icon = {"Healthy": "✔", "Degraded": "✖", "Aborted": "✖", "Paused": "॥", "Progressing": "◌"}.get(s["phase"], "?")
    lines = [
        f"Name:      {p['name']}",
        f"Model:     {p['model']}",
        f"Status:    {icon} {s['phase']}",
        f"Message:   {s['message']}",
        f"Step:      {min(s['step_index'], len(p['steps']))}/{len(p['steps'])}",
        "Weights:   " + ", ".join(f"{k}={v}%" for k, v in w.items()),
        "Steps:",
    ]
    for i, step in enumerate(p["steps"]):
        mark = "✔" if i < s["step_index"] else ("▶" if i == s["step_index"] and s["phase"] not in ("Healthy",) else " ")
        desc = next(iter(step.items()))
        lines.append(f"  {mark} {i + 1}. {desc[0]}: {json.dumps(desc[1])}")
    if s.get("gates"):
        lines.append("Gates (last evaluation):")
        for g in s["gates"]:
            val = "n/a" if g.get("value") is None else f"{g['value']:.4g}"
            lines.append(f"  {g['metric']:<15} {g['status']:<12} value {val:<8} threshold {g['threshold']:g}  "
                         f"({g['samples']} samples) {g['reason']}")
    return "\n".join(lines)


def run(args) -> int:
    client = AdminClient(args.url, os.environ.get("SEEKSERVE_ADMIN_TOKEN"))
    if args.rollout_command == "start":
        text = Path(args.plan).read_text()
        plan = yaml.safe_load(text)
        print(render(client.call("POST", "/admin/rollouts", plan)))
    elif args.rollout_command == "status":
        if args.name is None:
            for v in client.call("GET", "/admin/rollouts"):
                print(f"{v['plan']['name']}: {v['state']['phase']} {v['weights']}")
            return 0
        while True:
            view = client.call("GET", f"/admin/rollouts/{args.name}")
            if args.watch:
                sys.stdout.write("\033[2J\033[H")
            print(render(view), flush=True)
            if not args.watch or view["state"]["phase"] in ("Healthy", "Degraded", "Aborted"):
                return 0
            time.sleep(args.interval_s)
    elif args.rollout_command in ("promote", "abort", "retry"):
        path = "promote-full" if args.rollout_command == "promote" and args.full else args.rollout_command
        print(render(client.call("POST", f"/admin/rollouts/{args.name}/{path}")))
    elif args.rollout_command == "set-weights":
        print(render(client.call("POST", f"/admin/rollouts/{args.name}/weights", {"canary_weight": args.canary})))
    elif args.rollout_command == "history":
        for h in client.call("GET", f"/admin/rollouts/{args.name}/history"):
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["at"]))
            print(f"{when}  {h['who']:<10} step {h['step']:<2} {h['phase']:<11} canary {h['canary_weight']:>3}%  "
                  f"{h['decision']:<16} {h['reason']}")
    return 0


def add_parser(sub) -> None:
    r = sub.add_parser("rollout", help="canary rollouts (admin API; token in $SEEKSERVE_ADMIN_TOKEN)")
    r.add_argument("--url", default="http://127.0.0.1:8000", help="ingress URL")
    rs = r.add_subparsers(dest="rollout_command", required=True)
    s = rs.add_parser("start", help="start a rollout from a plan file (YAML or JSON)")
    s.add_argument("plan")
    st = rs.add_parser("status", help="show a rollout (all without a name)")
    st.add_argument("name", nargs="?")
    st.add_argument("--watch", "-w", action="store_true", help="refresh until it ends")
    st.add_argument("--interval-s", type=float, default=2.0)
    p = rs.add_parser("promote", help="skip the current pause/analysis step")
    p.add_argument("name")
    p.add_argument("--full", action="store_true", help="straight to 100%%")
    for cmd, help_ in (("abort", "canary to 0%% now"), ("retry", "restart a rolled-back rollout"),
                       ("history", "the audit log")):
        c = rs.add_parser(cmd, help=help_)
        c.add_argument("name")
    w = rs.add_parser("set-weights", help="set the canary's weight by hand")
    w.add_argument("name")
    w.add_argument("--canary", type=int, required=True)
    r.set_defaults(func=run)
