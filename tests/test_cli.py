import json
import subprocess
import sys
from pathlib import Path

import pytest

from thunder_tk.cli import main

pytest.importorskip("litgpt")
CONFIGS = Path(__file__).resolve().parents[1] / "litgpt_configs"


def test_explain_yaml_plans_without_a_gpu(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["explain", str(CONFIGS / "tiny.yaml"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tiny, 2 layers, hidden 256, 4 heads (head_dim 64, 2 kv groups), batch 4 x 256 tokens" in text
    assert "ltorch.scaled_dot_product_attention" in text and "prims.linear" in text
    data = json.loads(out.read_text())
    assert data["planned"] and any(r["trace"] == "backward" for r in data["rows"])
    assert all(r["inputs"].startswith("bf16") for r in data["rows"] if r["symbol"] == "prims.linear")
    # training plans the model with its loss, as `thunder-tk pretrain` runs it
    (loss,) = [r for r in data["rows"] if r["symbol"] == "ltorch.cross_entropy"]
    assert loss["inputs"].startswith("bf16[1024, ") and loss["claimed_by_tk"], loss


def test_explain_takes_the_yaml_as_pretrain_does(capsys):
    """`--config` names the model as `thunder-tk pretrain --config` does; given twice, one message says so."""
    assert main(["explain", "--config", str(CONFIGS / "tiny.yaml"), "--inference"]) == 0
    assert "tiny, 2 layers, hidden 256" in capsys.readouterr().out
    assert main(["explain", "Llama-3.2-1B", "--config", str(CONFIGS / "tiny.yaml")]) == 2
    err = capsys.readouterr().err
    assert "give the model once" in err and "Traceback" not in err


def test_explain_plans_a_yaml_at_its_precision(tmp_path, capsys):
    """A pretrain YAML's precision is what `explain` plans (bf16-mixed: fp32 weights, Thunder's autocast hands the
    linears and the attention bf16 inputs, and the norms stay fp32); --dtype overrides it; an unknown one is named."""
    config = tmp_path / "mixed.yaml"
    config.write_text((CONFIGS / "tiny.yaml").read_text() + "precision: bf16-mixed\n")
    out = tmp_path / "plan.json"
    assert main(["explain", str(config), "--inference", "--json", str(out)]) == 0
    assert "batch 4 x 256 tokens, bf16-mixed, inference" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert all(r["inputs"].startswith("bf16") for r in rows if r["symbol"] == "prims.linear")
    assert any(r["claimed_by_tk"] for r in rows if r["symbol"] == "ltorch.scaled_dot_product_attention")
    config.write_text((CONFIGS / "tiny.yaml").read_text() + "precision: 16-mixed\n")
    assert main(["explain", str(config)]) == 2
    assert "precision '16-mixed' is not one of bf16-true, bf16-mixed, 32-true; pass --dtype" in capsys.readouterr().err


def test_explain_default_model_and_inference(capsys):
    assert main(["explain", "--seq", "128", "--inference"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("Llama-3.2-1B: Llama-3.2-1B, 2 layers, hidden 2048")
    assert "backward" not in text and "cross_entropy" not in text  # inference plans the model alone


def test_explain_plans_the_step_as_cuda_graphs(tmp_path, capsys):
    """--cuda-graphs: the host's calls a step are the graphs' replays; the rows still name tk's ops."""
    out = tmp_path / "plan.json"
    assert main(["explain", str(CONFIGS / "tiny.yaml"), "--cuda-graphs", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "forward: 1 call a step on the host (CUDA graphs 1)" in text
    assert "backward: 1 call a step on the host (CUDA graphs 1)" in text
    rows = json.loads(out.read_text())["rows"]
    assert any(r["ran_by"] == "tk: tk_attention_forward" for r in rows)


@pytest.mark.gemm_size_policy
def test_explain_decoding_leaves_small_gemms_to_cublas_and_says_why(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["explain", "--seq", "16", "--inference", "--json", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["symbol"] == "ltorch.linear"]
    lm_head = [r for r in rows if "128256" in r["inputs"]]
    layers = [r for r in rows if "128256" not in r["inputs"]]
    assert len(lm_head) == 1 and lm_head[0]["claimed_by_tk"]  # the skinny kernel streams it faster than cuBLAS
    assert layers and all(not r["claimed_by_tk"] and "at most 64 rows" in r["reason"] and "gemm_size_policy" in r["reason"]
                          for r in layers), layers


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "NoSuchModel"], "model name 'NoSuchModel' is not a LitGPT config name"),
        (["explain", "missing.yaml"], "config file missing.yaml does not exist"),
        (["explain", "--seq", "0"], "--seq must be at least 1"),
        (["explain", str(CONFIGS / "tiny.yaml"), "--seq", "100000"], "exceeds the model's block_size 256"),
        (["explain", "Mixtral-8x7B-v0.1"], "Mixtral-8x7B-v0.1: model_config.mlp_class_name: LitGPT's "
         "mixture-of-experts MLP (LLaMAMoE)"),
    ],
)
def test_bad_input_is_one_message(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_yaml_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_config:\n  n_layer: 2\n  n_embdd: 64\n")
    assert main(["explain", str(bad)]) == 2
    assert "n_embdd" in capsys.readouterr().err


def test_console_entry_point_has_no_traceback():
    r = subprocess.run([sys.executable, "-m", "thunder_tk.cli", "explain", "NoSuchModel"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "error:" in r.stderr


def test_info(capsys, monkeypatch):
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "executors=[tk] amounts to: ['tk'" in text
    assert "collectives (THUNDER_TK_COLLECTIVE_*): 128 blocks, 64 MiB buffer, 4 slots, paired blocks" in text
    assert "engine sm" in text
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_ENGINE", "auto")
    assert main(["info"]) == 0
    assert "engine auto (from 16 MiB gathered, 256 MiB buffer, 4 slots, 32 summing blocks, flags by write)" in (
        capsys.readouterr().out)
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_BLOCKS", "none")
    assert main(["info"]) == 0
    assert "invalid: THUNDER_TK_COLLECTIVE_BLOCKS='none' is not an integer" in capsys.readouterr().out
    monkeypatch.delenv("THUNDER_TK_DEPENDENT_LAUNCH", raising=False)
    assert main(["info"]) == 0
    assert "launch order (THUNDER_TK_DEPENDENT_LAUNCH): programmatically dependent" in capsys.readouterr().out
    monkeypatch.setenv("THUNDER_TK_DEPENDENT_LAUNCH", "0")
    assert main(["info"]) == 0
    assert "launch order (THUNDER_TK_DEPENDENT_LAUNCH): plain stream order" in capsys.readouterr().out
    monkeypatch.setenv("THUNDER_TK_DEPENDENT_LAUNCH", "sometimes")
    assert main(["info"]) == 0
    assert "invalid: THUNDER_TK_DEPENDENT_LAUNCH='sometimes'" in capsys.readouterr().out


def test_info_lists_every_word_setting_in_effect(capsys, monkeypatch):
    from thunder_tk import env_settings

    for setting in env_settings.SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    monkeypatch.setenv("THUNDER_TK_DQ_ZERO", "Pass")
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_KEEP", "later")
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "THUNDER_TK_DQ_FINALIZE=auto (default; auto | pass | overlap): the attention backward rounds dQ" in text
    assert "THUNDER_TK_DQ_ZERO=pass (set; auto | pass | ahead)" in text
    assert "THUNDER_TK_COLLECTIVE_KEEP: invalid (THUNDER_TK_COLLECTIVE_KEEP='later': expected wait or record)" in text
    assert all(setting.name in text for setting in env_settings.SETTINGS)


def test_a_source_checkout_without_kernels_says_so(tmp_path):
    # Imported from a checkout (pyproject.toml and csrc/ beside the package), thunder_tk shadows the installed
    # build; the reason names the directory and the way out instead of a bare "not installed".
    from thunder_tk import _extension

    package = tmp_path / "thunder_tk"
    package.mkdir()
    assert "not installed with its build step" in _extension._no_build_reason(package)
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "csrc").mkdir()
    reason = _extension._no_build_reason(package)
    assert str(package) in reason and "run from another directory" in reason


def _plan_attention_rows(tmp_path, yaml: str) -> list[dict]:
    config = tmp_path / "model.yaml"
    config.write_text(yaml)
    out = tmp_path / "plan.json"
    assert main(["explain", str(config), "--json", str(out)]) == 0
    return [r for r in json.loads(out.read_text())["rows"] if r["symbol"] == "ltorch.scaled_dot_product_attention"]


def test_explain_plans_a_sliding_window_on_tk(tmp_path):
    """Mistral's sliding window: LitGPT hands SDPA a (1, 1, T, T) mask, which tk reads as a window of 16 keys."""
    rows = _plan_attention_rows(tmp_path, "model_name: Mistral-7B-v0.1\nmodel_config:\n  n_layer: 1\n"
                                          "  sliding_window_size: 16\ntrain:\n  micro_batch_size: 2\n"
                                          "  max_seq_length: 64\n")
    assert rows and all(r["claimed_by_tk"] and "attn_mask read as causal within a window of 16 keys" in r["detail"]
                        for r in rows), rows


def test_explain_says_when_sdpa_cannot_take_a_declined_attention(tmp_path):
    """Phi-3-mini's heads of 96 with a window shorter than the sequence: tk declines the head size, the window stays a
    mask, and Thunder's sdpa executor, whose checker would accept it, fails on a mask broadcast over the batch; the
    plan says so without a GPU."""
    rows = _plan_attention_rows(tmp_path, "model_name: Phi-3-mini-4k-instruct\nmodel_config:\n  n_layer: 1\n"
                                          "  sliding_window_size: 16\ntrain:\n  micro_batch_size: 2\n"
                                          "  max_seq_length: 64\n")
    assert rows and all("head_dim 96" in r["reason"] and "sdpa not used: its memory-efficient kernel needs one batch "
                        "size for q, k, v and the mask (got 2, 2, 2, 1)" in r["reason"] for r in rows), \
        [r["reason"] for r in rows]
