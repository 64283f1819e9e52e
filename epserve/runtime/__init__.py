"""Building and launching kernels: NVRTC compilation and its cache, the shipped variants, launch-argument
structs, TMA descriptors, and the GPU probe."""
