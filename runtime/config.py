"""The configuration schema (omegaconf structured configs) and its loader; bad keys fail at start."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, make_dataclass
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import StringNode

from runtime.sampling_params import SamplingParams, token_id

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a GPU is.",
    "List three prime numbers greater than 10.",
]


@dataclass
class ModelSection:
    path: str = "default"  # "default" = the embedded SmolLM2-135M-Instruct, or a local HF-format directory
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bfloat16 on GPU, float32 on CPU)
    max_seq_len: int = 4096  # capped at the model's max_position_embeddings; at most its sliding window, if any
    random_weights: bool = False  # random weights (benchmarks); path then needs only config.json
    # Attention, MLP and expert weights: fp8 (e4m3, a scale per output row; a bf16/fp16/fp32 checkpoint is quantised
    # at load), none (the model dtype; an FP8 checkpoint is dequantised) or auto (fp8 for a pre-quantised FP8
    # checkpoint, else none; none under engine.deterministic)
    quantization: str = "auto"


@dataclass
class CacheSection:
    page_size: int = 16
    memory_ratio: float = 0.9  # share of free GPU memory (before loading) for model + KV cache
    cpu_memory_bytes: int = 2 << 30  # on CPU this budget stands in for free GPU memory
    num_pages: int = 0  # > 0 fixes the KV page count instead of the formula
    type: str = "radix"  # radix: reuse KV of shared prefixes across requests | naive: no reuse
    # auto: the model dtype | fp8_e4m3: half the bytes a page (twice the tokens), a K and a V scale per layer
    dtype: str = "auto"
    debug_checks: bool = False  # verify page ownership (free + cached + held = pool) every step


@dataclass
class SchedulerSection:
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192  # prefill tokens per step; longer prompts are chunked
    overlap: bool = True  # schedule step N+1 while the GPU runs step N
    # While decoding, admit new prompts in groups once this share of rows and pages is free (0: at once)
    admit_free_share: float = 0.0625


@dataclass
class EngineSection:
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"  # auto | torch | flashinfer
    kernels: str = "auto"  # auto | torch | flashinfer: norms, RoPE, activation, sampling
    cuda_graph_max_bs: int = 256  # largest decode batch replayed from a CUDA graph; 0 disables graphs
    # Prefill steps up to this many tokens replay CUDA graphs (eager prefill is host-bound); 0: eager prefill
    cuda_graph_prefill_tokens: int = 16384
    # auto | always | never: decode steps use fused GEMVs (GPU, Triton, TP=1, flashinfer, CUDA graphs)
    fused_gemv: str = "auto"
    seed: int = 0
    # Batch-invariant kernels: a row's tokens are the same bits whatever the batch, DP size, order or resume
    # (mixture-of-experts models run their experts one by one, without CUDA graphs: much slower)
    deterministic: bool = False


def _sampling_section() -> type:
    """The ``sampling`` section, built from SamplingParams so each parameter is defined in one place."""
    hints = get_type_hints(SamplingParams)
    specs = []
    for f in fields(SamplingParams):
        default = field(default_factory=f.default_factory) if f.default_factory is not MISSING else field(default=f.default)
        specs.append((f.name, hints[f.name], default))
    return make_dataclass("SamplingSection", specs)


SamplingSection = _sampling_section()


@dataclass
class JobColumnsSection:
    """Which columns of a table input (Parquet, CSV, Arrow, datasets) hold what; null: no such column."""

    id: str | None = "id"  # row ids; a table without this (default-named) column uses the row number, from 0
    prompt: str | None = "prompt"  # text or token ids
    messages: str | None = "messages"  # chats: [{role, content}] (or ShareGPT's [{from, value}], or that as JSON)
    keep: list[str] = field(default_factory=list)  # columns copied to every result row


@dataclass
class JobSection:
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    # JSONL (native or OpenAI batch lines), or a table: .parquet, .csv, .arrow, Parquet shards, datasets folder
    input: str | None = None
    # One result per input id; a rerun skips ids already there. JSONL, or Parquet when named *.parquet
    output: str | None = None
    format: str = "auto"  # a JSONL input's rows: auto (from the first row) | native | openai
    columns: JobColumnsSection = field(default_factory=JobColumnsSection)
    # JSONL rows that could not be served (default: out.jsonl or out.json -> out.errors.jsonl, out.parquet ->
    # out.parquet.errors.jsonl)
    errors: str | None = None
    metrics: str | None = None  # JSON summary at the end (default: out.metrics.json, as errors)
    chat_template: bool = True  # apply the model's chat template to plain-string prompts
    fsync_every_s: float = 5.0  # how often finished rows are forced to disk (Parquet: written out)
    row_group_rows: int = 10000  # Parquet output: rows per row group
    lock: bool = True  # hold <output>.lock while running: a second run on the same output stops at start
    lock_wait_s: float = 60.0  # wait this long for another run's lock (a killed run's ranks may be exiting)
    drain_timeout_s: float = 20.0  # after SIGTERM/SIGUSR1: finish in-flight rows for at most this long
    progress: bool = True  # tqdm bar on rank 0


@dataclass
class ParallelSection:
    # Ranks per tensor-parallel group; world_size / tp_size data-parallel replicas. 0: one TP group.
    tp_size: int = 0
    timeout_s: int = 300  # collective timeout
    memory_imbalance_bytes: int = 2 << 30  # refuse to start if ranks' free memory differs by more
    # auto (symm_mem for decode-sized messages, NCCL otherwise) | nccl | symm_mem
    all_reduce: str = "auto"
    check_tokens: bool = False  # debug: compare every rank's sampled tokens each step (one sync per step)


@dataclass
class ServerSection:
    """``python launch.py serve``: the OpenAI-compatible HTTP server on the first rank of its one TP group."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the address is printed)
    api_key: str | None = None  # set: every request but /health and /metrics needs "Authorization: Bearer <api_key>"
    served_model_name: str | None = None  # the model's name in the API (default: the model directory's name)
    max_queue: int = 1024  # requests waiting for admission beyond this get 503
    # A stream sends at most one chunk this often (fewer chunks leave the step loop more host time); 0: every step
    stream_interval_ms: float = 20.0


@dataclass
class LoggingSection:
    level: str = "INFO"


@dataclass
class RuntimeConfig:
    model: ModelSection = field(default_factory=ModelSection)
    cache: CacheSection = field(default_factory=CacheSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    engine: EngineSection = field(default_factory=EngineSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    job: JobSection = field(default_factory=JobSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    server: ServerSection = field(default_factory=ServerSection)
    logging: LoggingSection = field(default_factory=LoggingSection)


class ConfigError(ValueError):
    """A configuration problem, reported before anything heavy starts; ``override``: the ``key=value`` at fault,
    when it is one."""

    override: str | None = None


_CHOICES = {
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.quantization": ("auto", "none", "fp8"),
    "engine.device": ("auto", "cpu", "cuda"),
    "cache.type": ("radix", "naive"),
    "cache.dtype": ("auto", "fp8_e4m3"),
    "engine.attention_backend": ("auto", "torch", "flashinfer"),
    "engine.kernels": ("auto", "torch", "flashinfer"),
    "engine.fused_gemv": ("auto", "always", "never"),
    "parallel.all_reduce": ("auto", "nccl", "symm_mem"),
    "logging.level": ("DEBUG", "INFO", "WARNING", "ERROR"),
    "job.format": ("auto", "native", "openai"),
}
_POSITIVE = ("model.max_seq_len", "cache.page_size", "scheduler.max_running_requests", "scheduler.max_prefill_tokens",
             "cache.cpu_memory_bytes", "parallel.timeout_s", "job.row_group_rows", "server.max_queue")
_NON_NEGATIVE = ("cache.num_pages", "job.drain_timeout_s", "job.fsync_every_s", "job.lock_wait_s",
                 "engine.cuda_graph_max_bs", "engine.cuda_graph_prefill_tokens", "parallel.memory_imbalance_bytes",
                 "parallel.tp_size", "server.stream_interval_ms")


def _all_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    for k, v in node.items():
        full = f"{prefix}{k}"
        keys.append(full)
        if isinstance(v, DictConfig):
            keys.extend(_all_keys(v, full + "."))
    return keys


def _explain(exc: OmegaConfBaseException, schema: DictConfig, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or ""
    msg = (getattr(exc, "msg", None) or str(exc)).splitlines()[0]  # omegaconf appends full_key/object_type lines
    if "not in struct" in str(exc) or "Key '" in msg and "not in" in msg:
        if key in _all_keys(schema):  # a known key, unknown here: YAML read its dotted name as one key
            *sections, leaf = key.split(".")
            nested = "".join(f"{s}: {{" for s in sections) + f"{leaf}: VALUE" + "}" * len(sections)
            return ConfigError(f"{source}: unknown config key '{key}': in YAML a dotted name is one key, so nest its "
                               f"parts ({nested}), or give {key}=VALUE on the command line")
        near = difflib.get_close_matches(key, _all_keys(schema), n=1, cutoff=0.6)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        return ConfigError(f"{source}: unknown config key '{key}'{hint}")
    if "is not a ListConfig" in msg:  # a scalar for a list key
        return ConfigError(f"{source}: config key '{key}' takes a list, e.g. {key}=[a,b] (in YAML: [a, b])")
    if msg.startswith("Incompatible value 'None' for field of type "):  # an empty value reads as null
        kind = msg.rsplit("of type ", 1)[1]
        leaf = key.rsplit(".", 1)[-1]
        return ConfigError(f"{source}: config key '{key}' needs a value of type {kind}, e.g. {key}=VALUE; an empty one "
                           f"('{key}=', or '{leaf}:' with nothing after it in YAML) is null")
    return ConfigError(f"{source}: invalid value for config key '{key}': {msg}")


_NULLS = ("null", "Null", "NULL", "~")


def yaml_as_written(text: str) -> Any:
    """YAML with every scalar read as the string written (None where that reading fails: nothing to restore)."""
    try:
        return yaml.load(text, Loader=yaml.BaseLoader)
    except yaml.YAMLError:
        return None


def _text_as_written(layer: DictConfig, written: Any, schema: DictConfig) -> None:
    """Keys that hold text (str, a list of str) take it as written (``written``: YAML read with every scalar a
    string): YAML 1.1 reads ``no`` as False, ``012`` as 10 and ``1_0`` as 10, which omegaconf would then store as
    the text 'False' or '10', so an API key or a stop string would silently be another one."""
    if not isinstance(written, dict):
        return
    for key, text in written.items():
        if not isinstance(key, str) or key not in schema or key not in layer:
            continue
        node = schema._get_node(key)
        if isinstance(node, DictConfig):
            if isinstance(text, dict) and isinstance(layer._get_node(key), DictConfig):
                _text_as_written(layer[key], text, node)
        elif isinstance(node, StringNode) and isinstance(text, str) and text not in _NULLS:
            layer[key] = text
        elif (isinstance(node, ListConfig) and node._metadata.element_type is str and isinstance(text, list)
              and all(isinstance(t, str) and t not in _NULLS for t in text)):
            layer[key] = text


def _check_sections(layer: DictConfig, schema: DictConfig, source: str, prefix: str = "") -> None:
    """Where ``schema`` has a section: an empty one (YAML ``sampling:`` with its keys commented out) sets nothing and
    is dropped from ``layer``; a value that is not a mapping is refused by name (omegaconf's merge error names no key)."""
    for key, value in OmegaConf.to_container(layer, resolve=False).items():
        node = schema.get(key) if isinstance(key, str) and key in schema else None
        if not isinstance(node, DictConfig) or not is_dataclass(OmegaConf.get_type(node)):
            continue  # a value, or an unknown key (the merge names it)
        full = f"{prefix}{key}"
        if value is None:
            del layer[key]
        elif isinstance(value, dict):
            _check_sections(layer[key], node, source, f"{full}.")
        elif not (isinstance(value, str) and value.startswith("${")):  # an interpolation is resolved later
            first = next(iter(node))
            raise ConfigError(f"{source}: config key '{full}' is a section, not a value ({value!r}): set its keys, e.g. "
                              f"{full}.{first}=VALUE (in YAML a mapping, {key}: {{{first}: VALUE}})")


def _validate(cfg: RuntimeConfig) -> None:
    node = OmegaConf.structured(cfg)
    for key, allowed in _CHOICES.items():
        value = OmegaConf.select(node, key)
        if value not in allowed:
            raise ConfigError(f"config key '{key}'={value!r} must be one of {list(allowed)}")
    if cfg.engine.deterministic and cfg.model.quantization == "fp8":
        raise ConfigError("engine.deterministic=true cannot be combined with model.quantization="
                          f"{cfg.model.quantization} (its GEMMs are not batch-invariant)")
    for key in _POSITIVE:
        value = OmegaConf.select(node, key)
        if not value > 0:  # NaN too
            raise ConfigError(f"config key '{key}'={value} must be > 0")
    if not 0.0 <= cfg.scheduler.admit_free_share <= 1.0:
        raise ConfigError(f"config key 'scheduler.admit_free_share'={cfg.scheduler.admit_free_share} must be in [0, 1]")
    if not 0.0 < cfg.cache.memory_ratio <= 1.0:
        raise ConfigError(f"config key 'cache.memory_ratio'={cfg.cache.memory_ratio} must be in (0, 1]")
    if not 0 <= cfg.engine.seed < 2**31:
        raise ConfigError(f"config key 'engine.seed'={cfg.engine.seed} must be in [0, 2**31)")
    for key in _NON_NEGATIVE:
        value = OmegaConf.select(node, key)
        if not value >= 0:  # NaN too
            raise ConfigError(f"config key '{key}'={value} must be >= 0")
    if not 0 <= cfg.server.port <= 65535:
        raise ConfigError(f"config key 'server.port'={cfg.server.port} must be in [0, 65535] (0: any free port)")
    if cfg.cache.num_pages == 1:
        raise ConfigError("config key 'cache.num_pages'=1 leaves no page for requests (page 0 is reserved); use >= 2")
    try:
        SamplingParams(**vars(cfg.sampling))
    except ValueError as exc:
        raise ConfigError(f"config section 'sampling': {exc}") from None


def load_config(paths: list[str | Path] | None = None, overrides: Sequence[str] | None = None,
                *, schema: type[RuntimeConfig] = RuntimeConfig) -> RuntimeConfig:
    """Schema <- each YAML file in order <- ``key=value`` overrides; validated."""
    schema = OmegaConf.structured(schema)
    merged = schema
    for path in paths or []:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file {file} does not exist")
        try:
            layer = OmegaConf.load(file)
        except Exception as exc:  # yaml.YAMLError and friends: report file and position
            raise ConfigError(f"config file {file} is not valid YAML: {exc}") from None
        if not isinstance(layer, DictConfig):
            raise ConfigError(f"config file {file} must hold a mapping of sections, not {type(layer).__name__}")
        _check_sections(layer, schema, str(file))
        _text_as_written(layer, yaml_as_written(file.read_text(encoding="utf-8")), schema)
        try:
            merged = _merge_layer(merged, layer, str(file))
        except OmegaConfBaseException as exc:
            raise _explain(exc, schema, str(file)) from None
    return _with_overrides(merged, overrides, schema)


def apply_overrides(cfg: RuntimeConfig, overrides: Sequence[str]) -> RuntimeConfig:
    """A validated copy of ``cfg`` with ``key=value`` overrides merged on top."""
    return _with_overrides(OmegaConf.structured(cfg), overrides, OmegaConf.structured(type(cfg)))


def _merge_override(merged: DictConfig, item: str, schema: DictConfig) -> DictConfig:
    if "=" not in item or item.startswith("="):
        raise ConfigError(f"override {item!r} is not of the form key=value")
    try:
        layer = OmegaConf.from_dotlist([item])
        _check_sections(layer, schema, f"override {item!r}")
        key, _, text = item.partition("=")
        written = yaml_as_written(text)
        for part in reversed(key.split(".")):
            written = {part: written}
        _text_as_written(layer, written, schema)
        return _merge_layer(merged, layer, f"override {item!r}")
    except OmegaConfBaseException as exc:
        raise _explain(exc, schema, f"override {item!r}") from None
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"override {item!r} cannot be parsed: {exc}") from None


def _with_overrides(merged: DictConfig, overrides: Sequence[str] | None, schema: DictConfig) -> RuntimeConfig:
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'key=value' strings, not one string: [{overrides!r}]")
    for item in overrides or []:
        try:
            merged = _merge_override(merged, item, schema)
        except ConfigError as exc:
            exc.override = item
            raise
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _explain(exc, schema, "config") from None
    _validate(cfg)
    if cfg.engine.deterministic and cfg.model.quantization == "auto":
        cfg.model.quantization = "none"  # batch-invariant GEMMs run in the model dtype: FP8 checkpoints dequantise
    return cfg


def _mapping_keys(schema: type, prefix: str = "") -> dict[str, type]:
    """The keys of ``schema`` typed as a dict (a value, not a section), with the type of their keys."""
    keys: dict[str, type] = {}
    for name, kind in get_type_hints(schema).items():
        if is_dataclass(kind):
            keys |= _mapping_keys(kind, f"{prefix}{name}.")
        elif get_origin(kind) is dict:
            keys[prefix + name] = get_args(kind)[0]
    return keys


# Keys whose value is a mapping (sampling.logit_bias), with the type of its keys: flattened as one value, its keys
# as text, so a copy read back from YAML or JSON (which writes keys as strings) equals the live config.
MAPPINGS = _mapping_keys(RuntimeConfig)


def _merge_layer(merged: DictConfig, layer: DictConfig, where: str) -> DictConfig:
    """``layer`` over ``merged``. A mapping the layer sets replaces the one before whole, as any other value
    does (merged key by key, ``{}`` could not clear it, nor a sweep's run drop a bias its base config sets); int
    keys are token ids, quoted or not (``'50256': -100``, as JSON and most YAML writers write them)."""
    mappings: dict[str, dict[Any, Any]] = {}
    for dotted, key_type in MAPPINGS.items():
        section, _, name = dotted.rpartition(".")
        parent = OmegaConf.select(layer, section, default=None, throw_on_missing=False)
        if not isinstance(parent, DictConfig) or not isinstance(parent.get(name), DictConfig):
            continue
        mappings[dotted] = {_mapping_key(key, key_type, dotted, where): value
                            for key, value in parent.pop(name).items()}
    out = OmegaConf.merge(merged, layer)
    for dotted, value in mappings.items():
        OmegaConf.update(out, dotted, value, merge=False)
    return out


def _mapping_key(key: Any, key_type: type, dotted: str, where: str) -> Any:
    if key_type is not int:
        return key
    token = token_id(key)
    if token is None:
        raise ConfigError(f"{where}: {dotted} maps token ids (non-negative integers) to numbers; {key!r} is not one")
    return token


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"section.key": value}``."""
    key = prefix.rstrip(".")
    if key in MAPPINGS and isinstance(node, dict):
        return {key: {str(k): v for k, v in sorted(node.items(), key=lambda item: str(item[0]))}}
    if not isinstance(node, dict):
        return {key: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat.update(flatten(value, f"{prefix}{key}."))
    return flat


def to_yaml(cfg: RuntimeConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
