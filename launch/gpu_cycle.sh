#!/usr/bin/env bash
# The checks and measurements the issues ask of a GPU machine, in as few device calls as
# possible. Each stage logs to $OUT/<stage>.log (the device tool brings $OUT back) and prints
# its summary lines; results/ is packed into $OUT/results.tgz.
#
#   bash launch/gpu_cycle.sh test run          # ~4-5 min on two H200s
#   bash launch/gpu_cycle.sh bench fuzz soak   # ~5-6 min
#   bash launch/gpu_cycle.sh timing            # the GEMMs and the one-GPU combine, ~1 min
#   bash launch/gpu_cycle.sh profile           # ncu: the wgmma GEMMs' L2/DRAM bytes per build, ~2 min
#   bash launch/gpu_cycle.sh profile-fp8       # ncu: the FP8 GEMMs' clock, L2/DRAM bytes, stalls, ~1 min
#   bash launch/gpu_cycle.sh layer             # issue 13's two-GPU timings: dispatch kernels, the
#                                              # decode layer eager and from a graph, host time, ~2 min
# bench runs one rank per GPU (on one GPU: one rank, no link); run, fuzz and soak take two
# ranks, sharing the GPU where there is one.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-out}
mkdir -p "$out"
export EPSERVE_CACHE_DIR=${EPSERVE_CACHE_DIR:-/tmp/epserve-cache}
status=0
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$gpus" -ge 1 ] 2>/dev/null || gpus=2

stage() {  # stage NAME SUMMARY-REGEX COMMAND...
    local name=$1 pattern=$2
    shift 2
    echo "== $name: $*"
    local start=$SECONDS
    "$@" > "$out/$name.log" 2>&1
    local rc=$?
    grep -aE "$pattern" "$out/$name.log" | tail -n 40
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || status=1
}

nvidia-smi -L > "$out/gpus.log" 2>&1; cat "$out/gpus.log"
for s in "$@"; do
    case $s in
        test)  stage test "passed|failed|FAILED|GPU test" make test ;;
        run)   stage run "^#|^path|^fused|^unfused" make run ;;
        timing) stage timing "^#|^GEMM|^dense|^path|^ *[a-z]" bash -c \
                   "PYTHONPATH=. python3 launch/jobs/time_gemm.py && python3 launch/run.py -n 1 -- python3 -m mpi4py launch/jobs/time_combine.py" ;;
        bench) stage bench "^#|^  [a-z]" make bench NP=$gpus
               tar czf "$out/results.tgz" results ;;
        fuzz)  stage fuzz "^# fuzz|^FAIL" make fuzz COUNT=500 ;;
        soak)  stage soak "^# soak" make soak CALLS=1000 ;;
        sanitize) stage sanitize "^== |SUMMARY" make sanitize ;;
        # Where the wgmma GEMMs' bytes come from, per build: L2 reads and writes, DRAM reads,
        # with the SpeedOfLight section (issue 12: is a CTA pair's multicast cutting L2 reads?).
        profile) stage profile "epserve_grouped|lts__|dram__|Throughput|Duration" env PYTHONPATH=. ncu --clock-control none \
                   --kernel-name regex:epserve_grouped_gemm_wgmma --section SpeedOfLight --metrics \
lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,dram__bytes_read.sum \
                   python3 launch/jobs/time_gemm.py --variants --routing balanced --skip-cublas --warmup 1 --iters 1 ;;
        # The FP8 GEMMs (issue 16): the clock under load, L2 and DRAM bytes, warp stalls, for the
        # dense run and both GEMMs at balanced and uniform routing (notes/gemm.md, "Where the FP8
        # GEMMs stand").
        profile-fp8) stage profile-fp8 "epserve_grouped|lts__|dram__|per_second|Throughput|Duration|No Eligible" \
                   env PYTHONPATH=. ncu --clock-control none --kernel-name epserve_grouped_gemm_fp8 \
                   --section SpeedOfLight --section WarpStateStats --section SchedulerStats --metrics \
sm__cycles_elapsed.avg.per_second,lts__t_sectors_op_read.sum,dram__bytes_read.sum,dram__bytes_write.sum \
                   python3 launch/jobs/time_gemm_fp8.py --routing balanced uniform --skip-bf16 --warmup 0 --iters 1 ;;
        # Issue 13 on two GPUs: the dispatch (<= 300 us at dsv3-prefill 4096), the decode layer
        # replayed from a graph (<= 2.9 ms, eager within 5%), and forward's host time (<= 50 us).
        layer) share=$([ "$gpus" -ge 2 ] || echo --share-gpu)
               stage layer-dispatch "^(call|move|default|[0-9]+:[0-9]+|own in|routing with|# time)|wrong|Error" \
                   env PYTHONPATH=. python3 launch/run.py -n 2 $share --timeout 120 -- python3 -m mpi4py \
                   launch/jobs/time_dispatch.py --preset dsv3-prefill --tokens 4096 --iters 20
               stage layer-graph "^#|^[a-z]|Error" env PYTHONPATH=. python3 launch/run.py -n 2 $share \
                   --timeout 120 -- python3 -m mpi4py launch/jobs/time_graph.py --preset dsv3-decode --tokens 128
               stage layer-host "^#|^forward|^dispatch|Error" env PYTHONPATH=. python3 launch/run.py -n 2 $share \
                   --timeout 120 -- python3 -m mpi4py launch/jobs/host_profile.py --tokens 128 --calls 20 --top 12 ;;
        *) echo "unknown stage $s (test run timing bench fuzz soak sanitize profile profile-fp8 layer)"; status=1 ;;
    esac
done
exit $status
