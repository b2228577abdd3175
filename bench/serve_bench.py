"""``trex serve`` under load: requests/s and generated tokens/s at several client concurrencies.

The server runs in its own process on a localhost socket bound to port 0 (the OS picks the port), in front of
a model directory (``--model``) or, by default, a tiny native model built here (``configs/tiny.yaml``'s model
with random weights and a small byte-level tokenizer). For each concurrency ``c`` the official ``openai``
client sends ``--requests`` chat completions from ``c`` threads (sampled, each with its own seed, as
``eval.backends.OpenAIBackend`` sends them); the table reports requests/s, completion tokens/s, the mean
latency and the generated tokens per model forward pass (prefills included; 1.0 means no batching), from the
server's forward-pass counter. The server stops with the benchmark.

Run: ``python bench/serve_bench.py [--model DIR] [--concurrency 1,4,16] [--requests 32] [--max-tokens 32]
[--max-batch 16] [--threads 1]`` (or ``trex bench serve ...``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTIONS = ["A factory makes chairs and tables. Maximise profit subject to 40 hours of labour.",
             "Minimise the cost of shipping 12 pallets from two warehouses to three shops.",
             "Schedule 3 machines to finish 5 jobs as early as possible.",
             "Choose items for a knapsack of capacity 50 to maximise value.",
             "x + y <= 10, 3x + 4y maximal: write the model."]


def build_tiny_model(out: Path) -> Path:
    """A random-weight export of ``configs/tiny.yaml``'s model with a tokenizer trained on a few sentences."""
    import yaml

    from trainer.export import build_model, export
    from trainer.models.deepseek_v4.args import ModelArgs
    from trainer.tokenizer import ChatTokenizer, train_tokenizer

    texts = [q.lower() for q in QUESTIONS] * 40 + [q for q in QUESTIONS] * 40
    train_tokenizer(texts, out / "tok", vocab_size=512)
    model_cfg = ModelArgs(**yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())["model"])
    export(build_model(model_cfg, ChatTokenizer(out / "tok").vocab_size, seed=0), out / "tok", out / "export")
    return out / "export"


def _server(sock: socket.socket, model: str, max_batch: int, threads: int) -> None:
    """The server process: load the model, serve on the inherited socket until terminated."""
    import torch
    import uvicorn

    from eval.backends import NativeBackend
    from eval.serve import create_app

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = model or str(build_tiny_model(Path(tmp)))
        app = create_app(NativeBackend(path), "bench", max_batch=max_batch)

        @app.get("/bench/passes")
        async def passes() -> dict:
            return {"forward_passes": app.state.batcher.forward_passes}

        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


def _wait_ready(base: str, proc, timeout_s: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.is_alive():
            raise RuntimeError("the server process exited")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not come up")


def run_level(client, concurrency: int, requests: int, max_tokens: int, temperature: float) -> dict:
    def one(i: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        r = client.chat.completions.create(model="bench", messages=[{"role": "user", "content": QUESTIONS[i % 5]}],
                                           temperature=temperature, max_tokens=max_tokens, seed=i)
        return r.usage.completion_tokens, time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - t0
    tokens = sum(t for t, _ in results)
    return {"concurrency": concurrency, "requests": requests, "seconds": wall, "requests_per_s": requests / wall,
            "tokens_per_s": tokens / wall, "mean_latency_s": statistics.mean(s for _, s in results),
            "tokens": tokens}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="model directory (default: a tiny random model built here)")
    p.add_argument("--concurrency", default="1,4,16", help="client concurrencies, comma-separated")
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max-batch", type=int, default=16, help="the server's --max-batch")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    args = p.parse_args(argv)
    import httpx
    from openai import OpenAI

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    proc = mp.get_context("fork").Process(target=_server, args=(sock, args.model, args.max_batch, args.threads),
                                          daemon=True)
    proc.start()
    rows = []
    try:
        _wait_ready(base, proc)
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
        run_level(client, 1, 2, args.max_tokens, args.temperature)  # warm-up
        print(f"{'concurrency':>11} {'requests':>8} {'seconds':>8} {'req/s':>7} {'tokens/s':>9} "
              f"{'latency s':>9} {'tokens/forward':>14}", flush=True)
        for c in [int(x) for x in args.concurrency.split(",")]:
            before = httpx.get(f"{base}/bench/passes").json()["forward_passes"]
            r = run_level(client, c, args.requests, args.max_tokens, args.temperature)
            r["forward_passes"] = httpx.get(f"{base}/bench/passes").json()["forward_passes"] - before
            r["tokens_per_forward"] = r["tokens"] / max(1, r["forward_passes"])
            rows.append(r)
            print(f"{c:>11} {r['requests']:>8} {r['seconds']:>8.2f} {r['requests_per_s']:>7.2f} "
                  f"{r['tokens_per_s']:>9.1f} {r['mean_latency_s']:>9.2f} {r['tokens_per_forward']:>14.2f}", flush=True)
    finally:
        proc.terminate()
        proc.join(timeout=30)
        sock.close()
    return rows


if __name__ == "__main__":
    main()
