"""Backend discovery: stevedore loads the ``dsp.backends`` entry points, pluggy calls them.

One plugin that fails to import, to register or in its hook is recorded with its reason
and skipped; it never stops the others from loading. "Fails" includes SystemExit and
an import that does not return within DSP_PLUGIN_TIMEOUT (see ``guard``). Each Backend a
plugin provides is checked against the contract's static shape (a ModeContract, a
GraphExecutionMode, a platform, a unique name, ``_supports`` answering Decline or None);
a malformed one is rejected with its reason, recorded like a load failure (stage "backend").
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from typing import Any

import pluggy
from stevedore import ExtensionManager

from dsp_core.backends import hookspecs
from dsp_core.backends.base import (
    Backend,
    CaptureProfile,
    Decline,
    LoadFailure,
    ModeContract,
    Registry,
    SlotView,
)
from dsp_core.backends.guard import call_with_timeout, describe
from dsp_core.backends.modes import GraphExecutionMode

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


class _GuardedManager(ExtensionManager):  # type: ignore[type-arg]
    """stevedore's manager, each entry point imported on a worker thread under DSP_PLUGIN_TIMEOUT.

    stevedore catches ``Exception`` only (and re-raises AssertionError): a SystemExit at
    import would end the process. The guard turns it (and a hang) into a BackendFault,
    which reaches the load-failure callback like any import error.
    """

    def _load_one_plugin(self, ep: Any, *args: Any, **kwargs: Any) -> Any:
        load = super()._load_one_plugin
        return call_with_timeout(lambda: load(ep, *args, **kwargs), f"import of plugin {ep.name} ({ep.value})")


def disabled_plugins() -> frozenset[str]:
    """DSP_DISABLE_PLUGINS: entry-point names discovery skips (cpu_ref, the reference, never)."""
    from dsp_core import config

    raw = str(config.get("disable_plugins") or "")
    return frozenset(n.strip() for n in raw.split(",") if n.strip()) - {"cpu_ref"}


def _load() -> Registry:
    registry = Registry()
    known = {(ep.name, ep.value): ep.dist for ep in importlib.metadata.entry_points(group=NAMESPACE)}

    def on_failure(manager: Any, entry_point: Any, exc: BaseException) -> None:
        dist, _ = _dist_of(entry_point, known)
        registry.failures.append(LoadFailure(entry_point.name, dist, describe(exc), "import"))
        log.info("dsp.backends: plugin %s failed to load: %s", entry_point.name, exc)

    manager = _GuardedManager(
        namespace=NAMESPACE,
        invoke_on_load=False,
        on_load_failure_callback=on_failure,
    )
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    disabled = disabled_plugins()
    for ext in sorted(manager.extensions, key=lambda e: e.name):
        if ext.name in disabled:
            continue  # DSP_DISABLE_PLUGINS: as if it were not installed
        dist, version = _dist_of(ext.entry_point, known)
        try:
            pm.register(ext.plugin, name=ext.name)
            pm.check_pending()
        except Exception as exc:  # noqa: BLE001  (isolation: record and skip this plugin)
            _drop(pm, ext.name)
            registry.failures.append(LoadFailure(ext.name, dist, describe(exc), "register"))
            continue
        others = [p for p in pm.get_plugins() if p is not ext.plugin]
        caller = pm.subset_hook_caller("dsp_register_backends", remove_plugins=others)
        try:
            provided = [
                b for batch in call_with_timeout(caller, f"plugin {ext.name}'s dsp_register_backends") for b in batch
            ]
            for backend in provided:
                if not isinstance(backend, Backend):
                    raise TypeError(f"{backend!r} is not a dsp_core Backend")
        except Exception as exc:  # noqa: BLE001  (BackendFault carries SystemExit and hangs)
            registry.failures.append(LoadFailure(ext.name, dist, describe(exc), "hook"))
            log.warning("DSP backend plugin %r (%s) failed to register: %s", ext.name, dist, exc)
            continue
        for backend in provided:
            problem = malformed(backend, registry)
            label = f"{ext.name}:{getattr(backend, 'name', type(backend).__name__)}"
            if problem is not None:
                registry.failures.append(
                    LoadFailure(label, dist, f"{type(backend).__name__} rejected: {problem}", "backend")
                )
                log.warning("DSP backend %s (%s) rejected: %s", label, dist, problem)
                continue
            backend.distribution, backend.version = dist, version
            registry.backends.append(backend)
    return registry


def _probe_slot() -> SlotView:
    """A plain float32 Relu: what discovery asks a backend's ``_supports`` about."""
    from dsp_core.ops.registry import lookup

    return SlotView(0, "Relu", "", lookup("Relu", "").traits, {}, ("float32",), ("float32",))


def malformed(backend: Backend, registry: Registry) -> str | None:
    """Why ``backend`` breaks the contract's static shape, or None when it is well formed."""
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or not name:
        return f"its name is {name!r}, not a non-empty string"
    if not isinstance(getattr(backend, "contract", None), ModeContract):
        return f"backend {name} declares no ModeContract (contract = {getattr(backend, 'contract', None)!r})"
    mode = getattr(backend, "mode", None)
    if not isinstance(mode, GraphExecutionMode):
        return f"backend {name}'s mode is {mode!r} ({type(mode).__name__}), not a GraphExecutionMode"
    if not isinstance(getattr(backend, "platform", None), str):
        return f"backend {name}'s platform is {getattr(backend, 'platform', None)!r}, not a string"
    if not isinstance(getattr(backend, "profile", None), CaptureProfile):
        return f"backend {name}'s profile is not a CaptureProfile"
    same = next((b for b in registry.backends if b.name == name), None)
    if same is not None:
        return f"a backend named {name!r} is already registered by {same.distribution}; names must be unique"
    try:  # a raising predicate is the auction's business (recorded there, per slot); a wrong type is malformed
        answer = backend._supports(_probe_slot())
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001
        return None
    if answer is not None and not isinstance(answer, Decline):
        return f"backend {name}._supports returned {type(answer).__name__} {answer!r}; it must return a Decline or None"
    return None


def _drop(pm: pluggy.PluginManager, name: str) -> None:
    plugin = pm.get_plugin(name)
    if plugin is not None:
        pm.unregister(plugin)
