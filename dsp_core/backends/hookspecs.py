"""Every hook a DSP plugin can implement. This file is the whole plugin contract.

A plugin is a module (or object) named by an entry point in the group ``dsp.backends``.
It implements hooks with ``@dsp_core.hookimpl``. Discovery (stevedore) loads it, a pluggy
PluginManager registers and checks it, then the core calls the hooks below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from dsp_core.backends.base import Backend

PROJECT = "dsp"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def dsp_register_backends() -> list[Backend]:
    """Return the Backend objects this plugin provides (one per execution mode it serves).

    When: once per process, at discovery, for each plugin separately.
    Results: the core calls each plugin's implementation on its own, so a plugin that
    raises is recorded as a load failure and skipped without affecting the others; the
    lists of all plugins are concatenated in discovery order. Must be cheap: no device
    work here (availability is probed later, by ``Backend.availability``).
    """
    raise NotImplementedError
