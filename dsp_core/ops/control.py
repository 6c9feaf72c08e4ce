"""Control-flow ops: If, Loop, Scan. Their subgraphs arrive as callables in ``ctx.subgraphs``.

Each callable takes a dict of the subgraph's formal inputs and returns its outputs in
order; values of the enclosing scope are visible to it, as ONNX requires.
"""

from __future__ import annotations

from typing import Any

from dsp_core import config
from dsp_core.errors import KernelError
from dsp_core.ops.registry import KernelContext, Trait, op


def _iteration_bound() -> int:
    """The most iterations a Loop or Scan may run (DSP_MAX_LOOP_ITERATIONS)."""
    return int(config.get("max_loop_iterations"))


def _too_many(ctx: KernelContext, what: str, limit: int) -> KernelError:
    return KernelError(
        f'{what} node "{ctx.node_name}" would run more than {limit:,} iterations '
        "(DSP_MAX_LOOP_ITERATIONS bounds them; raise it if the model really needs more)"
    )


def _formal_inputs(runner: Any) -> list[str]:
    return [v.name for v in runner.graph.inputs]


def _call(runner: Any, values: list[Any]) -> list[Any]:
    return list(runner(dict(zip(_formal_inputs(runner), values))))


@op("If", traits=Trait.CONTROL_FLOW, outputs=(1, -1), inputs=(1, 1))
def if_(ctx: KernelContext, cond: Any, *, then_branch: Any = None, else_branch: Any = None) -> tuple[Any, ...]:
    """Run then_branch or else_branch depending on a scalar condition."""
    branch = "then_branch" if bool(ctx.xp.asarray(cond).reshape(-1)[0]) else "else_branch"
    return tuple(_call(ctx.subgraphs[branch], []))


@op("Loop", traits=Trait.CONTROL_FLOW, outputs=(1, -1), inputs=(2, -1))
def loop(ctx: KernelContext, max_trip: Any, cond: Any, *carried: Any, body: Any = None) -> tuple[Any, ...]:
    """Run body while the trip count and condition allow; stack its scan outputs."""
    xp = ctx.xp
    runner = ctx.subgraphs["body"]
    trips = None if max_trip is None else int(xp.asarray(max_trip).reshape(-1)[0])
    keep_going = True if cond is None else bool(xp.asarray(cond).reshape(-1)[0])
    state = list(carried)
    n_scan = ctx.n_outputs - len(state)
    scans: list[list[Any]] = [[] for _ in range(n_scan)]
    limit = _iteration_bound()
    i = 0
    while keep_going and (trips is None or i < trips):
        if i >= limit:
            raise _too_many(ctx, "Loop", limit)
        out = _call(runner, [xp.asarray(i, dtype=xp.int64), xp.asarray(keep_going), *state])
        keep_going = bool(xp.asarray(out[0]).reshape(-1)[0])
        state = out[1 : 1 + len(state)]
        for k, val in enumerate(out[1 + len(state) :]):
            scans[k].append(val)
        i += 1
    stacked = [xp.stack(s) if s else _empty_scan(ctx, runner, len(state), k) for k, s in enumerate(scans)]
    return tuple(state + stacked)


def _empty_scan(ctx: KernelContext, runner: Any, n_state: int, k: int) -> Any:
    """A zero-trip Loop's scan output: empty along the new axis, dtype from the body."""
    from dsp_core.ir import dtypes

    info = runner.graph.outputs[1 + n_state + k]
    shape = tuple(d if isinstance(d, int) else 0 for d in (info.shape or ()))
    dtype = dtypes.to_numpy(info.dtype) if info.dtype else "float32"
    return ctx.xp.zeros((0, *shape), dtype=dtype)


@op("Scan", traits=Trait.CONTROL_FLOW, outputs=(1, -1), inputs=(1, -1), since=9)
def scan(
    ctx: KernelContext,
    *inputs: Any,
    body: Any = None,
    num_scan_inputs: int = 0,
    scan_input_axes: list[int] | None = None,
    scan_input_directions: list[int] | None = None,
    scan_output_axes: list[int] | None = None,
    scan_output_directions: list[int] | None = None,
) -> tuple[Any, ...]:
    """Iterate body over slices of the scan inputs, threading the state through."""
    xp = ctx.xp
    runner = ctx.subgraphs["body"]
    n_state = len(inputs) - num_scan_inputs
    state = list(inputs[:n_state])
    seqs = list(inputs[n_state:])
    in_axes = [a % s.ndim for a, s in zip(scan_input_axes or [0] * len(seqs), seqs)]
    in_dirs = scan_input_directions or [0] * len(seqs)
    lengths = {s.shape[a] for s, a in zip(seqs, in_axes)}
    if len(lengths) != 1:
        raise KernelError(f"Scan: scan inputs disagree on the sequence length: {sorted(lengths)}")
    steps = lengths.pop()
    limit = _iteration_bound()
    if steps > limit:
        raise _too_many(ctx, "Scan", limit)
    n_out = ctx.n_outputs - n_state
    collected: list[list[Any]] = [[] for _ in range(n_out)]
    for t in range(steps):
        slices = [xp.take(s, steps - 1 - t if d else t, axis=a) for s, a, d in zip(seqs, in_axes, in_dirs)]
        out = _call(runner, [*state, *slices])
        state = out[:n_state]
        for k, val in enumerate(out[n_state:]):
            collected[k].append(val)
    out_axes = scan_output_axes or [0] * n_out
    out_dirs = scan_output_directions or [0] * n_out
    results = []
    for vals, axis, direction in zip(collected, out_axes, out_dirs):
        if direction:
            vals = vals[::-1]
        stacked = xp.stack(vals)
        results.append(xp.moveaxis(stacked, 0, axis % stacked.ndim))
    return tuple(state + results)
