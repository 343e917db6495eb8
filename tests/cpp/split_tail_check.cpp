// Exhaustive host check of the stream-K tail (csrc/kittens/schedule.cuh), run by tests/test_split_tail.py: for
// many tile counts, k-block counts and grids, every k-block of every tile is computed exactly once; a block leaves
// at most one partial tile, the first piece of its tail; each split tile has one finisher, whose contributors are
// exactly the lower-numbered blocks that left its partial sums; no block waits on a block that waits on it.
#define __host__
#define __device__
#include "kittens/schedule.cuh"

#include <cstdio>
#include <map>
#include <vector>

using tk::schedule::split_tail;
using tk::schedule::work;

static int failures = 0;
#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            if (failures++ < 20) {                                         \
                std::printf("FAIL tiles=%d k_blocks=%d grid=%d: ", tiles, k_blocks, grid); \
                std::printf(__VA_ARGS__);                                  \
                std::printf("\n");                                         \
            }                                                              \
        }                                                                  \
    } while (0)

static void check(int tiles, int k_blocks, int grid, int max_pieces, int min_range) {
    const split_tail s = tk::schedule::plan_split_tail(tiles, k_blocks, grid, max_pieces, min_range);
    const int blocks = s.sk_tiles == 0 ? (tiles < grid ? tiles : grid) : (s.dp_tiles > 0 ? grid : s.sk_blocks);
    CHECK(s.sk_blocks <= grid && s.sk_blocks >= 1, "sk_blocks %d", s.sk_blocks);
    CHECK(s.dp_tiles % grid == 0 || s.sk_tiles == 0, "dp_tiles %d", s.dp_tiles);
    std::vector<std::vector<int>> covered(tiles, std::vector<int>(k_blocks, 0));
    std::map<int, std::vector<int>> partial_blocks;  // tile -> blocks that left partial sums
    std::map<int, std::pair<int, int>> finisher;      // tile -> (block, contributors_from)
    std::vector<int> partial_at(blocks, -1), finish_at(blocks, -1), first_tail(blocks, -1);
    for (int b = 0; b < blocks; ++b) {
        int partials = 0;
        for (int i = 0;; ++i) {
            const work w = s.item(b, blocks, i);
            if (w.tile < 0) break;
            CHECK(i < tiles + 4, "block %d: too many pieces", b);
            if (i >= tiles + 4) break;
            CHECK(w.tile >= 0 && w.tile < tiles, "tile %d", w.tile);
            CHECK(0 <= w.k_begin && w.k_begin < w.k_end && w.k_end <= k_blocks, "range [%d, %d)", w.k_begin, w.k_end);
            for (int k = w.k_begin; k < w.k_end; ++k) covered[w.tile][k]++;
            if (w.tile >= s.dp_tiles && first_tail[b] < 0) first_tail[b] = i;
            if (w.partial) {
                ++partials;
                CHECK(w.k_end < k_blocks, "a partial piece holds the tile's last k-block");
                partial_blocks[w.tile].push_back(b);
                partial_at[b] = i;
                CHECK(i == first_tail[b], "block %d: its partial piece is not the first of its tail", b);
            } else {
                CHECK(w.k_end == k_blocks, "a stored piece ends before the tile's last k-block");
                CHECK(w.contributors_from <= b, "contributors from %d > block %d", w.contributors_from, b);
                CHECK((w.contributors_from < b) == (w.k_begin > 0), "contributors iff the piece starts inside");
                CHECK(!finisher.count(w.tile), "tile %d stored twice", w.tile);
                finisher[w.tile] = {b, w.contributors_from};
                if (w.contributors_from < b) finish_at[b] = i;
            }
        }
        CHECK(partials <= 1, "block %d leaves %d partial tiles", b, partials);
    }
    for (int t = 0; t < tiles; ++t)
        for (int k = 0; k < k_blocks; ++k) CHECK(covered[t][k] == 1, "tile %d k-block %d covered %d times", t, k, covered[t][k]);
    for (auto& [t, fin] : finisher) {
        std::vector<int> expect;
        for (int c = fin.second; c < fin.first; ++c) expect.push_back(c);
        CHECK(partial_blocks[t] == expect, "tile %d: contributors do not match", t);
        if (fin.second < fin.first) {
            CHECK(int(expect.size()) < max_pieces, "tile %d split in %d pieces", t, int(expect.size()) + 1);
            // Each contributor computes its partial piece before any finishing piece of its own (no cycle).
            for (int c : expect) CHECK(finish_at[c] < 0 || partial_at[c] < finish_at[c], "block %d order", c);
        }
    }
    for (auto& [t, blocks_of_t] : partial_blocks) CHECK(finisher.count(t), "tile %d never stored", t);
}

int main() {
    long cases = 0;
    for (int grid : {1, 2, 7, 16, 132})
        for (int k_blocks : {1, 2, 3, 4, 5, 8, 32, 129})
            for (int tiles = 1; tiles <= 3 * grid + 5; ++tiles) {
                check(tiles, k_blocks, grid, 4, 4);
                check(tiles, k_blocks, grid, 1000, 1);
                cases += 2;
            }
    std::printf("%ld cases, %d failures\n", cases, failures);
    return failures != 0;
}
