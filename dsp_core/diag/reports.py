"""Reports of a diagnostics state (the live process's, a dump file's or a flight file's)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dsp_core.diag.trace import render_top_ops, top_ops
from dsp_core.errors import DSPError

FORMAT_PREFIX = "dsp-diag/"


def load(path: str | Path) -> dict[str, Any]:
    """A dump or flight file; DSPError when it is not one."""
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise DSPError(f"cannot read diagnostics file {path}: {exc}") from exc
    if not isinstance(state, dict) or not str(state.get("format", "")).startswith(FORMAT_PREFIX):
        raise DSPError(f"{path} is not a DSP diagnostics dump (no 'format': '{FORMAT_PREFIX}N' field)")
    return state


def build_report(state: dict[str, Any], plan_ids: Iterable[int] | None = None) -> dict[str, Any]:
    """Per-category counts, recaptures, fallbacks, cache misses with explanations, terminal records."""
    # Counts are exact over the whole run (they survive the ring's wrap-around); message lists
    # come from the events still kept. plan_ids narrows the lists and terminal records only.
    wanted = set(plan_ids) if plan_ids is not None else None
    events = [e for e in state["events"] if wanted is None or e["plan"] in wanted or e["plan"] < 0]
    codes: dict[str, int] = state["codes"]
    return {
        "kind": state.get("kind"),
        "pid": state.get("pid"),
        "created": state.get("created"),
        "levels": state.get("levels", {}),
        "events_recorded": state.get("written", 0),
        "events_kept": len(state["events"]),
        "categories": {name: agg for name, agg in state["aggregates"].items() if agg["count"]},
        "codes": codes,
        "graph_replay": {k: codes.get(f"GRAPH_REPLAY.{k}", 0) for k in ("recapture", "refresh", "stale_redispatch")},
        "fallbacks": {"count": codes.get("AUCTION.fallback", 0), "detail": _messages(events, "AUCTION", "fallback")},
        "cache": {
            **{k: codes.get(f"CACHE.{k}", 0) for k in ("build", "hit", "miss", "evict")},
            "miss_explanations": _messages(events, "CACHE", "miss"),
        },
        "transfers": _transfers(events, codes),
        "errors": _messages(events, "EXECUTE", "error"),
        "terminal": [t for t in state["terminal"] if wanted is None or t["plan"] in wanted],
        "top_ops": top_ops(state.get("ops", {})),
        **({"error": state["error"]["type"] + ": " + state["error"]["message"]} if "error" in state else {}),
    }


# The reasons of cross-device copies (dsp_core.devices.transfers.Reason), as TRANSFER codes.
TRANSFER_REASONS = ("activation", "constant_replication", "kv_cache", "input_migration", "output_return")


def _transfers(events: list[dict[str, Any]], codes: dict[str, int]) -> dict[str, Any]:
    """Cross-device copies per reason (count: exact; bytes: over the kept events) and device switches."""
    by_reason = {}
    for reason in TRANSFER_REASONS:
        count = codes.get(f"TRANSFER.{reason}", 0)
        if count:
            kept = [e["payload"] for e in events if e["category"] == "TRANSFER" and e["code"] == reason]
            by_reason[reason.upper()] = {"copies": count, "bytes_kept": int(sum(kept)), "copies_kept": len(kept)}
    return {"by_reason": by_reason, "device_switches": codes.get("MULTI_DEVICE.switch", 0)}


def _messages(events: list[dict[str, Any]], category: str, code: str) -> list[dict[str, Any]]:
    """Distinct messages of one kind of event, most frequent first."""
    counts = Counter(e["message"] for e in events if e["category"] == category and e["code"] == code)
    return [{"message": m, "count": n} for m, n in counts.most_common()]


def render_report(rep: dict[str, Any]) -> str:
    """The report as text."""
    lines = [f"diagnostics {rep['kind']} of pid {rep['pid']} ({rep['created']})"]
    if rep.get("error"):
        lines.append(f"error: {rep['error']}")
    levels = ", ".join(f"{c}={lv.lower()}" for c, lv in rep["levels"].items()) or "off"
    lines.append(f"recording: {levels}; {rep['events_recorded']} events recorded, {rep['events_kept']} kept")
    lines += ["", "category        count          sum          min          max"]
    for name, a in rep["categories"].items():
        lines.append(f"{name:<13} {a['count']:>7} {a['sum']:>12.6g} {a['min']:>12.6g} {a['max']:>12.6g}")
    g = rep["graph_replay"]
    lines.append(
        f"\nrecaptures {g['recapture']}, refreshes {g['refresh']}, stale re-dispatches {g['stale_redispatch']}"
    )
    c = rep["cache"]
    lines.append(f"plan cache: {c['build']} builds, {c['hit']} hits, {c['miss']} misses, {c['evict']} evictions")
    lines += [f"  miss x{m['count']}: {m['message']}" for m in c["miss_explanations"]]
    t = rep.get("transfers", {})
    if t.get("by_reason") or t.get("device_switches"):
        lines.append(f"cross-device: {t['device_switches']} device switches")
        for reason, r in t["by_reason"].items():
            lines.append(
                f"  {reason:<21} {r['copies']:>7} copies, {r['bytes_kept']} bytes in the {r['copies_kept']} kept"
            )
    lines.append(f"fallbacks: {rep['fallbacks']['count']}")
    lines += [f"  x{m['count']}: {m['message']}" for m in rep["fallbacks"]["detail"]]
    lines += [f"error x{m['count']}: {m['message']}" for m in rep["errors"]]
    lines += ["", _render_terminal(rep["terminal"])]
    if rep["top_ops"]:
        lines += ["", render_top_ops(rep["top_ops"])]
    return "\n".join(lines)


def _render_terminal(records: list[dict[str, Any]]) -> str:
    if not records:
        return "terminal records: none"
    lines = ["terminal records (why each segment ended where it did):"]
    for t in records:
        lines.append(f"  plan {t['plan']} {t['what']}: {t['state']} at execution {t['execution']}: {t['reason']}")
    return "\n".join(lines)


def render_dump(state: dict[str, Any], limit: int = 60) -> str:
    """A dump or flight file as text: the error, terminal records, the last ``limit`` events."""
    lines = [f"{state['kind']} of pid {state['pid']} ({state['created']}), {state['written']} events recorded"]
    if "error" in state:
        lines.append(f"error: {state['error']['type']}: {state['error']['message']}")
    lines += ["", _render_terminal(state["terminal"]), ""]
    events = state["events"][-limit:] if limit else state["events"]
    lines.append(f"last {len(events)} of {len(state['events'])} kept events (ms relative to the first shown):")
    t0 = events[0]["ts"] if events else 0
    for e in events:
        where = "/".join(str(x) for x in (e["plan"], e["segment"], e["slot"]))
        lines.append(
            f"  {(e['ts'] - t0) / 1e6:>10.3f}  {e['category']:<12} {e['level'].lower():<8} {where:<10} "
            f"{e['code']:<12} {e['message']}" + (f"  [{e['payload']:g}]" if e["payload"] else "")
        )
    return "\n".join(lines)
