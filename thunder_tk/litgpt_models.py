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


def load_spec(name_or_yaml: str, *, n_layer: int | None = None, micro_batch_size: int | None = None,
              seq_len: int | None = None) -> ModelSpec:
    """A LitGPT config name (e.g. "Llama-3.2-1B") or a YAML file with model_name/model_config and train.*"""
    GPT, Config = _litgpt()
    path = Path(name_or_yaml)
    train: dict = {}
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        doc = yaml.safe_load(path.read_text()) or {}
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        train = doc.get("train") or {}
        model_config = doc.get("model_config")
        model_name = doc.get("model_name")
        if model_config is not None:
            if not isinstance(model_config, dict):
                raise ConfigError(f"{path}: model_config must be a mapping")
            try:
                config = Config(**model_config)
            except TypeError as e:
                raise ConfigError(f"{path}: model_config: {e}") from e
        elif model_name:
            config = _from_name(Config, str(model_name), f"{path}: model_name")
        else:
            raise ConfigError(f"{path}: needs model_name or model_config")
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
    return ModelSpec(config, mbs, seq, source)


def _config_dict(config) -> dict:
    from dataclasses import asdict

    d = asdict(config)
    # Derived fields are recomputed by Config's __post_init__.
    return {k: v for k, v in d.items() if k not in ("rope_n_elem",)}


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
