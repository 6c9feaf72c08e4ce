"""LLM decode: GenerationPipeline, GenerationSession, the prefill and fixed-KV rewrites, sampling, metrics.

from dsp_core.llm import GenerationPipeline, Sampling
pipe = GenerationPipeline("decoder.onnx", max_length=256)
result = pipe.generate(prompt_ids, max_new_tokens=32)             # greedy
result = pipe.generate(prompt_ids, 32, sampling=Sampling(temperature=0.8, top_p=0.9, seed=0))
s = pipe.session(); s.append(prompt_ids); s.generate(8); s.append(more_ids); s.generate(8)

See docs/llm.md.
"""

from dsp_core.llm.kv import FixedKVGraph, KVGrowth, KVTransformError, find_kv_growth, fixed_kv_buffers
from dsp_core.llm.lm_head import LastLogits, last_position_logits
from dsp_core.llm.metrics import DecodeMetrics
from dsp_core.llm.pipeline import DecodeLoop, GenerationPipeline, GenerationResult, GenerationSession
from dsp_core.llm.sampling import GREEDY, Sampler, Sampling

__all__ = [
    "GREEDY",
    "DecodeLoop",
    "DecodeMetrics",
    "FixedKVGraph",
    "GenerationPipeline",
    "GenerationResult",
    "GenerationSession",
    "KVGrowth",
    "KVTransformError",
    "LastLogits",
    "Sampler",
    "Sampling",
    "find_kv_growth",
    "fixed_kv_buffers",
    "last_position_logits",
]
