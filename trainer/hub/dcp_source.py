"""Native tensors from a training run's DCP checkpoint, a few at a time, in one process.

A DCP step (``trainer.checkpoint``) holds the model under its full parameter names and global shapes
whatever parallel layout wrote it (FSDP, TP and expert shards are chunks of one logical tensor), so reading
a tensor here is a partial ``dcp.load`` of just that key: no process group, no gathering, memory bounded by
the group of tensors being read. The architecture comes from ``model.json`` (:func:`write_model_card`),
which every training stage writes beside its checkpoints.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainer.checkpoint import find_latest
from trainer.hub.reader import CheckpointError, CheckpointReader, check_args, native_shapes
from trainer.models.deepseek_v4.args import ModelArgs
from trainer.tokenizer import copy_tokenizer_files

MODEL_CARD = "model.json"
TOKENIZER_SUBDIR = "tokenizer"  # beside the card: a copy of the run's tokenizer files


def write_model_card(ckpt_dir: str | Path, args: ModelArgs, vocab_size: int,
                     tokenizer_dir: str | Path | None = None) -> Path:
    """``model.json`` in ``ckpt_dir``: the architecture (and tokenizer) an offline conversion needs.

    The tokenizer's files are copied into ``ckpt_dir/tokenizer/`` and the card names that directory relatively:
    the card is part of the stage's content (its hash, ``trex.core.refs``), which must not depend on where the
    tokenizer -- or the run's output directory -- happens to live, and the checkpoint converts without it."""
    ckpt = Path(ckpt_dir)
    path = ckpt / MODEL_CARD
    ckpt.mkdir(parents=True, exist_ok=True)
    tok = None
    if tokenizer_dir is not None:
        tok = TOKENIZER_SUBDIR
        staged = ckpt / (TOKENIZER_SUBDIR + ".partial")
        shutil.rmtree(staged, ignore_errors=True)
        copy_tokenizer_files(tokenizer_dir, staged)
        shutil.rmtree(ckpt / TOKENIZER_SUBDIR, ignore_errors=True)
        staged.rename(ckpt / TOKENIZER_SUBDIR)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"model": args.model_dump(mode="json"), "vocab_size": vocab_size,
                               "tokenizer_dir": tok}, indent=2))
    tmp.replace(path)
    return path


def is_dcp(path: str | Path) -> bool:
    p = Path(path)
    return (p / ".metadata").is_file() or (p / "latest").is_file()


LORA_CARD = "lora.json"
BASE_CARD = "frozen_base.json"  # a QLoRA run's: the checkpoint its frozen base is (its DCP holds the adapters only)


def write_base_card(ckpt_dir: str | Path, base: str | Path) -> Path:
    """``frozen_base.json`` beside a QLoRA run's checkpoints: the init checkpoint whose tensors the adapters adapt,
    so that its DCP steps (the adapters and their optimizer state) convert and export on their own."""
    path = Path(ckpt_dir) / BASE_CARD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"checkpoint": str(Path(base).resolve())}, indent=2))
    return path


class DcpSource:
    """The model tensors of a DCP step directory (or of the newest complete step under a checkpoint root)."""

    format = "dcp"

    def __init__(self, path: str | Path):
        p = Path(path)
        step = p if (p / ".metadata").is_file() else find_latest(p)
        if step is None:
            raise FileNotFoundError(f"{p}: no complete DCP checkpoint")
        self.root = step
        card = next((c / MODEL_CARD for c in (step, step.parent) if (c / MODEL_CARD).is_file()), None)
        if card is None:
            raise FileNotFoundError(f"{step}: no {MODEL_CARD} beside the checkpoint (the architecture to convert)")
        info = json.loads(card.read_text())
        self.args, self.vocab_size = ModelArgs(**info["model"]), int(info["vocab_size"])
        tok = info.get("tokenizer_dir")  # relative to the card (older cards: an absolute path)
        self.tokenizer_dir = str(card.parent / tok) if tok else None
        self.config, self.scheme = {}, None
        self.shapes = native_shapes(self.args, self.vocab_size)
        meta = FileSystemReader(str(step)).read_metadata().state_dict_metadata
        stored = {k[len("model."):]: v for k, v in meta.items() if k.startswith("model.")}
        self.base, self.from_base = self._frozen_base(step, card), set()
        for key, (shape, _) in self.shapes.items():
            m = stored.get(key)
            if not isinstance(m, TensorStorageMetadata) and self.base is not None and key in self.base.sources:
                self.from_base.add(key)  # a QLoRA run: the frozen tensor is the base checkpoint's
                continue
            if not isinstance(m, TensorStorageMetadata):
                if any(".lora." in k for k in stored):
                    raise CheckpointError(f"{step}: a LoRA run's checkpoint holds the adapters, not the frozen base "
                                          f"(no {key!r}): convert the base with --adapter RUN/adapter, or use "
                                          f"RUN/export (merged)")
                raise CheckpointError(f"{step}: DCP checkpoint has no model tensor {key!r}")
            if tuple(m.size) != tuple(shape):
                raise CheckpointError(f"{step}: model tensor {key!r} has shape {list(m.size)}, {card} implies "
                                      f"{list(shape)}")
        self.lora_keys = sorted(k for k in stored if ".lora." in k)  # a LoRA run's adapters (trainer.lora)
        extra = sorted(set(stored) - set(self.shapes) - set(self.lora_keys))
        if extra:
            raise CheckpointError(f"{step}: DCP model tensor {extra[0]!r} is not part of the architecture in {card}")
        self._meta = stored
        self.bytes_read = 0

    @staticmethod
    def _frozen_base(step: Path, card: Path):
        """The base checkpoint a QLoRA run's ``frozen_base.json`` names (None without one)."""
        base_card = next((c / BASE_CARD for c in (step, step.parent) if (c / BASE_CARD).is_file()), None)
        if base_card is None:
            return None
        path = json.loads(base_card.read_text())["checkpoint"]
        if not Path(path).is_dir():
            raise CheckpointError(f"{base_card}: the frozen base {path} is gone (the adapters alone do not convert)")
        reader = CheckpointReader(path)
        check_args(reader, ModelArgs(**json.loads(card.read_text())["model"]))
        return reader

    def native_keys(self) -> list[str]:
        return list(self.shapes)

    def lora(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        """A LoRA run's adapter tensors (``trainer.lora.lora_state`` names) and its ``lora.json`` (the LoRA config
        the run wrote beside its checkpoints); None for a full fine-tuning checkpoint."""
        if not self.lora_keys:
            return None
        conf = next((c / LORA_CARD for c in (self.root, self.root.parent) if (c / LORA_CARD).is_file()), None)
        if conf is None:
            raise CheckpointError(f"{self.root}: adapter tensors but no {LORA_CARD} (their rank and alpha)")
        return self.read_many(self.lora_keys), json.loads(conf.read_text())

    def read_many(self, keys: list[str]) -> dict[str, torch.Tensor]:
        state = {k: torch.empty(self._meta[k].size, dtype=self._meta[k].properties.dtype) for k in keys}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": state}, storage_reader=FileSystemReader(str(self.root)),
                     planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        self.bytes_read += sum(t.numel() * t.element_size() for t in state.values())
        return {k: (t if t.dtype == torch.int64 else t.float()) for k, t in state.items()}

    def read(self, key: str, index=None) -> torch.Tensor:
        if key in self.from_base:
            return self.base.read(key, index)
        t = self.read_many([key])[key]
        return t[tuple(index)] if index else t

    def iter_tensors(self, budget_bytes: int = 1 << 30) -> Iterator[tuple[str, torch.Tensor]]:
        """Every native tensor in model order, loaded in groups of about ``budget_bytes``."""
        group, size = [], 0
        for key in self.shapes:
            if key in self.from_base:  # (in model order: the group so far first)
                if group:
                    yield from self.read_many(group).items()
                    group, size = [], 0
                yield key, self.base.read(key)
                continue
            m = self._meta[key]
            n = m.properties.dtype.itemsize * torch.Size(m.size).numel()
            if group and size + n > budget_bytes:
                yield from self.read_many(group).items()
                group, size = [], 0
            group.append(key)
            size += n
        if group:
            yield from self.read_many(group).items()

    def close(self) -> None:
        if self.base is not None:
            self.base.close()
