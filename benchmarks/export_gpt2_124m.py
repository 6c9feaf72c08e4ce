"""Export GPT-2 124M (random weights, no download) with scripts/make_fixtures.py's recipe, for the CPU race.

Needs torch and transformers: run it with the fixture venv (`make fixtures` creates it),
never with the project's venv:

    .fixture-venv/bin/python benchmarks/export_gpt2_124m.py --out /tmp/gpt2_124m.onnx

The model has GPT-2 small's shapes (12 layers, 768 wide, 12 heads, vocab 50257), eager
attention at opset 18 (MatMul/Softmax, as `gpt2_eager`), and the KV naming of
docs/llm.md; about 500 MB with its weights inline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import make_fixtures as mf  # noqa: E402  (needs torch: the fixture venv)
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402


def build_gpt2_124m() -> torch.nn.Module:
    """GPT-2 small with seeded random weights."""
    torch.manual_seed(124)
    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, attn_implementation="eager")
    return GPT2LMHeadModel(cfg).eval()


def main() -> int:
    """Export to --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/gpt2_124m.onnx"))
    args = parser.parse_args()
    mf.export_decoder(mf.DecoderWrapper(build_gpt2_124m()), 18, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
