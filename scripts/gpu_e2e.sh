#!/usr/bin/env bash
# End-to-end figures on the GPU machine (after `source .gpukit/kit_env.sh`), written into
# $RESULTS by bench/bench_e2e.py (each file records its own command):
#   e2e_resnet50_fp16_<tag>     ours (CUDA graphs, default) vs ours without graphs, 2 threads,
#                               the stock handler (same threads; and without a budget) and the
#                               echo transport limit, clients 1..128, on one GPU (GPUS=1,all: more)
#   e2e_resnet50_fp16_b1_<tag>  batchSize 1 at one client: latency with and without graphs, and
#                               the first request after READY (echo first) against steady/idle
#   e2e_resnet50_cpu_<tag>      CPU workers (exported ResNet-50 fp32): thread budget sweep
#   e2e_resnet50_fp16_scaling_<tag>  one GPU (ours, stock, echo) and all GPUs (ours, echo): scaling;
#                               ours_tsreader is ours reading the frontend with TorchServe's reader
#   frames_<tag>                the worker reading a batch from the frontend: TorchServe's reader
#                               against handlers/torchserve/frontend_frames.py (CPU ms per batch, no GPU)
#   bench_resnet50_fp16_<tag>   handle() in process, CUDA graphs on and off, first request
#   bench_resnet50_fp16_export_<tag>  the same for the fp16 exported program (ExportedProgram.module())
#   e2e_resnet50_fp16_check_<tag>  one GPU, 1 and 64 clients, ours/stock/echo and ours with cuda_sync=block
#                               (the engine's wait for its GPU; auto spins): a short check of a revision
#   cpu_per_call_resnet50_fp16_<tag>  handle() on 1 and 8 one-row requests: wall and CPU ms per call of the
#                               worker served by the engine, the engine blocking and spinning (what a
#                               worker takes from the host's cores)
#   e2e_resnet50_fp16_shipped_<tag>, e2e_resnet50_fp16_mps_<tag>  one GPU, 64 clients, ours/stock/echo,
#                               without and then with CUDA MPS (the control daemon started for the
#                               second run and stopped after it; the workers inherit its pipe directory)
#   e2e_text_encoder_fp16_<tag>  text encoder, lengths 16..128 per request: ours, ours_pad (padding
#                               to length buckets; ours_padblock: and cuda_sync=block), stock eager,
#                               stock_aoti (same package), echo
#   e2e_mlp_fp16_<tag>          small MLP: ours, ours_block (cuda_sync=block), stock, stock_aoti, echo
#   e2e_hf_bert_fp16_<tag>      a transformers BERT classifier (examples/hf_bert.py: 6 layers, hidden 768,
#                               batch 1..64, length 8..256), exported and packaged as a user does, the
#                               .pt2 files handed to the archive with no options (padding found by the
#                               import); lengths 16..128 per request: ours, ours_nopad (pad={}: no
#                               padding), stock eager and stock_aoti (both pad each batch to its
#                               longest request, zero mask), echo; 1 and 64 clients
#   pod_resnet50_fp16_<tag>, pod_text_encoder_fp16_<tag>  the KServe pod's routes (nginx REST, the
#                               gRPC bridge) beside direct TorchServe, same bodies, 1 and 64 clients
#                               (bench/bench_pod.py; needs nginx: NGINX or on PATH); POD_LOAD=native
#                               loads them with wrk and h2load (LOADGEN or on PATH) instead of Python clients
#   pod_wide_fp32_<tag>         one 64 MiB FP32 request by the pod's REST binary and gRPC routes, equal eager
#   start_{resnet50,text_encoder}_fp16_<tag>  worker start step by step, 1 and 6 workers, and kill -9
#                               restarts of one worker, then of all at once (bench/bench_start.py --kill-all)
#   start_hf_bert_fp16_<tag>    the same for the transformers BERT classifier, the user's .pt2 files as
#                               the archive imports them, WORKERS workers (part start_bert)
#   e2e_mlp_fp16_reader_<tag>   small MLP: ours with its frame reader and with TorchServe's, 2 rounds
#   profile_mlp_fp16_<tag>      where handle() spends a worker's CPU per request (bench/profile_handle.py)
#   e2e_{mlp,text_encoder}_fp16_{w6,w12,b16w3,mps,mps12}_<tag>  small models at 64 clients, ours
#                               and echo (text: ours_pad too) with 6 workers, 12 workers, batch 16
#                               on 3 workers, and 6 and 12 workers under CUDA MPS (the daemon
#                               started and stopped around each); SMALL="NAME:BATCH:WORKERS ..."
#                               picks settings (a NAME starting with mps runs under MPS)
#   engine_{bert,r50,mlp}_fp16_<tag>  the engine (issue 64): ours (the default: the engine, with EWORKERS_OURS
#                               CPU workers, default 12: what cs-archive gives a 16-core host) and echo with as
#                               many, ours_engineN (engine: on with N CPU workers) for each N of EWORKERS
#                               (default none), ours_late (handler.engine_launch late) with ELATE=1, ours_nospin
#                               (engine_spin_us and engine_wait_spin_us 0: the default before s77) with
#                               ENOSPIN=1; 1, 64, 128 clients; wrk on cores of its
#                               own (LOAD=python: the Python clients); ESPY=RATE samples the workers (py-spy); ETIMELINE=1 records
#                               our workers' batch cycles (bench_e2e --timeline);
#                               EHANDLERS (default ours,echo: the variants are served only beside ours), ECLIENTS;
#                               CS_ENGINE_SAMPLE=PATH: each engine's own account, added to the results file;
#                               CS_ENGINE_PROFILE=START:COUNT beside it: torch's profiler table of that window of
#                               each engine's calls in PATH.PID.profile.txt (the CUDA calls a step makes).
#                               Two of these parts fit one 10-minute GPU call, whose $OUT returns at most 8 files.
#   engine_memory_big_mlp_fp16_<tag>  one copy of the weights per GPU, in the engine: examples/models.py:big_mlp
#                               (2 GiB fp16), the GPU memory of every process, 64 clients, answers, worker and
#                               engine kill -9 restarts, engines left after the stop (bench/bench_shared.py;
#                               EMODES: its modes, default engine)
#   heavy_{bert,r50,mlp}_fp16_<tag>  heavy load (issue 48): ours and echo with the archive's settings
#                               and with HEAVY's (NAME:BATCH:DELAY ..., default "b16:16:1 b32:32:1": batchSize 16 and 32,
#                               maxBatchDelay 1 ms; TorchServe 0.12 takes 0 as its default, 100 ms), wrk on 3 cores of its own
#                               (LOADGEN), 1, 64, 128 clients, each worker's batch cycle timed (--timeline)
#   spy_{mlp,resnet50,text_encoder}_fp16_<tag>  ours and echo at 1 and 64 clients with py-spy on
#                               every worker (--spy): the workers' time per request by stage, in
#                               the server under load (needs py-spy: PYSPY or on PATH)
#   lm_qwen15b_bf16_<tag>       issue 65 item 7: Qwen2.5-1.5B's shapes (random bf16 weights) through cs-export-lm
#                               --package --device cuda and cs-archive, TorchServe at 1, 8, 32, 64 streams, against
#                               transformers' compiled generate and generate_batch in the same run (bench/bench_lm.py;
#                               the checkpoint and artifact kept in $W/lm; LM_ARGS: more options, e.g. --rounds 1)
# PARTS selects (default "main b1 cpu"); BATCH, WORKERS, DELAY set the serving settings; ROUNDS
# measures every point that often, every other round in reverse order (default 2; 1 for mlp).
set -euo pipefail
RESULTS=${RESULTS:-docs/results}; TAG=${TAG:-gpu}; W=${WORK:-/tmp/gpu_e2e}
PARTS=${PARTS:-main b1 cpu}; BATCH=${BATCH:-8}; WORKERS=${WORKERS:-6}; DELAY=${DELAY:-1}; GPUS=${GPUS:-1}
PY=${PY:-python3}; export PYTHONUNBUFFERED=1
mkdir -p "$RESULTS" "$W"
# The GPU machine's image ships torch without .pyc files and sets PYTHONDONTWRITEBYTECODE=1, so
# every worker there compiles torch's sources at its start (import torch 4.1-4.9 s, 2.3-2.5 s
# compiled: shared_weights_big_mlp_fp16_h200, imports). Compiled once into a prefix, as a pip
# install writes them, and named in every results file's command; PYC=0 measures the image as is.
if [ "${PYC:-1}" = 1 ]; then
  export PYTHONPYCACHEPREFIX="$W/pyc"
  $PY -m compileall -q -j 0 "$($PY -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')" \
    "$($PY -c 'import os, ts; print(os.path.dirname(ts.__file__))')" handlers bench compiled_serving >/dev/null 2>&1 || true
fi
R50="--model examples/models.py:resnet50 --input image:8x3x224x224:float32 --dynamic-batch 1:64"
TEXT="--model examples/text_encoder.py:text_encoder --input input_ids:8xS:int64 --input attention_mask:8xS:int64 --dim S=8:256"
MLP="--model examples/mlp.py:mlp --input x:8x256:float32"
# the artifacts every part may use, compiled once each (in parallel: each compile is mostly one
# process); each compile's own exit status is waited for, so a failed one stops the script here
pids=()
need() {  # DIR ARGS...: compile into $W/DIR unless it is there
  local dir=$1; shift
  [ -f "$W/$dir/artifact.json" ] || { $PY -m compiled_serving.compile "$@" --backend aoti --precision fp16 --device cuda \
    --out "$W/$dir" & pids+=($!); }
}
case " $PARTS " in *" main "*|*" b1 "*|*" scaling "*|*" bench "*|*" check "*|*" mps "*|*" percall "*|*" start "*|*" spy "*|*" pod "*|*" heavy_r50 "*|*" engine_r50 "*) need r50 $R50 ;; esac
case " $PARTS " in *" text "*|*" start "*|*" spy "*|*" small "*|*" podtext "*) need text $TEXT --dynamic-batch 1:64 ;; esac
case " $PARTS " in *" engine_mem "*) need big --model examples/models.py:big_mlp --input x:4x8192:float32 --dynamic-batch 1:16 ;; esac
case " $PARTS " in *" mlp "*|*" profile "*|*" reader "*|*" spy "*|*" small "*|*" heavy_mlp "*|*" engine_mlp "*) need mlp $MLP --dynamic-batch 1:64 ;; esac
for pid in "${pids[@]}"; do wait "$pid" || { echo "gpu_e2e.sh: a compile failed (output above)" >&2; exit 1; }; done
E2E="$PY -m bench.bench_e2e --factory examples/models.py:resnet50 --rounds ${ROUNDS:-2}"
for part in $PARTS; do
  case $part in
    main) $E2E --artifact "$W/r50" --out "$RESULTS/e2e_resnet50_fp16_$TAG" --gpus "$GPUS" --clients 1,16,64,128 \
            --seconds 8 --batch-size "$BATCH" --workers-per-gpu "$WORKERS" --max-batch-delay "$DELAY" \
            --variant nographs:cuda_graphs=off --thread-sweep 2 --sweep-clients 64 ;;
    b1) $E2E --artifact "$W/r50" --out "$RESULTS/e2e_resnet50_fp16_b1_$TAG" --gpus 1 --clients 1 --seconds 8 \
            --batch-size 1 --workers-per-gpu 1 --max-batch-delay 0 --handlers ours,echo \
            --variant nographs:cuda_graphs=off --variant block:cuda_sync=block --first-request ;;
    cpu) [ -f "$W/r50cpu/artifact.json" ] || $PY -m compiled_serving.compile $R50 --backend export --device cpu --out "$W/r50cpu"
         $E2E --artifact "$W/r50cpu" --out "$RESULTS/e2e_resnet50_cpu_$TAG" --cpu --cpu-workers 4 --clients 16 \
            --seconds 8 --batch-size 4 --max-batch-delay 5 --thread-sweep 1,2,7 --sweep-clients 16 ;;
    scaling) $E2E --artifact "$W/r50" --out "$RESULTS/e2e_resnet50_fp16_scaling_$TAG" --gpus 1,all \
            --clients 64,128 --multi-gpu-clients 128 --seconds 8 --batch-size "$BATCH" \
            --workers-per-gpu "$WORKERS" --max-batch-delay "$DELAY" --handlers ours,stock,echo \
            --multi-gpu-handlers ours,echo --variant tsreader:buffered_reader=false ;;
    frames) $PY -m bench.bench_frames --batch-sizes 1,8 --out "$RESULTS/frames_$TAG" ;;
    bench) $PY -m bench.bench --artifact "$W/r50" --batch-sizes 1,8,64 --iters 20 --graphs-contrast \
            --formats safetensors --pieces 0 --out "$RESULTS/bench_resnet50_fp16_$TAG.json" ;;
    export) [ -f "$W/r50ep/artifact.json" ] || $PY -m compiled_serving.compile $R50 --backend export --precision fp16 \
              --device cuda --out "$W/r50ep"
            $PY -m bench.bench --artifact "$W/r50ep" --batch-sizes 1,8,64 --iters 20 --graphs-contrast \
              --formats safetensors --pieces 0 --out "$RESULTS/bench_resnet50_fp16_export_$TAG.json" ;;
    check) $E2E --artifact "$W/r50" --out "$RESULTS/e2e_resnet50_fp16_check_$TAG" --gpus 1 --clients 1,64 \
            --seconds 8 --batch-size "$BATCH" --workers-per-gpu "$WORKERS" --max-batch-delay "$DELAY" \
            --handlers ours,stock,echo --variant block:cuda_sync=block ;;
    mps) MPS="$E2E --artifact $W/r50 --gpus 1 --clients 64 --seconds 8 --batch-size $BATCH \
            --workers-per-gpu $WORKERS --max-batch-delay $DELAY --handlers ours,stock,echo"
         $MPS --out "$RESULTS/e2e_resnet50_fp16_shipped_$TAG"
         export CUDA_MPS_PIPE_DIRECTORY=$W/mps_pipe CUDA_MPS_LOG_DIRECTORY=$W/mps_log
         mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
         nvidia-cuda-mps-control -d
         $MPS --out "$RESULTS/e2e_resnet50_fp16_mps_$TAG" || true
         echo quit | nvidia-cuda-mps-control
         unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY ;;
    text) # the text encoder (examples/text_encoder.py, 6 layers, hidden 384) with a varying length:
          # every request draws its length from 16..128; ours groups by length, ours_pad pads to
          # length buckets (the model masks padding); stock_aoti calls the same package the plain way
          $PY -m bench.bench_e2e --factory examples/text_encoder.py:text_encoder --rounds 1 --artifact "$W/text" \
            --out "$RESULTS/e2e_text_encoder_fp16_$TAG" --gpus 1 --clients 1,64 --seconds 6 --batch-size "$BATCH" \
            --workers-per-gpu "$WORKERS" --max-batch-delay "$DELAY" --lengths uniform:16:128 \
            --handlers ours,stock,stock_aoti,echo --variant "pad:pad={input_ids: 0, attention_mask: 0}" \
            --variant "padblock:pad={input_ids: 0, attention_mask: 0},cuda_sync=block" ;;
    pod) # the KServe pod (nginx, the gRPC bridge) beside direct TorchServe, ResNet-50 fp16,
         # archive defaults; POD_ENV="K=V ..." sets the pod's environment (e.g. GRPC_BRIDGE_PROCESSES=4)
         $PY -m bench.bench_pod --artifact "$W/r50" --factory examples/models.py:resnet50 --clients 1,64 \
           --seconds 6 --rounds "${ROUNDS:-1}" --out "$RESULTS/pod_resnet50_fp16_$TAG" --load-generator "${POD_LOAD:-python}" \
           $(for kv in ${POD_ENV:-}; do echo "--pod-env=$kv"; done) ;;
    podtext) # the same for the text encoder with declared padding, lengths 16..128 per request
         $PY -m bench.bench_pod --artifact "$W/text" --factory examples/text_encoder.py:text_encoder \
           --clients 1,64 --seconds 6 --rounds "${ROUNDS:-1}" --lengths uniform:16:128 \
           --archive-option="--handler-option=pad={input_ids: 0, attention_mask: 0}" \
           --out "$RESULTS/pod_text_encoder_fp16_$TAG" --load-generator "${POD_LOAD:-python}" $(for kv in ${POD_ENV:-}; do echo "--pod-env=$kv"; done) ;;
    podwide) # 64 MiB of FP32 in one request (examples/models.py:wide) by the pod's REST binary and gRPC
         # routes, answers against eager; a short direct/pod point beside it
         [ -f "$W/wide/artifact.json" ] || $PY -m compiled_serving.compile --model examples/models.py:wide \
           --input x:2x16777216:float32 --dynamic-batch 1:2 --backend aoti --precision fp32 --device cuda --out "$W/wide"
         $PY -m bench.bench_pod --artifact "$W/wide" --factory examples/models.py:wide --clients 1 --seconds 3 \
           --routes direct_v2_binary,pod_v2_binary,direct_protobuf,pod_grpc --distinct-inputs 1 --largest-rows 1 \
           --out "$RESULTS/pod_wide_fp32_$TAG" ;;
    hf_bert) # the user's own model: plain torch and transformers build the files, the archive gets no options
         [ -f "$W/hf_bert/package.pt2" ] || $PY -m examples.hf_bert --size bench --device cuda --dtype float16 \
           --out "$W/hf_bert"
         $PY -m bench.bench_e2e --factory examples/hf_bert.py:bert_bench --rounds "${ROUNDS:-2}" \
           --artifact "$W/hf_bert/package.pt2" --program "$W/hf_bert/program.pt2" \
           --out "$RESULTS/e2e_hf_bert_fp16_$TAG" --gpus 1 --clients 1,64 --seconds 6 --batch-size "$BATCH" \
           --workers-per-gpu "$WORKERS" --max-batch-delay "$DELAY" --lengths uniform:16:128 \
           --handlers ours,stock,stock_aoti,echo --variant "nopad:pad={}" ;;
    mlp) # a small MLP (examples/mlp.py): the GPU work is tiny, so this measures the serving path;
         # ours (cuda_sync=auto: the engine spins) against the engine's blocking wait
         $PY -m bench.bench_e2e --factory examples/mlp.py:mlp --rounds "${ROUNDS:-1}" --artifact "$W/mlp" \
           --out "$RESULTS/e2e_mlp_fp16_$TAG" --gpus 1 --clients 1,64 --seconds 6 --batch-size "$BATCH" \
           --workers-per-gpu "$WORKERS" --max-batch-delay "$DELAY" --handlers ours,stock,stock_aoti,echo \
           --variant block:cuda_sync=block ;;
    start) for m in r50:resnet50 text:text_encoder; do
             $PY -m bench.bench_start --artifact "$W/${m%%:*}" --workers 1,"$WORKERS" --restarts 3 --kill-all \
               --batch-size "$BATCH" --max-batch-delay "$DELAY" --out "$RESULTS/start_${m#*:}_fp16_$TAG.json"
           done ;;
    start_bert) [ -f "$W/hf_bert/package.pt2" ] || $PY -m examples.hf_bert --size bench --device cuda --dtype float16 \
           --out "$W/hf_bert"
         $PY -m bench.bench_start --artifact "$W/hf_bert/package.pt2" --program "$W/hf_bert/program.pt2" \
           --workers "$WORKERS" --restarts 3 --kill-all --batch-size "$BATCH" --max-batch-delay "$DELAY" \
           --out "$RESULTS/start_hf_bert_fp16_$TAG.json" ;;
    reader) # the worker's frame reader against TorchServe's, order-balanced rounds (where a small
            # model makes the worker's CPU the limit)
            $PY -m bench.bench_e2e --factory examples/mlp.py:mlp --rounds 2 --artifact "$W/mlp" \
              --out "$RESULTS/e2e_mlp_fp16_reader_$TAG" --gpus 1 --clients 1,64 --seconds 6 --batch-size "$BATCH" \
              --workers-per-gpu "$WORKERS" --max-batch-delay "$DELAY" --handlers ours,echo \
              --variant tsreader:buffered_reader=false ;;
    spy) SPY="--gpus 1 --clients 1,64 --seconds 6 --batch-size $BATCH --workers-per-gpu $WORKERS \
           --max-batch-delay $DELAY --handlers ours,echo --spy 250 --rounds 1"
         $PY -m bench.bench_e2e --factory examples/mlp.py:mlp --artifact "$W/mlp" $SPY \
           --out "$RESULTS/spy_mlp_fp16_$TAG"
         $E2E --artifact "$W/r50" $SPY --out "$RESULTS/spy_resnet50_fp16_$TAG"
         $PY -m bench.bench_e2e --factory examples/text_encoder.py:text_encoder --artifact "$W/text" $SPY \
           --lengths uniform:16:128 --variant "pad:pad={input_ids: 0, attention_mask: 0}" \
           --out "$RESULTS/spy_text_encoder_fp16_$TAG" ;;
    small) small_failed=0
           mps_stop() {  # quit the MPS control daemon and wait until it is gone
             echo quit | nvidia-cuda-mps-control || true
             while pgrep -x nvidia-cuda-mps-control >/dev/null; do sleep 0.2; done
             unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
           }
           for setting in ${SMALL:-w6:8:6 w12:8:12 b16w3:16:3 mps:8:6 mps12:8:12}; do
             IFS=: read -r name batch workers <<< "$setting"
             SERVE="--gpus 1 --clients 64 --seconds 6 --max-batch-delay $DELAY --handlers ours,echo \
               --batch-size $batch --workers-per-gpu $workers"
             if [[ "$name" == mps* ]]; then
               export CUDA_MPS_PIPE_DIRECTORY=$W/mps_pipe CUDA_MPS_LOG_DIRECTORY=$W/mps_log
               mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
               trap mps_stop EXIT  # also when the script is stopped or fails inside the setting
               nvidia-cuda-mps-control -d
             fi
             $PY -m bench.bench_e2e --factory examples/mlp.py:mlp --artifact "$W/mlp" $SERVE \
               --out "$RESULTS/e2e_mlp_fp16_${name}_$TAG" || small_failed=1
             $PY -m bench.bench_e2e --factory examples/text_encoder.py:text_encoder --artifact "$W/text" $SERVE \
               --lengths uniform:16:128 --variant "pad:pad={input_ids: 0, attention_mask: 0}" \
               --out "$RESULTS/e2e_text_encoder_fp16_${name}_$TAG" || small_failed=1
             if [[ "$name" == mps* ]]; then
               mps_stop
               trap - EXIT
             fi
           done
           [ "$small_failed" = 0 ] || { echo "gpu_e2e.sh: a run of the small part failed (output above)" >&2; exit 1; } ;;
    profile) $PY -m bench.profile_handle --artifact "$W/mlp" --batch-sizes 1,8 --out "$RESULTS/profile_mlp_fp16_$TAG.json" ;;
    percall) $PY -m bench.cpu_per_call --artifact "$W/r50" --batch-sizes 1,8 \
              --out "$RESULTS/cpu_per_call_resnet50_fp16_$TAG.json" ;;
    engine_bert|engine_r50|engine_mlp) # the engine (issue 64): ours (the engine, the default), ours_engineN, echo
         model=${part#engine_}
         case $model in
           bert) [ -f "$W/hf_bert/package.pt2" ] || $PY -m examples.hf_bert --size bench --device cuda --dtype float16 --out "$W/hf_bert"
                 src=(--factory examples/hf_bert.py:bert_bench --artifact "$W/hf_bert/package.pt2" --program "$W/hf_bert/program.pt2" --lengths uniform:16:128) ;;
           r50) src=(--factory examples/models.py:resnet50 --artifact "$W/r50") ;;
           mlp) src=(--factory examples/mlp.py:mlp --artifact "$W/mlp") ;;
         esac
         evariants=(); for n in ${EWORKERS:-}; do evariants+=(--variant "engine$n:engine=on,workers=$n"); done
         [ "${ELATE:-0}" = 1 ] && evariants+=(--variant late:engine_launch=late)
         [ "${ENOSPIN:-0}" = 1 ] && evariants+=(--variant nospin:engine_spin_us=0,engine_wait_spin_us=0)
         $PY -m bench.bench_e2e "${src[@]}" --handlers "${EHANDLERS:-ours,echo}" ${evariants[@]+"${evariants[@]}"} --rounds "${ROUNDS:-1}" \
           --out "$RESULTS/engine_${model}_fp16_$TAG" --gpus 1 --clients "${ECLIENTS:-1,64,128}" --seconds "${SECONDS_PER_POINT:-4}" \
           --batch-size "$BATCH" --workers-per-gpu "${EWORKERS_OURS:-12}" --max-batch-delay "$DELAY" \
           --load-generator "${LOAD:-native}" ${ESPY:+--spy "$ESPY"} $([ "${ETIMELINE:-0}" = 1 ] && echo --timeline) ;;
    engine_mem) $PY -m bench.bench_shared --artifact "$W/big" --modes "${EMODES:-engine}" --restarts 2 --seconds 5 \
           --out "$RESULTS/engine_memory_big_mlp_fp16_$TAG" ;;
    heavy_bert|heavy_r50|heavy_mlp) # heavy load (issue 48): wrk on cores of its own (LOADGEN), our
         # workers' batch cycles recorded (--timeline); ours and echo with the archive's settings and
         # with each of HEAVY (NAME:BATCH:DELAY ...), 1, 64 and 128 clients
         model=${part#heavy_}; serving=(); for s in ${HEAVY:-b16:16:1 b32:32:1}; do serving+=(--serving "$s"); done
         case $model in
           bert) [ -f "$W/hf_bert/package.pt2" ] || $PY -m examples.hf_bert --size bench --device cuda --dtype float16 --out "$W/hf_bert"
                 src=(--factory examples/hf_bert.py:bert_bench --artifact "$W/hf_bert/package.pt2" --program "$W/hf_bert/program.pt2" --lengths uniform:16:128 --handlers ours,stock_aoti,echo) ;;
           r50) src=(--factory examples/models.py:resnet50 --artifact "$W/r50" --handlers ours,echo) ;;
           mlp) src=(--factory examples/mlp.py:mlp --artifact "$W/mlp" --handlers ours,echo) ;;
         esac
         $PY -m bench.bench_e2e "${src[@]}" --rounds "${ROUNDS:-1}" --out "$RESULTS/heavy_${model}_fp16_$TAG" --gpus 1 \
           --clients 1,64,128 --seconds "${SECONDS_PER_POINT:-6}" --batch-size "$BATCH" --workers-per-gpu "$WORKERS" \
           --max-batch-delay "$DELAY" --load-generator native --timeline "${serving[@]}" ;;
    lm) $PY -m bench.bench_lm --preset qwen25-1.5b --work "$W/lm" --out "$RESULTS/lm_qwen15b_bf16_$TAG" ${LM_ARGS:-} ;;
    *) echo "unknown part $part (main, b1, cpu, scaling, frames, bench, export, check, percall, mps, text, hf_bert, mlp, pod, podtext, podwide, start, profile, reader, spy, small, heavy_bert, heavy_r50, heavy_mlp, engine_bert, engine_r50, engine_mlp, engine_mem, lm)"; exit 2 ;;
  esac
done
