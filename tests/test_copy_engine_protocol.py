"""The copy-engine collectives' protocol (csrc/kernels/collectives/copy_engine.cu), played out on the CPU for
2..16 ranks over many calls of mixed sizes on one channel.

The path has run on 2 and 4 GPUs only. Here each rank's streams (staging, summing, one per peer) are queues of the
operations copy_engine.cu enqueues, in its order: copies, stream waits on a flag word (wrap-around >=), flag
writes into a peer, sums. A random scheduler runs whichever stream's next operation may run. It checks that every
chunk of every message reaches its output with the right data (all-gather), that every sum sees all ranks' parts
of the right chunk (reduce-scatter), that no staging slot is rewritten while a reader still needs it, and that no
call deadlocks. It mirrors the C++ index arithmetic (chunk_size, slots, sequence numbers, regions); a change
there should be made in both.
"""

import random
from collections import deque

import pytest

MIN_CHUNKS, MIN_CHUNK_BYTES = 4, 2 << 20


def chunk_size(nbytes: int, slot_bytes: int, elem: int) -> int:
    c = max(MIN_CHUNK_BYTES, -(-nbytes // MIN_CHUNKS))
    c = min(slot_bytes, -(-c // 256) * 256)
    return max(elem, c // elem * elem)


def geq(word: int, value: int) -> bool:
    """cuStreamWaitValue32's GEQ: (int32_t)(*addr - value) >= 0."""
    d = (word - value) & 0xFFFFFFFF
    return d < 0x80000000


class Model:
    """Every rank's flag words, staging contents and streams, persistent across calls like the channel's."""

    def __init__(self, world: int, slots: int, gather_slot: int, scatter_slot: int, start: int = 0):
        self.W, self.S = world, slots
        self.gather_slot, self.scatter_slot = gather_slot, scatter_slot
        self.flags = {}      # (rank, kind, source, slot) -> uint32 word
        self.stage = {}      # (rank, slot) -> (owner, chunk): all-gather
        self.region = {}     # (receiver, sender, slot) -> (sender, chunk): reduce-scatter
        self.readers = {}    # (rank, slot) -> peers yet to pull the chunk staged there
        self.gathered = self.scattered = start  # chunk counters (start: to test far-along counts)
        self.streams = {(r, s): [] for r in range(world) for s in ["stage", "reduce", *range(world)]}
        # A channel `start` chunks along: every word holds the last sequence number its slot carried, every slot
        # has been read or summed.
        for slot in range(slots):
            last = max((k for k in range(max(0, start - slots), start) if k % slots == slot), default=None)
            if last is None:
                continue
            for r in range(world):
                self.stage[(r, slot)] = (r, last)
                for src in range(world):
                    if src != r:
                        for kind in ("ag_ready", "ag_done", "rs_ready", "rs_done"):
                            self.flags[(r, kind, src, slot)] = (last + 1) & 0xFFFFFFFF
                        self.region[(r, src, slot)] = (src, "summed")

    # -- what copy_engine.cu enqueues ----------------------------------------------------------------

    def all_gather(self, nbytes: int, out: dict, call: int) -> None:
        W, S = self.W, self.S
        C = chunk_size(nbytes, self.gather_slot, 1)
        chunks = -(-nbytes // C)
        for r in range(W):
            q = self.streams
            for i in range(chunks):
                k = self.gathered + i
                slot, seq = k % S, (k + 1) & 0xFFFFFFFF
                if k >= S:
                    for p in range(W):
                        if p != r:
                            q[(r, "stage")].append(("wait", r, "ag_done", p, slot, (k + 1 - S) & 0xFFFFFFFF))
                q[(r, "stage")].append(("stage", r, slot, k))
                for p in range(W):
                    if p != r:
                        q[(r, "stage")].append(("signal", p, "ag_ready", r, slot, seq))
                for p in range(W):
                    if p == r:
                        continue
                    q[(r, p)].append(("wait", r, "ag_ready", p, slot, seq))
                    q[(r, p)].append(("pull", r, p, slot, k, out, (call, i)))
                    q[(r, p)].append(("signal", p, "ag_done", r, slot, seq))
        self.gathered += chunks

    def reduce_scatter(self, nelems: int, es: int, out: dict, call: int) -> None:
        W, S = self.W, self.S
        C = chunk_size(nelems * es, self.scatter_slot, es) // es
        chunks = -(-nelems // C)
        for r in range(W):
            q = self.streams
            for i in range(chunks):
                k = self.scattered + i
                slot, seq = k % S, (k + 1) & 0xFFFFFFFF
                for p in range(W):
                    if p == r:
                        continue
                    if k >= S:
                        q[(r, p)].append(("wait", r, "rs_done", p, slot, (k + 1 - S) & 0xFFFFFFFF))
                    q[(r, p)].append(("push", r, p, slot, k))
                    q[(r, p)].append(("signal", p, "rs_ready", r, slot, seq))
                for p in range(W):
                    if p != r:
                        q[(r, "reduce")].append(("wait", r, "rs_ready", p, slot, seq))
                q[(r, "reduce")].append(("sum", r, slot, k, out, (call, i)))
                for p in range(W):
                    if p != r:
                        q[(r, "reduce")].append(("signal", p, "rs_done", r, slot, seq))
        self.scattered += chunks

    # -- running the streams --------------------------------------------------------------------------

    def runnable(self, op) -> bool:
        if op[0] == "wait":
            _, r, kind, src, slot, value = op
            return geq(self.flags.get((r, kind, src, slot), 0), value)
        return True

    def execute(self, op) -> None:
        kind = op[0]
        if kind == "wait":  # it could run: the flag had reached its value
            return
        if kind == "signal":
            _, to, flag, src, slot, value = op
            self.flags[(to, flag, src, slot)] = value
        elif kind == "stage":
            _, r, slot, k = op
            left = self.readers.get((r, slot))
            assert not left, f"rank {r} restaged slot {slot} for chunk {k} while ranks {sorted(left)} had not read it"
            self.stage[(r, slot)] = (r, k)
            self.readers[(r, slot)] = set(range(self.W)) - {r}
        elif kind == "pull":
            _, r, p, slot, k, out, where = op
            assert self.stage.get((p, slot)) == (p, k), (
                f"rank {r} pulled {self.stage.get((p, slot))} from rank {p}'s slot {slot}, wanted chunk {k}")
            self.readers[(p, slot)].discard(r)
            out.setdefault((r, p), []).append(where)
        elif kind == "push":
            _, r, p, slot, k = op
            prev = self.region.get((p, r, slot))
            assert prev is None or prev[1] == "summed", (
                f"rank {r} overwrote its part of chunk {prev} in rank {p}'s slot {slot} before it was summed")
            self.region[(p, r, slot)] = (r, k)
        elif kind == "sum":
            _, r, slot, k, out, where = op
            for p in range(self.W):
                if p != r:
                    got = self.region.get((r, p, slot))
                    assert got == (p, k), f"rank {r} summed {got} from rank {p} in slot {slot}, wanted chunk {k}"
                    self.region[(r, p, slot)] = (p, "summed")
            out.setdefault(r, []).append(where)
        else:
            raise AssertionError(op)

    def drain(self, rng: random.Random) -> None:
        """Run every stream to its end: a random ready stream at a time, for a random burst of its operations."""
        queues = {key: deque(q) for key, q in self.streams.items() if q}
        while queues:
            ready = [key for key, q in queues.items() if self.runnable(q[0])]
            assert ready, f"deadlock: { {key: q[0][:5] for key, q in queues.items()} }"
            key = rng.choice(ready)
            q = queues[key]
            for _ in range(rng.randint(1, 6)):
                self.execute(q.popleft())
                if not q or not self.runnable(q[0]):
                    break
            if not q:
                del queues[key]
        for q in self.streams.values():
            q.clear()


@pytest.mark.parametrize("world, slots", [(2, 2), (2, 3), (2, 4), (3, 2), (3, 4), (4, 2), (4, 3), (4, 4), (8, 2),
                                           (8, 4), (16, 2)])
def test_every_chunk_arrives_and_no_slot_is_reused_early(world, slots):
    rng = random.Random(world * 100 + slots)
    # Small slots: messages of many chunks. A counter far along checks the wrap-around compares of 32-bit flags.
    m = Model(world, slots, gather_slot=1 << 20, scatter_slot=1 << 19, start=(1 << 32) - 7 * slots)
    for call in range(10 if world <= 4 else 4):
        queued = rng.randint(1, 3)  # calls enqueued before any runs, as the host does
        expected = []
        for j in range(queued):
            if rng.random() < 0.5:
                nbytes = rng.choice([16, 4096, 3 << 20, (5 << 20) + 5])
                out: dict = {}
                chunks = -(-nbytes // chunk_size(nbytes, m.gather_slot, 1))
                m.all_gather(nbytes, out, (call, j))
                expected.append(("ag", out, chunks, (call, j)))
            else:
                es = rng.choice([2, 4])
                nelems = rng.choice([1, 1000, (3 << 20) // es + 3])  # up to 7 chunks of 512 KiB
                out = {}
                chunks = -(-nelems // (chunk_size(nelems * es, m.scatter_slot, es) // es))
                m.reduce_scatter(nelems, es, out, (call, j))
                expected.append(("rs", out, chunks, (call, j)))
        m.drain(rng)
        for op, out, chunks, tag in expected:
            want = [(tag, i) for i in range(chunks)]
            if op == "ag":
                for r in range(world):
                    for p in range(world):
                        if p != r:
                            assert out[(r, p)] == want, (op, r, p, out.get((r, p)))
            else:
                for r in range(world):
                    assert out[r] == want, (op, r, out.get(r))


def test_chunk_size_mirrors_the_kernel():
    # At least 4 chunks of at least 2 MiB, never over a slot, a multiple of 256 bytes and of the element.
    assert chunk_size(64 << 20, 64 << 20, 1) == 16 << 20
    assert chunk_size(4 << 20, 64 << 20, 1) == 2 << 20
    assert chunk_size(100, 64 << 20, 1) == 2 << 20  # one chunk holds it all
    assert chunk_size(1 << 30, 64 << 20, 1) == 64 << 20
    assert chunk_size((8 << 20) + 6, 64 << 20, 2) % 256 == 0
    assert chunk_size(1 << 30, 1000, 4) == 1000


@pytest.mark.parametrize("op, dropped, words", [("all_gather", "ag_done", "restaged|pulled"),
                                                 ("reduce_scatter", "rs_done", "overwrote|summed")])
def test_the_model_catches_a_missing_wait(op, dropped, words):
    """The checks bite: without the done-waits a slot is rewritten while a reader still needs it."""
    m = Model(4, 2, gather_slot=1 << 20, scatter_slot=1 << 19)
    if op == "all_gather":
        m.all_gather(9 << 20, {}, 0)
    else:
        m.reduce_scatter(9 << 19, 2, {}, 0)
    plan = {key: [o for o in q if not (o[0] == "wait" and o[2] == dropped)] for key, q in m.streams.items()}
    with pytest.raises(AssertionError, match=words):
        for seed in range(50):  # some interleaving runs a sender ahead of the readers
            m2 = Model(4, 2, gather_slot=1 << 20, scatter_slot=1 << 19)
            m2.streams = {k: list(v) for k, v in plan.items()}
            m2.drain(random.Random(seed))
