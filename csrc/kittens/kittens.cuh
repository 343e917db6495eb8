// Single include for kernels: the thunder_tk tile library.
#pragma once
#include "common.cuh"
