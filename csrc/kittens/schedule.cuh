// Persistent-grid work order: output tiles visited in groups of `group_rows` tile rows, column by column
// inside a group, so the blocks running at one time share A rows and B columns in L2. Optionally with a
// stream-K tail (split_tail): the grid's last, part-filled wave cut into k-block ranges of equal length.
#pragma once

#include <cstdint>

namespace tk::schedule {

struct tile_coord {
    int m, n;
};

struct grouped_order {
    int tiles_m, tiles_n, group_rows;

    __host__ __device__ int count() const { return tiles_m * tiles_n; }

    __host__ __device__ tile_coord operator()(int t) const {
        const int per_group = group_rows * tiles_n;
        const int group = t / per_group;
        const int first_m = group * group_rows;
        const int rows = (tiles_m - first_m) < group_rows ? (tiles_m - first_m) : group_rows;
        const int in_group = t - group * per_group;
        return {first_m + in_group % rows, in_group / rows};
    }
};

// One block's next piece of work: k-blocks [k_begin, k_end) of the tile at `tile` in the order (-1: no more).
// `partial`: the block leaves its fp32 sums in its workspace slot for the tile's finisher instead of storing the
// tile. Otherwise the block stores the tile, first adding the slots of blocks [contributors_from, itself).
struct work {
    int tile, k_begin, k_end, contributors_from;
    bool partial;
};

// The static persistent schedule with a stream-K tail. The first `dp_tiles` tiles of the order go whole, round
// robin (block b takes b, b + grid, ...). The last `sk_tiles` are laid end to end as sk_tiles * k_blocks k-block
// units and cut into `sk_blocks` ranges of equal length (within one), block b taking the b-th: so a grid whose
// last wave would leave SMs idle ends level instead. A tile cut between blocks is finished by the block that holds
// its last k-block; the others, all lower-numbered, hold its earlier k-blocks, each as the last piece of its own
// range, so a block leaves at most one partial tile (its workspace slot is its block index). A block walks its
// range's last piece first and its first piece last: the partial sums it waits for are the first thing the
// blocks before it compute, and the block it would wait for never waits on it (no cycle, whatever the order in
// which blocks get SMs). sk_tiles = 0: no tail, every tile whole.
struct split_tail {
    int dp_tiles, sk_tiles, sk_blocks, k_blocks;

    __host__ __device__ int64_t units() const { return int64_t(sk_tiles) * k_blocks; }
    // First unit of block b's range (b = sk_blocks: the end).
    __host__ __device__ int64_t begin(int b) const { return units() * b / sk_blocks; }
    // The block whose range holds unit x: the largest b with begin(b) <= x.
    __host__ __device__ int block_of(int64_t x) const {
        return int(((x + 1) * sk_blocks + units() - 1) / units()) - 1;
    }

    // Block b's i-th piece of work, of `grid` blocks.
    __host__ __device__ work item(int b, int grid, int i) const {
        const int whole = b < dp_tiles ? (dp_tiles - 1 - b) / grid + 1 : 0;
        if (i < whole) return {b + i * grid, 0, k_blocks, b, false};
        const work none{-1, 0, 0, b, false};
        if (b >= sk_blocks) return none;
        const int64_t lo = begin(b), hi = begin(b + 1);
        const int first = int(lo / k_blocks), last = int((hi - 1) / k_blocks), pieces = last - first + 1;
        const int j = i - whole;
        if (lo == hi || j >= pieces) return none;
        const int t = j == 0 ? last : (j == pieces - 1 ? first : first + j);
        const int64_t t0 = int64_t(t) * k_blocks;
        const int64_t from = lo > t0 ? lo : t0, to = hi < t0 + k_blocks ? hi : t0 + k_blocks;
        return {dp_tiles + t, int(from - t0), int(to - t0), from > t0 ? block_of(t0) : b, to < t0 + k_blocks};
    }
};

// Every tile whole, round robin over the grid.
__host__ __device__ inline split_tail whole_tiles(int tiles, int k_blocks) { return {tiles, 0, 1, k_blocks}; }

// The stream-K tail for `tiles` tiles of `k_blocks` on a persistent grid of `grid` blocks: the last wave's tiles
// (every tile where there are fewer than blocks), spread over at most `max_pieces` blocks per tile with ranges of at
// least `min_range` k-blocks. No tail where the tiles fill the grid's waves. Ranges shorter than a tile keep the
// blocks in step along K, as whole tiles do, so concurrent blocks share their k-slices of A and B in L2: a block
// walks k-blocks [0, y) of its second tile, then [x, k_blocks) of its first, where x - y is the same for all. (A
// tail of the last wave plus one whole wave, ranges of 1 to 2 tiles, put blocks at unrelated places along K and
// ran 8192 x 2048 x 8192 at 0.83x of whole tiles on an H100: its slices came from memory, not L2.)
inline split_tail plan_split_tail(int tiles, int k_blocks, int grid, int max_pieces, int min_range) {
    if (tiles % grid == 0) return whole_tiles(tiles, k_blocks);
    split_tail s{};
    s.k_blocks = k_blocks;
    s.sk_tiles = tiles % grid;
    s.dp_tiles = tiles - s.sk_tiles;
    int64_t blocks = grid;
    // Ranges of at least k_blocks / (max_pieces - 1) units: a tile then meets at most max_pieces of them.
    if (int64_t(max_pieces - 1) * s.sk_tiles < blocks) blocks = int64_t(max_pieces - 1) * s.sk_tiles;
    if (s.units() / min_range < blocks) blocks = s.units() / min_range;
    s.sk_blocks = blocks < 1 ? 1 : int(blocks);
    return s;
}

}  // namespace tk::schedule
