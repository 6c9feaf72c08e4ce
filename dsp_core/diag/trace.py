"""Op timings exported: a Chrome/Perfetto trace (load it in ui.perfetto.dev) and a top-ops table."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dsp_core.diag.events import Category, Event


def chrome_trace(events: Iterable[Event], pid: int | None = None) -> dict[str, Any]:
    """``{"traceEvents": [...]}``: "X" spans for slots, segments, units; "i" marks for other events."""
    pid = os.getpid() if pid is None else pid
    tids: dict[int, int] = {}
    backend: dict[tuple[int, int], str] = {}  # (thread, segment) -> backend of the segment's last span
    out: list[dict[str, Any]] = []
    for e in events:
        tid = tids.setdefault(e.thread, len(tids) + 1)
        if e.category is not Category.TIMING:
            out.append(_instant(e, pid, tid))
            continue
        if e.slot < 0 and e.code == "segment":
            backend[(e.thread, e.segment)] = e.message
        out.append(_span(e, pid, tid, backend.get((e.thread, e.segment), "")))
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": "dsp"}}]
    for thread, tid in tids.items():
        name = f"device {-thread - 1}" if thread < 0 else f"host thread {tid}"
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
    return {"traceEvents": meta + out, "displayTimeUnit": "ms"}


def _span(e: Event, pid: int, tid: int, backend: str) -> dict[str, Any]:
    if e.slot >= 0:
        name, cat = f"{e.code} {e.message}", f"segment {e.segment}/{backend or '?'}"
    elif e.code == "segment":
        name, cat = f"segment {e.segment} ({e.message})", f"segment {e.segment}/{e.message}"
    else:
        name, cat = f"{e.code} {e.segment} ({e.message})", e.code
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "ts": e.ts / 1e3,
        "dur": max(e.payload, 0) / 1e3,
        "pid": pid,
        "tid": tid,
        "args": {"plan": e.plan, "segment": e.segment, "slot": e.slot},
    }


def _instant(e: Event, pid: int, tid: int) -> dict[str, Any]:
    return {
        "name": f"{e.category.name} {e.code}",
        "cat": e.category.name,
        "ph": "i",
        "s": "t",
        "ts": e.ts / 1e3,
        "pid": pid,
        "tid": tid,
        "args": {"message": e.message, "payload": e.payload, "plan": e.plan, "segment": e.segment},
    }


def write_trace(path: str | os.PathLike[str], events: Iterable[Event]) -> Path:
    """Write the trace JSON of ``events`` to ``path``."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(chrome_trace(events)))
    return target


def top_ops(op_totals: dict[str, dict[str, float]], n: int = 10) -> list[dict[str, Any]]:
    """The ``n`` ops with the largest total time: op, calls, total ms, mean us, share of all."""
    grand = sum(a["sum"] for a in op_totals.values()) or 1.0
    ranked = sorted(op_totals.items(), key=lambda kv: kv[1]["sum"], reverse=True)[:n]
    return [
        {
            "op": op,
            "calls": int(a["count"]),
            "total_ms": a["sum"] / 1e6,
            "mean_us": a["sum"] / max(a["count"], 1) / 1e3,
            "share": a["sum"] / grand,
        }
        for op, a in ranked
    ]


def render_top_ops(rows: list[dict[str, Any]]) -> str:
    """The top-ops table as text."""
    lines = [f"{'op':<24} {'calls':>7} {'total ms':>10} {'mean us':>10} {'share':>7}"]
    for r in rows:
        lines.append(f"{r['op']:<24} {r['calls']:>7} {r['total_ms']:>10.3f} {r['mean_us']:>10.2f} {r['share']:>6.1%}")
    return "\n".join(lines)
