#!/usr/bin/env bash
# One call on the GPU machine: build the CUDA extension, run the CUDA tests (and optionally
# compute-sanitizer), run the benchmarks; JSON and logs go to $OUT, a short table prints last.
# Usage: bash benchmarks/gpu_check.sh [build|test|probe-floor|probe-phases|ncu|ncu-admit|ncu-detail|ncu-source|sanitize|bench-slot|bench-gemm|bench-moe|bench-decode|bench-compile|diag-compile|all]...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OUT
steps=${*:-all}
has() { [[ " $steps " == *" $1 "* || " $steps " == *" all "* ]]; }
status=0

echo "== $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader) | $(python3 -c 'import torch;print("torch", torch.__version__)')"
if has build || [ -z "$(ls ft_ops/_C*.so 2>/dev/null)" ]; then
  t0=$(date +%s)
  MAX_JOBS=16 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  echo "== build ok in $(( $(date +%s) - t0 ))s; $(ldd ft_ops/_C*.so | grep -o 'libstdc++[^ ]* => [^ ]*')"
fi
export PYTHONPATH=$PWD:$PWD/plugin${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import ft_ops; assert ft_ops.cuda_kernels_available(), "CUDA kernels missing"; print("== CUDA kernels registered")' || exit 1

if has diag; then
  # Each case in its own process: does raising an error from a kernel crash the interpreter?
  for case in "slot_lookup(torch.full((2,8),-1,dtype=torch.int32),0,torch.tensor([9]))" \
              "slot_lookup(torch.full((2,8),-1,dtype=torch.int32),5,torch.tensor([1]))" \
              "expert_gemm(torch.randn(2,4),torch.zeros(2,1,dtype=torch.int32),torch.ones(2,1),torch.randn(3,8,4),torch.randn(3,4,4),activation='relu')"; do
    python3 -c "import torch, ft_ops
try:
    ft_ops.$case
except RuntimeError as e: print('raised ok:', str(e).splitlines()[0][:100])" 2>&1 | tail -2; echo "   rc=$? for $case"
  done
  cuda-gdb -batch -ex run -ex bt --args python3 -c "import torch, ft_ops
try: ft_ops.slot_lookup(torch.full((2,8),-1,dtype=torch.int32),0,torch.tensor([9]))
except RuntimeError as e: print('raised ok')" >"$OUT/diag_gdb.log" 2>&1
  grep -E "^#|signal|raised" "$OUT/diag_gdb.log" | head -25
fi
if has test; then
  timeout ${FT_TEST_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider ${FT_TESTS:-tests} ${FT_PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -15
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  # The admission kernels' other options (environment read once per process): the level kernel
  # for decode calls too, its 1,024-thread block, ordinary launches, the cluster kernel, the
  # decode kernel as 256 threads x 16 stamps.
  # FT_TEST_VARIANTS (a ;-separated list) runs only those.
  IFS=';' read -r -a variants <<<"${FT_TEST_VARIANTS:-FT_ADMIT_DECODE=0;FT_ADMIT_DECODE=0 FT_ADMIT_THREADS=1024;FT_PDL=0;FT_ADMIT_DECODE=0 FT_ADMIT_CLUSTER=1;FT_DECODE_THREADS=256;FT_DECODE_EARLY=0}"
  for variant in "${variants[@]}"; do
    env $variant timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_slot_cache.py \
      tests/test_cuda_graphs_and_sync.py tests/test_cache_property.py -k cuda 2>&1 | tail -1 | sed "s/^/== $variant slot-cache tests: /"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
fi
if has ncu; then
  # Kernel-only time of one admission (the graph benchmark includes launch gaps).
  timeout 120 ncu --clock-control none -k regex:admit_by --metrics gpu__time_duration.sum --csv \
    python3 benchmarks/probe_admission.py >"$OUT/ncu_admission.csv" 2>&1
  python3 - "$OUT/ncu_admission.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10 and r[-3:-2] != ["Metric Name"]]
vals = [r[-1] for r in rows if "gpu__time_duration" in ",".join(r)]
print("== ncu dedup_and_admit durations (ns), misses 0 x8, 2 x8, 8 x8 (every 2nd is the setup call):", vals[:48])
PY
fi
if has probe-floor; then
  # The pieces of a one-block admission call measured alone: launch gap, barriers, dependent
  # loads, loading the stamps (benchmarks/probe_admission_floor.cu).
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc benchmarks/probe_admission_floor.cu \
    -o "$OUT/probe_floor" >"$OUT/probe_floor_build.log" 2>&1 && timeout 120 "$OUT/probe_floor" | tee "$OUT/probe_floor.log"
  rm -f "$OUT/probe_floor"
fi
if has probe-phases; then
  # When thread 0 of the real admission kernel reaches each phase, in the benchmark's setting
  # (benchmarks/probe_admission_phases.cu; the kernel compiled with a timing hook).
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc benchmarks/probe_admission_phases.cu \
    -o "$OUT/probe_phases" >"$OUT/probe_phases_build.log" 2>&1 || tail -20 "$OUT/probe_phases_build.log"
  timeout 120 "$OUT/probe_phases" | tee "$OUT/probe_phases.log"
  rm -f "$OUT/probe_phases"
fi
if has ncu-admit; then
  # Kernel time, instructions and stall reasons of every admission in the probe, for each block
  # size of the 4,096-slot kernel (launch 2l+1: no miss; 16+2l+1: 2 misses; 32+l: 8 misses).
  stalls=barrier,no_instruction,imc_miss,long_scoreboard,short_scoreboard,wait,math_pipe_throttle
  metrics=gpu__time_duration.sum,smsp__inst_executed.sum$(for s in ${stalls//,/ }; do printf ",smsp__average_warps_issue_stalled_%s_per_issue_active.ratio" $s; done)
  for threads in ${FT_NCU_ADMIT_THREADS:-512}; do
    FT_ADMIT_THREADS=$threads timeout 150 ncu --clock-control none -k regex:admit_by --metrics $metrics --csv \
      python3 benchmarks/probe_admission.py >"$OUT/ncu_admit_$threads.csv" 2>&1
    python3 - "$OUT/ncu_admit_$threads.csv" $threads <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10 and r[0].isdigit()]
by_launch = collections.defaultdict(dict)
for r in rows:
    by_launch[int(r[0])][r[-3].replace("smsp__average_warps_issue_stalled_", "").replace("_per_issue_active.ratio", "")] = r[-1]
print(f"== ncu admission, {sys.argv[2]} threads: launch, us, warp instructions, stalls per issue")
for launch in (1, 3, 17, 19, 33, 35):
    m = by_launch.get(launch, {})
    print(launch, m.get("gpu__time_duration.sum"), m.get("smsp__inst_executed.sum"),
          {k: v for k, v in m.items() if not k.startswith(("gpu__", "smsp__"))})
PY
  done
fi
if has ncu-detail; then
  # Where the time goes in the decode GEMM kernels and in admission with misses (text reports:
  # speed of light, occupancy, warp stall reasons, source hot spots of the admission kernel).
  timeout 150 ncu --clock-control none -k regex:"gate_up|down_combine" --launch-skip 2 --launch-count 4 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    python3 benchmarks/probe_decode_gemm.py >"$OUT/ncu_decode_gemm.txt" 2>&1
  timeout 150 ncu --clock-control none -k regex:admit_by --launch-skip 16 --launch-count 2 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    python3 benchmarks/probe_admission.py >"$OUT/ncu_admission_detail.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|gate_up|down_combine|dedup" \
    "$OUT/ncu_decode_gemm.txt" "$OUT/ncu_admission_detail.txt" | head -40
fi
if has ncu-source; then
  # Per-instruction stall samples of one admission with 2 misses (launch 17 of the probe), as CSV.
  timeout 150 ncu --clock-control none --set full --import-source no -k regex:admit_ \
    --launch-skip 17 --launch-count 1 -f -o "$OUT/admission" python3 benchmarks/probe_admission.py >"$OUT/ncu_source_run.log" 2>&1
  ncu -i "$OUT/admission.ncu-rep" --page source --csv --print-source sass >"$OUT/admission_sass.csv" 2>&1
  echo "== admission SASS profile: $(wc -l <"$OUT/admission_sass.csv") lines"
fi
if has bench-slot; then timeout 420 python3 benchmarks/bench_slot_cache.py ${FT_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_slot_cache.log" | tail -40; fi
if has bench-gemm; then
  timeout 240 python3 benchmarks/bench_expert_gemm.py 2>&1 | tee "$OUT/bench_expert_gemm.log" | tail -40
  # The same decode rows on the FMA gate_up kernel, for comparison.
  FT_DECODE_TENSOR_CORES=0 timeout 60 python3 benchmarks/bench_expert_gemm.py --decode-only 2>&1 | tail -8
fi
if has bench-moe; then
  # 10 layers: a pool of more than 1,023 slots that still streams needs more than 8 layers.
  timeout 240 python3 benchmarks/bench_prefill.py --layers "${FT_PREFILL_LAYERS:-10}" 2>&1 | tee "$OUT/bench_prefill.log" | tail -25
fi
if has bench-moe || has bench-decode; then
  timeout 240 python3 benchmarks/bench_decode.py 2>&1 | tee "$OUT/bench_decode.log" | tail -25
fi
if has diag-compile; then timeout 600 python3 benchmarks/probe_whole_forward_compile.py; fi
if has bench-compile; then timeout 420 python3 benchmarks/bench_compile.py 2>&1 | tee "$OUT/bench_compile.log" | grep -v Warning | tail -14; fi
if has sanitize; then
  for tool in memcheck racecheck; do
    FT_PROPERTY_STEPS=30 timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -x -p no:cacheprovider \
      ${FT_SANITIZE_TESTS:-tests/test_slot_cache.py tests/test_cache_property.py tests/test_layer_copy.py tests/test_expert_gemm.py} -k cuda >"$OUT/sanitize_$tool.log" 2>&1
    rc=$?; echo "== compute-sanitizer $tool: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
    [ $rc = 0 ] || status=1
  done
fi
exit $status
