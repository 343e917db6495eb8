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
from thunder_tk import tk  # noqa: E402

SDPA = "ltorch.scaled_dot_product_attention"


# Mathstral's mask takes Mistral's path at a longer window and Phi-3-mini's the fallback's, both also in
# test_attention_masks.py: the CPU suite leaves them to the GPU family test (CI time).
_CPU_FAMILIES = [f for f in FAMILIES if f.name not in ("Mathstral-7B-v0.1", "Phi-3-mini-128k-instruct")]


@pytest.mark.parametrize("family", _CPU_FAMILIES, ids=ids)
def test_family_trains_through_tk_as_accurately_as_eager(standin_tk_build, standin_nvfuser, family):
    jitted = train_and_compare(litgpt, family, "cpu", lambda m: thunder.jit(m, executors=[tk]))
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
