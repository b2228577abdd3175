"""One rank of a parallel-engine test run (under torchrun): tiny V4, fixed data, N steps.

Writes ``out/losses.json`` (per-step losses, rank 0) and, with ``--weights``, ``out/weights.pt`` (every
parameter and buffer gathered to full tensors).
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.trainer.helpers import random_docs, tiny_model, tiny_train_cfg  # noqa: E402
from trainer.data import pack  # noqa: E402
from trainer.engines.distributed import gather_full_state, train_parallel  # noqa: E402
from trainer.parallel.dims import Layout, exit_rank, init_distributed  # noqa: E402
from trex.core.config import ParallelConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="{}", help="ParallelConfig fields as JSON")
    ap.add_argument("--model", default="{}", help="extra tiny ModelArgs fields as JSON")
    ap.add_argument("--train", default="{}", help="extra StageTrainConfig fields as JSON")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--weights", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    device = init_distributed("gloo", timeout_s=float(os.environ.get("TREX_TEST_TIMEOUT", "60")))
    pc = ParallelConfig(**json.loads(a.layout))
    layout = Layout.from_config(pc, dist.get_world_size())
    model = tiny_model(seed=0, **json.loads(a.model))
    data = pack(random_docs(n=48, seed=1), 32, 0)
    cfg = tiny_train_cfg(steps=a.steps, batch_size=8, log_every=1, ckpt_every=a.ckpt_every or a.steps, warmup_steps=1,
                         **json.loads(a.train))
    losses = {}
    res = train_parallel(model, data, cfg, layout, a.ckpt, seed=3, device=device,
                         on_log=lambda s, m: losses.__setitem__(s, m["loss"]), stop_after=a.stop_after)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.weights:
        full = gather_full_state(res.parts)
        if dist.get_rank() == 0:
            torch.save(full, out / "weights.pt")
    if dist.get_rank() == 0:
        (out / "losses.json").write_text(json.dumps({"losses": losses, "resumed_from": res.resumed_from}))
    exit_rank()


if __name__ == "__main__":
    main()
