"""Run by tests/test_rms_norm_fsdp.py under torchrun (two gloo ranks): a 3-layer LitGPT model in bf16 under Thunder
FSDP (each of argv[1]'s comma-separated variants: "zero2" or "zero3", "-off" appended for tk_disable="rms_norm"),
jitted with tk and the stand-in build
(tk's kernels in float64 math on CPU tensors), so that fold_rms_norm meets the all-gathered weights and the
reduce-scattered weight gradients. Rank 0 writes, by variant, the loss, the gradients' norms and the norms folded as
JSON to argv[2]."""

import sys

import thunder
import torch
from _pytest.monkeypatch import MonkeyPatch
from litgpt import GPT, Config
from thunder.distributed import FSDPType, fsdp
from thunder.extend import register_executor

from standins import EagerRegionFuser, StandinBuild
from thunder_tk import claim_rules, tk
from workers import run_variants


def run(variant: str) -> dict:
    torch.manual_seed(0)
    cfg = Config(name="s", block_size=64, vocab_size=128, padded_vocab_size=128, n_layer=3, n_head=2,
                 n_query_groups=2, n_embd=64, head_size=32, bias=False, norm_class_name="RMSNorm",
                 mlp_class_name="LLaMAMLP", intermediate_size=128, rotary_percentage=1.0, parallel_residual=False)
    model = GPT(cfg).to(torch.bfloat16)
    for p in model.parameters():
        if p.ndim == 1:  # norm weights away from 1
            p.data = (1 + 0.2 * torch.randn_like(p.float())).to(p.dtype)
    model.max_seq_length = 64
    options = {"tk_disable": "rms_norm"} if variant.endswith("-off") else {}
    strategy = FSDPType.ZERO3 if variant.startswith("zero3") else FSDPType.ZERO2
    net = fsdp(thunder.jit(model, executors=[tk], **options), device=torch.device("cpu"), sharding_strategy=strategy)
    x = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    loss = net(x).float().square().mean()
    loss.backward()
    fw, bw = str(thunder.last_traces(net)[-1]), str(thunder.last_backward_traces(net)[-1])
    return {"loss": float(loss), "grads": {n: float(p.grad.double().norm()) for n, p in net.named_parameters()},
            "forward_norms": fw.count("tk_rms_norm(") + fw.count("tk_add_rms_norm("),
            "backward_norms": bw.count("tk_rms_norm_backward(")}


if __name__ == "__main__":
    patch = MonkeyPatch()
    StandinBuild(patch)
    patch.setattr(claim_rules, "gemm_size_policy_default", False)
    register_executor(EagerRegionFuser("nvfuser"))
    run_variants(run, sys.argv[1], sys.argv[2])
