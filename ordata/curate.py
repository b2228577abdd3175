"""Curation: generate, solve, render and verify OR problems into CPT, SFT and held-out eval datasets.

Two halves: :func:`build` (generate, solve, verify: :class:`ordata.instances.Instances`) and :func:`assemble`
(seeds, decontamination, SFT chats, CPT documents, filters, the files below); :func:`curate` is both in one
call. With LLM stages (``data.llm``: rewrite, self-distillation, ``ordata/llm/``) the instances are written
between the halves and transformed by those stages first.

Output directory (a stage reference)::

    sft/  sft_val/  eval/  cpt/           HF datasets (``save_to_disk``); verified seed records join sft/cpt
                                          per ``data.seeds_into`` (otherwise they are counted, not written)
    eval_ood/                             the out-of-distribution held-out split (``data.ood``), when configured
    rejections.jsonl                      every rejected item with its stage and reason
    quarantine.jsonl                      unreadable input lines with file:line and reason
    manifest.json                         accounting per stage, counts, grid, seed, versions, file hashes

Every program that ends up in a dataset was executed in the sandbox that runs model outputs
(:func:`eval.sandbox.run_programs`) and its **attested** solve reproduced the HiGHS optimum of its IR (|p-g|/(|g|+1) <= 1e-6), or, for a deliberately infeasible variant (a small
configurable share, ``data.infeasible_rate``), reported the infeasibility HiGHS proved; the rest is
rejected with a reason, never dropped.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from pathlib import Path
from typing import Callable

from eval.audit import side_effect_detail
from eval.sandbox import Program, isolation_level, preload_for, rejection_reason, run_programs
from eval.scoring import REL_TOL, is_correct
from ordata.executors import dask_map, process_pool_map
from ordata.families import get_family
from ordata.filters import Decontaminator, exact_dedup, near_dedup, quality
from ordata.ingest import all_questions, ingest, read_corpora, verify_programs
from ordata.repair import repair_dialogues
from ordata.instances import TEMPLATE, Instances, read_instances, write_instances
from ordata.ir import solve_highs
from ordata.render import chat_row, cpt_document, seed_chat, seed_document
from ordata.tiers import difficulty
from trex.core.config import CODE_STYLES, DataConfig

Progress = Callable[[str, int, int], None]


def _rng(seed: int, split: str, i: int) -> random.Random:
    digest = hashlib.sha256(f"{seed}/{split}/{i}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def grid(cfg: DataConfig) -> list[tuple[str, str, list]]:
    """The (category, representation) cells to balance, each with the families that can fill it."""
    fams = [get_family(f) for f in cfg.families]
    cats = sorted({c for f in fams for c in f.categories if cfg.categories is None or c in cfg.categories})
    if not cats:
        raise ValueError(f"data.categories={cfg.categories} selects nothing from families {cfg.families}")
    return [(c, r, [f for f in fams if c in f.categories]) for c in cats for r in cfg.representations]


def cell_schedule(cfg: DataConfig, cells: list) -> tuple[list[int], list[int]]:
    """One period of the weighted grid cycle: the cell of each attempt and how often that cell came before.

    Weights (``data.grid_weights``, keys ``CATEGORY/REP``, default 1) become integer shares of the period,
    interleaved by smooth weighted round-robin; equal weights give plain round-robin over the cells.
    """
    names = [f"{c}/{r}" for c, r, _ in cells]
    unknown = set(cfg.grid_weights) - set(names)
    if unknown:
        raise ValueError(f"data.grid_weights: unknown cells {sorted(unknown)}; the grid is {names}")
    w = [cfg.grid_weights.get(n, 1.0) for n in names]
    counts = [max(1, round(100 * x / max(w))) for x in w]
    current = [0] * len(cells)
    order, rank, seen = [], [], [0] * len(cells)
    for _ in range(sum(counts)):
        current = [c + k for c, k in zip(current, counts)]
        i = max(range(len(cells)), key=lambda j: (current[j], -j))
        current[i] -= sum(counts)
        order.append(i)
        rank.append(seen[i])
        seen[i] += 1
    return order, rank


def build_attempts(cfg: DataConfig, split: str, start: int, count: int) -> list[dict]:
    """Sample, render and solve attempts ``start .. start+count-1`` (a pure function of the config).

    Runs in a worker (a spawned process, or a Dask worker), so HiGHS never runs in the curator.
    Returns one candidate per attempt, with ``reason`` set when the instance is not usable.
    """
    cells = grid(cfg)
    order, rank = cell_schedule(cfg, cells)
    period = len(order)
    out = []
    for attempt in range(start, start + count):
        cell = order[attempt % period]
        category, rep, fams = cells[cell]
        per_period = order.count(cell)
        fam = fams[((attempt // period) * per_period + rank[attempt % period]) % len(fams)]
        rng = _rng(cfg.seed, split, attempt)
        # drawn from its own stream, so the infeasible rate does not change the other instances
        infeasible = fam.infeasible_variants and _rng(cfg.seed, f"{split}/infeasible", attempt).random() < cfg.infeasible_rate
        spec = fam.sample(rng, rng.randint(cfg.min_size, cfg.max_size), category, infeasible=infeasible)
        api = rng.choice(cfg.apis)
        rendered = spec.render(rep, api)
        try:
            res = solve_highs(spec.ir, cfg.solve_time_limit)
            status, objective, seconds = res.status, res.objective, res.seconds
        except Exception as e:  # noqa: BLE001 - recorded as a rejection, never lost
            status, objective, seconds = f"error: {type(e).__name__}", None, 0.0
        reason = None
        if infeasible:  # a deliberately infeasible variant is kept only when HiGHS proves it so
            reason = None if status == "infeasible" else f"infeasible_variant_{status}"
        elif status != "optimal":
            reason = f"solver_{status}"
        elif abs(objective) < 1e-9:
            reason = "degenerate_objective"
        elif seconds > cfg.solve_time_limit:
            reason = "slow_solve"
        out.append({
            "id": f"{split}-{attempt:06d}", "reason": reason, "family": spec.family, "category": spec.category,
            "representation": rep, "api": api, "question": rendered.question, "math_model": spec.math_model,
            "program": rendered.program,
            "files": json.dumps({k: v.decode() for k, v in rendered.files.items()}, sort_keys=True),
            "objective": objective, "status": status, "sense": spec.ir.sense, "data": json.dumps(spec.data, sort_keys=True),
            "tier": difficulty(spec.ir)["tier"],
        })
    return out


def _build_shard(args: tuple[dict, str, int, int]) -> list[dict]:
    cfg, split, start, count = args
    return build_attempts(DataConfig(**cfg), split, start, count)


def generate(cfg: DataConfig, split: str, n: int, seen: set[str], rejections: list[dict],
             progress: Progress | None = None, map_shards=None) -> list[dict]:
    """Build ``n`` solved instances, cycling over the category x representation grid.

    Within a cell the families that can produce its category take turns, so the grid is balanced
    first and families second. Attempts are built in shards by ``map_shards`` (default: a process
    pool) and merged in attempt order, so the result does not depend on the executor.
    """
    cell_schedule(cfg, grid(cfg))  # validates the selection and the weights before any work is sent out
    map_shards = map_shards or process_pool_map(cfg.workers)
    out: list[dict] = []
    attempt = 0
    while len(out) < n:
        if attempt > 20 * n + 100:
            raise RuntimeError(f"curation: could only build {len(out)}/{n} {split} problems; see rejections")
        need = n - len(out)
        size = max(16, -(-need // (4 * cfg.workers)))
        shards = [(cfg.model_dump(mode="json"), split, s, min(size, attempt + need - s))
                  for s in range(attempt, attempt + need, size)]
        attempt += need
        accepted = []
        for cand in (c for shard in map_shards(_build_shard, shards) for c in shard):
            reason = cand.pop("reason")
            key = cand["question"] + cand["files"]  # a DPS question is only unique together with its data file
            if reason is None and key in seen:
                reason = "duplicate_question"
            if reason:
                rejections.append({"id": cand["id"], "split": split, "family": cand["family"], "reason": reason,
                                   "stage": "generate"})
                continue
            seen.add(key)
            accepted.append(cand)
        # verified inside the loop, so that rejected programs are replaced and the split reaches n
        out += verify(accepted, rejections, cfg) if cfg.verify_programs else accepted
        if progress:
            progress(split, len(out), n)
    return out


def verify(rows: list[dict], rejections: list[dict], cfg: DataConfig, chunk: int = 256) -> list[dict]:
    """Keep rows whose reference program, executed in the sandbox, reproduces the optimum by an attested solve.

    The same sandbox and the same verdict as a model's program (:func:`eval.sandbox.run_programs`): what
    the program prints is never the verdict. ``chunk`` programs per sandbox (each still in a fresh process of
    its own, its files scrubbed after it): a sandbox's start (bubblewrap, the interpreter, the solver imports)
    is paid once per chunk; 256 instead of 64 curated the tiny default in 56 s instead of 65, the same data.
    """
    results = run_programs([Program(r["program"], json.loads(r["files"])) for r in rows], cfg.program_timeout_s,
                           memory_mb=4096, isolation=cfg.isolation, allow_unisolated=cfg.allow_unisolated,
                           preload=preload_for(cfg.apis), workers=cfg.workers, batch_size=chunk,
                           setting="data.isolation")
    kept = []
    for row, res in zip(rows, results):
        reason = rejection_reason(res, is_correct(res.objective, res.reported, row["objective"], row["status"], REL_TOL))
        if reason is None:
            kept.append(row)
            continue
        detail = (side_effect_detail(res) if res.side_effects else
                  f"attested {res.reported} {res.objective} (printed {res.printed_objective}) vs solver "
                  f"{row['status']} {row['objective']}" if res.status in ("ok", "no_solve") else res.stderr_tail[-300:])
        rejections.append({"id": row["id"], "family": row["family"], "reason": reason, "detail": detail,
                           "isolation": res.isolation, "stage": "verify"})
    return kept


def benchmark_questions(paths: list[str]) -> tuple[list[str], dict[str, dict[str, int]]]:
    """Every question of the benchmark files (parsable answer or not) and the counts per file."""

    return all_questions(paths)


def filter_cpt(docs: list[dict], cfg: DataConfig, decon, rejections: list[dict], out: Path) -> tuple[list[dict], dict]:
    """Add raw corpora, then quality filter, exact + near dedup and decontaminate the CPT documents."""

    quarantined = 0
    if cfg.cpt_corpora:
        raw = read_corpora(cfg.cpt_corpora)
        docs = docs + [{**r, "family": "raw"} for r in raw.records]
        quarantined = len(raw.quarantined)
        with open(out / "quarantine.jsonl", "a") as f:
            for q in raw.quarantined:
                f.write(json.dumps(q, sort_keys=True) + "\n")
    n_in = len(docs) + quarantined
    docs, bad = quality(docs, cfg.cpt_min_chars, cfg.cpt_max_chars)
    docs, dup = exact_dedup(docs)
    docs, near = near_dedup(docs, cfg.near_dup_threshold)
    dirty: list[dict] = []
    if decon is not None:
        docs, dirty = decon.filter(docs)
    for r in bad + dup + near + dirty:
        rejections.append({"id": r["id"], "family": r.get("family", "raw"), "reason": r["reason"], "stage": "cpt_filter"})
    return docs, {"in": n_in, "kept": len(docs), "quarantined": quarantined}


def ingest_seeds(cfg: DataConfig, out: Path, rejections: list[dict]) -> tuple[dict, list[dict]]:
    """Ingest and verify the configured seed files; bad lines go to ``quarantine.jsonl``.

    Seed programs are untrusted code: they run in the same sandbox as model outputs and are judged by their
    attested solve. Returns the accounting and the kept records; where they go is ``data.seeds_into``.
    """

    records, quarantined, read = [], [], 0
    for seed in cfg.seeds:
        res = ingest([seed.path], seed.source, seed.licence)
        records += res.records
        quarantined += res.quarantined
        read += res.read
    kept, rejected = verify_programs(records, REL_TOL, cfg.isolation, cfg.allow_unisolated, cfg.program_timeout_s,
                                     cfg.workers)
    for r in rejected:
        rejections.append({**r, "id": r["origin"], "family": "seed", "stage": "ingest"})
    with open(out / "quarantine.jsonl", "a") as f:
        for q in quarantined:
            f.write(json.dumps(q, sort_keys=True) + "\n")
    return {"in": read, "kept": len(kept), "quarantined": len(quarantined)}, kept


def _save(rows: list[dict], path: Path) -> None:
    import datasets  # lazy: ~1.4 s to import, needed only when a split is written

    datasets.disable_progress_bars()
    if not rows:  # an empty split (e.g. `trex curate cpt` builds no SFT samples) still exists, with no rows
        datasets.Dataset.from_dict({"id": []}).save_to_disk(str(path), num_shards=1)
        return
    payload = json.dumps(rows, sort_keys=True).encode()
    ds = datasets.Dataset.from_list(rows)
    ds = datasets.Dataset(ds.data, info=ds.info, fingerprint=hashlib.sha256(payload).hexdigest()[:16])
    ds.save_to_disk(str(path))


def ood_config(cfg: DataConfig) -> DataConfig:
    """The configuration the out-of-distribution split is drawn with: its families and representations."""
    return DataConfig(**{**cfg.model_dump(mode="json"), "families": cfg.ood.families, "grid_weights": {},
                         "representations": cfg.ood.representations, "ood": {}})


def build(cfg: DataConfig, progress: Progress | None = None) -> Instances:
    """Generate, solve and verify every split: eval, sft, cpt, then (``data.ood``) eval_ood.

    The held-out split is drawn first so training splits can never contain one of its questions; the
    out-of-distribution split last, so the other splits are the same with or without it."""
    rejections: list[dict] = []
    seen: set[str] = set()
    map_shards = dask_map(cfg.dask_address) if cfg.executor == "dask" else process_pool_map(cfg.workers)
    rows = {split: generate(cfg, split, n, seen, rejections, progress, map_shards)
            for split, n in (("eval", cfg.eval.problems), ("sft", cfg.sft.samples), ("cpt", cfg.cpt.documents))}
    if cfg.ood.problems:
        rows["eval_ood"] = generate(ood_config(cfg), "eval_ood", cfg.ood.problems, seen, rejections, progress,
                                    map_shards)
    n_rejected = Counter(r["stage"] for r in rejections)
    n_rows = sum(len(v) for v in rows.values())
    accounting = {
        "generate": {"in": n_rows + n_rejected["verify"] + n_rejected["generate"], "kept": n_rows + n_rejected["verify"],
                     "quarantined": 0},
        "verify": {"in": n_rows + n_rejected["verify"], "kept": n_rows, "quarantined": 0},
    }
    return Instances(rows, rejections, accounting, generated={k: len(v) for k, v in rows.items()})


def curate(cfg: DataConfig, out_dir: str | Path, progress: Progress | None = None) -> dict:
    """Build all splits into ``out_dir`` and return the manifest info (without file hashes)."""
    return assemble(cfg, build(cfg, progress), out_dir)


def build_stage(cfg: DataConfig, out_dir: str | Path, progress: Progress | None = None) -> dict:
    """:func:`build` into an instances directory (``ordata/instances.py``), for LLM stages to transform."""
    return write_instances(build(cfg, progress), Path(out_dir))


def assemble_stage(cfg: DataConfig, instances_dir: str | Path, out_dir: str | Path) -> dict:
    """:func:`assemble` of an instances directory into the datasets."""
    return assemble(cfg, read_instances(instances_dir), out_dir)


def _styles(cfg: DataConfig, rows: list[dict]) -> list[str]:
    """Each SFT row's answer style: the styles of its representation (``answer_styles`` minus what ``ood.withhold``
    withholds) in turn within each family x category x representation, each such group starting one style further
    than the group before it. One turn over all rows would tie a style to a grid cell: the grid cycles over
    categories x representations, so with 3 representations and 3 styles every DP problem got the same style."""
    seen: Counter = Counter()
    first: dict[tuple, int] = {}
    out = []
    for r in rows:
        styles = cfg.styles_for(r["representation"])
        group = (r["family"], r["category"], r["representation"])
        start = first.setdefault(group, len(first))
        out.append(styles[(start + seen[group]) % len(styles)])
        seen[group] += 1
    return out


def assemble(cfg: DataConfig, inst: Instances, out_dir: str | Path) -> dict:
    """Turn verified instances into the datasets: seeds, decontamination, SFT chats, CPT documents and filters."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quarantine.jsonl").write_text("")
    rejections, accounting = list(inst.rejections), {k: dict(v) for k, v in inst.accounting.items()}
    eval_rows, sft_rows, cpt_rows = inst.rows["eval"], inst.rows["sft"], inst.rows["cpt"]
    ood_rows = inst.rows.get("eval_ood")
    seeds: list[dict] = []
    if cfg.seeds:
        accounting["ingest"], seeds = ingest_seeds(cfg, out, rejections)
    verified_seeds = [r for r in seeds if r.get("verified")]
    seed_sft = [seed_chat(r) for r in verified_seeds if r["program"]] if "sft" in cfg.seeds_into else []
    seed_cpt = [seed_document(r) for r in verified_seeds] if "cpt" in cfg.seeds_into else []

    decon, bench_counts = None, {}
    if cfg.decontaminate_against:
        questions, bench_counts = benchmark_questions(cfg.decontaminate_against)
        decon = Decontaminator(questions)
    if decon is not None:
        n_before = len(sft_rows) + len(seed_sft)
        sft_rows, rejected = decon.filter(sft_rows, key="question")
        seed_sft, rejected_seeds = decon.filter(seed_sft, key="question")
        rejections += [{"id": r["id"], "family": r["family"], "reason": r["reason"], "stage": "decontaminate"}
                       for r in rejected + rejected_seeds]
        accounting["decontaminate"] = {"in": n_before, "kept": len(sft_rows) + len(seed_sft), "quarantined": 0}
    sft_chat = [chat_row(r, style) for r, style in zip(sft_rows, _styles(cfg, sft_rows))] + seed_sft
    n_val = max(1, round(len(sft_chat) * cfg.sft.val_fraction)) if sft_chat and cfg.sft.val_fraction else 0
    if cfg.sft.repair_fraction:  # repair dialogues from the training problems (never the validation ones)
        trained = {r["id"] for r in sft_chat[n_val:]}
        repairs, accounting["repair"] = repair_dialogues([r for r in sft_rows if r["id"] in trained and r.get("program")],
                                                         cfg, rejections)
        sft_chat += repairs
    cpt_docs = seed_cpt + [{"id": r["id"], "family": r["family"], "source": "synthetic", "text": cpt_document(r, i % 3)}
                           for i, r in enumerate(cpt_rows)]
    cpt_docs, accounting["cpt_filter"] = filter_cpt(cpt_docs, cfg, decon, rejections, out)
    _save(sft_chat[n_val:], out / "sft")
    _save(sft_chat[:n_val], out / "sft_val")
    _save(eval_rows, out / "eval")
    _save(cpt_docs, out / "cpt")
    splits = [("sft", sft_rows), ("eval", eval_rows), ("cpt", cpt_rows)]
    if ood_rows is not None:  # the in-distribution split above keeps today's columns; this one says its wording's source
        _save([{**r, "question_source": r.get("question_source", TEMPLATE)} for r in ood_rows], out / "eval_ood")
        splits.append(("eval_ood", ood_rows))
    with open(out / "rejections.jsonl", "w") as f:
        for r in rejections:
            f.write(json.dumps(r, sort_keys=True) + "\n")

    import datasets  # lazy, as in _save; highspy: only its version is recorded here
    import highspy

    per_family = {split: dict(Counter(r["family"] for r in rows)) for split, rows in splits}
    per_cell = {split: dict(Counter(f"{r['category']}/{r['representation']}" for r in rows)) for split, rows in splits}
    infeasible = {split: sum(r["status"] == "infeasible" for r in rows) for split, rows in splits}
    for stage, acc in accounting.items():
        acc["rejected"] = dict(Counter(r["reason"] for r in rejections if r["stage"] == stage))
        acc["balanced"] = acc["in"] == acc["kept"] + sum(acc["rejected"].values()) + acc["quarantined"]
    counts = {"sft": len(sft_chat) - n_val, "sft_val": n_val, "eval": len(eval_rows), "cpt": len(cpt_docs),
              "generated": dict(inst.generated), "rejected": len(rejections)}
    if ood_rows is not None:
        counts["eval_ood"] = len(ood_rows)
    info = {
        "accounting": accounting,
        "counts": counts,
        "per_family": per_family,
        "per_category_representation": per_cell,
        "rejection_reasons": dict(Counter(r["reason"] for r in rejections)),
        "infeasible": infeasible,
        # the sandbox every reference and seed program ran in (the same as model outputs')
        "isolation": isolation_level(cfg.isolation, cfg.allow_unisolated, "data.isolation")
        if cfg.verify_programs or cfg.seeds else None,
        "seeds": {"records": len(seeds), "verified": len(verified_seeds), "unverified": len(seeds) - len(verified_seeds),
                  "into": list(cfg.seeds_into), "sft": len(seed_sft), "cpt": len(seed_cpt)},
        "decontamination": {"files": bench_counts,
                            "questions": sum(c["questions"] for c in bench_counts.values())},
        "seed": cfg.seed,
        "answer_styles": dict(Counter(r["style"] for r in sft_chat)),
        "text_sources": {"sft": {f"{part}_source": dict(Counter(r[f"{part}_source"] for r in sft_chat))
                                 for part in ("question", "answer")}},
        "config": cfg.model_dump(mode="json"),
        "versions": {"datasets": datasets.__version__, "highspy": getattr(highspy, "__version__", "unknown")},
    }
    if ood_rows is not None:
        info["text_sources"]["eval_ood"] = {"question_source": dict(Counter(r.get("question_source", TEMPLATE)
                                                                            for r in ood_rows))}
        info["ood"] = {"families": list(cfg.ood.families), "representations": list(cfg.ood.representations),
                       "withheld_from_training": withheld(cfg)}
    if inst.llm:
        info["llm"] = inst.llm
    return info


def withheld(cfg: DataConfig) -> list[str]:
    """The representation / code-prompt combinations of the OOD split that no SFT sample has."""
    return [f"{rep}/code" for rep in cfg.ood.representations
            if rep not in cfg.representations or not set(cfg.styles_for(rep)) & set(CODE_STYLES)]
