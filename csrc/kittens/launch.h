// Programmatic dependent launch, the host's switch (no device code: the binding includes it).
//
// With it on, tk's launches carry cudaLaunchAttributeProgrammaticStreamSerialization: a tk kernel may be scheduled
// while the kernel before it in the stream is still running, set itself up (barriers, descriptor prefetches) on the
// SMs that kernel has left, and waits at `pdl::wait_prior_grid()` (csrc/kittens/launch.cuh) for it to complete and
// its memory to be visible before its first access to global memory. Every tk kernel releases its successor at
// the same point, so the overlap reaches one launch ahead only. Off: ordinary stream order.
#pragma once

namespace tk {

void set_dependent_launch(bool enabled);
bool dependent_launch();

}  // namespace tk
