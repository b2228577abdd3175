"""T-Rex kernels: one op per module, each with a torch reference implementation (see registry).

Importing this package imports neither triton nor torch_npu: backends are checked and imported on first
use, on their own devices only (``docs/kernels.md``).
"""

from kernels.registry import (  # noqa: F401
    available,
    backends,
    choices,
    clear_choices,
    eager_version,
    get,
    overrides,
    register,
    register_backend,
    resolve_all,
    run_eagerly,
    select,
    set_overrides,
    use_backends,
)
from kernels.rms_norm import add_rms_norm, rms_norm  # noqa: F401
from kernels.rope import apply_rope  # noqa: F401
from kernels.hc_expand import hc_expand  # noqa: F401
from kernels.hc_mixes import hc_mixes  # noqa: F401
from kernels.hc_pre import hc_head, hc_pre  # noqa: F401
from kernels.sinkhorn import sinkhorn  # noqa: F401
from kernels.swiglu import swiglu  # noqa: F401
from kernels.fused_linear_cross_entropy import fused_linear_cross_entropy  # noqa: F401
from kernels.grouped_gemm import grouped_mm, moe_experts  # noqa: F401
from kernels.moe_permute import permute, unpermute  # noqa: F401
from kernels.moe_lora import moe_experts_lora  # noqa: F401
from kernels.router import route  # noqa: F401
from kernels.sink_attention import sink_attention  # noqa: F401
