"""Backend discovery: stevedore loads the ``dsp.backends`` entry points, pluggy calls them.

One plugin that fails to import, to register or in its hook is recorded with its reason
and skipped; it never stops the others from loading.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from typing import Any

import pluggy
from stevedore import ExtensionManager

from dsp_core.backends import hookspecs
from dsp_core.backends.base import Backend, LoadFailure, Registry

NAMESPACE = "dsp.backends"
log = logging.getLogger("dsp.backends")

_lock = threading.Lock()
_registry: Registry | None = None


def _dist_of(entry_point: Any, known: dict[tuple[str, str], Any]) -> tuple[str, str]:
    """(distribution name, version) that declares ``entry_point``.

    stevedore's entry-point cache drops the distribution, so it is looked up in ``known``
    (importlib.metadata's entry points of the group, read once per discovery).
    """
    dist = getattr(entry_point, "dist", None) or known.get((entry_point.name, entry_point.value))
    if dist is None:
        return ("unknown", "unknown")
    return (dist.metadata["Name"] or dist.name, dist.version)


def discover(refresh: bool = False) -> Registry:
    """Load every installed backend plugin (once per process unless ``refresh``)."""
    global _registry
    with _lock:
        if _registry is None or refresh:
            _registry = _load()
        return _registry


def _load() -> Registry:
    registry = Registry()
    known = {(ep.name, ep.value): ep.dist for ep in importlib.metadata.entry_points(group=NAMESPACE)}

    def on_failure(manager: Any, entry_point: Any, exc: BaseException) -> None:
        dist, _ = _dist_of(entry_point, known)
        registry.failures.append(LoadFailure(entry_point.name, dist, f"{type(exc).__name__}: {exc}", "import"))
        log.info("dsp.backends: plugin %s failed to load: %s", entry_point.name, exc)

    manager = ExtensionManager(
        namespace=NAMESPACE,
        invoke_on_load=False,
        on_load_failure_callback=on_failure,
    )
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for ext in sorted(manager.extensions, key=lambda e: e.name):
        dist, version = _dist_of(ext.entry_point, known)
        try:
            pm.register(ext.plugin, name=ext.name)
            pm.check_pending()
        except Exception as exc:  # noqa: BLE001  (isolation: record and skip this plugin)
            _drop(pm, ext.name)
            registry.failures.append(LoadFailure(ext.name, dist, f"{type(exc).__name__}: {exc}", "register"))
            continue
        others = [p for p in pm.get_plugins() if p is not ext.plugin]
        caller = pm.subset_hook_caller("dsp_register_backends", remove_plugins=others)
        try:
            provided = [b for batch in caller() for b in batch]
            for backend in provided:
                if not isinstance(backend, Backend):
                    raise TypeError(f"{backend!r} is not a dsp_core Backend")
        except Exception as exc:  # noqa: BLE001
            registry.failures.append(LoadFailure(ext.name, dist, f"{type(exc).__name__}: {exc}", "hook"))
            log.warning("DSP backend plugin %r (%s) failed to register: %s", ext.name, dist, exc)
            continue
        for backend in provided:
            backend.distribution, backend.version = dist, version
            registry.backends.append(backend)
    return registry


def _drop(pm: pluggy.PluginManager, name: str) -> None:
    plugin = pm.get_plugin(name)
    if plugin is not None:
        pm.unregister(plugin)
