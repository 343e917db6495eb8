// Persistent-grid work order: output tiles visited in groups of `group_rows` tile rows, column by column
// inside a group, so the blocks running at one time share A rows and B columns in L2.
#pragma once

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

}  // namespace tk::schedule
