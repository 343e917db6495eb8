// Single include for kernels: the thunder_tk tile library.
#pragma once
#include "common.cuh"
#include "launch.cuh"
#include "pipeline.cuh"
#include "register_tile.cuh"
#include "schedule.cuh"
#include "shared_vec.cuh"
#include "store_tile.cuh"
#include "sync.cuh"
#include "tma.cuh"
#include "warpgroup.cuh"
#include "wgmma.cuh"
