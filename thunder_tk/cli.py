"""`thunder-tk`: inspect how tk would run a LitGPT model, and what this install contains.

    thunder-tk explain                                  # the embedded default: Llama-3.2-1B, 2 layers
    thunder-tk explain litgpt_configs/tiny.yaml         # or --config litgpt_configs/tiny.yaml, as pretrain takes it
    thunder-tk explain Llama-3.2-1B --n-layer 4 --seq 4096 --json plan.json
    thunder-tk explain Gemma-3-1b-it --cuda-graphs          # the step as CUDA graphs: host calls per step
    thunder-tk info
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

DEFAULT_MODEL = "Llama-3.2-1B"
DEFAULT_N_LAYER = 2
# explain --dtype names for LitGPT's precisions (pretrain_config.PRECISIONS), and fp16, which pretrain does not run.
EXPLAIN_PRECISIONS = {"bf16-true": "bf16", "bf16-mixed": "bf16-mixed", "32-true": "fp32"}


def planned_dtypes() -> dict[str, tuple[str, str | None]]:
    """explain --dtype -> (weights' dtype, autocast dtype or None)."""
    from thunder_tk.pretrain_config import PRECISIONS

    return {**{short: PRECISIONS[name] for name, short in EXPLAIN_PRECISIONS.items()}, "fp16": ("float16", None)}


class CLIError(Exception):
    pass


def _cmd_explain(args) -> int:
    import torch

    from thunder_tk.litgpt_models import ConfigError, build_meta_model, jit_unsupported, load_spec
    from thunder_tk.planning import plan

    if args.model is not None and args.config is not None:
        raise CLIError(f"explain: give the model once, as {args.model!r} or as --config {args.config!r}")
    chosen = args.model if args.model is not None else args.config
    model = chosen or DEFAULT_MODEL
    n_layer = args.n_layer if args.n_layer is not None else (DEFAULT_N_LAYER if chosen is None else None)
    try:
        spec = load_spec(model, n_layer=n_layer, micro_batch_size=args.batch, seq_len=args.seq)
    except ConfigError as e:
        raise CLIError(str(e)) from None
    if why := jit_unsupported(spec.config):
        raise CLIError(f"{spec.source}: {why}")
    # --dtype, else the YAML's precision as `thunder-tk pretrain` would run it on a GPU, else bf16
    precision = args.dtype or EXPLAIN_PRECISIONS.get(spec.precision or "bf16-true")
    if precision is None:
        raise CLIError(f"{spec.source}: precision {spec.precision!r} is not one of "
                       f"{', '.join(EXPLAIN_PRECISIONS)}; pass --dtype")
    weights, autocast = (getattr(torch, name) if name else None for name in planned_dtypes()[precision])
    meta_model = build_meta_model(spec, weights)
    if args.inference:
        meta_model.requires_grad_(False)
    tokens = torch.empty(spec.micro_batch_size, spec.seq_len, dtype=torch.int64, device="meta")
    options = {"device": args.device, "autocast": autocast}
    if args.cuda_graphs:
        from thunder_tk.cuda_graphs import CUDAGraphs

        options["transforms"] = [CUDAGraphs()]
    if args.inference:
        report = plan(meta_model, [tokens], **options)
    else:  # training: the model with its loss, as `thunder-tk pretrain` jits it
        from thunder_tk.pretrain import LossModule

        report = plan(LossModule(meta_model), [tokens, torch.empty_like(tokens)], **options)
    cfg = spec.config
    print(f"{spec.source}: {cfg.name or 'model'}, {cfg.n_layer} layers, hidden {cfg.n_embd}, {cfg.n_head} heads "
          f"(head_dim {cfg.head_size}, {cfg.n_query_groups} kv groups), batch {spec.micro_batch_size} x "
          f"{spec.seq_len} tokens, {precision}, {'inference' if args.inference else 'training'}")
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": spec.source, **report.to_dict()}, f, indent=2)
    return 0


def _cmd_pretrain(args) -> int:
    from thunder_tk.litgpt_models import ConfigError
    from thunder_tk.pretrain import pretrain
    from thunder_tk.pretrain_config import load_config, parse_overrides

    try:
        config = load_config(args.config, parse_overrides(args.overrides))
        resume = {"true": True, "false": False}.get(str(args.resume).lower(), args.resume)
        pretrain(config, resume=resume, checkpoints=not args.no_checkpoint)
    except ConfigError as e:
        raise CLIError(str(e)) from None
    return 0


def _cmd_export(args) -> int:
    from thunder_tk.litgpt_checkpoint import export_run_checkpoint
    from thunder_tk.litgpt_models import ConfigError

    try:
        folder = export_run_checkpoint(args.out_dir, args.step, args.to)
    except ConfigError as e:
        raise CLIError(str(e)) from None
    print(f"LitGPT checkpoint: {folder} (e.g. litgpt generate {folder})")
    return 0


def _cmd_info(args) -> int:
    import thunder

    import thunder_tk
    from thunder_tk import _extension, env_settings

    info = _extension.build_info()
    print(f"thunder_tk {thunder_tk.__version__}, lightning-thunder {thunder.__version__}")
    try:
        kernels = sorted(_extension.compiled_kernels())
        print(f"kernels: {', '.join(kernels)} ({info.get('arch')}, nvcc {info.get('nvcc')})" if kernels
              else _extension.unavailable_reason())
    except ValueError as e:  # a THUNDER_TK_* setting the module checks as it loads
        print(f"kernels: not loaded: {e}")
    fuser = thunder_tk.tk.default_fuser()
    print(f"executors=[tk] amounts to: {[ex.name for ex in thunder_tk.executors()]} (fuser: {fuser.name})")
    print(f"collectives (THUNDER_TK_COLLECTIVE_*): {_collective_settings()}")
    print(f"launch order ({_extension.DEPENDENT_LAUNCH_ENV}): {_launch_order()}")
    print("settings:")
    for setting in env_settings.SETTINGS:
        print(f"  {setting.describe()}")
    return 0


def _launch_order() -> str:
    from thunder_tk import _extension

    try:
        dependent = _extension.dependent_launch_from_environment()
    except ValueError as e:
        return f"invalid: {e}"
    return ("programmatically dependent (a kernel set up under the one before it)" if dependent
            else "plain stream order")


def _collective_settings() -> str:
    from thunder_tk.collectives import ChannelConfig

    try:
        c = ChannelConfig.from_env()
    except ValueError as e:
        return f"invalid: {e}"
    text = (f"{c.blocks} blocks, {c.buffer_bytes >> 20} MiB buffer, {c.slots} slots, "
            f"{'paired' if c.pairs else 'unpaired'} blocks, timeout {c.timeout_s:g} s, engine {c.engine}")
    if c.engine != "sm":
        text += (f" ({'from ' + format(c.copy_min_bytes / 2**20, 'g') + ' MiB gathered, ' if c.engine == 'auto' else ''}"
                 f"{c.copy_buffer_bytes >> 20} MiB buffer, {c.copy_slots} slots, {c.copy_reduce_blocks} summing "
                 f"blocks, flags by {c.copy_signal})")
    return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="thunder-tk", description="thunder_tk: Hopper kernels for Lightning Thunder")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("explain", help="plan a LitGPT model's routing (no GPU needed)")
    e.add_argument("model", nargs="?", help=f"LitGPT config name or pretrain YAML (default {DEFAULT_MODEL}, "
                                            f"{DEFAULT_N_LAYER} layers)")
    e.add_argument("--config", help="the same as MODEL, as `thunder-tk pretrain --config` takes it")
    e.add_argument("--n-layer", type=int, help="override the number of layers")
    e.add_argument("--batch", type=int, help="micro-batch size (default: train.micro_batch_size or 1)")
    e.add_argument("--seq", type=int, help="sequence length (default: train.max_seq_length or min(block_size, 2048))")
    e.add_argument("--dtype", choices=tuple(planned_dtypes()),
                   help="weights and compute (bf16-mixed: fp32 weights under bf16 autocast; default: the YAML's "
                        "precision, else bf16)")
    e.add_argument("--inference", action="store_true", help="plan the forward pass only")
    e.add_argument("--cuda-graphs", action="store_true",
                   help="plan the step captured as CUDA graphs (thunder_tk.CUDAGraphs, pretrain's compiler.cuda_graphs): "
                        "the host's calls a step then count graph replays")
    e.add_argument("--device", default="cuda:0")
    e.add_argument("--json", help="also write the report as JSON to this path")
    e.set_defaults(run=_cmd_explain)
    t = sub.add_parser("pretrain", help="pretrain a LitGPT model through Thunder with tk (CPU, one GPU or torchrun)",
                       description="Any config key can be overridden with --key.path value, e.g. --train.max_steps 20.")
    t.add_argument("--config", required=True, help="pretrain YAML (LitGPT schema), e.g. litgpt_configs/tiny.yaml")
    t.add_argument("--resume", nargs="?", const="auto", default=None, metavar="WHEN",
                   help="continue from out_dir's checkpoints: alone or 'auto', the latest if any (else from step 0); "
                        "'true', the latest or an error; a folder, that checkpoint (default: the config's resume)")
    t.add_argument("--no-checkpoint", action="store_true",
                   help="write no checkpoints and no out_dir/final (benchmark runs; a 7B model's are many GB "
                        "per rank)")
    t.set_defaults(run=_cmd_pretrain)
    x = sub.add_parser("export", help="a pretrain run's checkpoint as a LitGPT checkpoint folder (offline, CPU)",
                       description="The run's final model is already in out_dir/final; this exports a resume "
                                   "checkpoint (FSDP shards put together) for LitGPT's generate, chat, finetune, "
                                   "evaluate and convert_from_litgpt.")
    x.add_argument("out_dir", help="the pretrain run's out_dir")
    x.add_argument("--step", type=int, help="the checkpoint of this step (default: the latest)")
    x.add_argument("--to", help="the folder to write (default: out_dir/step-XXXXXXXX, as litgpt pretrain names it)")
    x.set_defaults(run=_cmd_export)
    i = sub.add_parser("info", help="what this install contains")
    i.set_defaults(run=_cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    # Thunder warns at import about optional executors it cannot load; they are irrelevant here.
    warnings.filterwarnings("ignore", message=".*module not found.*")
    args, extra = _parser().parse_known_args(argv)
    if args.command == "pretrain":
        args.overrides = extra
    elif extra:
        print(f"thunder-tk: error: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return 2
    for name in ("n_layer", "batch", "seq", "step"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            print(f"thunder-tk: error: --{name.replace('_', '-')} must be at least 1, got {value}", file=sys.stderr)
            return 2
    try:
        return args.run(args)
    except CLIError as e:
        print(f"thunder-tk: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
