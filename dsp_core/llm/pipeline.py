"""GenerationPipeline and GenerationSession: prefill + fixed-KV decode, K steps per host call.

Two cached plans serve a decoder:

- the **prefill** plan: the model as exported, its LM head reading the last position
  only (``last_position_logits``, dsp_core.llm.lm_head: the pipeline reads no other
  position's logits), fed the prompt (or an appended chunk) with the retained cache as
  ``past``; its presents are written into the session's KV buffers;
- the **decode** plan: the graph rewritten by ``fixed_kv_buffers`` (dsp_core.llm.kv),
  compiled once per batch size, frozen on its first run. Its inputs (KV buffers,
  ``input_ids``, ``position_ids``, ``attention_mask`` at max_length, ``kv_position``)
  are variables read in place: their addresses never move, so after warm-up the plan
  replays every token without a recapture.

The decode loop (DecodeLoop) runs K steps per host call: run the plan (which scatters
the step's K/V into the buffers), choose the token (greedy ``next_token`` from the plan,
or the sampler on the logits), write it into ``input_ids`` in place, advance the
position arrays in place. Tokens stay arrays until the block ends; then the host reads
the block once, streams it and checks stop tokens.

GPU hook: ``DecodeLoop.block_hook`` -- when set, ``block_hook(k)`` must return a
callable that runs k whole steps (plan replay + choice + advance) on the device, e.g.
a CUDA graph captured over k iterations of exactly this loop body (it touches only the
state arrays, whose addresses are fixed); the loop then calls it once per block instead
of its Python loop. The block's uniforms (sampling) are passed in a fixed buffer too.

On a GPU: when every unit of the decode plan runs on a ``cuda`` backend (CUDA_GRAPHS,
or AUTO resolving to it), the decode state is allocated with ``xp = cupy``: KV buffers,
``input_ids``, ``position_ids``, ``attention_mask`` and ``kv_position`` live on the
device, the decode plan returns device outputs (``outputs_on_device``), the sampled token
is written back into ``input_ids`` by a device copy, and the block's tokens land in a
device array read once per block. Each decode step is one graph replay with no host
synchronisation inside a block. The prefill plan stays a normal plan (host feeds and
outputs); its presents are copied into the device buffers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dsp_core import config, progress
from dsp_core.backends.base import Registry
from dsp_core.backends.discovery import discover
from dsp_core.cache.memory import CacheStats
from dsp_core.devices.execution import device_of, input_devices, on_device
from dsp_core.errors import DSPError, InputError
from dsp_core.ir import dtypes
from dsp_core.ir.graph import Graph
from dsp_core.llm.block import TOKENS, UNIFORMS, BlockHook, block_key, unroll
from dsp_core.llm.kv import FixedKVGraph, KVLayout, fixed_kv_buffers, past_inputs
from dsp_core.llm.limits import TableLimit, table_limit
from dsp_core.llm.lm_head import ALL, LAST, last_position_logits
from dsp_core.llm.metrics import DecodeMetrics
from dsp_core.llm.sampling import GREEDY, Sampler, Sampling
from dsp_core.llm.store import EntryError, PlanStore
from dsp_core.plan.plan import ExternalClass, Plan
from dsp_core.runtime import hugepages, loader
from dsp_core.runtime.lifecycle import PlanPhase
from dsp_core.runtime.model import CompiledModel

log = logging.getLogger("dsp.llm")

# Fed inputs the decode loop updates in place (besides the KV buffers, graph variables already).
STATE_INPUTS = ("input_ids", "attention_mask", "position_ids")
WARMUP_STEPS = 8  # enough for freeze -> warm -> capture -> two clean replays
LOGITS = "logits"  # the decoder's logits output (the decode layout's too)
PREFILL = {"logits": "last"}  # the prefill entry's parameters: its graph is the last-position rewrite


@dataclass
class GenerationResult:
    """What ``generate`` returns: the new tokens, per-row lengths, metrics, why it stopped."""

    tokens: np.ndarray  # int64 [batch, n]; a row that stopped early repeats its stop token after it
    lengths: np.ndarray  # int64 [batch]: tokens up to and including each row's stop token
    metrics: DecodeMetrics
    stopped: bool  # a stop token ended the generation
    counters: dict[str, Any] = field(default_factory=dict)  # the decode plan's lifecycle counters

    def token_list(self, row: int = 0) -> list[int]:
        """The tokens of one row as ints, cut at its stop token."""
        return [int(t) for t in self.tokens[row, : int(self.lengths[row])]]


def state_inputs(fixed: KVLayout, model: CompiledModel) -> list[str]:
    """The decode state's inputs a plan reads in place (marked variable: never staged)."""
    return [n for n in (*STATE_INPUTS, fixed.position_input) if n in model.input_names]


def decode_namespace(model: CompiledModel) -> Any:
    """The array namespace of a decode plan's state: cupy when its readers run on a ``cuda`` backend.

    Decided from the partition: when every segment that reads a fed input (the state)
    runs on a backend whose ``platform`` is ``cuda``, the state lives on the device (the
    plan reads and writes it in place); otherwise it stays in numpy (a CUDA segment then
    copies it in, and copies a mutated KV buffer back).
    """
    part, plan = model.partition(), model.plan()
    if part is None or plan is None or not part.segments:
        return np
    fed = {plan.flat(plan.external_ref(k)) for k, e in enumerate(plan.externals) if e.cls is not ExternalClass.CONSTANT}
    readers = [
        seg
        for seg in part.segments
        if any(r is not None and plan.flat(r) in fed for s in seg.slots for r in plan.slots[s].inputs)
    ]
    if not readers or any(getattr(part.backends[seg.backend], "platform", "cpu") != "cuda" for seg in readers):
        return np
    try:
        import cupy
    except ImportError:  # a cuda backend is only available with cupy
        return np
    return cupy


def to_host(x: Any) -> np.ndarray:
    """A numpy copy (or view) of a host or device array."""
    if isinstance(x, np.ndarray):
        return x
    get = getattr(x, "get", None)
    return get() if callable(get) and hasattr(x, "__cuda_array_interface__") else np.asarray(x)


class DecodeState:
    """The decode plan's fed arrays for one session: allocated once, updated in place (numpy or cupy)."""

    def __init__(self, decoder: Decoder, xp: Any = None) -> None:
        xp = decoder.xp if xp is None else xp
        fk = decoder.layout
        batch, length = fk.batch, fk.max_length
        self.xp = xp
        self.max_length = length
        # On a placed plan each KV buffer is allocated on the device of the slots that read it.
        homes = input_devices(decoder.model)
        # Host buffers, read whole every step, on huge pages where the system has them (hugepages.zeros)
        specs = {n: (s, dtypes.to_numpy(fk.buffer_dtypes[n])) for n, s in fk.buffer_shapes.items()}
        self.buffers = (hugepages.zeros(specs) if xp is np else None) or {
            n: on_device(xp, homes.get(n, 0), lambda s=s, d=d: xp.zeros(s, dtype=d)) for n, (s, d) in specs.items()
        }
        self.input_ids = xp.zeros((batch, 1), dtype=decoder.dtype_of("input_ids"))
        self.position_ids = xp.zeros((batch, 1), dtype=decoder.dtype_of("position_ids"))
        self.attention_mask = xp.zeros((batch, length), dtype=decoder.dtype_of("attention_mask"))
        self.kv_position = xp.zeros((1,), dtype=xp.int64)
        every = {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": self.attention_mask,
            fk.position_input: self.kv_position,
            **self.buffers,
        }
        self.feeds = {n: every[n] for n in decoder.model.input_names}  # the same arrays every step
        self.block = xp.zeros((batch, 1), dtype=np.int64)  # a block's tokens (grown on demand, kept)

    def block_buffer(self, k: int) -> Any:
        """A [B, >=k] int64 array in the state's namespace where a block's tokens land."""
        if self.block.shape[1] < k:
            self.block = self.xp.zeros((self.block.shape[0], k), dtype=np.int64)
        return self.block

    def set_position(self, position: int) -> None:
        """Host-side: the next fed token goes to ``position`` (valid positions 0..position)."""
        self.kv_position[...] = position
        self.position_ids[...] = position
        self.attention_mask[...] = 0
        self.attention_mask[:, : position + 1] = 1

    def advance(self) -> None:
        """Device-side: one position further (no value goes to the host)."""
        if self.xp is np:
            # Host arrays: item writes and a basic index. The in-place ufuncs and the fancy index
            # below took ~60 us a GPT-2 124M token here, each a cold start after the model's
            # call has streamed 500 MB through the caches; these take a few.
            p = int(self.kv_position[0]) + 1
            self.kv_position[0] = p
            self.position_ids[...] = p  # equal to kv_position: set, advanced and blocked together
            self.attention_mask[:, p] = 1
            return
        self.kv_position += 1
        self.position_ids += 1
        self.attention_mask[:, self.kv_position] = 1

    def save(self, length: int) -> dict[str, Any]:
        """Copies of the KV buffers' first ``length`` positions (a session being swapped out)."""
        saved = {}
        for name, buf in self.buffers.items():
            with device_of(buf):  # a placed plan's buffer may live on another device
                saved[name] = buf[:, :, :length].copy()
        return saved

    def restore(self, saved: dict[str, Any]) -> None:
        """Write ``save``'s copies back at the start of the buffers (in place)."""
        for name, part in saved.items():
            with device_of(self.buffers[name]):
                self.buffers[name][:, :, : part.shape[2]] = part


class DecodeLoop:
    """K decode steps per host call over the replayed decode plan (see the module doc for the GPU hook)."""

    block_hook: Callable[[int], Callable[[Any, Any, int], None]] | None = None

    def __init__(self, decoder: Decoder, state: DecodeState, sampler: Sampler) -> None:
        self.model = decoder.model
        self.fixed = decoder.layout
        self.state = state
        self.sampler = sampler

    def step(self) -> dict[str, Any]:
        """One decode step: the plan runs (and scatters this step's K/V); returns its outputs."""
        return self.model.run(self.state.feeds)

    def run_block(self, k: int, out: Any, offset: int, uniforms: Any) -> None:
        """k steps; the chosen tokens land in ``out[:, offset:offset+k]`` (an array, never read here)."""
        run = self.block_hook(k) if self.block_hook is not None else None
        if run is not None:
            run(out, uniforms, offset)
            return
        state, greedy = self.state, self.sampler.sampling.greedy
        if uniforms is not None and state.xp is not np:
            uniforms = state.xp.asarray(uniforms)  # one copy per block
        # The same feed arrays every step: after the first, no feed checks and no output copies
        # (each step's outputs are read before the next); ~80 us of Python a GPT-2 124M token.
        with self.model.stepper(state.feeds) as stepper:
            for i in range(k):
                outs = stepper.step()
                if greedy:
                    token = outs[self.fixed.next_token][:, 0]
                else:
                    token = self.sampler.pick(outs[self.fixed.logits][:, -1], uniforms[i])
                state.input_ids[:, 0] = token  # fed back in place
                out[:, offset + i] = token
                state.advance()


class Decoder:
    """The decode plan of one batch size: the rewritten graph, compiled, frozen on first run.

    From the disk cache when the pipeline's PlanStore holds it (its plan and ``layout``):
    then the rewritten graph (``fixed``) is only built if something asks for it.
    """

    def __init__(self, pipeline: GenerationPipeline, batch: int) -> None:
        self.pipeline = pipeline
        self.batch = batch
        self._fixed: FixedKVGraph | None = None
        params = {"batch": batch, "max_length": pipeline.max_length}
        self.model: CompiledModel
        self.layout: KVLayout
        with pipeline.phase("decode plan"):
            cached = pipeline.cached_model("decode", params, lambda: self.fixed.graph, self._layout_of)
            if cached is not None:
                self.model, self.layout = cached
            else:
                self.layout = self.fixed.layout()
                self.model = pipeline.new_model(self.fixed.graph)
                pipeline.store.put("decode", params, {"layout": self.layout.to_json()}, self.model.plan())
        self.model.dsp.mark_variable(state_inputs(self.layout, self.model))
        self.model.dsp.freeze()  # the shapes never change: freeze at the first run
        self.xp: Any = decode_namespace(self.model)
        if self.xp is not np:
            self.model.outputs_on_device = True  # logits and next_token stay on the device
        self.warmed = False

    @property
    def fixed(self) -> FixedKVGraph:
        """The fixed-KV decode graph (rewritten from the model's graph on first use)."""
        if self._fixed is None:
            graph = self.pipeline.graph
            with self.pipeline.phase("rewrite decode graph"):
                self._fixed = fixed_kv_buffers(graph, batch=self.batch, max_length=self.pipeline.max_length)
            self.pipeline.store.stats.rewrites += 1
        return self._fixed

    def _layout_of(self, info: dict[str, Any], model: CompiledModel) -> KVLayout:
        """The cached entry's KV layout, checked against its plan's inputs and outputs."""
        layout = KVLayout.from_json(info.get("layout"))
        if (layout.batch, layout.max_length) != (self.batch, self.pipeline.max_length):
            raise EntryError(f"layout of batch {layout.batch}, max_length {layout.max_length}")
        missing = {*layout.buffer_shapes, layout.position_input} - set(model.input_names)
        missing |= {layout.logits, layout.next_token} - set(model.output_names)
        if missing:
            raise EntryError(f"the cached decode plan lacks {sorted(missing)}")
        return layout

    def dtype_of(self, name: str) -> Any:
        """The numpy dtype the graph declares for input ``name`` (int64 if absent)."""
        dtype = self.layout.input_dtypes.get(name)
        return dtypes.to_numpy(dtype) if dtype else np.int64


class GenerationSession:
    """Generation state that persists across calls: KV buffers, position, the pending token.

    ``append(ids)`` feeds more tokens after what the session holds (no new prefill of the
    earlier ones); ``generate(n)`` continues from there. Sessions are independent, and
    they share the plans without re-capturing them: the plans read one *resident* set of
    decode arrays per batch size (fixed addresses), and a session is swapped in when it
    runs — the previous one's valid KV prefix is copied out, this one's copied back (two
    device copies of the tokens held, instead of a re-capture). Calls of one pipeline's
    sessions are serialised (``pipeline.lock``).
    """

    def __init__(self, pipeline: GenerationPipeline, batch: int = 1) -> None:
        self.pipeline = pipeline
        self.batch = batch
        self.decoder = pipeline.decoder(batch)
        self.saved: dict[str, Any] | None = None  # this session's KV prefix while swapped out
        self.position = 0
        self.pending: np.ndarray | None = None  # [B, 1]: chosen but not yet fed
        self.last_logits: np.ndarray | None = None  # [B, V] after the last fed token
        self.history: list[np.ndarray] = []
        self.last_append_seconds = 0.0

    # -- state -------------------------------------------------------------------------
    @property
    def state(self) -> DecodeState:
        """The decode arrays, with this session swapped in (see the class doc)."""
        return self.pipeline.activate(self)

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the session: appended and generated (pending included), [B, n]."""
        if not self.history:
            return np.zeros((self.batch, 0), np.int64)
        return np.concatenate(self.history, axis=1)

    def reset_position(self) -> None:
        """Forget the sequence: position 0 (the buffers are overwritten as the next one is fed)."""
        self.position = 0
        self.pending = None
        self.last_logits = None
        self.history = []
        self.state.set_position(0)

    # -- feeding -----------------------------------------------------------------------
    def append(self, ids: Any) -> np.ndarray:
        """Feed ``ids`` ([B, n] or [n]) after the retained state; returns the last position's logits [B, V]."""
        with self.pipeline.lock:
            return self._append(ids)

    def _append(self, ids: Any) -> np.ndarray:
        start = time.perf_counter()
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[None, :] if ids.ndim == 1 else ids
        if ids.ndim != 2 or ids.shape[0] != self.batch or ids.shape[1] == 0:
            raise InputError(f"append: ids must be [{self.batch}, n] with n >= 1, got shape {ids.shape}")
        self.pipeline.check_ids(ids)
        chunk = ids if self.pending is None else np.concatenate([self.pending, ids], axis=1)
        self._check_room(chunk.shape[1])
        if chunk.shape[1] == 1:
            logits = self._decode_one(chunk)
        else:
            logits = self._prefill(chunk)
        self.position += chunk.shape[1]
        self.pending = None
        self.last_logits = logits
        self.history.append(ids.copy())
        self.last_append_seconds = time.perf_counter() - start
        return logits

    def _check_room(self, n: int) -> None:
        """Feeding ``n`` more tokens fits the KV buffers and the model's learned positions."""
        if self.position + n > self.pipeline.max_length:
            raise InputError(
                f"the session holds {self.position} tokens; {n} more exceed max_length "
                f"{self.pipeline.max_length}: build the pipeline with a larger max_length"
            )
        positions = self.pipeline.positions
        room = positions.rows - self.position if positions is not None else 0
        self.pipeline.check_positions(
            self.position + n,
            f"the session holds {self.position} tokens; {n} more",
            f"it has room for {max(room, 0)} more (start a new session)",
        )

    def _decode_one(self, token: np.ndarray) -> np.ndarray:
        """One token through the decode plan (in place, no prefill plan)."""
        self.state.set_position(self.position)
        self.state.input_ids[...] = self.state.xp.asarray(token)
        outs = self.decoder.model.run(self.state.feeds)
        return to_host(outs[self.decoder.layout.logits][:, -1])

    def _prefill(self, chunk: np.ndarray) -> np.ndarray:
        """A chunk through the prefill plan, the retained cache as past; presents go into the buffers."""
        pipe, p, n = self.pipeline, self.position, chunk.shape[1]
        feeds: dict[str, Any] = {"input_ids": chunk}
        names = pipe.prefill_model.input_names
        if "attention_mask" in names:
            feeds["attention_mask"] = np.ones((self.batch, p + n), dtype=self.decoder.dtype_of("attention_mask"))
        if "position_ids" in names:
            pos = np.arange(p, p + n, dtype=self.decoder.dtype_of("position_ids"))
            feeds["position_ids"] = np.repeat(pos[None, :], self.batch, axis=0)
        for name, buf in self.state.buffers.items():
            feeds[name] = to_host(buf[:, :, :p])  # the prefill plan takes host arrays
        with pipe.phase("prefill"):
            outs = pipe.prefill_model.run(feeds)
        xp = self.state.xp
        for g in self.decoder.layout.growth:
            buf = self.state.buffers[g.past]
            with device_of(buf):  # a placed plan's buffer may live on another device
                buf[:, :, p : p + n] = xp.asarray(outs[g.present][:, :, p : p + n])
        return to_host(outs[self.decoder.layout.logits][:, -1])

    # -- generating --------------------------------------------------------------------
    def generate(
        self,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        stop_tokens: Sequence[int] = (),
        on_tokens: Callable[[np.ndarray], None] | None = None,
        block_size: int | None = None,
    ) -> GenerationResult:
        """Continue the sequence by up to ``max_new_tokens`` tokens, K decode steps per host call."""
        with self.pipeline.lock:
            return self._generate(max_new_tokens, sampling, stop_tokens, on_tokens, block_size)

    def _generate(
        self,
        max_new_tokens: int,
        sampling: Sampling | None,
        stop_tokens: Sequence[int],
        on_tokens: Callable[[np.ndarray], None] | None,
        block_size: int | None,
    ) -> GenerationResult:
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if self.pending is None and self.last_logits is None:
            raise DSPError("nothing to continue from: append(ids) first")
        sampling = sampling or GREEDY
        k_max = max(1, int(block_size or self.pipeline.block_size))
        sampler = Sampler(sampling, self.batch)
        stops = np.asarray(sorted(set(int(t) for t in stop_tokens)), dtype=np.int64)
        out = np.zeros((self.batch, max_new_tokens), np.int64)
        seconds: list[float] = []
        n = 0
        start_position, first_from_logits = self.position, self.pending is None
        if self.pending is None:
            assert self.last_logits is not None
            t0 = time.perf_counter()
            uniforms = sampler.draws(1)
            out[:, 0] = sampler.pick(self.last_logits, None if uniforms is None else uniforms[0])
            seconds.append(self.last_append_seconds + time.perf_counter() - t0)
            n = 1
            if on_tokens is not None:
                on_tokens(out[:, :1].copy())
            self.pending = out[:, :1].copy()
        self._check_room(max_new_tokens - n)
        self.pipeline.warmup(self.batch)
        stop_at = _first_stops(out[:, :n], stops)
        if stop_at is None and n < max_new_tokens:
            loop = DecodeLoop(self.decoder, self.state, sampler)
            self.state.set_position(self.position)
            assert self.pending is not None
            self.state.input_ids[...] = self.state.xp.asarray(self.pending)
            if k_max > 1 and max_new_tokens - n >= k_max and self.pipeline.captures_blocks(self.batch):
                block_model = self.pipeline.block_model(self.batch, k_max, sampling, self)
                loop.block_hook = BlockHook(block_model, self.state, k_max)
            dev = self.state.block_buffer(k_max) if self.state.xp is not np else None
            while n < max_new_tokens:
                k = min(k_max, max_new_tokens - n)
                t0 = time.perf_counter()
                if dev is None:
                    loop.run_block(k, out, n, sampler.draws(k))
                else:
                    loop.run_block(k, dev, 0, sampler.draws(k))
                    out[:, n : n + k] = to_host(dev[:, :k])  # the host reads the block once (one sync)
                seconds.extend([(time.perf_counter() - t0) / k] * k)
                # A block runs to its end even past a stop: cut what was decoded after it
                # before anything reaches the caller, so the stream and the result agree.
                ends = _hold_after_stops(out, n + k, stops)
                stop_at = ends if ends is not None and (ends >= 0).all() else None
                end = n + k if stop_at is None else int(stop_at.max()) + 1
                if on_tokens is not None:
                    on_tokens(out[:, n:end].copy())
                n = end
                if stop_at is not None:
                    break
        kept = n if stop_at is None else int(stop_at.max()) + 1
        lengths = np.full(self.batch, kept, np.int64) if stop_at is None else np.minimum(stop_at + 1, kept)
        self.position = start_position + kept - (1 if first_from_logits else 0)
        self.pending = out[:, kept - 1 : kept].copy()
        self.last_logits = None
        self.history.append(out[:, :kept].copy())
        return GenerationResult(
            tokens=out[:, :kept].copy(),
            lengths=lengths,
            metrics=DecodeMetrics(tuple(seconds[:kept]), self.batch),
            stopped=stop_at is not None,
            counters=self.decoder.model.dsp.runtime.counters() if self.decoder.model.last_live else {},
        )


def _check_prefill(info: dict[str, Any], model: CompiledModel) -> str:
    """A cached prefill plan returns the logits, of one position when its entry says the last only."""
    kept = info.get("logits")
    if not isinstance(kept, str) or not (kept == LAST or kept.startswith(ALL)):
        raise EntryError(f"the prefill entry says its logits are {kept!r}")
    if LOGITS not in model.output_names:
        raise EntryError(f"the cached prefill plan returns {model.output_names}, not {LOGITS!r}")
    if kept == LAST and _given_logits(model.plan()) != LAST:
        raise EntryError("the cached prefill plan computes every position's logits, its entry says the last only")
    return kept


def _given_logits(plan: Plan | None) -> str:
    """LAST when ``plan`` declares its logits [B, 1, V] (one position), else what a given plan computes."""
    if plan is not None and LOGITS in plan.output_names:
        ref = plan.outputs[plan.output_names.index(LOGITS)]
        shape = plan.values[ref].shape if ref >= 0 else plan.externals[-ref - 1].shape
        if shape is not None and len(shape) == 3 and shape[1] == 1:
            return LAST
    return f"{ALL} (a CompiledModel given to the pipeline runs as it is)"


def _check_block(info: dict[str, Any], model: CompiledModel) -> None:
    """A cached block plan must return the block's tokens."""
    if TOKENS not in model.output_names:
        raise EntryError(f"the cached block plan returns {model.output_names}, not {TOKENS!r}")


def _hold_after_stops(out: np.ndarray, end: int, stops: np.ndarray) -> np.ndarray | None:
    """Per row, the index of its first stop token in ``out[:, :end]`` (-1: none yet); None without stops.

    A row that has stopped repeats its stop token up to ``end`` (in place), so what it
    decoded after the stop (the batch goes on until every row has stopped) is never
    streamed or returned; ``GenerationResult.lengths`` still says where each row ends.
    """
    if stops.size == 0 or end == 0:
        return None
    hit = np.isin(out[:, :end], stops)
    first = np.where(hit.any(axis=1), hit.argmax(axis=1), -1).astype(np.int64)
    for row, at in enumerate(first):
        if at >= 0:
            out[row, at + 1 : end] = out[row, at]
    return first


def _first_stops(tokens: np.ndarray, stops: np.ndarray) -> np.ndarray | None:
    """Per row, the index of its first stop token, when every row has one; else None."""
    if stops.size == 0 or tokens.shape[1] == 0:
        return None
    hit = np.isin(tokens, stops)
    if not hit.any(axis=1).all():
        return None
    return hit.argmax(axis=1).astype(np.int64)


class GenerationPipeline:
    """Greedy or sampled generation with a KV-cache decoder: prefill plan + fixed-KV decode plan.

    ``model``: a path, bytes, onnx.ModelProto, Graph or CompiledModel of a decoder with the
    usual KV naming (``input_ids``, ``attention_mask``, ``position_ids``,
    ``past_key_values.N.key/value`` -> ``logits``, ``present.N.key/value``).

    The prefill plan computes the last position's logits only (``prefill_logits`` says
    so, or why the LM head was not found and every position's are computed): the pipeline
    never reads another's. A CompiledModel given with neither another mode nor another
    placement is run as it is.

    Warm start: for a path, bytes or a proto, with the disk cache on, the prefill plan,
    the decode plans, the block plans and the model's metadata come from the disk cache
    (dsp_core/llm/store.py): a second process imports no graph and rewrites nothing, and
    reads each weight once. ``warm_stats`` counts what came from the cache and what was
    built; ``timings`` says where the start's time went (seconds per phase, each phase's
    own time without the phases inside it, so they add up).
    """

    def __init__(
        self,
        model: Any,
        max_length: int = 128,
        mode: str | None = None,
        *,
        block_size: int = 8,
        strict: bool | None = None,
        block_capture: bool | None = None,
        placement: Any = None,
    ) -> None:
        self.timings: dict[str, float] = {}
        self._phases: list[list[float]] = []  # running phases: [start, seconds spent in phases inside it]
        self._graph: Graph | None = None  # the model's graph as given (the decode rewrite's and metadata's source)
        self._load_graph: Callable[[], Graph] | None = None
        self.registry: Registry | None = None  # the backends every plan is auctioned among (the prefill plan's)
        # LAST ("last position"): the prefill plan computes the last position's logits only; else
        # "all positions (why: the LM head the rewrite looks for was not found)".
        self.prefill_logits = ALL
        with self.phase("prefill plan"):
            self.prefill_model = self._prefill_plan(model, mode, strict, placement)
        self.mode = self.prefill_model.mode
        # Every plan the pipeline makes (prefill, decode, blocks) is placed alike (docs/devices.md).
        self.placement = self.prefill_model.placement_request
        self.registry = self.prefill_model.registry
        self.store.share(self.prefill_model.plan())
        with self.phase("metadata"):
            meta = self._metadata()
        self.name: str = meta["name"]
        self.past_names: list[str] = meta["past"]
        if not self.past_names:
            raise InputError(f"model {self.name!r} has no past_key_values.N.* inputs: not a KV-cache decoder")
        # The embedding tables' ends (None where the model has none: rotary positions), checked before running.
        self.vocab: TableLimit | None = meta["vocab"]
        self.positions: TableLimit | None = meta["positions"]
        self.max_length = int(max_length)
        self.block_size = int(block_size)
        # Blocks of block_size decode steps (greedy or sampled) as one plan
        # (dsp_core/llm/block.py): one replay per block. None: on where the decode state lives on a device (a replay
        # is a graph launch there); on the CPU a block replay saves nothing.
        self.block_capture = block_capture
        self._decoders: dict[int, Decoder] = {}
        self._blocks: dict[tuple[Any, ...], CompiledModel] = {}
        self._default: GenerationSession | None = None
        self._resident: dict[int, DecodeState] = {}  # per batch: the arrays the decode plans read
        self._owners: dict[int, weakref.ref[GenerationSession]] = {}  # per batch: the session swapped in
        self.swaps = 0  # sessions swapped in (each: the KV prefixes copied out and back)
        self.lock = threading.RLock()

    # -- the prefill plan --------------------------------------------------------------
    def _prefill_plan(self, model: Any, mode: str | None, strict: bool | None, placement: Any) -> CompiledModel:
        """The prefill plan: the model's graph with its LM head cut to the last position, cached or compiled."""
        import dsp_core as dsp

        if isinstance(model, Graph):
            self.store = PlanStore(None)  # only a model given by its content has a disk-cache key
            self._graph = model
            return dsp.compile(self._prefill_graph(), mode=mode, strict=strict, placement=placement)
        if isinstance(model, CompiledModel):
            self.store = PlanStore(None)
            self._load_graph = lambda: model.graph
            placement = model.placement_request if placement is None else placement
            if mode is None and placement == model.placement_request:
                self.prefill_logits = _given_logits(model.plan())
                return model  # the caller's plan, run as it is
            mode = mode or model.mode.name
            return dsp.compile(self._prefill_graph(), mode=mode, strict=strict, placement=placement)
        source = loader.as_source(str(model) if isinstance(model, Path) else model)
        self.store = PlanStore(source)
        self._load_graph = lambda: loader.import_model(source)
        # The options as dsp.compile resolves them (None: DSP_MODE, DSP_STRICT, DSP_PLACEMENT).
        self.mode, strict_on, self.placement = config.compile_options(mode, strict, placement)
        cached = self.cached_model("prefill", PREFILL, self._prefill_graph, _check_prefill, strict=strict_on)
        if cached is not None:
            prefill, self.prefill_logits = cached
        else:
            prefill = self.new_model(self._prefill_graph(), strict=strict_on)
            self._store_prefill(prefill.plan())
        prefill.when_plan_learns(self._store_prefill)  # capture gaps learned: later starts know them
        return prefill

    def _prefill_graph(self) -> Graph:
        """The graph the prefill plan runs: the model's, its LM head reading the last position only (lm_head.py)."""
        graph = self.graph
        with self.phase("rewrite prefill graph"):
            cut = last_position_logits(graph, LOGITS)
        self.prefill_logits = cut.kept
        if cut.graph is not graph:
            self.store.stats.rewrites += 1
        elif cut.head is None:
            log.info("DSP pipeline %s: the prefill computes every position's logits: %s", graph.name, cut.reason)
        return cut.graph

    def _store_prefill(self, plan: Plan | None) -> None:
        if plan is not None:  # a declined graph runs on the interpreter: nothing to store
            self.store.put("prefill", PREFILL, {"logits": self.prefill_logits}, plan)

    # -- the warm start ----------------------------------------------------------------
    @property
    def graph(self) -> Graph:
        """The model's graph as given (not the prefill's rewrite), imported on first use (a warm start needs none)."""
        if self._graph is None:
            assert self._load_graph is not None
            with self.phase("import graph"):
                self._graph = self._load_graph()
            self.store.stats.graph_imports += 1
        return self._graph

    @property
    def warm_stats(self) -> dict[str, int]:
        """What this pipeline took from the disk cache and what it built (see store.WarmStats)."""
        return self.store.stats.as_dict()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the start into ``timings`` (its own seconds: nested phases are not counted twice)."""
        entry = [time.perf_counter(), 0.0]
        self._phases.append(entry)
        try:
            with progress.step(name):
                yield
        finally:
            self._phases.pop()
            spent = time.perf_counter() - entry[0]
            self.timings[name] = self.timings.get(name, 0.0) + spent - entry[1]
            if self._phases:
                self._phases[-1][1] += spent

    def _metadata(self) -> dict[str, Any]:
        """What the pipeline needs from the graph (name, KV inputs, table limits): from the cache, or the graph."""
        got = self.store.get("meta", {})
        if got is not None:
            info = got[0]
            try:
                meta = {
                    "name": info["name"],
                    "past": info["past"],
                    "vocab": TableLimit.from_json(info["vocab"]),
                    "positions": TableLimit.from_json(info["positions"]),
                }
                if not isinstance(meta["name"], str) or not isinstance(meta["past"], list):
                    raise EntryError("name or past has the wrong type")
                if not all(isinstance(n, str) for n in meta["past"]):
                    raise EntryError("past names must be strings")
            except (KeyError, ValueError) as exc:
                self.store.reject("meta", {}, exc)
            else:
                self.store.hit()
                return meta
        graph = self.graph
        vocab, positions = table_limit(graph, "input_ids"), table_limit(graph, "position_ids")
        meta = {"name": graph.name, "past": past_inputs(graph), "vocab": vocab, "positions": positions}
        if meta["past"]:
            info = {**meta, "vocab": vocab and vocab.to_json(), "positions": positions and positions.to_json()}
            self.store.put("meta", {}, info)
        return meta

    def new_model(self, graph: Graph, strict: bool = False) -> CompiledModel:
        """A plan of a rewritten graph (prefill, decode, block), compiled here (a cold start, or a miss)."""
        with self.phase("compile plan"):
            model = CompiledModel(graph, self.mode, strict, registry=self.registry, placement=self.placement)
        return model

    def cached_model(
        self,
        kind: str,
        params: dict[str, Any],
        load_graph: Callable[[], Graph],
        check: Callable[[dict[str, Any], CompiledModel], Any] | None = None,
        strict: bool = False,
    ) -> tuple[CompiledModel, Any] | None:
        """(model, what ``check`` returned) from the disk cache's ``kind`` entry, or None to build it.

        ``check(info, model)`` reads what the pipeline needs from the entry's JSON and
        checks the plan against it; an EntryError or ValueError there, or a plan that
        fails to start for a reason that is not DSP's kind of "no" (a mode nobody
        installed, a strict failure: those are raised), rejects the entry.
        """
        with self.phase(f"load {kind} plan"):
            fetched = self.store.fetch(kind, params)
        if fetched is None:
            return None
        if self.registry is None:
            # The plan's weights are being read on background threads meanwhile (PlanStore.fetch):
            # discovering the backends needs none of them.
            with self.phase("discover backends"):
                self.registry = discover()
        with self.phase(f"load {kind} plan"):
            got = fetched.load()
        if got is None:
            return None
        info, plan = got
        try:
            with self.phase(f"start {kind} plan"):
                model = CompiledModel(
                    None,
                    self.mode,
                    strict,
                    registry=self.registry,
                    plan=plan,
                    load_graph=load_graph,
                    stats=CacheStats(disk_hits=1),
                    placement=self.placement,
                )
            found = check(info, model) if check is not None else None
        except DSPError:
            raise
        except Exception as exc:  # noqa: BLE001  (whatever an entry holds, it only costs a rebuild)
            self.store.reject(kind, params, exc)
            return None
        self.store.hit()
        return model, found

    def activate(self, session: GenerationSession) -> DecodeState:
        """Swap ``session`` into its batch size's resident decode arrays; returns them.

        The session swapped out keeps a copy of its valid KV prefix (positions
        ``0 .. position - 1``; the rest of a buffer is never read unmasked), and the one
        swapped in gets its own back. A session that never held tokens needs no copy.
        """
        batch = session.batch
        state = self._resident.get(batch)
        if state is None:
            state = self._resident[batch] = DecodeState(self.decoder(batch))
        ref = self._owners.get(batch)
        owner = ref() if ref is not None else None
        if owner is session:
            return state
        if owner is not None and owner.position > 0:
            owner.saved = state.save(owner.position)
        if session.saved is not None:
            state.restore(session.saved)
            session.saved = None
        self._owners[batch] = weakref.ref(session)
        self.swaps += 1
        return state

    # -- limits ------------------------------------------------------------------------
    def check_ids(self, ids: np.ndarray) -> None:
        """InputError when a token id lies outside the model's vocabulary (its token embedding's rows)."""
        if ids.size == 0:
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0:
            raise InputError(f"token id {low} is negative: token ids are 0 .. vocabulary size - 1")
        if self.vocab is not None and high >= self.vocab.rows:
            raise InputError(
                f"token id {high} exceeds the model's vocabulary: {self.vocab.rows} tokens, ids "
                f"0..{self.vocab.rows - 1} (input_ids index {self.vocab.describe()}); the ids come from a tokenizer "
                "or prompt that does not match this model"
            )

    def check_positions(self, fed: int, what: str, remedy: str) -> None:
        """InputError when feeding ``fed`` tokens in all would pass the model's learned positions."""
        if self.positions is None or fed <= self.positions.rows:
            return
        raise InputError(
            f"{what} need positions 0..{fed - 1}, but the model's positions end at {self.positions.rows} "
            f"(0..{self.positions.rows - 1}: position_ids index {self.positions.describe()}): {remedy}"
        )

    def check_request(self, ids: np.ndarray, max_new_tokens: int) -> None:
        """Before any plan runs: the prompt's ids, and room for the prompt and ``max_new_tokens`` more."""
        self.check_ids(ids)
        fed = ids.shape[1] + max(max_new_tokens, 1) - 1  # the last new token is chosen, never fed
        what = f"a {ids.shape[1]}-token prompt and {max_new_tokens} new tokens"
        if fed > self.max_length:
            raise InputError(
                f"{what} need {fed} KV positions, more than max_length {self.max_length}: "
                "build the pipeline with a larger max_length"
            )
        room = self.positions.rows - ids.shape[1] + 1 if self.positions is not None else 0
        remedy = f"ask for at most {room} new tokens after this prompt" if room > 0 else "shorten the prompt"
        self.check_positions(fed, what, remedy)

    # -- plans -------------------------------------------------------------------------
    def decoder(self, batch: int = 1) -> Decoder:
        """The decode plan for ``batch`` rows (built on first use)."""
        if batch not in self._decoders:
            self._decoders[batch] = Decoder(self, batch)
        return self._decoders[batch]

    @property
    def decode_model(self) -> CompiledModel:
        """The batch-1 decode model (``decode_model.dsp`` shows its phase and counters)."""
        return self.decoder(1).model

    def warmup(self, batch: int = 1) -> None:
        """Drive the decode plan to REPLAYING (or REPLAY_BLOCKED) on a throwaway session's arrays."""
        decoder = self.decoder(batch)
        if decoder.warmed:
            return
        decoder.warmed = True
        with self.phase("decode warm-up"):
            self._drive(decoder.model, batch)
        # Block plans are built when a generation first runs a full block (block_model),
        # for the sampling it uses, warmed on that session's arrays.

    def _drive(self, model: CompiledModel, batch: int, session: GenerationSession | None = None, **extra: Any) -> None:
        """Run ``model`` on ``session``'s decode arrays until it replays (or cannot capture).

        Without a session, a throwaway one at position 0: swapping it in keeps whatever
        the other sessions hold (activate), and what the runs write at its positions is
        never read by another session unmasked, so nothing needs clearing after.
        """
        if session is None:
            session = GenerationSession(self, batch)
            session.state.set_position(0)
        feeds = {**session.state.feeds, **extra}
        for _ in range(WARMUP_STEPS):
            model.run(feeds)
            if model.dsp.phase in (PlanPhase.REPLAYING, PlanPhase.REPLAY_BLOCKED):
                break

    def captures_blocks(self, batch: int = 1) -> bool:
        """Whether decoding runs K-step block plans (``block_capture``, or by default on a device)."""
        if self.block_capture is not None:
            return bool(self.block_capture)
        return self.decoder(batch).xp is not np

    def block_model(
        self, batch: int, k: int, sampling: Sampling = GREEDY, session: GenerationSession | None = None
    ) -> CompiledModel:
        """The K-step block plan for ``batch`` rows and ``sampling`` (built, frozen and warmed on first use).

        One plan per (batch, k) for greedy decoding, and per (batch, k, temperature,
        top_k, top_p) for sampling (the seed is not part of it: the uniforms are fed).
        Warming runs the block on ``session``'s arrays at its position (it writes only
        the K positions the block is about to write), or, without a session, on a
        throwaway session's.
        """
        key = block_key(batch, k, sampling)
        if key not in self._blocks:
            decoder = self.decoder(batch)
            params = {"batch": batch, "max_length": self.max_length, "block": list(key)}

            def graph() -> Graph:
                with self.phase("unroll block"):
                    block = unroll(decoder.fixed, k, sampling)
                self.store.stats.rewrites += 1
                return block

            with self.phase("block plan"):
                cached = self.cached_model("block", params, graph, _check_block)
                if cached is not None:
                    model = cached[0]
                else:
                    model = self.new_model(graph())
                    self.store.put("block", params, {}, model.plan())
            model.dsp.mark_variable(state_inputs(decoder.layout, model))
            model.dsp.freeze()
            if decoder.xp is not np:
                model.outputs_on_device = True
            uniforms = {} if sampling.greedy else {UNIFORMS: np.full((k, batch), 0.5)}
            with self.phase("block warm-up"):
                self._drive(model, batch, session, **uniforms)
            self._blocks[key] = model
        return self._blocks[key]

    # -- sessions ----------------------------------------------------------------------
    def session(self, batch: int = 1) -> GenerationSession:
        """A new, independent session (its own KV buffers)."""
        return GenerationSession(self, batch)

    def _session(self, batch: int) -> GenerationSession:
        if self._default is None or self._default.batch != batch:
            self._default = GenerationSession(self, batch)
        return self._default

    @property
    def position(self) -> int:
        """Tokens held by the default session (the one ``generate`` uses)."""
        return self._default.position if self._default is not None else 0

    def reset_position(self) -> None:
        """Reset the default session to position 0."""
        if self._default is not None:
            self._default.reset_position()

    # -- generating --------------------------------------------------------------------
    def generate(
        self,
        input_ids: Any,
        max_new_tokens: int = 32,
        sampling: Sampling | None = None,
        stop_tokens: Sequence[int] = (),
        on_tokens: Callable[[np.ndarray], None] | None = None,
        block_size: int | None = None,
    ) -> GenerationResult:
        """Prefill ``input_ids`` ([B, n] or [n]) on the default session, then generate."""
        ids = np.asarray(input_ids, dtype=np.int64)
        ids = ids[None, :] if ids.ndim == 1 else ids
        if ids.ndim == 2:
            self.check_request(ids, max_new_tokens)
        with self.lock:
            # The decode plan's warm-up (on a GPU, its capture) runs after the first token is out
            # (GenerationSession._generate): the first token needs the prefill alone.
            session = self._session(ids.shape[0])
            session.reset_position()
            session.append(ids)
            return session.generate(max_new_tokens, sampling, stop_tokens, on_tokens, block_size)
