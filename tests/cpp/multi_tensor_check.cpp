// Host check of the multi-tensor chunk index (csrc/kittens/multi_tensor.cuh), run by tests/test_multi_tensor_index.py:
// for many lists of tensor sizes (empty tensors, one element, a chunk less, more or exactly one, large ones) and
// grids, the blocks of a persistent grid walking the chunks as the AdamW and sq_norm kernels do cover every element
// of every tensor exactly once, in chunks of at most CHUNK elements, none empty, each with its tensor's alignment
// bit; for_each_batch cuts any count into runs of at most N in order and stops at the first failure.
#define __host__
#define __device__
#define __forceinline__ inline
#include "kittens/multi_tensor.cuh"

#include <cstdio>
#include <random>
#include <vector>

static int failures = 0;
#define CHECK(cond, ...)                                 \
    do {                                                 \
        if (!(cond)) {                                   \
            if (failures++ < 20) {                       \
                std::printf("FAIL: ");                   \
                std::printf(__VA_ARGS__);                \
                std::printf("\n");                       \
            }                                            \
        }                                                \
    } while (0)

constexpr int N = 256;
constexpr int CHUNK = 2048;

static void check(const std::vector<int64_t>& numels, int grid) {
    static tk::chunk_index<N> index;  // 4 KB: off the stack, as the kernels' tables are a parameter
    index.clear();
    for (size_t i = 0; i < numels.size(); ++i) index.add(numels[i], CHUNK, i % 3 != 1);
    int64_t expected_chunks = 0;
    for (int64_t n : numels) expected_chunks += (n + CHUNK - 1) / CHUNK;
    CHECK(index.chunks() == expected_chunks, "%lld chunks, expected %lld", (long long)index.chunks(),
          (long long)expected_chunks);
    std::vector<std::vector<int>> covered(numels.size());
    for (size_t i = 0; i < numels.size(); ++i) covered[i].assign(static_cast<size_t>(numels[i]), 0);
    for (int block = 0; block < grid; ++block) {
        int t = 0;
        for (int64_t c = block; c < index.chunks(); c += grid) {
            const auto at = index.locate<CHUNK>(c, t);
            CHECK(t >= 0 && t < static_cast<int>(numels.size()), "chunk %lld in tensor %d", (long long)c, t);
            if (t < 0 || t >= static_cast<int>(numels.size())) return;
            CHECK(at.n > 0 && at.n <= CHUNK, "chunk %lld has %d elements", (long long)c, at.n);
            CHECK(at.start % CHUNK == 0 && at.start + at.n <= numels[t], "chunk %lld: [%lld, +%d) of %lld",
                  (long long)c, (long long)at.start, at.n, (long long)numels[t]);
            CHECK(at.aligned == (t % 3 != 1), "chunk %lld: tensor %d's alignment bit", (long long)c, t);
            for (int e = 0; e < at.n && at.start + e < numels[t]; ++e) ++covered[t][at.start + e];
        }
    }
    for (size_t i = 0; i < numels.size(); ++i)
        for (size_t e = 0; e < covered[i].size(); ++e)
            if (covered[i][e] != 1) {
                CHECK(false, "tensor %zu element %zu covered %d times (grid %d)", i, e, covered[i][e], grid);
                break;
            }
}

static void check_batches(int total) {
    std::vector<int> seen;
    int calls = 0;
    const int status = tk::for_each_batch<N>(total, 0, [&](int first, int count) {
        ++calls;
        CHECK(count > 0 && count <= N && first == static_cast<int>(seen.size()), "run (%d, %d) of %d", first, count,
              total);
        for (int i = 0; i < count; ++i) seen.push_back(first + i);
        return 0;
    });
    CHECK(status == 0 && static_cast<int>(seen.size()) == total && calls == (total + N - 1) / N,
          "%d entries in %d runs for %d", static_cast<int>(seen.size()), calls, total);
    calls = 0;
    const int failed = tk::for_each_batch<N>(total, 0, [&](int, int) { return ++calls == 2 ? 7 : 0; });
    CHECK(failed == (total > N ? 7 : 0) && calls == (total > N ? 2 : (total + N - 1) / N),
          "a failing second run of %d: status %d after %d calls", total, failed, calls);
}

int main() {
    const std::vector<int64_t> edges = {0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 7 * CHUNK + 5};
    int cases = 0;
    for (int64_t a : edges)
        for (int64_t b : edges)
            for (int64_t c : edges)
                for (int grid : {1, 2, 3, 7, 64}) {
                    check({a, b, c}, grid);
                    ++cases;
                }
    std::mt19937_64 rng(1);
    for (int trial = 0; trial < 300; ++trial) {
        const int count = 1 + static_cast<int>(rng() % N);
        std::vector<int64_t> numels(static_cast<size_t>(count));
        for (auto& n : numels) n = rng() % 5 == 0 ? static_cast<int64_t>(rng() % 3) : static_cast<int64_t>(rng() % 40000);
        check(numels, 1 + static_cast<int>(rng() % 300));
        ++cases;
    }
    check(std::vector<int64_t>(N, 1), 5);  // a full table
    for (int total : {0, 1, N - 1, N, N + 1, 3 * N, 1000}) check_batches(total);
    std::printf("%d cases, %d failures\n", cases + 1, failures);
    return failures == 0 ? 0 : 1;
}
