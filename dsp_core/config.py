"""Every option of DSP, in one table: property name, DSP_* variable, type, default, one line of doc.

Precedence: an explicit argument > the environment > the default. A value outside an
option's allowed set raises ConfigError naming the option and what is allowed, where it
is first read. Each option has one parser (its ``type``), and every reader of the option
goes through ``get``: ``dsp.compile``, the disk cache and ``dsp config`` agree on what a
value means. An environment variable set to the empty string counts as unset.

    from dsp_core import config
    config.get("explain_cache_misses")            # from DSP_EXPLAIN_CACHE_MISSES, else False
    config.get("plan_cache_capacity", explicit=8)
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.errors import ConfigError


@dataclass(frozen=True)
class Option:
    """One configurable option."""

    name: str
    env: str
    type: str  # "bool", "int", "float", "size" (bytes: 4G, 512M, 4096), "mode", "str", "path", "choice"
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None


OPTIONS: tuple[Option, ...] = (
    Option(
        "mode",
        "DSP_MODE",
        "mode",
        GraphExecutionMode.AUTO,
        "Default execution mode of dsp.compile and the CLI (a GraphExecutionMode name, any case).",
    ),
    Option(
        "strict",
        "DSP_STRICT",
        "bool",
        False,
        "Fail instead of falling back: to the reference backend, or from a GPU mode to a CPU one.",
    ),
    Option(
        "plan_cache_capacity",
        "DSP_PLAN_CACHE_CAPACITY",
        "int",
        0,
        "Live plans kept per model; 0 = automatic (64 with a GPU backend active, 4 on CPU).",
        minimum=0,
    ),
    Option(
        "plan_cache_budget",
        "DSP_PLAN_CACHE_BUDGET",
        "float",
        0.25,
        "Fraction of free host (or device) memory the live plans of a model may hold.",
        minimum=0.0,
        maximum=1.0,
    ),
    Option(
        "explain_cache_misses",
        "DSP_EXPLAIN_CACHE_MISSES",
        "bool",
        False,
        "Log which signature part differed from the nearest cached plan on every miss.",
    ),
    Option(
        "merge_products",
        "DSP_MERGE_PRODUCTS",
        "bool",
        True,
        "Merge sibling products (MatMul/Gemm of one input, constant weights of one K) into one (docs/merge.md).",
    ),
    Option("disk_cache", "DSP_DISK_CACHE", "bool", True, "Keep compiled plans on disk between processes."),
    Option(
        "cache_dir", "DSP_CACHE_DIR", "path", "", "Disk cache directory; empty = $XDG_CACHE_HOME/dsp or ~/.cache/dsp."
    ),
    Option(
        "cache_max_bytes",
        "DSP_CACHE_MAX_BYTES",
        "size",
        4 << 30,
        "Disk cache size bound (plans and weight files); least recently used entries are evicted beyond it.",
        minimum=1,
    ),
    Option(
        "cache_override_dir",
        "DSP_CACHE_OVERRIDE_DIR",
        "path",
        "",
        "Pre-seeded plan entries: looked up first, never written, never evicted.",
    ),
    Option("force_recompile", "DSP_FORCE_RECOMPILE", "bool", False, "Ignore cached plans (they are still written)."),
    Option(
        "cache_verify_weights",
        "DSP_CACHE_VERIFY_WEIGHTS",
        "choice",
        "changed",
        "When a start hashes a cached weight file: changed = only when its stat signature moved since DSP last "
        "knew its bytes (docs/cache.md); always = every start.",
        choices=("changed", "always"),
    ),
    Option(
        "freeze_after",
        "DSP_FREEZE_AFTER",
        "int",
        2,
        "Freeze a live plan after this many executions of its shape signature (0 = only on freeze()).",
        minimum=0,
    ),
    Option("no_freeze", "DSP_NO_FREEZE", "bool", False, "Never freeze plans (a debugging switch)."),
    Option(
        "cpu_threads",
        "DSP_CPU_THREADS",
        "int",
        0,
        "Threads a CPU segment runtime (OpenVINO, ONNX Runtime) may use per call (AUTO's trial gives a short "
        "segment fewer where they ran it faster); 0 = the runtime's default.",
        minimum=0,
    ),
    Option(
        "cpu_precision",
        "DSP_CPU_PRECISION",
        "choice",
        "f32",
        "Inference precision of CPU segment runtimes; bf16 is used only where the backend's contract allows it.",
        choices=("f32", "bf16"),
    ),
    Option(
        "disable_plugins",
        "DSP_DISABLE_PLUGINS",
        "str",
        "",
        "Backend plugins discovery skips, as if not installed: a comma list of entry-point names (dsp backends list).",
    ),
    Option(
        "auto_exclude",
        "DSP_AUTO_EXCLUDE",
        "str",
        "openvino,onnxruntime,numpy_replay",
        "Backends AUTO leaves out, a comma list of names; a mode named explicitly still runs. Default: the native "
        "CPU runtimes, which crash or disagree on malformed models, and numpy_replay, which keeps a buffer for every "
        "value of its segments and costs a timed trial against the reference at each freeze "
        "(docs/cpu-backends.md); `none` lets AUTO use all three on models you trust.",
    ),
    Option(
        "huge_pages",
        "DSP_HUGE_PAGES",
        "int",
        32,
        "A native runtime's compile that allocates at least this many MiB (its copies of the weights) has that "
        "memory backed by transparent huge pages (Linux, THP madvise or always; 0 = off): a decode step that "
        "streams its weights takes fewer TLB misses (docs/cpu-backends.md).",
        minimum=0,
    ),
    Option(
        "auction_trials",
        "DSP_AUCTION_TRIALS",
        "int",
        5,
        "Timed runs per candidate when two backends take a segment (at freeze; 0 = the fixed chain decides).",
        minimum=0,
    ),
    Option(
        "replay_contest",
        "DSP_REPLAY_CONTEST",
        "bool",
        True,
        "While a plan replays, time a short CPU segment's close runner-up in the auction's trial against "
        "its winner now and then, on real steps, and keep the faster (AUTO).",
    ),
    Option(
        "triton_products",
        "DSP_TRITON_PRODUCTS",
        "bool",
        True,
        "dsp-triton runs products of at most 16 rows (decode projections, the LM head) as its own "
        "skinny-product kernels with their epilogues fused; off: they run on cuBLAS.",
    ),
    Option(
        "triton_conv_epilogue",
        "DSP_TRITON_CONV_EPILOGUE",
        "bool",
        True,
        "dsp-triton runs a biased convolution on cuDNN without its bias and adds the bias in the "
        "generated kernel of the pointwise ops after it (activation, residual add); off: cuDNN adds "
        "the bias and those ops are a kernel of their own.",
    ),
    Option(
        "triton_flash_attention",
        "DSP_TRITON_FLASH_ATTENTION",
        "bool",
        True,
        "dsp-triton runs the attention of several query rows (an encoder's, a prefill's: scores with "
        "scale and mask, softmax, the weighted sum, the heads' transpose and merge after it) as one "
        "kernel with an online softmax per row, BLOCK_M rows a program; off: the scores product and the "
        "weighted sum on cuBLAS, the softmax and the transpose as kernels of their own.",
    ),
    Option(
        "triton_attention",
        "DSP_TRITON_ATTENTION",
        "bool",
        True,
        "dsp-triton runs decode attention (scores with scale and mask, softmax, the weighted sum) as one "
        "kernel with an online softmax, split over the KV positions past 256 (then combined); off: the "
        "scores product, the softmax and the weighted sum as three kernels.",
    ),
    Option(
        "triton_decode_fusion",
        "DSP_TRITON_DECODE_FUSION",
        "bool",
        True,
        "dsp-triton's decode fusions: a norm as the prologue of the product that alone reads it, the KV "
        "store as the last store of the kernel that computes its row, one rotary kernel per q and k "
        "(about 9 kernels per Llama layer instead of 14; checked on the H200, docs/fusion.md). 0: each "
        "norm, KV store and rotary half a kernel of its own.",
    ),
    Option(
        "triton_kv_splits",
        "DSP_TRITON_KV_SPLITS",
        "int",
        0,
        "Ranges of KV positions dsp-triton's decode attention splits into (then combines); 0: about 64 "
        "positions a program past 256 positions (at most 64 ranges), 1: no split.",
        minimum=0,
    ),
    Option(
        "triton_tune_flush",
        "DSP_TRITON_TUNE_FLUSH",
        "bool",
        True,
        "dsp-triton's tuner times each config's launch after a write that evicts the L2 cache (a decode "
        "step's weights are read once, cold); off: launches back to back, inputs left in L2 (as an "
        "encoder's attention reads what the kernel before it wrote). Tuning winners are cached per setting.",
    ),
    Option(
        "triton_pdl",
        "DSP_TRITON_PDL",
        "bool",
        True,
        "dsp-triton launches its kernels as programmatic dependents on sm_90+ GPUs (each waits for the "
        "kernel before it, then lets the next one launch, so launches overlap work inside a replayed "
        "graph; docs/fusion.md), all but the flash attention of several query rows, which loses time "
        "launched early; read once per process; off: plain launches.",
    ),
    Option(
        "nvrtc_attention",
        "DSP_NVRTC_ATTENTION",
        "bool",
        True,
        "dsp-nvrtc runs decode attention (scores with scale and mask, softmax, the weighted sum) as one "
        "CUDA C kernel: one block a head up to 256 KV positions, past that one block per head and range of "
        "about 64 positions, then a combine kernel (docs/nvrtc.md); off: cuBLAS products and a softmax row "
        "kernel, with a copy for GQA's expand.",
    ),
    Option(
        "nvrtc_product_columns",
        "DSP_NVRTC_PRODUCT_COLUMNS",
        "int",
        0,
        "Adjacent output columns one warp (or block) of a dsp-nvrtc product by a big constant weight "
        "computes, reading A once for all of them (dsp-triton's product programs compute a tile of "
        "columns); 0: auto (with a norm prologue, the fewest columns that let every block be resident "
        "at once; else two where a warp computes one of many outputs, one otherwise; docs/nvrtc.md).",
        minimum=0,
        maximum=8,
    ),
    Option(
        "nvrtc_product_lanes",
        "DSP_NVRTC_PRODUCT_LANES",
        "choice",
        "auto",
        "Lanes that share one output of a dsp-nvrtc product by a big constant weight: auto (the rule in "
        "docs/nvrtc.md: a warp where warps fill the GPU, a block where K is long and the outputs few), "
        "warp, or block (for measuring the rule).",
        choices=("auto", "warp", "block"),
    ),
    Option(
        "nvrtc_kv_splits",
        "DSP_NVRTC_KV_SPLITS",
        "int",
        0,
        "Ranges of KV positions dsp-nvrtc's decode attention splits into (one block each, then a combine "
        "kernel); 0: the rule dsp-triton's kernel follows (about 64 positions a block past 256 positions, "
        "at most 64 ranges), 1: one block a head.",
        minimum=0,
    ),
    Option(
        "runtime_kv_store",
        "DSP_RUNTIME_KV_STORE",
        "bool",
        True,
        "The whole-segment CPU backends (onnxruntime, openvino) take the decode plan's KV stores into their "
        "segment (ScatterElements inside the runtime's model; the segment writes the rows into the KV buffer "
        "after the call), so a decode step is one runtime call (docs/cpu-backends.md); off: each store ends a "
        "segment and runs on the reference.",
    ),
    Option(
        "runtime_kv_in_place",
        "DSP_RUNTIME_KV_IN_PLACE",
        "bool",
        True,
        "ONNX Runtime's replays bind each KV store's updated buffer onto the KV buffer itself, so its "
        "TensorScatter (opset 24, where the segment allows it; else ScatterElements, which still passes over "
        "the buffer) writes only the new rows instead of copying the whole buffer every step "
        "(docs/cpu-backends.md); off: the buffer is copied inside the call and the rows written after it.",
    ),
    Option(
        "runtime_kv_window",
        "DSP_RUNTIME_KV_WINDOW",
        "bool",
        True,
        "ONNX Runtime's decode step (KV stores as TensorScatter) has each attention read only the KV positions "
        "written so far, not the whole fixed buffer, while they are fewer than half of it at one thread (a third "
        "at more): the buffers and masks are sliced to position + rows inside its session, and an If per layer "
        "reads the whole buffer from there on, where that is cheaper than the slices' copies "
        "(docs/cpu-backends.md); off: the attention reads the whole buffer always, the unused tail masked.",
    ),
    Option(
        "nvrtc_kv_fusion",
        "DSP_NVRTC_KV_FUSION",
        "bool",
        True,
        "dsp-nvrtc writes a decode step's KV rows from the kernel that computes them (a pointwise or copy "
        "group: GPT-2's split of the QKV product, Llama's rotary of K), so a KV store is no kernel of its "
        "own (docs/nvrtc.md); off: each store its own kernel.",
    ),
    Option(
        "nvrtc_norm_prologue",
        "DSP_NVRTC_NORM_PROLOGUE",
        "bool",
        True,
        "dsp-nvrtc computes a norm (LayerNorm, RMSNorm) in the prologue of the one-row product that reads "
        "it: each block of the product's kernel reduces the row and stages it normalised in shared memory, "
        "so the norm is no kernel of its own (docs/nvrtc.md); off: the norm's own row kernel.",
    ),
    Option(
        "nvrtc_pdl",
        "DSP_NVRTC_PDL",
        "bool",
        True,
        "dsp-nvrtc launches its kernels as programmatic dependents on sm_90+ GPUs (cuLaunchKernelEx; each "
        "kernel waits for the one before it, its constant weights read first, so launches and weight "
        "loads overlap work inside a replayed graph; docs/nvrtc.md); read once per process; off: plain launches.",
    ),
    Option(
        "ptx_dir",
        "DSP_PTX_DIR",
        "path",
        "",
        "The PTX bundle: dsp-nvrtc's generated kernels as PTX, one file each, which PTX_JIT loads where "
        "NVRTC is not installed (docs/nvrtc.md); empty = <DSP cache directory>/ptx.",
    ),
    Option(
        "nvrtc_export_ptx",
        "DSP_NVRTC_EXPORT_PTX",
        "bool",
        False,
        "NVRTC_JIT also compiles each kernel it builds to PTX for the device's virtual architecture and "
        "writes it to the PTX bundle (DSP_PTX_DIR), for PTX_JIT on machines without NVRTC (docs/nvrtc.md).",
    ),
    Option(
        "cublas_tf32",
        "DSP_CUBLAS_TF32",
        "bool",
        False,
        "Allow TF32 in float32 cuBLAS products of GPU backends (faster, not deterministic); read at plugin load.",
    ),
    Option(
        "cudnn_algo",
        "DSP_CUDNN_ALGO",
        "choice",
        "timed",
        "How GPU backends choose a convolution's cuDNN algorithm, once per layout before capture: timed "
        "(cuDNN's search and heuristics shortlist a few, DSP times each over repeated calls and keeps the "
        "fastest), find (what cuDNN's own search, best of three, timed fastest), heuristic (cuDNN's "
        "heuristic first choice, untimed). Read when the backend first runs a convolution.",
        choices=("timed", "find", "heuristic"),
    ),
    Option(
        "oom_retries",
        "DSP_OOM_RETRIES",
        "int",
        3,
        "Times a capture that ran out of memory is retried before the segment fails for good.",
        minimum=0,
    ),
    Option(
        "oom_retry_every",
        "DSP_OOM_RETRY_EVERY",
        "int",
        16,
        "Executions between retries of a capture that ran out of memory.",
        minimum=1,
    ),
    Option(
        "capture_fault",
        "DSP_CAPTURE_FAULT",
        "str",
        "",
        "Test switch: every capture of a slot of these ops (OP[,OP...]) fails, on any capturing backend.",
    ),
    # -- bounds on what a model may ask for (docs/robustness.md); no real model comes near them --
    Option(
        "max_tensor_elements",
        "DSP_MAX_TENSOR_ELEMENTS",
        "int",
        1 << 40,
        "Largest element count a model may declare for one tensor (graph inputs, outputs, value_info).",
        minimum=1,
    ),
    Option(
        "max_node_outputs",
        "DSP_MAX_NODE_OUTPUTS",
        "int",
        1 << 16,
        "Most outputs one node may name (Split, Loop, If, ...).",
        minimum=1,
    ),
    Option(
        "max_loop_iterations",
        "DSP_MAX_LOOP_ITERATIONS",
        "int",
        10_000_000,
        "Most iterations one Loop or Scan may run; more is a KernelError naming the node.",
        minimum=1,
    ),
    Option(
        "shape_inference_timeout",
        "DSP_SHAPE_INFERENCE_TIMEOUT",
        "float",
        10.0,
        "Seconds ONNX's shape inference may take in its sandbox process (0 = do not run it).",
        minimum=0.0,
    ),
    Option(
        "shape_inference_memory_mb",
        "DSP_SHAPE_INFERENCE_MEMORY_MB",
        "int",
        2048,
        "Memory (MiB) ONNX's shape inference may add in its sandbox process.",
        minimum=64,
    ),
    Option(
        "plugin_timeout",
        "DSP_PLUGIN_TIMEOUT",
        "float",
        5.0,
        "Seconds a backend plugin's import or availability probe may take before it is skipped (0 = no limit).",
        minimum=0.0,
    ),
    # -- diagnostics (dsp_core.diag, docs/diagnostics.md) --
    Option(
        "diagnostics",
        "DSP_DIAGNOSTICS",
        "str",
        "",
        "Diagnostic categories to record: a comma list (CACHE,SEGMENT,...) or ALL; empty = off.",
    ),
    Option(
        "diagnostics_level",
        "DSP_DIAGNOSTICS_LEVEL",
        "choice",
        "summary",
        "How much the enabled categories record (set alone, it enables ALL).",
        choices=("off", "summary", "detailed", "full"),
    ),
    Option(
        "diagnostics_file",
        "DSP_DIAGNOSTICS_FILE",
        "path",
        "",
        "Where the diagnostics dump is written at exit (and by diag.dump()); empty = no dump.",
    ),
    Option(
        "flight_recorder",
        "DSP_FLIGHT_RECORDER",
        "bool",
        True,
        "When a step raises, write its last events to DSP_CACHE_DIR/flight/ and name that file in the error.",
    ),
    Option(
        "flight_events",
        "DSP_FLIGHT_EVENTS",
        "int",
        2000,
        "Events a flight-recorder file keeps (the most recent).",
        minimum=1,
    ),
    Option(
        "placement",
        "DSP_PLACEMENT",
        "choice",
        "single_device",
        "How dsp.compile places a plan's slots on devices (docs/devices.md); a name-pattern map is an argument only.",
        choices=("single_device", "memory_fit", "pipeline_parallel"),
    ),
    Option(
        "split_siblings",
        "DSP_SPLIT_SIBLINGS",
        "bool",
        False,
        "After placement, spread sibling products that read one input (Q/K/V, gate/up) over the devices.",
    ),
    Option(
        "max_device_memory",
        "DSP_MAX_DEVICE_MEMORY",
        "size",
        0,
        "Per-process cap on the bytes placement puts on each device; 0 = no cap (free memory minus the reserve).",
        minimum=0,
    ),
    Option(
        "device_memory_reserve",
        "DSP_DEVICE_MEMORY_RESERVE",
        "float",
        0.1,
        "Fraction of each device's free memory placement leaves for activations, workspaces and other processes.",
        minimum=0.0,
        maximum=0.9,
    ),
    Option(
        "progress",
        "DSP_PROGRESS",
        "choice",
        "auto",
        "Progress bars on stderr for long steps: auto (a terminal, steps over 1 s), on (every step), off.",
        choices=("auto", "on", "off"),
    ),
)

_BY_NAME = {o.name: o for o in OPTIONS}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def option(name: str) -> Option:
    """The Option called ``name``."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(f"unknown option {name!r}; options are {', '.join(sorted(_BY_NAME))}") from None


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i?b)?|b)?", re.IGNORECASE)
_SIZE_ALLOWED = "bytes, optionally with a K, M, G or T suffix (powers of 1024): 4096, 512M, 4G, 2GiB"


def parse_size(raw: Any) -> int:
    """Bytes from ``4096``, ``512M``, ``4G``, ``2GiB``, ``1.5T`` (suffixes are powers of 1024); ValueError if not."""
    if isinstance(raw, bool):
        raise ValueError(f"not a size: {raw!r}")
    if isinstance(raw, int):
        return raw
    match = _SIZE.fullmatch(str(raw).strip())
    if match is None:
        raise ValueError(f"not a size: {raw!r}")
    return int(float(match[1]) * 1024 ** " kmgt".index((match[2] or " ").lower()))


def format_size(n: int) -> str:
    """The shortest exact form of ``n`` bytes that ``parse_size`` reads back (4G, 512M, 4097)."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _parse_mode(raw: Any) -> GraphExecutionMode:
    try:
        return GraphExecutionMode.parse(raw)
    except ConfigError:
        raise ValueError(f"unknown execution mode {raw!r}") from None


def _parse(opt: Option, raw: Any, where: str) -> Any:
    def bad(allowed: str) -> ConfigError:
        return ConfigError(f"{where} = {raw!r} is invalid for option {opt.name}: expected {allowed}")

    if opt.type == "mode":
        try:
            return _parse_mode(raw)
        except ValueError:
            names = ", ".join(m.name.lower() for m in GraphExecutionMode)
            raise ConfigError(
                f"{where} = {raw!r} is invalid for option {opt.name}: unknown execution mode; expected one of {names} "
                "(any case; `dsp backends list` shows which are installed)"
            ) from None
    parsers: dict[str, Callable[[Any], Any]] = {"int": int, "float": float, "size": parse_size}
    if opt.type == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise bad("one of 1/0, true/false, yes/no, on/off")
    if opt.type in parsers:
        try:
            value = parsers[opt.type](raw)
        except (TypeError, ValueError, OverflowError):
            raise bad(_SIZE_ALLOWED if opt.type == "size" else f"a number ({opt.type})") from None
        if isinstance(value, float) and math.isnan(value):
            raise bad(f"a number ({opt.type})")
        if (opt.minimum is not None and value < opt.minimum) or (opt.maximum is not None and value > opt.maximum):
            raise bad(f"a value in [{opt.minimum}, {opt.maximum if opt.maximum is not None else 'inf'}]")
        return value
    if opt.type == "choice" and str(raw) not in opt.choices:
        raise bad(f"one of {', '.join(opt.choices)}")
    return str(raw)


def get(name: str, explicit: Any = None, env: Mapping[str, str] | None = None) -> Any:
    """The value of option ``name``: ``explicit`` if given, else its DSP_* variable, else the default.

    ``env`` replaces ``os.environ`` (a DiskCache built from a given environment).
    """
    opt = option(name)
    if explicit is not None:
        return _parse(opt, explicit, f"argument {name}")
    raw = _raw(opt, env)
    if raw is not None:
        return _parse(opt, raw, opt.env)
    return opt.default


def _raw(opt: Option, env: Mapping[str, str] | None) -> str | None:
    """The option's variable, None when unset or empty."""
    raw = (os.environ if env is None else env).get(opt.env)
    return raw if raw is not None and raw.strip() else None


def source(name: str, explicit: Any = None) -> str:
    """Where the value of ``name`` comes from: 'argument', 'environment' or 'default'."""
    opt = option(name)
    if explicit is not None:
        return "argument"
    return "environment" if _raw(opt, None) is not None else "default"


def compile_options(
    mode: Any = None, strict: Any = None, placement: Any = None
) -> tuple[GraphExecutionMode, bool, Any]:
    """(mode, strict, placement) as ``dsp.compile`` resolves them: each argument, else its DSP_* variable.

    A placement is read from DSP_PLACEMENT only when that is set: None is one device, no placement pass.
    """
    if placement is None and source("placement") == "environment":
        placement = get("placement")
    return get("mode", mode), bool(get("strict", strict)), placement


def table() -> list[dict[str, Any]]:
    """Every option with its current value and where it came from (what `dsp config` prints).

    JSON-able. An invalid value does not stop the table: its row has the raw text as
    ``value`` and the ConfigError's message as ``error`` (None on valid rows).
    """
    rows = []
    for o in OPTIONS:
        error = None
        try:
            value = _shown(o, get(o.name))
        except ConfigError as exc:
            value, error = _raw(o, None), str(exc)
        rows.append(
            {
                "name": o.name,
                "env": o.env,
                "type": o.type,
                "default": _shown(o, o.default),
                "value": value,
                "source": source(o.name),
                "allowed": _allowed(o),
                "doc": o.doc,
                "error": error,
            }
        )
    return rows


def _shown(opt: Option, value: Any) -> Any:
    """A value as `dsp config` and docs/config.md show it: modes by name, sizes as 4G."""
    if isinstance(value, GraphExecutionMode):
        return value.name.lower()
    if opt.type == "size":
        return format_size(int(value))
    return value


def _allowed(opt: Option) -> str:
    if opt.choices:
        return " / ".join(opt.choices)
    if opt.type == "bool":
        return "1/0, true/false, yes/no, on/off"
    if opt.type == "mode":
        return "a GraphExecutionMode name (auto, slot_by_slot, cuda_graphs, ...)"
    if opt.type == "size":
        return "size: bytes, or with K/M/G/T (powers of 1024): 512M, 4G"
    if opt.minimum is not None or opt.maximum is not None:
        low = "-inf" if opt.minimum is None else f"{opt.minimum:g}"
        high = "inf" if opt.maximum is None else f"{opt.maximum:g}"
        return f"{opt.type} in [{low}, {high}]"
    return opt.type


def markdown_table() -> str:
    """docs/config.md, generated from OPTIONS (a test checks the committed file matches)."""
    lines = [
        "# Configuration",
        "",
        "<!-- Generated from dsp_core/config.py OPTIONS: python -m dsp_core.config --write-docs docs/config.md -->",
        "",
        "Every option of DSP. Precedence: an explicit argument > the environment variable > the default.",
        "`dsp config` prints the current values and where each came from, and marks an invalid one.",
        "A variable set to the empty string counts as unset. Every reader of an option parses it the",
        "same way; a value outside what is allowed is a `ConfigError` naming the variable, where it is",
        "first read (`DSP_MODE` and `DSP_STRICT`: by `dsp.compile` and every CLI command that compiles).",
        "",
        "| Option | Variable | Default | Allowed | Description |",
        "|---|---|---|---|---|",
    ]
    for o in OPTIONS:
        shown = _shown(o, o.default)
        default = "(empty)" if shown == "" else f"`{shown if isinstance(shown, str) else repr(shown)}`"
        lines.append(f"| `{o.name}` | `{o.env}` | {default} | {_allowed(o)} | {o.doc.replace('|', '&#124;')} |")
    return "\n".join(lines) + "\n"


def _main(argv: list[str] | None = None) -> int:
    """`python -m dsp_core.config --write-docs docs/config.md` (or print the table with no argument)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dsp_core.config")
    parser.add_argument("--write-docs", metavar="PATH", help="write the generated markdown table to PATH")
    args = parser.parse_args(argv)
    if args.write_docs:
        with open(args.write_docs, "w") as fh:
            fh.write(markdown_table())
    else:
        print(markdown_table(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
