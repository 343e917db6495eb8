"""LitGPT models from a config name or a pretrain YAML (LitGPT's schema), for planning and training."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

INSTALL_HINT = "LitGPT is not installed: pip install 'thunder_tk[litgpt]' (litgpt 0.5.13)"


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key."""


def _litgpt():
    try:
        from litgpt import GPT, Config
    except ImportError as e:
        raise ConfigError(f"{INSTALL_HINT} ({e})") from e
    return GPT, Config


@dataclass
class ModelSpec:
    config: object  # litgpt.Config
    micro_batch_size: int
    seq_len: int
    source: str
    precision: str | None = None  # a pretrain YAML's `precision` (LitGPT's: bf16-true, bf16-mixed, 32-true)


def load_spec(name_or_yaml: str, *, n_layer: int | None = None, micro_batch_size: int | None = None,
              seq_len: int | None = None) -> ModelSpec:
    """A LitGPT config name (e.g. "Llama-3.2-1B") or a YAML file with model_name/model_config and train.*"""
    GPT, Config = _litgpt()
    path = Path(name_or_yaml)
    train: dict = {}
    precision = None
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        doc = yaml.safe_load(path.read_text()) or {}
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        train = doc.get("train") or {}
        precision = doc.get("precision")
        model_config = doc.get("model_config")
        model_name = doc.get("model_name")
        if model_config is None and not model_name:
            raise ConfigError(f"{path}: needs model_name or model_config")
        config = config_of(Config, str(model_name) if model_name else None, model_config, f"{path}: ")
        source = str(path)
    else:
        config = _from_name(Config, name_or_yaml, "model name")
        source = name_or_yaml
    if n_layer is not None:
        config = Config(**{**_config_dict(config), "n_layer": n_layer})
    mbs = int(micro_batch_size or train.get("micro_batch_size") or 1)
    seq = int(seq_len or train.get("max_seq_length") or min(config.block_size, 2048))
    if seq > config.block_size:
        raise ConfigError(f"train.max_seq_length {seq} exceeds the model's block_size {config.block_size}")
    return ModelSpec(config, mbs, seq, source, precision)


def _config_dict(config) -> dict:
    from dataclasses import asdict

    d = asdict(config)
    # Derived fields are recomputed by Config's __post_init__.
    return {k: v for k, v in d.items() if k not in ("rope_n_elem",)}


def config_of(Config, model_name: str | None, model_config: dict | None, where: str = ""):
    """LitGPT's Config from a name, from explicit fields, or, where model_name is a LitGPT config name and
    model_config is given too, the named config with those fields replaced (e.g. `--model_config.n_layer 8` for a
    shorter run of the same shapes). A model_name LitGPT does not know beside a model_config is just a label, as
    in LitGPT's own pretrain."""
    if model_config is not None and not isinstance(model_config, dict):
        raise ConfigError(f"{where}model_config: expected a mapping of LitGPT Config fields")
    if model_config is None:
        return _from_name(Config, model_name, f"{where}model_name")
    try:
        named = Config.from_name(model_name) if model_name is not None else None
    except ValueError:
        named = None  # a name LitGPT does not know: a label beside the fields
    if named is None:
        try:
            return Config(**model_config)
        except TypeError as e:
            raise ConfigError(f"{where}model_config: {e}") from None
    if not model_config:
        return named
    fields = _config_dict(named)
    unknown = sorted(k for k in model_config if k not in fields)
    if unknown:
        raise ConfigError(f"{where}model_config.{unknown[0]}: not a field of LitGPT's Config")
    try:
        return Config(**{**fields, **model_config})
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError(f"{where}model_config: {e}") from None


def jit_unsupported(config) -> str | None:
    """Why thunder.jit cannot trace a LitGPT model of this config, where that is known from the config alone; None
    otherwise. LitGPT's mixture-of-experts MLP (Mixtral, Qwen3's MoE models) picks each expert's tokens with
    `torch.where(mask)`, whose result's shape depends on the data: Thunder traces static shapes and stops there."""
    if getattr(config, "mlp_class_name", None) == "LLaMAMoE":
        return ("model_config.mlp_class_name: LitGPT's mixture-of-experts MLP (LLaMAMoE) selects each expert's tokens "
                "with torch.where(mask), whose shape depends on the data, and Thunder (lightning-thunder 0.2.6) "
                "traces only static shapes, so it cannot jit this model")
    return None


def sliding_window_layers(config) -> int:
    """How many of the model's layers LitGPT gives a sliding-window mask."""
    if getattr(config, "sliding_window_size", None) is None:
        return 0
    indices = getattr(config, "sliding_window_indices", None)
    return config.n_layer if indices is None else sum(1 for i in indices[: config.n_layer] if i)


def jit_time_note(config, seq: int) -> str | None:
    """A note for models that take long to jit, from the config alone; None otherwise. LitGPT 0.5.13 builds a
    sliding-window layer's mask in `forward` with a Python loop over the positions, so Thunder traces `seq` indexed
    writes a layer (with or without tk; tk then reads the finished mask as a pattern and drops its ops). Measured on
    a 2-core CPU: 76 s for one shrunk layer at 512 positions, 396 s for two at 2048."""
    layers = sliding_window_layers(config)
    if not layers:
        return None
    return (f"note: LitGPT builds the sliding-window mask of {layers} layer{'s' if layers != 1 else ''} with a loop over "
            f"the {seq} positions, which Thunder traces one write at a time: the first step's jit can take minutes "
            "per such layer")


def _from_name(Config, name: str, what: str):
    try:
        return Config.from_name(name)
    except ValueError as e:
        raise ConfigError(f"{what} {name!r} is not a LitGPT config name") from e


def build_meta_model(spec: ModelSpec, dtype):
    """The model on the meta device (no memory), sized for spec.seq_len."""
    import torch

    GPT, _ = _litgpt()
    with torch.device("meta"):
        model = GPT(spec.config)
        model.max_seq_length = spec.seq_len
    return model.to(dtype)
