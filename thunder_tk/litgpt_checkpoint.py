"""LitGPT's checkpoint folders, read and written, so that a `thunder-tk pretrain` run starts from a checkpoint the
rest of LitGPT made (`initial_checkpoint_dir`: e.g. `litgpt download`'s) and ends in one the rest of LitGPT reads
(`out_dir/final`: `litgpt generate`, `chat`, `finetune_*`, `evaluate`, `convert_from_litgpt`).

A folder holds `lit_model.pth` (the model's unsharded state dict, the keys of LitGPT's `GPT`), `model_config.yaml`
(LitGPT's `Config` as a mapping), the tokenizer's files where the run had a tokenizer, and `hyperparameters.yaml` (the
run's config). The resume checkpoints (`out_dir/checkpoints`, one file per rank with the optimizer's state) are a
different thing: they continue a run, these hand a model on.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import torch
import yaml

from thunder_tk.litgpt_models import ConfigError

CHECKPOINT_FILE = "lit_model.pth"
CONFIG_FILE = "model_config.yaml"
HYPERPARAMETERS_FILE = "hyperparameters.yaml"
# What LitGPT copies beside a checkpoint from its tokenizer directory (litgpt.utils.copy_config_files).
TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
                   "tokenizer_config.json")
# Config fields that decide the parameters' names and shapes: a checkpoint made for other values cannot be loaded.
SHAPE_FIELDS = ("n_layer", "n_embd", "n_head", "n_query_groups", "head_size", "padded_vocab_size", "intermediate_size",
                "moe_intermediate_size", "n_expert", "bias", "attn_bias", "lm_head_bias", "norm_qk",
                "post_attention_norm", "post_mlp_norm", "norm_class_name", "mlp_class_name", "shared_attention_norm",
                "parallel_residual")


def resolve_dir(path: str | Path) -> Path:
    """LitGPT's rule for checkpoint paths: a relative path that is not a folder here but is one under
    `checkpoints/` (where `litgpt download` puts models) means that one."""
    path = Path(path)
    under = Path("checkpoints") / path
    if not path.is_dir() and not path.is_absolute() and path.parts[:1] != ("checkpoints",) and under.is_dir():
        return under
    return path


def atomic_write(path: Path, write) -> None:
    """`write(tmp)` then a rename onto `path`: a killed process leaves the previous file or the new one, never part."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def full_state_dict(model: torch.nn.Module, net: torch.nn.Module | None = None, *, world: int = 1,
                    main: bool = True) -> dict[str, torch.Tensor] | None:
    """`model`'s state dict with every tensor unsharded and on the CPU, on the main rank; None on the others.

    One process: `model.state_dict()`, copied to the CPU. Thunder FSDP (`net`, world > 1): every parameter is sharded
    along its first dimension and padded to a multiple of the world size, so each rank's shard is gathered in turn
    (one parameter's full tensor on the device at a time), concatenated and cut to the shape `model` (whose
    parameters FSDP left on the meta device) still records. Every rank must call this (collectives)."""
    if world == 1 or net is None:
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    import torch.distributed as tdist

    # The keys of `model`'s state dict, tied parameters under each of their names: parameter -> names.
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    originals = dict(model.named_parameters())
    prefix = _prefix_of(model, net)
    out: dict[str, torch.Tensor] | None = {} if main else None
    for name, shard in net.named_parameters():
        local = name[len(prefix):] if name.startswith(prefix) else name
        if local not in originals:  # not part of the model (none in pretrain's LossModule)
            continue
        full_shape = originals[local].shape
        parts = [torch.empty_like(shard) for _ in range(world)]
        tdist.all_gather(parts, shard.detach().contiguous())
        if main:
            full = torch.cat(parts, 0).narrow(0, 0, full_shape[0]).reshape(full_shape).to("cpu", copy=True)
            for key in names_of[id(originals[local])]:
                out[key] = full
        del parts
    if main:  # buffers (replicated) in the state dict, e.g. a persistent one of a custom model
        for key, value in model.state_dict().items():
            if key not in out and value.device.type != "meta":
                out[key] = value.detach().to("cpu", copy=True)
        # LitGPT's order of keys, as `model.state_dict()` lists them
        out = {k: out[k] for k in model.state_dict() if k in out}
    return out


def _prefix_of(model: torch.nn.Module, net: torch.nn.Module) -> str:
    """The name under which `net` (a wrapper such as pretrain's LossModule, jitted) holds `model`."""
    inner = getattr(net, "_model", net)
    for name, module in inner.named_modules():
        if module is model:
            return f"{name}." if name else ""
    return ""


def write_litgpt_checkpoint(folder: Path, state_dict: dict[str, torch.Tensor], model_config, *,
                            tokenizer_dir: str | Path | None = None, hyperparameters: dict | None = None) -> Path:
    """Writes a LitGPT checkpoint folder (each file atomically: a killed run leaves the last complete file or none);
    returns the checkpoint file's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / CHECKPOINT_FILE, lambda p: torch.save(state_dict, p))
    config = dataclasses.asdict(model_config) if dataclasses.is_dataclass(model_config) else dict(model_config)
    atomic_write(folder / CONFIG_FILE, lambda p: p.write_text(yaml.dump(config)))
    if tokenizer_dir is not None:
        source = Path(tokenizer_dir)
        for name in TOKENIZER_FILES:
            if (source / name).is_file() and name != CONFIG_FILE:
                atomic_write(folder / name, lambda p, s=source / name: shutil.copyfile(s, p))
    if hyperparameters is not None:
        atomic_write(folder / HYPERPARAMETERS_FILE, lambda p: p.write_text(yaml.safe_dump(hyperparameters,
                                                                                     sort_keys=False)))
    return folder / CHECKPOINT_FILE


def checkpoint_model_config(folder: str | Path) -> dict | None:
    """The `model_config.yaml` of a LitGPT checkpoint folder as a mapping, or None where it has none."""
    path = resolve_dir(folder) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"initial_checkpoint_dir: {path} is not valid YAML ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"initial_checkpoint_dir: {path} is not a mapping")
    return doc


def load_initial_weights(model: torch.nn.Module, folder: str | Path, model_config) -> Path:
    """Loads a LitGPT checkpoint folder's weights into `model` (cast to its parameters' dtype); returns the file.
    Every problem is one ConfigError naming `initial_checkpoint_dir`: no such folder or file, a `model_config.yaml`
    whose shapes differ from the run's model (the first differing field named), or a state dict with other keys or
    shapes."""
    folder = resolve_dir(folder)
    key = "initial_checkpoint_dir"
    if not folder.is_dir():
        raise ConfigError(f"{key}: {folder} is not a folder")
    path = folder / CHECKPOINT_FILE
    if not path.is_file():
        raise ConfigError(f"{key}: {folder} has no {CHECKPOINT_FILE} (a LitGPT checkpoint folder holds one: "
                          f"`litgpt download` writes it, and so does `thunder-tk pretrain` in out_dir/final)")
    theirs = checkpoint_model_config(folder)
    if theirs is not None:
        ours = dataclasses.asdict(model_config)
        for field in SHAPE_FIELDS:
            if field in theirs and field in ours and theirs[field] != ours[field]:
                raise ConfigError(f"{key}: {folder / CONFIG_FILE} has {field} {theirs[field]!r}, the run's model "
                                  f"{ours[field]!r}")
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: say which
        raise ConfigError(f"{key}: {path} cannot be read ({type(e).__name__}: {e})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # LitGPT pretrain's own checkpoints hold the optimizer's state beside the model
    if not isinstance(state, dict):
        raise ConfigError(f"{key}: {path} holds no state dict")
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the model's tensors missing (first {missing[0]!r})")
        if unexpected:
            parts.append(f"{len(unexpected)} it does not have (first {unexpected[0]!r})")
        raise ConfigError(f"{key}: {path} does not fit the run's model: {'; '.join(parts)}")
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise ConfigError(f"{key}: {path} has {k} of shape {tuple(state[k].shape)}, the run's model "
                              f"{tuple(v.shape)}")
    with torch.no_grad():
        model.load_state_dict(state, strict=True)
    return path


def _run_checkpoint_folder(run_dir: Path, step: int | None) -> Path:
    from thunder_tk.pretrain import checkpoint_folder, latest_checkpoint

    checkpoints = run_dir / "checkpoints"
    if step is None:
        latest = latest_checkpoint(run_dir)
        if latest is None:
            raise ConfigError(f"{run_dir}: no checkpoint (no {checkpoints / 'latest'}); is it a `thunder-tk "
                              "pretrain` out_dir?")
        return latest
    folder = checkpoint_folder(run_dir, step)
    if not folder.is_dir():
        have = sorted(p.name for p in checkpoints.glob("step-*")) if checkpoints.is_dir() else []
        raise ConfigError(f"--step {step}: {run_dir} has no checkpoint of that step "
                          f"(it has: {', '.join(have) or 'none'})")
    return folder


def export_run_checkpoint(run_dir: str | Path, step: int | None = None, dest: str | Path | None = None) -> Path:
    """A `thunder-tk pretrain` resume checkpoint (the latest, or that of `step`) as a LitGPT checkpoint folder, on
    the CPU and offline: the ranks' FSDP shards are concatenated and cut to the model's shapes (read from a model on
    the meta device). `dest` defaults to `run_dir/step-XXXXXXXX`, where `litgpt pretrain` puts its own. Returns the
    folder. The run's final model is exported by the run itself (`run_dir/final`)."""
    from thunder_tk.litgpt_models import _litgpt, config_of

    run_dir = Path(run_dir)
    folder = _run_checkpoint_folder(run_dir, step)
    ranks = sorted(folder.glob("rank*.pt"), key=lambda p: int(p.stem[4:]))
    if not ranks:
        raise ConfigError(f"{folder}: no rank files")
    states = [torch.load(p, map_location="cpu", mmap=True, weights_only=False) for p in ranks]
    first = states[0]
    GPT, Config = _litgpt()
    run_config = first.get("config") or {}
    if "model_config" in first:
        cfg = Config(**first["model_config"])
    else:  # written before the model's config was kept beside the run's
        cfg = config_of(Config, run_config.get("model_name"), run_config.get("model_config"))
    with torch.device("meta"):
        model = GPT(cfg)
    if (run_config.get("train") or {}).get("tie_embeddings"):
        model.transformer.wte.weight = model.lm_head.weight
    expected = model.state_dict(keep_vars=True)
    world = len(states)
    out: dict[str, torch.Tensor] = {}
    for key, meta in expected.items():
        if world == 1:
            out[key] = first["model"][key]
            continue
        name = f"model.{key}"  # pretrain's FSDP module holds the model as LossModule.model
        if name not in first["model"]:  # a tied weight listed under its other name
            partner = next((k for k, v in expected.items() if v is meta and f"model.{k}" in first["model"]), None)
            if partner is None:
                raise ConfigError(f"{folder}: no shard of {key}")
            name = f"model.{partner}"
        full = torch.cat([s["model"][name] for s in states], 0)
        out[key] = full.narrow(0, 0, meta.shape[0]).reshape(meta.shape).clone()
    step_done = int(first.get("step", 0))
    dest = Path(dest) if dest is not None else run_dir / f"step-{step_done:08d}"
    tokenizer = (run_config.get("data") or {}).get("tokenizer_dir")
    tokenizer = resolve_dir(tokenizer) if tokenizer else None
    write_litgpt_checkpoint(dest, out, cfg, tokenizer_dir=tokenizer if tokenizer and tokenizer.is_dir() else None,
                            hyperparameters=run_config or None)
    return dest
