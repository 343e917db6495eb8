"""Run by tests/test_cuda_graphs.py under torchrun (two gloo ranks): Thunder FSDP of two transformer blocks on CPU,
jitted with executors=[tk] and thunder_tk.CUDAGraphs, against the same without graphs. The graphs are stood in for
(the CPU tensors count as on the GPU, a replay runs the region again into the first run's buffers) and torch's
gloo collectives play tk's, so the plan is the one a GPU run makes of FSDP's real traces. Rank 0 writes, by
variant, the losses, the gradients' norms and the collectives inside and outside the graphs, as JSON to argv[2]."""

import gc
import sys

import thunder
import torch
from thunder.distributed import FSDPType, fsdp

import thunder_tk
from thunder_tk import collectives, cuda_graphs
from models import Block
from trace_counts import collectives_in, waits_before_last
from test_cuda_graphs import cpu_capture
from workers import run_variants

PLAYED = frozenset({"torch_all_gather_prim_impl", "torch_reduce_scatter_prim_impl"})


def stand_in_for_gpu_graphs() -> None:
    cuda_graphs._on_cuda = lambda t: True
    cuda_graphs._TK_COLLECTIVES = PLAYED
    cuda_graphs._TK_REDUCE_SCATTERS = frozenset({"torch_reduce_scatter_prim_impl"})
    cuda_graphs._TORCH_DISTRIBUTED = cuda_graphs._TORCH_DISTRIBUTED - PLAYED - {cuda_graphs._WAIT}
    collectives.graph_replay = lambda device: None
    cuda_graphs._SharedPoolRunner._capture, cuda_graphs._free_storage = cpu_capture()


def run(variant: str) -> dict:
    import os

    if variant.endswith("window"):  # a budget of 4 KiB: each reduce-scatter waited for before the next
        os.environ["THUNDER_TK_REDUCE_SCATTER_INFLIGHT_MB"] = "0.004"
    else:
        os.environ.pop("THUNDER_TK_REDUCE_SCATTER_INFLIGHT_MB", None)
    gc.collect()  # the Parameters earlier variants leave (the graphs' CPU stand-ins keep theirs) are not this one's
    earlier = {id(o) for o in gc.get_objects() if isinstance(o, torch.nn.Parameter)}
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(64, 2), Block(64, 2))
    transforms = [thunder_tk.CUDAGraphs()] if variant.startswith("graphs") else []
    strategy = FSDPType.ZERO3 if variant.endswith("zero3") else FSDPType.ZERO2
    net = fsdp(thunder.jit(model, executors=[thunder_tk.tk], transforms=transforms), device=torch.device("cpu"),
               sharding_strategy=strategy)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    losses = []
    for _ in range(3):
        loss = net(torch.randn(2, 16, 64, generator=g)).pow(2).mean()
        loss.backward()
        losses.append(float(loss))
        grads = {n: float(p.grad.double().norm()) for n, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
    fw, bw = thunder.last_traces(net)[-1], thunder.last_backward_traces(net)[-1]
    # Parameters with memory that are not the FSDP module's (its shards): the unsharded originals, if anything
    # still holds them (the graphs' runner did, a whole model's worth).
    mine = {id(p) for p in net.parameters()}
    gc.collect()
    stray = sum(o.untyped_storage().nbytes() for o in gc.get_objects()
                if isinstance(o, torch.nn.Parameter) and id(o) not in mine | earlier and o.device.type != "meta")
    freed = transforms[0].cuda_graph_runner.freed_saved_bytes if transforms else None
    return {"losses": losses, "grads": grads, "forward": collectives_in(fw, PLAYED),
            "backward": collectives_in(bw, PLAYED), "freed_saved_bytes": freed,
            "early_waits": waits_before_last(bw, "torch_reduce_scatter_prim_impl") if transforms else None,
            "stray_parameter_bytes": stray}


if __name__ == "__main__":
    stand_in_for_gpu_graphs()
    run_variants(run, sys.argv[1], sys.argv[2])
