"""Run by tests/test_fsdp_schedule.py under torchrun (two gloo ranks): a 3-layer LitGPT model under Thunder FSDP,
jitted with the executors each of argv[1]'s comma-separated variants names ("tk", "tk-fused-order": tk with the
schedule off, "default"; a name with "zero3" in it shards with ZeRO-3). Rank 0 writes, by variant, where the
collectives and waits sit in the traces that run, the loss and the gradients' norms, as JSON to argv[2]."""

import sys

import thunder
import torch
from litgpt import GPT, Config
from thunder.distributed import FSDPType, fsdp

from thunder_tk.pretrain import LossModule, resolve_executors
from trace_counts import traces_not_python
from workers import run_variants


def positions(trace, pattern: str) -> list[int]:
    return [i for i, b in enumerate(trace.bound_symbols) if pattern in b.sym.name]


def first_gemm(trace) -> int:
    return min(i for i, b in enumerate(trace.bound_symbols) if b.sym.name in ("linear", "matmul", "tk_linear",
                                                                                "tk_matmul"))


def last_gemm(trace) -> int:
    return max(i for i, b in enumerate(trace.bound_symbols) if b.sym.name in ("linear", "matmul", "tk_linear",
                                                                                "tk_matmul"))


def run(variant: str) -> dict:
    torch.manual_seed(0)
    cfg = Config(name="s", block_size=64, vocab_size=128, padded_vocab_size=128, n_layer=3, n_head=2,
                 n_query_groups=2, n_embd=64, head_size=32, bias=False, norm_class_name="RMSNorm",
                 mlp_class_name="LLaMAMLP", intermediate_size=128, rotary_percentage=1.0, parallel_residual=False)
    model = GPT(cfg)
    model.max_seq_length = 64
    options = {"tk_disable": "collective_schedule"} if variant.endswith("fused-order") else {}
    names = ["default"] if variant == "default" else ["tk"]
    strategy = FSDPType.ZERO3 if "zero3" in variant else FSDPType.ZERO2
    net = fsdp(thunder.jit(LossModule(model), executors=resolve_executors(names), **options),
               device=torch.device("cpu"), sharding_strategy=strategy)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (2, 64), generator=g)
    y = torch.randint(0, 128, (2, 64), generator=g)
    loss = net(x, y)
    loss.backward()
    grads = {n: float(p.grad.double().norm()) for n, p in net.named_parameters()}
    fw, bw = thunder.last_traces(net)[-1], thunder.last_backward_traces(net)[-1]
    gathers = [b.args[0].name for b in fw.bound_symbols if "all_gather" in b.sym.name]
    return {
        "loss": float(loss), "grads": grads, "gathers": gathers,
        "forward_waits": positions(fw, "wait"), "forward_first_gemm": first_gemm(fw),
        "backward_reduce_scatters": positions(bw, "reduce_scatter"), "backward_last_gemm": last_gemm(bw),
        "backward_waits": positions(bw, "wait"),
        "backward_gathers": [(i, b.args[0].name) for i, b in enumerate(bw.bound_symbols) if "all_gather" in b.sym.name],
        "traces_not_python": traces_not_python(thunder.last_traces(net) + thunder.last_backward_traces(net)),
    }


if __name__ == "__main__":
    run_variants(run, sys.argv[1], sys.argv[2])
