"""Checkpoint conversion benchmark (``trex convert``): throughput and peak RSS against the largest shard.

Source: a random DeepSeek-V4-Flash checkpoint in the published layout (FP8 + E8M0 block scales, MXFP4 routed
experts; :func:`trainer.hub.fixture.write_hub_checkpoint`), one shard per layer as published, of at least
``--size-gb`` (default 1.1 GB: hidden 2048, 64 experts of width 1024, vocab 32768, 3 layers + MTP, i.e. 134 MB
embedding / head shards and ~225 MB layer shards). It is generated once into ``--cache-dir`` (default
``$TREX_STATE_DIR/bench/convert``, else ``/tmp/trex-bench-convert``) and reused while the same configuration is
asked for (``--regenerate`` to redo it); ``--source DIR`` benchmarks an existing checkpoint instead.

Conversions (``--to``): hub-fp8 -> hub-bf16, hub-fp8 -> hf (transformers' layout, float32), hub-fp8 -> hub-fp8
(dequantised and re-quantised). Each one runs in a fresh Python process (``python -c``: import
``trainer.hub.convert``, call :func:`trainer.hub.convert.convert` with ``max_shard_bytes`` = ``--max-shard-mb``,
default convert's own), so its peak RSS is the conversion's alone:

- peak RSS: the child's ``VmHWM`` (``/proc/self/status``) read just before it exits; its ``ru_maxrss`` (from
  ``os.wait4``) is in the JSON too. A sampler in this (torch-free) parent reads ``/proc/<pid>/status`` every
  20 ms for the anonymous / file-backed split (``RssAnon`` / ``RssFile``) at the sampled peak: file pages are
  the mmapped shards being read;
- baseline RSS: a child that only imports the same modules (python + torch + trainer.hub, ~300-400 MB); it
  counts in every peak, so the table shows the raw peak and the peak minus the baseline;
- time: the ``convert()`` call alone (not the imports), including the fsync and rename of the output;
- throughput: input bytes (the source's safetensors files) / s and output bytes / s (decimal GB = 1e9 B);
- the reference shard: the larger of the largest input and the largest output shard; the target is peak RSS
  <= 3x that shard (PASS / FAIL on the raw peak; the net figure is beside it).

Rounds alternate the order of the conversions (the import-only child first in each round) and the table shows
medians ("Quote medians of alternating rounds; these machines are noisy"); the input is in the page cache
after generation or the first round. Prints a rich table and one JSON line (also written to ``--json``).

Run: ``python bench/convert_bench.py [--size-gb 1.1] [--rounds 3] [--cache-dir DIR] [--json out.json]``
(``trex bench convert ...``); ``--quick`` is a seconds-long smoke run on the fixture's tiny model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANT = "flash"
# each layer one ~225 MB shard (64 x 3 MXFP4 experts of 1024 x 2048: 214 MB), the embedding and head 134 MB
DIMS = {"hidden_size": 2048, "moe_intermediate_size": 1024, "n_routed_experts": 64, "vocab_size": 32768}
TARGETS = ("hub-bf16", "hf", "hub-fp8")
TARGET_RATIO = 3.0
GB, MB = 1e9, 1e6
RESULT = "@@convert-bench@@"
STATUS_KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")

# The child processes. Only they import torch: this parent stays small, so that the ``ru_maxrss`` a vfork'ed
# child inherits from it at exec does not matter.
_PRELUDE = """
import hashlib, json, os, sys, time
sys.path[:0] = {paths!r}
def status():
    out = {{}}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in {keys!r}:
                out[k] = int(v.split()[0]) * 1024
    return out
t0 = time.perf_counter()
args = json.loads(sys.argv[1])
"""
CONVERT_CHILD = _PRELUDE + """
from trainer.hub.convert import convert
import torch
import trainer.hub as hub
from pathlib import Path
code = hashlib.sha1(b"".join(f.read_bytes() for f in sorted(Path(hub.__file__).parent.glob("*.py")))).hexdigest()[:12]
res = {{"import_s": time.perf_counter() - t0, "after_import": status(), "threads": torch.get_num_threads(),
        "code": code, "code_dir": str(Path(hub.__file__).parent)}}
if args.get("to"):
    t1 = time.perf_counter()
    res["summary"] = convert(args["src"], args["dst"], args["to"], **args["kwargs"])
    res["convert_s"] = time.perf_counter() - t1
res["end"] = status()
print({mark!r} + json.dumps(res), flush=True)
"""
# A new user's conversion script, the baseline: load a shard whole, dequantise each weight with its scale expanded
# to the weight's shape (float32), cast to bfloat16, save the shard; then fsync the outputs (timed apart).
NAIVE_CHILD = _PRELUDE + """
import torch
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst = Path(args["src"]), Path(args["dst"])
dst.mkdir(parents=True)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
res = {{"import_s": time.perf_counter() - t0, "after_import": status(), "threads": torch.get_num_threads(),
        "code": "naive", "code_dir": ""}}
t1 = time.perf_counter()
for shard in sorted(src.glob("*.safetensors")):
    sd, out = load_file(str(shard)), {{}}
    for name, t in sd.items():
        scale = sd.get(name[: -len("weight")] + "scale") if name.endswith(".weight") else None
        if name.endswith(".scale") and name[: -len("scale")] + "weight" in sd:
            continue
        if scale is None:
            out[name] = t
        elif t.dtype == torch.float8_e4m3fn:
            r, c = t.shape
            s = scale.float().repeat_interleave(128, 0)[:r].repeat_interleave(128, 1)[:, :c]
            out[name] = (t.float() * s).to(torch.bfloat16)
        else:  # MXFP4: two E2M1 codes per byte, a scale per 32 inputs
            b = t.view(torch.uint8)
            w = torch.stack([E2M1[(b & 15).long()], E2M1[(b >> 4).long()]], -1).flatten(-2)
            out[name] = (w * scale.float().repeat_interleave(32, 1)).to(torch.bfloat16)
    save_file(out, str(dst / shard.name), metadata={{"format": "pt"}})
    del sd, out
res["convert_s"] = time.perf_counter() - t1
t2 = time.perf_counter()
for f in dst.iterdir():
    fd = os.open(f, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
res["sync_s"] = time.perf_counter() - t2
res["end"] = status()
print({mark!r} + json.dumps(res), flush=True)
"""
# Are two checkpoint directories the same tensors, bit for bit (names, dtypes, shapes, bytes)?
EQUAL_CHILD = _PRELUDE + """
import torch
from pathlib import Path
from safetensors import safe_open
def tensors(d):
    out = {{}}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({{k: f for k in h.keys()}})
    return out
a, b = tensors(args["a"]), tensors(args["b"])
diff = sorted(set(a) ^ set(b))
unequal = []
for k in sorted(set(a) & set(b)):
    with safe_open(str(a[k]), "pt") as ha, safe_open(str(b[k]), "pt") as hb:
        x, y = ha.get_tensor(k), hb.get_tensor(k)
    if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.reshape(-1).view(torch.uint8),
                                                                   y.reshape(-1).view(torch.uint8)):
        unequal.append(k)
res = {{"tensors": len(a), "only_one_side": diff[:5], "n_only_one_side": len(diff), "unequal": unequal[:5],
        "n_unequal": len(unequal), "equal": not diff and not unequal}}
print({mark!r} + json.dumps(res), flush=True)
"""
GENERATE_CHILD = _PRELUDE + """
from pathlib import Path
from trainer.hub.fixture import hub_config, hub_layout, write_hub_checkpoint
overrides = dict(args["overrides"])
if args["size_bytes"]:  # the fewest layers whose checkpoint holds size_bytes
    n = 1
    while True:
        cfg = hub_config(args["variant"], {{**overrides, "num_hidden_layers": n}})
        total = sum(s.nbytes for g in hub_layout(cfg, args["variant"]) for s in g.values())
        if total >= args["size_bytes"]:
            break
        n += 1
    overrides["num_hidden_layers"] = n
t1 = time.perf_counter()
write_hub_checkpoint(args["dst"], args["variant"], overrides, seed=args["seed"])
res = {{"overrides": overrides, "generate_s": time.perf_counter() - t1, "end": status()}}
print({mark!r} + json.dumps(res), flush=True)
"""


def _code(template: str, code_root: Path | None = None) -> str:
    paths = [str(code_root)] * (code_root is not None) + [str(ROOT)]
    return template.format(paths=paths, keys=STATUS_KEYS, mark=RESULT)


def _read_status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in STATUS_KEYS:
                    out[k] = int(v.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return out


class Sampler(threading.Thread):
    """Polls ``/proc/<pid>/status``: the sample of highest ``VmRSS`` and the highest ``RssAnon`` / ``RssFile``."""

    def __init__(self, pid: int, period: float = 0.02):
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.peak: dict[str, int] = {}
        self.max_anon = self.max_file = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            s = _read_status(self.pid)
            if s.get("VmRSS", 0) > self.peak.get("VmRSS", 0):
                self.peak = s
            self.max_anon = max(self.max_anon, s.get("RssAnon", 0))
            self.max_file = max(self.max_file, s.get("RssFile", 0))
            self.done.wait(self.period)


def run_child(code: str, args: dict, log: Path) -> dict:
    """Run ``python -c code json(args)``; its result line, ``ru_maxrss``, wall time and the sampled RSS split."""
    with open(log, "w") as out:
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-c", code, json.dumps(args)], stdout=out, stderr=subprocess.STDOUT,
                             cwd=str(ROOT))
        sampler = Sampler(p.pid)
        sampler.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): the conversion goes too
            p.kill()
            p.wait()
            raise
        p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        sampler.done.set()
        sampler.join()
    text = log.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith(RESULT)]
    if p.returncode or not lines:
        raise RuntimeError(f"child failed (exit {p.returncode}):\n{text[-4000:]}")
    res = json.loads(lines[-1][len(RESULT):])
    res.update(wall_s=wall, ru_maxrss=usage.ru_maxrss * 1024, sampled_peak=sampler.peak,
               sampled_max_anon=sampler.max_anon, sampled_max_file=sampler.max_file)
    return res


# --------------------------------------------------------------------------------------------- source
def default_cache_dir() -> Path:
    state = os.environ.get("TREX_STATE_DIR")
    return Path(state) / "bench" / "convert" if state else Path(tempfile.gettempdir()) / "trex-bench-convert"


def shard_sizes(d: Path) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in sorted(d.glob("*.safetensors"))}


def source_checkpoint(cache: Path, overrides: dict, size_gb: float | None, seed: int, regenerate: bool,
                      log_dir: Path) -> tuple[Path, dict]:
    """The cached checkpoint of this configuration, generated first if missing; (path, its meta)."""
    spec = {"variant": VARIANT, "overrides": overrides, "size_gb": size_gb, "seed": seed}
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    final = cache / f"{VARIANT}-{key}"
    meta_file = final / "bench_meta.json"
    if final.is_dir() and meta_file.is_file() and not regenerate:
        meta = json.loads(meta_file.read_text())
        if meta.get("spec") == spec:
            return final, {**meta, "generated": False}
    partial = cache / f".{final.name}.partial"
    for d in (partial, final):
        shutil.rmtree(d, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    print(f"generating the source checkpoint into {final} ...", flush=True)
    res = run_child(_code(GENERATE_CHILD), {"dst": str(partial), "variant": VARIANT, "overrides": overrides,
                                            "seed": seed, "size_bytes": int(size_gb * GB) if size_gb else 0},
                    log_dir / "generate.log")
    meta = {"spec": spec, "config": res["overrides"], "generate_s": res["generate_s"],
            "generate_peak_rss": res["end"].get("VmHWM")}
    (partial / "bench_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(partial, final)
    return final, {**meta, "generated": True}


def git_state() -> dict:
    def git(*a):
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False)
        return r.stdout.strip() if r.returncode == 0 else None

    dirty = git("status", "--porcelain", "--", "trainer/hub")
    return {"head": git("rev-parse", "--short", "HEAD"), "trainer_hub_modified": bool(dirty)}


# ------------------------------------------------------------------------------------------------ bench
def bench(src: Path, targets: list[str], rounds: int, kwargs: dict, work: Path, source_format: str,
          code_root: Path | None = None) -> dict:
    inputs = shard_sizes(src)
    in_bytes, in_largest = sum(inputs.values()), max(inputs.values())
    runs: dict[str, list[dict]] = {t: [] for t in targets}
    baselines: list[dict] = []
    code = _code(CONVERT_CHILD, code_root)
    for r in range(rounds):
        order = targets if r % 2 == 0 else targets[::-1]
        base = run_child(code, {}, work / f"baseline-{r}.log")
        baselines.append(base)
        print(f"round {r + 1}/{rounds}: baseline (imports only) {base['end']['VmHWM'] / MB:.0f} MB", flush=True)
        for to in order:
            dst = work / f"out-{to}"
            settle()
            res = run_child(code, {"src": str(src), "dst": str(dst), "to": to, "kwargs": kwargs},
                            work / f"{to}-{r}.log")
            outputs = shard_sizes(dst)
            res.update(out_bytes=sum(outputs.values()), out_largest=max(outputs.values()), out_shards=len(outputs))
            shutil.rmtree(dst)
            runs[to].append(res)
            print(f"round {r + 1}/{rounds}: {source_format} -> {to} {res['convert_s']:.1f} s, peak RSS "
                  f"{res['end']['VmHWM'] / MB:.0f} MB", flush=True)
    med = statistics.median
    base_rss = med(b["end"]["VmHWM"] for b in baselines)
    rows = []
    for to in targets:
        rs = runs[to]
        secs = med(x["convert_s"] for x in rs)
        peak = med(x["end"]["VmHWM"] for x in rs)
        out_bytes, out_largest = rs[0]["out_bytes"], rs[0]["out_largest"]
        ref = max(in_largest, out_largest)
        at_peak = [x["sampled_peak"] for x in rs]
        rows.append({
            "conversion": f"{source_format} -> {to}", "target": to, "input_bytes": in_bytes, "output_bytes": out_bytes,
            "output_shards": rs[0]["out_shards"], "convert_s": secs, "convert_s_rounds": [x["convert_s"] for x in rs],
            "input_gb_per_s": in_bytes / GB / secs, "output_gb_per_s": out_bytes / GB / secs,
            "peak_rss": peak, "peak_rss_rounds": [x["end"]["VmHWM"] for x in rs],
            "ru_maxrss": med(x["ru_maxrss"] for x in rs), "baseline_rss": base_rss, "peak_minus_baseline": peak - base_rss,
            "rss_after_import": med(x["after_import"]["VmHWM"] for x in rs),
            "sampled_peak_anon": med(s.get("RssAnon", 0) for s in at_peak),
            "sampled_peak_file": med(s.get("RssFile", 0) for s in at_peak),
            "sampled_max_anon": med(x["sampled_max_anon"] for x in rs),
            "sampled_max_file": med(x["sampled_max_file"] for x in rs),
            "largest_input_shard": in_largest, "largest_output_shard": out_largest, "reference_shard": ref,
            "reference_shard_is": "output" if out_largest >= in_largest else "input",
            "ratio": peak / ref, "ratio_minus_baseline": (peak - base_rss) / ref,
            "ratio_vs_input_shard": peak / in_largest, "target_ratio": TARGET_RATIO,
            "pass": peak / ref <= TARGET_RATIO, "pass_minus_baseline": (peak - base_rss) / ref <= TARGET_RATIO,
            "threads": rs[0]["threads"], "summary": rs[0]["summary"], "code": sorted({x["code"] for x in rs}),
        })
    versions = sorted({x["code"] for rs in runs.values() for x in rs} | {b["code"] for b in baselines})
    return {"code_versions": versions, "code_dir": baselines[0]["code_dir"], "input_bytes": in_bytes,
            "input_shards": len(inputs), "largest_input_shard": in_largest,
            "baseline_rss": base_rss, "baseline_rss_rounds": [b["end"]["VmHWM"] for b in baselines],
            "baseline_anon": med(b["end"].get("RssAnon", 0) for b in baselines),
            "baseline_file": med(b["end"].get("RssFile", 0) for b in baselines), "rows": rows}


def settle() -> None:
    """Before each timed run: every dirty page of the runs before it written out (``sync``), so that no contestant
    pays for the previous one's write-back. (What made single rounds 2.5 s or 10 s by their position alone was
    the earlier outputs left in the page cache, not dirty pages: they are now removed as soon as compared.)"""
    os.sync()


def disk_write(path: Path, nbytes: int, direct: bool = False) -> float:
    """Seconds to write ``nbytes`` to a new file and fsync it: through the page cache (what a script that saves
    tensors pays: on a VM, every fresh page-cache page is also a page the host must back), or ``direct`` with
    O_DIRECT from one reused buffer (the device's own speed: the bound of the direct conversion path). A file
    system without O_DIRECT falls back to the page cache."""
    import mmap

    buf = mmap.mmap(-1, 64 << 20)
    buf.write(os.urandom(64 << 20))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    t0 = time.perf_counter()
    try:
        fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)
    except (OSError, AttributeError):
        fd = os.open(path, flags, 0o644)
    try:
        done = 0
        while done < nbytes:  # whole 4 KiB blocks (O_DIRECT), then the file cut to its size
            k = min(nbytes - done, len(buf))
            done += os.pwrite(fd, memoryview(buf)[: -(-k // 4096) * 4096], done)
        os.ftruncate(fd, nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    secs = time.perf_counter() - t0
    path.unlink()
    buf.close()
    return secs


def versus_naive(src: Path, rounds: int, kwargs: dict, work: Path, code_root: Path | None = None) -> dict:
    """hub-bf16 by ``trex convert`` (fsync on, off, and on through the general path: ``direct=False``) beside the naive
    script (:data:`NAIVE_CHILD`), alternating rounds, and two plain writes of the output's size (through the page
    cache, and with O_DIRECT); the outputs compared tensor by tensor (round 1)."""
    in_bytes = sum(shard_sizes(src).values())
    code = _code(CONVERT_CHILD, code_root)
    runs: dict[str, list[dict]] = {"naive": [], "trex": [], "trex_nosync": [], "trex_general": []}
    disk: list[float] = []
    disk_direct: list[float] = []
    equal = None
    out_bytes = 0
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for which in order:
            dst = work / f"vs-{which}"
            settle()
            if which == "naive":
                res = run_child(_code(NAIVE_CHILD), {"src": str(src), "dst": str(dst)}, work / f"naive-{r}.log")
            else:
                kw = {**kwargs, "fsync": which != "trex_nosync", "direct": which != "trex_general"}
                res = run_child(code, {"src": str(src), "dst": str(dst), "to": "hub-bf16", "kwargs": kw},
                                work / f"{which}-{r}.log")
                out_bytes = sum(shard_sizes(dst).values())
            runs[which].append(res)
            print(f"round {r + 1}/{rounds}: hub-fp8 -> hub-bf16 by {which}: {res['convert_s']:.2f} s"
                  + (f" + fsync {res['sync_s']:.2f} s" if which == "naive" else ""), flush=True)
            if equal is None and (work / "vs-naive").is_dir() and (work / "vs-trex").is_dir():
                equal = run_child(_code(EQUAL_CHILD), {"a": str(work / "vs-naive"), "b": str(work / "vs-trex")},
                                  work / "equal.log")
            # each output removed as soon as it is not needed: several 3.6 GB outputs left in the page cache made
            # the third run of a round 4x slower, whichever it was, on this VM
            for done in runs:  # (naive's and trex's kept until they are compared, in round 1)
                if equal is not None or done in ("trex_nosync", "trex_general"):
                    shutil.rmtree(work / f"vs-{done}", ignore_errors=True)
        disk.append(disk_write(work / "disk-probe.bin", out_bytes))
        disk_direct.append(disk_write(work / "disk-probe.bin", out_bytes, direct=True))
        print(f"round {r + 1}/{rounds}: disk write + fsync of {out_bytes / GB:.2f} GB: {disk[-1]:.2f} s through the "
              f"page cache, {disk_direct[-1]:.2f} s with O_DIRECT", flush=True)
    med = statistics.median
    naive_s, naive_sync = med(x["convert_s"] for x in runs["naive"]), med(x["convert_s"] + x["sync_s"]
                                                                           for x in runs["naive"])
    trex_s, trex_nosync = med(x["convert_s"] for x in runs["trex"]), med(x["convert_s"] for x in runs["trex_nosync"])
    disk_s, direct_s = med(disk), med(disk_direct)
    general_s = med(x["convert_s"] for x in runs["trex_general"])
    return {
        "input_bytes": in_bytes, "output_bytes": out_bytes, "rounds": rounds,
        "naive_s": naive_s, "naive_s_rounds": [x["convert_s"] for x in runs["naive"]],
        "naive_fsync_s": naive_sync, "naive_peak_rss": med(x["end"]["VmHWM"] for x in runs["naive"]),
        "trex_s": trex_s, "trex_s_rounds": [x["convert_s"] for x in runs["trex"]],
        "trex_nosync_s": trex_nosync, "trex_nosync_s_rounds": [x["convert_s"] for x in runs["trex_nosync"]],
        "trex_peak_rss": med(x["end"]["VmHWM"] for x in runs["trex"]),
        "speedup_page_cache": naive_s / trex_nosync, "speedup_durable": naive_sync / trex_s,
        "input_gb_per_s_page_cache": in_bytes / GB / trex_nosync, "input_gb_per_s_durable": in_bytes / GB / trex_s,
        "naive_input_gb_per_s": in_bytes / GB / naive_s,
        "disk_write_s": disk_s, "disk_gb_per_s": out_bytes / GB / disk_s,
        "disk_bound_input_gb_per_s": in_bytes / GB / disk_s,
        "disk_direct_s": direct_s, "disk_direct_gb_per_s": out_bytes / GB / direct_s,
        "disk_direct_bound_input_gb_per_s": in_bytes / GB / direct_s, "trex_of_disk_bound": direct_s / trex_s,
        "trex_general_s": general_s, "trex_general_s_rounds": [x["convert_s"] for x in runs["trex_general"]],
        "speedup_general_durable": naive_sync / general_s,
        "direct_io": runs["trex"][0]["summary"].get("direct_io"),
        "equal": equal, "workers": runs["trex"][0]["summary"].get("workers"),
        "threads": runs["trex"][0]["threads"],
    }


def print_versus(v: dict) -> None:
    eq = v["equal"]
    print(f"hub-fp8 -> hub-bf16, {v['input_bytes'] / GB:.3f} GB in, {v['output_bytes'] / GB:.3f} GB out, medians of "
          f"{v['rounds']} alternating rounds:")
    print(f"  naive script        {v['naive_s']:7.2f} s ({v['naive_input_gb_per_s']:.3f} GB/s in)"
          f"   + fsync {v['naive_fsync_s'] - v['naive_s']:.2f} s")
    print(f"  trex convert        {v['trex_nosync_s']:7.2f} s ({v['input_gb_per_s_page_cache']:.3f} GB/s in) "
          f"--no-fsync:  {v['speedup_page_cache']:.2f}x naive")
    print(f"  trex convert        {v['trex_s']:7.2f} s ({v['input_gb_per_s_durable']:.3f} GB/s in) durable:    "
          f"{v['speedup_durable']:.2f}x naive + fsync")
    print(f"  trex convert        {v['trex_general_s']:7.2f} s ({v['input_bytes'] / GB / v['trex_general_s']:.3f} GB/s in) "
          f"durable, general path (direct=False): {v['speedup_general_durable']:.2f}x naive + fsync")
    print(f"  disk write + fsync  {v['disk_write_s']:7.2f} s for the output through the page cache "
          f"({v['disk_gb_per_s']:.3f} GB/s; {v['disk_bound_input_gb_per_s']:.3f} GB/s in)")
    print(f"  disk write + fsync  {v['disk_direct_s']:7.2f} s with O_DIRECT, 64 MB writes one after another "
          f"({v['disk_direct_gb_per_s']:.3f} GB/s; {v['disk_direct_bound_input_gb_per_s']:.3f} GB/s in): trex (durable, "
          f"direct I/O {'on' if v['direct_io'] else 'off'}, its writes overlapped with the next buffer's fill) takes "
          f"{100 / v['trex_of_disk_bound']:.0f} % of that time")
    print(f"  outputs {'EQUAL' if eq['equal'] else 'DIFFERENT'}: {eq['tensors']} tensors compared bit for bit"
          + ("" if eq["equal"] else f" ({eq['n_unequal']} differ, e.g. {eq['unequal']}; {eq['n_only_one_side']} "
                                    f"on one side only, e.g. {eq['only_one_side']})"))
    ok = v["speedup_page_cache"] >= 3 and v["input_gb_per_s_page_cache"] >= 0.5
    durable = v["speedup_durable"] >= 3 and v["input_gb_per_s_durable"] >= 0.5
    print(f"  target >= 3x naive and >= 0.5 GB/s in: {'PASS' if ok else 'FAIL'} (--no-fsync), "
          f"{'PASS' if durable else 'FAIL'} (durable)")


def print_table(result: dict) -> None:
    headers = ["conversion", "in GB", "out GB", "s", "in GB/s", "out GB/s", "peak RSS MB", "peak-base MB",
               "anon/file MB", "largest in MB", "largest out MB", "RSS/shard", "(RSS-base)/shard", f"<= {TARGET_RATIO:g}x"]
    cells = []
    for r in result["rows"]:
        which = "out" if r["reference_shard_is"] == "output" else "in"
        cells.append([r["conversion"], f"{r['input_bytes'] / GB:.3f}", f"{r['output_bytes'] / GB:.3f}",
                      f"{r['convert_s']:.1f}", f"{r['input_gb_per_s']:.4f}", f"{r['output_gb_per_s']:.4f}",
                      f"{r['peak_rss'] / MB:.0f}", f"{r['peak_minus_baseline'] / MB:.0f}",
                      f"{r['sampled_peak_anon'] / MB:.0f}/{r['sampled_peak_file'] / MB:.0f}",
                      f"{r['largest_input_shard'] / MB:.1f}", f"{r['largest_output_shard'] / MB:.1f}",
                      f"{r['ratio']:.2f}x ({which})", f"{r['ratio_minus_baseline']:.2f}x",
                      ("PASS" if r["pass"] else "FAIL") + ("" if r["pass"] == r["pass_minus_baseline"] else
                                                           f" (net {'PASS' if r['pass_minus_baseline'] else 'FAIL'})")])
    title = (f"trex convert: {result['source']['input_gb']:.3f} GB, {result['input_shards']} shards, "
             f"median of {result['rounds']} alternating rounds; baseline RSS (imports only) "
             f"{result['baseline_rss'] / MB:.0f} MB ({result['baseline_anon'] / MB:.0f} anon / "
             f"{result['baseline_file'] / MB:.0f} file); anon/file: RSS split at the sampled peak; "
             f"shard = max(largest input, largest output)")
    if len(result["code_versions"]) > 1:
        title += (f"; WARNING: trainer/hub changed during the run ({len(result['code_versions'])} versions: "
                  f"rounds measured different code)")
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for h in headers:
            table.add_column(h, justify="left" if h == "conversion" else "right")
        for c in cells:
            table.add_row(*c)
        Console(width=220).print(table)
    except ImportError:
        print(title)
        for c in [headers, *cells]:
            print("  ".join(f"{x:>14s}" for x in c))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.1, help="least size of the generated checkpoint (1 GB = 1e9 B)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (the table shows medians)")
    ap.add_argument("--to", default=",".join(TARGETS), help=f"comma-separated targets among {','.join(TARGETS)}")
    ap.add_argument("--cache-dir", default=None, help=f"where the generated checkpoint is kept (default: "
                                                      f"$TREX_STATE_DIR/bench/convert, else {default_cache_dir()})")
    ap.add_argument("--work-dir", default=None, help="conversion outputs and logs (default: a temporary directory "
                                                     "in the cache directory, removed afterwards)")
    ap.add_argument("--source", default=None, help="benchmark this checkpoint instead of a generated one")
    ap.add_argument("--code-root", default=None, help="import trainer/ from this directory instead (to measure a "
                                                      "patched copy against the same checkpoint)")
    ap.add_argument("--max-shard-mb", type=float, default=None, help="output shard limit (default: convert's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--regenerate", action="store_true", help="generate the source even if it is cached")
    ap.add_argument("--quick", action="store_true", help="the fixture's tiny model, 1 round (a smoke run)")
    ap.add_argument("--no-naive", action="store_true", help="skip the naive script beside hub-bf16")
    ap.add_argument("--check", action="store_true", help="exit 1 when a conversion misses the RSS target or its "
                                                         "output differs from the naive script's")
    ap.add_argument("--json", default=None, help="also write the JSON result to this file")
    a = ap.parse_args(argv)
    if threading.current_thread() is threading.main_thread():  # a terminated run still removes its outputs
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    targets = [t.strip() for t in a.to.split(",") if t.strip()]
    if not targets or any(t not in TARGETS for t in targets):
        ap.error(f"--to takes a comma-separated subset of {','.join(TARGETS)}")
    rounds = 1 if a.quick and "--rounds" not in (argv if argv is not None else sys.argv[1:]) else a.rounds
    cache = Path(a.cache_dir) if a.cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="run-", dir=cache))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if a.source:
            src = Path(a.source)
            with open(src / "config.json") as f:
                quantized = "quantization_config" in json.load(f)
            meta = {"path": str(src), "generated": False, "config": None}
            source_format = "hub-fp8" if quantized else "source"
        else:
            overrides = {} if a.quick else dict(DIMS)
            src, meta = source_checkpoint(cache, overrides, None if a.quick else a.size_gb, a.seed, a.regenerate, work)
            meta["path"] = str(src)
            source_format = "hub-fp8"
        kwargs = {"max_shard_bytes": int(a.max_shard_mb * MB)} if a.max_shard_mb else {}
        code_root = Path(a.code_root).resolve() if a.code_root else None
        result = bench(src, targets, rounds, kwargs, work, source_format, code_root)
        if "hub-bf16" in targets and source_format == "hub-fp8" and not a.no_naive:
            result["versus_naive"] = versus_naive(src, rounds, kwargs, work, code_root)
    finally:
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    meta["input_gb"] = result["input_bytes"] / GB
    result = {"bench": "convert", "source": meta, "rounds": rounds, "max_shard_bytes": kwargs.get("max_shard_bytes"),
              "target_ratio": TARGET_RATIO, "git": git_state(), **result}
    print_table(result)
    if "versus_naive" in result:
        print_versus(result["versus_naive"])
    line = json.dumps(result)
    print(line)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(line + "\n")
    if a.check and (not all(r["pass"] for r in result["rows"])
                    or not result.get("versus_naive", {"equal": {"equal": True}})["equal"]["equal"]):
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
