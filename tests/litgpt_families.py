"""LitGPT's model families, shrunk: each a LitGPT config name with its distinguishing structure kept (the MLP and norm
classes, grouped or multi-query heads, q/k norms, attention biases, partial rotary embeddings, parallel residuals,
logit soft-capping, sliding windows, head sizes tk declines) and its sizes cut to a one-layer model that trains in
seconds. The CPU and GPU family tests train each through tk and check where the work went and that every gradient is
as accurate as eager PyTorch's.

`claimed`: tk ops that must be in the joint trace; `absent`: ones that must not be, because the family's structure
does not have what they fold (the explain row or the fold's own rule says why). `declined`: text that explain's
attention row gives as its reason, where the family's attention stays off tk."""

from __future__ import annotations

from dataclasses import dataclass, field

VOCAB = 512
SEQ = 32  # above every shrunk sliding window (16): the window's mask is in play


@dataclass(frozen=True)
class Family:
    name: str                    # a LitGPT config name
    overrides: dict              # sizes (and the window) that shrink it
    claimed: frozenset = field(default_factory=frozenset)
    absent: frozenset = field(default_factory=frozenset)
    declined: str = ""           # explain's reason for the attention row, where attention is declined


def _family(name, claimed=(), absent=(), declined="", **overrides) -> Family:
    sizes = dict(n_layer=1, n_head=4, head_size=64, intermediate_size=256, padded_vocab_size=VOCAB, vocab_size=VOCAB,
                 block_size=512)
    sizes.update(overrides)
    sizes.setdefault("n_query_groups", sizes["n_head"])
    sizes.setdefault("n_embd", sizes["n_head"] * sizes["head_size"])
    return Family(name, sizes, frozenset(claimed), frozenset(absent), declined)


_EVERYTHING = ("tk_linear_rope", "tk_attention_forward", "tk_attention_backward_qkv", "tk_swiglu_linear",
               "tk_matmul_swiglu_grad", "tk_add_rms_norm", "tk_rms_norm_backward", "tk_embedding_backward")

FAMILIES = [
    # Grouped-query heads, SwiGLU, RMSNorm, rope over the whole head: every fold.
    _family("Llama-3.2-1B", _EVERYTHING, n_query_groups=2),
    # RMSNorm on q and k between the projection and the rope: the rope and qkv-gradient folds do not apply.
    _family("Qwen3-0.6B", ("tk_attention_forward", "tk_attention_backward", "tk_swiglu_linear", "tk_add_rms_norm"),
            ("tk_linear_rope", "tk_attention_backward_qkv"), n_query_groups=2),
    # A bias on the qkv projection: the rope stays the fuser's (the epilogue adds none), its gradient still folds.
    _family("Qwen2.5-0.5B", ("tk_attention_backward_qkv", "tk_swiglu_linear", "tk_add_rms_norm"),
            ("tk_linear_rope",), n_query_groups=2),
    # GeGLU (not SwiGLU), RMSNorm's 1 + w, scaled embeddings, one KV head of 256.
    _family("Gemma-2b", ("tk_linear_rope", "tk_attention_backward_qkv", "tk_add_rms_norm"),
            ("tk_swiglu_linear", "tk_matmul_swiglu_grad"), n_head=2, n_query_groups=1, head_size=256),
    # Soft-capped attention logits: LitGPT computes the scores itself, so there is no SDPA to claim.
    _family("Gemma-2-2b", ("tk_add_rms_norm", "tk_rms_norm_backward"), ("tk_attention_forward",), n_query_groups=2,
            sliding_window_size=16),
    # LayerNorm, a GELU MLP, parallel residual, biases, a rotary embedding over 32 of 80 columns: heads of 80.
    _family("phi-2", ("tk_linear", "tk_embedding_backward"), ("tk_attention_forward", "tk_add_rms_norm"),
            declined="head_dim 80", head_size=80),
    # One KV head, parallel residual with one shared norm (LayerNorm).
    _family("falcon-7b", ("tk_linear_rope", "tk_attention_backward_qkv"), (), n_query_groups=1),
    # q/k norms over the whole projection and norms after attention and MLP.
    _family("OLMo-2-1124-7B", ("tk_attention_forward", "tk_swiglu_linear", "tk_add_rms_norm", "tk_rms_norm_backward"),
            ("tk_linear_rope",)),
    # LayerNorm with LLaMA's MLP, the rotary embedding over 16 of 64 columns.
    _family("stablelm-3b-4e1t", ("tk_linear_rope", "tk_attention_backward_qkv", "tk_swiglu_linear"),
            ("tk_add_rms_norm",)),
    # A sliding window shorter than the sequence: LitGPT hands SDPA a mask, which tk reads as a causal window.
    _family("Mistral-7B-v0.1", ("tk_attention_forward", "tk_attention_backward_qkv", "tk_swiglu_linear",
                                "tk_add_rms_norm"), n_query_groups=2, sliding_window_size=16),
    # A window no shorter than the sequence (Mathstral's 4096 at up to 4096 tokens): LitGPT's mask is causal.
    _family("Mathstral-7B-v0.1", ("tk_attention_forward", "tk_attention_backward_qkv", "tk_linear_rope",
                                  "tk_swiglu_linear"), n_query_groups=2, sliding_window_size=64),
    # Phi-4-mini: a window of 262145 (a causal mask at any length) and the rotary embedding over 48 of 64 columns.
    _family("Phi-4-mini-instruct", ("tk_attention_forward", "tk_swiglu_linear", "tk_add_rms_norm"),
            n_query_groups=2),
    # Phi-3-mini: the same causal mask with heads of 96, which tk declines; the mask still goes as is_causal.
    _family("Phi-3-mini-128k-instruct", ("tk_swiglu_linear",), ("tk_attention_forward",), declined="head_dim 96",
            head_size=96),
    # Gemma-3: q/k norms, a window of 16 keys on five layers of six (the first here), unit-offset norms.
    _family("Gemma-3-1b-it", ("tk_attention_forward", "tk_add_rms_norm"), n_head=2, n_query_groups=1, head_size=256,
            sliding_window_size=16),
]

# LitGPT's mixture-of-experts MLP picks each expert's tokens with torch.where(mask): Thunder cannot trace it.
MOE = _family("Mixtral-8x7B-v0.1", n_query_groups=2, n_expert=4, n_expert_per_token=2)


def ids(family: Family) -> str:
    """pytest's id for a family parameter."""
    return family.name


def build(litgpt, family: Family, device, dtype, seed: int = 0):
    """(model in `dtype`, the same weights in eager `dtype`, in float64, and the config). The norm weights are moved
    away from their initial values, so that a lost or misplaced weight shows in the results."""
    import torch

    cfg = litgpt.Config.from_name(family.name, **family.overrides)
    torch.manual_seed(seed)
    exact = litgpt.GPT(cfg).to(device=device, dtype=torch.float64)
    for p in exact.parameters():
        if p.ndim == 1:
            p.data += 0.2 * torch.randn_like(p)
    models = []
    for _ in range(2):
        m = litgpt.GPT(cfg).to(device=device, dtype=dtype)
        m.load_state_dict({k: v.to(dtype) for k, v in exact.state_dict().items()})
        models.append(m)
    return models[0], models[1], exact, cfg


def jit_tk(model):
    """thunder.jit(model, executors=[tk]), sliding-window masks built as pretrain builds them
    (litgpt_models.vectorize_window_masks)."""
    import thunder

    from thunder_tk import tk
    from thunder_tk.litgpt_models import vectorize_window_masks

    vectorize_window_masks(model)
    return thunder.jit(model, executors=[tk])


def tk_ops(jitted) -> set[str]:
    """The tk ops in the jitted model's last forward and backward traces."""
    import thunder

    traces = (thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1])
    return {str(b.sym.name) for t in traces for b in t.bound_symbols if str(b.sym.name).startswith("tk_")}


def train_and_compare(litgpt, family: Family, device, jit, batch: int = 2, seq: int = SEQ, mixed: bool = False):
    """One forward and backward of the family's model through `jit(model)` beside eager PyTorch and float64 with the
    same weights: bf16 weights, or with `mixed` LitGPT's bf16-mixed (fp32 weights, the forward under bf16 autocast,
    for the jitted model and eager alike). Asserts that the jitted error against float64 is at most twice eager's
    (plus 1e-3), for the output and every parameter's gradient. Returns the jitted model."""
    import torch

    # tests/ is on the path (conftest's directory); tests/gpu may not be
    from gpu.accuracy import assert_as_accurate_as_eager

    model, eager, exact, cfg = build(litgpt, family, device, torch.float32 if mixed else torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device)
    seed = torch.randn(batch, seq, cfg.padded_vocab_size, generator=gen).to(device)
    jitted = jit(model)
    results = []
    for m in (jitted, eager):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=mixed):
            out = m(idx)
        out.backward(seed.to(out.dtype))
        results.append(out)
    x = exact(idx)
    x.backward(seed.double())
    assert_as_accurate_as_eager(family.name, *results, x, model, eager, exact)
    return jitted


def infer_and_compare(litgpt, family: Family, device, jit, batch: int = 2, seq: int = SEQ):
    """The family's bf16 model through `jit(model)` under no_grad (inference traces: ltorch ops, tk_attention)
    beside eager bf16 and float64; asserts the jitted output's error is at most twice eager's (plus 1e-3). Returns
    the jitted model."""
    import torch

    from gpu.accuracy import rel_err

    model, eager, exact, cfg = build(litgpt, family, device, torch.bfloat16)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        jitted = jit(model)
        got, want, x = jitted(idx), eager(idx), exact(idx)
    assert rel_err(got, x) < 2 * rel_err(want, x) + 1e-3, (family.name, rel_err(got, x), rel_err(want, x))
    return jitted


def train_steps_and_compare(litgpt, family: Family, device, jit, steps: int = 8, batch: int = 2, seq: int = SEQ,
                            lr: float = 3e-3) -> tuple[object, list[float]]:
    """`steps` AdamW steps of the family's bf16 model through `jit(model)` beside eager bf16 and float64 with the
    same weights, batch and targets (one fixed batch, so the loss falls fast and rounding has every chance to build
    up). Asserts that the jitted losses are on average within twice eager's distance from float64's (plus 2e-3 of
    the loss): what builds up over steps (a biased gradient, state carried from one step to the next) shows here
    where one step's check passes. bf16 training itself drifts from float64 by 1-5% in these steps, so the check
    finds errors above that (a 10% logit scale fails it, 2% does not). Returns the jitted model and its losses."""
    import torch
    import torch.nn.functional as F

    model, eager, exact, cfg = build(litgpt, family, device, torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device)
    jitted = jit(model)
    runs = [jitted, eager, exact]  # a jitted module's parameters are its model's
    optimizers = [torch.optim.AdamW(m.parameters(), lr=lr) for m in runs]
    losses = [[], [], []]
    for _ in range(steps):
        for m, opt, out in zip(runs, optimizers, losses):
            loss = F.cross_entropy(m(idx).double().flatten(0, 1), targets.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
    got, want, x = losses

    def distance(a):
        return sum(abs(u - v) for u, v in zip(a, x)) / steps

    assert distance(got) <= 2 * distance(want) + 2e-3 * sum(x) / steps, (
        family.name, f"mean distance from float64: jitted {distance(got):.2e}, eager {distance(want):.2e}",
        "jitted", got, "eager", want, "float64", x)
    assert x[-1] < 0.9 * x[0], (family.name, x)  # the steps did train
    return jitted, got
