"""LitGPT's model families (tests/litgpt_families.py) trained through tk's real kernels on an sm_90 GPU: each
family's folds run where its structure allows, every gradient as accurate as eager bf16's (the CPU test checks the
same with stand-ins); a sequence of 300 leaves a tail in every tile. The elementwise regions run eagerly (the
`standin_nvfuser` fixture), not compiled by inductor: the kernels and folds are what differ between families, and
compiling each family's regions took 30 s a family (tests/gpu/test_attention_training_gpu.py and
test_pretrain_gpu.py train with the real fuser)."""

import pytest
import thunder

from litgpt_families import FAMILIES, ids, jit_tk, tk_ops, train_and_compare, train_steps_and_compare
from thunder_tk import tk

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", FAMILIES, ids=ids)
def test_family_trains_on_tk_kernels_as_accurately_as_eager(standin_nvfuser, family):
    litgpt = pytest.importorskip("litgpt")
    jitted = train_and_compare(litgpt, family, "cuda", lambda m: thunder.jit(m, executors=[tk]), seq=300)
    ran = tk_ops(jitted)
    assert family.claimed <= ran, (family.name, sorted(family.claimed - ran))
    assert not family.absent & ran, (family.name, sorted(family.absent & ran))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.name in ("Llama-3.2-1B", "Gemma-3-1b-it")], ids=ids)
def test_family_trains_for_steps_on_tk_kernels_as_accurately_as_eager(standin_nvfuser, family):
    """Eight AdamW steps on the kernels (Gemma 3: a window, heads of 256, one KV head; its mask built in a few ops):
    the loss stays as close to float64 training as eager bf16's, so nothing builds up from step to step (a kernel's
    state carried between launches, a biased gradient)."""
    litgpt = pytest.importorskip("litgpt")
    jitted, _ = train_steps_and_compare(litgpt, family, "cuda", jit_tk, seq=300)
    assert "tk_attention_forward" in tk_ops(jitted)
