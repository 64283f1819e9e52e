// Compiled only by tests/cpu/test_sendconfig.py: the test defines EPSERVE_LAYOUT_ASSERTS as a
// list of static_asserts comparing epserve/sendconfig.py's offsets with the compiler's.
#include "sinks/peer_send_config.cuh"

EPSERVE_LAYOUT_ASSERTS

extern "C" __global__ void epserve_layout_probe() {}
