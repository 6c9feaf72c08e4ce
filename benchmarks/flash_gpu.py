"""An encoder's flash attention on the GPU: dsp-triton's kernel per tuning config against torch SDPA.

The encoder attention fixture (``dsp_core.testing.models.encoder_attention``: one QKV
projection split into heads, ``q @ k^T / sqrt(d)`` plus the padding mask ``[batch, 1, 1, L]``,
Softmax, the weighted sum, the heads' transpose and merge) in fp16 at BERT-base's heads (12 x 64)
and the given batch x sequence shapes. For each shape the attention group's kernel is generated
by ``dsp_triton.codegen`` at every config the tuner times (``codegen.attention_configs``), fed one
set of random inputs laid out as the group reads them (Q, K and V inside the projection's output),
and timed as the tuner times it (``common.torch_flushed_us``: launches in a replayed graph, each
after an L2 flush). ``max_diff`` is each config's largest difference from the default config's
output on the same inputs (the group's agreement with the reference is the GPU tests' job:
tests/gpu/test_triton_attention_gpu.py). torch's rows are ``scaled_dot_product_attention`` on
``[batch, 12, L, 64]`` with the same mask through cuDNN and the memory-efficient kernel, and flash
without a mask (its fastest path). The floor is Q, K, V and the output's bytes over the copy
bandwidth.

    python3 benchmarks/flash_gpu.py --out benchmarks/results/flash_gpu.json
    python3 benchmarks/flash_gpu.py --shapes 1x512,8x128 --out /tmp/flash.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "tests" / "triton_interp"))
from common import machine_meta, torch_flushed_us, write_results  # noqa: E402

HEADS, HEAD_DIM = 12, 64
SHAPES = "1x128,8x128,1x512,8x512"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"1x512,8x128"`` -> [(1, 512), (8, 128)] (batch x sequence); a clear error otherwise."""
    shapes = []
    for part in text.split(","):
        try:
            batch, seq = (int(x) for x in part.strip().lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes: {part!r} is not BATCHxSEQ (e.g. 1x512)") from None
        if batch < 1 or seq < 17:
            raise SystemExit(f"--shapes: {part!r}: the flash kernel takes batch >= 1 and more than 16 rows")
        shapes.append((batch, seq))
    return shapes


def attention_spec(batch: int, seq: int) -> Any:
    """The fixture's attention group spec at this shape (as dsp-triton's kernels.py builds it)."""
    from test_triton_attention import _attention_spec, _model

    from dsp_core.testing.models import encoder_attention_feeds

    shape = {"batch": batch, "seq": seq, "heads": HEADS, "head_dim": HEAD_DIM}
    return _attention_spec(_model(Path(tempfile.mkdtemp()), **shape), encoder_attention_feeds("float16", **shape))


def kernel_inputs(spec: Any, kernel: Any, seq: int) -> list[Any]:
    """Random inputs laid out as ``spec`` says (strides included); the scale 8, the mask's last eighth -10000."""
    import torch

    made = []
    for v in kernel.args[: kernel.n_inputs]:
        t = spec.values[v]
        dtype = getattr(torch, t.dtype)
        x = (
            torch.empty(t.shape, dtype=dtype, device="cuda")
            if t.strides is None
            else torch.empty_strided(t.shape, t.strides, dtype=dtype, device="cuda")
        )
        if x.numel() == 1:
            x.fill_(float(HEAD_DIM) ** 0.5)
        elif len(t.shape) == 4 and t.shape[1] == 1 and t.shape[2] == 1:
            x.zero_()
            x[..., seq - max(1, seq // 8) :] = -10000.0
        else:
            x.normal_()
        made.append(x)
    return made


def dsp_rows(batch: int, seq: int, folder: Path) -> list[dict[str, Any]]:
    import torch
    from dsp_triton import codegen
    from interpret_check import load_kernel

    spec = attention_spec(batch, seq)
    default = codegen.generate(spec)
    inputs = kernel_inputs(spec, default, seq)
    out_spec = spec.values[default.args[default.n_inputs]]
    rows, reference = [], None
    for config in codegen.attention_configs(spec):
        kernel = codegen.generate(spec, config=config)
        row: dict[str, Any] = {"batch": batch, "seq": seq, "who": "dsp", "config": config, "kernel": kernel.name}
        try:
            fn = load_kernel(folder, kernel, interpret=False)
            out = torch.empty(out_spec.shape, dtype=getattr(torch, out_spec.dtype), device="cuda")

            def launch(fn: Any = fn, kernel: Any = kernel, out: Any = out) -> None:
                fn[kernel.grid](*inputs, out, num_warps=kernel.num_warps)

            launch()
            torch.cuda.synchronize()
            if reference is None:
                reference = out.clone()
            row["max_diff"] = float((out.float() - reference.float()).abs().max())
            row["us"] = torch_flushed_us(launch)
        except Exception as exc:  # noqa: BLE001  (a config the device refuses: say so, time the others)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
    return rows


def torch_rows(batch: int, seq: int) -> list[dict[str, Any]]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(batch, HEADS, seq, HEAD_DIM, dtype=torch.float16, device="cuda") for _ in range(3))
    mask = torch.zeros(batch, 1, 1, seq, dtype=torch.float16, device="cuda")
    mask[..., seq - max(1, seq // 8) :] = -10000.0
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for name, backend, m in (
        ("cudnn_mask", SDPBackend.CUDNN_ATTENTION, mask),
        ("efficient_mask", SDPBackend.EFFICIENT_ATTENTION, mask),
        ("flash_no_mask", SDPBackend.FLASH_ATTENTION, None),
    ):
        row: dict[str, Any] = {"batch": batch, "seq": seq, "who": f"torch {name}"}
        try:
            with sdpa_kernel(backend):

                def body(m: Any = m) -> None:
                    sdpa(q, k, v, attn_mask=m)

                body()
                row["us"] = torch_flushed_us(body)
        except Exception as exc:  # noqa: BLE001  (a backend this build or GPU lacks)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help=f"comma list of BATCHxSEQ (default {SHAPES})")
    p.add_argument("--out", default=str(HERE / "results" / "flash_gpu.json"))
    args = p.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    try:
        import torch
    except ImportError:
        raise SystemExit("flash_gpu.py needs torch and a CUDA GPU (torch is not installed)") from None
    if not torch.cuda.is_available():
        raise SystemExit("flash_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    from products_gpu import copy_bandwidth

    bandwidth = copy_bandwidth()
    folder = Path(tempfile.mkdtemp(prefix="dsp_flash_"))
    results = []
    print(f"{'batch x seq':>12} {'who':<16} {'config':<34} {'us':>8} {'x floor':>8} {'max diff':>9}")
    for batch, seq in shapes:
        floor_us = 4 * batch * seq * HEADS * HEAD_DIM * 2 / bandwidth * 1e6
        rows = dsp_rows(batch, seq, folder) + torch_rows(batch, seq)
        for row in rows:
            row["floor_us"] = floor_us
            us = row.get("us")
            config = ",".join(f"{k}={v}" for k, v in row.get("config", {}).items())
            timing = f"{us:8.2f} {us / floor_us:8.1f}" if us is not None else f"{row.get('error', '')[:40]}"
            diff = f" {row['max_diff']:9.2e}" if "max_diff" in row else ""
            print(f"{batch:>5} x {seq:<5} {row['who']:<16} {config:<34} {timing}{diff}")
        results += rows
    write_results(args.out, machine_meta(gpu=torch.cuda.get_device_name(), torch=torch.__version__), results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
