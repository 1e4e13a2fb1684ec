"""The fast decode path on a CUDA device: prefill and decode step against the HF forward in float32 and
bfloat16, and the engine's tokens and log-probs with and without it (eager and compiled). CPU CI skips these;
`benchmarks/gpu_check.sh` runs them where a GPU is lent."""

import pytest
import torch

from orchard.rollout.fast_decode import DecodeForward
from orchard.rollout.hf_engine import HFEngine
from orchard.rollout.kv_cache import prefill_inputs

from .test_fast_decode import _REQUESTS, VOCAB, _generate, _model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (run by benchmarks/gpu_check.sh)")
CUDA = torch.device("cuda")


def _reference(model, seqs):
    """Next-token logits of each sequence alone through the HF forward, no cache, no padding."""
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([s], device=CUDA)).logits[0, -1] for s in seqs])


# float32: the fast path's own sums against cuBLAS/SDPA's in another order, so a little above the CPU tests' 1e-5.
# bfloat16: 8 mantissa bits (relative step 2**-8 = 0.004) through 2 layers and two attention kernels; 3 % of the
# logits' largest magnitude still tells a missing term (a norm, the rotary, a bias moves them by far more).
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_fast_prefill_and_step_equal_the_hf_forward_on_cuda(dtype, tolerance):
    model = _model("qwen3").to(CUDA, dtype)
    decode = DecodeForward(model)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (3, 9, 1)]
    inputs = prefill_inputs(model.config, [None] * 3, seqs, 0, CUDA)
    cache = inputs.cache
    with torch.no_grad():
        logits = decode.prefill(inputs.input_ids, inputs.attention_mask, inputs.position_ids, cache)
    cache.advance(inputs.input_ids.shape[1])
    for step in range(4):
        ref = _reference(model, seqs).float()
        scale = ref.abs().max()
        assert scale > 1
        torch.testing.assert_close(logits.float(), ref, atol=tolerance * scale, rtol=0, msg=f"step {step}")
        tokens = torch.randint(1, VOCAB, (3,), generator=gen).tolist()
        cache.reserve(1)
        cache.mask[:, cache.length] = 1
        with torch.no_grad():
            logits = decode(torch.tensor(tokens, device=CUDA), torch.tensor([len(s) for s in seqs], device=CUDA),
                            cache)
        cache.advance(1)
        for seq, token in zip(seqs, tokens, strict=True):
            seq.append(token)


@pytest.mark.parametrize("compiled", [False, True])
def test_engine_on_cuda_samples_the_same_with_the_fast_path(compiled):
    model = _model("qwen3").to(CUDA)
    fast = _generate(HFEngine(model, fast_decode=True, compile_decode=compiled), _REQUESTS)
    plain = _generate(HFEngine(model, fast_decode=False), _REQUESTS)
    for a, b in zip(fast, plain, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
