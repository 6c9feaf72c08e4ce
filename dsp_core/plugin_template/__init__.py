"""`dsp plugin new NAME`: write a working, installable backend distribution to start from.

The template (``files/``, shipped as package data) is a capturing CPU backend: numpy
kernels for elementwise ops and MatMul, a compiled segment with the whole capture
lifecycle (warm, prepare, capture, replay, refresh, release), its own tests, and the
conformance kit wired into its ``pytest``. docs/writing-a-backend.md walks through it.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dsp_core.backends.modes import FALLBACK_CHAINS, GraphExecutionMode
from dsp_core.errors import DSPError

# Modes the template may claim: the CPU chain that AUTO walks, less the reference itself.
TEMPLATE_MODES: tuple[GraphExecutionMode, ...] = tuple(
    m for m in FALLBACK_CHAINS["cpu"] if m is not GraphExecutionMode.SLOT_BY_SLOT
)
DEFAULT_MODE = GraphExecutionMode.MLIR_CPU_JIT
_NAME = re.compile(r"[a-z][a-z0-9_]*")
# template path (under files/) -> path in the new project; {module} is the package name.
_LAYOUT: dict[str, str] = {
    "pyproject.toml.tmpl": "pyproject.toml",
    "README.md.tmpl": "README.md",
    "module/__init__.py.tmpl": "{module}/__init__.py",
    "module/kernels.py.tmpl": "{module}/kernels.py",
    "module/plugin.py.tmpl": "{module}/plugin.py",
    "module/segment.py.tmpl": "{module}/segment.py",
    "tests/test_backend.py.tmpl": "tests/test_{name}.py",
    "tests/test_conformance.py.tmpl": "tests/test_conformance.py",
}


class PluginTemplateError(DSPError):
    """`dsp plugin new` cannot write the project: a bad name, mode or target directory."""


@dataclass(frozen=True)
class PluginNames:
    """The names one backend name gives: distribution, package, class, mode."""

    name: str  # Backend.name and the entry point's name: "my_backend"
    dist: str  # the distribution: "dsp-my-backend"
    module: str  # the package: "dsp_my_backend"
    cls: str  # the class prefix: "MyBackend"
    mode: GraphExecutionMode

    @classmethod
    def of(cls, name: str, mode: str | GraphExecutionMode = DEFAULT_MODE) -> PluginNames:
        """Check ``name`` and ``mode`` and derive the other names."""
        if not _NAME.fullmatch(name) or keyword.iskeyword(name):
            raise PluginTemplateError(
                f"plugin name {name!r} is not a lower-case Python identifier (letters, digits, _; "
                "starting with a letter); it becomes Backend.name and part of the package name"
            )
        chosen = GraphExecutionMode.parse(mode)
        if chosen not in TEMPLATE_MODES:
            allowed = ", ".join(m.value for m in TEMPLATE_MODES)
            raise PluginTemplateError(
                f"mode {chosen.name} is not one the template can serve: it is a CPU backend (numpy); "
                f"choose one of {allowed}, or start from it and change platform and kernels for a device "
                "(docs/writing-a-backend.md)"
            )
        camel = "".join(part.capitalize() for part in name.split("_") if part)
        return cls(name, f"dsp-{name.replace('_', '-')}", f"dsp_{name}", camel, chosen)


def render(names: PluginNames) -> dict[str, str]:
    """The new project's files: relative path -> text."""
    from dsp_core import __version__

    major, minor = (int(p) for p in __version__.split(".")[:2])
    tokens = {
        "{{name}}": names.name,
        "{{dist}}": names.dist,
        "{{module}}": names.module,
        "{{Class}}": names.cls,
        "{{MODE}}": names.mode.name,
        "{{mode}}": names.mode.value,
        "{{core_version}}": __version__,
        "{{core_next}}": f"{major}.{minor + 1}" if major == 0 else f"{major + 1}",
    }
    root = resources.files(__name__).joinpath("files")
    out: dict[str, str] = {}
    for template, target in _LAYOUT.items():
        text = root.joinpath(template).read_text(encoding="utf-8")
        for token, value in tokens.items():
            text = text.replace(token, value)
        out[target.format(module=names.module, name=names.name)] = text
    return out


def write(names: PluginNames, dest: Path) -> list[Path]:
    """Write the project into ``dest`` (which must not exist or be empty); the paths written."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise PluginTemplateError(f"{dest} already exists and is not an empty directory; choose another --dir")
    written = []
    for rel, text in render(names).items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


__all__ = ["DEFAULT_MODE", "TEMPLATE_MODES", "PluginNames", "PluginTemplateError", "render", "write"]
