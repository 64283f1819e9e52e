// Fixed-width integer types without <cstdint>: NVRTC ships no C library headers.
#pragma once

typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned short uint16_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
typedef unsigned long long uintptr_t;

// bf16 travels as its 16-bit storage; arithmetic happens in fp32.
typedef uint16_t bf16_t;

// Local experts one rank may hold: the GEMM's tile scheduler keeps a table per expert and
// the dispatch layout gives each its own thread (epserve.kernel_structs.MAX_LOCAL_EXPERTS).
#define EPSERVE_MAX_LOCAL_EXPERTS 512
