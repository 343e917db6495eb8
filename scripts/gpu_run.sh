#!/usr/bin/env bash
# One GPU-host job (set THUNDER_TK_COMMIT where the checkout has no .git; BENCH_ARGS=--sweep to tune;
# BENCHES='gemm attention loss litgpt delta' picks benchmarks; a carried .ab_ref (scripts/ab_ref.sh) adds a same-machine
# A/B, AB_BENCH, several separated by ';'; AB_KNOB=NAME=V0,V1 compares values of an environment knob of this build
# instead, e.g. THUNDER_TK_GEMM_SCHEDULE=static,dynamic): install carried wheels, build thunder_tk, run the GPU tests,
# compute-sanitizer and the benchmarks, and print a short table last. Full logs go to $OUT (default out/gpu), packed into logs.tgz and charts.tgz
# beside the JSON results at the end (the device tool fetches at most 8 files; PACK_OUT=0 leaves them loose, e.g. to
# grep a log in the same command after this script).
#   bash scripts/gpu_run.sh [all|test|bench|dist|pretrain]
#     dist: the multi-GPU collectives benchmark and tests; pretrain: `thunder-tk pretrain` with tk vs Thunder's
#     default executors on every GPU of the host (PRETRAIN_CONFIG, default llama-2-7b; PRETRAIN_ARGS: overrides;
#     PRETRAIN_ONLY='"tk - gemm" tk': variants of benchmarks/pretrain_compare.py),
#     then, with PRETRAIN_THEN_KERNELS=1, the collectives kernel checks on all GPUs. WITH_TESTS=1 runs the
#     one-GPU tests and sanitizers first in any mode. profile: after the build, run PROFILE (a shell command, from
#     /tmp, with OUT and HERE (the checkout) exported), e.g. ncu over benchmarks/profile_attention.py.
# GPU_TESTS (files), GPU_TESTS_TIMEOUT (the whole test step, default 600 s), THUNDER_TK_TEST_TIMEOUT (one GPU test,
# default 240 s: past it the watchdog in tests/conftest.py ends the run and the summary names where it was stuck),
# THUNDER_TK_TEST_SHARD=k/n (every n-th test from the k-th: the whole GPU suite takes three calls, 1/3 to 3/3, each
# about 300 s of pytest; a half no longer fits a fresh machine's 600 s call with the build).
# Processes an earlier run left behind (a call cut at the device tool's limit) are stopped first (KEEP_LEFTOVERS=1:
# only reported).
set -uo pipefail
what=${1:-all}
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
OUT_ABS=$(cd "$OUT" && pwd)
# A report left in $OUT by an earlier run must not pass for this run's (a cut test step may write none).
rm -f "$OUT_ABS/gpu_tests.xml" "$OUT_ABS/dist_tests.xml" "$OUT_ABS/failures.log"
# Each failing test's report, written as it fails (tests/conftest.py), so a call cut before pytest's summary keeps it.
export THUNDER_TK_FAILURE_LOG="$OUT_ABS/failures.log"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
summary=()
# DEADLINE=<seconds>: no step runs past that many seconds of this script (a step is cut short by `timeout`, or
# skipped with under 15 s left), so the summary and the packed logs still come back inside the device tool's limit.
# A cut pytest step still prints what failed so far and writes its XML (tests/conftest.py turns SIGTERM into an interrupt).
# A cut step shows as CUT in the summary (its own timeout or DEADLINE's; the build, `info` and the SASS listing
# take their share of DEADLINE first); FAIL means the step itself failed.
step() { local name=$1; shift; local t0=$SECONDS
         if [ -n "${DEADLINE:-}" ]; then
           local left=$((DEADLINE - SECONDS))
           if [ $left -lt 15 ]; then summary+=("$(printf '%-22s %-6s %4ss  %s' "$name" skip 0 "past DEADLINE=$DEADLINE")"); return 1; fi
           set -- timeout $left "$@"
         fi
         "$@" > "$OUT/$name.log" 2>&1; local rc=$?
         # 124: a `timeout` fired (the step's own or DEADLINE's): the step was cut, not failed on its own.
         local verdict=$([ $rc = 0 ] && echo ok || { [ $rc = 124 ] && echo CUT || echo FAIL; })
         summary+=("$(printf '%-22s %-6s %4ss  %s' "$name" "$verdict" $((SECONDS-t0)) "$(tail -n 1 "$OUT/$name.log" | cut -c1-90)")"); return $rc; }

# A call that the device tool cut at its limit can leave its processes (the pytest run, a benchmark, their torchrun
# ranks) running on a machine that stays warm: the next call then shares the GPU with them (session 71: three heavy
# tests failed in that call, and the machine stopped answering after it). Every process this script starts carries
# THUNDER_TK_GPU_RUN; ones carrying it from an earlier run are stopped before anything is built or timed (TERM, then
# KILL after 20 s), and the summary says so. KEEP_LEFTOVERS=1 only reports them. A run started from inside another
# (THUNDER_TK_GPU_RUN already set) leaves its parent's processes alone.
if [ -z "${THUNDER_TK_GPU_RUN:-}" ]; then
  leftovers=()
  for environ in /proc/[0-9]*/environ; do
    pid=${environ#/proc/}; pid=${pid%/environ}
    [ "$pid" = $$ ] && continue
    grep -qz '^THUNDER_TK_GPU_RUN=' "$environ" 2> /dev/null && leftovers+=("$pid")
  done
  if [ ${#leftovers[@]} -gt 0 ]; then
    t0=$SECONDS
    names=$(for pid in "${leftovers[@]}"; do tr '\0' ' ' < /proc/$pid/cmdline 2> /dev/null | cut -c1-60; echo; done \
            | grep -v '^$' | sort | uniq -c | sort -rn | head -n 3 | tr -s ' \n' ' ')
    if [ "${KEEP_LEFTOVERS:-0}" = 1 ]; then
      verdict=kept
    else
      kill -TERM "${leftovers[@]}" 2> /dev/null
      for _ in $(seq 20); do alive=0; for pid in "${leftovers[@]}"; do kill -0 "$pid" 2> /dev/null && alive=1; done
                             [ $alive = 0 ] && break; sleep 1; done
      kill -KILL "${leftovers[@]}" 2> /dev/null; verdict=stopped
    fi
    summary+=("$(printf '%-22s %-6s %4ss  %s' leftovers "$verdict" $((SECONDS - t0)) "${#leftovers[@]} processes of an earlier run: $names" | cut -c1-160)")
  fi
fi
export THUNDER_TK_GPU_RUN=$$

if compgen -G ".whl/*.whl" > /dev/null; then
  step wheels python3 scripts/offline_wheels.py install --from .whl --target /tmp/site
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader > "$OUT/gpu.txt" 2>&1
# The build leaves ptxas's report and the PTX of every kernel (csrc/CMakeLists.txt) beside its objects under build/,
# which a warm machine keeps, so that the report of a source not recompiled is still there; check_kernels.py reads it
# (wgmma serialisation, spills, kernels that never wait for the grid before them), as CI does.
report="$(pwd)/build/kernel_report"
step build env THUNDER_TK_KERNEL_REPORT="$report" python3 -m pip install -v --no-build-isolation --no-index --no-deps .
step kernel_check python3 scripts/check_kernels.py --report "$report"
# From outside the checkout, so that the installed package (with its compiled module) is the one imported.
step info bash -c "cd /tmp && python3 -c \"import thunder_tk.cli as c; c.main(['info'])\""
# The SASS instruction counts (wgmma, TMA loads, barriers in the built module): a cuobjdump of the whole module, part
# of the ~25 s the calls of 2026-12-01 spent outside their steps. In the background under the tests; sass_done waits
# for them before anything timed (profiles, benchmarks) and the summary.
( so=$(cd /tmp && python3 -c "import thunder_tk._C as m; print(m.__file__)" 2>/dev/null)
  [ -n "$so" ] && cuobjdump --dump-sass "$so" 2>/dev/null | grep -oE "HGMMA|UTMALDG|SYNCS" | sort | uniq -c > "$OUT/sass.txt" ) &
sass_pid=$!
sass_done() { [ -n "$sass_pid" ] && wait "$sass_pid"; sass_pid=; }

# Run from outside the checkout so the installed package (with its compiled module) is the one imported.
here=$(pwd)
if [ -n "${ATTN_PROBE:-}" ]; then  # attention cases one child process each, a hang reported per shape; stops here on any
  step attention_probe timeout 400 bash -c "cd /tmp && python3 $here/scripts/attention_hang_probe.py --backward"
  cat "$OUT/attention_probe.log"
  grep -qE "^(HANG|rc=)" "$OUT/attention_probe.log" && { printf '%s\n' "${summary[@]}"; exit 1; }
fi
if [ "$what" = all ] || [ "$what" = test ] || [ -n "${WITH_TESTS:-}" ]; then  # WITH_TESTS=1: also before dist
  step smoke timeout 120 bash -c "cd /tmp && python3 -c \"import torch; from thunder_tk import ops; a = torch.randn(256, 128, device='cuda', dtype=torch.bfloat16); print(float((ops.gemm(a, a.t()).float() - a.float() @ a.float().t()).abs().max()))\""
  step gpu_tests timeout ${GPU_TESTS_TIMEOUT:-600} bash -c "cd /tmp && python3 -m pytest -q -m gpu -p no:cacheprovider $(for t in ${GPU_TESTS:-tests/gpu}; do printf "%s " "$here/$t"; done)-rs --junitxml=$OUT_ABS/gpu_tests.xml"
  # A test past THUNDER_TK_TEST_TIMEOUT (tests/conftest.py's watchdog) ended the run: name where it was stuck.
  if grep -q "^Timeout (" "$OUT/gpu_tests.log" 2>/dev/null; then
    # The outermost frame under tests/gpu is the test function (the traceback lists the most recent call first).
    stuck=$(grep -oE 'tests/gpu/[^"]+", line [0-9]+ in [A-Za-z_0-9]+' "$OUT/gpu_tests.log" | tail -n 1 | sed 's/",//')
    summary+=("$(printf '%-22s %-6s %4ss  %s' watchdog STUCK 0 "${stuck:-see gpu_tests.log}" | cut -c1-120)")
  fi
  # SANITIZE=0: the tests alone (the sanitizers already ran on these kernels); SANITIZE_ONLY=<sections>: part of them
  if [ "${SANITIZE:-1}" = 1 ]; then
    step memcheck timeout ${SANITIZE_TIMEOUT:-300} compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_targets.py
    step racecheck timeout ${SANITIZE_TIMEOUT:-300} compute-sanitizer --tool racecheck --error-exitcode 9 python3 tests/gpu/sanitize_targets.py
    grep -q "0 hazards" "$OUT/racecheck.log" || grep -m 12 -E "Error|Write|Read|at .*0x|in .*kernel" "$OUT/racecheck.log"
  fi
fi
sass_done
if [ "$what" = dist ]; then  # checks first, then the benchmarks (the longest last), so a cut-off run keeps the checks
  ngpu=$(nvidia-smi -L | wc -l)
  nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
  # DIST_ONLY='litgpt' (or 'tests', 'collectives', any of them): only those parts of the multi-GPU run.
  dist_wanted() { [[ " ${DIST_ONLY:-tests collectives${DIST_LITGPT:+ litgpt}} " == *" $1 "* ]]; }
  dist_wanted tests && step dist_tests timeout ${DIST_TEST_TIMEOUT:-500} bash -c "cd /tmp && python3 -m pytest -q -p no:cacheprovider -s $here/tests/gpu/test_collectives_multi_gpu.py ${DIST_TEST_ARGS:-} -rs --junitxml=$OUT_ABS/dist_tests.xml"
  grep -E "passed|failed|error" "$OUT/dist_tests.log" 2>/dev/null | tail -n 1
  if [ -n "${DIST_SANITIZE:-}" ] && dist_wanted tests; then
    # API return codes are left out: NCCL's init probes kernels of other architectures and torch probes fabric
    # handles, each an expected error (18 of them on the 2x H200 host), not a memory error of ours.
    for tool in memcheck racecheck; do
      step ${tool}_dist timeout ${DIST_SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --report-api-errors no --target-processes all --error-exitcode 9 python3 -m torch.distributed.run --nproc_per_node "$ngpu" tests/gpu/collectives_worker.py small
    done
  fi
  if dist_wanted collectives; then
    step bench_collectives timeout ${DIST_BENCH_TIMEOUT:-300} python3 -m torch.distributed.run --nproc_per_node "$ngpu" benchmarks/collectives.py ${COLL_ARGS:-} --json "$OUT/collectives.json" --png "$OUT/collectives.png"
    cat "$OUT/bench_collectives.log"
  fi
  if dist_wanted litgpt; then  # the end-to-end step sharded over every GPU (LITGPT_FSDP_ARGS)
    step bench_litgpt_fsdp timeout ${DIST_LITGPT_TIMEOUT:-400} python3 -m torch.distributed.run --nproc_per_node "$ngpu" benchmarks/litgpt_step.py --fsdp ${LITGPT_FSDP_ARGS:-} --json "$OUT/litgpt_step_fsdp.json" --png "$OUT/litgpt_step_fsdp.png"
    cat "$OUT/bench_litgpt_fsdp.log"
  fi
fi
if [ "$what" = pretrain ]; then
  ngpu=$(nvidia-smi -L | wc -l)
  step pretrain_compare timeout ${PRETRAIN_TIMEOUT:-500} bash -c "cd /tmp && python3 $here/benchmarks/pretrain_compare.py --config $here/${PRETRAIN_CONFIG:-litgpt_configs/llama-2-7b.yaml} --nproc $ngpu ${PRETRAIN_ONLY:+--only $PRETRAIN_ONLY} --timeout ${PRETRAIN_VARIANT_TIMEOUT:-240} --work $OUT_ABS/pretrain --json $OUT_ABS/pretrain_compare.json --png $OUT_ABS/pretrain_compare.png -- ${PRETRAIN_ARGS:-}"
  cat "$OUT/pretrain_compare.log"
  if [ -n "${PRETRAIN_THEN_KERNELS:-}" ]; then
    step dist_kernels timeout ${DIST_KERNELS_TIMEOUT:-150} bash -c "cd /tmp && python3 -m torch.distributed.run --nproc_per_node $ngpu $here/tests/gpu/collectives_worker.py kernels"
  fi
fi
if [ "$what" = profile ] || [ -n "${PROFILE:-}" ]; then  # PROFILE set: in any mode, after the tests
  step profile timeout ${PROFILE_TIMEOUT:-500} bash -c "cd /tmp && export OUT=$OUT_ABS HERE=$here && ${PROFILE:?PROFILE: the command to run}"
  cat "$OUT/profile.log"
fi
# Whether this mode runs benchmarks (`all`, `bench`), and whether it runs benchmark $1 (BENCHES, default every one).
benching() { [ "$what" = all ] || [ "$what" = bench ]; }
bench_wanted() { benching && [[ " ${BENCHES:-gemm attention loss litgpt delta} " == *" $1 "* ]]; }
if { [ -d .ab_ref ] || [ -n "${AB_KNOB:-}" ]; } && benching; then
  # Same-machine A/B against another commit (scripts/ab_ref.sh <commit>; carry .ab_ref): build it beside, run in turns.
  # AB_KNOB=NAME=V0,V1,...: instead, this build once per value of an environment variable (V0 the reference).
  if [ -n "${AB_KNOB:-}" ]; then
    ab_side=(--knob "$AB_KNOB")
  else
    step build_ref python3 -m pip install --no-build-isolation --no-index --no-deps --target /tmp/ref_site ./.ab_ref
    ab_side=(--ref-site /tmp/ref_site)
  fi
  # AB_INPROCESS="<ab_inprocess.py args>": the attention kernels (or with --bench gemm the GEMM) of both builds in
  # one process, in fine turns (a reference build only; AB_BENCH=none then skips the per-process A/B).
  if [ -n "${AB_INPROCESS:-}" ] && [ -z "${AB_KNOB:-}" ]; then
    step ab_inprocess timeout ${AB_TIMEOUT:-500} bash -c "cd /tmp && python3 $here/benchmarks/ab_inprocess.py --ref-site /tmp/ref_site --ref-label $(cat .ab_ref/AB_COMMIT 2>/dev/null || echo reference) ${AB_INPROCESS} --json $OUT_ABS/ab_inprocess.json"
    cat "$OUT/ab_inprocess.log"
  fi
  # AB_BENCH may name several benchmarks separated by ';' (each its own ab_<bench> log and JSON); none: no such run.
  [ "${AB_BENCH:-}" = none ] && AB_BENCH=";"
  IFS=';' read -ra ab_benches <<< "${AB_BENCH:-attention --no-backward --seq-lens 512 2048 8192}"
  for ab in "${ab_benches[@]}"; do
    read -ra ab_args <<< "$ab"; [ ${#ab_args[@]} = 0 ] && continue
    step ab_${ab_args[0]} timeout ${AB_TIMEOUT:-500} python3 benchmarks/ab_compare.py "${ab_side[@]}" --rounds ${AB_ROUNDS:-2} --json "$OUT/ab_${ab_args[0]}.json" "${ab_args[@]}"
    cat "$OUT/ab_${ab_args[0]}.log"
  done
fi
if bench_wanted gemm; then  # GEMM_ARGS: several runs separated by ';' (gemm.json, gemm_2.json, ...)
  IFS=';' read -ra gemm_runs <<< "${GEMM_ARGS:- }"
  n=0
  for run_args in "${gemm_runs[@]}"; do
    n=$((n + 1)); sfx=$([ $n = 1 ] && echo "" || echo "_$n")
    step bench_gemm$sfx timeout 400 python3 benchmarks/gemm.py $run_args --json "$OUT/gemm$sfx.json" --png "$OUT/gemm$sfx.png"
    cat "$OUT/bench_gemm$sfx.log"
  done
fi
if bench_wanted attention; then
  step bench_attention timeout ${ATTN_TIMEOUT:-400} python3 benchmarks/attention.py ${ATTN_ARGS:-} --json "$OUT/attention.json" --png "$OUT/attention.png"
  cat "$OUT/bench_attention.log"
fi
if bench_wanted loss; then
  step bench_loss timeout 300 python3 benchmarks/cross_entropy.py ${LOSS_ARGS:-} --json "$OUT/cross_entropy.json" --png "$OUT/cross_entropy.png"
  cat "$OUT/bench_loss.log"
fi
if bench_wanted litgpt; then
  step bench_litgpt timeout ${LITGPT_TIMEOUT:-500} python3 benchmarks/litgpt_step.py ${LITGPT_ARGS:-} --json "$OUT/litgpt_step.json" --png "$OUT/litgpt_step.png"
  cat "$OUT/bench_litgpt.log"
fi
if bench_wanted step_gemms; then  # each GEMM call of one Thunder [tk] LitGPT step, tk against cuBLAS
  step bench_step_gemms timeout ${STEP_GEMMS_TIMEOUT:-400} python3 benchmarks/step_gemms.py ${STEP_GEMMS_ARGS:-} --json "$OUT/step_gemms.json"
  cat "$OUT/bench_step_gemms.log"
fi
if bench_wanted qkv_grad; then  # not in the default set: the attention backward into dqkv with rope (QKV_GRAD_ARGS)
  step bench_qkv_grad timeout 300 python3 benchmarks/attention_qkv_grad.py ${QKV_GRAD_ARGS:-} --json "$OUT/attention_qkv_grad.json" --png "$OUT/attention_qkv_grad.png"
  cat "$OUT/bench_qkv_grad.log"
fi
if bench_wanted rope; then  # not in the default set: the qkv projection, rope in its epilogue (LINEAR_ROPE_ARGS)
  step bench_rope timeout 300 python3 benchmarks/linear_rope.py ${LINEAR_ROPE_ARGS:-} --json "$OUT/linear_rope.json" \
    --png "$OUT/linear_rope.png"
  cat "$OUT/bench_rope.log"
fi
if bench_wanted sum; then  # not in the default set: two products summed in one launch (GEMM_SUM_ARGS)
  step bench_gemm_sum timeout 300 python3 benchmarks/gemm_sum.py ${GEMM_SUM_ARGS:-} \
    --json "$OUT/gemm_sum.json" --png "$OUT/gemm_sum.png"
  cat "$OUT/bench_gemm_sum.log"
fi
if bench_wanted embedding; then  # not in the default set: the embedding's weight gradient (EMBEDDING_ARGS)
  step bench_embedding timeout 300 python3 benchmarks/embedding_backward.py ${EMBEDDING_ARGS:-} \
    --json "$OUT/embedding_backward.json" --png "$OUT/embedding_backward.png"
  cat "$OUT/bench_embedding.log"
fi
if bench_wanted adamw; then  # not in the default set: the optimizer's update, tk against torch's fused and foreach AdamW (ADAMW_ARGS)
  step bench_adamw timeout ${ADAMW_TIMEOUT:-400} python3 benchmarks/adamw.py ${ADAMW_ARGS:-} \
    --json "$OUT/adamw.json" --png "$OUT/adamw.png"
  cat "$OUT/bench_adamw.log"
fi
if bench_wanted delta; then
  step bench_delta python3 benchmarks/attention_bwd_delta.py ${BENCH_ARGS:-} --json "$OUT/attention_bwd_delta.json" --png "$OUT/attention_bwd_delta.png"
  cat "$OUT/bench_delta.log"
fi
# Without THUNDER_TK_COMMIT, git's word; "-dirty" says the tree is not that commit's (a copied tree beside an older
# .git, as on the device hosts, or uncommitted changes).
echo; echo "== $(cat "$OUT/gpu.txt") | commit ${THUNDER_TK_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo ?)}"
grep -E "passed|failed|error" "$OUT/gpu_tests.log" 2>/dev/null | tail -n 1
[ -s "$OUT/failures.log" ] && { echo "failed (failures.log):"; grep "^FAILED " "$OUT/failures.log" | head -n 20; }
[ -f "$OUT/sass.txt" ] && echo "sass: $(tr -s ' \n' ' ' < "$OUT/sass.txt")"
printf '%s\n' "${summary[@]}"
# The device tool fetches at most 8 files from $OUT: keep the results (JSON) and the run log loose, and pack the logs
# and charts into two archives (PACK_OUT=0 leaves everything loose).
if [ "${PACK_OUT:-1}" = 1 ]; then
  ( cd "$OUT" && shopt -s nullglob
    # pretrain/: each variant's metrics.jsonl, summary and explain report (many small files) go with the logs
    logs=(*.log *.txt *.xml); charts=(*.png); [ -d pretrain ] && logs+=(pretrain)
    [ ${#logs[@]} -gt 0 ] && tar czf logs.tgz "${logs[@]}" && rm -rf "${logs[@]}"
    [ ${#charts[@]} -gt 0 ] && tar czf charts.tgz "${charts[@]}" && rm -f "${charts[@]}"
    echo "in \$OUT: $(ls | tr '\n' ' ')" )
fi
