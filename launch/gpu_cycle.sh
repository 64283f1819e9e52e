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
#   bash launch/gpu_cycle.sh sustained         # the GEMMs back to back at the power limit, in blocks, with
#                                              # power, clock and throttle reasons; the knob builds, ~2 min
#   bash launch/gpu_cycle.sh layer             # issue 13's two-GPU timings: dispatch kernels, the
#                                              # decode layer eager and from a graph, host time, ~2 min
#   bash launch/gpu_cycle.sh review-x2         # two GPUs, what three issues wait for: the FP8 bench, the
#                                              # across-nodes 2-gpus tests, the off-node transfer, the send
#                                              # under GEMM 2, <= 9 min
#   bash launch/gpu_cycle.sh tests-x2          # two GPUs, the other 2-gpus tests, <= 9 min
#   bash launch/gpu_cycle.sh fp8-race          # two GPUs, the FP8 GEMM's stage release fix, <= 8 min
#   bash launch/gpu_cycle.sh sink-bulk         # GEMM 2's peer sink builds: the bulk ones' jobs on two GPUs,
#                                              # then the bench with each sink build, <= 9 min
#   bash launch/gpu_cycle.sh fp8-x2            # two GPUs, issue 16's open questions in one call: the bench's
#                                              # FP8 and bf16 presets with each sink build, the targets,
#                                              # <= 9.5 min
#   bash launch/gpu_cycle.sh rank-of-2         # one GPU standing in for a rank of two: the dsv3 presets
#                                              # with 128 experts (bench --as-rank-of 2), prefill at 4096
#                                              # tokens and decode at 128, and issue 16's targets off both, ~2 min
#   bash launch/gpu_cycle.sh gemm-ab           # one GPU: the FP8 GEMMs' knob builds against the shipped one,
#                                              # timed as bench rows, and where a tile's cycles go, ~2 min
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

summary_lines=40  # the last this many matching lines of a stage's log are printed
deadline=0
# within SECONDS: a timeout for a stage's next command: SECONDS, or what is left before
# $deadline when that is less, but never under 30
within() {
    local left=$((deadline - SECONDS))
    local t=$(($1 < left ? $1 : left))
    echo $((t < 30 ? 30 : t))
}

stage() {  # stage NAME SUMMARY-REGEX COMMAND...
    local name=$1 pattern=$2
    shift 2
    echo "== $name: $*"
    local start=$SECONDS
    "$@" > "$out/$name.log" 2>&1
    local rc=$?
    grep -aE "$pattern" "$out/$name.log" | tail -n "$summary_lines"
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
               stage bench-targets "^#|^  " env PYTHONPATH=. python3 -m epserve.bench.targets "results/h200x$gpus/bench.json"
               tar czf "$out/results.tgz" results ;;
        # The expert GEMMs at a two-rank rank's shape on one GPU (nothing crosses a link): what
        # issue 16's GEMM targets can be read off without a second GPU.
        rank-of-2) stage rank-of-2 "^#|^  [a-z]" env PYTHONPATH=. python3 launch/run.py -n 1 --timeout 300 -- \
                       python3 -m mpi4py -m epserve.bench --presets dsv3-prefill-fp8,dsv3-prefill --as-rank-of 2 \
                       --routing balanced --tokens 4096 --out "$out/rank-of-2"
                   stage rank-of-2-decode "^#|^  [a-z]" env PYTHONPATH=. python3 launch/run.py -n 1 --timeout 200 -- \
                       python3 -m mpi4py -m epserve.bench --presets dsv3-decode-fp8,dsv3-decode --as-rank-of 2 \
                       --routing balanced --tokens 128 --iters 20 --warmup 5 --out "$out/rank-of-2-decode"
                   stage rank-of-2-targets "^#|^  " env PYTHONPATH=. python3 -m epserve.bench.targets \
                       "$out/rank-of-2/bench.json" "$out/rank-of-2-decode/bench.json" ;;
        # The FP8 GEMMs' builds at the bench's clock, and per-tile stamps (notes/gemm.md,
        # twenty-third session): GEMM_AB_KNOBS picks the builds beside the shipped one
        # (epserve.ffn.gemm_fp8.KNOBS, space-separated).
        gemm-ab) stage gemm-ab "^#|^problem|^gemm|^dense" env PYTHONPATH=. python3 launch/jobs/ab_gemm_fp8.py \
                     --knobs ${GEMM_AB_KNOBS:-split split-unpublished} \
                     --problems gemm2 gemm1 dense2048 --rounds 5
                 stage gemm-trace "^##|wait|k-loop|k-block|hand-over|producer" env PYTHONPATH=. \
                     python3 launch/jobs/trace_gemm_fp8.py --problems dense2048 gemm2 gemm1 \
                     --on split split+ahead ;;
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
        # The expert GEMMs as a layer runs them, at the power limit: long blocks of launches per
        # build, alternated, with nvidia-smi's power and clock (notes/gemm.md, sixteenth session).
        sustained) stage sustained "^#|^GEMM" env PYTHONPATH=. python3 launch/jobs/time_gemm_sustained.py \
                   --routing balanced uniform --knobs split-unzeroed split+overlap --bf16 --dense 8192 ;;
        # Issue 13 on two GPUs: the dispatch (<= 300 us at dsv3-prefill 4096), the decode layer
        # replayed from a graph (<= 2.9 ms, eager within 5%), and forward's host time (<= 50 us).
        layer) share=$([ "$gpus" -ge 2 ] || echo --share-gpu)
               for preset in dsv3-prefill dsv3-prefill-fp8; do  # issue 16's FP8 / bf16 dispatch ratio
                   stage "layer-dispatch-$preset" "^(call|move|default|[0-9]+:[0-9]+|own in|routing with|# time)|wrong|Error" \
                       env PYTHONPATH=. python3 launch/run.py -n 2 $share --timeout 120 -- python3 -m mpi4py \
                       launch/jobs/time_dispatch.py --preset $preset --tokens 4096 --iters 20
               done
               stage layer-graph "^#|^[a-z]|Error" env PYTHONPATH=. python3 launch/run.py -n 2 $share \
                   --timeout 120 -- python3 -m mpi4py launch/jobs/time_graph.py --preset dsv3-decode --tokens 128
               stage layer-host "^#|^forward|^dispatch|Error" env PYTHONPATH=. python3 launch/run.py -n 2 $share \
                   --timeout 120 -- python3 -m mpi4py launch/jobs/host_profile.py --tokens 128 --calls 20 --top 12 ;;
        # Three issues' two-GPU measurements in one call, each command under its own timeout
        # (timeout -k 10: run.py's own teardown takes up to 5 s; its --timeout 15 s under the
        # outer one), all of them within REVIEW_BUDGET_S (default 540 s) so that one hang cannot
        # eat the call: a command gets its own limit or what is left, whichever is less.
        #  - issue 16: the FP8 presets beside the bf16 ones, balanced, 4096 and 128 tokens;
        #  - the two-GPU tests (-k 2-gpus: two ranks, forced nodes over NCCL, 4 ranks on 2 GPUs);
        #  - issue 15: the off-node transfer alone over NCCL against an NCCL all-to-all (ratio);
        #  - issue 15, step 2: dsv3-prefill 4096 balanced across forced nodes of 1 with routed
        #    sizes, the send after GEMM 2 and then under it (EPSERVE_OFFNODE_OVERLAP=1): read the
        #    fused and layer-fused rows of the two logs side by side (the bench has no flag to
        #    time fewer paths; its `fused` row combines capacity blocks, layer-fused routed ones).
        review-x2)
            export NCCL_NVLS_ENABLE=0
            deadline=$((SECONDS + ${REVIEW_BUDGET_S:-540})) summary_lines=120
            rows="^# (preset|  )|^  [a-z]|#wrong|passed|failed|ratio|Error|timed out"
            t=$(within 215)
            stage review-bench-fp8 "$rows|^# .*(FP8|limits)" timeout -k 10 "$t" env PYTHONPATH=. \
                python3 launch/run.py -n 2 --timeout $((t - 15)) -- python3 -m mpi4py -m epserve.bench \
                --presets dsv3-prefill-fp8,dsv3-decode-fp8,dsv3-prefill,dsv3-decode --routing balanced \
                --tokens 4096,128 --out "$out/bench-fp8"
            stage review-targets "^#|^  " env PYTHONPATH=. python3 -m epserve.bench.targets "$out/bench-fp8/bench.json"
            # the across-nodes two-GPU cases only (about 40 s each): all 28 two-GPU tests take
            # about 20 minutes, more than one device call (stage tests-x2 below)
            t=$(within 330)
            stage review-tests-2gpus "passed|failed|FAILED|SKIPPED|ERROR|#wrong|ratio|timed out" \
                timeout -k 10 "$t" env PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_across_nodes.py -q -rs \
                -k 2-gpus -p no:cacheprovider
            t=$(within 215)
            stage review-offnode-transfer "^# (time_off_node|transfer)|^(counts|dispatch|combine) |#wrong|ratio|passed|failed|Error|timed out" \
                timeout -k 10 "$t" env PYTHONPATH=. EPSERVE_RANKS_PER_NODE=1 python3 launch/run.py -n 2 \
                --timeout $((t - 15)) -- python3 -m mpi4py launch/jobs/time_off_node.py --preset dsv3-prefill \
                --iters 50 --warmup 5
            for overlap in 0 1; do
                name=review-offnode-host$([ $overlap = 0 ] || echo -overlap)
                set_overlap=$([ $overlap = 0 ] && echo "-u EPSERVE_OFFNODE_OVERLAP" || echo EPSERVE_OFFNODE_OVERLAP=1)
                t=$(within 150)
                stage "$name" "^# (preset|  )|^  \S+ +\S+ +[0-9]+ +(layer-)?(un)?fused |#wrong|passed|failed|ratio|Error|timed out" \
                    timeout -k 10 "$t" env $set_overlap PYTHONPATH=. EPSERVE_RANKS_PER_NODE=1 \
                    EPSERVE_OFFNODE_SIZES=host python3 launch/run.py -n 2 --timeout $((t - 15)) -- \
                    python3 -m mpi4py -m epserve.bench --presets dsv3-prefill --routing balanced --tokens 4096 \
                    --iters 30 --warmup 5
            done
            summary_lines=40 ;;
        # The FP8 GEMM's stage release by every consumer thread (notes/gemm.md, "FP8 fused !=
        # unfused now and then on two H200s" and "Thirteenth session"), two GPUs, <= 8 min: the
        # race job on the shipped build (must pass)
        # and on the pre-fix release (should fail: it shows the job catches the race; not counted
        # in the exit status), then the bench points that showed it (every fused #wrong 0).
        fp8-race) export NCCL_NVLS_ENABLE=0
            race=(python3 launch/run.py -n 2 --timeout 200 -- python3 -m mpi4py launch/jobs/check_fp8_race.py)
            stage fp8-race "passed|failed|FAIL|wrong|differ|# " timeout -k 10 220 env PYTHONPATH=. "${race[@]}"
            keep=$status
            stage fp8-race-prefix "passed|failed|FAIL|wrong|differ|# " timeout -k 10 220 env PYTHONPATH=. \
                "${race[@]}" --release-by-warpgroup
            status=$keep
            stage fp8-race-bench "^  dsv3|#wrong" timeout -k 10 120 env PYTHONPATH=. python3 launch/run.py -n 2 \
                --timeout 110 -- python3 -m mpi4py -m epserve.bench --presets dsv3-prefill-fp8 --routing \
                balanced,skewed --tokens 1024,2048 --iters 10 --warmup 3 --out "$out/fp8-race-bench" ;;
        # GEMM 2's peer sink builds (EPSERVE_SINK_STORES own-bulk, the default, warps and bulk;
        # notes/gemm.md "GEMM 2 + fused combine, taken apart" and thirty-first session), <= 9 min:
        # the bulk builds' jobs bitwise on two GPUs, then the bench's gemm2 / fused / layer rows
        # with each sink build.
        sink-bulk) export NCCL_NVLS_ENABLE=0
            stage sink-bulk-tests "passed|failed|FAILED|SKIPPED|ERROR|timed out" timeout -k 10 240 env PYTHONPATH=. \
                python3 -m pytest -m gpu tests/gpu/test_two_ranks.py -q -rs -k "bulk and 2-gpus" -p no:cacheprovider
            keep=$status
            for stores in own-bulk warps bulk; do
                stage "sink-bulk-bench-$stores" "^  dsv3|#wrong" timeout -k 10 100 env PYTHONPATH=. \
                    EPSERVE_SINK_STORES=$stores python3 launch/run.py -n "$gpus" --timeout 90 -- python3 -m mpi4py \
                    -m epserve.bench --presets dsv3-prefill,dsv3-prefill-fp8 --routing balanced --tokens 4096 \
                    --iters 10 --warmup 3 --out "$out/sink-bulk-$stores"
                keep=$((keep || status))
            done
            status=$keep ;;
        # Issue 16 on two GPUs in one device call (notes/dispatch.md and notes/gemm.md, twentieth and
        # thirty-first sessions): the bench with the shipped sink (own-bulk; FP8 and bf16 presets,
        # prefill 4096 and decode 128: every target, the dispatch-layer ratio, #wrong bitwise), then
        # dsv3-prefill-fp8 with the send warps' stores and with bulk copies for every row (fused and
        # layer-fused against the first run, #wrong), the targets of each; all within
        # FP8_X2_BUDGET_S. The FP8 stage-release race job is stage fp8-race.
        fp8-x2)
            export NCCL_NVLS_ENABLE=0
            deadline=$((SECONDS + ${FP8_X2_BUDGET_S:-560})) summary_lines=80
            rows="^# (preset|  )|^  [a-z]|#wrong|Error|timed out"
            for stores in own-bulk warps bulk; do
                if [ $stores = own-bulk ]; then presets=dsv3-prefill-fp8,dsv3-prefill,dsv3-decode-fp8,dsv3-decode tokens=4096,128 t=$(within 215)
                else presets=dsv3-prefill-fp8 tokens=4096 t=$(within 120); fi
                stage "fp8-x2-bench-$stores" "$rows" timeout -k 10 "$t" env PYTHONPATH=. EPSERVE_SINK_STORES=$stores \
                    python3 launch/run.py -n 2 --timeout $((t - 15)) -- python3 -m mpi4py -m epserve.bench \
                    --presets $presets --routing balanced --tokens $tokens --iters 10 --warmup 3 --out "$out/fp8-x2-$stores"
                stage "fp8-x2-targets-$stores" "^#|^  " env PYTHONPATH=. python3 -m epserve.bench.targets \
                    "$out/fp8-x2-$stores/bench.json"
            done
            summary_lines=40 ;;
        # The two-GPU tests other than the across-nodes ones (review-x2 runs those), <= 9 min.
        tests-x2) export NCCL_NVLS_ENABLE=0
            stage tests-x2 "passed|failed|FAILED|SKIPPED|ERROR|timed out" timeout -k 10 540 env PYTHONPATH=. \
                python3 -m pytest -m gpu tests -q -rs -k "2-gpus and not test_across_nodes" -p no:cacheprovider ;;
        *) echo "unknown stage $s (test run timing bench fuzz soak sanitize profile profile-fp8 sustained layer review-x2 tests-x2 fp8-race sink-bulk fp8-x2 rank-of-2)"; status=1 ;;
    esac
done
exit $status
