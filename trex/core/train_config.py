"""The ``train`` sections of the configuration (``trex.core.config`` re-exports them): a stage's training keys
(``StageTrainConfig``), its low-rank adapters (``LoRAConfig``), the RL stage (``RLConfig``, ``VLLMRollout``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from trex.core.sections import Section as _Section

LORA_TARGETS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "attn.compressor.wkv", "attn.compressor.wgate",
                "attn.indexer.wq_b", "attn.indexer.weights_proj", "attn.indexer.compressor.wkv",
                "attn.indexer.compressor.wgate", "ffn.shared.w1", "ffn.shared.w2", "ffn.shared.w3",
                "ffn.experts.w1", "ffn.experts.w2", "ffn.experts.w3")
"""What ``train.<stage>.lora.targets`` may name (native module paths inside a block; ``ffn.experts.w1/w2/w3``:
the routed experts' gate / down / up, stacked over experts, w1 and w3 together: PEFT's ``gate_up_proj`` adapts
both; the router is not a target: neither PEFT nor vLLM loads an adapter on it)."""

DEFAULT_LORA_TARGETS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "ffn.shared.w1", "ffn.shared.w2",
                        "ffn.shared.w3", "ffn.experts.w1", "ffn.experts.w2", "ffn.experts.w3")


class LoRAConfig(_Section):
    """``train.<stage>.lora``: low-rank adapters on a frozen base (trainer/lora.py, docs/lora.md). Every routed
    expert gets its own A / B (stacked tensors inside the grouped expert GEMMs); the base stays as loaded."""

    rank: int = Field(0, ge=0, description="0: off (full fine-tuning)")
    alpha: float = Field(16.0, gt=0, description="scale alpha / rank (rslora: alpha / sqrt(rank))")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input (dense targets only: PEFT "
                           "and vLLM refuse it on stacked experts)")
    rslora: bool = Field(False, description="rank-stabilised scaling alpha / sqrt(rank)")
    targets: list[str] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS),
                               description=f"modules adapted in every block: any of {', '.join(LORA_TARGETS)}")
    lr: float | None = Field(None, gt=0, description="the adapters' learning rate (None: the stage's lr)")
    base: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="the frozen base in memory: auto keeps a published checkpoint's FP8 / MXFP4 weights "
        "quantised (dequantised per layer in forward and backward), else the training dtype; bf16 / fp32: a "
        "dense copy")

    @model_validator(mode="after")
    def _targets(self) -> "LoRAConfig":
        unknown = sorted(set(self.targets) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(f"lora.targets: unknown {unknown}; known: {', '.join(LORA_TARGETS)}")
        if self.rank and not self.targets:
            raise ValueError("lora.targets is empty: the adapter would train nothing")
        if ("ffn.experts.w1" in self.targets) != ("ffn.experts.w3" in self.targets):
            raise ValueError("lora.targets: ffn.experts.w1 and ffn.experts.w3 go together (PEFT and vLLM adapt the "
                             "experts' fused gate_up_proj)")
        return self

    @property
    def scale(self) -> float:
        return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)


class StageTrainConfig(_Section):
    enabled: bool = Field(True, description="train.cpt.enabled=false skips CPT: SFT starts from model.init_from "
                          "(or from scratch)")
    steps: int = Field(100, ge=1)
    batch_size: int = Field(8, ge=1)
    seq_len: int = Field(256, ge=8)
    grad_accum: int = Field(1, ge=1)
    packing: Literal["in_order", "best_fit"] = Field(
        "in_order", description="documents into rows: in their order, or best-fit decreasing (fewer rows, less "
        "padding; trainer.data.pack)")
    group_by_length: bool = Field(False, description="batches of rows of similar length (each run of 16 batches "
                                  "of the epoch's permutation sorted by length): less padding after trimming")
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(1.0, gt=0)
    dtype: Literal["fp32", "bf16"] = "fp32"
    log_every: int = Field(5, ge=1)
    ckpt_every: int = Field(50, ge=1)
    keep_last: int = Field(2, ge=1)
    lora: LoRAConfig = Field(default_factory=lambda: LoRAConfig(), description="low-rank adapters on a frozen base "
                             "(rank 0: off)")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="muon: torch.optim.Muon on 2-D hidden matrices, AdamW on the rest")
    muon_ns_dtype: Literal["bf16", "fp32"] = Field(
        "bf16", description="muon: precision of the Newton-Schulz orthogonalisation (bf16 as torch.optim.Muon)")
    schedule: Literal["cosine", "wsd"] = Field("cosine", description="after warmup: cosine decay, or warmup-stable-decay")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: share of the steps spent decaying")
    decay_steps: int | None = Field(None, ge=1, description="wsd: steps spent decaying (instead of decay_fraction; "
                                    "at most all of them)")
    decay_trigger_loss: float | None = Field(
        None, gt=0, description="wsd: the stable phase ends as soon as the mean training loss of the last "
        "decay_trigger_window steps falls below this (the skill it waits for has appeared); the decay follows and "
        "the stage ends with it, so `steps` is the most it trains (trainer.optim.LrSchedule)")
    decay_trigger_window: int = Field(20, ge=1, description="wsd: steps averaged for decay_trigger_loss")
    compile: bool = Field(False, description="torch.compile every decoder block (native engines): fused element-wise "
                          "chains, the data-dependent attention core and CPU expert loop left eager; the first "
                          "steps pay the compilation (cached under $TORCHINDUCTOR_CACHE_DIR)")
    activation_checkpointing: Literal["none", "moe", "block"] = Field(
        "none", description="recompute in backward: the MoE of every block, or whole blocks")
    max_bad_steps: int = Field(5, ge=1, description="a step whose loss or gradient norm is NaN/Inf is skipped (no "
                               "update, counted as skipped_steps); this many in a row stop the run with an error")
    async_checkpoint: bool = Field(False, description="write checkpoints in the background (DCP async_save; the "
                                   "parallel engine over a gloo group of its own); published when the next save "
                                   "or the end of the run waits for them; the final checkpoint is synchronous")
    # --- baseline engine (trainer/engines/deepspeed.py, docs/baseline.md) ---
    engine: Literal["native", "deepspeed"] = Field(
        "native", description="native: the native model (trainer/engines/single.py, or distributed.py under parallel.*); deepspeed: transformers' model + DeepSpeed ZeRO")
    zero_stage: int = Field(2, ge=1, le=3, description="deepspeed: ZeRO stage (1 optimizer, 2 + gradients, 3 + parameters)")
    offload: bool = Field(False, description="deepspeed: offload optimizer states (and ZeRO-3 parameters) to CPU memory")
    nproc: int = Field(1, ge=1, description="deepspeed: processes (data-parallel ranks) launched by torchrun")
    # --- end baseline engine ---

    @model_validator(mode="after")
    def _decay(self) -> "StageTrainConfig":
        if self.decay_trigger_loss is not None and self.schedule != "wsd":
            raise ValueError("decay_trigger_loss needs schedule: wsd (a cosine schedule has no stable phase to end)")
        if self.lora.rank and self.lora.base == "bf16" and self.dtype != "bf16":
            raise ValueError("lora.base: bf16 needs dtype: bf16 (the bf16 frozen weights meet the activations under "
                             "bf16 autocast)")
        return self


class VLLMRollout(_Section):
    """``train.rl.vllm``: the offline vLLM engine of ``rollout_backend: vllm`` (trainer/sampler.py)."""

    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="the engine's share of the device memory "
                                          "(the policy and its optimizer share the device)")
    tensor_parallel_size: int = Field(1, ge=1)
    dtype: str = "bfloat16"
    sync_chunk_mb: float = Field(1024, gt=0, description="weights sent to the engine per call at each sync")
    engine_opts: dict[str, Any] = Field(default_factory=dict, description="more vllm.LLM arguments")


class RLConfig(StageTrainConfig):
    """The RL stage after SFT (GRPO family; docs/rl.md): rollouts of the SFT model on the SFT split's prompts,
    rewards from the attested sandbox, the clipped surrogate. The optimizer, schedule, checkpoints and logging are
    the training core's (``steps`` optimizer steps; ``batch_size`` rows per forward)."""

    enabled: bool = Field(False, description="run the RL stage after SFT (the lifecycle evaluates and compares both)")
    steps: int = Field(40, ge=1, description="optimizer steps: rollouts x ppo_epochs x minibatches")
    lr: float = Field(1e-4, gt=0)
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(1.0, ge=0, le=1, description="1: a constant learning rate after warmup")
    weight_decay: float = Field(0.0, ge=0)
    log_every: int = Field(1, ge=1)
    ckpt_every: int = Field(10, ge=1)
    group_size: int = Field(8, ge=1, description="samples per prompt (the group whose rewards normalise each other)")
    prompts_per_rollout: int = Field(8, ge=1, description="prompts sampled per rollout (SFT split, code answers)")
    ppo_epochs: int = Field(1, ge=1, description="passes over each rollout (importance ratios to the rollout policy)")
    minibatches: int = Field(1, ge=1, description="optimizer steps per pass over a rollout")
    max_new_tokens: int = Field(320, ge=1, description="the response length limit")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts (ratios use it too)")
    top_p: float = Field(1.0, gt=0, le=1)
    rollout_batch: int = Field(64, ge=1, description="rows decoded at once (continuous batching)")
    norm_adv_std: bool = Field(True, description="divide advantages by the group's (unbiased) std (off: Dr.GRPO)")
    adv_eps: float = Field(1e-6, gt=0)
    clip_low: float = Field(0.2, ge=0, lt=1, description="ratio clip below: 1 - clip_low")
    clip_high: float = Field(0.28, ge=0, description="ratio clip above: 1 + clip_high (clip-higher, DAPO: 0.28)")
    clip_c: float | None = Field(None, gt=1, description="dual-clip bound for negative advantages (verl: 3.0; None: off)")
    kl_beta: float = Field(0.0, ge=0, description="KL (k3) to the frozen SFT model per token (0: no reference model)")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="how token losses make the step's loss (trainer.rl.aggregate)")
    drop_equal_groups: bool = Field(True, description="leave out groups whose rewards are all equal (counted)")
    pos_lm_coef: float = Field(0.0, ge=0, description="VAPO's positive-example LM loss: this weight times the NLL of "
                               "the correct samples' response tokens (at the sampling temperature) joins each token's "
                               "loss, aggregated with it (0: off)")
    replay: float = Field(0.0, ge=0, le=1, description="share of each rollout's prompts taken again from those whose "
                          "last group had unequal rewards (still learnable; oldest first, each once until it is seen "
                          "again), the rest new from the seeded order (0: every prompt new)")
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong penalty over the last N tokens of the "
                                 "length limit (0: off)")
    overlong_penalty: float = Field(1.0, ge=0, description="the penalty at the length limit")
    rollout_backend: Literal["native", "vllm"] = Field(
        "native", description="what decodes the rollouts: the policy itself with the continuous-batching decoder of "
        "trex serve, or an offline vLLM / vllm-ascend engine that receives the weights before every rollout "
        "(trainer/sampler.py)")
    vllm: VLLMRollout = Field(default_factory=lambda: VLLMRollout(), description="the vllm rollout engine")
    router_replay: bool = Field(False, description="record the rollout's expert choices and replay them in the "
                                "old-log-probability pass and the update (R3; the reference model routes afresh)")
    reward_format: float = Field(0.0, ge=0, le=1, description="partial reward: the answer holds a python block")
    reward_executes: float = Field(0.0, ge=0, le=1, description="partial reward: the program ran without error")
    reward_feasible: float = Field(0.0, ge=0, le=1, description="partial reward: an attested optimal solve (wrong value)")
    promote: Literal["not_worse", "better", "always"] = Field(
        "not_worse", description="register the RL model only when the paired comparison with SFT on the held-out "
        "split says it is not significantly worse (better: significantly better; always), else the SFT model")

    @model_validator(mode="after")
    def _rl(self) -> "RLConfig":
        if self.engine != "native":
            raise ValueError("train.rl runs on the native engine (trainer/engines/single.py)")
        if self.rollout_backend == "vllm" and self.router_replay:
            raise ValueError("train.rl.router_replay needs rollout_backend=native (vLLM records no expert choices)")
        if self.overlong_buffer > self.max_new_tokens:
            raise ValueError("train.rl.overlong_buffer must be at most max_new_tokens")
        return self


class TrainConfig(_Section):
    cpt: StageTrainConfig = Field(default_factory=StageTrainConfig)
    sft: StageTrainConfig = Field(default_factory=lambda: StageTrainConfig(lr=2e-3))
    rl: RLConfig = Field(default_factory=RLConfig)
