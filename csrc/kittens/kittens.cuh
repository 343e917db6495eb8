// Single include for kernels: the thunder_tk tile library.
#pragma once
#include "common.cuh"
#include "pipeline.cuh"
#include "schedule.cuh"
#include "sync.cuh"
#include "tma.cuh"
#include "warpgroup.cuh"
#include "wgmma.cuh"
