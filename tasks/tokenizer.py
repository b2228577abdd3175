"""Tokenizer task: train a byte-level BPE on the curated corpus, or adopt a given tokenizer dir.

An adopted tokenizer's files are copied verbatim (a DeepSeek-V4 checkpoint keeps its own special tokens and
configuration) and validated by building a :class:`trainer.tokenizer.ChatTokenizer`; the manifest records the
detected chat format and where ``transformers`` would tokenize differently from training (``hf_agreement``,
empty when they agree; each problem is also a warning).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import datasets
from prefect import task

from tasks.common import TASK_OPTIONS, StageContext, plain, stage_dir, stage_key, stage_result
from trainer.tokenizer import ChatTokenizer, copy_tokenizer_files, iter_texts_from_rows, train_tokenizer
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
        ChatTokenizer(src)  # validates the given files for their chat format before anything is copied
        copy_tokenizer_files(src, out)
        source = str(src.resolve())
    else:
        rows = []
        for split in ("cpt", "sft"):
            rows += datasets.load_from_disk(str(Path(data_ref["path"]) / split)).to_list()
        train_tokenizer(iter_texts_from_rows(rows), out, tok.vocab_size, tok.min_frequency)
        source = "trained"
    final = ChatTokenizer(out)
    problems = final.agreement_problems()
    for p in problems:
        warnings.warn(f"tokenizer: {p}", RuntimeWarning, stacklevel=2)
    vocab = final.vocab_size
    ref = write_manifest(out, "tokenizer", {"vocab_size": vocab, "source": source, "data_hash": data_ref["hash"],
                                            "chat_format": final.chat_format, "hf_agreement": problems})
    run.params({"chat_format": final.chat_format})
    run.metrics({"vocab_size": vocab})
    run.finish()
    return stage_result(ref, {"vocab_size": vocab, "source": source, "chat_format": final.chat_format}, t0,
                        run.run_id)
