"""The collectives' block schedule and flag protocol (csrc/kernels/collectives/p2p.cu), played out on the CPU for
2..16 ranks, paired and unpaired, over many calls of mixed sizes on one channel.

The kernels have run on 2 and 4 GPUs only. This plays the same schedule with every block's sending and receiving
team as a coroutine and a random interleaving, for the rank counts no host here has. It checks that every unit of
every rank's message reaches every output once, with the right data, that reduce-scatter sums all ranks' parts in
rank order, that no cell is overwritten before it is drained, and that no call deadlocks. It mirrors the kernel's
index arithmetic (to/from, lanes, turns, slots, sequence numbers); a change there should be made in both.
"""

import random

import pytest


class Channel:
    """Every rank's flags, cells and per-block sequence numbers, persistent across calls like the kernel's."""

    def __init__(self, world: int, blocks: int, slots: int, pairs: bool):
        self.world, self.blocks, self.slots, self.pairs = world, blocks, slots, pairs and world >= 3
        self.peers = world - 1
        self.ready = {}     # (receiver, block, slot, src) -> value
        self.consumed = {}  # (sender, block, slot, dst) -> value
        self.cells = {}     # (receiver, block, slot, src) -> payload (the pairs layout ignores src)
        self.seq = {}       # (rank, block) -> units done

    def grid(self, units: int) -> int:
        per_lane = self.peers if self.pairs else 1
        return max(1, min(units, self.blocks // per_lane)) * per_lane

    def cell_key(self, receiver, block, slot, src):
        return (receiver, block, slot, None if self.pairs else src)


def block_state(ch: Channel, me: int, b: int, grid: int):
    P, W = ch.peers, ch.world
    if ch.pairs:
        d0, npeers, lane, lanes = 1 + b % P, 1, b // P, grid // P
    else:
        d0, npeers, lane, lanes = 1, P, b, grid
    return dict(me=me, b=b, d0=d0, npeers=npeers, lane=lane, lanes=lanes, seq0=ch.seq.get((me, b), 0),
                to=[(me + d0 + i) % W for i in range(npeers)], frm=[(me + W - d0 - i) % W for i in range(npeers)])


def play(ch: Channel, op: str, units: int, rng: random.Random) -> dict:
    """One call of `op` with `units` units per rank; returns what each rank's output received per unit."""
    W, P, grid = ch.world, ch.peers, ch.grid(units)
    out = {}  # all_gather: (rank, src, unit) -> payload; reduce_scatter: (rank, unit) -> tuple of summed parts

    def my_turn(s, k):
        return not ch.pairs or k % P == s["d0"] - 1

    def sibling(s, d):
        return s["lane"] * P + d - 1 if ch.pairs else s["b"]

    def mine(s):
        return -(-(units - s["lane"]) // s["lanes"]) if units > s["lane"] else 0

    def sender(s):
        for k in range(mine(s)):
            slot, value, unit = (s["seq0"] + k) % ch.slots, s["seq0"] + k + 1, s["lane"] + k * s["lanes"]
            if value > ch.slots:
                for p in s["to"]:
                    yield lambda p=p: ch.consumed.get((s["me"], s["b"], slot, p), 0) >= value - ch.slots
            if op == "all_gather" and my_turn(s, k):
                key = (s["me"], s["me"], unit)
                assert key not in out, f"own part {key} copied twice"
                out[key] = (s["me"], unit)
            for p in s["to"]:
                key = ch.cell_key(p, s["b"], slot, s["me"])
                assert ch.cells.get(key, (None,))[0] is None, f"cell {key} overwritten before it was drained"
                # all-gather sends its own unit; reduce-scatter the part of the receiver's slice
                ch.cells[key] = (s["me"], unit) if op == "all_gather" else (s["me"], p, unit)
            for p in s["to"]:
                ch.ready[(p, s["b"], slot, s["me"])] = value

    def receiver(s):
        for k in range(mine(s)):
            slot, value, unit = (s["seq0"] + k) % ch.slots, s["seq0"] + k + 1, s["lane"] + k * s["lanes"]
            if op == "all_gather" or not ch.pairs:
                inbox = [(s["b"], src) for src in s["frm"]]
            elif my_turn(s, k):
                inbox = [(sibling(s, d), (s["me"] + W - d) % W) for d in range(1, W)]
            else:
                continue
            for blk, src in inbox:
                yield lambda blk=blk, src=src: ch.ready.get((s["me"], blk, slot, src), 0) >= value
                assert ch.ready[(s["me"], blk, slot, src)] == value, "out of step"
            parts = []
            for blk, src in inbox:
                key = ch.cell_key(s["me"], blk, slot, src)
                payload = ch.cells[key]
                assert payload[0] == src, f"cell {key} holds rank {payload[0]}'s data, expected rank {src}'s"
                parts.append(payload)
                ch.cells[key] = (None,)
            if op == "all_gather":
                for src, u in parts:
                    assert u == unit
                    key = (s["me"], src, unit)
                    assert key not in out, f"{key} received twice"
                    out[key] = (src, u)
            else:
                assert all(dst == s["me"] and u == unit for _, dst, u in parts)
                key = (s["me"], unit)
                assert key not in out, f"unit {key} summed twice"
                out[key] = tuple(sorted([src for src, _, _ in parts] + [s["me"]]))  # rank order
            for blk, src in inbox:
                ch.consumed[(src, blk, slot, s["me"])] = value

    agents, states = [], []
    for r in range(W):
        for b in range(grid):
            s = block_state(ch, r, b, grid)
            states.append(s)
            agents += [sender(s), receiver(s)]
    waiting = {i: None for i in range(len(agents))}  # agent -> condition it waits for (None: runnable)
    while waiting:
        # A random runnable team steps next: a few random probes, then (all of them waiting) a full scan.
        ids = list(waiting)
        probes = [rng.choice(ids) for _ in range(4)]
        i = next((j for j in probes if waiting[j] is None or waiting[j]()), None)
        if i is None:
            runnable = [j for j in ids if waiting[j] is None or waiting[j]()]
            assert runnable, f"deadlock: {len(waiting)} teams wait ({op}, {units} units, {W} ranks, grid {grid})"
            i = rng.choice(runnable)
        try:
            waiting[i] = next(agents[i])
        except StopIteration:
            del waiting[i]
    for s in states:
        ch.seq[(s["me"], s["b"])] = s["seq0"] + mine(s)
    return out


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("pairs", [False, True])
def test_every_unit_arrives_once_over_many_calls(world, pairs):
    rng = random.Random(world * 2 + pairs)
    for blocks, slots in ((2 * world + 1, 2), (world - 1 if world > 2 else 1, 3), (20, 4)):
        ch = Channel(world, blocks, slots, pairs)
        for _ in range(6):
            op, units = rng.choice(["all_gather", "reduce_scatter"]), rng.choice([1, 2, 5, 17, 40])
            out = play(ch, op, units, rng)
            if op == "all_gather":
                assert out == {(r, src, u): (src, u) for r in range(world) for src in range(world)
                               for u in range(units)}
            else:
                assert out == {(r, u): tuple(range(world)) for r in range(world) for u in range(units)}
        # Siblings of a lane keep equal sequence numbers, so they agree on every unit's slot.
        if ch.pairs:
            for r in range(world):
                for lane in range(blocks // ch.peers):
                    assert len({ch.seq.get((r, lane * ch.peers + j), 0) for j in range(ch.peers)}) == 1


def test_pairs_use_whole_lanes():
    ch = Channel(8, 128, 4, True)
    assert ch.grid(1) == 7 and ch.grid(10) == 70 and ch.grid(10 ** 6) == 126  # 18 lanes of 7 blocks
    assert Channel(2, 128, 4, True).pairs is False  # two ranks: every block already has one peer
