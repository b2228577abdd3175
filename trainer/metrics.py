"""Model FLOPs utilisation (MFU) for DeepSeek-V4: FLOPs per trained token and device peaks.

Training FLOPs per token (forward + backward = 3x forward, a multiply-add = 2 FLOPs)::

    6 * P_matmul_active                      every weight a token multiplies: attention projections
                                             (q low-rank, shared KV, grouped output), compressors and
                                             indexer projections, mHC mixes, router, the top-k routed
                                             experts + shared expert, LM head (embedding lookups: 0)
  + 12 * H * C * K_avg                       attention scores and weighted values over K_avg keys per
                                             query: the sliding window (min(n_win, (L+1)/2) on average
                                             over a row of L tokens) plus the visible compressed entries
                                             (CSA: min(top-k, L/(2 m)); HCA: L/(2 m'))
  + 6 * n_I * c_I * L/(2 m)                  lightning-indexer scores on CSA layers

MTP heads, when trained, add their block, projection and LM head like one more layer. Peaks are dense
bf16 tensor throughput per accelerator; on the CPU they are measured by a matmul probe in the run's dtype
(fp32 or bf16) and cached. An accelerator missing from the table does not stop training: :func:`training_peak_flops` warns once and MFU
is unknown (``None``, not logged) unless ``TREX_DEVICE_PEAK`` names the peak.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from pathlib import Path

import torch

from trainer.models.deepseek_v4.args import ModelArgs

log = logging.getLogger(__name__)
_warned: set[str] = set()  # the unknown-peak messages already given (one warning per device and process)

PEAK_BF16 = {  # dense FLOP/s per device
    "910b": 313e12,   # Ascend 910B (910B3 class)
    "910c": 752e12,   # Ascend 910C (two dies)
    "a100": 312e12,
    "h100": 989e12,
    "h200": 989e12,
}


def _layer_matmul_params(c: ModelArgs, attn: str) -> int:
    d, h, hd = c.hidden_size, c.num_heads, c.head_dim
    n = c.hc_mult
    p = d * c.q_lora_rank + c.q_lora_rank * h * hd + d * hd  # q low-rank, shared KV
    p += h * hd * c.o_lora_rank + c.o_groups * c.o_lora_rank * d  # grouped output projection
    p += 2 * ((2 + n) * n * n * d)  # two mHC mixes
    if attn == "compressed_sparse_attention":
        p += 2 * d * 2 * hd  # compressor kv + gate (two series)
        p += 2 * d * 2 * c.index_head_dim + c.q_lora_rank * c.index_n_heads * c.index_head_dim + d * c.index_n_heads
    elif attn == "heavily_compressed_attention":
        p += 2 * d * hd
    p += d * c.n_routed_experts  # router
    p += 3 * d * c.moe_intermediate_size * (c.num_experts_per_tok + c.n_shared_experts)
    return p


def _keys_per_query(c: ModelArgs, attn: str, seq_len: int) -> tuple[float, float]:
    """(average keys per query, average indexer entries per query) for one layer."""
    keys = min(c.sliding_window, (seq_len + 1) / 2)
    idx = 0.0
    if attn == "compressed_sparse_attention":
        idx = seq_len / (2 * c.compress_rate_csa)
        keys += min(c.index_topk, idx)
    elif attn == "heavily_compressed_attention":
        keys += seq_len / (2 * c.compress_rate_hca)
    return keys, idx


def training_flops_per_token(c: ModelArgs, vocab_size: int, seq_len: int) -> float:
    """The documented formula above (main model, plus the MTP heads when present)."""
    layers = list(c.attention_types) + ["sliding_attention"] * c.mtp_layers
    flops = 6.0 * vocab_size * c.hidden_size * (1 + c.mtp_layers)  # LM head (shared by MTP)
    flops += 6.0 * c.hc_mult * c.hc_mult * c.hidden_size  # final mHC collapse
    flops += 6.0 * c.mtp_layers * 2 * c.hidden_size * c.hidden_size  # MTP input projection
    for attn in layers:
        keys, idx = _keys_per_query(c, attn, seq_len)
        flops += 6.0 * _layer_matmul_params(c, attn)
        flops += 12.0 * c.num_heads * c.head_dim * keys + 6.0 * c.index_n_heads * c.index_head_dim * idx
    return flops


def device_type(model: torch.nn.Module) -> str:
    return next(model.parameters()).device.type


def _cache_file() -> Path:
    root = Path(os.environ.get("TREX_STATE_DIR") or Path.home() / ".cache" / "trex")
    return root / "cpu_peak.json"


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cpu_capability() -> str:
    """The vector instruction set torch's CPU kernels use here (``AVX2``, ``AVX512``, ...): bf16 matmuls are
    fast only with native bf16 (AVX512-BF16 / AMX) and are emulated, far slower than fp32, on plain AVX2."""
    return torch.backends.cpu.get_cpu_capability()


def measure_cpu_peak(n: int = 1024, repeats: int = 5, dtype: torch.dtype = torch.float32,
                     budget_s: float = 2.0) -> float:
    """Best matmul throughput of this CPU in ``dtype`` (FLOP/s) with torch's current threads: ``n x n``
    products, both ``a @ b`` and ``a @ b.T`` (the layout of ``F.linear``), best of up to ``repeats`` timings
    of each, fewer when they take more than ``budget_s`` (an emulated bf16 matmul can take seconds). The operands
    come from a generator of their own: a measurement inside a training run (the first on a machine, before the
    peak is cached) must not advance the seeded global RNG that its checkpoints save (``rng.pt``)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, dtype=dtype, generator=g), torch.randn(n, n, dtype=dtype, generator=g)
    best = float("inf")
    for x, y in ((a, b), (a, b.t())):
        start = time.perf_counter()
        x @ y  # the warm-up: it counts as the only timing when it alone exceeds the budget
        first = time.perf_counter() - start
        if first > budget_s:
            best = min(best, first)
            continue
        for _ in range(repeats):
            t0 = time.perf_counter()
            x @ y
            best = min(best, time.perf_counter() - t0)
            if time.perf_counter() - start > budget_s:
                break
    return 2 * n ** 3 / best


def peak_flops(device: str = "cpu", name: str | None = None, dtype: str = "fp32", fresh: bool = False) -> float:
    """Peak FLOP/s of ``name`` (a key of :data:`PEAK_BF16`, or ``TREX_DEVICE_PEAK`` = a number or a key),
    else of the accelerator reported by torch (its dense bf16 peak), else the measured CPU peak in ``dtype``
    (``fp32`` or ``bf16``; cached per thread count, dtype and CPU capability). ``fresh``: measure the CPU now
    (and cache that), for benchmarks whose MFU should use the machine's speed during the run -- a shared VM's
    matmul throughput drifts by tens of per cent within an hour."""
    name = (name or os.environ.get("TREX_DEVICE_PEAK") or "").lower()
    if name:
        try:
            return float(name)
        except ValueError:
            if name in PEAK_BF16:
                return PEAK_BF16[name]
            raise KeyError(f"unknown device {name!r} for the MFU peak; known: {sorted(PEAK_BF16)} or a number")
    if device != "cpu":
        label = ""
        if device == "cuda" and torch.cuda.is_available():
            label = torch.cuda.get_device_name().lower()
        elif device == "npu":
            import torch_npu  # noqa: F401 - only on Ascend

            label = torch.npu.get_device_name().lower()
        for key, value in PEAK_BF16.items():
            if key in label.replace(" ", ""):
                return value
        raise KeyError(f"no peak known for {label or device!r}; set TREX_DEVICE_PEAK")
    if dtype not in DTYPES:
        raise KeyError(f"no CPU peak for dtype {dtype!r}; one of {sorted(DTYPES)}")
    f = _cache_file()
    key = f"{torch.get_num_threads()}:{dtype}:{cpu_capability()}"
    if not fresh:
        cached = _read_peak_cache(f)
        if key in cached:
            return cached[key]
    value = measure_cpu_peak(dtype=DTYPES[dtype])
    cached = {**_read_peak_cache(f), key: value}  # (another process may have added its keys meanwhile)
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")  # processes measuring at once each replace the file whole
    tmp.write_text(json.dumps(cached))
    os.replace(tmp, f)
    return value


def cpu_peaks_apart(threads: int, dtypes: tuple[str, ...] = ("fp32", "bf16"), probes: int = 1) -> dict[str, float]:
    """The CPU peaks measured now (``peak_flops(fresh=True)``, the best of ``probes`` each) in a child process:
    in the caller the probe's OpenMP threads would stay, spinning under ``OMP_WAIT_POLICY=ACTIVE`` (``trex
    bench``'s default) on the cores the work measured next needs (it cut a benchmark's workers to ~40 %)."""
    import subprocess
    import sys

    code = ("import json, sys, torch; from trainer.metrics import peak_flops; torch.set_num_threads(int(sys.argv[1]));"
            " print(json.dumps({d: max(peak_flops('cpu', dtype=d, fresh=True) for _ in range(int(sys.argv[2])))"
            " for d in sys.argv[3:]}))")
    proc = subprocess.run([sys.executable, "-c", code, str(threads), str(probes), *dtypes], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1], timeout=600)
    if proc.returncode:
        raise RuntimeError(f"the CPU peak probe failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _read_peak_cache(f: Path) -> dict:
    """The cached CPU peaks; an unreadable cache (e.g. left torn by an older, non-atomic writer) is measured anew."""
    if not f.is_file():
        return {}
    try:
        cached = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        log.warning("ignoring the unreadable CPU peak cache %s (%s); measuring again", f, e)
        return {}
    return cached if isinstance(cached, dict) else {}


def training_peak_flops(device: str = "cpu", name: str | None = None, dtype: str = "fp32") -> float | None:
    """:func:`peak_flops` for a training loop: an accelerator (or ``TREX_DEVICE_PEAK`` name) missing from
    :data:`PEAK_BF16` gives ``None`` -- MFU unknown -- and one warning, instead of stopping the run."""
    try:
        return peak_flops(device, name, dtype)
    except KeyError as e:
        msg = f"MFU unknown: {e.args[0]}"
        if msg not in _warned:
            _warned.add(msg)
            log.warning("%s", msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return None


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation, or ``None`` when the peak is unknown."""
    return None if not peak else tokens_per_s * flops_per_token / peak
