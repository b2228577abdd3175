#!/usr/bin/env bash
# The CUDA device check, as one prepared script (a lent GPU machine has minutes, not hours):
#   1. the kernel tests with Triton compiled for the GPU (no interpreter): every kernel against its reference,
#      forward and backward, fp32 and bf16, outputs poisoned; 10 training steps per backend on the GPU;
#   2a. `bench/grouped_gemm_sweep.py`: Triton grouped GEMM tiles vs per-expert torch matmuls;
#   2. `bench/kernels_bench.py --device cuda`: eager reference vs Triton (vs Liger-Kernel where it has the op)
#      at realistic shapes, with the max abs difference to the reference;
#   3. `bench/model_bench.py --device cuda --dtype bf16`: native V4 (Triton kernels, FlexAttention) vs native with
#      masked SDPA vs transformers' DeepseekV4ForCausalLM, tokens/s, peak memory and MFU vs the H200 peak;
#   4. the same with `--compile` (native blocks as train.<stage>.compile compiles them; transformers' model whole);
#   5. `bench/attention_bench.py`: the attention core alone per layer type, masked SDPA vs FlexAttention (block
#      mask, sink through the log-sum-exp), time, memory and the largest difference of output and gradients.
#   6. step 3 on the issue's >= 1 B-activated config (native vs transformers);
#   7. native on that config compiled (train.<stage>.compile), with dynamo's recompile log.
# STEPS (default "3 6 5 4 1 2a 2") picks and orders the steps; the T_* variables bound each one (seconds).
# Step 3 writes torch.profiler tables of one more step per engine to $OUT/profile_<engine>_bf16.txt; everything
# else goes to $OUT/gpu_check.log.
# All steps exceed one device call (600 s). On the second 2026-12-04 lease steps 6 + 7 took 386 s (step 7, compiling
# three block kinds, ~210 s). Next lease (the fused AdamW and the Triton SwiGLU in the MoE, untimed at model level):
# STEPS="7 6" T_M1BC=300 first (<= 600 s), then STEPS="1 4" with what is left.
# Python packages the machine lacks travel as wheels in .whl/ (see docs/kernels.md, "GPU check").
# Usage on the GPU machine, from the repository root: OUT=/some/dir bash bench/gpu_check.sh
set -u
OUT=${OUT:-/tmp/trex-gpu-check}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1  # one log (a device run brings back at most 8 files)
export PYTHONUNBUFFERED=1 TREX_STATE_DIR=/tmp/trex-state PYTHONDONTWRITEBYTECODE=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    --find-links .whl pydantic pydantic-core annotated-types typing-inspection liger-kernel \
    && export PYTHONPATH=/tmp/site || exit 1
fi
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

T_TESTS=${T_TESTS:-120}
T_KBENCH=${T_KBENCH:-120}
T_MBENCH=${T_MBENCH:-200}  # (2026-12-04: three engines took ~130 s, FlexAttention's first compile included)
T_MCOMP=${T_MCOMP:-420}  # (2026-12-04: 200 s did not finish compiling native + transformers)
T_ATTN=${T_ATTN:-90}
STEPS=${STEPS:-3 6 5 4 1 2a 2}
KB_OPS=${KB_OPS:-rms_norm,swiglu,rope,sinkhorn,hc_expand,router,permute,grouped_mm,moe,flce}
M_ENGINES=${M_ENGINES:-native,native-sdpa,hf}

# a 187 M-parameter V4 (~80 M activated) at 4k context: every attention type, hash + top-k MoE, 4 mHC streams
MODEL=(--batch 4 --seq 4096 --vocab 32768
  --set model.hidden_size=1024 --set model.num_layers=4
  --set "model.layer_types=[sliding_attention,compressed_sparse_attention,heavily_compressed_attention,compressed_sparse_attention]"
  --set "model.mlp_layer_types=[hash_moe,moe,moe,moe]" --set model.n_routed_experts=16
  --set model.num_experts_per_tok=4 --set model.moe_intermediate_size=512 --set model.num_heads=8
  --set model.q_lora_rank=512 --set model.o_lora_rank=256 --set model.o_groups=4 --set model.max_seq_len=4096
  --set model.sliding_window=128 --set model.index_topk=128 --set model.hc_mult=4)

# the issue's >= 1 B-activated config: 12 layers (sliding, CSA, HCA, CSA) x 3, hidden 2048, 16 heads of 128,
# 16 routed experts top-6 of width 1536 (+1 shared): 6.31 GFLOP/token at 4k context, ~1.05 B activated-equivalent
LT=sliding_attention,compressed_sparse_attention,heavily_compressed_attention,compressed_sparse_attention
MODEL_1B=(--batch 2 --seq 4096 --vocab 32768
  --set model.hidden_size=2048 --set model.num_layers=12 --set "model.layer_types=[$LT,$LT,$LT]"
  --set "model.mlp_layer_types=[hash_moe,moe,moe,moe,moe,moe,moe,moe,moe,moe,moe,moe]" --set model.n_routed_experts=16
  --set model.num_experts_per_tok=6 --set model.moe_intermediate_size=1536 --set model.num_heads=16
  --set model.q_lora_rank=1024 --set model.o_lora_rank=512 --set model.o_groups=8 --set model.max_seq_len=4096
  --set model.sliding_window=128 --set model.index_topk=128 --set model.hc_mult=4)
T_M1B=${T_M1B:-300}
T_M1BC=${T_M1BC:-300}

for step in $STEPS; do case $step in
1) echo "== 1. kernel tests on CUDA (compiled Triton)"  # (--confcutdir: tests/conftest.py imports Prefect)
   timeout "$T_TESTS" python3 -m pytest -q -p no:cacheprovider tests/kernels --confcutdir tests/kernels \
     -o addopts="" -rfE 2>&1 | tail -25 ;;
2a) echo "== 2a. grouped GEMM tile sweep"
   timeout 60 python3 bench/grouped_gemm_sweep.py 2>&1 ;;
2) echo "== 2. kernel benchmark on CUDA"
   timeout "$T_KBENCH" python3 bench/kernels_bench.py --device cuda --rounds 5 --ops "$KB_OPS" \
     --rows 32768 --width 4096 --tokens 16384 --experts 64 --topk 6 --hidden 2048 --inter 1024 \
     --ce-tokens 16384 --vocab 129280 --ce-hidden 4096 2>&1 ;;
3) echo "== 3. model benchmark on CUDA (bf16 autocast)"
   timeout "$T_MBENCH" python3 bench/model_bench.py --device cuda --dtype bf16 --rounds 1 --steps 6 \
     --engines "$M_ENGINES" --profile "$OUT" "${MODEL[@]}" 2>&1 ;;
4) echo "== 4. the same, compiled (train.<stage>.compile: every native block; transformers' whole model)"
   timeout "$T_MCOMP" python3 bench/model_bench.py --device cuda --dtype bf16 --rounds 1 --steps 6 --compile \
     --engines native,hf "${MODEL[@]}" 2>&1 ;;
5) echo "== 5. attention core: masked SDPA vs FlexAttention (bf16, the model config's shapes)"
   timeout "$T_ATTN" python3 bench/attention_bench.py --batch 4 --seq 4096 --heads 8 --head-dim 128 \
     --window 128 --topk 128 --rate-csa 4 --rate-hca 32 --rounds 3 2>&1
   echo "-- the published V4's head width (512) and CSA/HCA rates (4 / 128), 16 heads"  # (FlexAttention's tiles)
   timeout "$T_ATTN" python3 bench/attention_bench.py --batch 1 --seq 8192 --heads 16 --head-dim 512 \
     --window 128 --topk 512 --rate-csa 4 --rate-hca 128 --rounds 3 2>&1 ;;
6) echo "== 6. model benchmark, the >= 1 B-activated config (bf16 autocast)"
   timeout "$T_M1B" python3 bench/model_bench.py --device cuda --dtype bf16 --rounds 1 --steps 4 \
     --engines native,hf --profile "$OUT/1b" "${MODEL_1B[@]}" 2>&1 ;;
7) echo "== 7. the >= 1 B-activated config, native compiled"
   TORCH_LOGS=recompiles timeout "$T_M1BC" python3 bench/model_bench.py --device cuda --dtype bf16 --rounds 1 \
     --steps 4 --compile --engines native --profile "$OUT/1b" "${MODEL_1B[@]}" 2>&1 ;;
esac; done
echo "== done"
