"""`dsp plan fuse` on the fixtures: groups, templates, kernels vs slots per step (no GPU needed)."""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES, run_cli

from dsp_core.cli import fuse_report
from dsp_core.errors import DSPError

FIXTURE_MODELS = ["cnn", "gpt2_eager", "gpt2_sdpa23", "gpt2_torchscript", "llama_eager", "llama_sdpa23"]
DECODERS = ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"]


def check_report(report: dict) -> None:
    """Every slot that runs per step is in exactly one group; kernels count the groups that launch."""
    assert {"slots", "kernels", "groups"} <= set(report)
    grouped = [s for g in report["groups"] for s in g["slots"]]
    assert len(grouped) == len(set(grouped)) == report["live_slots"] == report["slots"] - report["sealed"]
    assert report["kernels"] == sum(g["kernels"] for g in report["groups"])
    assert all({"template", "slots"} <= set(g) for g in report["groups"])
    assert 0 < report["kernels"] < report["live_slots"]  # the reference policy fuses something on every fixture


@pytest.mark.parametrize("name", FIXTURE_MODELS)
def test_plan_fuse_reports_groups_on_every_fixture(name: str) -> None:
    report = fuse_report(str(FIXTURES / f"{name}.onnx"))
    check_report(report)
    assert report["policy"] == "reference" and not report["decode"]


@pytest.mark.parametrize("name", DECODERS)
def test_plan_fuse_decode_shows_the_fixed_kv_plan(name: str) -> None:
    report = fuse_report(str(FIXTURES / f"{name}.onnx"), decode=True, max_length=32)
    check_report(report)
    ops = {op for g in report["groups"] for op in g["ops"]}
    assert "KVScatter" in ops  # the decode plan writes its fixed KV buffers in place
    scatters = [g for g in report["groups"] if "KVScatter" in g["ops"]]
    assert all(g["ops"] == ["KVScatter"] and g["outputs"] for g in scatters)  # alone, its buffer stored


def test_plan_fuse_cli_text_and_json() -> None:
    path = str(FIXTURES / "llama_eager.onnx")
    done = run_cli("plan", "fuse", path, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    check_report(report)
    assert any(g["template"] == "row_reduction" for g in report["groups"])  # the RMSNorm chain
    text = run_cli("plan", "fuse", path, "--decode", "--max-length", "32")
    assert text.returncode == 0, text.stderr
    first = text.stdout.splitlines()[0]
    assert first.startswith("decode plan of") and "kernels per step" in first
    assert "[row_reduction]" in text.stdout and "not fused with producer slot" in text.stdout


def test_plan_fuse_with_a_backend_that_fuses_nothing_counts_one_kernel_per_slot() -> None:
    report = fuse_report(str(FIXTURES / "gpt2_eager.onnx"), backend="slot_by_slot")
    assert report["policy"] == "none"
    assert report["kernels"] == report["live_slots"] == len(report["groups"])


def test_plan_fuse_names_an_unknown_backend_and_a_non_decoder() -> None:
    with pytest.raises(DSPError, match="no installed backend has that name; installed: .*slot_by_slot"):
        fuse_report(str(FIXTURES / "cnn.onnx"), backend="nope")
    done = run_cli("plan", "fuse", str(FIXTURES / "cnn.onnx"), "--decode")
    assert done.returncode != 0 and "not a KV-cache decoder" in done.stderr
