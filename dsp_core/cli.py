"""The ``dsp`` command: backends, run, ops, plan show / explain / dot, cache, diag, config.

Every DSPError becomes one line on stderr and exit status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dsp_core.backends.modes import FALLBACK_CHAINS, GraphExecutionMode
from dsp_core.errors import DSPError, InputError


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dsp`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except DSPError as exc:
        print(f"dsp: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `dsp ops list | head`: the reader left; not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (so the interpreter's final flush is quiet)
        return 0
    except Exception as exc:  # noqa: BLE001  (a DSP bug: one line saying where, not a 40-line traceback)
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        print(
            f"dsp: internal error: {type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno}); "
            "this is a DSP bug, please report it with the model that caused it",
            file=sys.stderr,
        )
        return 3


def _parser() -> argparse.ArgumentParser:
    from dsp_core import __version__

    p = argparse.ArgumentParser(prog="dsp", description="DSP: compile-once, replay-many graph executor")
    p.add_argument("--version", action="version", version=f"dsp-core {__version__}")
    sub = p.add_subparsers(title="commands")

    backends = sub.add_parser("backends", help="installed backends").add_subparsers(title="backends commands")
    bl = backends.add_parser("list", help="every backend: distribution, mode, platform, availability, AUTO rank")
    bl.add_argument("--json", action="store_true", help="print JSON")
    bl.set_defaults(func=cmd_backends_list)

    run = sub.add_parser("run", help="run a model once and print its outputs")
    run.add_argument("model", help="an .onnx file")
    run.add_argument(
        "--input", "-i", action="append", default=[], metavar="NAME=FILE.npy", help="a feed from a .npy file"
    )
    run.add_argument("--random-inputs", action="store_true", help="feed random data to every input not given")
    run.add_argument(
        "--dim", action="append", default=[], metavar="SYMBOL=N", help="size of a symbolic dim (default 1)"
    )
    run.add_argument("--mode", default=None, help="execution mode (default: DSP_MODE, else auto)")
    run.add_argument("--save", metavar="DIR", help="write each output to DIR/NAME.npy")
    run.add_argument("--json", action="store_true", help="print JSON")
    run.add_argument("--trace", metavar="OUT.json", help="time every slot: write a Perfetto trace, print top ops")
    run.set_defaults(func=cmd_run)

    ops = sub.add_parser("ops", help="the op table").add_subparsers(title="ops commands")
    ol = ops.add_parser("list", help="every op: domain, opset range, traits, which installed backends take it")
    ol.add_argument("--json", action="store_true", help="print JSON")
    ol.set_defaults(func=cmd_ops_list)

    plan = sub.add_parser("plan", help="inspect the compiled plan").add_subparsers(title="plan commands")
    show = plan.add_parser("show", help="slot table: op, inputs, outputs, shapes, traits, releases")
    show.add_argument("model")
    show.add_argument("--mode", default=None, help="execution mode (default: DSP_MODE, else auto)")
    show.add_argument("--json", action="store_true")
    _add_runs(show, 0, "then show the plan phase, per-slot phases and unit counters")
    show.set_defaults(func=cmd_plan_show)
    dot = plan.add_parser("dot", help="Graphviz source of the plan, slots coloured by unit (sealed grey)")
    dot.add_argument("model")
    dot.add_argument("--mode", default=None, help="execution mode (default: DSP_MODE, else auto)")
    _add_runs(dot, 3, "so the plan freezes and its units exist")
    _add_devices(dot)
    dot.set_defaults(func=cmd_plan_dot)
    expl = plan.add_parser("explain", help="per segment: the winning backend, bids and every decline; merged products")
    expl.add_argument("model")
    expl.add_argument("--mode", default=None, help="execution mode (default: DSP_MODE, else auto)")
    expl.add_argument("--strict", action="store_true", default=None, help="fail instead of falling back (DSP_STRICT)")
    expl.add_argument("--json", action="store_true")
    _add_runs(expl, 0, "then show the frozen plan's islands and gaps (with each gap's reason) and the timed trials")
    _add_devices(expl)
    expl.add_argument(
        "--devices", action="store_true", help="show the placement: slots, weight bytes and budget per device, the cuts"
    )
    expl.set_defaults(func=cmd_plan_explain)
    fuse = plan.add_parser(
        "fuse", help="merged products, then fusion groups: each group's template and slots, kernels vs slots per step"
    )
    fuse.add_argument("model")
    fuse.add_argument("--backend", help="group with this backend's fusion policy (default: the reference policy)")
    fuse.add_argument("--decode", action="store_true", help="the decode plan GenerationPipeline builds (fixed KV)")
    fuse.add_argument("--max-length", type=int, default=64, metavar="L", help="KV buffer length for --decode (64)")
    fuse.add_argument("--json", action="store_true")
    fuse.set_defaults(func=cmd_plan_fuse)

    cache = sub.add_parser("cache", help="the on-disk plan cache (DSP_CACHE_DIR)").add_subparsers(
        title="cache commands"
    )
    for name, func, text in (
        ("ls", cmd_cache_ls, "every entry of every build: key, build, object, size, last use, status"),
        ("info", cmd_cache_info, "directory, size and bound, entry, build and quarantine counts, fingerprint"),
        ("clear", cmd_cache_clear, "remove every entry (quarantine/ too with --all)"),
        ("verify", cmd_cache_verify, "check every entry in full; quarantine bad ones (exit 1 if any)"),
    ):
        cmd = cache.add_parser(name, help=text)
        cmd.add_argument("--json", action="store_true", help="print JSON")
        cmd.set_defaults(func=func)
        if name == "clear":
            cmd.add_argument("--all", action="store_true", help="also empty quarantine/")

    diag = sub.add_parser("diag", help="diagnostics dumps and flight-recorder files").add_subparsers(
        title="diag commands"
    )
    dshow = diag.add_parser("show", help="render a dump or flight file: error, terminal records, last events")
    dshow.add_argument("file")
    dshow.add_argument("--limit", type=int, default=60, help="events shown (0 = all; default 60)")
    dshow.add_argument("--json", action="store_true", help="print the file's JSON")
    dshow.set_defaults(func=cmd_diag_show)
    dreport = diag.add_parser("report", help="counts, recaptures, fallbacks, cache misses, terminal records")
    dreport.add_argument("file", nargs="?", help="a dump or flight file (default: this process's state)")
    dreport.add_argument("--json", action="store_true", help="print JSON")
    dreport.set_defaults(func=cmd_diag_report)

    from dsp_core.llm.cli import add_llm_commands

    add_llm_commands(sub)  # `dsp generate`, `dsp validate` (dsp_core/llm/cli.py)

    plugin = sub.add_parser("plugin", help="start a backend of your own").add_subparsers(title="plugin commands")
    pnew = plugin.add_parser("new", help="write a working, installable backend distribution with its tests")
    pnew.add_argument("name", help="the backend's name (a lower-case identifier): dsp-NAME, package dsp_NAME")
    pnew.add_argument("--mode", default="mlir_cpu_jit", help="the CPU mode it serves (default mlir_cpu_jit)")
    pnew.add_argument("--dir", help="where to write it (default ./dsp-NAME; must not exist or be empty)")
    pnew.set_defaults(func=cmd_plugin_new)

    conf = sub.add_parser("config", help="every option: current value and where it came from")
    conf.add_argument("--json", action="store_true", help="print JSON")
    conf.set_defaults(func=cmd_config)
    return p


def _add_runs(cmd: argparse.ArgumentParser, default: int, why: str) -> None:
    cmd.add_argument(
        "--runs", type=int, default=default, metavar="N", help=f"run N times on random inputs first, {why}"
    )
    cmd.add_argument(
        "--dim", action="append", default=[], metavar="SYMBOL=N", help="size of a symbolic dim (default 1)"
    )


# -- backends ---------------------------------------------------------------------------
def backends_table() -> dict[str, Any]:
    """What `dsp backends list` shows, as a dict."""
    from dsp_core.backends.auction import candidates
    from dsp_core.backends.discovery import discover

    registry = discover()
    try:
        chain, notes = candidates(registry, GraphExecutionMode.AUTO)
        auto = [b.name for b in chain]
    except DSPError as exc:
        auto, notes = [], [str(exc)]
    rows = []
    for b in registry.backends:
        row = b.describe()
        order = FALLBACK_CHAINS.get(b.platform, ())
        row["chain_rank"] = order.index(b.mode) + 1 if b.mode in order else None
        row["auto_position"] = auto.index(b.name) + 1 if b.name in auto else None
        rows.append(row)
    failures = [f.__dict__ for f in registry.failures]
    from dsp_core.backends.auction import auto_excluded

    left_out = sorted(n for n in auto_excluded() if any(b.name == n for b in registry.backends))
    return {"backends": rows, "auto": auto, "auto_excluded": left_out, "failures": failures, "notes": notes}


def cmd_backends_list(args: argparse.Namespace) -> int:
    """`dsp backends list`."""
    table = backends_table()
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    rows = [["name", "mode", "platform", "distribution", "available", "AUTO rank"]]
    for r in table["backends"]:
        avail = "yes" if r["available"] else f"no: {r['reason']}"
        rank = f"{r['auto_position']}" if r["auto_position"] else (f"({r['chain_rank']})" if r["chain_rank"] else "-")
        rows.append([r["name"], r["mode"], r["platform"], f"{r['distribution']} {r['version']}", avail, rank])
    _print_table(rows)
    print(f"\nAUTO resolves to: {' -> '.join(table['auto']) or '(nothing)'}")
    if table["auto_excluded"]:
        print(
            f"left out of AUTO by DSP_AUTO_EXCLUDE: {', '.join(table['auto_excluded'])} "
            "(named modes still run them; DSP_AUTO_EXCLUDE=none lets AUTO use them: docs/cpu-backends.md)"
        )
    for f in table["failures"]:
        print(f"failed plugin {f['entry_point']} ({f['distribution']}, at {f['stage']}): {f['error']}")
    return 0


# -- ops --------------------------------------------------------------------------------
def ops_table() -> dict[str, Any]:
    """What `dsp ops list` shows: every op, its opsets and traits, and each backend's answer."""
    from dsp_core.backends.base import SlotView
    from dsp_core.backends.discovery import discover
    from dsp_core.ops.registry import Trait, all_ops

    backends = discover().backends
    rows = []
    for opdef in all_ops():
        view = SlotView(0, opdef.name, opdef.domain, opdef.traits, {}, (), ())
        support: dict[str, bool | str] = {}
        for b in backends:
            if not b.availability().ok:
                support[b.name] = f"unavailable: {b.availability().reason}"
                continue
            decline = b.supports(view)
            support[b.name] = True if decline is None else str(decline)
        rows.append(
            {
                "op": opdef.name,
                "domain": opdef.domain or "ai.onnx",
                "since": opdef.since,
                "until": opdef.until,
                "inputs": list(opdef.inputs),
                "outputs": list(opdef.outputs),
                "traits": [t.name for t in Trait if t.name and t.value and opdef.traits & t],
                "has_shape_rule": opdef.shape_rule is not None,
                "backends": support,
            }
        )
    return {"ops": rows, "backends": [b.name for b in backends]}


def _support_mark(answer: bool | str) -> str:
    if answer is True:
        return "yes"
    return "n/a" if str(answer).startswith("unavailable") else "no"


def cmd_ops_list(args: argparse.Namespace) -> int:
    """`dsp ops list`."""
    table = ops_table()
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    rows = [["op", "domain", "opsets", "traits", *table["backends"]]]
    for r in table["ops"]:
        opsets = f"{r['since']}..{r['until'] if r['until'] is not None else ''}"
        marks = [_support_mark(r["backends"][b]) for b in table["backends"]]
        rows.append([r["op"], r["domain"], opsets, ",".join(t.lower() for t in r["traits"]) or "-", *marks])
    _print_table(rows)
    print(f"\n{len(table['ops'])} ops")
    return 0


# -- run --------------------------------------------------------------------------------
def _dims(specs: list[str]) -> dict[str, int]:
    out = {}
    for spec in specs:
        name, _, val = spec.partition("=")
        if not val.isdigit():
            raise InputError(f"--dim {spec!r}: expected SYMBOL=N with N a non-negative integer")
        out[name] = int(val)
    return out


def random_feeds(model: Any, dims: dict[str, int], given: set[str], seed: int = 0) -> dict[str, np.ndarray]:
    """Random arrays for every input not in ``given``: floats ~ N(0,1), ints in [0, 2), bools.

    A decoder with the usual KV naming gets consistent feeds instead: the attention mask
    covers past + new tokens (ones) and position ids count on from the past length.
    """
    from dsp_core.ir import dtypes

    rng = np.random.default_rng(seed)
    inputs = fed_inputs(model)
    _check_dim_symbols(inputs, dims)
    asked = dict(dims)
    dims = {**_decoder_dims(inputs, dims), **dims}
    planned = []
    for name, dtype, dshape in inputs:
        if name in given:
            continue
        if dtype is None or dshape is None:
            raise InputError(f"input {name!r} has no declared dtype/shape; pass it with --input")
        shape = tuple(d if isinstance(d, int) else dims.get(str(d), 1) for d in dshape)
        planned.append((name, dtype, dshape, shape))
    _check_feed_bytes(planned, asked)
    feeds = {}
    for name, dtype, _, shape in planned:
        dt = dtypes.to_numpy(dtype)
        if name == "attention_mask" and dims.get("__decoder__"):
            feeds[name] = np.ones(shape, dt)
        elif name == "position_ids" and dims.get("__decoder__") and len(shape) == 2:
            past = dims["__past__"]
            feeds[name] = np.broadcast_to(np.arange(past, past + shape[1], dtype=dt), shape).copy()
        elif dt.kind == "f" or dtype == "bfloat16":
            feeds[name] = rng.standard_normal(shape).astype(dt)
        elif dt.kind == "b":
            feeds[name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[name] = rng.integers(0, 2, shape).astype(dt)
    return feeds


InputInfo = tuple[str, str | None, tuple[Any, ...] | None]  # name, dtype, shape (ints and symbols)


def _check_dim_symbols(inputs: list[InputInfo], dims: dict[str, int]) -> None:
    """InputError for a --dim naming a symbol no input has (it would be silently ignored)."""
    symbols = list(dict.fromkeys(str(d) for _, _, shape in inputs for d in shape or () if not isinstance(d, int)))
    unknown = [k for k in dims if k not in symbols]
    if not unknown:
        return
    has = f"its symbolic dims are {', '.join(symbols)}" if symbols else "its inputs have no symbolic dims"
    listed = ", ".join(f"{name}{list(shape) if shape is not None else ''}" for name, _, shape in inputs[:8])
    raise InputError(
        f"--dim {', '.join(f'{k}={dims[k]}' for k in unknown)}: the model has no symbolic dim "
        f"{' or '.join(repr(k) for k in unknown)}; {has} (inputs: {listed}{', ...' if len(inputs) > 8 else ''})"
    )


def _check_feed_bytes(planned: list[tuple[str, str, tuple[Any, ...], tuple[int, ...]]], asked: dict[str, int]) -> None:
    """InputError, before allocating, when the random inputs would not fit in memory (or pass DSP's tensor bound)."""
    from dsp_core import config
    from dsp_core.cache.memory import available_host_bytes
    from dsp_core.ir import dtypes

    sizes = []
    for name, dtype, dshape, shape in planned:
        elements = math.prod(shape)
        sizes.append((elements * dtypes.to_numpy(dtype).itemsize, elements, name, dtype, dshape, shape))
    if not sizes:
        return
    total = sum(b for b, *_ in sizes)
    nbytes, elements, name, dtype, dshape, shape = max(sizes)
    used = [k for k in asked if k in {str(d) for d in dshape}] or list(asked)
    culprit = f"--dim {', '.join(f'{k}={asked[k]}' for k in used)}" if used else f"input {name!r} as declared"
    detail = f"input {name!r} {list(dshape)} = {list(shape)} {dtype}: {_bytes(nbytes)}"
    limit = int(config.get("max_tensor_elements"))
    if elements > limit:
        raise InputError(
            f"{culprit}: {detail} has {elements} elements, more than DSP_MAX_TENSOR_ELEMENTS ({limit}); "
            "use a smaller --dim"
        )
    free = available_host_bytes()
    if total > free:
        raise InputError(
            f"{culprit}: the random inputs need {_bytes(total)} ({detail}), more than the {_bytes(free)} of memory "
            "available; use a smaller --dim"
        )


def _bytes(n: int) -> str:
    """``n`` bytes for a person: 2.24 TiB, 512 MiB, 12 B."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f"{n} B" if unit == "B" else f"{size:.3g} {unit}"
        size /= 1024
    return f"{n} B"


def fed_inputs(model: Any) -> list[InputInfo]:
    """(name, dtype, shape) of every input the model is fed, in graph order.

    From the plan when there is one, so a warm start from the disk cache never imports
    the model for this (the plan's placeholders and variables are the graph's inputs,
    in order, with their declared dtypes and shapes); from the graph when it was declined.
    """
    from dsp_core.plan.plan import ExternalClass

    plan = model.plan()
    if plan is not None:
        fed = (ExternalClass.PLACEHOLDER, ExternalClass.VARIABLE)
        return [(e.name, e.dtype, _shape(e.shape)) for e in plan.externals if e.cls in fed]
    graph = model.graph
    return [(v.name, v.dtype, _shape(v.shape)) for v in graph.inputs if v.name not in graph.initializers]


def _shape(shape: Any) -> tuple[Any, ...] | None:
    return None if shape is None else tuple(shape)


def _decoder_dims(inputs: list[InputInfo], dims: dict[str, int]) -> dict[str, int]:
    """For a KV decoder: the attention mask's length symbol = past length + new tokens."""
    from dsp_core.llm.kv import PAST

    pasts = [name for name, _, _ in inputs if PAST.match(name)]
    info = {name: shape for name, _, shape in inputs}
    mask, ids = info.get("attention_mask"), info.get("input_ids")
    if not pasts or mask is None or ids is None or not mask or not ids or not info[pasts[0]]:
        return {}
    past_shape = info[pasts[0]]
    assert past_shape is not None
    past_dim, seq_dim, total_dim = past_shape[2], ids[-1], mask[-1]
    past = past_dim if isinstance(past_dim, int) else dims.get(str(past_dim), 1)
    seq = seq_dim if isinstance(seq_dim, int) else dims.get(str(seq_dim), 1)
    out: dict[str, int] = {"__decoder__": 1, "__past__": past}
    if isinstance(total_dim, str):
        out[total_dim] = past + seq
    return out


def _load_inputs(specs: list[str]) -> dict[str, np.ndarray]:
    feeds = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            raise InputError(f"--input {spec!r}: expected NAME=FILE.npy")
        try:
            feeds[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise InputError(f"--input {name}: cannot read {path}: {exc}") from exc
    return feeds


def cmd_run(args: argparse.Namespace) -> int:
    """`dsp run MODEL`."""
    t_start = time.perf_counter()
    started = t_start - _process_age()  # the process's start on the perf_counter clock
    import dsp_core
    from dsp_core import progress

    if args.trace:
        _start_trace()
    t0 = time.perf_counter()
    progress.reset_timings()
    model = dsp_core.compile(args.model, mode=args.mode)
    t_compile = time.perf_counter() - t0
    compile_steps = progress.timings()
    feeds = _load_inputs(args.input)
    if args.dim and not args.random_inputs:
        raise InputError(f"--dim {' '.join(args.dim)}: --dim sizes the random inputs; add --random-inputs")
    if args.random_inputs:
        feeds.update(random_feeds(model, _dims(args.dim), set(feeds)))
    t1 = time.perf_counter()
    outs = model.run(feeds)
    t_run = time.perf_counter() - t1
    t_ran = time.perf_counter()
    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
        for name, arr in outs.items():
            np.save(Path(args.save) / f"{_safe(name)}.npy", arr)
    report: dict[str, Any] = {
        "model": str(args.model),
        "mode": model.mode.name,
        "backends": model.resolved_backends(),
        "declined": str(model.declined) if model.declined else None,
        "compile_ms": round(t_compile * 1e3, 3),
        "run_ms": round(t_run * 1e3, 3),
        "outputs": {name: _stats(arr) for name, arr in outs.items()},
    }
    if args.trace:
        report["trace"] = _finish_trace(args.trace)
    marks = {"started": started, "start": t_start, "compile": t0, "compiled": t0 + t_compile, "fed": t1, "ran": t_ran}
    report["times_ms"] = run_times(marks, compile_steps, time.perf_counter())
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"mode {report['mode']} -> {', '.join(report['backends'])}"
        f"{'  (declined: ' + report['declined'] + ')' if report['declined'] else ''}"
    )
    print(f"compile {report['compile_ms']:.1f} ms, run {report['run_ms']:.2f} ms")
    print(_render_times(report["times_ms"]))
    rows = [["output", "dtype", "shape", "min", "mean", "max"]]
    for name, st in report["outputs"].items():
        rows.append([name, st["dtype"], str(tuple(st["shape"])), _g(st["min"]), _g(st["mean"]), _g(st["max"])])
    _print_table(rows)
    if args.trace:
        from dsp_core.diag.trace import render_top_ops

        trace = report["trace"]
        print(f"\ntrace: {trace['path']} ({trace['events']} events; open it in ui.perfetto.dev); top ops:")
        print(render_top_ops(trace["top_ops"]))
    return 0


def _process_age() -> float:
    """Seconds since this process started (Linux: /proc, 10 ms resolution); 0.0 where unknown."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, in ticks since boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def run_times(marks: dict[str, float], compile_steps: list[tuple[str, float]], end: float) -> dict[str, Any]:
    """Where `dsp run`'s wall time went, in ms: contiguous parts that add up to ``total``.

    ``startup`` is the interpreter's start and every import (numpy, onnx, DSP, its
    backends) up to the command, ``compile`` the model's (broken down by its progress
    steps, the rest ``other``), then building the feeds, the run, and the output
    (statistics, saving).
    """
    ms = {
        "startup": marks["compile"] - marks["started"],
        "compile": marks["compiled"] - marks["compile"],
        "feeds": marks["fed"] - marks["compiled"],
        "run": marks["ran"] - marks["fed"],
        "output": end - marks["ran"],
    }
    steps: dict[str, float] = {}
    for label, seconds in compile_steps:
        steps[label] = steps.get(label, 0.0) + seconds
    steps["other"] = max(0.0, ms["compile"] - sum(steps.values()))
    out: dict[str, Any] = {k: round(v * 1e3, 3) for k, v in ms.items()}
    out["compile_steps"] = {k: round(v * 1e3, 3) for k, v in steps.items()}
    out["total"] = round((end - marks["started"]) * 1e3, 3)
    return out


def _render_times(t: dict[str, Any]) -> str:
    steps = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in t["compile_steps"].items() if v >= 5 or k != "other")
    parts = [f"{k} {t[k] / 1e3:.2f}" + (f" ({steps})" if k == "compile" else "") for k in _TIME_PARTS]
    return f"time {t['total'] / 1e3:.2f} s = " + " + ".join(parts)


_TIME_PARTS = ("startup", "compile", "feeds", "run", "output")


def _start_trace() -> None:
    """Time every slot from now on (TIMING at full level, on top of DSP_DIAGNOSTICS)."""
    from dsp_core import diag

    diag.configure_from_env()
    diag.enable_timing()


def _finish_trace(path: str) -> dict[str, Any]:
    """Write the trace of what ran; the top-10 ops by total time."""
    from dsp_core import diag
    from dsp_core.diag.trace import top_ops, write_trace

    events = diag.events()
    write_trace(path, events)
    return {"path": path, "events": len(events), "top_ops": top_ops(diag.RECORDER.op_totals(), 10)}


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def _stats(arr: np.ndarray) -> dict[str, Any]:
    st: dict[str, Any] = {"dtype": str(arr.dtype), "shape": list(arr.shape)}
    if arr.size and arr.dtype.kind in "biuf" or arr.dtype.name == "bfloat16":
        a = arr.astype(np.float64) if arr.size else arr
        st.update(min=float(a.min()), mean=float(a.mean()), max=float(a.max()))
    else:
        st.update(min=None, mean=None, max=None)
    return st


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


# -- plan -------------------------------------------------------------------------------
def plan_table(model: Any) -> dict[str, Any]:
    """What `dsp plan show` prints, as a dict."""
    plan = model.plan()
    if plan is None:
        return {"declined": str(model.declined), "slots": []}
    released_at: dict[int, int] = {}
    for s, values in enumerate(plan.release):
        for v in values:
            released_at[v] = s
    slots = []
    for slot in plan.slots:
        outs = []
        for v in slot.outputs:
            if v is None:
                continue
            dtype, shape = plan.ref_info(v)
            outs.append(
                {
                    "name": plan.ref_name(v),
                    "dtype": dtype,
                    "shape": _shape_str(shape),
                    "released_at": released_at.get(v),
                }
            )
        slots.append(
            {
                "slot": slot.index,
                "op": slot.op,
                "name": slot.name,
                "inputs": [plan.ref_name(r) if r is not None else "" for r in slot.inputs],
                "input_refs": list(slot.inputs),
                "outputs": outs,
                "traits": [t.name for t in type(slot.traits) if t and t in slot.traits and t.name],
                "releases": [plan.ref_name(v) for v in plan.release[slot.index]],
            }
        )
    externals = [
        {"index": k, "name": e.name, "class": e.cls.value, "dtype": e.dtype, "shape": _shape_str(e.shape)}
        for k, e in enumerate(plan.externals)
    ]
    return {"summary": plan.summary(), "backends": model.resolved_backends(), "externals": externals, "slots": slots}


def _shape_str(shape: Any) -> str:
    if shape is None:
        return "?"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def lifecycle_table(model: Any, runs: int) -> dict[str, Any]:
    """The live plan after ``runs`` runs: phase, per-slot phase, units and their counters."""
    if model.last_live is None:
        return {"runs": runs, "phase": None, "note": "no live plan: the graph runs on the legacy interpreter"}
    handle = model.dsp
    return {
        "runs": runs,
        "phase": handle.phase.name,
        "counters": handle.runtime.counters(),
        "flags": list(handle.runtime.flags),
        "slots": [s["phase"] for s in handle.slots],
        "units": [u.as_dict() for u in handle.segments],
    }


def _exercise(model: Any, runs: int, dims: list[str]) -> None:
    """Run ``model`` ``runs`` times on random inputs (same shapes, fresh values)."""
    sizes = _dims(dims)
    for i in range(runs):
        model.run(random_feeds(model, sizes, set(), seed=i))


def cmd_plan_show(args: argparse.Namespace) -> int:
    """`dsp plan show MODEL [--runs N]`."""
    import dsp_core

    model = dsp_core.compile(args.model, mode=args.mode)
    _exercise(model, args.runs, args.dim)
    table = plan_table(model)
    if args.runs:
        table["lifecycle"] = lifecycle_table(model, args.runs)
    table["cache"] = model.stats.as_dict()
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    if table.get("declined"):
        print(f"plan declined: {table['declined']} -> runs on the legacy interpreter")
        return 0
    s = table["summary"]
    print(
        f"plan {s['content_hash'][:12]}: {s['slots']} slots, {s['values']} values, externals {s['externals']}, "
        f"{s['constant_bytes'] / 1e6:.2f} MB of constants; backends: {', '.join(table['backends'])}"
    )
    print("cache: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in table["cache"].items()))
    phases = table.get("lifecycle", {}).get("slots")
    rows = [["slot", "op", "inputs", "outputs", "traits", "releases", *(["phase"] if phases else [])]]
    for sl in table["slots"]:
        outs = ", ".join(f"{o['name']}:{o['dtype'] or '?'}{o['shape']}" for o in sl["outputs"])
        rows.append(
            [
                str(sl["slot"]),
                sl["op"],
                _trunc(", ".join(sl["inputs"])),
                _trunc(outs),
                ",".join(t.lower() for t in sl["traits"]) or "-",
                _trunc(", ".join(sl["releases"])) or "-",
                *([phases[sl["slot"]].lower()] if phases else []),
            ]
        )
    _print_table(rows)
    if "lifecycle" in table:
        _print_lifecycle(table["lifecycle"])
    return 0


def _print_lifecycle(life: dict[str, Any]) -> None:
    if life["phase"] is None:
        print(f"\nafter {life['runs']} runs: {life['note']}")
        return
    sealed = sum(1 for p in life["slots"] if p == "SEALED")
    print(f"\nafter {life['runs']} runs: plan phase {life['phase']}; {sealed} of {len(life['slots'])} slots sealed")
    print("counters: " + ", ".join(f"{k} {v}" for k, v in life["counters"].items()))
    for flag in life["flags"]:
        print(f"flag: {flag}")
    rows = [["unit", "kind", "backend", "phase", "slots", "replays", "eager runs", "recaptures", "reason"]]
    for u in life["units"]:
        c = u["counters"]
        span = f"{u['slots'][0]}..{u['slots'][1]}" if u["slots"] else "-"
        rows.append(
            [
                str(u["index"]),
                u["kind"],
                u["backend"],
                u["phase"] or "-",
                f"{span} ({u['n_slots']})",
                str(c.get("replays", "-")),
                str(c.get("eager_runs", "-")),
                str(c.get("recaptures", "-")),
                _trunc(u["reason"], 60),
            ]
        )
    _print_table(rows)


def _add_devices(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--placement",
        default=None,
        help="place the plan over the devices: single_device, memory_fit, pipeline_parallel (default: DSP_PLACEMENT)",
    )
    cmd.add_argument(
        "--stub-devices",
        default=None,
        metavar="SPEC",
        help="simulated devices: NxSIZE (4x1G, all peers; 4x1G:nopeer, none) or a JSON list of "
        '{"memory": bytes, "peers": [...]} (docs/devices.md)',
    )


def stub_specs(spec: str) -> list[dict[str, Any]]:
    """Stub devices from ``4x1G`` (peers), ``4x1G:nopeer`` or a JSON list of device dicts."""
    from dsp_core import config

    text = spec.strip()
    if text.startswith("["):
        try:
            devices = json.loads(text)
        except ValueError as exc:
            raise DSPError(f"--stub-devices: not a JSON list of devices: {exc}") from exc
        if not isinstance(devices, list):
            raise DSPError('--stub-devices: a JSON list of device dicts, e.g. [{"memory": 1073741824}]')
        return devices
    body, _, flag = text.partition(":")
    count, sep, size = body.partition("x")
    if not sep or not count.strip().isdigit() or flag not in ("", "peer", "nopeer"):
        raise DSPError(f"--stub-devices {spec!r}: expected NxSIZE[:nopeer] (4x1G) or a JSON list")
    n = int(count)
    try:
        memory = config.parse_size(size)
    except ValueError:
        raise DSPError(f"--stub-devices {spec!r}: {size!r} is not a size (4096, 512M, 1G)") from None
    peers = flag != "nopeer"
    return [{"memory": memory, "peers": [j for j in range(n) if j != i] if peers else []} for i in range(n)]


def _devices_scope(args: argparse.Namespace) -> Any:
    """The stub topology the command asked for, or nothing to enter."""
    import contextlib

    from dsp_core.devices import stub_topology

    spec = getattr(args, "stub_devices", None)
    return stub_topology(stub_specs(spec)) if spec else contextlib.nullcontext()


def cmd_plan_dot(args: argparse.Namespace) -> int:
    """`dsp plan dot MODEL [--runs N] [--placement P --stub-devices SPEC]`: Graphviz source on stdout."""
    import dsp_core

    with _devices_scope(args):
        model = dsp_core.compile(args.model, mode=args.mode, placement=args.placement)
        if model.declined is not None:
            raise DSPError(
                f"plan declined: {model.declined}; the graph runs on the legacy interpreter (no plan to draw)"
            )
        _exercise(model, max(1, args.runs), args.dim)
        print(model.dsp.to_dot(), end="")
    return 0


def devices_report(model: Any) -> dict[str, Any]:
    """The placement of the default plan, and the transfers recorded so far (what --devices prints)."""
    plan = model.plan()
    report: dict[str, Any] = model.dsp.placement.as_dict(plan)
    report["transfers"] = model.dsp.transfer_summary()
    return report


def _print_devices(rep: dict[str, Any]) -> None:
    topo = rep["topology"]
    print(f"\nplacement {rep['strategy']} on {len(topo['devices'])} {topo['kind']} device(s)")
    rows = [["device", "key", "slots", "weight bytes", "budget bytes", "peers"]]
    for d, t in zip(rep["devices"], topo["devices"]):
        span = f"{d['slots'][0]}..{d['slots'][1]} ({d['n_slots']})" if d["slots"] else "-"
        key = "/".join(x for x in d["key"] if x) or "-"
        rows.append([str(d["device"]), key, span, str(d["weight_bytes"]), str(d["budget_bytes"]), str(t["peers"])])
    _print_table(rows)
    for c in rep["cuts"]:
        print(
            f"cut after slot {c['after_slot']}: device {c['src']} -> {c['dst']}, {c['bytes']} bytes per step "
            f"(symbolic dims as 1): {_trunc(', '.join(c['values']), 80)}"
        )
    print(f"replicated constants: {rep['replicated_bytes']} bytes (copied once)")
    t = rep["transfers"]
    if t["steps"]:
        per = ", ".join(f"{k} {v} B" for k, v in t["bytes"].items()) or "none"
        print(f"transfers over {t['steps']} step(s): {per}; {t['switches']} device switches")


def cmd_plan_explain(args: argparse.Namespace) -> int:
    """`dsp plan explain MODEL`."""
    with _devices_scope(args):
        return _plan_explain(args)


def _plan_explain(args: argparse.Namespace) -> int:
    import dsp_core
    from dsp_core.backends.auction import on_threads

    model = dsp_core.compile(args.model, mode=args.mode, strict=args.strict, placement=args.placement)
    runs = getattr(args, "runs", 0)
    if runs and model.declined is None:
        _exercise(model, runs, getattr(args, "dim", []))
    report = model.explain()
    if args.devices and model.declined is None:
        report["devices"] = devices_report(model)
    if runs and model.declined is None:
        report["units"] = [
            {k: v for k, v in u.as_dict().items() if k in ("index", "kind", "phase", "slots", "n_slots", "reason")}
            for u in model.dsp.segments
        ]
        report["phase"] = model.dsp.phase.name
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if report.get("declined"):
        print(f"plan declined: {report['declined']} -> runs on the legacy interpreter")
        return 0
    print(f"mode {report['mode']}; candidates in order: {' -> '.join(report['chain'])}")
    for note in report["notes"]:
        print(f"note: {note}")
    for seg in report["segments"]:
        print(
            f"segment {seg['segment']}: slots {seg['slots'][0]}..{seg['slots'][-1]} ({seg['n_slots']}) "
            f"-> {seg['backend']} ({seg['mode']}), bids {seg['bids']}"
        )
        for d in seg["declines"]:
            print(f"    slot {d['slot']} {d['op']}: {d['backend']} declined ({d['reason']}: {d['detail']})")
        for t in seg.get("trials", []):  # the measured auction (at freeze): best time of each contender
            times = ", ".join(f"{name} {us:.1f} us" for name, us in t["times_us"].items())
            on = on_threads(t.get("threads", 0))  # fewer than DSP_CPU_THREADS where the trial found them faster
            rivals = f"; rivals {', '.join(t['rivals'])}" if t.get("rivals") else ""
            print(f"    trial ({t['source']}) for feeds {t['feeds']}: {times} -> {t['winner']}{on}{rivals}")
        for c in seg.get("contests", []):  # the replay contest: the rivals timed again on real steps
            dropped = f"; out: {'; '.join(c['dropped'])}" if c["dropped"] else ""
            print(
                f"    contest for feeds {c['feeds']}: {' vs '.join([c['holder'], *c['rivals']])}, running "
                f"{c['running']} after {c['duels']} duel{'s' if c['duels'] != 1 else ''} "
                f"({c['switches']} switched){dropped}"
            )
        fusion = seg.get("fusion")
        if fusion:  # the winner's fusion policy grouped the segment
            print(f"    fusion ({fusion['policy']}): {fusion['slots']} slots -> {fusion['kernels']} kernels")
            for g in fusion["groups"]:
                chain = " -> ".join(f"{c['backend']}: {c['verdict']}" for c in g.get("chain", []))
                print(
                    f"      group {g['index']} [{g['template']}]: slots {g['slots']}" + (f"; {chain}" if chain else "")
                )
            for b in fusion["boundaries"]:
                print(f"      boundary slot {b['producer']} -> {b['consumer']}: {b['reason']}")
        for gap in seg.get("gaps", []):
            print(f"    gap slot {gap['slot']} {gap['op']}: {gap['reason']}")
    print_merges(report["merges"])
    print(f"fraction of slots on the reference after fallback: {report['fallback_fraction']:.1%}")
    if "devices" in report:
        _print_devices(report["devices"])
    if "units" in report:
        print(f"after {runs} run(s): plan phase {report['phase']}")
        for u in report["units"]:
            span = f"slots {u['slots'][0]}..{u['slots'][-1]}" if u["slots"] else "no slots"
            why = f": {u['reason']}" if u["reason"] else ""
            print(f"  {u['kind']} {u['index']} ({span}, {u['n_slots']}) {u['phase']}{why}")
    return 0


def fuse_report(path: str, backend: str | None = None, decode: bool = False, max_length: int = 64) -> dict[str, Any]:
    """What `dsp plan fuse` prints, as a dict: groups per segment, kernels vs slots per step."""
    from dsp_core.backends.discovery import discover
    from dsp_core.plan.fusion import NO_FUSION, REFERENCE_POLICY, FusionPolicy, segment_fusion
    from dsp_core.plan.merge import merge_report

    registry = discover()
    policy: FusionPolicy = REFERENCE_POLICY
    if backend is not None:
        found = next((b for b in registry.backends if b.name == backend), None)
        if found is None:
            names = ", ".join(b.name for b in registry.backends)
            raise DSPError(f"--backend {backend}: no installed backend has that name; installed: {names}")
        policy = found.fusion_policy() or NO_FUSION  # pure Python: no device needed
    variables: list[str] = []
    if decode:
        from dsp_core.llm.pipeline import GenerationPipeline, state_inputs

        decoder = GenerationPipeline(path, max_length=max_length, mode="slot_by_slot").decoder(1)
        model = decoder.model
        variables = state_inputs(decoder.fixed, model)
    else:
        import dsp_core

        model = dsp_core.compile(path, mode="slot_by_slot")
    plan, part = model.plan(), model.partition()
    if plan is None or part is None:
        raise DSPError(f"{path}: the plan was declined ({model.declined}); nothing to group (it runs interpreted)")
    results = [segment_fusion(plan, seg.slots, policy, variables) for seg in part.segments]
    groups = [g.as_dict(plan) for r in results for g in r.groups]
    live = sum(len(r.order) for r in results)
    return {
        "model": path,
        "decode": decode,
        "merges": merge_report(plan, model.graph),
        "policy": policy.name,
        "slots": len(plan.slots),
        "live_slots": live,
        "sealed": len(plan.slots) - live,
        "kernels": sum(r.kernels for r in results),
        "groups": groups,
        "boundaries": [b.as_dict() for r in results for b in r.boundaries],
        "templates": {
            name: sum(1 for g in groups if g["template"] == name) for name in sorted({g["template"] for g in groups})
        },
    }


def print_merges(merges: dict[str, Any]) -> None:
    """The sibling-product rewrite's lines of `dsp plan fuse` and `dsp plan explain`."""
    if not merges["enabled"]:
        print("merged products: off (DSP_MERGE_PRODUCTS=0)")
    else:
        print(f"merged products: {len(merges['merged'])} merge(s) of {merges['products_merged']} products")
    for m in merges["merged"]:
        parts = " + ".join(f"{p['node']} [{p['n']}]" for p in m["parts"])
        print(f"  slot {m['slot']} {m['form']} of {m['input']!r}, K={m['k']} N={m['n']} {m['dtype']}: {parts}")
    for u in merges["unmerged"]:
        print(f"  not merged: {u['node']} (reads {u['input']!r}): {u['reason']}")


def cmd_plan_fuse(args: argparse.Namespace) -> int:
    """`dsp plan fuse MODEL [--backend NAME] [--decode --max-length L] [--json]`."""
    report = fuse_report(args.model, args.backend, args.decode, args.max_length)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    what = "decode plan" if report["decode"] else "plan"
    print(
        f"{what} of {report['model']}: {report['slots']} slots, {report['live_slots']} run per step "
        f"({report['sealed']} sealed at freeze) -> {report['kernels']} kernels per step "
        f"(policy {report['policy']}; templates {report['templates']})"
    )
    print_merges(report["merges"])
    why = {(b["producer"], b["consumer"]): b["reason"] for b in report["boundaries"]}
    for g in report["groups"]:
        slots = " ".join(f"{s}:{op}" for s, op in zip(g["slots"], g["ops"]))
        print(f"group {g['index']} [{g['template']}] {g['kernels']} kernel(s): {slots}")
        for (p, c), reason in why.items():
            if c in g["slots"]:
                print(f"    not fused with producer slot {p}: {reason}")
    return 0


# -- cache ------------------------------------------------------------------------------
def _disk_cache() -> Any:
    from dsp_core import diag
    from dsp_core.cache.disk import DiskCache

    cache = DiskCache.from_config()
    diag.watch_disk_cache(cache)
    return cache


def cmd_cache_ls(args: argparse.Namespace) -> int:
    """`dsp cache ls`."""
    rows = _disk_cache().ls()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [["key", "source", "build", "object", "size", "last used", "status"]]
    for r in rows:
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["mtime"])) if r["mtime"] else "-"
        size = str(r["size"]) if r["size"] is not None else "-"
        build = f"{r['build']} (this)" if r["this_build"] else r["build"]
        table.append([r["key"], r["source"], build, r["object"] or "-", size, used, _trunc(r["status"], 60)])
    _print_table(table)
    mine = sum(1 for r in rows if r["this_build"])
    print(f"\n{len(rows)} entries ({mine} of this build, {len(rows) - mine} of other builds)")
    return 0


def cmd_cache_info(args: argparse.Namespace) -> int:
    """`dsp cache info`."""
    info = _disk_cache().info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"dir          {info['dir']}{'' if info['enabled'] else '  (disabled: DSP_DISK_CACHE=0)'}")
    print(f"override dir {info['override_dir'] or '-'}")
    print(f"size         {info['size'] / 2**20:.2f} MiB of {info['max_bytes'] / 2**20:.0f} MiB")
    print(
        f"entries      {info['count']} objects, {info['refs']} refs ({info['this_build_refs']} of this build, "
        f"{info['builds']} builds), {info['quarantine_count']} quarantined"
    )
    print(f"recompile    {'forced (DSP_FORCE_RECOMPILE)' if info['force_recompile'] else 'when missing or invalid'}")
    print(f"fingerprint  {info['fingerprint']}  (build {info['build']})")
    return 0


def cmd_cache_clear(args: argparse.Namespace) -> int:
    """`dsp cache clear`."""
    cache = _disk_cache()
    removed = cache.clear(include_quarantine=args.all)
    if args.json:
        print(json.dumps({"dir": str(cache.root), "removed": removed, "quarantine_cleared": args.all}))
    else:
        print(f"removed {removed} files from {cache.root}{' (quarantine included)' if args.all else ''}")
    return 0


def cmd_cache_verify(args: argparse.Namespace) -> int:
    """`dsp cache verify`: exit status 1 when a bad entry was found."""
    report = _disk_cache().verify()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{report['objects_ok']} objects, {report['refs_ok']} refs and {report['weights_ok']} weights ok; "
            f"{report['other_build_refs']} refs of other builds ok (kept); "
            f"{report['quarantined']} quarantined; "
            f"{report['dangling_refs_removed']} dangling refs removed; override: {report['override_ok']} ok, "
            f"{report['override_bad']} bad"
        )
        for prob in report["problems"]:
            print(f"bad: {prob['path']}: {prob['reason']}")
    return 1 if report["problems"] else 0


# -- diag -------------------------------------------------------------------------------
def cmd_diag_show(args: argparse.Namespace) -> int:
    """`dsp diag show FILE`."""
    from dsp_core.diag.reports import load, render_dump

    state = load(args.file)
    print(json.dumps(state, indent=1) if args.json else render_dump(state, args.limit))
    return 0


def cmd_diag_report(args: argparse.Namespace) -> int:
    """`dsp diag report [FILE]`: a dump or flight file, or this process's diagnostics state."""
    from dsp_core import diag
    from dsp_core.diag.reports import build_report, load, render_report

    if args.file:
        state = load(args.file)
    else:
        diag.configure_from_env()
        state = diag.snapshot()
    report = build_report(state)
    print(json.dumps(report, indent=2) if args.json else render_report(report))
    return 0


# -- config -----------------------------------------------------------------------------
def cmd_config(args: argparse.Namespace) -> int:
    """`dsp config`: every option, its current value and where that came from."""
    from dsp_core import config

    rows = config.table()
    invalid = [r for r in rows if r["error"]]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        table = [["option", "variable", "value", "source", "allowed", "doc"]]
        for r in rows:
            value = "(empty)" if r["value"] == "" else str(r["value"])
            if r["error"]:
                value = f"INVALID {value!r}"
            table.append([r["name"], r["env"], value, r["source"], r["allowed"], r["doc"]])
        _print_table(table)
    for r in invalid:  # the whole table first, then what is wrong: one line each, status 2
        print(f"dsp: error: {r['error']}", file=sys.stderr)
    return 2 if invalid else 0


# -- plugin -----------------------------------------------------------------------------
def cmd_plugin_new(args: argparse.Namespace) -> int:
    """`dsp plugin new NAME`: write the backend template (dsp_core/plugin_template)."""
    from dsp_core.backends.discovery import discover
    from dsp_core.plugin_template import PluginNames, write

    names = PluginNames.of(args.name, args.mode)
    dest = Path(args.dir) if args.dir else Path(names.dist)
    for path in write(names, dest):
        print(f"wrote {path}")
    registry = discover()
    same = [f"{b.name} ({b.distribution})" for b in registry.for_mode(names.mode)]
    if same:
        print(
            f"note: installed backends already serve {names.mode.name}: {', '.join(same)}; two backends of one "
            "mode compete for its slots (choose another with --mode)",
            file=sys.stderr,
        )
    if any(b.name == names.name for b in registry.backends):
        print(f"note: a backend named {names.name} is already installed; the first one found wins", file=sys.stderr)
    print(f"\nnext: pip install -e {dest} && dsp backends list && (cd {dest} && pytest)")
    print("docs/writing-a-backend.md walks through every file")
    return 0


def _trunc(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    sys.exit(main())
