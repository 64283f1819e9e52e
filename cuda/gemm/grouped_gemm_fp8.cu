// The block-scaled FP8 grouped GEMM (issue 16): A [M, K] and B [E, rows, K] in e4m3, A with
// one fp32 scale per row and 128-wide k-block, B with one per 128 x 128 block (DeepSeek-V3's
// layout, common/fp8.cuh's convention), fp32 accumulation promoted per k-block
// (gemm/block_scaled_mma.cuh). C[m, :] = dequant(A)[m, :] @ dequant(B[e])^T per expert.
//
// The structure is the bf16 kernel's (gemm/grouped_gemm_wgmma.cu, whose comment explains
// each choice), without its experimental knobs: a persistent grid taking 128 x 256 tiles from
// an atomic counter in gemm/tile_scheduler.cuh's order; two consumer warpgroups, 64 rows
// each, skipping the MMA of a half without rows; a producer warpgroup whose first thread
// issues the TMA loads of a ring of stages and whose other three warps write finished tiles
// out (the null build's C store, or the peer sink's send warps) while the consumers go on.
//
// What FP8 changes:
// - A stage is one k-block: 128 e4m3 = 128 bytes a row, one 128-byte swizzle row, so A
//   (16 KB) and B (32 KB) have the bf16 kernel's bytes for twice its MMA work; a third TMA
//   box brings the A scales of the tile's rows (scales stored k-block-major, [K / 128, ld],
//   so they are one contiguous box). That box's first column is the tile's first row rounded
//   down to a multiple of 4, and it is 132 floats wide: a TMA box's start in its innermost
//   dimension must be 16-byte aligned (common/ptx.cuh, tma_load_2d), experts start at any
//   row, and cuTensorMapEncodeTiled cannot check a coordinate. The first version started the
//   box at the tile's first row; its first GPU run died with CUDA_ERROR_ILLEGAL_INSTRUCTION
//   on experts starting at rows 0, 64, 129, 130, ... (notes/gemm.md). B's scales are read by
//   the consumers from global memory (one float a half a k-block, the same for every thread:
//   a broadcast).
// - A consumer keeps a 128 x 256 tile's fp32 sum (128 registers) and computes each k-block
//   into a 64-register part, one 128-column half at a time (sum + two parts would not fit).
// - -DEPSERVE_GEMM_SWIGLU=1 builds GEMM 1: B is w13 [E, 2N, K], a stage holds N-tile n's
//   128 gate rows and the matching up rows, and the epilogue applies SwiGLU and quantizes
//   the tile's 128 act columns (one scale block) to e4m3 with one scale a row
//   (ffn/swiglu_quantize.cuh): C is act_q [M, N] e4m3 and c_scales [N / 128, c_scale_ld]
//   fp32, which is GEMM 2's A and A scales as they are. Without it (GEMM 2) C is bf16 [M, N]
//   and the tile goes to the sink exactly as in the bf16 kernel.
#include "common/bf16.cuh"
#include "common/bulk_copy.cuh"
#include "common/fp8.cuh"
#include "common/ptx.cuh"
#include "ffn/swiglu_quantize.cuh"
#include "gemm/block_scaled_mma.cuh"
#include "gemm/tile_scheduler.cuh"
#include "sinks/ep_peer_sink.cuh"
#if defined(EPSERVE_SINK_BULK) && EPSERVE_SINK_BULK  // the bulk-copy send warps (EPSERVE_SINK_STORES=bulk)
#include "sinks/ep_peer_sink_bulk.cuh"
#endif
#include "sinks/null_peer_sink.cuh"
#include "sinks/tile_mailbox.cuh"
#include "sinks/tile_mailbox_mbarrier.cuh"

#ifndef EPSERVE_SINK
#error "build with -DEPSERVE_SINK=NullPeerSink or -DEPSERVE_SINK=EpPeerSink"
#endif
#ifndef EPSERVE_GEMM_SWIGLU
#define EPSERVE_GEMM_SWIGLU 0
#endif
#ifndef EPSERVE_GROUP_N
#define EPSERVE_GROUP_N 4  // n-tiles of a weight-sharing group (gemm/tile_scheduler.cuh)
#endif
// Diagnostic builds (tests/gpu/test_gemm_fp8.py's probes, launch/jobs/probe_gemm_fp8.py), none
// of them shipped; each keeps every barrier, arrival and byte count of the default build, so
// a build that runs shows that what it left out was not the fault:
// - EPSERVE_GEMM_FP8_TMA_LOADS: which TMA boxes the producer issues, bit 0 A, bit 1 A's
//   scales, bit 2 B (default 7, all). A box left out is counted as arrived bytes instead
//   (mbarrier.expect_tx of the bytes, then mbarrier.complete_tx of them), so the stage still
//   completes; the consumers then compute on whatever the ring holds.
// - EPSERVE_GEMM_FP8_MMA=0: the consumers issue no wgmma and promote nothing (a scale the
//   ring holds unloaded could be NaN); the output is all zeros.
// - EPSERVE_GEMM_FP8_CHECK_TMA=1: before each TMA load the producer checks what the hardware
//   requires of it and cuTensorMapEncodeTiled cannot see (shared destination aligned to 128
//   bytes, 1024 for the swizzled A and B boxes; innermost start coordinate a multiple of 16
//   bytes) and on a violation prints the load, its coordinates and the tile, then traps.
// - EPSERVE_GEMM_FP8_UNALIGNED_SCALES=1: the A-scale box starts at the tile's first row
//   itself, as the first version did (the same values land in the same places): the build
//   that reproduces the first GPU run's fault if an unaligned start was its cause.
// - EPSERVE_GEMM_FP8_RELEASE_BY_WARPGROUP=1: a stage is freed by one arrival per consumer
//   warpgroup (its thread 0), as before the split tails' scale race was fixed (see `release`
//   in the consumers): the build that reproduces that race (launch/jobs/check_fp8_race.py
//   --release-by-warpgroup), never a shipped one.
// Experimental builds (launch/jobs/time_gemm_fp8.py --variants times them against the
// default; tests/gpu/test_gemm_fp8.py holds each to the default's bits):
// - EPSERVE_GEMM_FP8_SPLIT_TAILS=1: a tile whose real rows all lie in its first 64 (an
//   expert's tail) is computed by both consumer warpgroups, each on one 128-column half of
//   the same 64 rows, instead of by the first warpgroup alone on both halves while the
//   second idles. The default's lone warpgroup leaves the tensor pipe idle during each of
//   its waits and promotions (nothing else issues wgmmas); split, the two warpgroups fill
//   each other's gaps as they do on whole tiles. At dsv3-prefill, balanced routing, 65 of
//   rank 0's 321 m-tiles are such tails (11% of the MMA work). Same bits: each output
//   element comes from the same wgmma instruction (m64n128k32, same descriptors: the same
//   A rows and B half of the same stage) and the same promotion fma with the same scale
//   product, k-block by k-block in the same order; only which warpgroup's registers hold
//   it changes. GEMM 1 (SwiGLU): the second warpgroup computes the up half and hands its
//   sums to the first through shared memory, rounded to bf16 (the epilogue's first step
//   rounds them to bf16 anyway, and a bf16 value widened to fp32 rounds back to itself),
//   and the first warpgroup runs the unchanged epilogue.
// - EPSERVE_GEMM_FP8_ZERO_PADDING=1 (shipped): an A box that reaches past its expert's last
//   row (a tail tile's) is loaded through a copy of map_a whose row extent ends there, so TMA
//   fills those rows with zeros instead of the next expert's rows. The tile's real rows get
//   the same sums (each output row depends on its own A row only), but multiplying zeros
//   switches less in the tensor cores, and this part's clock is bound by its power: at
//   dsv3-prefill's balanced routing, where padding is 11% of the MMA rows, GEMM 1 runs
//   1.5-1.8% faster and GEMM 2 0.6% (notes/gemm.md, fifteenth session). The copies live in
//   global memory, a set per SM (one CTA an SM), rewritten on the device (tensormap.replace).
// - EPSERVE_GEMM_FP8_BN=128 (GEMM 2 only): 128 x 128 tiles. Each warpgroup's share is one
//   64 x 128 part; 16 KB B stages, a 34 KB output tile, so 5 stages instead of 3. Same bits:
//   an output element's wgmmas and promotions do not depend on the tile's width (the same
//   instruction on the same rows of A and B, the same scales, the same k order).
// - EPSERVE_GEMM_FP8_OVERLAP=1: where a warpgroup computes one 128-column half (every tile
//   with BN=128; split tails), it keeps k-block kt + 1's wgmmas in flight while it promotes
//   k-block kt (a second part, wgmma.wait_group 1), so the tensor pipe has work during the
//   promotion; a stage is freed after its k-block's wait, as before. Sum (64) and two parts
//   (64 each) fit where the 128 x 256 tile's sum (128) and one part do. Same bits: the same
//   wgmmas into a fresh part, the same promotion fma, k-blocks promoted in the same order;
//   only the time at which each is issued moves. On today's shipped builds (KNOBS split+ovl,
//   split+ahead+ovl) still 1-6% slower, dense problems without split tails included: the
//   whole-tile loop's code changes with it (twenty-ninth session).
// - EPSERVE_GEMM_FP8_L2_SIDES=1 (shipped): tiles handed out by L2 side. Hopper's L2 is two partitions
//   joined by a fabric; an SM reads through its near one, and lines homed in the far one
//   cross the fabric, once for each side whose SMs read them. An expert's weight tiles are
//   read by its 2-3 m-tiles, often on both sides. With this build a CTA on side 0 (by
//   epserve_gemm_sm_side[%smid], measured on the GPU in hand by the host: the side table
//   differs from die to die) takes tiles in the scheduler's order from the front, a CTA on
//   side 1 from the back, so each side works on experts of its own; the two meet where they
//   run out (one 64-bit counter holds both counts, a take fails once they sum to the tile
//   count). Same bits: a tile's work does not depend on which CTA runs it, and any table
//   (epserve/runtime/l2_sides.py writes the measured one, or zeros) gives them. Shipped since
//   the twenty-second session: fabric traffic down a third, time unchanged at the power limit
//   (fifteenth session), and GEMM 1 0.9-2.7%, GEMM 2 0.4-1.7% faster timed as the bench times them.
// - EPSERVE_GEMM_FP8_PUBLISH_TILE=1 (shipped): the producer, which decodes each tile it takes
//   anyway, writes the decoded tile (expert, rows, columns) beside its index in the tile's
//   first stage, and prefetches the lines of the tile's weight scales into the SM's L1; the
//   consumers read the tile from shared memory instead of decoding it again (a binary search
//   over the experts and two global loads on their path into every tile). Same bits: the same
//   tile. Shipped since the twenty-third session: GEMM 2 0.8-2.6% faster (4.6% in one run),
//   GEMM 1 unchanged (-1.3% to +0.3%), timed as the bench times them (notes/gemm.md).
// - EPSERVE_GEMM_FP8_SMEM_OFFSETS=1 (no faster: GEMM 2 -0.1% gated, +1.1% null, twenty-fourth
//   session): the scheduler keeps the expert offsets in shared memory
//   (gemm/tile_scheduler.cuh), so the producer's decode of each tile makes no global load. The twenty-third session's stamps put the producer's take and decode at
//   ~3000 cycles on GEMM 2 (~1800 for one expert), on the path between a tile's last load and
//   the next tile's first, whose late arrival is GEMM 2's largest cost per tile. Same bits:
//   the same offsets.
// - EPSERVE_GEMM_FP8_TAKE_AHEAD=1 (shipped for GEMM 2 since the twenty-fourth session, 2-4%
//   faster; GEMM 1 4-7% slower with it, as each CTA claims its next tile a whole long tile
//   early): the producer takes the next tile from the counter during this one's loads (the
//   atomic after its first stage's loads, the answer read after the wait for its second
//   stage) and decodes it into shared memory, instead of between this tile's last load and
//   the next one's first. The stamps put that gap (~3000
//   cycles) on GEMM 2's path into each tile: its ring has 3 stages (its bf16 output tile
//   takes 66 KB), and the next tile's first stage arrived ~2100 cycles after the consumers
//   wanted it. Same bits: the same tiles, each CTA taking one tile ahead of the one it works on.
// - EPSERVE_GEMM_FP8_FIRST_FMA=1 (measured 1-2% slower: k-block 0 shorter, k-block 1 longer):
//   k-block 0's promotion starts the sums, fma(part, scale, +0), instead of zeroing 128
//   registers first (128 tiles: the stamps put k-block 0 ~900 cycles above the later ones). Same bits: the same fma with the same +0.
// - EPSERVE_GEMM_FP8_MBARRIER_MAILBOX=1 (measured no faster: GEMM 2 null +0.9%, GEMM 1 +0.8%):
//   the finished tile goes to the writer or send warps through
//   sinks/tile_mailbox_mbarrier.cuh's mailbox (two mbarriers) instead of
//   TileMailbox's named barriers, with which every consumer thread's hand-over and drain waited
//   for all of them: the two consumer warpgroups left each tile in step, both out of the MMA at
//   once for the epilogue (~770 cycles on GEMM 2, ~4200 on GEMM 1) and both back into it at
//   once. Now each goes on as soon as its own rows are written, and the other one's wgmmas
//   can fill the tensor pipe meanwhile. Same bits: the same tile in the same shared memory.
//   Not with the bulk send warps (their hand-over fences the async proxy).
// - EPSERVE_GEMM_FP8_SWIGLU_ON_WRITERS=1 (GEMM 1; measured 5-6.5% slower with the take-ahead,
//   twenty-fifth session: with 3 stages GEMM 1's k-blocks took 1293 cycles against 1239, more
//   than the epilogue gave back): the consumers leave the tile's gate and up
//   sums as bf16 (GEMM 2's output tile: 128 rows of 256 columns, gate then up) and the three
//   writer warps apply SwiGLU and act's quantization, a row at a time (a lane a 4-column
//   group, the row's amax by five shuffles), storing act's e4m3 and its scale straight to
//   global memory. The stamps put GEMM 1's epilogue + hand-over at ~4000 of a tile's ~72000
//   cycles, both consumer warpgroups out of the MMA meanwhile; GEMM 2's bf16 hand-over costs
//   ~770. The price: the 66 KB bf16 tile leaves room for 3 ring stages instead of 4. Same
//   bits: the epilogue rounds the sums to bf16 first anyway, and the writers call the very
//   functions the consumers did (swiglu_bf16x2, the amax from +0, fp8_inv_scale,
//   quantize_bf16x2, fp8_scale); a row's max does not depend on the order it is taken in.
// - EPSERVE_GEMM_FP8_STMATRIX=1 (measured no faster, twenty-fifth session: GEMM 2 gated -0.3%,
//   null +0.7%, dense K = 2048 +1.5%): the bf16 output tile (GEMM 2's; GEMM 1's with
//   EPSERVE_GEMM_FP8_SWIGLU_ON_WRITERS) is written by stmatrix, four 8 x 8 blocks an
//   instruction, instead of one 4-byte store per value pair: 16 stores a thread instead of
//   64 in the epilogue, while both consumer warpgroups are out of the MMA. Same bits: the same
//   bf16 pairs at the same places (the wgmma accumulator's fragment is stmatrix's).
// - EPSERVE_GEMM_FP8_TILE_IN_RING=1 (GEMM 2; measured no faster, twenty-sixth session: gated
//   -1.6% to +1.1%, null +2.6 to +4.2%, the bench's layer-fused no faster): GEMM 2's 66 KB
//   output tile leaves room for 3 ring stages, and two measurements said its k-blocks want a
//   fourth (notes/gemm.md). A stage is
//   laid out as one block [A | B | A scales]; the consumers keep the stage of a tile's last
//   k-block and write the tile's first kRowsInStage (80) rows over its A and B, the other 48
//   rows into a region of their own (25 KB), which leaves room for 4 stages. The writer or
//   send warps read the rows in the stage first and then free it (one arrival counting for
//   all the consumers'), then the rest. Gated off, nothing is held. While the writers hold
//   the stage the ring has 3; the producer waits on it. A first version (commit 2b95c4b) put
//   the whole tile into the stages of the last two k-blocks (no region of its own) and freed
//   them after the whole tile: gated -4.0%, but null +8% and the fused combine +19%, the
//   writers holding half the ring. Same bits: the same bf16 values at the same rows.
// - EPSERVE_GEMM_FP8_HIDE_HANDSHAKE=1: a consumer's ring handshake is moved under its wgmmas.
//   The default k-block waits on its stage's full barrier before it issues, and arrives on
//   the empty barrier between its last wait and its promotion: both on the path from one
//   wgmma group to the next. The consumer-loop probe (twelfth session) priced them at ~35 and
//   ~60 cycles a k-block of 1024. Here k-block kt waits on k-block kt + 1's full barrier with
//   its last group in flight, and frees k-block kt - 1's stage after it issued its first
//   group (stage kt - 1's wgmmas are done since kt - 1's last wait; each thread's A-scale
//   reads of it came before, and its arrive releases them as before). A stage is freed one
//   promotion and one issue later. Same bits: the same wgmmas, promotions and scales in the
//   same order; only when a thread waits and arrives moves. Not with the overlapped loop or
//   the tile in the ring. =1 measured slower (GEMM 2 +2.6-9%, GEMM 1 +1.3%, twenty-eighth
//   session: a stage freed later reaches the producer later, and GEMM 2's split tails ran
//   their k-blocks 30% slower); =2 moves the full wait alone, the release stays where it was
//   (also slower: GEMM 2 +1.1-4.4%, GEMM 1 +0.4-6.2%, twenty-ninth session).
// - EPSERVE_GEMM_FP8_REGISTER_A=1: on whole 256-wide tiles each consumer reads its k-block's
//   A rows from the stage into registers once (four ldmatrix.x4, 16 registers) and both
//   128-column halves' wgmmas take A from them (the RS form, common/wgmma_fp8.cuh), where the
//   default's wgmmas read A from shared memory, once per half: shared-memory reads for the
//   MMA fall from 48 to 40 KB a warpgroup and k-block. Under the power limit, which holds
//   these GEMMs (notes/gemm.md), bytes not moved are energy not spent. Same bits if the
//   fragment is right: the same products of the same e4m3 values in the same wgmma (the knob
//   test's bits hold). Measured slower: GEMM 2 +2.5-5.8%, GEMM 1 +4.5-9.7% (twenty-ninth
//   session; the RS wgmma issues slower, 1277 against 1121 cycles a k-block in the probe).
// - EPSERVE_GEMM_FP8_B_KBLOCK_MAJOR=1: B is read from a copy of the weights laid out k-block
//   major, [E, K / 128, b_rows, 128] (epserve.ffn.gemm_fp8.kblock_major), so each TMA box of B
//   (b_box rows x 128 bytes) is one contiguous run of memory instead of 128 bytes from each of
//   b_box rows K bytes apart. Every weight byte comes from HBM once per GEMM; read as whole
//   DRAM pages instead of one 128-byte piece a page, the same bytes may cost less energy, and
//   these GEMMs run at the part's power limit (notes/gemm.md, thirtieth session). Same bits:
//   the same box lands in shared memory with the same swizzle.
// Diagnostic build: EPSERVE_GEMM_FP8_TRACE=1 stamps %clock64 at points of each tile into
// epserve_gemm_trace (below); launch/jobs/trace_gemm_fp8.py reads them.
// Diagnostic build: EPSERVE_GEMM_FP8_SMEM_PAD=B asks for B more bytes of shared memory, never
// touched (does the footprint alone move the time? 9216 on GEMM 2, twenty-sixth session: no,
// gated -0.2%, null -0.6%).
#ifndef EPSERVE_GEMM_FP8_SPLIT_TAILS
#define EPSERVE_GEMM_FP8_SPLIT_TAILS 0
#endif
#ifndef EPSERVE_GEMM_FP8_L2_SIDES
#define EPSERVE_GEMM_FP8_L2_SIDES 0
#endif
#ifndef EPSERVE_GEMM_FP8_BN
#define EPSERVE_GEMM_FP8_BN 256
#endif
#ifndef EPSERVE_GEMM_FP8_OVERLAP
#define EPSERVE_GEMM_FP8_OVERLAP 0
#endif
#ifndef EPSERVE_GEMM_FP8_TMA_LOADS
#define EPSERVE_GEMM_FP8_TMA_LOADS 7
#endif
#ifndef EPSERVE_GEMM_FP8_MMA
#define EPSERVE_GEMM_FP8_MMA 1
#endif
#ifndef EPSERVE_GEMM_FP8_CHECK_TMA
#define EPSERVE_GEMM_FP8_CHECK_TMA 0
#endif
#ifndef EPSERVE_GEMM_FP8_UNALIGNED_SCALES
#define EPSERVE_GEMM_FP8_UNALIGNED_SCALES 0
#endif
#ifndef EPSERVE_GEMM_FP8_RELEASE_BY_WARPGROUP
#define EPSERVE_GEMM_FP8_RELEASE_BY_WARPGROUP 0
#endif
#ifndef EPSERVE_GEMM_FP8_ZERO_PADDING
#define EPSERVE_GEMM_FP8_ZERO_PADDING 0
#endif
#ifndef EPSERVE_GEMM_FP8_TRACE
#define EPSERVE_GEMM_FP8_TRACE 0
#endif
#ifndef EPSERVE_GEMM_FP8_PUBLISH_TILE
#define EPSERVE_GEMM_FP8_PUBLISH_TILE 0
#endif
#ifndef EPSERVE_GEMM_FP8_SMEM_OFFSETS
#define EPSERVE_GEMM_FP8_SMEM_OFFSETS 0
#endif
#ifndef EPSERVE_GEMM_FP8_TAKE_AHEAD
#define EPSERVE_GEMM_FP8_TAKE_AHEAD 0
#endif
#ifndef EPSERVE_GEMM_FP8_FIRST_FMA
#define EPSERVE_GEMM_FP8_FIRST_FMA 0
#endif
#ifndef EPSERVE_GEMM_FP8_MBARRIER_MAILBOX
#define EPSERVE_GEMM_FP8_MBARRIER_MAILBOX 0
#endif
#ifndef EPSERVE_GEMM_FP8_SWIGLU_ON_WRITERS
#define EPSERVE_GEMM_FP8_SWIGLU_ON_WRITERS 0
#endif
#ifndef EPSERVE_GEMM_FP8_STMATRIX
#define EPSERVE_GEMM_FP8_STMATRIX 0
#endif
#ifndef EPSERVE_GEMM_FP8_SMEM_PAD
#define EPSERVE_GEMM_FP8_SMEM_PAD 0
#endif
#ifndef EPSERVE_GEMM_FP8_TILE_IN_RING
#define EPSERVE_GEMM_FP8_TILE_IN_RING 0
#endif
#ifndef EPSERVE_GEMM_FP8_HIDE_HANDSHAKE
#define EPSERVE_GEMM_FP8_HIDE_HANDSHAKE 0
#endif
#ifndef EPSERVE_GEMM_FP8_REGISTER_A
#define EPSERVE_GEMM_FP8_REGISTER_A 0
#endif
#ifndef EPSERVE_GEMM_FP8_B_KBLOCK_MAJOR
#define EPSERVE_GEMM_FP8_B_KBLOCK_MAJOR 0
#endif

namespace {

using Sink = EPSERVE_SINK;
using namespace epserve;
constexpr bool kSwiGLU = EPSERVE_GEMM_SWIGLU != 0;
static_assert(!(kSwiGLU && Sink::kEnabled), "GEMM 1 keeps act on this GPU: its sink is the null one");
constexpr int kBM = 128, kBN = EPSERVE_GEMM_FP8_BN, kBK = kFp8BlockK;  // kBN: accumulator columns of a tile
static_assert(kBN == 256 || (kBN == 128 && !kSwiGLU), "EPSERVE_GEMM_FP8_BN: 256, or 128 for GEMM 2 (GEMM 1's tile "
                                                      "holds a whole 128-column act block: 256 accumulator columns)");
constexpr int kHalfN = 128;  // columns of one part, and of one weight scale block
constexpr int kOutCols = kSwiGLU ? kBN / 2 : kBN;
// EPSERVE_GEMM_FP8_SWIGLU_ON_WRITERS: GEMM 1's SwiGLU and quantization on the writer warps.
constexpr bool kWriterSwiGLU = kSwiGLU && EPSERVE_GEMM_FP8_SWIGLU_ON_WRITERS != 0;
constexpr int kConsumers = 2, kConsumerThreads = 128 * kConsumers;
constexpr bool kReleaseByWarpgroup = EPSERVE_GEMM_FP8_RELEASE_BY_WARPGROUP != 0;
constexpr bool kZeroPadding = EPSERVE_GEMM_FP8_ZERO_PADDING != 0;
constexpr bool kL2Sides = EPSERVE_GEMM_FP8_L2_SIDES != 0;
constexpr bool kPublishTile = EPSERVE_GEMM_FP8_PUBLISH_TILE != 0;
// A tile's first stage carries its index, and with kPublishTile its coordinates as the
// producer decoded them (index, expert, m_abs, m_end, n_abs, rows).
constexpr int kStageTileInts = kPublishTile ? 6 : 1;
// A decoded tile in shared memory after its index (slot[0]): a tile's first stage with
// kPublishTile, the next tile with EPSERVE_GEMM_FP8_TAKE_AHEAD.
__device__ __forceinline__ void store_tile(int* slot, const GroupedTile& t) {
  slot[1] = t.expert;
  slot[2] = t.m_abs;
  slot[3] = t.m_end;
  slot[4] = t.n_abs;
  slot[5] = t.rows;
}
__device__ __forceinline__ GroupedTile load_tile(const int* slot) {
  GroupedTile t;
  t.expert = slot[1];
  t.m_abs = slot[2];
  t.m_end = slot[3];
  t.n_abs = slot[4];
  t.rows = slot[5];
  return t;
}
constexpr bool kSmemOffsets = EPSERVE_GEMM_FP8_SMEM_OFFSETS != 0;
constexpr bool kTakeAhead = EPSERVE_GEMM_FP8_TAKE_AHEAD != 0;
// The arrivals that free a stage: one per consumer thread (the consumers' `release` says why).
constexpr int kStageReleases = kReleaseByWarpgroup ? kConsumers : kConsumerThreads;
constexpr int kThreads = 128 * (kConsumers + 1);
constexpr int kProducerWarpgroup = kConsumers;
constexpr bool kSendWarps = Sink::kSendWarps > 0;
constexpr bool kWriterWarps = kSendWarps || !Sink::kEnabled;
static_assert(kWriterWarps, "a peer sink without send warps has no place in this kernel");
constexpr int kCWriterWarps = 3;
using CMailbox = TileMailbox<kConsumerThreads, kCWriterWarps * 32>;
// EPSERVE_GEMM_FP8_MBARRIER_MAILBOX: the hand-over to the writer or send warps by mbarriers
// (sinks/tile_mailbox_mbarrier.cuh), with which the consumer warpgroups never wait for each other.
constexpr bool kMbarrierMailbox = EPSERVE_GEMM_FP8_MBARRIER_MAILBOX != 0;
#if defined(EPSERVE_SINK_BULK) && EPSERVE_SINK_BULK
static_assert(!kMbarrierMailbox, "EPSERVE_GEMM_FP8_MBARRIER_MAILBOX: not with the bulk send warps (their hand-over fences)");
#endif
using MbarrierMailbox = TileMailboxMbarrier<kConsumerThreads, (kSendWarps ? Sink::kSendWarps : kCWriterWarps) * 32>;
constexpr int kMailboxBytes = kMbarrierMailbox ? 64 : 32;  // the mailbox (and its barriers)
// EPSERVE_GEMM_FP8_TILE_IN_RING: GEMM 2's first output rows in the stage of a tile's last k-block.
constexpr bool kTileInRing = EPSERVE_GEMM_FP8_TILE_IN_RING != 0;
#if defined(EPSERVE_SINK_BULK) && EPSERVE_SINK_BULK
static_assert(!kTileInRing, "EPSERVE_GEMM_FP8_TILE_IN_RING: not with the bulk send warps");
#endif
static_assert(!kTileInRing || (!kSwiGLU && kBN == 256 && !EPSERVE_GEMM_FP8_OVERLAP && !kMbarrierMailbox &&
                               !EPSERVE_GEMM_FP8_STMATRIX),
              "EPSERVE_GEMM_FP8_TILE_IN_RING: GEMM 2's 256-wide tiles, with the named-barrier mailbox, without the "
              "overlapped loop or stmatrix");
// The null writer warps' own barrier (kTileInRing: every writer done reading a tile's rows in
// the ring before its stage is freed).
constexpr int kWriterBarrier = 7;
static_assert(MbarrierMailbox::kBytes <= 64, "the mailbox's room");
constexpr int kLightRegs = 40, kConsumerRegs = 232;
static_assert(kConsumers * 128 * kConsumerRegs + 128 * kLightRegs <= 65536, "registers");
static_assert(Sink::kSendWarps <= 3, "the send warps share the producer warpgroup with the TMA warp");
constexpr int kHalfA = 64 * kBK;  // bytes of one warpgroup's 64 rows of an A stage: one TMA box
// A's scales: a box of kScaleBox floats from the tile's first row rounded down to 4 (see the
// top of the file), in a slot of kStageScales bytes (a TMA destination is 128-byte aligned).
constexpr int kScaleAlign = 4;  // floats: 16 bytes
constexpr int kScaleBox = kBM + kScaleAlign;
constexpr int kScaleBoxBytes = kScaleBox * 4;
static_assert(kScaleBoxBytes % 16 == 0 && kScaleBox <= 256, "a TMA box: whole 16 bytes, at most 256 elements");
constexpr int kStageA = kBM * kBK, kStageB = kBN * kBK, kStageScales = (kScaleBoxBytes + 127) / 128 * 128;
constexpr int kLoads = EPSERVE_GEMM_FP8_TMA_LOADS;
static_assert(kLoads >= 0 && kLoads <= 7, "EPSERVE_GEMM_FP8_TMA_LOADS: bit 0 A, bit 1 A's scales, bit 2 B");
constexpr bool kLoadA = kLoads & 1, kLoadScales = kLoads & 2, kLoadB = kLoads & 4;
constexpr bool kMma = EPSERVE_GEMM_FP8_MMA != 0;
// Without wgmmas (the EPSERVE_GEMM_FP8_MMA=0 diagnostic) nothing promotes: the sums are zeroed.
constexpr bool kFirstFma = EPSERVE_GEMM_FP8_FIRST_FMA != 0 && kMma;
template <bool kFirst>
struct KBlockKind {  // which k-block a consumer's loop body is for (kFirstFma)
  static constexpr bool first = kFirst;
};
constexpr bool kCheckTma = EPSERVE_GEMM_FP8_CHECK_TMA != 0;
constexpr bool kUnalignedScales = EPSERVE_GEMM_FP8_UNALIGNED_SCALES != 0;
constexpr bool kSplitTails = EPSERVE_GEMM_FP8_SPLIT_TAILS != 0 && kBN == 256;  // (a 128-wide tile has one half)
// Without wgmmas (the EPSERVE_GEMM_FP8_MMA=0 diagnostic) there is nothing to overlap: off.
constexpr bool kOverlap = EPSERVE_GEMM_FP8_OVERLAP != 0 && kMma;
// EPSERVE_GEMM_FP8_HIDE_HANDSHAKE: the full wait and the release under the wgmmas (top of the file).
constexpr bool kHideHandshake = EPSERVE_GEMM_FP8_HIDE_HANDSHAKE != 0;
constexpr bool kHideRelease = EPSERVE_GEMM_FP8_HIDE_HANDSHAKE == 1;  // =2: the full wait alone
static_assert(EPSERVE_GEMM_FP8_HIDE_HANDSHAKE >= 0 && EPSERVE_GEMM_FP8_HIDE_HANDSHAKE <= 2,
              "EPSERVE_GEMM_FP8_HIDE_HANDSHAKE: 0, 1 (the wait and the release) or 2 (the wait)");
static_assert(!kHideHandshake || (!kOverlap && !kTileInRing),
              "EPSERVE_GEMM_FP8_HIDE_HANDSHAKE: not with the overlapped loop or the tile in the ring");
// EPSERVE_GEMM_FP8_REGISTER_A: whole tiles' wgmmas take A from registers (top of the file).
constexpr bool kRegisterA = EPSERVE_GEMM_FP8_REGISTER_A != 0;
// EPSERVE_GEMM_FP8_B_KBLOCK_MAJOR: B from the k-block-major copy of the weights (top of the file).
constexpr bool kBKblockMajor = EPSERVE_GEMM_FP8_B_KBLOCK_MAJOR != 0;
static_assert(!kOverlap || kBN == 128 || EPSERVE_GEMM_FP8_SPLIT_TAILS, "EPSERVE_GEMM_FP8_OVERLAP acts on tiles a "
              "warpgroup computes one half of: build it with EPSERVE_GEMM_FP8_BN=128 or EPSERVE_GEMM_FP8_SPLIT_TAILS=1");
// Named barriers of the split tails' GEMM 1 epilogue (0 is __syncthreads; 2 and 3 are the
// mailbox's, 4 the peer sink's send warps').
constexpr int kSplitBarrierConsumers = 5, kSplitBarrierFirst = 6;

// The finished tile in shared memory. GEMM 2: kBM rows of kOutCols bf16, each row padded by
// 16 bytes (bank spread; the peer sink reads rows by stride), as in the bf16 kernel; GEMM 1
// with kWriterSwiGLU the same, its kBN sums (gate, then up) a row. GEMM 1: kBM rows of 128
// e4m3 with each row's 16-byte chunks rotated by row % 8 (the consumers' 2-byte writes then
// spread over the banks), followed by the rows' scales.
struct OutTile {
  static constexpr bool kBf16 = !kSwiGLU || kWriterSwiGLU;
  static constexpr int kCols = kBf16 ? kBN : kOutCols;  // columns the consumers write
  static constexpr int kLd = kCols + 8;  // bf16 elements between rows
  static constexpr int kRowBytes = kBf16 ? kLd * 2 : kOutCols;
  static constexpr int kBytes = kBM * kRowBytes + (kBf16 ? 0 : kBM * 4);
  __device__ static int byte_offset(int row, int col) {
    if constexpr (!kBf16) return row * kRowBytes + (((col >> 4) ^ (row & 7)) << 4) + (col & 15);
    return row * kRowBytes + col * 2;
  }
};

// Shared memory: the ring (A, B, A scales), the output tile, then the barriers, the mailbox
// and the scheduler's table; the peer build's row scatter keeps its tables in static shared
// memory, which the dynamic buffer follows at its 1024-byte alignment.
constexpr int kSmemLimit = 227 * 1024;
constexpr int kStaticSmem = Sink::kEnabled ? 2048 : 0;
constexpr int kMaxStages = 6;
// EPSERVE_GEMM_FP8_TAKE_AHEAD's next tile (index, expert, m_abs, m_end, n_abs, rows) waits in
// shared memory: the producer thread's registers are few (kLightRegs), and six more live
// across its loads spill.
constexpr int kAheadInts = kTakeAhead ? 6 : 0;
constexpr int kTailBytes = 2 * kMaxStages * 8 + kMailboxBytes + (kMaxStages * kStageTileInts + kAheadInts) * 4 +
                           (EPSERVE_MAX_LOCAL_EXPERTS + 1) * 4 * (kSmemOffsets ? 2 : 1) + EPSERVE_GEMM_FP8_SMEM_PAD;
constexpr int kStageBytes = kStageA + kStageB + kStageScales;
// EPSERVE_GEMM_FP8_TILE_IN_RING: a stage is one block [A | B | A scales] (1024-aligned, the
// swizzle's), and a finished tile's first kRowsInStage rows go into the stage of its last
// k-block, over its A and B; only its other rows have a region of their own (out_tile).
constexpr int kRingStageBytes = kTileInRing ? (kStageBytes + 1023) / 1024 * 1024 : kStageBytes;
constexpr int kRowsInStage = 80;  // a multiple of 16: a warp's two rows a thread lie on one side
static_assert(!kTileInRing || kRowsInStage * OutTile::kRowBytes <= kStageA + kStageB, "the rows fit a stage's A and B");
constexpr int kOutTileBytes = kTileInRing ? (kBM - kRowsInStage) * OutTile::kRowBytes : OutTile::kBytes;
// A stage's A, B and A scales are kAStride, kBStride, kSaStride bytes from the previous stage's.
constexpr int kAStride = kTileInRing ? kRingStageBytes : kStageA;
constexpr int kBStride = kTileInRing ? kRingStageBytes : kStageB;
constexpr int kSaStride = kTileInRing ? kRingStageBytes : kStageScales;
constexpr int kFitStages = (kSmemLimit - kStaticSmem - kOutTileBytes - kTailBytes) / kRingStageBytes;
constexpr int kStages = kFitStages < kMaxStages ? kFitStages : kMaxStages;
static_assert(kStages >= 2, "shared memory");
constexpr int kSmemBytes = kStages * kRingStageBytes + kOutTileBytes + kTailBytes;
using Scheduler = GroupedTileScheduler<kBM, kOutCols, EPSERVE_GROUP_N, kSmemOffsets>;

struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

// The column where a tile's A-scale box starts: its first row rounded down to 16 bytes.
__device__ __forceinline__ int scale_box_col(int m_abs) {
  return kUnalignedScales ? m_abs : m_abs & ~(kScaleAlign - 1);
}

// GEMM 2's epilogue: sum's first kBlocks n8 blocks to the bf16 output tile. n8 block j:
// values 4j, 4j+1 at (row, col0 + 8j, +1), 4j+2, 4j+3 at row + 8.
template <int kBlocks>
__device__ __forceinline__ void store_bf16_tile_rows(unsigned char* out_tile, const float (&sum)[128], int row,
                                                     int col0) {
  if constexpr (EPSERVE_GEMM_FP8_STMATRIX) {
    // Blocks j and j + 1, each its rows 0-7 and 8-15 (the warp's 16): lane t's address is row
    // t % 8 of block j + t / 16, top (t & 8 == 0) or bottom; from one block pair to the next
    // the addresses move by 16 columns (32 bytes).
    static_assert(kBlocks % 2 == 0, "blocks in pairs");
    const int lane = threadIdx.x % 32;
    const uint32_t base = smem_u32(out_tile + OutTile::byte_offset(row - lane / 4 + (lane & 7) + (lane & 8),
                                                                   col0 - 2 * (lane % 4) + 8 * (lane >> 4)));
#pragma unroll
    for (int j = 0; j < kBlocks; j += 2)
      stmatrix_x4(base + 16 * j, pack_bf16x2(sum[4 * j], sum[4 * j + 1]), pack_bf16x2(sum[4 * j + 2], sum[4 * j + 3]),
                  pack_bf16x2(sum[4 * j + 4], sum[4 * j + 5]), pack_bf16x2(sum[4 * j + 6], sum[4 * j + 7]));
    return;
  }
#pragma unroll
  for (int j = 0; j < kBlocks; ++j) {
    *reinterpret_cast<uint32_t*>(out_tile + OutTile::byte_offset(row, col0 + 8 * j)) =
        pack_bf16x2(sum[4 * j], sum[4 * j + 1]);
    *reinterpret_cast<uint32_t*>(out_tile + OutTile::byte_offset(row + 8, col0 + 8 * j)) =
        pack_bf16x2(sum[4 * j + 2], sum[4 * j + 3]);
  }
}

// GEMM 1's epilogue: SwiGLU and act's quantization of the thread's rows (row, row + 8) into
// the output tile and their scales. The row goes through an empty asm: otherwise the
// compiler keeps the 32 swizzled store addresses in registers across the tile loop, and
// they spill.
__device__ __forceinline__ void store_act_rows(unsigned char* out_tile, float* out_scales, const float (&sum)[128],
                                               int row, int lane) {
  int erow = row;
  asm volatile("" : "+r"(erow));
  const float2 s = swiglu_quantize(sum, lane, [&](int dr, int col, uint16_t v) {
    *reinterpret_cast<uint16_t*>(out_tile + OutTile::byte_offset(erow + dr, col)) = v;
  });
  if (lane % 4 == 0) {
    out_scales[row] = s.x;
    out_scales[row + 8] = s.y;
  }
}

// kWriterSwiGLU: a writer thread's share of GEMM 1's epilogue on the bf16 tile (gate columns
// [0, 128), up [128, 256)): a warp a row, lane l act columns 4l .. 4l + 3, as store_act_rows
// computes them (the same functions on the same bf16 values), stored to act's e4m3 rows and
// the row's scale. writer: 0 .. kCWriterWarps * 32 - 1.
__device__ __forceinline__ void write_act_rows(const unsigned char* out_tile, unsigned char* act, float* act_scales,
                                               long long scale_ld, const SendMailbox& m, int N, int writer) {
  const int warp = writer / 32, lane = writer % 32;
  for (int r = warp; r < m.rows; r += kCWriterWarps) {
    const uint2 gate = *reinterpret_cast<const uint2*>(out_tile + OutTile::byte_offset(r, 4 * lane));
    const uint2 up = *reinterpret_cast<const uint2*>(out_tile + OutTile::byte_offset(r, kHalfN + 4 * lane));
    const uint32_t act0 = swiglu_bf16x2(gate.x, up.x), act1 = swiglu_bf16x2(gate.y, up.y);
    float amax = fmaxf(fmaxf(0.f, bf16x2_amax(act0)), bf16x2_amax(act1));
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    const float inv = fp8_inv_scale(amax);
    *reinterpret_cast<uint32_t*>(act + static_cast<long long>(m.m_abs + r) * N + m.n_abs + 4 * lane) =
        quantize_bf16x2(act0, inv) | static_cast<uint32_t>(quantize_bf16x2(act1, inv)) << 16;
    if (lane == 0) act_scales[(m.n_abs / kHalfN) * scale_ld + m.m_abs + r] = fp8_scale(amax);
  }
}

// tma_load_2d, or (EPSERVE_GEMM_FP8_TMA_LOADS) its bytes counted as arrived without a load;
// with EPSERVE_GEMM_FP8_CHECK_TMA, the hardware's requirements checked first.
template <bool kIssue>
__device__ __forceinline__ void stage_load(const char* what, void* dst, const TensorMap* map, uint64_t* bar, int x,
                                           int y, int elem_bytes, uint32_t dst_align, uint32_t bytes, int tile) {
  if constexpr (kCheckTma) {
    const uint32_t d = smem_u32(dst);
    if ((d & (dst_align - 1)) || ((static_cast<long long>(x) * elem_bytes) & 15)) {
      printf("epserve_grouped_gemm_fp8: block %d, tile %d: TMA load of %s at (x %d, y %d) breaks a rule: shared "
             "destination 0x%x (must be aligned to %u), innermost start %lld bytes (must be a multiple of 16)\n",
             static_cast<int>(blockIdx.x), tile, what, x, y, d, dst_align, static_cast<long long>(x) * elem_bytes);
      __trap();
    }
  }
  if constexpr (kIssue) tma_load_2d(dst, map, bar, x, y);
  else mbarrier_complete_tx(bar, bytes);
}

}  // namespace

// EPSERVE_GEMM_FP8_ZERO_PADDING: per SM, copies of map_a whose row extent is cut at an
// expert's end, so a box reaching past it loads zeros there. A copy is rewritten only after
// every load through it has completed: kMaxStages + 1 copies, used in turn by the tiles that
// need one, each tile at least one load, the rewrite after the tile's first wait for a free
// stage, and the producer never more than the ring's stages ahead of the consumers (who wait
// for each load). A set per SM serves one CTA at a time: the shared memory allows no second.
constexpr int kPaddingMaps = kMaxStages + 1;
static_assert(!kZeroPadding || kSmemBytes > 228 * 1024 / 2, "one CTA an SM: the padding maps are per SM");
extern "C" {
__device__ TensorMap epserve_gemm_padding_maps[kZeroPadding ? 256 : 1][kPaddingMaps];
}

// EPSERVE_GEMM_FP8_L2_SIDES: each SM's L2 side (0 or 1) by %smid, written by the host.
extern "C" {
__device__ unsigned char epserve_gemm_sm_side[256];
}

// EPSERVE_GEMM_FP8_TRACE (a diagnostic build): %clock64 at points of each tile, for the first
// kTraceCtas CTAs and kTraceTiles tiles of each, by predicated stores (no branch in the tile
// loop). Slots: 0-3 the first consumer warpgroup before its tile's first wait, after it, after
// the k-loop, after the hand-over; 4-5 the same warpgroup after its k-blocks 0 and 1 (whole
// 128-row tiles); 6-7 the producer before taking the tile from the counter and after decoding it
// (with EPSERVE_GEMM_FP8_TAKE_AHEAD, 7 only, but for the first tile); 8 the first warpgroup
// before its k-block 0's first MMA (whole tiles). With EPSERVE_GEMM_FP8_TRACE=2 also 9-16 and
// 17-24: the first and the second warpgroup (their threads 0 and 128) after each of their
// k-blocks 0-7 of whole tiles (these stores slow GEMM 1 by ~7%: compare =2 builds with =2).
constexpr bool kTrace = EPSERVE_GEMM_FP8_TRACE != 0;
constexpr bool kTraceKBlocks = EPSERVE_GEMM_FP8_TRACE == 2;
constexpr int kTraceCtas = 132, kTraceTiles = 128, kTraceSlots = 25, kTracedKBlocks = 8;
extern "C" {
__device__ long long epserve_gemm_trace[kTrace ? kTraceCtas * kTraceTiles * kTraceSlots : 1];
}
__device__ __forceinline__ void trace_point(bool on, int seq, int slot) {
  if constexpr (kTrace) {
    long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
    const int i = (min(static_cast<int>(blockIdx.x), kTraceCtas - 1) * kTraceTiles + min(seq, kTraceTiles - 1)) *
                      kTraceSlots + slot;
    const bool p = on && blockIdx.x < kTraceCtas && seq < kTraceTiles;
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p st.global.u64 [%1], %2;\n}\n" ::"r"(static_cast<int>(p)),
                 "l"(epserve_gemm_trace + i), "l"(t)
                 : "memory");
  }
}

extern "C" __constant__ int epserve_gemm_smem_bytes = kSmemBytes;
extern "C" __constant__ int epserve_gemm_l2_sides = kL2Sides;
extern "C" __constant__ int epserve_gemm_threads = kThreads;
extern "C" __constant__ int epserve_gemm_stages = kStages;
extern "C" __constant__ int epserve_gemm_b_box_rows = kSwiGLU ? kBN / 2 : kBN;  // the rows of B's TMA box
extern "C" __constant__ int epserve_gemm_scale_box_cols = kScaleBox;  // the columns (floats) of A's scale box
extern "C" __constant__ int epserve_gemm_b_kblock_major = kBKblockMajor;  // map_b over [E * K / 128 * b_rows, 128]

// map_a: A [M, K] e4m3 in 64-row x 128-byte boxes; map_sa: A's scales [K / 128, >= M] fp32
// in 1 x epserve_gemm_scale_box_cols boxes; map_b: B [E * b_rows, K] e4m3 in boxes of
// epserve_gemm_b_box_rows rows; b_scales [E, b_rows / 128, K / 128]. N: output columns (b_rows = N, or 2N with SwiGLU);
// N and K multiples of 128. C: bf16 [M, N] (null sink; may be null with the peer sink), or
// with SwiGLU e4m3 [M, N] and c_scales [N / 128, c_scale_ld]. tile_counter: two ints (three,
// 8-byte aligned, with EPSERVE_GEMM_FP8_L2_SIDES), zero at launch and zero again when the
// kernel ends (the last CTA resets them).
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    epserve_grouped_gemm_fp8(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_sa,
                             const __grid_constant__ TensorMap map_b, const float* __restrict__ b_scales,
                             void* __restrict__ C, float* __restrict__ c_scales, long long c_scale_ld,
                             const int* __restrict__ expert_offsets, int num_experts, int N, int K,
                             const PeerSendConfig cfg, int gate, int* __restrict__ tile_counter) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* ring_a = smem;
  unsigned char* ring_b = ring_a + (kTileInRing ? kStageA : kStages * kStageA);
  float* ring_sa = reinterpret_cast<float*>(kTileInRing ? ring_b + kStageB : ring_b + kStages * kStageB);
  unsigned char* out_tile = smem + kStages * kRingStageBytes;  // (kTileInRing: rows kRowsInStage on)
  float* out_scales = reinterpret_cast<float*>(out_tile + kBM * OutTile::kRowBytes);  // GEMM 1 only
  uint64_t* full = reinterpret_cast<uint64_t*>(out_tile + kOutTileBytes);
  uint64_t* empty = full + kStages;
  SendMailbox* mailbox = reinterpret_cast<SendMailbox*>(full + 2 * kMaxStages);
  // [kMaxStages][kStageTileInts]
  int* stage_tile = reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(mailbox) + kMailboxBytes);
  int* ahead = stage_tile + kMaxStages * kStageTileInts;  // [kAheadInts]
  int* mtile_prefix = ahead + kAheadInts;
  int* smem_offsets = mtile_prefix + EPSERVE_MAX_LOCAL_EXPERTS + 1;  // EPSERVE_GEMM_FP8_SMEM_OFFSETS

  if (threadIdx.x == 0) {
    if (smem_u32(smem) & 1023u) __trap();  // the 128-byte swizzle's pattern is tied to 1024-byte alignment
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kStageReleases);  // one arrival per consumer thread: see `release`
    }
    if constexpr (kMbarrierMailbox) MbarrierMailbox::init(mailbox);
    fence_mbarrier_init();
  }
  Scheduler sched;
  // Its __syncthreads publishes the barriers too.
  sched.init(expert_offsets, num_experts, N, mtile_prefix, smem_offsets);
  const int k_blocks = K / kBK;
  const int b_rows = kSwiGLU ? 2 * N : N;  // B rows per expert
  // Read through a shuffle so the compiler knows it is warp-uniform (the bf16 kernel says why).
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);

  if (warpgroup == kProducerWarpgroup) {
    setmaxnreg_dec<kLightRegs>();
    const int warp = (threadIdx.x % 128) / 32;
    // kTileInRing: the stage holding the next tile's first rows, that of its last k-block.
    // Every tile handed over is k_blocks stages further on in the ring (each tile is, and all
    // are handed over where the stage is held), so the writer and send warps follow the ring
    // without being told.
    int ring_next = 0;  // the stage of the next tile's first k-block
    auto held_stage = [&]() {
      const int s = (ring_next + k_blocks - 1) % kStages;
      ring_next = (ring_next + k_blocks) % kStages;
      return s;
    };
    // Frees it for the producer once every writer or send thread has read its rows: the count
    // of arrivals the consumers' releases would have made.
    auto free_held = [&](int s) { mbarrier_arrive_count(&empty[s], kStageReleases); };
    // The tile's rows [kRowsInStage, kBM) in out_tile, indexed from the tile's first row.
    const bf16_t* const rows_out = reinterpret_cast<const bf16_t*>(out_tile) - kRowsInStage * OutTile::kLd;
    if constexpr (kSendWarps) {
      if constexpr (kTileInRing) {
        int held = 0;  // the stage of the tile being sent
        if (warp >= 1 && warp <= Sink::kSendWarps && gate >= 0)
          Sink::template service_split<kConsumerThreads>(
              [&]() {
                held = held_stage();
                return reinterpret_cast<const bf16_t*>(smem + held * kRingStageBytes);
              },
              rows_out, OutTile::kLd, kRowsInStage, [&](int send_tid) {
                if (send_tid == 0) free_held(held);
              },
              mailbox, cfg, threadIdx.x % 128 - 32);
      } else {
        if (warp >= 1 && warp <= Sink::kSendWarps && gate >= 0)
          Sink::template service<kConsumerThreads, kMbarrierMailbox ? 1 : 0>(
              SmemTile{reinterpret_cast<const bf16_t*>(out_tile), OutTile::kLd, 0, 0}, mailbox, cfg,
              threadIdx.x % 128 - 32);
      }
    } else {
      if (warp >= 1 && warp <= kCWriterWarps) {
        const int writer = threadIdx.x % 128 - 32;
        constexpr int kChunks = kOutCols * (kSwiGLU ? 1 : 2) / 16;  // 16-byte chunks of a tile row
        const int row_bytes = N * (kSwiGLU ? 1 : 2);
        // Rows [r0, r1) of the tile to C, row r read at src + OutTile::byte_offset(r, .).
        auto copy_rows = [&](const SendMailbox& m, const unsigned char* src, int r0, int r1) {
          const int elem = kSwiGLU ? 1 : 2;
          for (int i = writer + r0 * kChunks; i < r1 * kChunks; i += kCWriterWarps * 32) {
            const int r = i / kChunks, c = (i % kChunks) * 16 / elem;  // c: the chunk's first column
            if (c < m.cols)
              st_global_v4(static_cast<unsigned char*>(C) + static_cast<long long>(m.m_abs + r) * row_bytes +
                               static_cast<long long>(m.n_abs + c) * elem,
                           ld_shared_v4(src + OutTile::byte_offset(r, c)));
          }
        };
        auto write_out = [&](const SendMailbox& m) {
          if constexpr (kTileInRing) {
            // The rows in the stage first, which is then freed, then those in out_tile.
            const int held = held_stage();
            const int split = min(m.rows, kRowsInStage);
            copy_rows(m, smem + held * kRingStageBytes, 0, split);
            named_barrier_sync_across_roles<kWriterBarrier, kCWriterWarps * 32>();
            if (writer == 0) free_held(held);
            copy_rows(m, reinterpret_cast<const unsigned char*>(rows_out), split, m.rows);
            return;
          }
          if constexpr (kWriterSwiGLU) {
            write_act_rows(out_tile, static_cast<unsigned char*>(C), c_scales, c_scale_ld, m, N, writer);
            return;
          }
          copy_rows(m, out_tile, 0, m.rows);
          if constexpr (kSwiGLU) {
            for (int r = writer; r < m.rows; r += kCWriterWarps * 32)
              c_scales[(m.n_abs / kHalfN) * c_scale_ld + m.m_abs + r] = out_scales[r];
          }
        };
        if constexpr (kMbarrierMailbox) MbarrierMailbox::serve(mailbox, write_out);
        else CMailbox::serve(mailbox, write_out);
      }
    }
    // Producer: one thread takes tiles from the counter and keeps the ring full. A tile's first
    // stage carries its index to the consumers (the full barrier publishes it); index -1 in
    // an otherwise empty stage tells them to stop.
    if (threadIdx.x % 128 == 0) {
      int stage = 0;
      uint32_t phase = 0;
      TensorMap* padding_maps = nullptr;
      int padding_map = 0;
      if constexpr (kZeroPadding) {
        int smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        padding_maps = epserve_gemm_padding_maps[smid & 255];
        for (int m = 0; m < kPaddingMaps; ++m) padding_maps[m] = map_a;
      }
      int side = 0;
      if constexpr (kL2Sides) {
        int smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        side = epserve_gemm_sm_side[smid & 255];
      }
      // The lines of a tile's weight scales into this SM's L1, where the consumers' __ldg of
      // them at the tile's first k-block will find them (kPublishTile).
      auto prefetch_b_scales = [&](const GroupedTile& t) {
        const float* sb = b_scales + static_cast<long long>(t.expert) * (b_rows / kHalfN) * k_blocks;
        const int nb0 = t.n_abs / kHalfN, nb1 = kSwiGLU ? (N + t.n_abs) / kHalfN : nb0 + 1;
        const bool second = kSwiGLU || (kBN == 256 && t.n_abs + kHalfN < N);
        for (int h = 0; h < (second ? 2 : 1); ++h) {
          const char* p = reinterpret_cast<const char*>(sb + static_cast<long long>(h ? nb1 : nb0) * k_blocks);
          for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{127};
               a < reinterpret_cast<uintptr_t>(p) + 4 * k_blocks; a += 128)
            asm volatile("prefetch.global.L1 [%0];" ::"l"(a));
        }
      };
      int seq = 0;  // tiles so far (EPSERVE_GEMM_FP8_TRACE)
      // A take from the counter in two steps: issue the atomic (its answer is a register the
      // thread waits on only where it reads it), then turn the answer into a tile index.
      auto take_issue = [&]() -> unsigned long long {
        if constexpr (kL2Sides)  // counts taken from the front (low word) and from the back
          return atomicAdd(reinterpret_cast<unsigned long long*>(tile_counter), side ? 1ull << 32 : 1ull);
        else
          return static_cast<unsigned int>(atomicAdd(tile_counter, 1));
      };
      auto take_index = [&](unsigned long long taken) -> int {
        if constexpr (kL2Sides) {
          const int front = static_cast<int>(taken & 0xffffffffu), back = static_cast<int>(taken >> 32);
          return front + back >= sched.total_tiles ? sched.total_tiles
                                                   : (side ? sched.total_tiles - 1 - back : front);
        } else {
          return static_cast<int>(taken);
        }
      };
      // EPSERVE_GEMM_FP8_TAKE_AHEAD: the next tile, taken during this one's loads, decoded
      // into `ahead`.
      auto decode_ahead = [&](int next_index) {
        ahead[0] = next_index;
        if (next_index < sched.total_tiles) {
          const GroupedTile n = sched.tile(next_index);
          store_tile(ahead, n);
          if constexpr (kPublishTile) prefetch_b_scales(n);
        }
      };
      if constexpr (kTakeAhead) {
        trace_point(true, seq, 6);
        decode_ahead(take_index(take_issue()));
        trace_point(true, seq, 7);
      }
      for (;;) {
        int index;
        if constexpr (kTakeAhead) {
          index = ahead[0];
        } else {
          trace_point(true, seq, 6);
          index = take_index(take_issue());
        }
        if (index >= sched.total_tiles) {
          mbarrier_wait(&empty[stage], phase ^ 1);
          stage_tile[stage * kStageTileInts] = -1;
          mbarrier_expect_tx(&full[stage], 0);
          // The last CTA to stop resets the counters for the next launch on the stream (with
          // kL2Sides, words 0 and 1 are the 64-bit tile counter, word 2 counts the stops).
          if (atomicAdd(tile_counter + (kL2Sides ? 2 : 1), 1) == static_cast<int>(gridDim.x) - 1) {
            tile_counter[0] = 0;
            tile_counter[1] = 0;
            if constexpr (kL2Sides) tile_counter[2] = 0;
          }
          break;
        }
        GroupedTile t;
        if constexpr (kTakeAhead) {
          t = load_tile(ahead);
        } else {
          t = sched.tile(index);
          trace_point(true, seq, 7);  // after the tile's coordinates: after the counter's answer
        }
        ++seq;
        if constexpr (kPublishTile && !kTakeAhead) prefetch_b_scales(t);
        const int a_boxes = t.rows > 64 ? 2 : 1;  // a tail of at most 64 rows loads (and computes) one half
        // kBKblockMajor: k-block kt of expert e's rows is the [b_rows, 128] block e * k_blocks + kt
        const int b_row = (kBKblockMajor ? t.expert * k_blocks : t.expert) * b_rows + t.n_abs;
        const TensorMap* a_map = &map_a;
        // One k-block's stage: wait until it is free, then its loads (with the tile in its
        // first stage).
        auto load_k_block = [&](int kt) {
          mbarrier_wait(&empty[stage], phase ^ 1);  // every consumer thread is done with the stage
          if (kt == 0) {
            int* st = stage_tile + stage * kStageTileInts;
            st[0] = index;
            if constexpr (kPublishTile) store_tile(st, t);
          }
          if (kZeroPadding && kt == 0 && t.m_abs + 64 * a_boxes > t.m_end) {
            // Rows past the expert's end (the next expert's) load as zeros: the same sums for
            // the tile's real rows, and zeros switch the tensor cores' multipliers less.
            TensorMap* m = padding_maps + padding_map;
            padding_map = padding_map + 1 == kPaddingMaps ? 0 : padding_map + 1;
            tensor_map_set_extent<1>(m, t.m_end);
            a_map = m;
          }
          mbarrier_expect_tx(&full[stage], a_boxes * kHalfA + kStageB + kScaleBoxBytes);
          for (int h = 0; h < a_boxes; ++h)
            stage_load<kLoadA>("A", ring_a + stage * kAStride + h * kHalfA, a_map, &full[stage], kt * kBK,
                               t.m_abs + 64 * h, 1, 1024, kHalfA, index);
          // The scales of the tile's rows, from a 16-byte aligned column (past the end of A:
          // zeros, never used).
          stage_load<kLoadScales>("A scales", ring_sa + stage * (kSaStride / 4), &map_sa, &full[stage],
                                  scale_box_col(t.m_abs), kt, 4, 128, kScaleBoxBytes, index);
          unsigned char* b = ring_b + stage * kBStride;
          const int bx = kBKblockMajor ? 0 : kt * kBK, by = kBKblockMajor ? b_row + kt * b_rows : b_row;
          if constexpr (kSwiGLU) {  // gate rows, then the matching up rows
            stage_load<kLoadB>("B gate", b, &map_b, &full[stage], bx, by, 1, 1024, kStageB / 2, index);
            stage_load<kLoadB>("B up", b + kStageB / 2, &map_b, &full[stage], bx, by + N, 1, 1024, kStageB / 2,
                               index);
          } else {
            stage_load<kLoadB>("B", b, &map_b, &full[stage], bx, by, 1, 1024, kStageB, index);
          }
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
        };
        if constexpr (kTakeAhead) {
          // The next tile's atomic goes out after this tile's first loads, before the wait for
          // its second stage (the producer's usual wait, about a k-block), and its answer is
          // read after that wait, when it is back: neither the counter's round trip nor the
          // decode then sits between this tile's last load and the next tile's first. (Between
          // two loops: taken inside the k-loop, its registers spilled.)
          load_k_block(0);
          // (no stamp 6 here: one more register live across the take spilled in the trace build)
          const unsigned long long taken = take_issue();
          if (k_blocks > 1) mbarrier_wait(&empty[stage], phase ^ 1);  // load_k_block(1)'s wait then returns at once
          decode_ahead(take_index(taken));
          trace_point(true, seq, 7);
          for (int kt = 1; kt < k_blocks; ++kt) load_k_block(kt);
        } else {
          for (int kt = 0; kt < k_blocks; ++kt) load_k_block(kt);
        }
      }
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    const int tid = threadIdx.x;  // 0 .. kConsumerThreads - 1
    const int lane = tid % 32, warp = (tid % 128) / 32;
    const int row = warpgroup * 64 + warp * 16 + lane / 4;  // this thread's first row in the tile
    // The rings' wgmma descriptors, by their low words: an operand d bytes into a ring is
    // ring_*_desc + d / 16 (common/ptx.cuh, smem_desc_sw128_lo).
    const uint32_t ring_a_desc = smem_desc_sw128_lo(ring_a), ring_b_desc = smem_desc_sw128_lo(ring_b);
    // Frees stage s for the producer's next TMA loads into it. Every thread arrives for
    // itself, after its own reads of the stage: besides the wgmmas (whose wait precedes every
    // release), the consumers read the stage's A scales (ring_sa) with ordinary loads, and the
    // split tails' promote_stage reads them after the MMA, just before it frees the stage.
    // With one arrival per warpgroup (its thread 0, as this kernel first had), the
    // warpgroup's other three warps could still be about to read their rows' scales when the
    // producer, seeing the stage free, had TMA overwrite them with the next k-block's (or the
    // next tile's): those rows' sums then took one k-block at a wrong scale. Each thread's
    // arrive (a release) orders its own loads before it, and the producer's wait acquires
    // them all. (One arrival per warp after a __syncwarp is as correct, and measured up to
    // 1.5% slower on GEMM 1: the lane branch and the warp sync sit between the wgmma wait and
    // the promotion; notes/gemm.md, thirteenth session.)
    auto release = [&](int s) {
      if constexpr (kReleaseByWarpgroup) {  // the diagnostic build of the race (top of the file)
        if (tid % 128 == 0) mbarrier_arrive(&empty[s]);
      } else {
        mbarrier_arrive(&empty[s]);
      }
    };
    int stage = 0;
    uint32_t phase = 0;
    auto advance = [&] {
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    };
    // kHideHandshake: one wgmma group of the k-block in `stage`, with the ring's handshake
    // while it runs: the wait for the next k-block's stage (waits_next: on its last group, but
    // for the tile's last k-block, whose next stage the tile loop waits for) and, with
    // kHideRelease, the release of the previous k-block's stage (frees_previous: on the
    // k-block's first group, from its second k-block on). The k-loop then waits on its first
    // k-block's stage only and, with kHideRelease, frees its last one by release_previous
    // after the loop.
    auto next_stage_wait = [&] {
      const int next = stage + 1 == kStages ? 0 : stage + 1;
      mbarrier_wait(&full[next], next == 0 ? phase ^ 1 : phase);
    };
    auto release_previous = [&] { release(stage == 0 ? kStages - 1 : stage - 1); };
    auto hidden_k_block_mma = [&](float(&p)[64], auto issue, bool frees_previous, bool waits_next) {
      if constexpr (kMma) issue();
      if (frees_previous) release_previous();
      if (waits_next) next_stage_wait();
      if constexpr (kMma) {
        k_block_wait<0>(p);
      } else {
#pragma unroll
        for (int i = 0; i < 64; ++i) p[i] = 0.f;
      }
    };
    float sum[128];
    float part[64];
    float part2_n128[64];  // EPSERVE_GEMM_FP8_OVERLAP's second part with 128-wide tiles (other builds never touch it)
    bool tile_pending = false;  // the writer warps still hold the shared output tile
    int handed = 0;             // tiles handed over (kMbarrierMailbox: the mailbox's phases)
    int seq = 0;  // tiles so far (EPSERVE_GEMM_FP8_TRACE)
    // kTileInRing: the consumers keep the stage of a tile's last k-block (k-block held_from)
    // for its first output rows, and the writer or send warps free it. Gated off (the math
    // alone, no output), every stage is freed as usual.
    const int held_from = kTileInRing && (!Sink::kEnabled || gate >= 0) ? k_blocks - 1 : k_blocks;
    for (;;) {
      trace_point(tid == 0, seq, 0);
      mbarrier_wait(&full[stage], phase);  // the tile's first stage (the k-loop's wait returns at once)
      trace_point(tid == 0, seq, 1);
      const int* st = stage_tile + stage * kStageTileInts;
      const int index = st[0];
      if (index < 0) break;
      const GroupedTile t = kPublishTile ? load_tile(st) : sched.tile(index);
      // The weight scale rows of the tile's two halves: the gate block and its up block, or
      // two neighbouring blocks; GEMM 2's last tile may have no second half.
      const bool second_half = kSwiGLU || (kBN == 256 && t.n_abs + kHalfN < N);
      const int nb0 = t.n_abs / kHalfN;
      const int nb1 = kSwiGLU ? (N + t.n_abs) / kHalfN : (second_half ? nb0 + 1 : nb0);
      const float* sb = b_scales + static_cast<long long>(t.expert) * (b_rows / kHalfN) * k_blocks;
      const float* sb0 = sb + static_cast<long long>(nb0) * k_blocks;
      const float* sb1 = sb + static_cast<long long>(nb1) * k_blocks;
      // EPSERVE_GEMM_FP8_SPLIT_TAILS: a tile of at most 64 real rows, computed by both
      // warpgroups, warpgroup h on half h of the first 64 rows (top of the file). With it, and
      // with 128-wide tiles, a warpgroup computes one half: its sums go to sum[0, 64), the
      // scales of its rows are those of hrow (srow, or `row` for a 128-wide tile).
      const bool split = kSplitTails && t.rows <= 64;
      const bool one_half = kBN == 128 || split;
      const int srow = warp * 16 + lane / 4;
      const bool computes = split ? (warpgroup == 0 || second_half) : warpgroup * 64 < t.rows;
      if (one_half && computes) {
        const int hrow = split ? srow : row;
        const int a_off = split ? 0 : warpgroup * kHalfA;  // the stage's first 64 rows of A are its only box
        const int b_off = split ? warpgroup * kHalfN * kBK : 0;
        const float* sbh = split && warpgroup == 1 ? sb1 : sb0;
        // Reads the A scales of k-block `stage`, frees the stage, promotes p into the sum.
        auto promote_stage = [&](const float(&p)[64], float b_scale, bool frees = true) {
          const float* sa = ring_sa + stage * (kSaStride / 4) + (t.m_abs - scale_box_col(t.m_abs));
          const float a_lo = sa[hrow], a_hi = sa[hrow + 8];
          if (frees) release(stage);
          if constexpr (kMma) promote<0>(sum, p, a_lo * b_scale, a_hi * b_scale);
          advance();
        };
#pragma unroll
        for (int i = 0; i < 64; ++i) sum[i] = 0.f;
        if constexpr (kOverlap) {
          // The issue side runs one k-block ahead of `stage`: part holds the even k-blocks,
          // part2 the odd ones.
          int istage = stage;
          uint32_t iphase = phase;
          auto issue = [&](float(&p)[64]) {
            mbarrier_wait(&full[istage], iphase);
            k_block_mma_issue(p, ring_a + istage * kAStride + a_off, ring_b + istage * kBStride + b_off);
            if (++istage == kStages) {
              istage = 0;
              iphase ^= 1;
            }
          };
          // A split tail's second part is sum[64, 128), unused there (GEMM 1's first warpgroup
          // fills it with the up half only after the loop): a part of its own beside the
          // 128 sums spills. A 128-wide tile has no sum[64, 128).
          float(&part2)[64] = *reinterpret_cast<float(*)[64]>(kBN == 256 ? sum + 64 : part2_n128);
          // Two k-blocks an iteration, the same wgmma bracket and waits on every pass (a
          // wait on a path of its own makes ptxas serialize the wgmmas); the last one or two
          // k-blocks after the loop.
          float bs0 = __ldg(sbh), bs1;
          issue(part);
          int kt = 0;
          for (; kt + 2 < k_blocks; kt += 2) {
            bs1 = __ldg(sbh + kt + 1);
            issue(part2);  // k-block kt + 1, while kt runs
            k_block_wait<1>(part);
            promote_stage(part, bs0);
            bs0 = __ldg(sbh + kt + 2);
            issue(part);  // k-block kt + 2, while kt + 1 runs
            k_block_wait<1>(part2);
            promote_stage(part2, bs1);
          }
          if (kt + 1 < k_blocks) {
            bs1 = __ldg(sbh + kt + 1);
            issue(part2);
            k_block_wait<1>(part);
            promote_stage(part, bs0);
            k_block_wait<0>(part2);
            promote_stage(part2, bs1);
          } else {
            k_block_wait<0>(part);
            promote_stage(part, bs0);
          }
        } else if constexpr (kHideHandshake) {
          for (int kt = 0; kt < k_blocks; ++kt) {
            const float b_scale = __ldg(sbh + kt);
            if (kt == 0) mbarrier_wait(&full[stage], phase);  // later k-blocks': under the last one's wgmmas
            const uint32_t a = ring_a_desc + (stage * kAStride + a_off) / 16;
            const uint32_t b = ring_b_desc + (stage * kBStride + b_off) / 16;
            hidden_k_block_mma(part, [&] { k_block_mma_issue(part, a, b); }, kHideRelease && kt > 0, kt + 1 < k_blocks);
            promote_stage(part, b_scale, !kHideRelease);
          }
          if constexpr (kHideRelease) release_previous();
        } else {
          for (int kt = 0; kt < k_blocks; ++kt) {
            const float b_scale = __ldg(sbh + kt);  // in flight during the wait
            mbarrier_wait(&full[stage], phase);
            // For a split tail, the default build's first warpgroup issues these very wgmmas
            // for half h.
            k_block_mma<kMma>(part, ring_a_desc + (stage * kAStride + a_off) / 16,
                              ring_b_desc + (stage * kBStride + b_off) / 16);
            promote_stage(part, b_scale, !kTileInRing || kt < held_from);
          }
        }
      } else if (kBN == 256 && computes) {
        // kFirst: k-block 0 with kFirstFma (its promotion starts the sums)
        auto k_block = [&](int kt, auto first) {
          constexpr bool kFirst = decltype(first)::first;
          const float b_scale0 = __ldg(sb0 + kt), b_scale1 = __ldg(sb1 + kt);  // in flight during the wait
          if (!kHideHandshake || kt == 0) mbarrier_wait(&full[stage], phase);  // kHideHandshake: see hidden_k_block_mma
          const float* sa = ring_sa + stage * (kSaStride / 4) + (t.m_abs - scale_box_col(t.m_abs));
          const float a_lo = sa[row], a_hi = sa[row + 8];
          const uint32_t a = ring_a_desc + (stage * kAStride + warpgroup * kHalfA) / 16;
          const uint32_t b = ring_b_desc + stage * kBStride / 16;
          // kRegisterA: this k-block's A rows into registers once, for both halves
          uint32_t a_frag[16];  // (unused without kRegisterA)
          if constexpr (kRegisterA) load_a_k_block(a_frag, ring_a + stage * kAStride + warpgroup * kHalfA, warp, lane);
          auto issue_half = [&](uint32_t b_half) {
            if constexpr (kRegisterA) k_block_mma_issue_rs(part, a_frag, b_half);
            else k_block_mma_issue(part, a, b_half);
          };
          auto mma_half = [&](uint32_t b_half) {
            if constexpr (kRegisterA && kMma) {
              issue_half(b_half);
              k_block_wait<0>(part);
            } else {
              k_block_mma<kMma>(part, a, b_half);
            }
          };
          if constexpr (kTrace) trace_point(tid == 0 && kt == 0, seq, 8);
          const bool frees = !kTileInRing || kt < held_from;
          if constexpr (kHideHandshake)
            hidden_k_block_mma(part, [&] { issue_half(b); }, kHideRelease && kt > 0, !second_half && kt + 1 < k_blocks);
          else mma_half(b);
          if (!kHideRelease && !second_half && frees) release(stage);
          if constexpr (kMma) promote<0, kFirst>(sum, part, a_lo * b_scale0, a_hi * b_scale0);  // (a probe: sum stays 0)
          if (second_half) {
            if constexpr (kHideHandshake)
              hidden_k_block_mma(part, [&] { issue_half(b + kHalfN * kBK / 16); }, false, kt + 1 < k_blocks);
            else mma_half(b + kHalfN * kBK / 16);
            if (!kHideRelease && frees) release(stage);
            if constexpr (kMma) promote<64, kFirst>(sum, part, a_lo * b_scale1, a_hi * b_scale1);
          } else if constexpr (kFirst) {
#pragma unroll
            for (int i = 64; i < 128; ++i) sum[i] = 0.f;
          }
          if constexpr (kTrace) trace_point(tid == 0 && kt < 2, seq, 4 + min(kt, 1));
          if constexpr (kTraceKBlocks)
            trace_point(tid % 128 == 0 && kt < kTracedKBlocks, seq,
                        9 + warpgroup * kTracedKBlocks + min(kt, kTracedKBlocks - 1));
          advance();
        };
        int kt = 0;
        if constexpr (kFirstFma) {
          k_block(kt++, KBlockKind<true>{});
        } else {
#pragma unroll
          for (int i = 0; i < 128; ++i) sum[i] = 0.f;
        }
        for (; kt < k_blocks; ++kt) k_block(kt, KBlockKind<false>{});
        if constexpr (kHideRelease) release_previous();
      } else {  // no rows in this warpgroup's half: free the stages for the producer
        for (int kt = 0; kt < k_blocks; ++kt) {
          mbarrier_wait(&full[stage], phase);
          if (!kTileInRing || kt < held_from) release(stage);
          advance();
        }
      }

      trace_point(tid == 0, seq++, 2);
      if constexpr (Sink::kEnabled) {
        if (gate < 0) continue;  // the peer sink gated off: the math alone
      }
      if (tile_pending) {  // wait until the writer warps are done with the last tile
        if constexpr (kMbarrierMailbox) MbarrierMailbox::drain(mailbox, handed);
        else if constexpr (kSendWarps) Sink::template drain<kConsumerThreads>();
        else CMailbox::drain();
      } else if constexpr (kTileInRing) {
        // Both warpgroups' wgmmas are done with the held stage before either writes over it
        // (the drain, which every consumer thread joins, orders the later tiles).
        named_barrier_sync<kSplitBarrierConsumers, kConsumerThreads>();
      }
      // kTileInRing: the thread's rows in the stage of the tile's last k-block (rows below
      // kRowsInStage) or in out_tile (the others), at the same offsets from the tile's first row.
      unsigned char* const tile_out =
          !kTileInRing ? out_tile
          : (split ? srow : row) < kRowsInStage
              ? smem + (stage + kStages - 1) % kStages * kRingStageBytes
              : out_tile - kRowsInStage * OutTile::kRowBytes;
      if (split) {
        if constexpr (kSwiGLU && !kWriterSwiGLU) {
          // The second warpgroup's up half to the first one, as the bf16 pairs the epilogue
          // makes of it first (pack_bf16x2 of a bf16 value widened to fp32 gives it back), in
          // the output tile's bytes (16 KB, free since the drain; word i of thread t at
          // i * 128 + t); the first warpgroup then runs the default epilogue.
          static_assert(kBM * OutTile::kRowBytes >= 32 * 128 * 4, "the split tails' exchange fits the output tile");
          uint32_t* xchg = reinterpret_cast<uint32_t*>(out_tile);
          const int t128 = tid % 128;
          if (warpgroup == 1) {
#pragma unroll
            for (int i = 0; i < 32; ++i) xchg[i * 128 + t128] = pack_bf16x2(sum[2 * i], sum[2 * i + 1]);
          }
          named_barrier_sync<kSplitBarrierConsumers, kConsumerThreads>();
          if (warpgroup == 0) {
#pragma unroll
            for (int i = 0; i < 32; ++i) {
              const uint32_t w = xchg[i * 128 + t128];
              sum[64 + 2 * i] = bf16_lo(w);
              sum[64 + 2 * i + 1] = bf16_hi(w);
            }
            named_barrier_sync<kSplitBarrierFirst, 128>();  // every word read before the tile is written over it
            store_act_rows(out_tile, out_scales, sum, srow, lane);
          }
        } else if (computes) {  // half h's 128 columns of the first 64 rows
          store_bf16_tile_rows<kHalfN / 8>(tile_out, sum, srow, warpgroup * kHalfN + 2 * (lane % 4));
        }
      } else if (computes) {
        if constexpr (!OutTile::kBf16) {
          store_act_rows(out_tile, out_scales, sum, row, lane);
        } else {
          store_bf16_tile_rows<OutTile::kCols / 8>(tile_out, sum, row, 2 * (lane % 4));
        }
      }
      // kTileInRing: generic writes into a stage TMA writes next, once the writer warps free it.
      if constexpr (kTileInRing) fence_proxy_async_shared();
      // The hand-over's barrier publishes the tile to the writer warps.
      const SmemTile tile{reinterpret_cast<const bf16_t*>(out_tile), OutTile::kLd, t.rows, min(kOutCols, N - t.n_abs)};
      if constexpr (kMbarrierMailbox) MbarrierMailbox::hand_over(mailbox, tile, t.m_abs, t.n_abs, tid);
      else if constexpr (kSendWarps) Sink::template hand_over<kConsumerThreads>(mailbox, tile, t.m_abs, t.n_abs, tid);
      else CMailbox::hand_over(mailbox, tile, t.m_abs, t.n_abs, tid);
      ++handed;
      trace_point(tid == 0, seq - 1, 3);
      tile_pending = true;
    }
    if constexpr (kMbarrierMailbox) {
      if (!kSendWarps || gate >= 0) MbarrierMailbox::shutdown(mailbox, tile_pending, handed, tid);
    } else if constexpr (kSendWarps) {
      if (gate >= 0) Sink::template shutdown<kConsumerThreads>(mailbox, tile_pending, tid);
    } else {
      CMailbox::shutdown(mailbox, tile_pending, tid);
    }
  }
}
