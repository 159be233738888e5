#!/bin/bash
# The GPU conformance suites and the quick diagnostics in one command, for a lent GPU machine
# whose session time is short (no network there).
#
#   bash bench/gpu_checks.sh [STAGE ...]        # default: suites quant-diag batch1
#
# Stages (each under `timeout`, its log in $OUT/gpu_checks/STAGE.log, the rc and seconds in
# times.txt; everything is also packed into $OUT/gpu_checks.tgz, since the device tool brings back
# only a few files):
#   suites      the quant suite (four methods), the MoE runner suites, the GPU quant tests
#   quant-diag  bench/diag_moe_fp8.py (the fp8 MoE experts' error, by stage)
#   batch1      bench/profile_decode.py at batch 1 for bf16, online fp8 and AWQ, then 16 for fp8
#   peers       bench/sweep_quant.py --only peers (small-M fp8 / int4 against the library kernels)
#   serve       bench/serve_methods.py (every quant method through `core serve`)
#   offline-fp8 bench/profile_decode.py at batch 256 (1,024-token prompts), bf16 and fp8
#   parallel-1gpu  bench/bench_parallel.py at TP=1 and DP=1 / 2 on one GPU (issue 18's fallback
#               when no multi-GPU machine is lent: the NCCL path, two replicas sharing the GPU)
#   lora        the GPU LoRA tests, bench/bench_lora_serving.py (issue 36's targets), then
#               profile_decode.py --lora 8 at batch 1 and 64
#   spec        profile_decode.py --verify 4 (a verify step's cost against a plain one, bf16),
#               then bench/bench_spec_gpu.py (the oracle's forced acceptance, the c64 governor)
#   gemma       profile_decode.py on Gemma-2-9B at batch 1, then sweep_triton.py --shape gemma2
#               (the d256 decode tiling, tuning.py's ("sm90", "d256") entry)
#   gemma-suites  the GPU tests of the Gemma / GPT-OSS / mxfp4 / Triton attention and ops paths,
#               then the attention and mxfp4 quant conformance suites on cuda (issue 35's "the
#               suites pass on the GPU"; 90 and 50 s were too short in session 29)
#   gpt-oss     bench_serving.py on GPT-OSS-20B (dummy MXFP4 experts): batch 1, offline 1,000 x
#               1,024/256, online through `core serve` (issue 35's targets)
#   cold-start  bench/cold_start.py (Llama-3.1-8B dummy: empty kernel caches, then a restart)
#   amx-profile the host CPU: py-spy over 16-thread batch-1 decode (needs the py-spy wheel in .whl;
#               -r 100, since -r 250 fell behind there), then ours on the VNNI kernels
#               (--quantization gguf_avx512) for issue 38's "pp512 >= 2x our VNNI path"
#   amx         the host CPU, not the GPU (issue 38; the H200 host has AMX): its flags, the AMX
#               tests, a random-weight copy of the default model built from .whl/meta.gguf
#               (bench/gguf_like.py; needs the gguf wheel in .whl), batch-1 decode steps at 4 and
#               16 threads, then bench_cpu_peers.py (ours, and llama.cpp when a llama_cpp_python
#               wheel built for this CPU is in .whl) at 16 threads, one rep
#
# Wheels the image lacks (gguf, compressed-tensors, xgrammar, ...) are installed from ./.whl
# when it exists (carry it with the device tool), then the checkout with its entry points.
set -u
STAGES="suites quant-diag batch1 peers serve offline-fp8 parallel-1gpu lora spec gemma gemma-suites gpt-oss cold-start amx amx-profile"
for s in ${*:-}; do  # refuse an unknown stage before any device time goes
    case " $STAGES " in *" $s "*) ;; *) echo "unknown stage $s (stages: $STAGES)" >&2; exit 2 ;; esac
done
OUT=${OUT:-/tmp/out}
R=$OUT/gpu_checks
mkdir -p "$R"
if [ -d .whl ]; then
    mkdir -p /tmp/site && python3 -m pip install -q --no-deps --target /tmp/site .whl/*.whl \
        >"$R/pip.log" 2>&1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$R/pip.log" 2>&1
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log -1 --format=%h; } \
    >"$R/machine.txt" 2>&1

run() {  # run NAME SECONDS CMD...
    local name=$1 limit=$2 t0
    shift 2
    t0=$(date +%s)
    timeout "$limit" "$@" >"$R/$name.log" 2>&1
    echo "$name rc=$? $(($(date +%s) - t0))s" | tee -a "$R/times.txt"
}
PYTEST=(python3 -m pytest -q -p no:cacheprovider --no-header -rfE)

for stage in "${@:-suites quant-diag batch1}"; do
  for s in $stage; do
    case $s in
    suites)
        run quant_suite 240 "${PYTEST[@]}" -m gpu --conformance-quant fp8 \
            --conformance-quant w8a8_int8 --conformance-quant awq --conformance-quant gptq \
            --conformance-device cuda conformance/quant_suite.py
        run moe_suites 300 "${PYTEST[@]}" -m gpu tests/test_moe_conformance.py \
            tests/test_moe_gpu.py tests/test_moe_triton.py --conformance-device cuda
        run quant_gpu 240 "${PYTEST[@]}" -m gpu tests/test_quant_gpu.py ;;
    quant-diag)
        run diag_moe_fp8 90 python3 bench/diag_moe_fp8.py --dtypes float32,float16,bfloat16 \
            --tilings table --out "$R/diag_moe_fp8.json" ;;
    batch1)
        run prof_bf16 120 python3 bench/profile_decode.py --batch-sizes 1 --steps 32 --rows 12 \
            --out "$R/prof_bf16.json"
        run prof_fp8 120 python3 bench/profile_decode.py --batch-sizes 1,16 --steps 32 \
            --rows 12 --quantization fp8 --out "$R/prof_fp8.json"
        run prof_awq 120 python3 bench/profile_decode.py --batch-sizes 1 --steps 32 --rows 12 \
            --quant-config awq --out "$R/prof_awq.json" ;;
    peers)
        run peers 240 python3 bench/sweep_quant.py --only peers --out "$R/peers.json" ;;
    serve)
        run serve_methods 400 python3 bench/serve_methods.py --out "$R/serve_methods.json" ;;
    offline-fp8)
        for q in bf16 fp8; do
            extra=()
            [ "$q" = fp8 ] && extra=(--quantization fp8)
            run "prof256_$q" 240 python3 bench/profile_decode.py --batch-sizes 256 \
                --graph-max-bs 256 --prompt-len 1024 --steps 16 --rows 20 "${extra[@]}" \
                --out "$R/prof256_$q.json"
        done ;;
    parallel-1gpu)
        run parallel_1gpu 540 python3 bench/bench_parallel.py --tp-sizes 1 --dp-sizes 1,2 \
            --num-prompts 200 --out "$R/parallel_1gpu.json" ;;
    lora)
        run lora_gpu 240 "${PYTEST[@]}" -m gpu tests/test_lora_conformance.py \
            tests/test_lora_triton_blocks.py tests/test_lora_graphs.py tests/test_lora.py \
            --conformance-device cuda
        run lora_serving 200 python3 bench/bench_lora_serving.py --skip-eager-base \
            --out "$R/lora_serving.json"
        run prof_lora 120 python3 bench/profile_decode.py --lora 8 --batch-sizes 1,64 \
            --steps 16 --graph-max-bs 64 --rows 25 --out "$R/prof_lora.json" ;;
    spec)
        run prof_verify 180 python3 bench/profile_decode.py --verify 4 --batch-sizes 1,16,64 \
            --steps 32 --graph-max-bs 256 --rows 15 --out "$R/prof_verify.json"
        run spec_gpu 400 python3 bench/bench_spec_gpu.py --out "$R/spec_gpu.json" ;;
    gemma)
        run prof_gemma 150 python3 bench/profile_decode.py \
            --config tests/fixtures/configs/gemma-2-9b.json --batch-sizes 1 --steps 16 --rows 20 \
            --out "$R/prof_gemma.json"
        run sweep_d256 240 python3 bench/sweep_triton.py --shape gemma2 --skip extend --quick \
            --out "$R/sweep_d256.json" ;;
    gemma-suites)
        run gemma_suites 400 "${PYTEST[@]}" -m gpu tests/test_gpt_oss.py tests/test_mxfp4.py \
            tests/test_triton_attention.py tests/test_gemma.py tests/test_triton_ops.py
        run gemma_conformance 300 "${PYTEST[@]}" -m "" conformance/attention_suite.py \
            conformance/quant_suite.py --conformance-backend triton --conformance-quant mxfp4 \
            --conformance-device cuda ;;
    gpt-oss)
        run gpt_oss 500 python3 bench/bench_serving.py \
            --config tests/fixtures/configs/gpt-oss-20b.json --modes batch1,offline,online \
            --num-prompts 1000 --input-len 1024 --output-len 256 --online-num-prompts 32 \
            --online-output-len 128 --skip-hf --skip-eager --out "$R/gpt_oss.json" ;;
    cold-start)
        run cold_start 150 python3 bench/cold_start.py --out "$R/cold_start.json" ;;
    amx)
        { lscpu; grep -o -w 'amx_[a-z0-9]*\|avx512_[a-z0-9]*' /proc/cpuinfo | sort -u; } \
            >"$R/amx_cpu.txt" 2>&1
        run amx_tests 150 "${PYTEST[@]}" tests/test_gguf_amx.py tests/test_cpu_amx_attention.py
        if [ ! -f .whl/meta.gguf ]; then
            echo "amx: no .whl/meta.gguf (carry .whl; closing note of session 27): model runs skipped" \
                | tee -a "$R/times.txt"
            continue
        fi
        run amx_model 60 python3 bench/gguf_like.py build .whl/meta.gguf /tmp/smol.gguf
        run amx_steps 120 python3 bench/cpu_decode_steps.py --model-path /tmp/smol.gguf \
            --threads 4,16 --steps 64
        peers=ours
        python3 -c "import llama_cpp" 2>/dev/null && peers=ours,llama.cpp
        # llama.cpp's AMX path (its extra buffer types) dies on this model: SIGSEGV on session
        # 18's AMX VM, SIGILL (-4) on the H100 host in session 28; off, it runs its VNNI kernels
        run amx_peers 240 python3 bench/bench_cpu_peers.py --model-path /tmp/smol.gguf \
            --peers "$peers" --threads 16 --reps 1 --llama-extra-bufts off \
            --out "$R/amx_peers.json" ;;
    amx-profile)
        if [ ! -f .whl/meta.gguf ] || ! ls .whl/py_spy-*.whl >/dev/null 2>&1; then
            echo "amx-profile: needs .whl/meta.gguf and the py-spy wheel in .whl" \
                | tee -a "$R/times.txt"
            continue
        fi
        run amx_model 60 python3 bench/gguf_like.py build .whl/meta.gguf /tmp/smol.gguf
        run amx_spy16 120 /tmp/site/bin/py-spy record --native -r 100 --format raw \
            -o "$R/amx_spy16.txt" -- python3 bench/cpu_decode_steps.py \
            --model-path /tmp/smol.gguf --threads 16 --steps 600
        run amx_vnni 200 python3 bench/bench_cpu_peers.py --model-path /tmp/smol.gguf \
            --peers ours --quantization gguf_avx512 --threads 16 --reps 1 \
            --out "$R/amx_vnni.json" ;;
    esac
  done
done
tar czf "$OUT/gpu_checks.tgz" -C "$OUT" gpu_checks
