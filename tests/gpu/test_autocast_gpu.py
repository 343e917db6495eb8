"""bf16-mixed training (fp32 weights, the forward under bf16 autocast) with every backward op outside tk's kernels:
Thunder's default executors (its SDPA backward, cuBLAS GEMMs, the torch.compile fuser), tk with its attention
declined, and tk with its GEMM size policy sending the small products to cuBLAS. Thunder 0.2.6's `no_autocast`
turned autocast back on (float16, the autograd thread's default) after each fusion region of the backward, so these
failed ("query and dout must have the same dtype") or ran GEMMs in float16; thunder_tk.thunder_fixes replaces it.
Each step's output and gradients must be as accurate as eager's under the same autocast."""

import pytest

import thunder
import thunder_tk
from litgpt_training import step_as_accurately_as_eager

pytestmark = pytest.mark.gpu


@pytest.fixture
def litgpt():
    return pytest.importorskip("litgpt")


def test_thunder_default_executors_train_at_bf16_mixed(litgpt):
    jitted, _ = step_as_accurately_as_eager(litgpt, mixed=True, executors=thunder_tk.baseline_executors())
    names = [b.sym.name for b in thunder.last_backward_traces(jitted)[-1].bound_symbols]
    assert any("scaled_dot_product" in n for n in names), names  # Thunder's own SDPA backward ran


def test_tk_with_its_attention_declined_trains_at_bf16_mixed(litgpt):
    jitted, _ = step_as_accurately_as_eager(litgpt, mixed=True, tk_disable="attention")
    rows = [r for r in thunder_tk.explain(jitted).rows if r.symbol == "ltorch.scaled_dot_product_attention"]
    assert rows and not any(r.claimed_by_tk for r in rows)


@pytest.mark.gemm_size_policy  # the suite turns the policy off (tests/conftest.py); this test needs it on
def test_tk_with_cublas_for_small_products_trains_at_bf16_mixed(litgpt):
    """The test model's products are small (600 tokens against 512- to 1024-wide weights, 10-20 output tiles): the
    size policy leaves them to cuBLAS, which run between regions."""
    jitted, _ = step_as_accurately_as_eager(litgpt, mixed=True)
    names = [b.sym.name for b in thunder.last_backward_traces(jitted)[-1].bound_symbols]
    assert "matmul" in names, sorted(set(names))
