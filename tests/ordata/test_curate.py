import datasets

from ordata.curate import curate
from trex.core.config import DataConfig
from trex.core.refs import write_manifest


def small_cfg(**kw):
    base = dict(sft={"samples": 12}, eval={"problems": 6}, cpt={"documents": 9}, max_size=3)
    base.update(kw)
    return DataConfig(**base)


def test_curate_splits_counts_and_disjoint_questions(tmp_path):
    info = curate(small_cfg(), tmp_path)
    c = info["counts"]
    assert c["sft"] + c["sft_val"] == 12 and c["eval"] == 6 and c["cpt"] == 9
    sft = datasets.load_from_disk(str(tmp_path / "sft")).to_list()
    ev = datasets.load_from_disk(str(tmp_path / "eval")).to_list()
    assert not {r["question"] for r in sft} & {r["question"] for r in ev}
    assert set(info["per_family"]["eval"]) == {"production", "knapsack", "transportation"}
    msg = sft[0]["messages"]
    assert [m["role"] for m in msg] == ["system", "user", "assistant"]
    assert msg[2]["content"].startswith("```python") and "highspy" in msg[2]["content"]
    cpt = datasets.load_from_disk(str(tmp_path / "cpt")).to_list()
    assert all(len(d["text"]) > 100 for d in cpt)


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    refs = []
    for i, seed in enumerate((7, 7, 8)):
        out = tmp_path / str(i)
        info = curate(small_cfg(seed=seed), out)
        refs.append(write_manifest(out, "data", info)["hash"])
    assert refs[0] == refs[1] != refs[2]


def test_rejected_programs_are_recorded_replaced_and_accounted(tmp_path, monkeypatch):
    import ordata.curate as cur

    corrupted: set[str] = set()

    def in_process_corrupting_pool(workers):
        def run(fn, shards):
            out = [fn(s) for s in shards]
            split = shards[0][1]
            if split not in corrupted:  # corrupt the first two programs of every split, once
                corrupted.add(split)
                first = out[0]
                # solves another problem (printing its own optimum), fails, prints the right optimum without solving
                first[0]["program"] = ("import highspy\nh = highspy.Highs()\nh.silent()\nx = h.addVariable(lb=0, ub=1)\n"
                                       "h.maximize(x)\nprint('Optimal objective:', h.getInfo().objective_function_value)\n")
                first[1]["program"] = "raise RuntimeError('boom')"
                first[2]["program"] = f"print('Optimal objective: {first[2]['objective']}')\n"
            return out

        return run

    monkeypatch.setattr(cur, "process_pool_map", in_process_corrupting_pool)
    info = curate(small_cfg(), tmp_path)
    reasons = info["rejection_reasons"]
    assert reasons["program_error"] == 3 and reasons["program_mismatch"] == 3
    assert reasons["program_printed_without_solve"] == 3
    assert sum(reasons.values()) == info["counts"]["rejected"]
    # rejected programs were replaced: every split still has its full size
    assert info["counts"]["sft"] + info["counts"]["sft_val"] == 12 and info["counts"]["eval"] == 6
    assert info["accounting"]["verify"]["rejected"] == {"program_mismatch": 3, "program_error": 3,
                                                        "program_printed_without_solve": 3}
    assert all(a["balanced"] for a in info["accounting"].values())
    lines = (tmp_path / "rejections.jsonl").read_text().splitlines()
    assert len(lines) == info["counts"]["rejected"]


def test_curate_all_representations_and_apis_verified(tmp_path):
    import json

    cfg = small_cfg(sft={"samples": 18}, eval={"problems": 9}, cpt={"documents": 3}, representations=["DP", "DT", "DPS"],
                    apis=["highspy", "pyomo"], categories=["LP", "IP"])
    info = curate(cfg, tmp_path)
    assert info["counts"]["rejected"] == 0, info["rejection_reasons"]
    ev = datasets.load_from_disk(str(tmp_path / "eval")).to_list()
    assert {r["representation"] for r in ev} == {"DP", "DT", "DPS"}
    assert {r["category"] for r in ev} <= {"LP", "IP"}
    for r in ev:
        files = json.loads(r["files"])
        assert ("data.json" in files) == (r["representation"] == "DPS")
    cells = info["per_category_representation"]["sft"]
    assert sum(cells.values()) == 18 and all("/" in k for k in cells)
    sft = datasets.load_from_disk(str(tmp_path / "sft")).to_list()
    assert any("Pyomo" in r["messages"][1]["content"] for r in sft) or all(r["api"] == "highspy" for r in sft)


def test_answer_styles_used_in_turn_with_matching_instructions(tmp_path):
    cfg = small_cfg(sft={"samples": 9}, answer_styles=["code_only", "math_model_with_code", "math_model"])
    info = curate(cfg, tmp_path)
    rows = datasets.load_from_disk(str(tmp_path / "sft")).to_list() + datasets.load_from_disk(str(tmp_path / "sft_val")).to_list()
    assert sum(info["answer_styles"].values()) == 9 and len(info["answer_styles"]) == 3
    for r in rows:
        user, answer = r["messages"][1]["content"], r["messages"][2]["content"]
        if r["style"] == "math_model":
            assert "```" not in answer and "**Objective:**" in answer and "optimal objective value is" in answer
            assert "Formulate the mathematical model" in user
        elif r["style"] == "math_model_with_code":
            assert answer.startswith("**Sets:**") and "```python" in answer
        else:
            assert answer.startswith("```python") and "Write a Python program" in user


def test_grid_is_balanced_over_categories_and_representations(tmp_path):
    from collections import Counter

    cfg = small_cfg(sft={"samples": 60}, eval={"problems": 3}, cpt={"documents": 3}, representations=["DP", "DT", "DPS"],
                    families=["production", "knapsack", "facility", "portfolio"])
    info = curate(cfg, tmp_path)
    cells = Counter(info["per_category_representation"]["sft"])
    assert len(cells) == 12  # LP, IP, MILP, NLP x DP, DT, DPS
    assert max(cells.values()) - min(cells.values()) <= 1


def test_seed_ingestion_quarantine_and_accounting(tmp_path):
    import json

    from tests.ordata.test_ingest import write_planted

    seeds = write_planted(tmp_path)
    cfg = small_cfg(seeds=[{"path": str(seeds), "licence": "CC-BY-4.0", "source": "planted"}])
    info = curate(cfg, tmp_path / "out")
    acc = info["accounting"]
    assert all(a["balanced"] for a in acc.values()), acc
    assert acc["ingest"] == {"in": 8, "kept": 3, "quarantined": 5, "rejected": {}, "balanced": True}
    q = [json.loads(line) for line in (tmp_path / "out" / "quarantine.jsonl").read_text().splitlines()]
    assert {x["origin"] for x in q} == {f"{seeds}:{i}" for i in (2, 3, 4, 6, 9)}
    assert not (tmp_path / "out" / "seeds").exists()  # not fed anywhere: counted, not written
    assert info["seeds"] == {"records": 3, "verified": 1, "unverified": 2, "into": [], "sft": 0, "cpt": 0}
    assert info["isolation"] == "bwrap"


def test_verified_seeds_feed_sft_and_cpt_through_the_switch(tmp_path):
    from tests.ordata.test_ingest import SOLVES_42, write_planted

    seeds = write_planted(tmp_path)
    cfg = small_cfg(seeds=[{"path": str(seeds), "licence": "CC-BY-4.0", "source": "planted"}], seeds_into=["sft", "cpt"])
    info = curate(cfg, tmp_path / "out")
    assert info["seeds"] == {"records": 3, "verified": 1, "unverified": 2, "into": ["sft", "cpt"], "sft": 1, "cpt": 1}
    sft = datasets.load_from_disk(str(tmp_path / "out" / "sft")).to_list()
    seed_rows = [r for r in sft if r["family"] == "seed:planted"]
    assert len(seed_rows) == 1 and SOLVES_42 in seed_rows[0]["messages"][2]["content"]
    cpt = datasets.load_from_disk(str(tmp_path / "out" / "cpt")).to_list()
    assert [d for d in cpt if d["family"] == "seed:planted" and "optimal objective value 42" in d["text"]]
    assert all(a["balanced"] for a in info["accounting"].values())


def test_reference_program_printing_a_fake_optimum_is_rejected(tmp_path, monkeypatch):
    """A reference program that prints the right optimum without solving is not verified (attested, not printed)."""
    import json

    import ordata.curate as cur

    real = cur.build_attempts

    def fake_some(cfg, split, start, count):
        rows = real(cfg, split, start, count)
        for r in rows[::2]:  # every other reference program only prints the HiGHS optimum
            if r["reason"] is None and r["objective"] is not None:
                r["program"] = f"print('Optimal objective: {r['objective']!r}')\n"
        return rows

    monkeypatch.setattr(cur, "build_attempts", fake_some)
    monkeypatch.setattr(cur, "_build_shard", lambda a: fake_some(cur.DataConfig(**a[0]), *a[1:]))
    rej = []
    rows = cur.generate(small_cfg(), "sft", 6, set(), rej, map_shards=lambda f, shards: [f(s) for s in shards])
    assert len(rows) == 6 and not any(r["program"].startswith("print(") for r in rows)
    printed = [r for r in rej if r["reason"] == "program_printed_without_solve"]
    assert printed and all(r["stage"] == "verify" and r["isolation"] == "bwrap" for r in printed)


def test_dask_cluster_executor_gives_identical_data(tmp_path):
    from distributed import LocalCluster

    from trex.core.refs import dir_files

    base = dict(sft={"samples": 10}, eval={"problems": 4}, cpt={"documents": 4})
    curate(small_cfg(**base), tmp_path / "p")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        curate(small_cfg(**base, executor="dask", dask_address=cluster.scheduler_address), tmp_path / "d")
    files_p, files_d = dir_files(tmp_path / "p"), dir_files(tmp_path / "d")
    assert files_p == files_d and any(k.startswith("sft/") for k in files_p)


def test_cpt_only_and_sft_only_curation(tmp_path):
    info = curate(small_cfg(sft={"samples": 0}), tmp_path / "cpt")
    assert info["counts"]["sft"] == 0 and info["counts"]["cpt"] == 9
    assert len(datasets.load_from_disk(str(tmp_path / "cpt" / "sft"))) == 0
    info = curate(small_cfg(cpt={"documents": 0}), tmp_path / "sft")
    assert info["counts"]["cpt"] == 0 and info["counts"]["sft"] + info["counts"]["sft_val"] == 12


def test_grid_weights_shift_the_shares_and_unknown_cells_are_named(tmp_path):
    from collections import Counter

    import pytest

    cfg = small_cfg(sft={"samples": 40}, eval={"problems": 3}, cpt={"documents": 3}, representations=["DP", "DT"],
                    families=["production", "knapsack"], grid_weights={"LP/DP": 3.0})
    info = curate(cfg, tmp_path)
    cells = Counter(info["per_category_representation"]["sft"])
    # weights 3:1:1:1 over LP/DP, LP/DT, IP/DP, IP/DT
    assert cells["LP/DP"] == 20 and cells["LP/DT"] + cells["IP/DP"] + cells["IP/DT"] == 20
    with pytest.raises(ValueError, match="unknown cells"):
        curate(small_cfg(grid_weights={"NLP/DP": 2.0}), tmp_path / "bad")


def test_infeasible_variants_are_labelled_verified_and_counted(tmp_path):
    info = curate(small_cfg(families=["transportation", "knapsack"], infeasible_rate=0.4,
                            sft={"samples": 30, "val_fraction": 0.0}), tmp_path)
    sft = datasets.load_from_disk(str(tmp_path / "sft")).to_list()
    bad = [r for r in sft if r["status"] == "infeasible"]
    assert bad and all(r["family"] == "transportation" and r["objective"] is None for r in bad)
    assert all(r["status"] == "optimal" and r["objective"] is not None for r in sft if r["family"] == "knapsack")
    assert info["infeasible"]["sft"] == len(bad)
    assert all(acc["balanced"] for acc in info["accounting"].values())
    none = curate(small_cfg(families=["transportation"], infeasible_rate=0.0), tmp_path / "zero")
    assert none["infeasible"] == {"sft": 0, "eval": 0, "cpt": 0}


def test_answer_styles_are_not_tied_to_a_grid_cell(tmp_path):
    from collections import Counter

    cfg = small_cfg(sft={"samples": 36, "val_fraction": 0.0}, eval={"problems": 2}, cpt={"documents": 2},
                    representations=["DP", "DT", "DPS"], answer_styles=["code_only", "math_model_with_code", "math_model"])
    info = curate(cfg, tmp_path)
    sft = datasets.load_from_disk(str(tmp_path / "sft")).to_list()
    per_rep = {rep: Counter(r["style"] for r in sft if r["representation"] == rep) for rep in ("DP", "DT", "DPS")}
    # the grid cycles over 2 categories x 3 representations: one turn of 3 styles over all rows gave each
    # representation a single style; within each family x category x representation the styles now take turns
    assert all(len(c) == 3 for c in per_rep.values()), per_rep
    assert max(info["answer_styles"].values()) - min(info["answer_styles"].values()) <= 4


# a correct, attested optimum (42) printed after a side effect: verified before the audit, rejected now
SEEDS_WITH_EFFECTS = {
    "connects a socket": ("import socket\ns = socket.socket()\ns.settimeout(1)\ntry:\n    s.connect(('10.9.8.7', 80))\n"
                          "except OSError:\n    pass\n", "side-effect: socket.connect"),
    "writes outside": ("open('/tmp/left-by-a-seed.txt', 'w').write('x')\n", "side-effect: open.write"),
    "spawns a subprocess": ("import subprocess\nsubprocess.run(['true'])\n", "side-effect: subprocess.Popen"),
    "plain": ("", None),
}


def test_seed_programs_with_side_effects_never_enter_a_training_set(tmp_path):
    """Each seed prints (and attests) the right optimum; the three with a side effect are rejected with their reason,
    counted in the ingest stage's accounting and absent from SFT and CPT; the plain one is kept in both."""
    import json

    from tests.ordata.test_ingest import SOLVES_42

    f = tmp_path / "seeds.jsonl"
    with open(f, "w") as out:
        for what, (prefix, _) in SEEDS_WITH_EFFECTS.items():
            program = f"```python\n{prefix}{SOLVES_42}```"
            out.write(json.dumps({"messages": [{"role": "user", "content": f"Maximise 7x with x <= 6 ({what})."},
                                               {"role": "assistant", "content": program}]}) + "\n")
    cfg = small_cfg(seeds=[{"path": str(f), "licence": "MIT", "source": "effects"}], seeds_into=["sft", "cpt"])
    info = curate(cfg, tmp_path / "out")
    acc = info["accounting"]["ingest"]
    expected = {reason: 1 for _, reason in SEEDS_WITH_EFFECTS.values() if reason}
    assert acc["in"] == 4 and acc["kept"] == 1 and acc["rejected"] == expected and acc["balanced"], acc
    rejections = [json.loads(line) for line in (tmp_path / "out" / "rejections.jsonl").read_text().splitlines()]
    seeds = {r["reason"]: r for r in rejections if r["stage"] == "ingest"}
    assert set(seeds) == set(expected) and "10.9.8.7" in seeds["side-effect: socket.connect"]["detail"]
    sft = datasets.load_from_disk(str(tmp_path / "out" / "sft")).to_list()
    cpt = datasets.load_from_disk(str(tmp_path / "out" / "cpt")).to_list()
    text = json.dumps(sft) + json.dumps(cpt)
    assert "(plain)" in text or SOLVES_42.splitlines()[0] in text
    for prefix, reason in SEEDS_WITH_EFFECTS.values():
        if reason:
            assert prefix.splitlines()[0] not in text, reason


def test_a_reference_program_with_a_side_effect_is_rejected_and_replaced(tmp_path, monkeypatch):
    """A curated reference program that writes outside its directory, then solves correctly: rejected at verify."""
    import ordata.curate as cur

    real = cur.build_attempts

    def tainted(cfg, split, start, count):
        rows = real(cfg, split, start, count)
        for k, r in enumerate(rows):
            if (start + k) % 3 == 0 and r["reason"] is None:
                r["program"] = "open('/tmp/reference-side-effect', 'a').write('x')\n" + r["program"]
        return rows

    monkeypatch.setattr(cur, "build_attempts", tainted)
    monkeypatch.setattr(cur, "_build_shard", lambda a: tainted(cur.DataConfig(**a[0]), *a[1:]))
    rej = []
    rows = cur.generate(small_cfg(), "sft", 6, set(), rej, map_shards=lambda f, shards: [f(s) for s in shards])
    assert len(rows) == 6 and not any("reference-side-effect" in r["program"] for r in rows)
    hit = [r for r in rej if r["reason"] == "side-effect: open.write"]
    assert hit and all(r["stage"] == "verify" and "/tmp/reference-side-effect" in r["detail"] for r in hit)
