"""docs/config.md is generated from the option table, and stays so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dsp_core import config
from dsp_core.errors import ConfigError

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_committed_doc_matches_the_table() -> None:
    assert DOC.read_text() == config.markdown_table(), (
        "docs/config.md is stale: python -m dsp_core.config --write-docs docs/config.md"
    )


def test_every_option_is_documented() -> None:
    text = config.markdown_table()
    for opt in config.OPTIONS:
        assert f"| `{opt.name}` | `{opt.env}` |" in text


def test_write_docs_writes_the_generated_text(tmp_path: Path) -> None:
    out = tmp_path / "config.md"
    done = subprocess.run(
        [sys.executable, "-m", "dsp_core.config", "--write-docs", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert out.read_text() == config.markdown_table()


def test_table_reports_value_and_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_FLIGHT_EVENTS", "50")
    rows = {r["name"]: r for r in config.table()}
    assert rows["flight_events"]["value"] == 50 and rows["flight_events"]["source"] == "environment"
    assert rows["diagnostics_level"]["allowed"] == "off / summary / detailed / full"


def test_invalid_values_name_the_option_and_what_is_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_DIAGNOSTICS_LEVEL", "loud")
    with pytest.raises(ConfigError, match="DSP_DIAGNOSTICS_LEVEL.*diagnostics_level.*off, summary, detailed, full"):
        config.get("diagnostics_level")
    monkeypatch.setenv("DSP_FLIGHT_EVENTS", "0")
    with pytest.raises(ConfigError, match=r"flight_events: expected a value in \[1"):
        config.get("flight_events")
