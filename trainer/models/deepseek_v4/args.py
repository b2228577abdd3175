"""Arguments of the DeepSeek-V4 model, beside the model (TorchTitan-style ``args.py``).

A leaf: pydantic only, nothing of the project, so that the run configuration (``trex.core.config``)
can compose it without importing torch or the model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


ATTENTION_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


class YarnConfig(_Section):
    """YaRN scaling of the compressed branches' RoPE (V4: factor 16 over 65536 original positions)."""

    factor: float = Field(16.0, gt=0)
    original_max_position_embeddings: int = Field(65536, ge=1)
    beta_fast: float = 32.0
    beta_slow: float = 1.0


class ModelArgs(_Section):
    """A DeepSeek-V4 model (the fields of ``transformers``' ``DeepseekV4Config`` under T-Rex names)."""

    arch: Literal["deepseek_v4"] = "deepseek_v4"
    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    head_dim: int = Field(32, ge=4, description="per-head width of the shared-KV (single KV head) attention")
    rope_head_dim: int = Field(16, ge=2, description="trailing channels of each head that get RoPE (qk_rope_head_dim)")
    q_lora_rank: int = Field(64, ge=1)
    o_groups: int = Field(2, ge=1, description="head groups of the grouped output projection")
    o_lora_rank: int = Field(64, ge=1, description="per-group width of the grouped output projection")
    layer_types: list[Literal["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]] | None = Field(
        None, description="attention per layer (default: all sliding_attention)")
    sliding_window: int = Field(128, ge=1)
    compress_rate_csa: int = Field(4, ge=1)
    compress_rate_hca: int = Field(128, ge=1)
    index_n_heads: int = Field(4, ge=1)
    index_head_dim: int = Field(32, ge=2)
    index_topk: int = Field(16, ge=1)
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_yarn: YarnConfig | None = Field(None, description="YaRN for the compressed branches' RoPE")
    hc_mult: int = Field(4, ge=1, description="manifold-constrained hyper-connection streams")
    hc_sinkhorn_iters: int = Field(20, ge=1)
    hc_eps: float = 1e-6
    hc_streams_fp32: bool = Field(False, description="under autocast, keep the mHC residual streams in fp32 "
                                  "(default: in the autocast dtype, as DeepSeek-V4's bf16 code keeps them)")
    mlp_layer_types: list[Literal["hash_moe", "moe"]] | None = Field(
        None, description="MoE routing per layer: hash_moe (token-id table) or moe (learned top-k); default all moe")
    moe_intermediate_size: int = Field(128, ge=1)
    n_routed_experts: int = Field(4, ge=1)
    n_shared_experts: int = Field(1, ge=0)
    num_experts_per_tok: int = Field(2, ge=1)
    scoring_func: Literal["sigmoid", "softmax", "sqrtsoftplus"] = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = Field(10.0, gt=0)
    bias_update_rate: float = Field(1e-3, ge=0.0, description="aux-loss-free expert-bias update speed")
    mtp_layers: int = Field(0, ge=0, le=1, description="multi-token-prediction heads (num_nextn_predict_layers)")
    mtp_loss_weight: float = Field(0.3, ge=0.0)
    indexer_loss_weight: float = Field(0.01, ge=0.0, description="weight of the CSA indexers' KL loss")
    max_seq_len: int = Field(512, ge=8)
    norm_eps: float = 1e-6
    init_std: float = 0.02
    kv_norm_init: float = Field(1.0, gt=0, description="initial kv_norm (and compressor norm) weight: with "
                                "normalised queries and keys it sets the attention-logit range, sqrt(head_dim) x this")
    tie_embeddings: bool = False

    @model_validator(mode="after")
    def _shapes(self) -> "ModelArgs":
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("num_experts_per_tok must be <= n_routed_experts")
        if self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            raise ValueError("rope_head_dim must be even and <= head_dim")
        if self.index_head_dim % 2 or self.rope_head_dim > self.index_head_dim:
            raise ValueError("index_head_dim must be even and >= rope_head_dim")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError("num_heads * head_dim must be divisible by o_groups")
        for name in ("layer_types", "mlp_layer_types"):
            v = getattr(self, name)
            if v is not None and len(v) != self.num_layers:
                raise ValueError(f"{name} has {len(v)} entries but num_layers is {self.num_layers}")
        return self

    @property
    def attention_types(self) -> list[str]:
        return list(self.layer_types or ["sliding_attention"] * self.num_layers)

    @property
    def moe_types(self) -> list[str]:
        return list(self.mlp_layer_types or ["moe"] * self.num_layers)
