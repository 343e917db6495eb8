"""One LitGPT training step on tk beside the same weights in eager bf16 and in float64, for the GPU tests that check a
model end to end."""

import thunder
import torch

from accuracy import assert_as_accurate_as_eager
from thunder_tk import tk


def step_as_accurately_as_eager(litgpt, mixed: bool = False, executors=None, **options):
    """A two-layer LitGPT model (grouped-query heads, 8 over 2 groups of 64, rope over the whole head, a sequence of
    300: a tail in every tile size) jitted with executors=[tk]: one forward and backward, beside eager bf16 and
    float64 with the same weights. Asserts that tk's error against float64 is at most twice eager bf16's, for the
    output and every parameter's gradient. `mixed`: bf16-mixed instead (LitGPT's default training precision: fp32
    weights, the forward under bf16 autocast, for tk and eager alike). `executors` (default [tk]) and `options` go
    to thunder.jit. Returns the jitted model and its config."""
    cfg = litgpt.Config(name="tk-test", block_size=512, n_layer=2, n_head=8, n_query_groups=2, n_embd=512,
                        head_size=64, padded_vocab_size=1024, vocab_size=1024, bias=False, norm_class_name="RMSNorm",
                        mlp_class_name="LLaMAMLP", intermediate_size=1024, rotary_percentage=1.0,
                        parallel_residual=False)
    torch.manual_seed(0)
    exact = litgpt.GPT(cfg).cuda().double()
    weights = torch.float32 if mixed else torch.bfloat16
    model = litgpt.GPT(cfg).cuda().to(weights)
    model.load_state_dict({k: v.to(weights) for k, v in exact.state_dict().items()})
    eager = litgpt.GPT(cfg).cuda().to(weights)
    eager.load_state_dict(model.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, 300), device="cuda")

    jitted = thunder.jit(model, executors=executors if executors is not None else [tk], **options)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mixed):
        logits = jitted(idx)
    seed = torch.randn_like(logits)
    logits.backward(seed)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mixed):
        eager_logits = eager(idx)
    eager_logits.backward(seed)
    exact_logits = exact(idx)
    exact_logits.backward(seed.double())

    assert_as_accurate_as_eager(cfg.name, logits, eager_logits, exact_logits, model, eager, exact)
    return jitted, cfg
