# ruff: noqa: B007, B023, E402, E731, F821  (a one-off measurement kept as it ran on the H200; closures are called inside their loop iteration)
"""Why does DSP's graph launch cost the host ~0.45 us a node? Diagnose on the GPU."""

import ctypes
import json
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, "benchmarks")
import cupy as cp
import models_gpu as mg

RES = Path("/tmp/res")
RES.mkdir(exist_ok=True)
out = {}
dev = cp.cuda.Device()
sync = dev.synchronize
libcuda = ctypes.CDLL("libcuda.so.1")
libcuda.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
libcuda.cuGraphInstantiateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_ulonglong]
libcuda.cuGraphUpload.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
libcuda.cuGraphGetNodes.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
libcuda.cuGraphGetEdges.argtypes = [
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.POINTER(ctypes.c_size_t),
]
libcuda.cuGraphNodeGetType.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]


def host(fn, n=200):
    t = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    sync()
    return round(statistics.median(t) * 1e6, 2)


def structure(g):
    n = ctypes.c_size_t(0)
    assert libcuda.cuGraphGetNodes(g, None, ctypes.byref(n)) == 0
    nodes = (ctypes.c_void_p * n.value)()
    libcuda.cuGraphGetNodes(g, nodes, ctypes.byref(n))
    types = Counter()
    for nd in nodes:
        t = ctypes.c_int()
        libcuda.cuGraphNodeGetType(nd, ctypes.byref(t))
        types[t.value] += 1
    e = ctypes.c_size_t(0)
    libcuda.cuGraphGetEdges(g, None, None, ctypes.byref(e))
    return {
        "nodes": n.value,
        "types(0=kernel,1=memcpy,2=memset,3=host,4=graph,5=empty,6=wait,7=record)": dict(types),
        "edges": e.value,
    }


def probe(name, graph, stream):
    r = structure(graph.graph)
    r["cupy_launch_us"] = host(lambda: graph.launch(stream))
    ge, s = graph.graphExec, stream.ptr
    r["cuGraphLaunch_us"] = host(lambda: libcuda.cuGraphLaunch(ge, s))
    for flags in (0, 8):
        ex = ctypes.c_void_p()
        st = libcuda.cuGraphInstantiateWithFlags(ctypes.byref(ex), graph.graph, flags)
        if st:
            r[f"reinst_{flags}"] = f"CUresult {st}"
            continue
        libcuda.cuGraphUpload(ex, s)
        libcuda.cuGraphLaunch(ex, s)
        r[f"reinst_flags{flags}_us"] = host(lambda: libcuda.cuGraphLaunch(ex, s))
    try:
        dot = graph.debug_dot_str(1)
        (RES / f"{name}.dot").write_text(dot)
        r["dot_attrs"] = sorted(set(re.findall(r"\b([A-Z_]{6,})\b", dot)))[:60]
    except Exception as exc:
        r["dot"] = repr(exc)
    out[name] = r
    print(name, json.dumps(r), flush=True)


# --- synthetic chains ---
N = 62
s = cp.cuda.Stream(non_blocking=True)
x = cp.zeros(256, cp.float32)
with s:
    s.begin_capture()
    for _ in range(N):
        x += 1
    g = s.end_capture()
g.launch(s)
probe("cupy_elementwise_chain", g, s)

src = 'extern "C" __global__ void k%d(float* x){ x[threadIdx.x] += 1.0f; }'
mod1 = cp.RawModule(code=src % 0)
rk1 = mod1.get_function("k0")
f1 = rk1.kernel
sys.path.insert(0, "plugins/cuda_graphs")
from dsp_cuda_graphs.launch import launch_pointers

for dep in (False, True):
    s.begin_capture()
    for _ in range(N):
        launch_pointers(f1, (1, 1, 1), 256, [x.data.ptr], s.ptr, dependent=dep)
    g = s.end_capture()
    g.launch(s)
    probe(f"launchex_one_module_dep{int(dep)}", g, s)
mods = [cp.RawModule(code=src % i) for i in range(N)]
rks = [m.get_function(f"k{i}") for i, m in enumerate(mods)]
fs = [r.kernel for r in rks]
s.begin_capture()
for f in fs:
    launch_pointers(f, (1, 1, 1), 256, [x.data.ptr], s.ptr)
g = s.end_capture()
g.launch(s)
probe("launchex_many_modules", g, s)
# cupy's own launch of many module functions
s.begin_capture()
with s:
    for f in rks:
        f((1,), (256,), (x,))
g = s.end_capture()
g.launch(s)
probe("cupy_call_many_modules", g, s)

# torch chain
import torch

tx = torch.zeros(256, device="cuda")
tg = torch.cuda.CUDAGraph()
st = torch.cuda.Stream()
with torch.cuda.stream(st):
    for _ in range(3):
        tx.add_(1)
torch.cuda.synchronize()
with torch.cuda.graph(tg):
    for _ in range(N):
        tx.add_(1)
tg.replay()
out["torch_chain_replay_us"] = host(tg.replay)
print("torch chain", out["torch_chain_replay_us"], flush=True)

# --- DSP's MiniLM fp16 b1 ---
import dsp_core as dsp

for name in ("minilm", "bert-512"):
    module, make_feeds = mg.build(name)
    module = module.eval().cuda().half()
    feeds = make_feeds(1, "cuda")
    path = Path(tempfile.mkdtemp()) / f"{name}.onnx"
    mg.export(module, feeds, path)
    model = dsp.compile(str(path), mode="auto", outputs_on_device=True)
    devf = {k: cp.asarray(v.detach().cpu().numpy()) for k, v in feeds.items()}
    for _ in range(8):
        model.run(devf)
    sync()
    out[f"{name}_call_host_us"] = host(lambda: model.run(devf))
    rt = model.dsp.runtime
    k = 0
    for u in rt.units:
        gr = getattr(u.compiled, "_graph", None)
        if gr is not None:
            probe(f"{name}_dsp_graph{k}", gr, u.compiled._st["stream"])
            k += 1
    out[f"{name}_units"] = [type(u.compiled).__name__ for u in rt.units]
    del model
    # torch graph of the same module
    args = tuple(feeds.values())
    with torch.no_grad():
        st = torch.cuda.Stream()
        with torch.cuda.stream(st):
            for _ in range(3):
                module(*args)
        torch.cuda.synchronize()
        tg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(tg):
            module(*args)
    tg.replay()
    out[f"{name}_torch_replay_us"] = host(tg.replay)
    print(name, "torch replay", out[f"{name}_torch_replay_us"], "dsp call", out[f"{name}_call_host_us"], flush=True)
    del module, tg
    torch.cuda.empty_cache()

(RES / "launchcost.json").write_text(json.dumps(out, indent=1))
