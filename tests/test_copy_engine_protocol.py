"""The copy-engine collectives' protocol (csrc/kernels/collectives/copy_engine.cu), played out on the CPU for
2..16 ranks over many calls of mixed sizes and both ops on one channel.

The path has run on 2 and 4 GPUs only. Here each rank's streams (the local one, one per peer) are queues of the
operations copy_engine.cu enqueues, in its order: pushes into a peer's staging, stream waits on a flag word
(wrap-around >=), flag writes into a peer, the receiver's copy or sum. A random scheduler runs whichever stream's
next operation may run. It checks that every chunk of every message reaches its output (all-gather: every peer's
chunk; reduce-scatter: every rank's part of the right chunk in each sum), that no staging slot is rewritten while
its receiver still needs it, whichever op wrote it and whichever reads it next, and that no call deadlocks. It
mirrors the C++ index arithmetic (chunk_size, slots, sequence numbers); a change there should be made in both.
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

    def __init__(self, world: int, slots: int, slot_bytes: int, start: int = 0):
        self.W, self.S, self.slot_bytes = world, slots, slot_bytes
        self.flags = {}      # (rank, kind, source, slot) -> uint32 word; kind "ready" or "done"
        self.region = {}     # (receiver, sender, slot) -> (op, chunk) staged there, or "consumed"
        self.chunks = start  # chunk counter of both ops (start: to test far-along counts)
        self.streams = {(r, s): [] for r in range(world) for s in ["local", *range(world)]}
        # A channel `start` chunks along: every word holds the last sequence number its slot carried, every slot
        # has been consumed.
        for slot in range(slots):
            last = max((k for k in range(max(0, start - slots), start) if k % slots == slot), default=None)
            if last is None:
                continue
            for r in range(world):
                for src in range(world):
                    if src != r:
                        for kind in ("ready", "done"):
                            self.flags[(r, kind, src, slot)] = (last + 1) & 0xFFFFFFFF
                        self.region[(r, src, slot)] = "consumed"

    # -- what copy_engine.cu enqueues ----------------------------------------------------------------

    def _exchange(self, op: str, nbytes: int, elem: int, out: dict, tag) -> int:
        W, S = self.W, self.S
        C = chunk_size(nbytes, self.slot_bytes, elem)
        chunks = -(-nbytes // C)
        q = self.streams
        for r in range(W):
            for i in range(chunks):
                k = self.chunks + i
                slot, seq = k % S, (k + 1) & 0xFFFFFFFF
                for p in range(W):  # push(k, p, ...)
                    if p == r:
                        continue
                    if k >= S:
                        q[(r, p)].append(("wait", r, "done", p, slot, (k + 1 - S) & 0xFFFFFFFF))
                    q[(r, p)].append(("push", r, p, slot, (op, k)))
                    q[(r, p)].append(("signal", p, "ready", r, slot, seq))
                for p in range(W):  # await_peers(k)
                    if p != r:
                        q[(r, "local")].append(("wait", r, "ready", p, slot, seq))
                q[(r, "local")].append(("consume", r, slot, (op, k), out, (tag, i)))
                for p in range(W):  # release(k)
                    if p != r:
                        q[(r, "local")].append(("signal", p, "done", r, slot, seq))
        self.chunks += chunks
        return chunks

    def all_gather(self, nbytes: int, out: dict, tag) -> int:
        return self._exchange("ag", nbytes, 1, out, tag)

    def reduce_scatter(self, nelems: int, es: int, out: dict, tag) -> int:
        return self._exchange("rs", nelems * es, es, out, tag)

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
        elif kind == "push":
            _, r, p, slot, chunk = op
            prev = self.region.get((p, r, slot))
            assert prev is None or prev == "consumed", (
                f"rank {r} overwrote {prev} in its slot {slot} at rank {p} with {chunk} before rank {p} used it")
            self.region[(p, r, slot)] = chunk
        elif kind == "consume":
            _, r, slot, chunk, out, where = op
            for p in range(self.W):
                if p != r:
                    got = self.region.get((r, p, slot))
                    assert got == chunk, f"rank {r} used {got} from rank {p} in slot {slot}, wanted {chunk}"
                    self.region[(r, p, slot)] = "consumed"
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
    m = Model(world, slots, slot_bytes=1 << 19, start=(1 << 32) - 7 * slots)
    for call in range(10 if world <= 4 else 4):
        queued = rng.randint(1, 3)  # calls enqueued before any runs, as the host does
        expected = []
        for j in range(queued):
            out: dict = {}
            if rng.random() < 0.5:
                chunks = m.all_gather(rng.choice([16, 4096, 3 << 20, (5 << 20) + 5]), out, (call, j))
            else:
                es = rng.choice([2, 4])
                chunks = m.reduce_scatter(rng.choice([1, 1000, (3 << 20) // es + 3]), es, out, (call, j))
            expected.append((out, [((call, j), i) for i in range(chunks)]))
        m.drain(rng)
        for out, want in expected:
            for r in range(world):
                assert out[r] == want, (r, out.get(r))


def test_chunk_size_mirrors_the_kernel():
    # At least 4 chunks of at least 2 MiB, never over a slot, a multiple of 256 bytes and of the element.
    assert chunk_size(64 << 20, 64 << 20, 1) == 16 << 20
    assert chunk_size(4 << 20, 64 << 20, 1) == 2 << 20
    assert chunk_size(100, 64 << 20, 1) == 2 << 20  # one chunk holds it all
    assert chunk_size(1 << 30, 64 << 20, 1) == 64 << 20
    assert chunk_size((8 << 20) + 6, 64 << 20, 2) % 256 == 0
    assert chunk_size(1 << 30, 1000, 4) == 1000


def _without_done_waits(m: Model) -> dict:
    return {key: [o for o in q if not (o[0] == "wait" and o[2] == "done")] for key, q in m.streams.items()}


@pytest.mark.parametrize("calls", [["ag"], ["rs"], ["ag", "rs"], ["rs", "ag"]])
def test_the_model_catches_a_missing_wait(calls):
    """The checks bite: without the done-waits a slot is rewritten while its receiver still needs it, within one op
    and from one op to the other."""
    m = Model(4, 2, slot_bytes=1 << 19)
    # One op alone: 9 chunks over 2 slots. Two ops: the first's 2 chunks fill both slots, the second's 1 chunk
    # takes slot 0 again.
    sizes = [9 << 19] if len(calls) == 1 else [1 << 20, 1 << 19]
    for n, (op, nbytes) in enumerate(zip(calls, sizes)):
        if op == "ag":
            m.all_gather(nbytes, {}, n)
        else:
            m.reduce_scatter(nbytes // 2, 2, {}, n)
    plan = _without_done_waits(m)
    with pytest.raises(AssertionError, match="overwrote|used"):
        for seed in range(200):  # some interleaving runs a sender ahead of a receiver
            m2 = Model(4, 2, slot_bytes=1 << 19)
            m2.streams = {k: list(v) for k, v in plan.items()}
            m2.drain(random.Random(seed))


def test_two_ops_that_counted_chunks_apart_would_collide():
    """Why the ops share one chunk counter: with one per op (each op's slot reuse waiting only on its own earlier
    chunks), an all-gather's chunk still staged at a receiver is overwritten by the reduce-scatter after it."""
    m = Model(4, 2, slot_bytes=1 << 19)
    m.all_gather(1 << 19, {}, 0)  # one chunk, slot 0
    m.chunks = 0                  # a reduce-scatter counting from zero again: slot 0, no wait
    m.reduce_scatter(1 << 18, 2, {}, 1)
    plan = {key: list(q) for key, q in m.streams.items()}
    with pytest.raises(AssertionError, match="overwrote|used"):
        for seed in range(200):
            m2 = Model(4, 2, slot_bytes=1 << 19)
            m2.streams = {k: list(v) for k, v in plan.items()}
            m2.drain(random.Random(seed))
