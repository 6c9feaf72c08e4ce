"""The conformance kit's pytest plugin (entry point ``pytest11: dsp_conformance``).

Adds ``--dsp-backend NAME`` (the installed backend under test) and ``--dsp-seed N``
(replay a failing run's random inputs), and the fixtures the kit's tests use. Without
``--dsp-backend`` every kit test is skipped with the reason, so the plugin never
disturbs an ordinary test run; with a name that is not an installed, available backend
the run stops at once with a usage error listing the installed ones. When other
installed backends claim the same mode, the run warns (a PytestWarning and a header line).

    pytest --pyargs dsp_core.testing.conformance --dsp-backend my_backend
"""

from __future__ import annotations

import secrets
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

if TYPE_CHECKING:
    from dsp_core.backends.base import Backend, Registry

_BACKEND = pytest.StashKey["Backend | None"]()
_SEED = pytest.StashKey[int]()
_SHARED = pytest.StashKey[str]()  # the warning that other backends claim the same mode
SKIP_REASON = "DSP conformance kit: no backend chosen; run with --dsp-backend NAME (see `dsp backends list`)"


def pytest_addoption(parser: pytest.Parser) -> None:
    """The kit's command-line options."""
    group = parser.getgroup("dsp-conformance", "DSP backend conformance kit")
    group.addoption(
        "--dsp-backend",
        action="store",
        default=None,
        metavar="NAME",
        help="run the DSP conformance kit against the installed backend NAME (its Backend.name)",
    )
    group.addoption(
        "--dsp-seed",
        action="store",
        type=int,
        default=None,
        metavar="N",
        help="seed the kit's random inputs (default: a fresh seed per run, printed with every failure)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Resolve --dsp-backend once; a name that is not installed and available is a usage error."""
    seed = config.getoption("--dsp-seed")
    config.stash[_SEED] = int(seed) if seed is not None else secrets.randbits(32)
    name = config.getoption("--dsp-backend")
    if name is None:
        config.stash[_BACKEND] = None
        return
    from dsp_core.backends.discovery import discover

    registry = discover()
    backend = resolve_backend(name, registry)
    config.stash[_BACKEND] = backend
    note = shared_mode_note(backend, registry)
    if note is not None:
        config.stash[_SHARED] = note
        config.issue_config_time_warning(pytest.PytestWarning(note), stacklevel=2)


def shared_mode_note(backend: Backend, registry: Registry) -> str | None:
    """A warning when other installed backends claim ``backend``'s mode, else None.

    ``dsp.compile(mode=...)`` (the kit's way in) and AUTO give each slot to the first
    available backend of the mode that takes it, in discovery order, so with two claimants
    the kit may be exercising the other one, and users get whichever is found first.
    """
    others = [b for b in registry.for_mode(backend.mode) if b is not backend]
    if not others:
        return None
    order = " -> ".join(
        f"{b.name} ({b.distribution}{'' if b.availability().ok else ', unavailable here'})"
        for b in registry.for_mode(backend.mode)
    )
    return (
        f"DSP conformance: {len(others) + 1} installed backends claim mode {backend.mode.name}: {order}. "
        f"Slots go to the first available one that takes them, so this run may test another backend than "
        f"{backend.name}, and users get whichever is found first; uninstall the others or give {backend.name} "
        "a mode of its own"
    )


def resolve_backend(name: str, registry: Registry | None = None) -> Backend:
    """The installed, available backend called ``name``; pytest.UsageError naming the choices otherwise."""
    from dsp_core.backends.discovery import discover

    registry = registry if registry is not None else discover()
    matches = [b for b in registry.backends if b.name == name]
    if not matches:
        raise pytest.UsageError(
            f"--dsp-backend {name!r}: no installed DSP backend has that name; installed: {_installed(registry)}"
        )
    backend = matches[0]
    avail = backend.availability()
    if not avail.ok:
        raise pytest.UsageError(
            f"--dsp-backend {name!r} is installed ({backend.distribution} {backend.version}) but unavailable "
            f"here: {avail.reason}; installed: {_installed(registry)}"
        )
    return backend


def _installed(registry: Registry) -> str:
    rows = [
        f"{b.name} ({b.mode.name}, {b.distribution}, {'available' if b.availability().ok else b.availability().reason})"
        for b in registry.backends
    ]
    failed = [f"{f.entry_point} failed to load: {f.error}" for f in registry.failures]
    return "; ".join(rows + failed) or "none"


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    """Say which backend and seed the kit runs with."""
    backend = config.stash.get(_BACKEND, None)
    if backend is None:
        return None
    c = backend.contract
    return [
        f"dsp conformance: backend {backend.name} (mode {backend.mode.name}, platform {backend.platform}, "
        f"{backend.distribution} {backend.version}, captures={backend.captures})",
        f"dsp conformance: contract deterministic={c.deterministic} can_update_in_place={c.can_update_in_place} "
        f"tolerance={c.tolerance} computes_values={c.computes_values} dtypes={','.join(sorted(c.dtypes))}",
        f"dsp conformance: seed {config.stash[_SEED]} (replay with --dsp-seed {config.stash[_SEED]})",
        *([f"dsp conformance: WARNING {config.stash[_SHARED]}"] if _SHARED in config.stash else []),
    ]


@pytest.fixture(scope="session")
def dsp_backend(pytestconfig: pytest.Config) -> Backend:
    """The backend under test (skips the test when --dsp-backend was not given)."""
    backend = pytestconfig.stash.get(_BACKEND, None)
    if backend is None:
        pytest.skip(SKIP_REASON)
    return backend


@pytest.fixture
def dsp_rng(request: pytest.FixtureRequest) -> Iterator[np.random.Generator]:
    """A generator of fresh random inputs, seeded from the run's seed and the test's name."""
    seed = request.config.stash[_SEED]
    test = f"{request.node.module.__name__}::{request.node.name}"  # the same wherever pytest runs from
    yield np.random.default_rng([seed, _stable_hash(test)])


def _stable_hash(text: str) -> int:
    """A hash of ``text`` that is the same in every process (str hashes are salted)."""
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[Any]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Add the seed to a failing kit test's report, so its inputs can be drawn again."""
    report = yield
    if report.failed and "dsp_rng" in getattr(item, "fixturenames", ()):
        seed = item.config.stash[_SEED]
        report.sections.append(("dsp conformance", f"random inputs drawn with --dsp-seed {seed}"))
    return report
