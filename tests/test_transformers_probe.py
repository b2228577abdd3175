"""Our top-level ``kernels`` package shares its name with a Hugging Face package that
``transformers`` probes. With our tree first on sys.path, transformers must still import and run."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CODE = """
import sys
sys.path.insert(0, {root!r})
import kernels  # ours
assert hasattr(kernels, "rms_norm"), kernels
import torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
m = LlamaForCausalLM(cfg)
out = m(torch.randint(0, 64, (1, 8)))
assert out.logits.shape == (1, 8, 64)
print("ok")
"""


def test_transformers_runs_with_our_kernels_package_on_path():
    res = subprocess.run([sys.executable, "-c", CODE.format(root=str(ROOT))], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
