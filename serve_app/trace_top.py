"""``seekserve trace top FILE``: where did the time of a request go?

Reads OTLP JSON lines, rebuilds each trace's call tree from parent span ids,
and for a root (the ingress request span by default) lists the leaf spans that
took the largest share of the root's duration, summed over all matching traces.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    children: list = field(default_factory=list)
    events: dict = field(default_factory=dict)  # name -> time (ns) of its first occurrence

    @property
    def duration_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)


def read_spans(path: str | Path) -> list[Span]:
    spans = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        doc = json.loads(line)
        for rs in doc.get("resourceSpans", []):
            for ss in rs.get("scopeSpans", []):
                for s in ss.get("spans", []):
                    events = {}
                    for e in s.get("events", []):
                        events.setdefault(e["name"], int(e["timeUnixNano"]))
                    spans.append(Span(s["traceId"], s["spanId"], s.get("parentSpanId", ""), s["name"],
                                      int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"]), events=events))
    return spans


def build_trees(spans: list[Span]) -> list[Span]:
    by_id = {(s.trace_id, s.span_id): s for s in spans}
    roots = []
    for s in spans:
        parent = by_id.get((s.trace_id, s.parent_id)) if s.parent_id else None
        if parent is None:
            roots.append(s)
        else:
            parent.children.append(s)
    return roots


def leaves(span: Span) -> list[Span]:
    if not span.children:
        return [span]
    return [leaf for c in span.children for leaf in leaves(c)]


def top_leaves(path: str | Path, root_prefix: str = "", k: int = 3) -> tuple[list[tuple[str, float, float]], int, float]:
    """[(leaf name, total seconds, share of root time)], number of roots, total root seconds."""
    roots = [r for r in build_trees(read_spans(path)) if r.name.startswith(root_prefix)]
    total_root = sum(r.duration_ns for r in roots)
    per_leaf: dict[str, int] = defaultdict(int)
    for r in roots:
        covered = 0
        for leaf in leaves(r):
            if leaf is r:
                continue
            per_leaf[leaf.name] += leaf.duration_ns
            covered += leaf.duration_ns
        # time the root spent outside any child: its own work (HTTP, routing, serialisation)
        per_leaf[f"{r.name.split(' ')[0]} (self)"] += max(0, r.duration_ns - covered)
    ranked = sorted(per_leaf.items(), key=lambda kv: -kv[1])[:k]
    return [(name, ns / 1e9, ns / total_root if total_root else 0.0) for name, ns in ranked], len(roots), total_root / 1e9


def render(path: str | Path, root_prefix: str = "", k: int = 3) -> str:
    rows, n, total = top_leaves(path, root_prefix, k)
    if n == 0:
        return f"no root spans matching {root_prefix!r} in {path}"
    out = [f"{n} request(s), {total:.3f} s in total; top {len(rows)} leaf spans by share of the root's time:"]
    for i, (name, secs, share) in enumerate(rows, 1):
        out.append(f"  {i}. {name:<28} {secs:9.3f} s  {100 * share:5.1f}%")
    return "\n".join(out)
