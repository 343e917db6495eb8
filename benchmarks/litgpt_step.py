"""End-to-end LitGPT training step: tokens/s and peak memory for eager PyTorch, torch.compile, Thunder's default
executors and Thunder with executors=[tk], in one run.

Model: LitGPT's Llama-3.2-1B config (fewer layers with --n-layer, stated in the output), bf16 weights, fused
AdamW, fp32 cross-entropy, sequence 2048. Each variant: warm-up steps, then timed steps (CUDA events).

    python benchmarks/litgpt_step.py --n-layer 4 --json out/litgpt_step.json --png out/litgpt_step.png
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bar_chart, print_table, write_results  # noqa: E402

from thunder_tk.pretrain import LossModule  # noqa: E402  (model + fp32 cross-entropy, as pretrain runs it)


def build(model_name: str, n_layer: int | None, seq: int):
    from litgpt import GPT, Config

    cfg = Config.from_name(model_name, **({"n_layer": n_layer} if n_layer else {}))
    with torch.device("cuda"):
        model = GPT(cfg)
        model.max_seq_length = seq
    return model.to(torch.bfloat16), cfg


def variants():
    import thunder

    import thunder_tk

    return {
        "eager": lambda m: m,
        "torch.compile": lambda m: torch.compile(m),
        # Thunder's defaults with the torch.compile fuser standing in for nvFuser (which cannot load here)
        "thunder default": lambda m: thunder.jit(m, executors=thunder_tk.baseline_executors()),
        "thunder [tk]": lambda m: thunder.jit(m, executors=[thunder_tk.tk]),
    }


def run(name, wrap, args):
    torch.manual_seed(0)
    model, cfg = build(args.model, args.n_layer, args.seq)
    net = wrap(LossModule(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(cfg.padded_vocab_size, (args.batch, args.seq), device="cuda")
    y = torch.randint(cfg.padded_vocab_size, (args.batch, args.seq), device="cuda")

    def step():
        loss = net(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        loss = step()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / args.steps
    row = {"variant": name, "tokens_per_s": args.batch * args.seq / ms * 1e3,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": float(loss)}
    if name == "thunder [tk]":
        import thunder_tk

        report = thunder_tk.explain(net)
        row["tk_claimed"] = sorted({r.ran_by for r in report.rows if r.claimed_by_tk})
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Llama-3.2-1B")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--only", nargs="*", help="variant names to run")
    p.add_argument("--json", default="out/litgpt_step.json")
    p.add_argument("--png")
    a = p.parse_args()
    rows = []
    for name, wrap in variants().items():
        if a.only and name not in a.only:
            continue
        rows.append(run(name, wrap, a))
        print(rows[-1], flush=True)
        gc.collect()  # the variant's model and optimizer went out of scope with run()
        torch.cuda.empty_cache()
    base = {r["variant"]: r["tokens_per_s"] for r in rows}
    for r in rows:
        r["vs_thunder_default"] = r["tokens_per_s"] / base["thunder default"] if "thunder default" in base else None
        r["vs_torch_compile"] = r["tokens_per_s"] / base["torch.compile"] if "torch.compile" in base else None
    print(f"{a.model}, {a.n_layer} layers, batch {a.batch} x {a.seq} tokens, bf16, fused AdamW")
    print_table(rows, ["variant", "tokens_per_s", "peak_gib", "vs_thunder_default", "vs_torch_compile"])
    write_results(a.json, "litgpt_step", rows)
    if a.png:
        bar_chart(a.png, f"{a.model} ({a.n_layer} layers) training tokens/s", [r["variant"] for r in rows],
                  {"tokens/s": [r["tokens_per_s"] for r in rows]}, "tokens/s")


if __name__ == "__main__":
    main()
