"""`dsp generate` and `dsp validate`: text generation and cross-mode token validation.

dsp generate MODEL.onnx --tokenizer tokenizer.json --prompt "..." [--max-new-tokens N] [--mode M]
             [--temperature T --top-k K --top-p P --seed S] [--stop-token T ...] [--block-size K] [--json]
dsp validate MODEL.onnx [--modes auto,slot_by_slot,emulated_replay] [--golden FILE] [--threshold 0.99]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from dsp_core.errors import InputError
from dsp_core.llm.lm_head import LAST


def add_llm_commands(sub: Any) -> None:
    """Register the `generate` and `validate` sub-commands on the `dsp` parser."""
    gen = sub.add_parser("generate", help="generate text with a KV-cache decoder, streaming tokens")
    gen.add_argument("model", help="decoder .onnx (past_key_values.N.* -> present.N.*)")
    gen.add_argument("--tokenizer", help="a tokenizers tokenizer.json (needs `pip install dsp-core[llm]`)")
    gen.add_argument("--prompt", help="prompt text (needs --tokenizer)")
    gen.add_argument("--prompt-ids", help="prompt as comma-separated token ids (instead of --prompt)")
    gen.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    gen.add_argument("--max-length", type=int, default=None, metavar="L", help="KV buffer length (default: fits)")
    gen.add_argument("--mode", default=None, help="execution mode (default: DSP_MODE, else auto)")
    _add_sampling(gen)
    gen.add_argument("--stop-token", action="append", default=[], metavar="T", help="token id or token text")
    gen.add_argument("--block-size", type=int, default=8, metavar="K", help="decode steps per host call")
    gen.add_argument(
        "--block-capture",
        choices=["auto", "on", "off"],
        default="auto",
        help="K decode steps (greedy or sampled) as one plan: one graph launch per K tokens; auto: on a device",
    )
    gen.add_argument("--json", action="store_true", help="print the result and metrics as JSON at the end")
    gen.set_defaults(func=cmd_generate)

    val = sub.add_parser("validate", help="greedy tokens in every available mode vs SLOT_BY_SLOT (and golden)")
    val.add_argument("model", help="decoder .onnx")
    val.add_argument("--modes", default="", help="comma-separated modes (default: AUTO and every available mode)")
    val.add_argument("--golden", help=".npz with greedy_tokens (and prompt), or .npy of tokens")
    val.add_argument("--prompt-ids", help="comma-separated prompt ids (default: the golden prompt, or 1..7)")
    val.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    val.add_argument("--threshold", type=float, default=0.99, help="pass threshold of the match rate (0..1)")
    val.add_argument("--json", action="store_true", help="print JSON")
    val.set_defaults(func=cmd_validate)


def _add_sampling(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    cmd.add_argument("--top-k", type=int, default=0)
    cmd.add_argument("--top-p", type=float, default=1.0)
    cmd.add_argument("--seed", type=int, default=None)


def _ids(text: str) -> np.ndarray:
    try:
        return np.asarray([int(t) for t in text.replace(" ", "").split(",") if t], dtype=np.int64)
    except ValueError as exc:
        raise InputError(f"--prompt-ids: expected comma-separated integers, got {text!r}") from exc


def _tokenizer(path: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise InputError("--tokenizer needs the tokenizers library: pip install 'dsp-core[llm]'") from exc
    if not Path(path).is_file():
        raise InputError(f"--tokenizer {path!r}: no such file")
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001  (tokenizers raises a bare Exception for any bad file)
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise InputError(
            f"--tokenizer {path!r}: not a tokenizer file ({reason}); give the tokenizer.json of a `tokenizers` "
            "tokenizer (for a Hugging Face model: the tokenizer.json next to its weights)"
        ) from None


def cmd_generate(args: argparse.Namespace) -> int:
    """`dsp generate`: prefill the prompt, stream the new tokens, print tokens/s."""
    from dsp_core.llm import GenerationPipeline, Sampling

    tok = _tokenizer(args.tokenizer) if args.tokenizer else None
    if args.prompt_ids:
        prompt = _ids(args.prompt_ids)
    elif args.prompt is not None:
        if tok is None:
            raise InputError("--prompt needs --tokenizer (or give --prompt-ids)")
        prompt = np.asarray(tok.encode(args.prompt).ids, dtype=np.int64)
    else:
        raise InputError("give --prompt (with --tokenizer) or --prompt-ids")
    if prompt.size == 0:
        raise InputError("the prompt encodes to no tokens")
    stops = [_stop_id(s, tok) for s in args.stop_token]
    max_length = args.max_length or int(prompt.size + args.max_new_tokens)
    blocks = {"auto": None, "on": True, "off": False}[args.block_capture]
    pipe = GenerationPipeline(
        args.model, max_length=max_length, mode=args.mode, block_size=args.block_size, block_capture=blocks
    )
    pipe.check_request(prompt[None, :], args.max_new_tokens)  # ids and positions, before anything runs or prints
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    seen: list[int] = []
    printed = ""

    def stream(block: np.ndarray) -> None:
        nonlocal printed
        seen.extend(int(t) for t in block[0])
        if args.json:
            return
        if tok is None:
            print(" ".join(str(int(t)) for t in block[0]), end=" ", flush=True)
            return
        text = tok.decode(seen)
        print(text[len(printed) :] if text.startswith(printed) else " " + text, end="", flush=True)
        printed = text

    if not args.json and tok is not None:
        print(args.prompt if args.prompt is not None else tok.decode(prompt.tolist()), end=" ", flush=True)
    result = pipe.generate(prompt, args.max_new_tokens, sampling=sampling, stop_tokens=stops, on_tokens=stream)
    name, rate = result.metrics.effective
    if args.json:
        out = {
            "prompt_ids": prompt.tolist(),
            "tokens": result.token_list(),
            "text": tok.decode(result.token_list()) if tok is not None else None,
            "stopped": result.stopped,
            "metrics": result.metrics.as_dict(),
            "mode": pipe.mode.name,
            "decode_phase": pipe.decode_model.dsp.phase.name,
            "block_capture": pipe.captures_blocks(),
            "start": {"seconds": pipe.timings, "warm": pipe.warm_stats, "prefill_logits": pipe.prefill_logits},
        }
        print(json.dumps(out, indent=2))
        return 0
    print()
    rate_text = f"{rate:.1f}" if rate is not None else "n/a"
    print(f"{len(result.token_list())} tokens, {rate_text} tokens/s ({name}), mode {pipe.mode.name}", file=sys.stderr)
    print(start_line(pipe), file=sys.stderr)
    return 0


def start_line(pipe: Any) -> str:
    """Where the pipeline's set-up went, the phases adding up, and what came from the disk cache."""
    phases = {k: v for k, v in pipe.timings.items() if v >= 0.005}
    parts = " + ".join(f"{k} {v:.2f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]))
    warm = pipe.warm_stats
    cached = f"{warm['hits']} cached, {warm['writes']} stored" if pipe.store.enabled else "disk cache off"
    line = f"start {sum(pipe.timings.values()):.2f} s = {parts or '0'} ({cached})"
    if pipe.prefill_logits != LAST:  # the LM head was not found: the prefill computes every position
        line += f"; prefill logits: {pipe.prefill_logits}"
    return line


def _stop_id(text: str, tok: Any) -> int:
    if text.lstrip("-").isdigit():
        return int(text)
    if tok is not None and tok.token_to_id(text) is not None:
        return int(tok.token_to_id(text))
    raise InputError(f"--stop-token {text!r}: not an id, and not a token of the tokenizer")


def available_modes() -> list[str]:
    """AUTO and every mode an available, value-computing backend serves (discovery order)."""
    from dsp_core.backends.discovery import discover

    modes = ["AUTO"]
    for backend in discover().backends:
        if backend.availability().ok and backend.contract.computes_values and backend.mode.name not in modes:
            modes.append(backend.mode.name)
    return modes


def _golden(path: str | None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(tokens, prompt) from a golden file."""
    if path is None:
        return None, None
    if not Path(path).is_file():
        raise InputError(f"--golden {path!r}: no such file")
    data = np.load(path, allow_pickle=False)
    if isinstance(data, np.ndarray):
        return data.reshape(-1).astype(np.int64), None
    if "greedy_tokens" not in data.files:
        raise InputError(f"--golden {path!r}: no 'greedy_tokens' array (keys: {', '.join(data.files)})")
    prompt = data["prompt"].reshape(-1).astype(np.int64) if "prompt" in data.files else None
    return data["greedy_tokens"].reshape(-1).astype(np.int64), prompt


def validate(
    model: str, modes: list[str], prompt: np.ndarray, max_new_tokens: int, golden: np.ndarray | None
) -> dict[str, Any]:
    """Greedy tokens per mode and their match rate against SLOT_BY_SLOT (and the golden tokens)."""
    from dsp_core.llm import GenerationPipeline

    max_length = int(prompt.size + max_new_tokens)
    runs: dict[str, list[int]] = {}
    ran: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for mode in dict.fromkeys(["SLOT_BY_SLOT", *modes]):
        try:
            pipe = GenerationPipeline(model, max_length=max_length, mode=mode)
            runs[mode] = pipe.generate(prompt, max_new_tokens).token_list()
            ran[mode] = _what_ran(pipe)
        except Exception as exc:  # noqa: BLE001  (a failing mode is reported, the others still run)
            errors[mode] = f"{type(exc).__name__}: {exc}"
    ref = runs.get("SLOT_BY_SLOT")
    report: dict[str, Any] = {"prompt_ids": prompt.tolist(), "max_new_tokens": max_new_tokens, "modes": {}}
    for mode in dict.fromkeys(["SLOT_BY_SLOT", *modes]):
        entry: dict[str, Any] = {"error": errors.get(mode)}
        if mode in runs:
            entry.update(ran[mode])
            entry["tokens"] = runs[mode]
            entry["match_vs_slot_by_slot"] = _match(runs[mode], ref) if ref is not None else None
            if golden is not None:
                entry["match_vs_golden"] = _match(runs[mode], golden.tolist())
        report["modes"][mode] = entry
    return report


def _what_ran(pipe: Any) -> dict[str, Any]:
    """The backends that ran the pipeline's plans, their modes, and whether the mode asked for was among them.

    A mode that was remapped (a GPU mode on a machine without a GPU) ran as another mode:
    ``remapped`` says so, with the auction's note, so a report never credits a mode that never ran.
    """
    models = [pipe.prefill_model, pipe.decode_model, *pipe._blocks.values()]
    backends: dict[str, str] = {}
    notes: list[str] = []
    for m in models:
        part = m.partition()
        if part is None:
            backends.setdefault("legacy", "LEGACY")
            continue
        for name in part.resolved():
            backends.setdefault(name, part.backends[name].mode.name)
        notes.extend(n for n in part.notes if n not in notes)
    asked = pipe.mode.name
    remapped = asked != "AUTO" and asked not in backends.values()
    return {
        "ran_on": list(backends),
        "ran_modes": list(dict.fromkeys(backends.values())),
        "remapped": remapped,
        "notes": notes,
    }


def _match(a: list[int], b: list[int] | None) -> float | None:
    if b is None:
        return None
    n = max(len(a), len(b))
    return sum(1 for x, y in zip(a, b) if x == y) / n if n else 1.0


def cmd_validate(args: argparse.Namespace) -> int:
    """`dsp validate`: exit 1 when a mode's match rate is below the threshold."""
    golden, golden_prompt = _golden(args.golden)
    if args.prompt_ids:
        prompt = _ids(args.prompt_ids)
    elif golden_prompt is not None:
        prompt = golden_prompt
    else:
        prompt = np.arange(1, 8, dtype=np.int64)
    n = args.max_new_tokens if golden is None else min(args.max_new_tokens, golden.size)
    modes = [m.strip().upper() for m in args.modes.split(",") if m.strip()] or available_modes()
    report = validate(args.model, modes, prompt, n, golden[:n] if golden is not None else None)
    failed = []
    for mode, entry in report["modes"].items():
        rates = [entry.get("match_vs_slot_by_slot"), entry.get("match_vs_golden")]
        if entry["error"] or any(r is not None and r < args.threshold for r in rates) or rates[0] is None:
            failed.append(mode)
    report["threshold"] = args.threshold
    report["passed"] = not failed
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        name = Path(args.model).name
        print(f"{name}: {n} greedy tokens from {len(prompt)} prompt tokens, threshold {args.threshold:.0%}")
        for mode, entry in report["modes"].items():
            if entry["error"]:
                print(f"  {mode:<16} FAIL  {entry['error']}")
                continue
            parts = [f"vs SLOT_BY_SLOT {_pct(entry['match_vs_slot_by_slot'])}"]
            if "match_vs_golden" in entry:
                parts.append(f"vs golden {_pct(entry['match_vs_golden'])}")
            status = "FAIL" if mode in failed else ("REMAPPED" if entry["remapped"] else "ok")
            ran_on = f"ran on {', '.join(entry['ran_on'])}"
            print(f"  {mode:<16} {status:<8}  {', '.join(parts)}; {ran_on}")
            if entry["remapped"]:
                print(f"  {'':<16} {mode} never ran: {'; '.join(entry['notes']) or 'another mode ran instead'}")
        remapped = [m for m, e in report["modes"].items() if e.get("remapped")]
        tail = f" ({', '.join(remapped)} not validated: remapped)" if remapped else ""
        print(("passed" if not failed else f"FAILED: {', '.join(failed)}") + tail)
    return 0 if not failed else 1


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"
