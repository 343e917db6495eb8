"""A short pretraining run of a Llama-3.2-1B-shaped model (2 layers) on one GPU through `thunder-tk pretrain`."""

import json

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("litgpt")

from thunder_tk.pretrain import pretrain  # noqa: E402
from thunder_tk.pretrain_config import load_config  # noqa: E402


def test_llama_3_2_1b_two_layers(tmp_path):
    config = load_config(None, {
        "model_name": "Llama-3.2-1B", "model_config": None, "out_dir": str(tmp_path),
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
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert all(r["mfu"] is not None and 0 < r["mfu"] < 1 for r in rows)
    report = json.loads((tmp_path / "explain.json").read_text())
    gemms = [r for r in report["rows"] if r["symbol"] in ("prims.linear", "ltorch.matmul") and "2-D" not in r["reason"]]
    assert gemms and all(r["claimed_by_tk"] for r in gemms if r["inputs"].startswith("bf16"))
