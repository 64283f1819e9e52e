// Compiled only by tests/cpu/test_kernel_structs.py, which defines EPSERVE_LAYOUT_PROBES as
// one tiny kernel per struct field, each taking the struct by value and reading that field.
// The PTX then names the parameter's size and alignment and each load's byte offset: the
// compiler's own layout, read without offsetof (NVRTC 13.0 has no __builtin_offsetof).
#include "comm/dispatch_config.cuh"
#include "comm/peer_counters.cuh"
#include "sinks/peer_send_config.cuh"

EPSERVE_LAYOUT_PROBES
