"""Isolation of plugin code: every call into a backend goes through here or through a guard like it.

A backend is third-party code. Whatever it does inside a hook or a lifecycle call (raise
any exception, SystemExit included, hang in an import or a probe, return something off
its contract) is that backend declining or failing, recorded with its reason; it never
takes the caller down. KeyboardInterrupt alone passes through: it is the user's.

Imports of plugin entry points and availability probes run on a worker thread joined with
a timeout (``DSP_PLUGIN_TIMEOUT``): one that does not answer is recorded as "did not answer
within N s" and the command goes on (the stuck thread is a daemon and stays blocked).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from dsp_core import config
from dsp_core.errors import BackendError

T = TypeVar("T")


class BackendFault(BackendError):
    """A backend's hook or lifecycle call raised, hung, or returned something its contract forbids."""


def describe(exc: BaseException) -> str:
    """'ValueError: message', the form every recorded reason takes."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def plugin_timeout() -> float:
    """Seconds an import or availability probe may take (0 = no limit)."""
    return float(config.get("plugin_timeout"))


def call_with_timeout(fn: Callable[[], T], what: str, timeout: float | None = None) -> T:
    """``fn()`` on a daemon thread; BackendFault if it does not return within the timeout.

    An exception that is not an ``Exception`` (SystemExit, GeneratorExit, ...) or an
    AssertionError (which stevedore re-raises) comes back as a BackendFault naming it, so
    callers that catch ``Exception`` record it like any other failure.
    """
    limit = plugin_timeout() if timeout is None else timeout
    if limit <= 0:
        return _shielded(fn, what)
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001  (carried back to the caller's thread)
            outcome["error"] = exc

    worker = threading.Thread(target=target, name=f"dsp-plugin: {what}", daemon=True)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        raise BackendFault(
            f"{what} did not answer within {limit:g} s (DSP_PLUGIN_TIMEOUT); skipped. "
            "Fix or uninstall the plugin, or raise DSP_PLUGIN_TIMEOUT if it is only slow"
        )
    if "error" in outcome:
        _reraise(outcome["error"], what)
    return outcome["value"]  # type: ignore[no-any-return]


def _shielded(fn: Callable[[], T], what: str) -> T:
    try:
        return fn()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001
        _reraise(exc, what)
        raise  # unreachable: _reraise always raises


def _reraise(exc: BaseException, what: str) -> None:
    if isinstance(exc, Exception) and not isinstance(exc, AssertionError):
        raise exc
    raise BackendFault(f"{what} raised {describe(exc)}") from exc
