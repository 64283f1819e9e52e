// The epilogue's finished output tile in shared memory, as handed to a sink.
#pragma once
#include "common/types.cuh"

struct SmemTile {
  const bf16_t* data;  // row-major, `ld` elements between rows
  int ld;
  int rows;            // valid rows (the rest belong to no row of this group)
  int cols;            // valid columns, a multiple of 8
};
