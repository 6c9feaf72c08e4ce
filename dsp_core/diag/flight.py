"""The flight recorder: when a step raises, the last events and the terminal records go to a file.

The file is ``<DSP_CACHE_DIR or ~/.cache/dsp>/flight/flight-<timestamp>-<pid>.json``; the
exception keeps its type and traceback and gains a note naming the file (a DSPError's
message names it too). Lifecycle moves and errors are always kept in a small ring, so the
file explains a failure even with diagnostics off; with them on, every recorded event
of the last ``DSP_FLIGHT_EVENTS`` is there as well.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

from dsp_core import config, diag
from dsp_core.errors import DSPError

KEEP_FILES = 32  # older flight files are removed


def flight_dir() -> Path:
    """Where flight files go: DSP_CACHE_DIR (or the default cache directory) / flight."""
    from dsp_core.cache.disk import default_cache_dir

    root = str(config.get("cache_dir"))
    return (Path(root).expanduser() if root else default_cache_dir(os.environ)) / "flight"


def record_failure(exc: BaseException, plan: int = -1) -> Path | None:
    """Write the flight file for ``exc`` and name it in the exception; None if off or already done."""
    if getattr(exc, "_dsp_flight", None) is not None or not config.get("flight_recorder"):
        return None
    diag.error(exc, plan)
    try:
        path = write(exc)
    except OSError as err:
        exc.add_note(f"DSP flight recorder: could not write its file: {err}")
        exc._dsp_flight = ""  # type: ignore[attr-defined]
        return None
    _name_in(exc, path)
    return path


def write(exc: BaseException) -> Path:
    """The flight file for ``exc``: the snapshot's last events, terminal records and the error."""
    state = diag.snapshot("flight", diag.flight_size())
    state["error"] = {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": traceback.format_exception(exc),
    }
    folder = flight_dir()
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{time.time_ns() % 1_000_000_000:09d}"
    path = folder / f"flight-{stamp}-{os.getpid()}.json"
    path.write_text(json.dumps(state, indent=1))
    _prune(folder)
    return path


def _name_in(exc: BaseException, path: Path) -> None:
    """A note on every exception; a DSPError's message names the file too (one-line CLI errors)."""
    exc._dsp_flight = str(path)  # type: ignore[attr-defined]
    exc.add_note(f"DSP flight recorder: {path} (render it with: dsp diag show {path})")
    if isinstance(exc, DSPError) and exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]} [flight recorder: {path}]", *exc.args[1:])


def _prune(folder: Path) -> None:
    files = sorted(folder.glob("flight-*.json"), key=_mtime)
    for old in files[:-KEEP_FILES]:
        try:
            old.unlink()
        except OSError:
            pass


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile by another process
        return 0.0
