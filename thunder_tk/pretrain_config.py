"""The `thunder-tk pretrain` configuration: LitGPT's pretrain YAML schema plus a `compiler` section.

Every problem with a config is one `ConfigError` whose message names the key ("train.micro_batch_size:
expected an integer, got 'four'"); the CLI prints it without a traceback.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from thunder_tk.litgpt_models import ConfigError


@dataclass
class TrainArgs:
    global_batch_size: int = 8
    micro_batch_size: int = 4
    max_tokens: int | None = None
    max_steps: int | None = None
    max_seq_length: int | None = None
    lr_warmup_steps: int | None = 0
    max_norm: float | None = 1.0
    min_lr: float = 0.0
    save_interval: int | None = None
    log_interval: int = 1
    epochs: int | None = None  # accepted for LitGPT compatibility; the token budget decides
    tie_embeddings: bool | None = None  # the embedding and the output layer share one weight, as in LitGPT
    # Warm-up over this fraction of an epoch of the text data (LitGPT's meaning); instead of lr_warmup_steps
    lr_warmup_fraction: float | None = None
    max_time: float | None = None  # seconds of training, after which the run stops (after a step) and saves


@dataclass
class EvalArgs:
    interval: int | None = None
    max_iters: int = 2
    max_new_tokens: int | None = None
    initial_validation: bool = False
    final_validation: bool = False
    evaluate_example: str | int | None = None


@dataclass
class DataArgs:
    """`synthetic` (default: a learnable token stream, no downloads) or `text` (local files, local tokenizer).
    LitGPT's form for its TextFiles module ({class_path: litgpt.data.TextFiles, init_args: {train_data_path,
    val_data_path}}) is read as text (`_litgpt_data`)."""

    kind: str = "synthetic"
    paths: list[str] = field(default_factory=list)
    tokenizer_dir: str | None = None
    val_fraction: float = 0.05  # the text's last share, held out for validation (unless val_paths)
    val_paths: list[str] = field(default_factory=list)  # validation text of its own


# LitGPT's pretraining data modules other than TextFiles read prepared datasets (downloads, litdata shards).
def _litgpt_data(value, key: str):
    """A LitGPT `data` value (a module name, or {class_path, init_args}) as DataArgs' fields; other values as given."""
    if isinstance(value, str):
        if value in ("synthetic", "text"):
            return {"kind": value}
        name, init = value.rpartition(".")[2], {}
    elif isinstance(value, dict) and "class_path" in value:
        extra = sorted(set(value) - {"class_path", "init_args"})
        if extra:
            raise ConfigError(f"{key}.{extra[0]}: unknown key (expected class_path, init_args)")
        name, init = str(value["class_path"]).rpartition(".")[2], value.get("init_args") or {}
    else:
        return value
    if name != "TextFiles":
        raise ConfigError(f"{key}: LitGPT's {name} data module reads a prepared dataset (downloaded, or litdata "
                          f"shards), which thunder-tk pretrain does not; use data: synthetic, or local text: "
                          f"{{kind: text, paths: [...]}} or {{class_path: litgpt.data.TextFiles, init_args: "
                          f"{{train_data_path: <folder of .txt files>}}}}")
    unknown = sorted(set(init) - {"train_data_path", "val_data_path", "seed", "num_workers"})
    if unknown:
        raise ConfigError(f"{key}.init_args.{unknown[0]}: not an argument of LitGPT's TextFiles")
    if not init.get("train_data_path"):
        raise ConfigError(f"{key}.init_args.train_data_path: LitGPT's TextFiles needs a folder of .txt files")

    def texts(folder_key):
        folder = Path(str(init[folder_key]))
        files = sorted(str(p) for p in folder.glob("*.txt"))
        if not files:
            raise ConfigError(f"{key}.init_args.{folder_key}: no .txt files in {folder}")
        return files

    paths = texts("train_data_path")
    if init.get("val_data_path"):
        val_paths = texts("val_data_path")
    else:  # LitGPT's rule: the first file is the validation text
        if len(paths) < 2:
            raise ConfigError(f"{key}.init_args.train_data_path: LitGPT's TextFiles without val_data_path holds the "
                              f"first of at least two .txt files out for validation; {init['train_data_path']} has one")
        val_paths, paths = paths[:1], paths[1:]
    return {"kind": "text", "paths": paths, "val_paths": val_paths}


# Where optimizer.class_path may name a class: torch's, and tk's AdamW (its update on tk's kernel).
OPTIMIZER_MODULES = ("torch.optim.", "thunder_tk.optim.")


@dataclass
class OptimizerArgs:
    class_path: str = "torch.optim.AdamW"
    init_args: dict = field(default_factory=lambda: {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]})


@dataclass
class CompilerArgs:
    executors: list[str] = field(default_factory=lambda: ["tk"])
    jit: bool = True  # False: eager PyTorch, for comparisons
    # tk rules, families or features to turn off for this model (Thunder's tk_disable compile option), e.g. [gemm]
    disable: list[str] = field(default_factory=list)
    # Capture the step's forward and backward as CUDA graphs and replay them (thunder_tk.CUDAGraphs): one host call
    # each, for models whose op-by-op step the host cannot issue as fast as the GPU runs it. Under FSDP tk's
    # collectives are captured with the compute (other collectives run between the graphs).
    cuda_graphs: bool = False


@dataclass
class PretrainConfig:
    model_name: str | None = None
    model_config: dict | None = None
    out_dir: str = "out/pretrain"
    data: DataArgs = field(default_factory=DataArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)
    optimizer: OptimizerArgs = field(default_factory=OptimizerArgs)
    compiler: CompilerArgs = field(default_factory=CompilerArgs)
    devices: int | str = 1
    num_nodes: int = 1
    seed: int = 42
    # LitGPT's choices: bf16-true (bf16 weights and compute), bf16-mixed (fp32 weights, bf16 autocast), 32-true;
    # null: bf16-true on a GPU, 32-true on a CPU (precision_of).
    precision: str | None = None
    # A LitGPT checkpoint folder (lit_model.pth, model_config.yaml) whose weights the run starts from; relative
    # paths are also looked for under checkpoints/, as LitGPT does. Its model_config.yaml gives the model where
    # neither model_name nor model_config does.
    initial_checkpoint_dir: str | None = None
    # Continue from out_dir's checkpoints: true (the latest; an error if there is none), "auto" (the latest if
    # any), or a checkpoint folder (out_dir/checkpoints/step-XXXXXXXX). A resumed state replaces the initial one.
    resume: bool | str = False
    tokenizer_dir: str | None = None  # LitGPT's place for the tokenizer: the text data's, unless data names one
    # LitGPT keys with no effect here, accepted so its configs load (metrics go to out_dir/metrics.jsonl).
    logger_name: str | None = None
    log: dict | None = None


# ------------------------------------------------------------------------------------------------
# Loading


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


# PyYAML reads YAML 1.1, whose floats need a dot: `lr: 3e-4` (as LitGPT's configs and command lines write it) comes
# back as the string '3e-4'. Such strings are read as the numbers they are.
_EXPONENT_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def yaml_number(value):
    """`value`, or the float a string like '3e-4' spells; mappings and lists element by element."""
    if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        return float(value)
    if isinstance(value, dict):
        return {k: yaml_number(v) for k, v in value.items()}
    if isinstance(value, list):
        return [yaml_number(v) for v in value]
    return value


def _coerce(value, tp, key: str):
    """`value` as type `tp` (from the dataclass annotation), or ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(e)
        names = " or ".join(_type_name(a) for a in args if a is not type(None))
        raise ConfigError(f"{key}: expected {names}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if tp is DataArgs:
            value = _litgpt_data(value, key)
        if isinstance(value, str) and tp is OptimizerArgs:
            value = {"class_path": value if "." in value else f"torch.optim.{value}"}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        value = yaml_number(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return yaml_number(value)  # model_config's and optimizer.init_args' fields, e.g. norm_eps: 1e-5
    return value


# Keys older LitGPT pretrain configs kept under `train`, and where LitGPT 0.5 reads them.
MOVED_TRAIN_KEYS = {"learning_rate": "optimizer.init_args.lr", "weight_decay": "optimizer.init_args.weight_decay",
                    "beta1": "optimizer.init_args.betas", "beta2": "optimizer.init_args.betas"}


def _build(cls, values: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in values.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in known:
            if cls is TrainArgs and k in MOVED_TRAIN_KEYS:
                raise ConfigError(f"{key}: unknown key (older LitGPT configs' place for it; LitGPT 0.5 and this "
                                  f"command read {MOVED_TRAIN_KEYS[k]})")
            raise ConfigError(f"{key}: unknown key (expected one of {', '.join(sorted(known))})")
        kwargs[k] = _coerce(v, hints[k], key)
    return cls(**kwargs)


def parse_overrides(tokens: list[str]) -> dict:
    """`--train.max_steps 20 --compiler.executors '[tk, sdpa]'` -> nested dict, values parsed as YAML."""
    out: dict = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or len(token) <= 2:
            raise ConfigError(f"{token}: expected --key.path value")
        if "=" in token:
            key, raw = token[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(tokens):
                raise ConfigError(f"{token[2:]}: missing a value")
            key, raw = token[2:], tokens[i + 1]
            i += 2
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: conflicts with another override")
        node[parts[-1]] = value
    return out


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict) and k not in ("model_config",):
            merged[k] = _merge(merged[k], v)
        elif isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = {**merged[k], **v}
        else:
            merged[k] = v
    return merged


def load_config(path: str | Path | None, overrides: dict | None = None) -> PretrainConfig:
    doc: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
    config = _build(PretrainConfig, _merge(doc, overrides or {}))
    validate(config)
    return config


# LitGPT pretrain's precisions: name -> (parameter dtype, autocast dtype or None).
PRECISIONS = {"bf16-true": ("bfloat16", None), "bf16-mixed": ("float32", "bfloat16"), "32-true": ("float32", None)}


def precision_of(precision: str | None, device_type: str) -> tuple[str, str, str | None]:
    """(name, parameter dtype, autocast dtype or None) for a config's `precision` on a device type; null picks
    bf16-true on a GPU and 32-true on a CPU."""
    name = precision or ("bf16-true" if device_type == "cuda" else "32-true")
    return (name, *PRECISIONS[name])


def world_size_of(config: PretrainConfig) -> int:
    devices = config.devices
    if isinstance(devices, str):
        if devices != "auto":
            raise ConfigError(f"devices: expected an integer or 'auto', got {devices!r}")
        import torch

        devices = max(1, torch.cuda.device_count())
    return int(devices) * config.num_nodes


def validate(config: PretrainConfig) -> None:
    """ConfigError naming the first key that cannot be used; LitGPT's top-level tokenizer_dir becomes the data's."""
    t = config.train
    if config.model_name is None and config.model_config is None:
        if config.initial_checkpoint_dir is None:
            raise ConfigError("model_name: give model_name (a LitGPT config name), model_config, or an "
                              "initial_checkpoint_dir with a model_config.yaml")
        from thunder_tk.litgpt_checkpoint import CONFIG_FILE, checkpoint_model_config, resolve_dir

        if checkpoint_model_config(config.initial_checkpoint_dir) is None:
            raise ConfigError(f"model_name: give model_name or model_config ("
                              f"{resolve_dir(config.initial_checkpoint_dir) / CONFIG_FILE} does not exist)")
    for key, value in (("train.global_batch_size", t.global_batch_size), ("train.micro_batch_size", t.micro_batch_size),
                       ("train.log_interval", t.log_interval), ("num_nodes", config.num_nodes)):
        if value < 1:
            raise ConfigError(f"{key}: must be at least 1, got {value}")
    for key, value in (("train.max_steps", t.max_steps), ("train.max_tokens", t.max_tokens),
                       ("train.save_interval", t.save_interval), ("train.max_seq_length", t.max_seq_length),
                       ("eval.interval", config.eval.interval)):
        if value is not None and value < 1:
            raise ConfigError(f"{key}: must be at least 1, got {value}")
    if t.max_steps is None and t.max_tokens is None:
        raise ConfigError("train.max_steps: give train.max_steps or train.max_tokens")
    if t.lr_warmup_steps is not None and t.lr_warmup_steps < 0:
        raise ConfigError(f"train.lr_warmup_steps: must be at least 0, got {t.lr_warmup_steps}")
    if t.lr_warmup_fraction is not None:
        if not 0 <= t.lr_warmup_fraction <= 1:
            raise ConfigError(f"train.lr_warmup_fraction: must be between 0 and 1, got {t.lr_warmup_fraction}")
        if t.lr_warmup_fraction and t.lr_warmup_steps:
            raise ConfigError("train.lr_warmup_fraction: give it or train.lr_warmup_steps, not both")
        if t.lr_warmup_fraction and config.data.kind == "synthetic":
            raise ConfigError("train.lr_warmup_fraction: a fraction of an epoch, and the synthetic stream has no "
                              "epochs; give train.lr_warmup_steps")
    if t.max_time is not None and t.max_time <= 0:
        raise ConfigError(f"train.max_time: must be above 0 seconds, got {t.max_time}")
    if config.resume == "":
        raise ConfigError("resume: expected true, false, 'auto' or a checkpoint folder, got ''")
    if config.tokenizer_dir is not None:
        if config.data.tokenizer_dir is None:
            config.data.tokenizer_dir = config.tokenizer_dir  # LitGPT's top-level key: the data's tokenizer
        elif Path(config.tokenizer_dir) != Path(config.data.tokenizer_dir):
            raise ConfigError(f"tokenizer_dir: {config.tokenizer_dir} differs from data.tokenizer_dir "
                              f"{config.data.tokenizer_dir}; give one")
    world = world_size_of(config)
    if t.global_batch_size % (t.micro_batch_size * world):
        raise ConfigError(
            f"train.global_batch_size: {t.global_batch_size} is not a multiple of train.micro_batch_size "
            f"({t.micro_batch_size}) x {world} device{'s' if world > 1 else ''}"
        )
    if not 0 <= config.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction: must be at least 0 and below 1, got {config.data.val_fraction}")
    if config.data.kind not in ("synthetic", "text"):
        raise ConfigError(f"data.kind: expected synthetic or text, got {config.data.kind!r}")
    if config.data.kind == "text":
        if not config.data.paths:
            raise ConfigError("data.paths: text data needs at least one local file")
        if not (config.data.tokenizer_dir or config.initial_checkpoint_dir):
            raise ConfigError("data.tokenizer_dir: text data needs a local tokenizer directory (or an "
                              "initial_checkpoint_dir whose tokenizer it then reads)")
    if config.precision is not None and config.precision not in PRECISIONS:
        raise ConfigError(f"precision: expected one of {', '.join(PRECISIONS)} (or null: bf16-true on a GPU, 32-true "
                          f"on a CPU), got {config.precision!r}")
    if not config.optimizer.class_path.startswith(OPTIMIZER_MODULES):
        raise ConfigError(f"optimizer.class_path: only torch.optim optimizers and thunder_tk.optim.AdamW, got "
                          f"{config.optimizer.class_path!r}")
    if not config.compiler.executors and config.compiler.jit:
        raise ConfigError("compiler.executors: name at least one executor (e.g. [tk])")
    if config.compiler.cuda_graphs and not config.compiler.jit:
        raise ConfigError("compiler.cuda_graphs: CUDA graphs are captured from Thunder's traces; they need "
                          "compiler.jit true")
    if config.compiler.disable:
        from thunder_tk.claim_rules import known_disable_names

        known = known_disable_names()
        unknown = sorted(set(config.compiler.disable) - known)
        if unknown:
            raise ConfigError(f"compiler.disable: unknown name {unknown[0]!r} (known: {', '.join(sorted(known))})")
