"""Progress of long steps on stderr (load, import, shape inference, compile, weights), and their times.

    with progress.step("load model.onnx", total=nbytes, unit="B") as bar:
        for chunk in chunks:
            bar.advance(len(chunk))

``DSP_PROGRESS`` decides what is shown: ``auto`` (the default) draws a bar only when
stderr is a terminal and only once a step has run for a second, so short steps, pipes,
logs and tests stay silent; ``on`` reports every step, on any stderr (one line per
step when stderr is not a terminal); ``off`` never prints. Whatever is shown, every
step's wall time is recorded (:func:`timings`), so ``dsp run`` can say where its time
went. Dependency-free: a bar is one line redrawn with ``\\r`` by a ticker thread that
exists only while a step is being shown.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from dsp_core import config

DELAY_S = 1.0  # auto: a step is shown once it has run this long
_REFRESH_S = 0.1  # a terminal bar is redrawn this often
_PLAIN_EVERY_S = 10.0  # not a terminal (DSP_PROGRESS=on): a line this often for a step still running
_WIDTH = 24  # characters of the bar itself
_SPIN = "|/-\\"


@dataclass
class Step:
    """One running step: what it is, how far it has got, since when."""

    label: str
    total: int | None = None
    unit: str = ""
    done: int = 0
    started: float = field(default_factory=time.perf_counter)

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more units done."""
        self.done += n

    def elapsed(self) -> float:
        """Seconds since the step started."""
        return time.perf_counter() - self.started

    def render(self, final: bool = False, tick: int = 0) -> str:
        """The step's line: label, bar (or spinner), amount, elapsed time."""
        parts = [f"dsp: {self.label}"]
        if self.total:
            frac = 1.0 if final else min(1.0, self.done / self.total)
            filled = int(frac * _WIDTH)
            parts.append(f"[{'#' * filled}{'.' * (_WIDTH - filled)}] {frac * 100:3.0f}%")
            parts.append(f"{_amount(self.done, self.unit)}/{_amount(self.total, self.unit)}")
        else:
            if not final:
                parts.append(_SPIN[tick % len(_SPIN)])
            if self.done:
                parts.append(_amount(self.done, self.unit))
        parts.append(f"{self.elapsed():.1f} s")
        return "  ".join(parts)


def _amount(n: int, unit: str) -> str:
    if unit != "B":
        return f"{n:,}{' ' + unit if unit else ''}"
    size = float(n)
    for suffix in ("B", "KB", "MB", "GB"):
        if size < 1000 or suffix == "GB":
            return f"{size:.0f} {suffix}" if suffix == "B" else f"{size:.1f} {suffix}"
        size /= 1000
    return f"{n} B"  # unreachable


# -- recorded times -----------------------------------------------------------------------
_timings: deque[tuple[str, float]] = deque(maxlen=256)
_local = threading.local()  # .depth: steps inside steps are shown, but only the outermost are recorded


def timings() -> list[tuple[str, float]]:
    """(label, seconds) of every outermost step finished in this process, in order."""
    return list(_timings)


def reset_timings() -> None:
    """Forget the recorded steps (``dsp run`` reads the ones of its own compile)."""
    _timings.clear()


# -- showing --------------------------------------------------------------------------------
def _setting() -> str:
    return str(config.get("progress"))


class _Ticker:
    """Draws the innermost shown step on stderr until it ends; one thread per shown step."""

    def __init__(self, s: Step, delay: float, tty: bool) -> None:
        self.step, self.delay, self.tty = s, delay, tty
        self.drawn = False
        self.last_plain = 0.0
        self.paused = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dsp-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(_REFRESH_S):
            tick += 1
            if self.paused or self.step.elapsed() < self.delay:
                continue
            if self.tty:
                _write("\r" + self.step.render(tick=tick) + "\033[K")
                self.drawn = True
            elif self.step.elapsed() - self.last_plain >= _PLAIN_EVERY_S:
                self.last_plain = self.step.elapsed()
                _write(self.step.render(tick=tick) + "\n")

    def pause(self) -> None:
        """Clear the line: an inner step takes it over."""
        self.paused = True
        with _lock:
            if self.drawn:
                sys.stderr.write("\r\033[K")
                sys.stderr.flush()
                self.drawn = False

    def finish(self, show_final: bool) -> None:
        """Stop the thread; leave the final line when the step was shown (or must be)."""
        self._stop.set()
        self._thread.join()
        if self.drawn or show_final:
            _write(("\r" if self.tty else "") + self.step.render(final=True) + ("\033[K\n" if self.tty else "\n"))


_lock = threading.Lock()
_shown: list[_Ticker] = []  # the stack of shown steps; only the top one draws


def _write(text: str) -> None:
    with _lock:
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except (OSError, ValueError):  # stderr closed or gone: progress is never worth an error
            pass


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def step(label: str, total: int | None = None, unit: str = "") -> Iterator[Step]:
    """A step of ``total`` units (None: unknown), shown on stderr as DSP_PROGRESS says; its time recorded."""
    s = Step(label, total, unit)
    setting = _setting()
    tty = _stderr_is_tty()
    ticker: _Ticker | None = None
    if setting == "on" or (setting == "auto" and tty):
        if _shown:
            _shown[-1].pause()
        ticker = _Ticker(s, 0.0 if setting == "on" else DELAY_S, tty)
        _shown.append(ticker)
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield s
    finally:
        _local.depth = depth
        if depth == 0:
            _timings.append((label, s.elapsed()))
        if ticker is not None:
            _shown.remove(ticker)
            ticker.finish(show_final=setting == "on" or s.elapsed() >= DELAY_S)
            if _shown:
                _shown[-1].paused = False
