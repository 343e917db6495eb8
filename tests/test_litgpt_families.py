"""LitGPT's model families (tests/litgpt_families.py) trained through tk on CPU, tk's kernels standing in
(`standins.StandinBuild`): each family's folds go where its structure allows and nowhere else, every gradient is as
accurate as eager bf16's, and explain says why attention stays off tk where it does. A mixture-of-experts model,
which Thunder cannot trace, gets one clear message from `thunder-tk pretrain` and `explain`."""

import pytest
import torch

litgpt = pytest.importorskip("litgpt")

import thunder  # noqa: E402

import thunder_tk  # noqa: E402
from litgpt_families import FAMILIES, MOE, build, ids, infer_and_compare, tk_ops, train_and_compare  # noqa: E402
from trace_counts import traces_not_python  # noqa: E402
from thunder_tk import tk  # noqa: E402

SDPA = "ltorch.scaled_dot_product_attention"


# Mathstral's mask takes Mistral's path at a longer window and Phi-3-mini's the fallback's, both also in
# test_attention_masks.py: the CPU suite leaves them to the GPU family test (CI time).
_CPU_FAMILIES = [f for f in FAMILIES if f.name not in ("Mathstral-7B-v0.1", "Phi-3-mini-128k-instruct")]


@pytest.mark.parametrize("family", _CPU_FAMILIES, ids=ids)
def test_family_trains_through_tk_as_accurately_as_eager(standin_tk_build, standin_nvfuser, family):
    jitted = train_and_compare(litgpt, family, "cpu", lambda m: thunder.jit(m, executors=[tk]))
    # Every trace of the forward and the backward, tk's passes' among them, prints as a Python program.
    assert traces_not_python(thunder.last_traces(jitted) + thunder.last_backward_traces(jitted)) == []
    ran = tk_ops(jitted)
    assert family.claimed <= ran, (family.name, sorted(family.claimed - ran))
    assert not family.absent & ran, (family.name, sorted(family.absent & ran))
    if family.declined:
        rows = [r for r in thunder_tk.explain(jitted).rows if r.symbol == SDPA]
        assert rows and all(not r.claimed_by_tk and family.declined in r.reason for r in rows), \
            [(r.claimed_by_tk, r.reason) for r in rows]


def _some(*names):
    return [f for f in FAMILIES if f.name in names]


# LitGPT's default training precision: the residual stream and the norms in fp32 (the fuser's), q/k norms in bf16.
@pytest.mark.parametrize("family", _some("Llama-3.2-1B", "Qwen3-0.6B", "Gemma-2b"), ids=ids)
def test_family_trains_at_bf16_mixed_as_accurately_as_eager(standin_tk_build, standin_nvfuser, family):
    jitted = train_and_compare(litgpt, family, "cpu", lambda m: thunder.jit(m, executors=[tk]), mixed=True)
    assert {"tk_attention_forward", "tk_linear", "tk_embedding_backward"} <= tk_ops(jitted)


@pytest.mark.parametrize("family", _some("Llama-3.2-1B", "Gemma-2-2b", "Mistral-7B-v0.1"), ids=ids)
def test_family_infers_as_accurately_as_eager(standin_tk_build, standin_nvfuser, family):
    jitted = infer_and_compare(litgpt, family, "cpu", lambda m: thunder.jit(m, executors=[tk]))
    ran = {str(b.sym.name) for b in thunder.last_traces(jitted)[-1].bound_symbols}
    assert "tk_linear" in ran and ("tk_attention" in ran) == ("tk_attention_forward" not in family.absent)


def test_thunder_cannot_trace_litgpts_mixture_of_experts():
    """If a later Thunder traces LLaMAMoE, litgpt_models.jit_unsupported's refusal and this test should go."""
    model, *_ = build(litgpt, MOE, "cpu", torch.float32)
    with pytest.raises(NotImplementedError, match="torch.where"):
        thunder.jit(model)(torch.zeros(1, 8, dtype=torch.long))


# -- sliding-window masks built in a few ops (litgpt_models.vectorize_window_masks) -------------------------------


@pytest.mark.parametrize("seq, window", [(1, 1), (7, 1), (33, 5), (64, 16), (16, 16), (17, 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_vectorized_window_mask_equals_litgpts_loop(seq, window, dtype):
    from test_attention_masks import litgpt_window  # LitGPT's loop, as its forward writes the mask
    from thunder_tk.litgpt_models import sliding_window_mask

    got = sliding_window_mask(seq, window, dtype, "cpu")
    assert got.dtype == dtype and got.shape == (1, 1, seq, seq)
    assert torch.equal(got, litgpt_window(torch.empty(1, 1, seq, 1, dtype=dtype), window))


def _window_families():
    return _some("Mistral-7B-v0.1", "Gemma-3-1b-it", "Gemma-2-2b")  # Gemma 2: soft-capped scores take the mask


def _jit_vectorized(model):
    from litgpt_families import jit_tk
    from thunder_tk.litgpt_models import vectorize_window_masks

    assert vectorize_window_masks(model) == 1  # the shrunk families' one layer has a window
    return jit_tk(model)


@pytest.mark.parametrize("family", _window_families(), ids=ids)
def test_vectorized_window_masks_train_as_litgpts_do(standin_tk_build, standin_nvfuser, family):
    """The jitted model's mask comes from a few ops, not one write a position (eager and float64 keep LitGPT's
    loop), with the same accuracy, and tk reads it as the same window."""
    jitted = train_and_compare(litgpt, family, "cpu", _jit_vectorized)
    assert family.claimed <= tk_ops(jitted), (family.name, sorted(family.claimed - tk_ops(jitted)))
    first = thunder.last_traces(jitted)[0]  # the trace as Thunder first records it, before any pass
    names = [str(b.sym.name) for b in first.bound_symbols]
    assert not [n for n in names if "setitem" in n] and len(names) < 200, (len(names), sorted(set(names)))
    if "tk_attention_forward" in family.claimed:
        rows = [r for r in thunder_tk.explain(jitted).rows if r.symbol == SDPA]
        window = family.overrides["sliding_window_size"]
        assert rows and all(f"window of {window} keys" in r.detail for r in rows), [r.detail for r in rows]


def test_the_vectorized_trace_does_not_grow_with_the_sequence(standin_tk_build, standin_nvfuser):
    family = _some("Mistral-7B-v0.1")[0]
    counts = []
    for seq in (32, 64):
        model, *_ = build(litgpt, family, "cpu", torch.bfloat16)
        jitted = _jit_vectorized(model)
        jitted(torch.zeros(1, seq, dtype=torch.long))
        counts.append(len(thunder.last_traces(jitted)[0].bound_symbols))
    assert counts[0] == counts[1], counts


def test_vectorize_window_masks_counts_layers_and_keeps_kv_caches_out():
    from thunder_tk.litgpt_models import vectorize_window_masks

    gemma3 = _some("Gemma-3-1b-it")[0]
    cfg = litgpt.Config.from_name(gemma3.name, **{**gemma3.overrides, "n_layer": 6})
    model = litgpt.GPT(cfg)
    assert vectorize_window_masks(model) == sum(cfg.sliding_window_indices[:6]) == 5
    assert vectorize_window_masks(model) == 0  # done once
    llama, *_ = build(litgpt, _some("Llama-3.2-1B")[0], "cpu", torch.float32)
    assert vectorize_window_masks(llama) == 0

    # A KV cache: refused before the change, and a changed layer given one later raises instead of attending
    # without its window.
    mistral = _some("Mistral-7B-v0.1")[0]
    cached, changed, *_ = build(litgpt, mistral, "cpu", torch.float32)
    cached.set_kv_cache(batch_size=1)
    with pytest.raises(ValueError, match="transformer.h.0.attn: has a KV cache"):
        vectorize_window_masks(cached)
    vectorize_window_masks(changed)
    changed.set_kv_cache(batch_size=1)
    with pytest.raises(RuntimeError, match="KV-cache inference needs a model without that change"):
        changed(torch.zeros(1, 4, dtype=torch.long), input_pos=torch.arange(4))


@pytest.mark.parametrize("family", _some("Llama-3.2-1B", "Gemma-3-1b-it"), ids=ids)
def test_family_trains_for_steps_as_accurately_as_eager(standin_tk_build, standin_nvfuser, family):
    """Several optimizer steps (tk's kernels standing in): the loss stays as close to float64 training as eager's."""
    from litgpt_families import jit_tk, train_steps_and_compare

    jitted, _ = train_steps_and_compare(litgpt, family, "cpu", jit_tk)
    assert "tk_attention_forward" in tk_ops(jitted)
