# ruff: noqa: B007, B023, E402, E731, F821  (a one-off measurement kept as it ran on the H200; closures are called inside their loop iteration)
"""Host cost of CuPy's small copies: legacy null stream against a non-blocking stream, in several process states."""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import cupy as cp

sync = cp.cuda.Device().synchronize


def host(fn, n=300):
    t = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    sync()
    return round(statistics.median(t) * 1e6, 2)


out = {}
nb = cp.cuda.Stream(non_blocking=True)
y = cp.zeros(384, cp.float16)
z = cp.zeros(384, cp.float16)
big = cp.zeros((512, 768), cp.float16)
big2 = cp.zeros_like(big)


def measure(tag):
    r = {}
    r["copy_null"] = host(lambda: y.copy())
    r["empty_null"] = host(lambda: cp.empty(384, cp.float16))
    r["memcpy_null"] = host(lambda: z.data.copy_from_device_async(y.data, y.nbytes))
    r["memcpy_big_null"] = host(lambda: big2.data.copy_from_device_async(big.data, big.nbytes))
    r["copy_big_null"] = host(lambda: big.copy())

    def on_nb(f):
        def g():
            with nb:
                f()

        return g

    r["copy_nb"] = host(on_nb(lambda: y.copy()))
    r["memcpy_nb"] = host(lambda: z.data.copy_from_device_async(y.data, y.nbytes, nb))
    r["memcpy_big_nb"] = host(lambda: big2.data.copy_from_device_async(big.data, big.nbytes, nb))
    r["copy_big_nb"] = host(on_nb(lambda: big.copy()))
    r["empty_plus_memcpy_nb"] = host(
        on_nb(lambda: cp.empty(384, cp.float16).data.copy_from_device_async(y.data, y.nbytes, nb))
    )
    ev = cp.cuda.Event(disable_timing=True)
    r["event_record_null"] = host(lambda: ev.record(cp.cuda.Stream.null))
    r["stream_wait_null"] = host(lambda: cp.cuda.Stream.null.wait_event(ev))
    out[tag] = r
    print(tag, json.dumps(r), flush=True)


measure("fresh_cupy")
blocking = [cp.cuda.Stream() for _ in range(8)]
for s in blocking:
    with s:
        y.copy()
sync()
measure("after_8_blocking_streams")
import torch

torch.zeros(1, device="cuda")
torch.cuda.Stream()
torch.cuda.synchronize()
measure("after_torch_init")
sys.path.insert(0, "benchmarks")
import models_gpu as mg

import dsp_core as dsp

module, make_feeds = mg.build("minilm")
module = module.eval().cuda().half()
feeds = make_feeds(1, "cuda")
path = Path(tempfile.mkdtemp()) / "m.onnx"
mg.export(module, feeds, path)
del module
model = dsp.compile(str(path), mode="auto", outputs_on_device=True)
dev = {k: cp.asarray(v.detach().cpu().numpy()) for k, v in feeds.items()}
for _ in range(10):
    model.run(dev)
sync()
out["dsp_run"] = host(lambda: model.run(dev))
measure("after_dsp_model")
json.dump(out, open("/tmp/res/copycost.json", "w"), indent=1)
