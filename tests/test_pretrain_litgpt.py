"""`thunder-tk pretrain` and the rest of LitGPT: it starts from LitGPT checkpoint folders (`initial_checkpoint_dir`)
and ends in one (`out_dir/final`, and `thunder-tk export` for any checkpoint) that LitGPT's own generate and
conversion read; LitGPT's pretrain keys (`resume`, `tokenizer_dir`, `data` as LitGPT's TextFiles,
`train.tie_embeddings`, `train.lr_warmup_fraction`, `train.max_time`, `eval.initial_validation`,
`eval.final_validation`) do what LitGPT says they do, and its initialisation is drawn."""

import json
import types
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("litgpt")

from thunder_tk.cli import main  # noqa: E402
from thunder_tk.litgpt_checkpoint import load_initial_weights  # noqa: E402
from thunder_tk.litgpt_models import ConfigError, init_like_litgpt_pretrain  # noqa: E402
from thunder_tk.pretrain import pretrain  # noqa: E402
from thunder_tk.pretrain_config import load_config  # noqa: E402

MICRO_MODEL = {"name": "micro", "block_size": 32, "vocab_size": 128, "padded_vocab_size": 128, "n_layer": 1,
               "n_head": 2, "n_query_groups": 2, "n_embd": 64, "head_size": 32, "bias": False,
               "norm_class_name": "RMSNorm", "mlp_class_name": "LLaMAMLP", "intermediate_size": 128}
TRAIN = {"global_batch_size": 4, "micro_batch_size": 2, "max_seq_length": 32, "max_steps": 2,
         "lr_warmup_steps": 1, "log_interval": 1}
EAGER = {"jit": False}  # where Thunder is not the point: seconds instead of a trace


def _config(out_dir: Path, **fields) -> dict:
    train = {**TRAIN, **fields.pop("train", {})}
    return {"model_config": MICRO_MODEL, "out_dir": str(out_dir), "train": train, **fields}


def _rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _word_tokenizer(folder: Path, text: str) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder.mkdir()
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


@pytest.fixture
def corpus(tmp_path):
    text = " ".join(["the cat sat on the mat and a dog ran far away"] * 40)
    (tmp_path / "corpus.txt").write_text(text)
    return tmp_path / "corpus.txt", _word_tokenizer(tmp_path / "tok", text)


def test_the_final_folder_is_a_litgpt_checkpoint_that_litgpt_generates_from(tmp_path, corpus, capsys):
    """Through Thunder with tk: out_dir/final holds the trained weights bit for bit under LitGPT's keys, LitGPT's
    model config, the tokenizer (LitGPT's top-level tokenizer_dir) and the run's config; LitGPT's generate and its
    conversion to Hugging Face names take the folder as it is."""
    text, tok = corpus
    out = tmp_path / "run"
    pretrain(load_config(None, _config(out, data={"kind": "text", "paths": [str(text)]}, tokenizer_dir=str(tok),
                                       train={"save_interval": 1})))
    final = out / "final"
    assert sorted(p.name for p in final.iterdir()) == ["hyperparameters.yaml", "lit_model.pth", "model_config.yaml",
                                                       "tokenizer.json", "tokenizer_config.json"]
    from litgpt import GPT, Config

    config = Config.from_file(final / "model_config.yaml")
    assert config.n_embd == MICRO_MODEL["n_embd"] and config.n_layer == MICRO_MODEL["n_layer"]
    exported = torch.load(final / "lit_model.pth", weights_only=True)
    GPT(config).load_state_dict(exported, strict=True)
    trained = torch.load(out / "checkpoints" / "step-00000002" / "rank0.pt", weights_only=False)["model"]
    assert list(exported) == list(trained)
    for k in trained:
        assert torch.equal(exported[k], trained[k]), k
    assert yaml.safe_load((final / "hyperparameters.yaml").read_text())["tokenizer_dir"] == str(tok)

    from litgpt.generate.base import main as generate
    from litgpt.scripts.convert_lit_checkpoint import convert_lit_checkpoint

    capsys.readouterr()
    torch.manual_seed(0)
    generate(final, prompt="the cat", max_new_tokens=4, precision="32-true", top_k=1)
    said = capsys.readouterr().out.strip().splitlines()[-1].split()  # after LitGPT's echo of its arguments
    assert said[:2] == ["the", "cat"], said  # the prompt and what the model made of it, decoded
    convert_lit_checkpoint(final, tmp_path / "hf")
    hf = torch.load(tmp_path / "hf" / "model.pth", weights_only=True)
    assert torch.equal(hf["model.embed_tokens.weight"], exported["transformer.wte.weight"])

    # `thunder-tk export`: a resume checkpoint as such a folder, offline (the last one: the final weights)
    assert main(["export", str(out)]) == 0
    assert f"LitGPT checkpoint: {out / 'step-00000002'}" in capsys.readouterr().out
    again = torch.load(out / "step-00000002" / "lit_model.pth", weights_only=True)
    assert list(again) == list(exported) and all(torch.equal(again[k], exported[k]) for k in exported)
    assert (out / "step-00000002" / "tokenizer.json").is_file()
    assert main(["export", str(out), "--step", "1", "--to", str(tmp_path / "first")]) == 0
    first = torch.load(tmp_path / "first" / "lit_model.pth", weights_only=True)
    GPT(config).load_state_dict(first, strict=True)
    assert not torch.equal(first["lm_head.weight"], exported["lm_head.weight"])  # a step earlier
    assert main(["export", str(out), "--step", "7"]) == 2
    assert "--step 7: " in (err := capsys.readouterr().err) and "step-00000001, step-00000002" in err
    assert main(["export", str(tmp_path / "tok")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_initial_checkpoint_dir_starts_from_its_weights_and_gives_the_model(tmp_path, monkeypatch):
    """A run from another run's final folder (looked for under checkpoints/ as LitGPT does, its model from the
    folder's model_config.yaml) starts from those weights: with a learning rate of 0 it ends where it began, and its
    first loss is the trained model's, below a fresh model's."""
    first = tmp_path / "first"
    pretrain(load_config(None, _config(first, compiler=EAGER, optimizer={"init_args": {"lr": 3e-3}},
                                       train={"max_steps": 8})))
    (tmp_path / "checkpoints").mkdir()
    (first / "final").rename(tmp_path / "checkpoints" / "trained")
    monkeypatch.chdir(tmp_path)
    frozen = tmp_path / "frozen"
    config = load_config(None, {"initial_checkpoint_dir": "trained", "out_dir": str(frozen), "train": TRAIN,
                                "optimizer": {"init_args": {"lr": 0.0}}})
    assert config.model_name is None and config.model_config is None
    pretrain(config)
    before = torch.load(tmp_path / "checkpoints" / "trained" / "lit_model.pth", weights_only=True)
    after = torch.load(frozen / "final" / "lit_model.pth", weights_only=True)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    fresh = tmp_path / "fresh"
    pretrain(load_config(None, _config(fresh, compiler=EAGER, optimizer={"init_args": {"lr": 0.0}})))
    assert [r["loss"] for r in _rows(frozen)][0] < [r["loss"] for r in _rows(fresh)][0] - 0.5


def test_initial_checkpoint_problems_name_the_key(tmp_path):
    from litgpt import GPT, Config

    config = Config(**MICRO_MODEL)
    model = GPT(config)
    with pytest.raises(ConfigError, match="initial_checkpoint_dir: .*missing is not a folder"):
        load_initial_weights(model, tmp_path / "missing", config)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="initial_checkpoint_dir: .* has no lit_model.pth"):
        load_initial_weights(model, tmp_path / "empty", config)
    other = tmp_path / "other"
    other.mkdir()
    torch.save(model.state_dict(), other / "lit_model.pth")
    (other / "model_config.yaml").write_text(yaml.dump({**MICRO_MODEL, "n_layer": 3}))
    with pytest.raises(ConfigError, match="initial_checkpoint_dir: .*model_config.yaml has n_layer 3, the run's "
                                          "model 1"):
        load_initial_weights(model, other, config)
    (other / "model_config.yaml").unlink()
    state = model.state_dict()
    torch.save({k: v for k, v in state.items() if k != "lm_head.weight"}, other / "lit_model.pth")
    with pytest.raises(ConfigError, match="1 of the model's tensors missing \\(first 'lm_head.weight'\\)"):
        load_initial_weights(model, other, config)
    torch.save({**state, "lm_head.weight": torch.zeros(3, 3)}, other / "lit_model.pth")
    with pytest.raises(ConfigError, match="has lm_head.weight of shape \\(3, 3\\), the run's model \\(128, 64\\)"):
        load_initial_weights(model, other, config)
    (other / "lit_model.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="lit_model.pth cannot be read"):
        load_initial_weights(model, other, config)
    # LitGPT pretrain's own checkpoints hold {"model": ..., "optimizer": ...}: the model is read from them
    torch.save({"model": state, "iter_num": 3}, other / "lit_model.pth")
    load_initial_weights(GPT(config), other, config)
    with pytest.raises(ConfigError, match="model_name: give model_name or model_config .*model_config.yaml does "
                                          "not exist"):
        load_config(None, {"initial_checkpoint_dir": str(other), "train": TRAIN})


def test_resume_values(tmp_path, capsys):
    """resume: true needs a checkpoint, auto takes one if there is one, a folder is that checkpoint; a checkpoint of
    another number of processes is refused."""
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="resume: true, but .* holds no checkpoint"):
        pretrain(load_config(None, _config(out, compiler=EAGER, resume=True)))
    pretrain(load_config(None, _config(out, compiler=EAGER, resume="auto", train={"save_interval": 1})))
    assert "starting from step 0" in capsys.readouterr().out
    again = pretrain(load_config(None, _config(out, compiler=EAGER, train={"max_steps": 3})),
                     resume=str(out / "checkpoints" / "step-00000001"))
    assert again["steps"] == 3 and [r["step"] for r in _rows(out)][-2:] == [2, 3]
    two = tmp_path / "two" / "checkpoints" / "step-00000001"
    two.mkdir(parents=True)
    for rank in (0, 1):
        (two / f"rank{rank}.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="holds 2 rank files, written by that many processes; this run has 1"):
        pretrain(load_config(None, _config(tmp_path / "two", compiler=EAGER)), resume=str(two))
    # the command line: --resume alone is auto, --resume true the strict form
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(_config(tmp_path / "cli", compiler=EAGER)))
    assert main(["pretrain", "--config", str(config), "--resume", "true"]) == 2
    assert "resume: true, but" in capsys.readouterr().err
    assert main(["pretrain", "--config", str(config), "--resume"]) == 0


def test_tied_embeddings_train_as_one_weight_through_thunder(tmp_path):
    out = tmp_path / "tied"
    pretrain(load_config(None, _config(out, train={"tie_embeddings": True})))
    state = torch.load(out / "final" / "lit_model.pth", weights_only=True)
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    untied = tmp_path / "untied"
    pretrain(load_config(None, _config(untied)))
    state = torch.load(untied / "final" / "lit_model.pth", weights_only=True)
    assert not torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])


def test_lr_warmup_fraction_is_a_fraction_of_an_epoch(tmp_path, corpus):
    text, tok = corpus
    data = {"kind": "text", "paths": [str(text)], "tokenizer_dir": str(tok)}
    out = tmp_path / "run"
    # 40 x 11 words + bos/eos = 442 tokens, 34 held out for validation: 12 samples of 32 an epoch, 3 steps of 4;
    # a fraction of 0.5 warms up over ceil(1.5) = 2 steps
    pretrain(load_config(None, _config(out, data=data, compiler=EAGER, optimizer={"init_args": {"lr": 1e-3}},
                                       train={"lr_warmup_steps": 0, "lr_warmup_fraction": 0.5, "max_steps": 4})))
    lrs = [r["lr"] for r in _rows(out)]
    assert lrs[:2] == pytest.approx([0.5e-3, 1e-3])
    with pytest.raises(ConfigError, match="train.lr_warmup_fraction: give it or train.lr_warmup_steps, not both"):
        load_config(None, _config(out, data=data, train={"lr_warmup_fraction": 0.5, "lr_warmup_steps": 2}))
    with pytest.raises(ConfigError, match="the synthetic stream has no epochs"):
        load_config(None, _config(out, train={"lr_warmup_fraction": 0.5, "lr_warmup_steps": 0}))
    with pytest.raises(ConfigError, match="train.lr_warmup_fraction: must be between 0 and 1"):
        load_config(None, _config(out, data=data, train={"lr_warmup_fraction": 2.0, "lr_warmup_steps": 0}))
    assert load_config(None, _config(out, train={"lr_warmup_steps": None})).train.lr_warmup_steps is None


def test_max_time_stops_after_a_step_and_saves(tmp_path):
    out = tmp_path / "run"
    summary = pretrain(load_config(None, _config(out, compiler=EAGER, train={"max_steps": 50, "max_time": 1e-9})))
    assert summary["steps"] == 1 and summary["stopped_by"] == "train.max_time"
    assert [r["step"] for r in _rows(out)] == [1]
    assert (out / "final" / "lit_model.pth").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000001"
    with pytest.raises(ConfigError, match="train.max_time: must be above 0 seconds"):
        load_config(None, _config(out, train={"max_time": 0}))


def test_initial_and_final_validation(tmp_path):
    out = tmp_path / "run"
    summary = pretrain(load_config(None, _config(out, eval={"initial_validation": True, "final_validation": True})))
    rows = [r for r in _rows(out) if "val_loss" in r]
    assert [(r["step"], r.get("initial"), r.get("final")) for r in rows] == [(0, True, None), (2, None, True)]
    assert summary["final_val_loss"] == rows[-1]["val_loss"] < rows[0]["val_loss"]


def test_weights_are_drawn_as_litgpt_pretrain_draws_them():
    """The same seed, the same weights as LitGPT's own pretrain initialisation (GPT-NeoX's scheme)."""
    from litgpt import GPT, Config
    from litgpt.pretrain import initialize_weights

    config = Config(**{**MICRO_MODEL, "n_layer": 2, "bias": True})
    torch.manual_seed(3)
    theirs = GPT(config)
    torch.manual_seed(5)
    initialize_weights(types.SimpleNamespace(strategy=None), theirs, config.n_layer, config.n_embd)
    torch.manual_seed(3)
    ours = GPT(config)
    torch.manual_seed(5)
    init_like_litgpt_pretrain(ours, config)
    a, b = theirs.state_dict(), ours.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert float(b["transformer.wte.weight"].std()) == pytest.approx((2 / 5 / 64) ** 0.5, rel=0.05)


def test_litgpt_textfiles_data_and_held_out_validation(tmp_path, corpus):
    """LitGPT's TextFiles form reads a folder's .txt files (the first held out for validation, as LitGPT does, or
    val_data_path's); LitGPT's modules that read prepared datasets are refused by name; validation never reads the
    training text."""
    _, tok = corpus
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text(" ".join(["a dog ran far away"] * 20))
    (folder / "b.txt").write_text(" ".join(["the cat sat on the mat"] * 20))
    data = {"class_path": "litgpt.data.TextFiles", "init_args": {"train_data_path": str(folder)}}
    config = load_config(None, _config(tmp_path / "out", data=data, tokenizer_dir=str(tok)))
    assert (config.data.kind, config.data.paths, config.data.val_paths) == (
        "text", [str(folder / "b.txt")], [str(folder / "a.txt")])
    summary = pretrain(load_config(None, _config(tmp_path / "out", data=data, tokenizer_dir=str(tok),
                                                 compiler=EAGER, eval={"final_validation": True})))
    assert summary["final_val_loss"] is not None
    from thunder_tk.data import TextFiles

    words = TextFiles(config.data.paths, str(tok), 8, val_paths=config.data.val_paths)
    from litgpt import Tokenizer

    tokenizer = Tokenizer(tok)
    assert "dog" in tokenizer.decode(words.validation.sample(0)) and "dog" not in tokenizer.decode(words.sample(0))
    tail = TextFiles([str(folder / "b.txt"), str(folder / "a.txt")], str(tok), 8, val_fraction=0.2)
    # (6 x 20 + 2) + (5 x 20 + 2) tokens with bos and eos, the last ceil(0.2 x 224) held out
    assert (tail.tokens.numel(), tail.validation.tokens.numel()) == (224 - 45, 45)
    assert "dog" in tokenizer.decode(tail.validation.sample(0))  # the last fifth: a.txt's words
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "b.txt").write_text("the cat")
    with pytest.raises(ConfigError, match="data.init_args.train_data_path: LitGPT's TextFiles without val_data_path "
                                          "holds the first of at least two .txt files out"):
        load_config(None, _config(tmp_path, data={"class_path": "litgpt.data.TextFiles",
                                                  "init_args": {"train_data_path": str(tmp_path / "one")}}))
    with pytest.raises(ConfigError, match="data: LitGPT's TinyLlama data module reads a prepared dataset"):
        load_config(None, _config(tmp_path, data="TinyLlama"))
    with pytest.raises(ConfigError, match="data.init_args.shuffle: not an argument of LitGPT's TextFiles"):
        load_config(None, _config(tmp_path, data={"class_path": "litgpt.data.TextFiles",
                                                  "init_args": {"train_data_path": str(folder), "shuffle": True}}))
    with pytest.raises(ConfigError, match="train.learning_rate: unknown key .*optimizer.init_args.lr"):
        load_config(None, _config(tmp_path, train={"learning_rate": 4e-4}))


def test_a_continued_run_reads_the_initial_checkpoint_s_tokenizer(tmp_path, corpus):
    """Text data with no tokenizer named reads the initial checkpoint's (a `litgpt download` folder holds the
    model's), which the new final folder carries on; a folder without one, or without a tokenizer file, is one
    message."""
    text, tok = corpus
    data = {"kind": "text", "paths": [str(text)]}
    first = tmp_path / "first"
    pretrain(load_config(None, _config(first, data={**data, "tokenizer_dir": str(tok)}, compiler=EAGER)))
    second = tmp_path / "second"
    pretrain(load_config(None, {"initial_checkpoint_dir": str(first / "final"), "out_dir": str(second),
                                "train": TRAIN, "data": data, "compiler": EAGER}))
    assert (second / "final" / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    (first / "final" / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="data.tokenizer_dir: text data needs a tokenizer, and .* has no "
                                          "tokenizer.json or tokenizer.model"):
        pretrain(load_config(None, {"initial_checkpoint_dir": str(first / "final"), "out_dir": str(tmp_path / "x"),
                                    "train": TRAIN, "data": data, "compiler": EAGER}))
    with pytest.raises(ConfigError, match="has no tokenizer.json or tokenizer.model \\(LitGPT's Tokenizer"):
        pretrain(load_config(None, _config(tmp_path / "y", data={**data, "tokenizer_dir": str(tmp_path)},
                                           compiler=EAGER)))


def test_exponent_numbers_as_litgpt_writes_them(tmp_path):
    """PyYAML reads `3e-4` as a string (YAML 1.1 floats need a dot); LitGPT's configs and command lines write
    numbers so, and they are read as numbers, in typed keys and in model_config and optimizer.init_args alike."""
    from thunder_tk.pretrain_config import parse_overrides

    path = tmp_path / "c.yaml"
    path.write_text("model_config:\n  name: micro\n  n_layer: 1\n  n_embd: 64\n  n_head: 2\n  norm_eps: 1e-5\n"
                    "train:\n  max_steps: 2\n  min_lr: 4e-5\noptimizer:\n  class_path: torch.optim.AdamW\n"
                    "  init_args:\n    lr: 3e-4\n    betas: [9e-1, 0.95]\n")
    config = load_config(path, parse_overrides(["--train.max_time", "1e-9"]))
    assert (config.train.min_lr, config.train.max_time) == (4e-5, 1e-9)
    assert config.model_config["norm_eps"] == 1e-5
    assert config.optimizer.init_args == {"lr": 3e-4, "betas": [0.9, 0.95]}
