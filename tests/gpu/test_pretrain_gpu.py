"""A short pretraining run of a Llama-3.2-1B-shaped model (2 layers) on one GPU through `thunder-tk pretrain`."""

import json

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("litgpt")

from thunder_tk.pretrain import pretrain  # noqa: E402
from thunder_tk.pretrain_config import load_config  # noqa: E402


@pytest.mark.parametrize("precision", [None, "bf16-mixed"])
def test_llama_3_2_1b_two_layers(tmp_path, precision):
    """Null precision trains bf16 weights; bf16-mixed keeps fp32 weights and Thunder's autocast hands tk bf16
    products: tk claims every bf16 GEMM and the attention either way."""
    config = load_config(None, {
        "model_name": "Llama-3.2-1B", "model_config": None, "out_dir": str(tmp_path), "precision": precision,
        "train": {"global_batch_size": 4, "micro_batch_size": 2, "max_seq_length": 512, "max_steps": 4,
                  "lr_warmup_steps": 1, "log_interval": 1, "save_interval": 2},
    })
    # n_layer=2 through model_config: LitGPT's named config with fewer layers.
    from litgpt import Config
    from dataclasses import asdict

    cfg = asdict(Config.from_name("Llama-3.2-1B", n_layer=2))
    cfg.pop("rope_n_elem", None)
    config.model_config = cfg
    summary = pretrain(config)
    assert summary["steps"] == 4 and summary["device"] != "cpu"
    assert (summary["precision"], summary["parameter_dtype"]) == (
        ("bf16-true", "bfloat16") if precision is None else ("bf16-mixed", "float32"))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert all(r["mfu"] is not None and 0 < r["mfu"] < 1 for r in rows)
    report = json.loads((tmp_path / "explain.json").read_text())
    gemms = [r for r in report["rows"] if r["symbol"] in ("prims.linear", "ltorch.matmul") and "2-D" not in r["reason"]]
    assert any(r["inputs"].startswith("bf16") for r in gemms)
    assert all(r["claimed_by_tk"] for r in gemms if r["inputs"].startswith("bf16"))
    attention = [r for r in report["rows"] if r["symbol"] == "ltorch.scaled_dot_product_attention"]
    assert any(r["claimed_by_tk"] for r in attention), [r["reason"] for r in attention]
    # out_dir/final: the trained weights under LitGPT's keys, bit for bit, which LitGPT's GPT loads and runs
    import torch
    from litgpt import GPT, Config as LitConfig

    exported = torch.load(tmp_path / "final" / "lit_model.pth", weights_only=True)
    trained = torch.load(tmp_path / "checkpoints" / "step-00000004" / "rank0.pt", map_location="cpu",
                         weights_only=False)["model"]
    assert list(exported) == list(trained) and all(torch.equal(exported[k], trained[k]) for k in trained)
    with torch.device("cuda"):
        model = GPT(LitConfig.from_file(tmp_path / "final" / "model_config.yaml"))
    model.load_state_dict(exported, strict=True)
    with torch.no_grad():
        logits = model(torch.randint(model.config.padded_vocab_size, (1, 64), device="cuda"))
    assert logits.shape == (1, 64, model.config.padded_vocab_size) and bool(logits.isfinite().all())


def test_cuda_graphs_train_as_the_op_by_op_step(tmp_path):
    """compiler.cuda_graphs: the step replayed from CUDA graphs gives the op-by-op run's losses, step by step (same
    seed, data and kernels), with validation (a trace without gradients) in graphs of its own."""
    from dataclasses import asdict

    from litgpt import Config

    cfg = asdict(Config.from_name("Llama-3.2-1B", n_layer=2))
    cfg.pop("rope_n_elem", None)
    losses, summaries = [], []
    for graphs in (False, True):
        out = tmp_path / ("graphs" if graphs else "plain")
        config = load_config(None, {
            "model_name": "Llama-3.2-1B", "model_config": cfg, "out_dir": str(out),
            "train": {"global_batch_size": 4, "micro_batch_size": 2, "max_seq_length": 512, "max_steps": 5,
                      "lr_warmup_steps": 1, "log_interval": 1, "save_interval": None},
            "eval": {"interval": 3, "max_iters": 2, "final_validation": True},
            "compiler": {"cuda_graphs": graphs},
        })
        summaries.append(pretrain(config))
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses.append(([r["loss"] for r in rows if "loss" in r], [r["val_loss"] for r in rows if "val_loss" in r]))
    (plain, plain_val), (replayed, replayed_val) = losses
    assert len(plain) == len(replayed) == 5 and len(plain_val) == len(replayed_val) >= 2
    for a, b in zip(replayed + replayed_val, plain + plain_val):
        assert abs(a - b) <= 2e-3 * abs(b), (replayed, plain, replayed_val, plain_val)
    assert summaries[0]["cuda_graphs_captured"] is None
    assert summaries[1]["cuda_graphs_captured"] >= 3  # forward, backward, validation's forward
    # The reserved peak counts the graphs' pool; the graphs report what it holds and what the backward reused.
    plain_summary, graphs_summary = summaries
    assert plain_summary["cuda_graphs_memory_gib"] is None
    assert 0 < plain_summary["peak_memory_gib"] <= plain_summary["peak_reserved_gib"]
    held = graphs_summary["cuda_graphs_memory_gib"]
    assert set(held) >= {"pool", "pool_allocated", "outputs", "input_copies", "saved_reused"}, held
    assert 0 < held["pool_allocated"] <= held["pool"] <= graphs_summary["peak_reserved_gib"], graphs_summary
    assert held["saved_reused"] > 0, held


def test_tk_adamw_with_clipping_trains_as_torch_adamw(tmp_path):
    """train.max_norm with thunder_tk.optim.AdamW (clip_grad_norm_: the norm by tk's sq_norm kernel, the scaling in
    its update) against torch's fused AdamW (pretrain's foreach clip): the same model, data and seed, a max_norm small
    enough to clip every step, five steps: every parameter on tk's kernel, and the losses of the two runs within
    0.1% (the clip factors differ in their last bits: the norms are summed in different orders)."""
    from dataclasses import asdict

    from litgpt import Config

    cfg = asdict(Config.from_name("Llama-3.2-1B", n_layer=2))
    cfg.pop("rope_n_elem", None)
    losses, summaries = [], []
    for class_path in ("thunder_tk.optim.AdamW", "torch.optim.AdamW"):
        out = tmp_path / class_path
        config = load_config(None, {
            "model_name": "Llama-3.2-1B", "model_config": cfg, "out_dir": str(out),
            "train": {"global_batch_size": 4, "micro_batch_size": 2, "max_seq_length": 512, "max_steps": 5,
                      "lr_warmup_steps": 1, "log_interval": 1, "save_interval": None, "max_norm": 0.05},
            "optimizer": {"class_path": class_path, "init_args": {"lr": 1e-3, "fused": True}},
        })
        summaries.append(pretrain(config))
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in rows if "loss" in r])
    tk, torch_ = losses
    assert len(tk) == len(torch_) == 5, losses
    for a, b in zip(tk, torch_):
        assert abs(a - b) <= 1e-3 * abs(b), losses
    report = summaries[0]["optimizer"]
    assert report["tensors_on_tk"] > 0 and report["tensors_on_torch"] == 0, report
