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


def sliding_window_mask(seq: int, window: int, dtype, device):
    """LitGPT's sliding-window attention mask for `seq` positions, (1, 1, seq, seq): 0 where query i keeps key j
    (i - window < j <= i), -inf elsewhere, in `dtype`. The same values as the loop in LitGPT 0.5.13's
    `CausalSelfAttention.forward`, from a handful of tensor ops."""
    import torch

    pos = torch.arange(seq, device=device)
    behind = pos.unsqueeze(1) - pos  # query minus key
    keep = (behind >= 0) & (behind < window)
    return torch.full((seq, seq), float("-inf"), dtype=dtype, device=device).masked_fill(keep, 0.0).view(1, 1, seq, seq)


def _attention_with_window_mask(self, q, k, v, mask=None):
    """A sliding-window layer's attention (after `vectorize_window_masks`): LitGPT's own, with the window's mask."""
    if mask is not None:
        raise RuntimeError(
            "this layer's sliding-window mask was moved out of LitGPT's forward for training "
            "(thunder_tk.litgpt_models.vectorize_window_masks); KV-cache inference needs a model without that change")
    mask = sliding_window_mask(q.size(2), self.config.sliding_window_size, q.dtype, q.device)
    return type(self).scaled_dot_product_attention(self, q, k, v, mask)


def vectorize_window_masks(model) -> int:
    """Make a LitGPT model's sliding-window layers build their mask in a few tensor ops; returns how many layers.

    LitGPT 0.5.13 builds that mask in `CausalSelfAttention.forward` with a Python loop over the positions, which
    thunder.jit (and torch.compile) trace one indexed write at a time: minutes per layer at 2048 positions, and, where
    no executor drops them, thousands of ops in every forward. Each such layer here keeps its window but leaves
    LitGPT's loop off (`apply_sliding_window_attention` False), and its `scaled_dot_product_attention` adds the same
    mask (`sliding_window_mask`), which tk then reads as a causal window. Same values, so the same results. For
    training and full-sequence forwards: the change leaves LitGPT's KV-cache path, so a layer with a KV cache is
    refused here, and one given a cache later raises rather than attend without its window."""
    import types

    from litgpt.model import CausalSelfAttention

    changed = 0
    for name, module in model.named_modules():
        if not (isinstance(module, CausalSelfAttention) and module.apply_sliding_window_attention):
            continue
        if module.kv_cache is not None:
            raise ValueError(f"{name}: has a KV cache; vectorize_window_masks is for training and full-sequence "
                             "forwards (LitGPT's KV-cache path needs its own window handling)")
        module.apply_sliding_window_attention = False
        module.scaled_dot_product_attention = types.MethodType(_attention_with_window_mask, module)
        changed += 1
    return changed


def init_like_litgpt_pretrain(model, config) -> None:
    """The initialisation `litgpt pretrain` gives a new model (GPT-NeoX's): every embedding and linear weight drawn
    from N(0, 2 / (5 n_embd)) and their biases zeroed, then the output projections of attention and of the LLaMA-style
    MLPs (LitGPT's LLaMAMLP and its subclasses) from N(0, (1 / (sqrt(n_embd) n_layer))^2). `GPT(config)` alone keeps
    PyTorch's defaults (embeddings from N(0, 1)), which train another curve than LitGPT's."""
    import math

    import torch
    from litgpt.model import CausalSelfAttention, LLaMAMLP

    def normal(module, std):
        torch.nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            torch.nn.init.zeros_(module.bias)

    # One draw per weight, in the modules' order, as LitGPT's reset pass makes them: the same seed gives the same
    # weights as `litgpt pretrain`.
    projections = {id(m.proj) for m in model.modules() if isinstance(m, (LLaMAMLP, CausalSelfAttention))}
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Embedding, torch.nn.Linear)):
                normal(module, 1 / math.sqrt(config.n_embd) / config.n_layer if id(module) in projections
                       else math.sqrt(2.0 / 5 / config.n_embd))


def _from_name(Config, name: str, what: str):
    try:
        return Config.from_name(name)
    except ValueError as e:
        raise ConfigError(f"{what} {name!r} is not a LitGPT config name") from e


def build_meta_model(spec: ModelSpec, dtype):
    """The model on the meta device (no memory), sized for spec.seq_len, its window masks built as pretrain builds
    them (vectorize_window_masks)."""
    import torch

    GPT, _ = _litgpt()
    with torch.device("meta"):
        model = GPT(spec.config)
        model.max_seq_length = spec.seq_len
    vectorize_window_masks(model)
    return model.to(dtype)
