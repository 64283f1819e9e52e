// Compiled only by tests/cpu/test_kernel_structs.py: the test defines EPSERVE_LAYOUT_ASSERTS
// as static_asserts comparing epserve/kernel_structs.py's sizes and offsets with the compiler's.
#include "comm/dispatch_config.cuh"
#include "sinks/peer_send_config.cuh"

EPSERVE_LAYOUT_ASSERTS

extern "C" __global__ void epserve_layout_probe() {}
