#!/bin/bash
# One device call of issue #8's GPU work, carrying [".raybundle"] (stack), or [".enginebundle", ".inductor_cache"]
# for the other modes: Ray's 46 MB and the tracked tree are most of the 64 MiB a call carries, so the stack
# carries the compile cache only where it still fits (since 2026-12-06 it does not: run the stack after an
# engine call on the same warm machine, whose cache it finds there; ray_bundle.py --engine-only builds
# .enginebundle: no Ray, 2.5 MB; both bundles hold the tokenizer, bench_assets.tar.xz):
#   bash benchmarks/device_call.sh first          # the KV memory check, then the engine in fp8 (scales in the
#                                                 # epilogue, the default), then the cache packed; on a
#                                                 # machine whose FP8 kernels are not in the carried cache
#                                                 # the FP8 compile alone outruns one call (runs 120, 158:
#                                                 # docs/gpu_notes.md): there run `engine --set` calls instead
#   bash benchmarks/device_call.sh answers [--cases ...]          # the fast paths' answers against eager ones
#                                                 # (gpu_answers_check.py: float32, bf16, fp8), then the cache packed
#   bash benchmarks/device_call.sh engine [--set KEY=JSON ...]   # the engine alone (gpu_engine.py)
#   bash benchmarks/device_call.sh firstuse [--set ...]           # gpu_first_use_probe.py (~1 min, no model),
#                                                 # then the engine as `engine`
#   bash benchmarks/device_call.sh probe          # gpu_first_use_probe.py alone (what a call with little
#                                                 # device time left can still do)
#   bash benchmarks/device_call.sh stack [--set KEY=JSON ...]    # the stack against the last engine run on this machine
# Why one script: a call's command line is 2,000 characters, the machine goes back 30 s after a call, and a
# fresh one costs minutes to start (often more: docs/gpu_notes.md), so each call does as much as fits its
# 600 s and packs the compile cache (inductor_cache.py) whatever happened, for the next call or machine.
# CALL_S=N (default 565) ends the measured script N s after the call began, for a call whose limit_s is under
# 600 (little device time left), so the script stops itself and its partial files still come back.
# Runs 119-126 (2026-12-06) came from it: their commands are in docs/benchmarks.md and docs/gpu_notes.md.
T0=$SECONDS
nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,power.limit --format=csv
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/seekserve-bench/inductor
mkdir -p /tmp/site /tmp/seekserve-bench $OUT/mc $OUT/eo .bench_assets
B=.raybundle; [ -f $B/site.tar.xz ] || B=.enginebundle
if [ ! -f /tmp/site/.done-$B ]; then
  tar -xJf $B/bench_assets.tar.xz -C .bench_assets && tar -xJf $B/site.tar.xz -C /tmp/site && touch /tmp/site/.done-$B
  python3 benchmarks/inductor_cache.py unpack --parts .inductor_cache 2>&1 | tail -2
fi
export PYTHONPATH=/tmp/site:$PWD
echo "setup done at $((SECONDS-T0)) s"
mode=$1; shift
if [ "$mode" = first ]; then
  timeout 130 python3 benchmarks/gpu_memory_check.py --tokenizer .bench_assets --out $OUT/mc > $OUT/memcheck-log.txt 2>&1
  echo "memcheck rc=$? at $((SECONDS-T0)) s"; tail -12 $OUT/memcheck-log.txt
  # then the engine in fp8: bf16 has its figures on both cards (runs 71-73 on H200s, 116 on an H100), fp8 none on an H200
  mode=engine; set -- --set 'quantization="fp8"'
fi
if [ "$mode" = firstuse ] || [ "$mode" = probe ]; then
  # the probe's engine arm takes the engine's prompt_attention from a --set of it, as the engine run does
  pa=$(printf '%s\n' "$@" | sed -n 's/^prompt_attention="\(.*\)"$/\1/p' | tail -1)
  timeout 150 python3 benchmarks/gpu_first_use_probe.py ${pa:+--prompt-attention $pa} --out $OUT/fu > $OUT/firstuse-log.txt 2>&1
  echo "first-use probe rc=$? at $((SECONDS-T0)) s"; tail -40 $OUT/firstuse-log.txt
  [ "$mode" = probe ] && exit 0  # no engine, so no compile cache to pack
  mode=engine
fi
left=$((${CALL_S:-565} - SECONDS + T0))  # what the measured script may use of the call
if [ "$mode" = answers ]; then
  timeout $left python3 benchmarks/gpu_answers_check.py --tokenizer .bench_assets --out $OUT/ac "$@" > $OUT/answers-log.txt 2>&1
  echo "answers rc=$? at $((SECONDS-T0)) s"; grep -v "Loading weights\|Writing model" $OUT/answers-log.txt | tail -30
elif [ "$mode" = engine ]; then
  timeout $left python3 benchmarks/gpu_engine.py --tokenizer .bench_assets --set mixed_graph_tokens=512 "$@" --engine-process separate --think-ms 0 --skip-probes --out $OUT/eo > $OUT/engine-log.txt 2>&1
  echo "engine rc=$? at $((SECONDS-T0)) s"; tail -30 $OUT/engine-log.txt
elif [ "$mode" = stack ]; then
  f=$(ls -t /tmp/seekserve-bench/last_engine/gpu_engine*.json | head -1); [ -n "$f" ] && cp $f $OUT/eo/gpu_engine.json; echo "engine to compare: $f"
  timeout $left python3 benchmarks/gpu_stack.py --tokenizer .bench_assets --concurrency 32 64 --steady-rounds 10 --set mixed_graph_tokens=512 "$@" --http-proxy haproxy --ingress direct --think-ms 0 --clients bare --out $OUT/eo > $OUT/stack-log.txt 2>&1
  echo "stack rc=$? at $((SECONDS-T0)) s"; tail -30 $OUT/stack-log.txt
fi
[ "$mode" = engine ] && mkdir -p /tmp/seekserve-bench/last_engine && cp $OUT/eo/gpu_engine*.json /tmp/seekserve-bench/last_engine/ 2>/dev/null
python3 benchmarks/inductor_cache.py pack --out $OUT/ic 2>&1 | tail -2
echo "all done at $((SECONDS-T0)) s"
