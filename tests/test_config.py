"""Config loading: YAML + overrides, unknown keys with suggestions, types, and cross-field rules."""

import copy
import os
from pathlib import Path

import pytest
import torch

from lmpretrain.config import config_problems, load_config, parse_overrides
from lmpretrain.errors import ConfigError
from lmpretrain.model.build import build_model, build_model_config
from lmpretrain.preflight import model_problems


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_then_overrides_typed(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: 10\noptim:\n  lr: 1e-3\n")
    cfg = load_config(
        [
            path,
            "--train.max_steps=30",
            "--optim.min_lr",
            "2e-5",
            "--data.shuffle=false",
            "--model.overrides.hidden_size=32",
        ]
    )
    assert cfg.train.max_steps == 30
    assert cfg.optim.lr == pytest.approx(1e-3)  # PyYAML reads 1e-3 as a string; coerced to float
    assert cfg.optim.min_lr == pytest.approx(2e-5)
    assert cfg.data.shuffle is False  # the former boolean, read as "none" by the data stream
    assert cfg.model.overrides == {"hidden_size": 32}
    assert cfg.config_path == path


def test_unknown_keys_and_wrong_types_are_reported_together(tmp_path):
    path = write(tmp_path, "train:\n  max_step: 10\n  micro_batch_size: four\noptim:\n  lrr: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config([path, "--logging.wandb_mod=offline"])
    text = str(err.value)
    assert len(err.value.problems) == 4, text
    assert "unknown key 'train.max_step'; did you mean 'max_steps'?" in text
    assert "unknown key 'optim.lrr'; did you mean 'lr'?" in text
    assert "unknown key 'logging.wandb_mod'; did you mean 'wandb_mode'?" in text
    assert "train.micro_batch_size: expected int, got 'four'" in text


def test_unknown_section_and_source_keys(tmp_path):
    path = write(tmp_path, "trian:\n  max_steps: 1\ndata:\n  train: [{name: python-stdlib, splitt: train}]\n")
    with pytest.raises(ConfigError) as err:
        load_config([path])
    text = str(err.value)
    assert "unknown key 'trian'; did you mean 'train'?" in text
    assert "unknown key 'data.train[0].splitt'; did you mean 'split'?" in text


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="has no value"):
        parse_overrides(["--train.max_steps"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_overrides(["train.max_steps=3"])
    assert parse_overrides(["--a.b=1", "--a.c", "x"]) == {"a": {"b": 1, "c": "x"}}


def test_missing_config_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config([str(tmp_path / "nope.yaml")])


def test_allowed_values_are_checked_with_the_types_and_named_once(tmp_path):
    """Each set of allowed values is a Literal on its field: checked when the config loads."""
    path = write(tmp_path, "train:\n  precision: bf61\nlogging:\n  wandb_mode: cloud\n")
    with pytest.raises(ConfigError) as err:
        load_config([path])
    assert err.value.problems == [
        "train.precision='bf61' must be one of no, bf16, fp16; did you mean 'bf16'?",
        "logging.wandb_mode='cloud' must be one of online, offline, disabled",
    ]


def test_every_cross_field_rule_is_reported_at_once(tmp_path):
    path = write(
        tmp_path,
        "train:\n  max_steps: 10\n  micro_batch_size: 0\n"
        "optim:\n  lr: 1.0e-3\n  min_lr: 1.0e-2\n  warmup_steps: 10\n"
        "data:\n  num_streams: 3\n  seq_len: 1\n",
    )
    problems = config_problems(load_config([path]), world_size=2)
    text = "\n".join(problems)
    assert "train.micro_batch_size must be >= 1" in text
    assert "optim.warmup_steps=10 must be < train.max_steps=10" in text
    assert "optim.min_lr=0.01 must be between 0 and optim.lr=0.001" in text
    assert "data.num_streams=3 must be a multiple of the world size 2" in text
    assert "data.seq_len must be >= 2" in text
    assert len(problems) == 5


def test_workers_bounded_by_streams_per_rank(tmp_path):
    cfg = load_config([write(tmp_path, "data:\n  num_streams: 4\n  num_workers: 3\n")])
    assert any("data.num_workers=3 exceeds the 2 streams" in p for p in config_problems(cfg, world_size=2))
    assert config_problems(cfg, world_size=1) == []


def test_model_rules_seq_len_and_vocab(tmp_path, small_tokenizer):
    cfg = load_config(
        [
            write(
                tmp_path,
                "model:\n  type: llama\n  overrides: {max_position_embeddings: 128, vocab_size: 300}\n"
                "data:\n  seq_len: 256\n",
            )
        ]
    )
    problems = model_problems(cfg, build_model_config(cfg.model), small_tokenizer)
    text = "\n".join(problems)
    assert "data.seq_len=256 exceeds the model's 128 positions" in text
    assert f"has {len(small_tokenizer)} tokens but the model's vocab_size is 300" in text
    assert len(problems) == 2


def test_tokenizer_without_eos_is_a_config_problem(tmp_path, small_tokenizer):
    cfg = load_config([write(tmp_path, "model:\n  overrides: {vocab_size: 512}\n")])
    tokenizer = copy.deepcopy(small_tokenizer)
    tokenizer.eos_token = None
    assert model_problems(cfg, build_model_config(cfg.model), tokenizer) == [
        "tokenizer 'builtin:python-stdlib' has no EOS token; documents cannot be separated"
    ]


def test_gpt2_positions_are_checked_through_the_attribute_map(tmp_path, small_tokenizer):
    cfg = load_config(
        [write(tmp_path, "model:\n  type: gpt2\n  overrides: {n_positions: 64}\ndata:\n  seq_len: 65\n")]
    )
    problems = model_problems(cfg, build_model_config(cfg.model), small_tokenizer)
    assert problems == [
        "data.seq_len=65 exceeds the model's 64 positions "
        "(raise model.overrides.max_position_embeddings / n_positions, or lower data.seq_len)"
    ]


def test_unknown_model_override_names_the_nearest_field(tmp_path):
    cfg = load_config([write(tmp_path, "model:\n  type: llama\n  overrides: {hiden_size: 32}\n")])
    with pytest.raises(ConfigError, match="model.overrides.hiden_size \\(did you mean 'hidden_size'\\?\\)"):
        build_model_config(cfg.model)


def test_a_field_the_model_reads_only_when_set_is_accepted_and_reaches_the_model(tmp_path):
    """Qwen3-MoE's config class has no head_dim, but its attention reads one when a config has it (the Hub's
    Qwen3-30B-A3B sets 128 with hidden 2048 and 32 heads); a misspelling of it is still refused."""
    text = "model:\n  type: qwen3_moe\n  overrides: {hidden_size: 64, num_attention_heads: 4, %s: 32}\n"
    model_config = build_model_config(load_config([write(tmp_path, text % "head_dim")]).model)
    with torch.device("meta"):
        model = build_model(model_config)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)  # not 64 / 4 = 16 per head
    with pytest.raises(ConfigError, match="model.overrides.head_dimm \\(did you mean 'head_dim'\\?\\)"):
        build_model_config(load_config([write(tmp_path, text % "head_dimm")]).model)


def test_overrides_reach_derived_fields(tmp_path):
    """Llama derives head_dim from hidden_size / num_attention_heads in its constructor."""
    cfg = load_config(
        [write(tmp_path, "model:\n  type: llama\n  overrides: {hidden_size: 192, num_attention_heads: 6}\n")]
    )
    model_config = build_model_config(cfg.model)
    assert model_config.head_dim == 32 and model_config.use_cache is False


def test_overrides_on_a_pretrained_config_are_applied_or_refused(tmp_path):
    base = build_model_config(
        load_config(
            [write(tmp_path, "model:\n  overrides: {hidden_size: 64, num_attention_heads: 4}\n")]
        ).model
    )
    base.save_pretrained(tmp_path / "pretrained")
    ok = load_config(
        [
            write(
                tmp_path,
                f"model:\n  pretrained: {tmp_path / 'pretrained'}\n  overrides: {{num_hidden_layers: 3}}\n",
            )
        ]
    )
    config = build_model_config(ok.model)
    assert (config.num_hidden_layers, config.hidden_size, config.use_cache) == (3, 64, False)
    bad = load_config(
        [
            write(
                tmp_path, f"model:\n  pretrained: {tmp_path / 'pretrained'}\n  overrides: {{hiden_size: 3}}\n"
            )
        ]
    )
    with pytest.raises(ConfigError, match="model.overrides.hiden_size \\(did you mean 'hidden_size'\\?\\)"):
        build_model_config(bad.model)


# ---- base: a training YAML on top of another ------------------------------------------------------------------


def test_a_config_inherits_from_its_base_overrides_keys_and_null_deletes_them(tmp_path):
    smoke = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
    (tmp_path / "sub").mkdir()
    child = tmp_path / "sub" / "gpt2.yaml"
    child.write_text(
        f"base: {os.path.relpath(smoke, child.parent)}\n"  # relative to the file itself
        "model:\n  type: gpt2\n  overrides: {num_key_value_heads: null, intermediate_size: null, n_positions: 128}\n"
        "train: {max_steps: 7}\n"
        "eval: {sample_tokens: null}\n"
    )
    cfg = load_config([str(child), "--optim.lr=1e-3"])
    assert cfg.model.type == "gpt2" and cfg.train.max_steps == 7 and cfg.optim.lr == 1e-3
    assert cfg.model.overrides == {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "vocab_size": 8192,
        "tie_word_embeddings": True,
        "n_positions": 128,
    }
    assert cfg.train.micro_batch_size == 4  # from the base
    assert cfg.eval.sample_tokens == 48  # deleted: the field's default
    grandchild = tmp_path / "short.yaml"
    grandchild.write_text("base: sub/gpt2.yaml\ntrain: {max_steps: 3}\n")
    assert load_config([str(grandchild)]).model.type == "gpt2"
    assert load_config([str(grandchild)]).train.max_steps == 3
    overrides = load_config([str(smoke), "--model.overrides.num_key_value_heads=null"]).model.overrides
    assert (
        "num_key_value_heads" not in overrides and overrides["intermediate_size"] == 176
    )  # on the command line too


def test_a_missing_base_and_a_cycle_of_bases_get_one_message_each(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("base: b.yaml\n")
    b.write_text("base: a.yaml\ntrain: {max_steps: 3}\n")
    with pytest.raises(ConfigError) as err:
        load_config([str(a)])
    assert err.value.problems == [f"{b}: its bases form a cycle: {a} -> {b} -> {a}"]
    a.write_text("base: nowhere.yaml\n")
    with pytest.raises(ConfigError) as err:
        load_config([str(a)])
    assert err.value.problems == [f"{a.resolve()}: base {tmp_path / 'nowhere.yaml'} does not exist"]
    a.write_text("base: [b.yaml]\n")
    with pytest.raises(ConfigError, match="base must be the path of another training YAML"):
        load_config([str(a)])


def test_the_former_allow_mismatch_switch_is_refused_with_the_names_it_takes():
    smoke = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
    with pytest.raises(ConfigError) as err:
        load_config([str(smoke), "--run.allow_mismatch=true"])
    (problem,) = err.value.problems
    assert problem.startswith(
        "run.allow_mismatch=True is no longer a switch: it takes the names of the resume"
    )
    assert (
        "from: sources, tokenizer, add_bos, epoch_offset, seq_len," in problem
        and "micro_batch_size" in problem
    )
    assert load_config([str(smoke), "--run.allow_mismatch=[seq_len]"]).run.allow_mismatch == ["seq_len"]


@pytest.mark.parametrize(
    "written,mode",
    [("false", "none"), ("true", "full"), ("none", "none"), ("full", "full"), ("selective", "selective")],
)
def test_activation_checkpointing_reads_a_mode_and_the_former_booleans(tmp_path, written, mode):
    """In the YAML and on the command line alike; the rest of the code (and config.yaml, W&B) sees the mode."""
    path = write(tmp_path, f"train:\n  activation_checkpointing: {written}\n")
    assert load_config([path]).train.activation_checkpointing == mode
    assert (
        load_config(
            [write(tmp_path, ""), f"--train.activation_checkpointing={written}"]
        ).train.activation_checkpointing
        == mode
    )


def test_an_unknown_activation_checkpointing_mode_is_one_problem_naming_the_modes(tmp_path):
    for written, hint in (("selectve", "; did you mean 'selective'?"), ("2", "")):
        with pytest.raises(ConfigError) as err:
            load_config([write(tmp_path, ""), f"--train.activation_checkpointing={written}"])
        value = repr(written) if written == "selectve" else written
        assert err.value.problems == [
            f"train.activation_checkpointing={value} must be one of none, full, selective{hint}"
        ]
