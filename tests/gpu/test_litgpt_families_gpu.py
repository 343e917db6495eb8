"""LitGPT's model families (tests/litgpt_families.py) trained through tk's real kernels on an sm_90 GPU: each
family's folds run where its structure allows, every gradient as accurate as eager bf16's (the CPU test checks the
same with stand-ins); a sequence of 300 leaves a tail in every tile. The elementwise regions run eagerly (the
`standin_nvfuser` fixture), not compiled by inductor: the kernels and folds are what differ between families, and
compiling each family's regions took 30 s a family (tests/gpu/test_attention_training_gpu.py and
test_pretrain_gpu.py train with the real fuser)."""

import pytest
import thunder

from litgpt_families import FAMILIES, ids, tk_ops, train_and_compare
from thunder_tk import tk

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", FAMILIES, ids=ids)
def test_family_trains_on_tk_kernels_as_accurately_as_eager(standin_nvfuser, family):
    litgpt = pytest.importorskip("litgpt")
    jitted = train_and_compare(litgpt, family, "cuda", lambda m: thunder.jit(m, executors=[tk]), seq=300)
    ran = tk_ops(jitted)
    assert family.claimed <= ran, (family.name, sorted(family.claimed - ran))
    assert not family.absent & ran, (family.name, sorted(family.absent & ran))
