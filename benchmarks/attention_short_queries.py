"""tk attention forward against torch SDPA's backends where the queries are few and the keys many (decoding and
chunked prefill: Sq from 1 to a few hundred against Sk in the thousands, no mask), bf16, in one run.

The FlashAttention-3 protocol (benchmarks/attention.py) has Sq = Sk. Here a forward reads all of K and V for few
queries, so its time is set by how fast it streams K and V from memory: the table gives each library's effective
bandwidth (bytes of q, k, v and o over the time) and tk's speed ratio to the fastest peer.

    python benchmarks/attention_short_queries.py --json out/attention_short_queries.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attention import PEERS, rel_err, sdpa_peers  # noqa: E402
from common import graphed, interleaved_ms, print_table, write_results  # noqa: E402

SQ = (1, 4, 16, 64, 128, 512)
SK = (1024, 4096, 16384)
EXTRA_PEERS = {"efficient": "EFFICIENT_ATTENTION"}
TOL = 2e-2


def points(sq, sk, batch, heads, kv_heads, head_dim):
    for k_len in sk:
        for q_len in sq:
            yield batch, heads, kv_heads, q_len, k_len, head_dim


def bytes_moved(B, Hq, Hkv, Sq, Sk, D) -> int:
    return 2 * (2 * B * Hq * Sq * D + 2 * B * Hkv * Sk * D)  # q and o, k and v, 16-bit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="out/attention_short_queries.json")
    p.add_argument("--q-lens", type=int, nargs="+", default=list(SQ))
    p.add_argument("--k-lens", type=int, nargs="+", default=list(SK))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (grouped-query attention)")
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--graphs", action="store_true", help="time CUDA graphs of each call (no host launch path)")
    a = p.parse_args()
    if a.heads % a.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    from torch.nn.attention import SDPBackend

    from thunder_tk import ops

    backends = {name: getattr(SDPBackend, member) for name, member in {**PEERS, **EXTRA_PEERS}.items()}
    rows = []
    for B, Hq, Hkv, Sq, Sk, D in points(a.q_lens, a.k_lens, a.batch, a.heads, a.kv_heads, a.head_dim):
        q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        # SDPA's backends take the key/value heads expanded (torch 2.11 has enable_gqa, not every backend does).
        ke, ve = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (k, v))
        notes = []
        peers, ref, _ = sdpa_peers(backends, q, ke, ve, False, notes)
        fns = {"tk": lambda: ops.attention_forward(q, k, v), **peers}
        o, _ = ops.attention_forward(q, k, v)
        err = rel_err(o, ref) if ref is not None else None
        assert err is None or err < TOL, f"tk wrong at Sq={Sq} Sk={Sk}: rel err {err}"
        if a.graphs:
            fns = {name: graphed(fn) for name, fn in fns.items()}
        ms = interleaved_ms(fns, rounds=a.rounds)
        moved = bytes_moved(B, Hq, Hkv, Sq, Sk, D)
        peers = [n for n in ms if n != "tk"]
        best = min(peers, key=ms.get) if peers else None
        row = {"B": B, "Hq": Hq, "Hkv": Hkv, "Sq": Sq, "Sk": Sk, "D": D, "err": err, "notes": "; ".join(notes),
               "best_peer": best, "vs_best": ms[best] / ms["tk"] if best else None,
               "timing": "graph" if a.graphs else "eager"}
        for name in ("tk", *backends):
            row[f"{name}_us"] = ms[name] * 1e3 if name in ms else None
            row[f"{name}_gbs"] = moved / ms[name] / 1e6 if name in ms else None
        rows.append(row)
        print(f"Sq={Sq:>5} Sk={Sk:>6}: " + "  ".join(f"{n} {ms[n] * 1e3:8.1f} us" for n in ms)
              + (f"  tk/{best} {row['vs_best']:.2f}" if best else ""), flush=True)
        del q, k, v, ke, ve, o, ref
    print_table(rows, ["Sq", "Sk", "tk_us", "cudnn_us", "flash_us", "efficient_us", "tk_gbs", "best_peer", "vs_best"])
    print(f"wrote {write_results(a.json, 'attention_short_queries', rows)}")


if __name__ == "__main__":
    main()
