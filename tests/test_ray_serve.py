"""Whole-model replicas behind Ray Serve on a local Ray instance with CPU replicas (dsp-core[serve]).

Each replica compiles the model with the CPU reference, so every answer is bit-equal to one
process, through the deployment handle and over HTTP. Skipped, with the reason, where Ray
Serve is not installed (``pip install 'dsp-core[serve]'``; the test extra installs it).
"""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.errors import DSPError
from tests.test_devices import FIXTURES, fixture_feeds

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'dsp-core[serve]'")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'dsp-core[serve]'")

from dsp_core.devices.distributed import RayServe  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[RayServe, dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """The GPT-2 fixture on two Serve replicas, with one step's feeds and the local answer."""
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    path = str(FIXTURES / "gpt2_eager.onnx")
    feeds = fixture_feeds("gpt2_eager")
    want = dsp.compile(path, mode="slot_by_slot").run(feeds)
    app = RayServe(path, replicas=2, mode="slot_by_slot", num_cpus=1, http_port=_free_port())
    try:
        yield app, feeds, want
    finally:
        app.shutdown()
        serve.shutdown()
        ray.shutdown()


def test_the_handle_answers_what_one_process_computes(served: Any) -> None:
    app, feeds, want = served
    got = app.run(feeds)
    assert set(got) == set(want)
    assert all(np.array_equal(got[k], want[k]) for k in want)
    batch = app.map([feeds] * 6)
    assert all(np.array_equal(b[k], want[k]) for b in batch for k in want)


def test_concurrent_calls_reach_both_replicas(served: Any) -> None:
    app, _, _ = served
    assert len(app.replicas_answering(32)) == 2


def _post(url: str, body: Any) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def test_http_json_in_json_out(served: Any) -> None:
    app, feeds, want = served
    answer = _post(app.url, {"inputs": {k: v.tolist() for k, v in feeds.items()}})
    assert "error" not in answer, answer
    for k, ref in want.items():
        got = np.asarray(answer["outputs"][k], dtype=answer["dtypes"][k]).reshape(answer["shapes"][k])
        assert got.dtype == ref.dtype and np.array_equal(got, ref), k


def test_a_bad_request_gets_a_clear_error(served: Any) -> None:
    app, feeds, _ = served
    assert "must be JSON" in _post(app.url, {"feeds": {}})["error"]
    name = next(iter(feeds))
    bad = _post(app.url, {"inputs": {name: [[1.5]]}})
    assert bad.get("error"), bad


def test_zero_replicas_is_refused() -> None:
    with pytest.raises(DSPError, match="at least one replica"):
        RayServe("unused.onnx", replicas=0)
