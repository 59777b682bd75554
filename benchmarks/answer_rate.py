"""How often a served model answers a known question, per sampling setting.

Against a running app (e.g. ``make serve``): asks the same chat question N times with each setting (the
app's own default first, i.e. no temperature in the request) and counts answers that contain the expected
word. Used to choose the embedded model's ``sampling_defaults``.

    python benchmarks/answer_rate.py --base http://127.0.0.1:8000 --out results/answer_rate.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx

SETTINGS = {"app default": {}, "temperature 1.0": {"temperature": 1.0},
            "temperature 0.2, top_p 0.9": {"temperature": 0.2, "top_p": 0.9}, "temperature 0": {"temperature": 0}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--question", default="What is the capital of France?")
    p.add_argument("--expect", default="Paris")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--out", default="results/answer_rate.json")
    args = p.parse_args()
    rows = []
    with httpx.Client(base_url=args.base, timeout=120) as client:
        for name, extra in SETTINGS.items():
            answers = []
            for _ in range(args.n):
                body = {"model": args.model, "messages": [{"role": "user", "content": args.question}],
                        "max_tokens": args.max_tokens, **extra}
                r = client.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                answers.append(r.json()["choices"][0]["message"]["content"])
            hits = sum(args.expect.lower() in a.lower() for a in answers)
            rows.append({"setting": name, "request": extra, "n": args.n, "answered": hits,
                         "examples": sorted(set(answers))[:5]})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"question": args.question, "expect": args.expect, "rows": rows}, indent=2))
    print(f"{args.question!r}, answers containing {args.expect!r}, of {args.n}:")
    print(f"{'setting':<30}{'answered':>9}")
    for r in rows:
        print(f"{r['setting']:<30}{r['answered']:>9}")


if __name__ == "__main__":
    main()
