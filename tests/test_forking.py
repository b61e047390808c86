"""A fork adds files, never edits ours (docs/forking.md): a custom architecture through model.imports,
an extra loss term with a config section of its own, an auxiliary module left out of the export."""

import json
import re
import signal
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import recipe_runner as rr
from lmpretrain.config import load_config
from lmpretrain.data import TrainStream, load_tokenizer
from lmpretrain.errors import ConfigError
from lmpretrain.layout import Layout
from lmpretrain.model import (
    build_model,
    build_model_config,
    import_model_modules,
    make_labels,
    refuse_unfound_embedding,
)

FORKS = Path(__file__).parent / "forks"
sys.path.insert(0, str(FORKS))
from pretrain_mtp import MTPConfig, MTPObjective  # noqa: E402

TINYBLOCK = FORKS / "tinyblock.py"


# ---- a fork's own config section ----------------------------------------------------------------------------


def test_a_fork_section_gets_overrides_type_checks_and_did_you_mean(tmp_path):
    cfg = load_config([str(rr.SMOKE), "--mtp.weight=0.5"], sections={"mtp": MTPConfig})
    assert cfg.mtp.weight == 0.5
    assert cfg.to_dict()["mtp"] == {"weight": 0.5}  # what config.yaml and W&B's config receive
    assert load_config([str(rr.SMOKE)], sections={"mtp": MTPConfig}).mtp.weight == 0.1  # the default
    with pytest.raises(ConfigError) as err:
        load_config([str(rr.SMOKE), "--mtp.wieght=1", "--mtp.weight=heavy"], sections={"mtp": MTPConfig})
    assert err.value.problems == [
        "unknown key 'mtp.wieght'; did you mean 'weight'?",
        "mtp.weight: expected float, got 'heavy' (str)",
    ]
    with pytest.raises(ConfigError, match="unknown key 'mtp'"):  # the recipe itself has no such section
        load_config([str(rr.SMOKE), "--mtp.weight=0.5"])
    with pytest.raises(ConfigError, match="cannot reuse the name of a built-in one: train"):
        load_config([str(rr.SMOKE)], sections={"train": MTPConfig})


# ---- an extra loss term: trained, reduced over ranks and micro-batches, logged, equal to a hand computation ---


@pytest.fixture(scope="module")
def mtp_run(tmp_path_factory):
    """The MTP fork on 2 gloo ranks x micro-batch 2 x accumulation 2, float64, a checkpoint after each step."""
    return rr.run(
        tmp_path_factory.mktemp("mtp") / "run",
        *rr.QUICK,
        "--mtp.weight=0.3",
        "--train.max_steps=2",
        "--optim.warmup_steps=1",
        "--train.micro_batch_size=2",
        "--train.grad_accum_steps=2",
        "--train.param_dtype=float64",
        "--checkpoint.every=1",
        "--checkpoint.keep_last=3",
        "--eval.every=0",
        "--logging.every=1",
        "--logging.wandb_mode=disabled",
        launch="cpu-ddp",
        recipe=FORKS / "pretrain_mtp.py",
    )


@pytest.mark.slow
def test_an_extra_term_equals_its_hand_computation_on_2_ranks_with_accumulation(mtp_run):
    """Step 2's logged terms, recomputed here from step 1's checkpoint and step 2's global batch."""
    out = mtp_run.out
    cfg = load_config([str(out / "config.yaml")], sections={"mtp": MTPConfig})
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model = build_model(build_model_config(cfg.model, tokenizer), dtype="float64")
    objective = MTPObjective.from_config(cfg, tokenizer.eos_token_id)
    objective.install(model)
    saved = load_file(out / "checkpoints" / "step-00000001" / "model.safetensors")
    assert "mtp_proj.weight" in saved  # the auxiliary module is checkpointed
    missing, unexpected = model.load_state_dict(saved, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # tied to the input embedding
    stream = TrainStream(
        cfg.data, tokenizer, blocks_per_step=cfg.global_batch(2), rank=0, world_size=1, seed=1337
    )
    batches = iter(stream)
    next(batches)
    ids = next(batches).input_ids  # step 2's global batch, all 8 rows
    stream.close()
    labels = make_labels(ids)
    with torch.no_grad():
        terms = objective(model, ids, labels)
    by_hand = {name: (term.sum / term.count).item() for name, term in terms.items()}
    logged = next(r for r in mtp_run.metrics() if r["step"] == 2)
    assert logged["train/mtp"] == pytest.approx(by_hand["mtp"], rel=1e-10)
    assert logged["train/loss"] == pytest.approx(by_hand["loss"], rel=1e-10)
    assert "| mtp " in mtp_run.output  # the console line shows the term
    extra = 64 * 64 + 8192 * 64  # mtp_proj, and the tied output embedding's second pass
    assert f"+ 6 x {extra:,} weights of the objective's auxiliary modules)" in mtp_run.output  # FLOPs, MFU
    assert yaml.safe_load((out / "config.yaml").read_text())["mtp"] == {"weight": 0.3}


@pytest.mark.slow
def test_an_auxiliary_module_is_left_out_of_the_export(mtp_run):
    model, info = LlamaForCausalLM.from_pretrained(mtp_run.out / "final", output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    assert not any("mtp" in name for name, _ in model.named_parameters())


@pytest.mark.slow
def test_runs_record_which_recipe_and_commit_trained_them(mtp_run):
    made = yaml.safe_load((mtp_run.out / "config.yaml").read_text())["provenance"]
    assert made["recipe"] == str(FORKS / "pretrain_mtp.py")
    assert made["recipe_sha256"] == rr.file_sha256(FORKS / "pretrain_mtp.py")
    assert set(made["versions"]) == {"python", "torch", "transformers", "accelerate", "datasets"}
    meta = yaml.safe_load((mtp_run.out / "checkpoints" / "step-00000002" / "meta.json").read_text())
    assert meta["provenance"] == made


# ---- a custom architecture, registered by a module the config names ------------------------------------------


def tinyblock_config(tmp_path) -> Path:
    """configs/smoke.yaml with the model section of a `tinyblock`, the architecture of tests/forks/tinyblock.py
    (as docs/models.md writes it: `base:` and null for the smoke model's fields a tinyblock lacks)."""
    path = tmp_path / "tinyblock.yaml"
    path.write_text(
        f"base: {rr.SMOKE}\n"
        "model:\n"
        "  type: tinyblock\n"
        f"  imports: [{TINYBLOCK}]\n"
        "  overrides: {hidden_size: 32, num_attention_heads: 2, intermediate_size: null,\n"
        "              num_key_value_heads: null, max_position_embeddings: null, tie_word_embeddings: null}\n"
    )
    assert load_config([str(path)]).model.overrides == {
        "vocab_size": 8192,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
    }
    return path


@pytest.mark.slow
def test_a_custom_model_trains_resumes_bit_identically_after_kill_9_exports_and_loads(tmp_path):
    config = tinyblock_config(tmp_path)
    args = [*rr.QUICK, "--train.max_steps=12", "--checkpoint.every=4", "--eval.every=4"]
    straight = rr.run(tmp_path / "straight", *args, config=config)
    assert "TinyBlockForCausalLM" in straight.output
    out = tmp_path / "killed"
    with open(tmp_path / "killed.log", "w") as log:
        proc = rr.start_forked(out, *args, config=config, log=log)
        rr.wait_for_step(proc, out, 6)
        rr.kill_tree(proc, signal.SIGKILL)
        proc.wait(timeout=120)
    assert rr.read_metrics(out)[-1]["step"] < 12, "the run finished before it could be killed"
    resumed = rr.run(out, *args, config=config)
    assert "resumed from" in resumed.output
    assert rr.file_sha256(straight.out / "final" / "model.safetensors") == rr.file_sha256(
        out / "final" / "model.safetensors"
    )
    import tinyblock  # noqa: F401  (registers the architecture, as model.imports did in the run)

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert type(model).__name__ == "TinyBlockForCausalLM"
    assert rr.rel_diff(dict(model.state_dict()), resumed.weights()) == 0


@pytest.mark.slow
def test_an_unknown_model_type_names_the_nearest_and_how_to_register(tmp_path):
    run = rr.run(tmp_path / "x", "--model.type=lama", check=False, launch=None)
    assert run.returncode == 2
    assert "model.type='lama' is not a registered model type (nearest: llama" in run.output
    assert "AutoModelForCausalLM.register in a module and list it in model.imports" in run.output


@pytest.mark.slow
def test_a_missing_piece_of_the_model_contract_is_named_before_any_work(tmp_path):
    run = rr.run(
        tmp_path / "x", "--train.activation_checkpointing=true", config=tinyblock_config(tmp_path), check=False,
        launch=None,
    )  # fmt: skip
    assert run.returncode == 2
    assert "TinyBlockForCausalLM.supports_gradient_checkpointing is not true" in run.output
    assert "parameters; optimizer groups" not in run.output  # refused before the model was built


def test_fsdp2_and_mup_refuse_a_model_whose_input_embedding_transformers_cannot_find(tmp_path, monkeypatch):
    """accelerate's FSDP2 wrapping and μP ask get_input_embeddings(), which finds only `embed_tokens` (or the
    class's _input_embed_layer): tinyblock names its `embed`; without that, both are refused by name."""
    cfg = load_config([str(tinyblock_config(tmp_path))])
    import_model_modules(cfg.model)
    model = build_model(build_model_config(cfg.model))
    fsdp2, ddp = Layout(kind="fsdp2", num_processes=2), Layout(kind="ddp", num_processes=2)
    refuse_unfound_embedding(model, cfg, fsdp2)
    assert model.get_input_embeddings() is model.model.embed
    monkeypatch.delattr(type(model).__mro__[1], "_input_embed_layer")  # TinyBlockPreTrainedModel's
    refuse_unfound_embedding(model, cfg, ddp)  # DDP without μP never asks
    with pytest.raises(ConfigError) as refused:
        refuse_unfound_embedding(model, cfg, fsdp2)
    assert (
        "TinyBlockForCausalLM.get_input_embeddings() does not find the input embedding, which FSDP2"
        in str(refused.value)
    )
    assert "set _input_embed_layer = '<its attribute name>'" in str(refused.value)
    with pytest.raises(ConfigError, match=r"which model\.mup \(the embedding keeps its init and lr\) needs"):
        refuse_unfound_embedding(
            model, load_config([str(tinyblock_config(tmp_path)), "--model.mup.base_width=32"]), ddp
        )


# ---- a data fork: a transform named in data.transforms -------------------------------------------------------

LOWERCASE_LONG = "examples/data_transforms.py:keep_long_lowercased"
DEDUP = "examples/data_transforms.py:ExactDedup"


def two_corpora(tmp_path) -> str:
    """A two-corpus mixture: 300 distinct documents, and 150 others each 5 times in a row (one file each: one
    piece that the 4 streams share, each keeping every 4th document, so each stream meets copies); 250
    characters a document, so the streams read several 8-document windows before a checkpoint."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    distinct = [f"Text{i} " + " ".join(words[(i * k) % 8] for k in range(45)) for i in range(300)]
    copies = [f"Doc{i} " + "word " * 50 for i in range(150) for _ in range(5)]
    for name, docs in (("distinct", distinct), ("dups", copies)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return (
        f"--data.train=[{{files: [{tmp_path / 'distinct.jsonl'}]}}, {{files: [{tmp_path / 'dups.jsonl'}]}}]"
    )


@pytest.mark.slow
def test_a_stateful_dedup_transform_resumes_bit_identically_after_kill_9_and_a_changed_one_is_refused(
    tmp_path,
):
    """A filter and a dedup that keeps state (examples/data_transforms.py) on a two-source mixture: a run
    killed with SIGKILL at step 6 and resumed ends with the straight run's weights and drop counts."""
    transforms = f"--data.transforms=[{LOWERCASE_LONG}, {DEDUP}]"
    args = [*rr.QUICK, transforms, two_corpora(tmp_path), "--train.max_steps=12", "--checkpoint.every=4"]
    args += ["--eval.every=4", "--logging.wandb_mode=disabled"]
    straight = rr.run(tmp_path / "straight", *args)
    assert f"transforms: {LOWERCASE_LONG} -> {DEDUP} (state kept per stream: {DEDUP})" in straight.output
    out = tmp_path / "killed"
    with open(tmp_path / "killed.log", "w") as log:
        proc = rr.start_forked(out, *args, log=log)
        rr.wait_for_step(proc, out, 6)
        rr.kill_tree(proc, signal.SIGKILL)
        proc.wait(timeout=120)
    assert rr.read_metrics(out)[-1]["step"] < 12, "the run finished before it could be killed"
    resumed = rr.run(out, *args)
    assert "resumed from" in resumed.output
    assert rr.file_sha256(straight.out / "final" / "model.safetensors") == rr.file_sha256(
        out / "final" / "model.safetensors"
    )
    counted = {r["step"]: r["train/filtered_docs"] for r in straight.metrics() if "train/filtered_docs" in r}
    assert len(counted) == 12 and counted[4] > 0  # short documents and copies were dropped, and counted
    assert {r["step"]: r["train/filtered_docs"] for r in rr.read_metrics(out) if r["step"] > 8} == {
        s: n for s, n in counted.items() if s > 8
    }
    # each stream's dedup state is in the checkpoint with its data position: the start of a later document
    # window, which a resume re-reads from there
    step_8 = out / "checkpoints" / "step-00000008" / "rank-00000.pt"
    streams = torch.load(step_8, weights_only=True)["states"]["data"]["streams"].values()
    assert len(streams) == 4
    assert all(d["docs"]["window"] > 0 and d["docs"]["start"]["transforms"][DEDUP]["seen"] for d in streams)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["data"]["transforms"] == [LOWERCASE_LONG, DEDUP]

    config = out / "config.yaml"
    before = (config.stat().st_mtime_ns, rr.file_sha256(config))
    other = f"--data.transforms=[examples/data_transforms.py:keep_long, {DEDUP}]"
    kept = [a for a in args if a != transforms]
    refused = rr.run(out, *kept, other, "--train.max_steps=16", check=False, launcher=rr.LAUNCHER)
    assert refused.returncode == 2
    assert (
        f"data.transforms: ['{LOWERCASE_LONG}', '{DEDUP}'] -> ['examples/data_transforms.py:keep_long', '{DEDUP}']"
        in (refused.output)
    )
    assert "--run.allow_data_change=true" in refused.output
    assert "parameters; optimizer groups" not in refused.output  # refused before the model was built
    assert (config.stat().st_mtime_ns, rr.file_sha256(config)) == before


@pytest.mark.slow
def test_transforms_for_token_files_prepared_without_them_are_refused_before_the_model_is_built(
    tmp_path, stdlib_cache
):
    from lmpretrain.data.prepare import write_token_files

    text = tmp_path / "docs.jsonl"
    text.write_text(
        "".join(json.dumps({"text": f"def f{i}():\n    return {i}\n" * 30}) + "\n" for i in range(40))
    )
    write_token_files({"files": [str(text)]}, load_tokenizer("builtin:python-stdlib"), tmp_path / "tok")
    run = rr.run(
        tmp_path / "run", f"--data.train=[{{files: [{tmp_path / 'tok'}]}}]", f"--data.transforms=[{LOWERCASE_LONG}]",
        check=False, launch=None,
    )  # fmt: skip
    assert run.returncode == 2
    assert (
        f"error: source files:{tmp_path / 'tok'} is token files, which data.transforms ({LOWERCASE_LONG})"
        in (run.output)
    )
    assert (
        f"python scripts/prepare_data.py --files {text} --tokenizer builtin:python-stdlib --transform "
        f"{LOWERCASE_LONG} --out {tmp_path / 'tok'}-transformed" in run.output
    )
    assert (
        "parameters; optimizer groups" not in run.output and not (tmp_path / "run" / "config.yaml").exists()
    )


@pytest.mark.slow
def test_a_transform_that_raises_ends_the_run_on_one_message_naming_it_the_source_and_the_document(tmp_path):
    (tmp_path / "raising.py").write_text(
        "def boom(text, source):\n"
        "    if 'import os' in text:\n"
        "        raise ValueError('no os, please')\n"
        "    return text\n"
    )
    run = rr.run(
        tmp_path / "run", *rr.QUICK, f"--data.transforms=[{tmp_path / 'raising.py'}:boom]", check=False,
        launcher=rr.LAUNCHER,
    )  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.output, run.output[-3000:]
    last = run.output.rstrip().splitlines()[-1]
    assert re.fullmatch(
        rf"error: data\.transforms: {re.escape(str(tmp_path / 'raising.py'))}:boom raised ValueError: no os, please "
        r"on the document at \S+/python-stdlib-\S+/(train|validation)-\d+-of-\d+\.jsonl line \d+ \(source "
        r"python-stdlib:(train|validation)\); fix the transform, or have it return None to drop such a document",
        last,
    ), last
    path, line = re.search(r"at (\S+) line (\d+)", last).groups()
    assert "import os" in json.loads(Path(path).read_text().splitlines()[int(line) - 1])["text"]
    assert not (tmp_path / "run" / "config.yaml").exists() and not (tmp_path / "run" / "checkpoints").exists()


# ---- a fork section's fields are part of the resume fingerprint ---------------------------------------------


def test_a_fork_sections_fields_are_checked_at_resume_unless_declared_free():
    from dataclasses import dataclass, field

    from transformers import LlamaConfig

    from lmpretrain.errors import CheckpointMismatchError
    from lmpretrain.run.fingerprint import allow_mismatch_problems, check_fingerprint, run_fingerprint

    @dataclass
    class Probe:
        width: int = 8
        log_every: int = field(default=10, metadata={"resume": "free"})  # may change at resume

    sections = {"probe": Probe}
    model_config = LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2)

    def fingerprint(*args):
        cfg = load_config([str(rr.SMOKE), *args], sections=sections)
        return run_fingerprint(cfg, 1, {"seq_len": 64}, model_config)

    saved = fingerprint()
    assert saved["probe"] == {"width": 8}
    assert check_fingerprint(saved, fingerprint("--probe.log_every=1")) == []
    with pytest.raises(CheckpointMismatchError, match=r"probe\.width: 8 -> 16"):
        check_fingerprint(saved, fingerprint("--probe.width=16"))
    lines = check_fingerprint(saved, fingerprint("--probe.width=16"), allow_mismatch=["probe.width"])
    assert lines == [
        "WARNING: resuming across a fingerprint difference (run.allow_mismatch): probe.width: 8 -> 16"
    ]
    assert allow_mismatch_problems(["probe.width", "probe"], sections=["probe"]) == []
    assert "model.<field>, probe, probe.<field>" in allow_mismatch_problems(["prob"], sections=["probe"])[0]
    assert "probe" not in run_fingerprint(load_config([str(rr.SMOKE)]), 1, {}, model_config)
