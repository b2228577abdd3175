#!/usr/bin/env bash
# The CUDA device check, as one prepared script (a lent GPU machine has minutes, not hours):
#   1. the kernel tests with Triton compiled for the GPU (no interpreter): every kernel against its reference,
#      forward and backward, fp32 and bf16, outputs poisoned; 10 training steps per backend on the GPU;
#   2a. `bench/grouped_gemm_sweep.py`: Triton grouped GEMM tiles vs per-expert torch matmuls;
#   2. `bench/kernels_bench.py --device cuda`: eager reference vs Triton (vs Liger-Kernel where it has the op)
#      at realistic shapes, with the max abs difference to the reference;
#   3. `bench/model_bench.py --device cuda --dtype bf16`: native V4 (Triton kernels) vs native with the torch
#      reference ops vs transformers' DeepseekV4ForCausalLM, tokens/s, peak memory and MFU vs the H200 peak;
#   4. the same with `--compile` (native blocks as train.<stage>.compile compiles them; transformers' model whole).
# Python packages the machine lacks travel as wheels in .whl/ (see docs/kernels.md, "GPU check").
# Usage on the GPU machine, from the repository root: OUT=/some/dir bash bench/gpu_check.sh
set -u
OUT=${OUT:-/tmp/trex-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TREX_STATE_DIR=/tmp/trex-state PYTHONDONTWRITEBYTECODE=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

T_TESTS=${T_TESTS:-120}
T_KBENCH=${T_KBENCH:-120}
T_MBENCH=${T_MBENCH:-120}

echo "== 1. kernel tests on CUDA (compiled Triton)"
timeout "$T_TESTS" python3 -m pytest -q -p no:cacheprovider tests/kernels -o addopts="" -rfE 2>&1 \
  | tee "$OUT/kernel_tests.log" | tail -25

echo "== 2a. grouped GEMM tile sweep"
timeout 60 python3 bench/grouped_gemm_sweep.py 2>&1 | tee "$OUT/gemm_sweep.log"

echo "== 2. kernel benchmark on CUDA"
timeout "$T_KBENCH" python3 bench/kernels_bench.py --device cuda --rounds 5 \
  --rows 32768 --width 4096 --tokens 16384 --experts 64 --topk 6 --hidden 2048 --inter 1024 \
  --ce-tokens 16384 --vocab 129280 --ce-hidden 4096 2>&1 | tee "$OUT/kernels_bench.log" | grep -v '^{'

# a ~1 B-activated V4 at 4k context: every attention type, hash + top-k MoE, 4 mHC streams
MODEL=(--batch 4 --seq 4096 --vocab 32768
  --set model.hidden_size=1024 --set model.num_layers=4
  --set "model.layer_types=[sliding_attention,compressed_sparse_attention,heavily_compressed_attention,compressed_sparse_attention]"
  --set "model.mlp_layer_types=[hash_moe,moe,moe,moe]" --set model.n_routed_experts=16
  --set model.num_experts_per_tok=4 --set model.moe_intermediate_size=512 --set model.num_heads=8
  --set model.q_lora_rank=512 --set model.o_lora_rank=256 --set model.o_groups=4 --set model.max_seq_len=4096
  --set model.sliding_window=128 --set model.index_topk=128 --set model.hc_mult=4)

echo "== 3. model benchmark on CUDA (bf16 autocast)"
timeout "$T_MBENCH" python3 bench/model_bench.py --device cuda --dtype bf16 --rounds 1 --steps 6 \
  --engines native,native-reference,hf "${MODEL[@]}" 2>&1 | tee "$OUT/model_bench.log" | grep -v '^{'

echo "== 4. the same, compiled (train.<stage>.compile: every native block; transformers' whole model)"
timeout "$T_MBENCH" python3 bench/model_bench.py --device cuda --dtype bf16 --rounds 1 --steps 6 --compile \
  --engines native,hf "${MODEL[@]}" 2>&1 | tee "$OUT/model_bench_compiled.log" | grep -v '^{'
echo "== done"
