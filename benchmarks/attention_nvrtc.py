"""dsp-nvrtc's decode-attention kernel alone, in its variants, on the GPU: µs per launch.

For GPT-2 124M's shape (12 heads) and Llama-3.2-1B's (32 heads over 8 KV heads), 296 KV
positions, head dim 64, fp16: the group's kernel (``codegen._attention_template``) generated
with 256, 512 and 1,024 threads a block and 4, 8 or 32 lanes per KV position for the scores,
compiled by NVRTC for the device, launched 30 times after 5 warm-up launches (CUDA events,
median), and its output compared with the reference's.

    python3 benchmarks/attention_nvrtc.py --out $OUT/attention_nvrtc_variants.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(12, 12, 296, 64), (32, 8, 296, 64)]  # heads, KV heads, positions, head dim


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attention_nvrtc_variants.json"))
    parser.add_argument("--launches", type=int, default=30)
    args = parser.parse_args(argv)
    os.environ["DSP_NVRTC_ATTENTION"] = "1"  # the group forms only with it on
    sys.path.insert(0, str(ROOT / "tests" / "triton_interp"))
    import attention_graphs as ag
    import cupy as cp
    from dsp_nvrtc import codegen, compiler, hostcheck

    results: dict[str, Any] = {}
    for heads, kv_heads, length, dim in SHAPES:
        feeds = ag.feeds(heads, kv_heads, length, length - 3, dim, "float16")
        model = ag.model(heads, kv_heads, length, dim, "slot_by_slot", "float16")
        found = [x for x in hostcheck.group_specs(model, feeds) if x[2].template == "decode_attention"]
        _, _, spec, values = found[0]
        want = np.asarray(values[spec.outputs[0]]).astype(np.float32)
        for threads in (256, 512, 1024):
            for lanes in (4, 8, 32):
                codegen.ATTENTION_THREADS, codegen.ATTENTION_LANES = threads, lanes
                kernel = codegen.generate(spec)
                target = compiler.Target(f"sm_{cp.cuda.Device().compute_capability}")
                module = cp.cuda.function.Module()
                module.load(compiler.compile_source(kernel.device_source(), kernel.name, target))
                fn = module.get_function(kernel.name)
                ins = [cp.asarray(np.ascontiguousarray(values[v])) for v in kernel.args[: kernel.n_inputs]]
                out = cp.empty(spec.values[kernel.args[-1]].shape, dtype=np.float16)
                for _ in range(5):
                    fn((kernel.grid,), (kernel.threads,), (*ins, out))
                cp.cuda.Device().synchronize()
                start, stop, times = cp.cuda.Event(), cp.cuda.Event(), []
                for _ in range(args.launches):
                    start.record()
                    fn((kernel.grid,), (kernel.threads,), (*ins, out))
                    stop.record()
                    stop.synchronize()
                    times.append(cp.cuda.get_elapsed_time(start, stop) * 1000)
                err = float(np.abs(cp.asnumpy(out).astype(np.float32) - want).max())
                key = f"h{heads}/kv{kv_heads} L{length} threads {threads} lanes {lanes}"
                results[key] = {"us_median": float(np.median(times)), "max_err": err}
                print(key, results[key], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
