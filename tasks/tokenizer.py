"""Tokenizer task: train a byte-level BPE on the curated corpus, or adopt a given tokenizer dir."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import datasets
from prefect import task

from tasks.common import TASK_OPTIONS, StageContext, plain, stage_dir, stage_key, stage_result
from trainer.tokenizer import ChatTokenizer, iter_texts_from_rows, save_tokenizer, train_tokenizer
from trex.core.config import TokenizerConfig
from trex.core.refs import fresh_dir, read_manifest, write_manifest
from trex.tracking.runs import start_run


@task(name="tokenizer", **TASK_OPTIONS)
def tokenizer_task(tok: TokenizerConfig, data_ref: dict, ctx: StageContext) -> dict:
    t0 = time.perf_counter()
    read_manifest(data_ref["path"], "data")
    out = fresh_dir(stage_dir(ctx, "tokenizer", stage_key(tok=tok, data=data_ref["hash"])))
    run = start_run(ctx.tracking, "tokenizer", ctx.parent_run_id, {"stage": "tokenizer"})
    run.params({"tokenizer": plain(tok), "data_hash": data_ref["hash"]})
    if tok.path:
        src = Path(tok.path)
        given = ChatTokenizer(src)  # validates the special tokens
        save_tokenizer(given.tok, out)
        if (src / "tokenizer_config.json").is_file():
            shutil.copy2(src / "tokenizer_config.json", out / "tokenizer_config.json")
        source = str(src.resolve())
    else:
        rows = []
        for split in ("cpt", "sft"):
            rows += datasets.load_from_disk(str(Path(data_ref["path"]) / split)).to_list()
        train_tokenizer(iter_texts_from_rows(rows), out, tok.vocab_size, tok.min_frequency)
        source = "trained"
    vocab = ChatTokenizer(out).vocab_size
    ref = write_manifest(out, "tokenizer", {"vocab_size": vocab, "source": source, "data_hash": data_ref["hash"]})
    run.metrics({"vocab_size": vocab})
    run.finish()
    return stage_result(ref, {"vocab_size": vocab, "source": source}, t0, run.run_id)
