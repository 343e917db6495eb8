"""tk's fused cross-entropy vs PyTorch (eager and torch.compile), forward + backward of a language model's loss, in
one run.

Each variant computes mean cross-entropy over (tokens, vocabulary) logits in the model dtype (bf16) and its
gradient with respect to the logits:
  tk:            ops.cross_entropy_forward / _backward (fp32 math, reads the bf16 logits directly)
  eager:         F.cross_entropy(logits, target) on bf16 logits
  eager fp32:    F.cross_entropy(logits.float(), target), the upcast many training scripts write
  torch.compile: the eager bf16 function compiled
Memory traffic floor: forward reads the logits once, backward reads them and writes their gradient (3 x logits
bytes); GB/s below counts those bytes over the measured time, so 3.35 TB/s (H100 HBM3) is the roof.

    python benchmarks/cross_entropy.py --json out/cross_entropy.json --png out/cross_entropy.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import bar_chart, geomean, interleaved_ms, print_table, write_results  # noqa: E402

from thunder_tk import ops  # noqa: E402

# (tokens, vocabulary): Llama-3 (128256), Llama-2 (32000), GPT-2 (50257), at 8192 and 16384 tokens
PROBLEMS = [(8192, 128256), (8192, 32000), (16384, 50257), (4096, 128256)]


def tk_step(logits, target):
    rows, lse = ops.cross_entropy_forward(logits, target)
    loss = rows.sum() / rows.shape[0]
    grad_rows = torch.full_like(rows, 1.0 / rows.shape[0])
    return loss, ops.cross_entropy_backward(logits, target, lse, grad_rows)


def torch_step(fn):
    def step(logits, target):
        x = logits.detach().requires_grad_()
        loss = fn(x, target)
        loss.backward()
        return loss, x.grad

    return step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default="out/cross_entropy.json")
    p.add_argument("--png")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="the first problem only")
    p.add_argument("--part-bytes", type=int, nargs="*", default=[],
                   help="also time the forward+grad kernel with rows split in parts of at most these many bytes "
                        "(> 0); tk_fwd_grad is the default split, 64 KB parts")
    a = p.parse_args()
    if any(b <= 0 for b in a.part_bytes):  # before any timing: old command lines passed 0
        p.error(f"--part-bytes: sizes must be > 0 (0 timed the one-block-a-row kernel, now removed); "
                f"got {a.part_bytes}")

    bf16_loss = lambda x, t: F.cross_entropy(x, t)  # noqa: E731
    def tk_fwd_grad(part_bytes=None):
        def step(logits, target):  # the incoming gradient would scale the GEMMs that read grad
            rows, _, grad = ops.cross_entropy_forward_grad(logits, target, _part_bytes=part_bytes)
            return rows.sum() / rows.shape[0], grad
        return step

    variants = {
        "tk": tk_step,
        "tk_fwd_grad": tk_fwd_grad(),
        **{f"tk_fwd_grad_part{b}": tk_fwd_grad(b) for b in a.part_bytes},
        "eager": torch_step(bf16_loss),
        "eager_fp32": torch_step(lambda x, t: F.cross_entropy(x.float(), t)),
        "compile": torch_step(torch.compile(bf16_loss)),
    }
    rows = []
    for tokens, vocab in PROBLEMS[:1] if a.quick else PROBLEMS:
        torch.manual_seed(0)
        logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16) * 4
        target = torch.randint(vocab, (tokens,), device="cuda")
        # correctness against fp64 before timing
        ref_x = logits.double().requires_grad_()
        ref_loss = F.cross_entropy(ref_x, target)
        ref_loss.backward()
        loss, grad = tk_step(logits, target)
        loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        grad_err = ((grad.double() - ref_x.grad).norm() / ref_x.grad.norm()).item()
        assert loss_err < 1e-5 and grad_err < 1e-2, (loss_err, grad_err)
        for name in ("tk_fwd_grad", *(f"tk_fwd_grad_part{b}" for b in a.part_bytes)):  # unscaled: times 1/tokens
            loss, grad = variants[name](logits, target)
            fg_loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
            fg_grad_err = ((grad.double() / tokens - ref_x.grad).norm() / ref_x.grad.norm()).item()
            assert fg_loss_err < 1e-5 and fg_grad_err < 1e-2, (name, fg_loss_err, fg_grad_err)
        del ref_x, ref_loss, loss, grad
        torch.cuda.empty_cache()
        ms = interleaved_ms({name: (lambda fn=fn: fn(logits, target)) for name, fn in variants.items()},
                            rounds=a.rounds)
        traffic = 3 * logits.numel() * logits.element_size()
        row = {"problem": f"{tokens}x{vocab}", "tokens": tokens, "vocab": vocab, "loss_rel_err": loss_err,
               "grad_rel_err": grad_err}
        for name, t in ms.items():
            row[f"{name}_ms"] = t
        row["tk_gbps"] = traffic / ms["tk"] / 1e6
        for name in ("eager", "eager_fp32", "compile"):
            row[f"vs_{name}"] = ms[name] / ms["tk"]
        rows.append(row)
        row["tk_fwd_grad_gbps"] = (2 * logits.numel() * logits.element_size()) / ms["tk_fwd_grad"] / 1e6
        for b in a.part_bytes:
            row[f"tk_fwd_grad_vs_part{b}"] = ms[f"tk_fwd_grad_part{b}"] / ms["tk_fwd_grad"]
        parts = "".join(f"; part {b}: {ms[f'tk_fwd_grad_part{b}']:.3f}" for b in a.part_bytes)
        print(f"{row['problem']:>13}: tk {ms['tk']:.3f} ms ({row['tk_gbps']:.0f} GB/s)  tk forward+grad "
              f"{ms['tk_fwd_grad']:.3f} ({row['tk_fwd_grad_gbps']:.0f} GB/s{parts})  eager {ms['eager']:.3f}  "
              f"eager fp32 {ms['eager_fp32']:.3f}  torch.compile {ms['compile']:.3f}", flush=True)
        del logits, target
        torch.cuda.empty_cache()
    print_table(rows, ["problem", "tk_ms", "tk_gbps", "tk_fwd_grad_ms", "tk_fwd_grad_gbps",
                       *[f"tk_fwd_grad_vs_part{b}" for b in a.part_bytes], "eager_ms", "eager_fp32_ms",
                       "compile_ms", "vs_eager", "vs_eager_fp32", "vs_compile"])
    for name in ("eager", "eager_fp32", "compile"):
        g = geomean(r[f"vs_{name}"] for r in rows)
        print(f"tk speed-up over {name}: geometric mean {g:.2f}x")
    print(f"wrote {write_results(a.json, 'cross_entropy', rows)}")
    if a.png:
        bar_chart(a.png, "cross-entropy forward + backward, bf16 logits (ms, lower is better)",
                  [r["problem"] for r in rows],
                  {name: [r[f"{name}_ms"] for r in rows] for name in variants}, "ms")


if __name__ == "__main__":
    main()
