"""Typed configuration for T-Rex, loaded from YAML with ``--set a.b=c`` overrides (a leaf library).

It imports nothing of the project except the model-argument modules that sit beside each model
(``trainer/models/<arch>/args.py``, TorchTitan-style), which import nothing of the project themselves
(both enforced by ``.importlinter``).

Every section is a strict pydantic model: an unknown key, a value of the wrong type or a missing
file raises :class:`ConfigError`, whose message names the key (with its YAML line when known)
and the file. The CLI turns that into exit code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from trainer.models.deepseek_v4.args import ModelArgs
from trex.core.sections import Section as _Section
from trex.core.train_config import (  # noqa: F401 (the train sections, re-exported: one import for every section)
    DEFAULT_LORA_TARGETS,
    LORA_TARGETS,
    LoRAConfig,
    RLConfig,
    StageTrainConfig,
    TrainConfig,
    VLLMRollout,
)


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the key."""




class RunConfig(_Section):
    name: str = "tiny"
    seed: int = 0
    state_dir: str = ".trex"  # MLflow store, Prefect home and stage outputs live under here

    @property
    def output_dir(self) -> Path:
        return Path(self.state_dir) / "outputs"


class SeedSource(_Section):
    path: str = Field(description="JSONL / JSON / parquet file of external seed problems")
    licence: str = "unknown"
    source: str | None = Field(None, description="name recorded with every record (default: file stem)")


class SftData(_Section):
    samples: int = Field(600, ge=0, description="verified problems rendered as SFT chat samples")
    val_fraction: float = Field(0.05, ge=0, lt=1, description="share of the SFT samples held out for validation")
    repair_fraction: float = Field(0.0, ge=0, le=1, description="share of the SFT problems answered by a program that "
                                   "also become a repair dialogue: a mutated program, its real error from the "
                                   "sandbox, the fix (ordata/repair.py)")


class CptData(_Section):
    documents: int = Field(600, ge=0, description="solver-verified documents in the CPT corpus")


class HeldOutData(_Section):
    problems: int = Field(60, ge=1, description="held-out problems for the evaluate stage")


class OodData(_Section):
    """The out-of-distribution held-out split (docs/data.md): ``families`` none of which trains, in ``representations``
    at least one of which no SFT sample has with the code prompt (not trained, or its code styles withheld)."""

    problems: int = Field(0, ge=0, description="out-of-distribution held-out problems (0: no such split)")
    families: list[str] = Field(default_factory=list, description="its families; none may be in data.families")
    representations: list[Literal["DP", "DT", "DPS"]] = Field(default_factory=lambda: ["DP", "DT"])
    withhold: list[Annotated[str, Field(pattern=r"^(DP|DT|DPS)/(code_only|math_model_with_code|math_model)$")]] = Field(
        default_factory=list, description="'REP/STYLE' combinations no SFT sample gets (e.g. 'DPS/code_only')")


CODE_STYLES = ("code_only", "math_model_with_code")  # the styles whose prompt asks for a program (eval's prompt)


class LLMEndpoint(_Section):
    """One OpenAI-compatible endpoint (vLLM / vllm-ascend / SGLang, a hosted API, ``trex serve``)."""

    base_url: str = Field(description="e.g. http://127.0.0.1:8000/v1")
    model: str = Field(description="the served model name; part of every response-cache key")
    name: str | None = Field(None, description="label in the accounting (default: model@host:port)")
    weight: float = Field(1.0, gt=0, description="share of the requests routed here (weighted rendezvous hashing)")
    max_concurrency: int = Field(4, ge=1, description="requests in flight at once")
    timeout_s: float = Field(600.0, gt=0, description="per request")
    max_retries: int = Field(3, ge=0, description="retries on 429 / 5xx / connection errors, then the next endpoint")
    backoff_s: float = Field(1.0, ge=0)
    max_backoff_s: float = Field(60.0, ge=0)
    api_key_env: str | None = Field(None, description="environment variable holding the API key (none sent if unset)")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="merged into every request; in the cache key")

    @property
    def label(self) -> str:
        host = self.base_url.split("://", 1)[-1].split("/", 1)[0]
        return self.name or f"{self.model}@{host}"


class LLMBudget(_Section):
    max_requests: int | None = Field(None, ge=0, description="answers the stage requests (cache hits are free)")
    max_completion_tokens: int | None = Field(None, ge=0, description="checked before each batch of requests")


class RewriteStage(LLMBudget):
    enabled: bool = False
    splits: list[Literal["sft", "cpt", "eval_ood"]] = Field(default_factory=lambda: ["sft", "cpt", "eval_ood"])
    temperature: float = Field(0.7, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(2048, ge=1)
    forward_temperature: float = Field(0.0, ge=0, description="the forward-modelling check's sampling")
    forward_max_tokens: int = Field(4096, ge=1)
    repair: bool = Field(True, description="one repair attempt, with the error fed back, for a rewrite that fails")


class DistillStage(LLMBudget):
    enabled: bool = False
    k: int = Field(4, ge=1, description="answers sampled per SFT problem")
    temperature: float = Field(0.6, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)
    max_tokens: int = Field(8192, ge=1)
    select: Literal["shortest", "first"] = Field("shortest", description="which of several accepted answers is kept")
    on_failure: Literal["template", "drop"] = Field("template", description="no accepted answer: template answer, or drop")


class LLMConfig(_Section):
    """LLM stages of the data engine (``ordata/llm``): off unless a stage is enabled, and then only with endpoints."""

    endpoints: list[LLMEndpoint] = Field(default_factory=list)
    cache_dir: str | None = Field(None, description="the persistent response cache (default: <run.state_dir>/llm-cache)")
    rewrite: RewriteStage = Field(default_factory=RewriteStage)
    distill: DistillStage = Field(default_factory=DistillStage)

    @property
    def active(self) -> bool:
        return self.rewrite.enabled or self.distill.enabled

    @model_validator(mode="after")
    def _endpoints(self) -> "LLMConfig":
        if self.active and not self.endpoints:
            raise ValueError(f"llm.{'rewrite' if self.rewrite.enabled else 'distill'}.enabled needs llm.endpoints")
        labels = [e.label for e in self.endpoints]
        if len(set(labels)) != len(labels):
            raise ValueError(f"llm.endpoints: two endpoints share a label ({labels}); give them distinct names")
        return self


class DataConfig(_Section):
    families: list[str] = Field(default_factory=lambda: ["production", "knapsack", "transportation"])
    seed: int = 1234
    sft: "SftData" = Field(default_factory=lambda: SftData())
    cpt: "CptData" = Field(default_factory=lambda: CptData())
    eval: "HeldOutData" = Field(default_factory=lambda: HeldOutData())
    verify_programs: bool = Field(True, description="execute every reference program and keep it only if it reproduces the optimum")
    isolation: Literal["auto", "bwrap", "rlimits"] = Field(
        "auto", description="sandbox for reference and seed programs (the same sandbox as model outputs; auto = bwrap)")
    allow_unisolated: bool = Field(False, description="permit isolation=rlimits (no sandbox: network and files reachable)")
    program_timeout_s: float = Field(30.0, gt=0, description="wall-clock limit per reference / seed program")
    seeds_into: list[Literal["sft", "cpt"]] = Field(
        default_factory=list, description="where verified seed records go: 'sft' (records with a verified program "
        "become chats), 'cpt' (every verified record becomes a document); empty: verified and counted, not written")
    workers: int = Field(2, ge=1)
    executor: Literal["process", "dask"] = Field("process", description="where instances are built and solved")
    dask_address: str | None = Field(None, description="scheduler address for executor=dask, e.g. tcp://host:8786")
    solve_time_limit: float = Field(10.0, gt=0, description="HiGHS time limit; slower instances are rejected")
    infeasible_rate: float = Field(
        0.02, ge=0, le=0.5, description="share of instances (of families that can) drawn deliberately infeasible, "
                                        "labelled status='infeasible'")
    min_size: int = Field(2, ge=1, description="smallest index-set size of generated problems")
    max_size: int = Field(4, ge=1, description="largest index-set size of generated problems")
    categories: list[Literal["LP", "IP", "MILP", "NLP"]] | None = Field(
        None, description="problem classes to sample (default: every class a family can produce)")
    grid_weights: dict[str, float] = Field(
        default_factory=dict, description="relative weight per grid cell 'CATEGORY/REP' (default 1 each)")
    representations: list[Literal["DP", "DT", "DPS"]] = Field(
        default_factory=lambda: ["DP"], description="DP: data in text, DT: Markdown tables, DPS: attached data.json")
    answer_styles: list[Literal["code_only", "math_model_with_code", "math_model"]] = Field(
        default_factory=lambda: ["code_only"], description="SFT answer styles, used in turn")
    seeds: list[SeedSource] = Field(default_factory=list, description="external seed files to ingest and verify")
    cpt_corpora: list[str] = Field(default_factory=list, description="raw text for CPT: .txt files, or .jsonl/.json/.parquet with a 'text' field")
    decontaminate_against: list[str] = Field(
        default_factory=list, description="benchmark files whose questions no training text may share a 13-gram with")
    near_dup_threshold: float = Field(0.85, gt=0, le=1, description="MinHash-LSH Jaccard threshold for CPT near-duplicates")
    cpt_min_chars: int = Field(160, ge=0)
    cpt_max_chars: int = Field(4000, ge=1)
    apis: list[Literal["highspy", "pyomo", "gurobipy"]] = Field(
        default_factory=lambda: ["highspy"], description="solver APIs of the reference programs")
    ood: OodData = Field(default_factory=OodData, description="the out-of-distribution held-out split")
    llm: LLMConfig = Field(default_factory=LLMConfig, description="LLM rewrite / self-distillation stages (off by default)")

    @model_validator(mode="after")
    def _sizes(self) -> "DataConfig":
        if self.executor == "dask" and not self.dask_address:
            raise ValueError("executor=dask needs dask_address")
        if self.min_size > self.max_size:
            raise ValueError(f"min_size ({self.min_size}) must be <= max_size ({self.max_size})")
        self._check_ood()
        return self

    def stage_view(self, stage: Literal["build", "rewrite", "distill"]) -> "DataConfig":
        """This section as one curation stage depends on it (its task's cache key and output directory): ``build``
        without ``llm``, ``rewrite`` without ``llm.distill``, ``distill`` without ``llm.rewrite`` (whose effect its
        input instances carry). A change elsewhere then leaves that stage cached."""
        llm = {"build": LLMConfig(), "rewrite": self.llm.model_copy(update={"distill": DistillStage()}),
               "distill": self.llm.model_copy(update={"rewrite": RewriteStage()})}[stage]
        return self.model_copy(update={"llm": llm})

    def styles_for(self, representation: str) -> list[str]:
        """The answer styles SFT samples of ``representation`` take in turn (``answer_styles`` minus ``ood.withhold``)."""
        return [s for s in self.answer_styles if f"{representation}/{s}" not in self.ood.withhold]

    def _check_ood(self) -> None:
        ood = self.ood
        for rep in self.representations:
            if not self.styles_for(rep):
                raise ValueError(f"ood.withhold leaves representation {rep} no answer style of {self.answer_styles}")
        if not ood.problems:
            return
        if not ood.families:
            raise ValueError("ood.problems > 0 needs ood.families (families withheld from training)")
        shared = sorted(set(ood.families) & set(self.families))
        if shared:
            raise ValueError(f"ood.families {shared} are also training families (data.families): withhold them")
        if not any(rep not in self.representations or not set(self.styles_for(rep)) & set(CODE_STYLES)
                   for rep in ood.representations):
            raise ValueError(f"ood.representations {ood.representations}: each is trained with the code prompt; withhold "
                             "at least one (a representation not in data.representations, or its code styles in "
                             "ood.withhold, e.g. 'DT/code_only')")


class TokenizerConfig(_Section):
    path: str | None = Field(None, description="use this tokenizer directory instead of training one")
    vocab_size: int = Field(1024, ge=300)
    min_frequency: int = Field(2, ge=1)


class ParallelConfig(_Section):
    """The native engine's layout (``trainer/parallel``, ``docs/parallel.md``): world = pp x dp_replicate x
    dp_shard x tp; expert parallelism is carved out of dp_shard (``ep`` divides it), as in the reference
    system's V4 layouts (EP spans data-parallel ranks)."""

    backend: Literal["auto", "gloo", "nccl", "hccl"] = Field("auto", description="auto: from the device type")
    pp: int = Field(1, ge=1, description="pipeline stages (ranks); with vpp, pp * vpp stages in all")
    vpp: int = Field(1, ge=1, description="virtual stages per pipeline rank (interleaved / V schedules)")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"] = Field(
        "1f1b", description="zbv / dualpipev: the V-shaped zero-bubble schedules (2 stages per rank)")
    pp_microbatches: int = Field(0, ge=0, description="pipeline micro-batches per step (0: one per row of a data-parallel rank's batch)")
    pp_layers: list[int] | None = Field(
        None, description="decoder layers per stage (sum = num_layers); default: even split")
    dp_replicate: int = Field(1, ge=1, description="HSDP replicas (gradients all-reduced across them)")
    dp_shard: int = Field(-1, ge=-1, description="FSDP2 shards (-1: whatever remains of the world)")
    tp: int = Field(1, ge=1, description="tensor parallel (heads, output groups, expert width, vocab)")
    ep: int = Field(1, ge=1, description="expert parallel, carved out of dp_shard")
    sequence_parallel: bool = Field(
        False, description="with tp > 1: mHC streams and norms hold T / tp tokens per rank between TP regions")
    reshard_after_forward: bool = Field(
        True, description="FSDP2: free gathered parameters after forward (ZeRO-3); false keeps them until "
                          "backward (ZeRO-2-like: less communication, more memory)")
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="dtype of FSDP2's gradient reduce-scatter (and HSDP all-reduce) when training in bf16: "
                            "fp32 (default), or bf16 -- half the bytes, as DeepSpeed's bf16 mode reduces")
    timeout_s: float = Field(120.0, gt=0, description="collective timeout: a dead rank ends the job within it")
    nproc_per_node: int = Field(1, ge=1, description="processes per node launched by torchrun (trex train)")
    nnodes: int = Field(1, ge=1)
    rdzv_endpoint: str = Field("localhost:29500", description="host:port of the torchrun rendezvous")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


class ModelConfig(ModelArgs):
    """The ``model`` section: the architecture (:class:`ModelArgs`) plus where its weights start and the form
    the registered model is handed back in. The extra fields are not part of a dump, so any dump of this
    section is a valid ``ModelArgs``; :meth:`architecture` gives the ``ModelArgs`` with just the keys the
    YAML set (a checkpoint's ``config.json`` supplies the rest, and contradicts none of them)."""

    init_from: str | None = Field(None, exclude=True, description="start training from this checkpoint directory "
                                  "(the published hub layout, transformers' save_pretrained or a T-Rex export): "
                                  "the architecture, tokenizer and chat format come from it")
    export_format: Literal["hf", "hub-fp8", "hub-bf16"] = Field(
        "hf", exclude=True, description="the registered model's format: hf (transformers), hub-fp8 (the published "
        "layout, re-quantised to the init checkpoint's scheme) or hub-bf16 (published names, BF16)")
    export_scheme: Literal["flash", "flash-base"] | None = Field(
        None, exclude=True, description="hub-fp8: the quantisation (default: model.init_from's own, else flash)")

    def architecture(self) -> ModelArgs:
        names = self.model_fields_set & set(ModelArgs.model_fields)
        return ModelArgs(**{k: getattr(self, k) for k in names})


class EvalConfig(_Section):
    max_new_tokens: int = Field(256, ge=1)
    batch_size: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = 42
    samples: int = Field(1, ge=1, description="samples per problem: Pass@1 is the mean over problems of their share "
                         "of correct samples, with unbiased pass@k for k <= samples (use temperature > 0)")
    confidence: float = Field(0.95, gt=0, lt=1, description="level of the reported Pass@1 intervals (Wilson for one "
                              "sample per problem, else a bootstrap over problems) and paired comparisons")
    timeout_s: float = Field(20.0, gt=0)
    memory_mb: int = Field(2048, ge=64)
    workers: int = Field(2, ge=1)
    limit: int | None = Field(None, ge=1, description="evaluate only the first N held-out problems")
    rel_tol: float = Field(1e-6, gt=0, description="pass when |p-g|/(|g|+1) <= rel_tol")
    isolation: Literal["auto", "bwrap", "rlimits"] = Field(
        "auto", description="sandbox for executing programs (auto = bwrap; a level that does not work is an error)")
    allow_unisolated: bool = Field(False, description="permit isolation=rlimits (no sandbox: network and files reachable)")
    side_effects: Literal["report", "fail"] = Field(
        "report", description="a sample whose program had a side effect (socket, subprocess, a file written "
        "outside its directory, ...: docs/eval.md): report keeps its score and lists the effects in report.json "
        "and the sample table; fail scores it 0")
    repair_rounds: int = Field(0, ge=0, le=8, description="follow-up turns for a program that fails (exception, "
                               "timeout, a limit, infeasible / unbounded / no attested objective, no program): the "
                               "model sees its error and answers again, up to this many times; report.json keeps "
                               "pass@1_first_attempt beside pass@1 (0: the benchmark-comparable setting)")
    evaluate_base: bool = Field(True, description="also evaluate the CPT-only model for comparison")
    benchmarks: list[str] = Field(default_factory=list, description="public benchmarks (eval/benchmarks.py keys) the "
                                  "lifecycle also evaluates the SFT model on; data under $TREX_BENCHMARKS_DIR")
    benchmark_limit: int | None = Field(None, ge=1, description="first N items of each public benchmark")
    template: str = Field("reference", description="prompt template for public benchmarks: reference | synthetic")
    api: str | None = Field(None, description="solver API the public-benchmark prompt asks for (default gurobipy)")


class TrackingConfig(_Section):
    enabled: bool = True
    tracking_uri: str | None = Field(
        None, description="default: the local MLflow server of `make ui` when it is up, else sqlite:///<state_dir>/mlflow.db")
    experiment: str = "trex"
    registered_model: str = "trex-or"
    system_metrics: bool = Field(True, description="MLflow system metrics (CPU, memory, GPU/NPU) on training runs")
    request_timeout_s: float = Field(5.0, gt=0, description="an MLflow server call slower than this counts as an outage")
    retry_after_s: float = Field(30.0, ge=0, description="during an outage, metrics are buffered locally and "
                                                          "delivery is retried this often")


class RetrainConfig(_Section):
    """Scheduled / data-triggered retraining (``flows/retrain.py``, docs/operations.md)."""

    stages: list[Literal["cpt", "sft"]] = Field(
        default_factory=lambda: ["sft"], description="stages continued from the champion's weights, in order")
    margin: float = Field(0.0, ge=0, description="promote only if mean Pass@1 improves by at least this much")
    tolerance: float = Field(0.05, ge=0, description="... and no benchmark drops by more than this (absolute Pass@1)")
    alias: str = Field("champion", description="the registry alias that marks the serving model")
    ood: Literal["not_worse", "ignore"] = Field(
        "not_worse", description="the out-of-distribution guard (data.ood): not_worse rejects a challenger significantly "
        "worse on it (paired), whatever it gains in distribution; ignore leaves it out of the decision")


class TrexConfig(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    retrain: RetrainConfig = Field(default_factory=RetrainConfig)

    source: str | None = Field(None, exclude=True, description="the YAML file this came from")

    @model_validator(mode="after")
    def _adopt_checkpoint_tokenizer(self) -> "TrexConfig":
        """A run from ``model.init_from`` uses that checkpoint's tokenizer unless ``tokenizer.path`` says otherwise."""
        if self.model.init_from and self.tokenizer.path is None:
            self.tokenizer.path = self.model.init_from
        return self


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Map each mapping key path in a YAML document to its 1-based line number."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key_path = path + (str(k.value),)
                lines[key_path] = k.start_mark.line + 1
                walk(v, key_path)

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, ())
    return lines


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrexConfig:
    """Load a YAML config (or the defaults when ``path`` is None) and apply ``--set`` overrides."""
    raw: dict[str, Any] = {}
    lines: dict[tuple[str, ...], int] = {}
    where = "<defaults>"
    if path is not None:
        p = Path(path)
        where = str(p)
        if not p.is_file():
            raise ConfigError(f"{where}: config file not found")
        text = p.read_text(encoding="utf-8")
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: invalid YAML: {e}") from e
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{where}: top level must be a mapping of sections")
        raw = loaded
        lines = _key_lines(text)

    override_keys: set[tuple[str, ...]] = set()
    for item in overrides:
        parts, value = parse_override(item)
        cur = raw
        for i, part in enumerate(parts[:-1]):
            nxt = cur.get(part)
            if nxt is None:
                nxt = cur[part] = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            cur = nxt
        cur[parts[-1]] = value
        override_keys.add(tuple(parts))

    try:
        cfg = TrexConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, where, lines, override_keys)) from None
    cfg.source = None if path is None else str(path)
    return cfg


def _format_errors(e: ValidationError, where: str, lines: dict, override_keys: set) -> str:
    msgs = []
    for err in e.errors():
        loc = tuple(str(x) for x in err["loc"])
        key = ".".join(loc) or "<root>"
        origin = where
        if loc in override_keys:
            origin = f"--set {key} (on {where})"
        elif loc in lines:
            origin = f"{where}:{lines[loc]}"
        if err["type"] == "extra_forbidden":
            msgs.append(f"{origin}: unknown key '{key}'")
        elif err["type"] == "missing":
            msgs.append(f"{origin}: missing key '{key}'")
        else:
            msgs.append(f"{origin}: key '{key}': {err['msg']} (got {err.get('input')!r})")
    return "invalid configuration\n  " + "\n  ".join(msgs)


def dump_config(cfg: TrexConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
