# ruff: noqa: B007, B023, E402, E731, F821  (a one-off measurement kept as it ran on the H200; closures are called inside their loop iteration)
"""Does a graph launch cost the host more when its stream has pending work or a pending cross-stream wait?"""

import json
import statistics
import time

import cupy as cp

RES = "/tmp/res"
sync = cp.cuda.Device().synchronize
spin = cp.RawKernel(
    r"""extern "C" __global__ void spin(long long n){ long long t=clock64(); while(clock64()-t<n); }""", "spin"
)
inc = cp.RawKernel(r"""extern "C" __global__ void inc(float* x){ x[threadIdx.x] += 1.0f; }""", "inc")
x = cp.zeros(256, cp.float32)
out = {}


def chain(stream, n):
    with stream:
        stream.begin_capture()
        for _ in range(n):
            inc((1,), (256,), (x,))
        g = stream.end_capture()
    g.launch(stream)
    sync()
    return g


def host(pre, fn, n=100):
    t = []
    for _ in range(n):
        sync()
        pre()
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    sync()
    return round(statistics.median(t) * 1e6, 2)


CYC = 400000  # ~200 us
s = cp.cuda.Stream(non_blocking=True)
s2 = cp.cuda.Stream(non_blocking=True)
sb = cp.cuda.Stream(non_blocking=False)
null = cp.cuda.Stream.null
ev = cp.cuda.Event(disable_timing=True)
nothing = lambda: None


def spin_on(st):
    with st:
        spin((1,), (1,), (cp.int64(CYC),))


for n in (62, 124, 248):
    g = chain(s, n)
    gb = chain(sb, n)
    r = {}
    r["idle"] = host(nothing, lambda: g.launch(s))
    r["same_stream_busy"] = host(lambda: spin_on(s), lambda: g.launch(s))

    def pre_cross():
        spin_on(s2)
        ev.record(s2)
        s.wait_event(ev)

    r["cross_stream_wait_pending"] = host(pre_cross, lambda: g.launch(s))

    def pre_null():
        spin_on(null)
        ev.record(null)
        s.wait_event(ev)

    r["null_stream_wait_pending"] = host(pre_null, lambda: g.launch(s))

    def pre_done():
        ev.record(null)
        s.wait_event(ev)

    r["wait_completed_event"] = host(pre_done, lambda: g.launch(s))

    def launch_with_wait():
        ev.record(null)
        s.wait_event(ev)
        g.launch(s)

    r["record_wait_launch_busy_null"] = host(lambda: spin_on(null), launch_with_wait)
    r["blocking_stream_null_busy"] = host(lambda: spin_on(null), lambda: gb.launch(sb))
    r["blocking_stream_idle"] = host(nothing, lambda: gb.launch(sb))
    # a second launch right after the first (the queue holds the first)
    r["back_to_back_second"] = host(lambda: g.launch(s), lambda: g.launch(s))
    out[f"chain{n}"] = r
    print(n, json.dumps(r), flush=True)

import torch

tx = torch.zeros(256, device="cuda")
ts = torch.cuda.Stream()
with torch.cuda.stream(ts):
    tx.add_(1)
torch.cuda.synchronize()
tg = torch.cuda.CUDAGraph()
with torch.cuda.graph(tg):
    for _ in range(124):
        tx.add_(1)
tg.replay()
torch.cuda.synchronize()
cur = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
r = {"idle": host(nothing, tg.replay), "current_stream_busy": host(lambda: spin_on(cur), tg.replay)}
out["torch124"] = r
print("torch124", r, flush=True)
json.dump(out, open(f"{RES}/launchwait.json", "w"), indent=1)
