"""Meta-device init (model/meta_init.py): a model built on meta and filled from the recorded init holds the
weights a host build of the same seed holds, bit for bit, and leaves the generator where the host build does;
on 2 FSDP2 gloo ranks through accelerate's own wrapping each rank fills only its shards; a build it cannot
replay is built on the host, saying why."""

import json

import pytest
import torch
from transformers import AutoConfig

import recipe_runner as rr
from lmpretrain.config import load_config
from lmpretrain.errors import ConfigError
from lmpretrain.layout import Layout
from lmpretrain.model import LMObjective, ModelInit, build_model, meta_init, mup

SMALL = dict(hidden_size=60, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4, head_dim=16)
FSDP2 = Layout(kind="fsdp2", num_processes=2)


class RunCfg:  # the two sections ModelInit.for_run reads
    class model:
        pretrained, ep_size = None, 1

    class train:
        fp8 = "none"


def chunked_objective() -> LMObjective:
    return LMObjective.from_config(
        load_config([str(rr.ROOT / "configs" / "smoke.yaml"), "--train.loss_impl=chunked"]), 1
    )


def values(model) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize(
    "kind,fields,dtype,base_width",
    [
        ("llama", dict(SMALL, vocab_size=301, pad_token_id=0, tie_word_embeddings=True), "float32", None),
        ("llama", dict(SMALL, vocab_size=301, num_key_value_heads=2), "float64", 20),
        (
            "gpt2",
            dict(n_embd=60, n_layer=2, n_head=4, vocab_size=301, bos_token_id=0, eos_token_id=0),
            "float32",
            None,
        ),
        ("gemma3_text", dict(SMALL, vocab_size=301), "float32", None),
    ],
)
def test_a_meta_build_replayed_in_chunks_equals_the_host_build(monkeypatch, kind, fields, dtype, base_width):
    """Chunks of 48 elements: the 301 x 60 embedding (18,060 elements, 12 past a multiple of 16) is drawn in
    377 pieces, the last of 16 + 12, as CHUNK draws a large tensor. The chunked loss's start-up check runs on
    a host twin of the meta model, drawing nothing from the generator the replay repeats."""
    monkeypatch.setattr(meta_init, "CHUNK", 48)
    objective = chunked_objective()

    def make():
        model = build_model(AutoConfig.for_model(kind, **fields), dtype=dtype)
        if base_width:
            mup.apply(model, base_width)
        return model, objective.install(model)

    torch.manual_seed(3)
    host = values(make()[0])
    host_rng = torch.get_rng_state()
    torch.manual_seed(3)
    init = ModelInit.for_run(RunCfg, FSDP2)
    model, lines = init.build(make)
    assert init.on_meta and all(p.is_meta for p in model.parameters())
    assert f"chunked loss: logits = output embedding(final hidden states) for {kind}, checked" in lines
    assert lines[-1].startswith("objective checks run on a host twin of the model built on meta")
    names = meta_init._tensors(model)
    meta_init.to_empty_tied(model, "cpu")
    tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    held = init._replay({n: tensors[n] for n in set(names.values())}, names)
    replayed = values(model)
    assert replayed.keys() == host.keys()
    assert [n for n in host if not torch.equal(replayed[n], host[n])] == []
    assert torch.equal(torch.get_rng_state(), host_rng)  # what is drawn after the model draws the same
    assert held == sum(p.numel() for p in model.parameters())
    if fields.get("tie_word_embeddings"):
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_a_model_built_on_meta_is_refused_what_its_host_build_is_refused():
    """Gemma 2's soft-capped logits with the chunked loss: refused by the check on the meta build's host twin,
    with the host build's message, and not built again on the host first."""
    objective, builds = chunked_objective(), []

    def make():
        builds.append(1)
        model = build_model(
            AutoConfig.for_model("gemma2", **SMALL, vocab_size=301, final_logit_softcapping=30.0)
        )
        return model, objective.install(model)

    with pytest.raises(
        ConfigError, match="a gemma2 model post-processes its logits after the output embedding"
    ):
        ModelInit.for_run(RunCfg, FSDP2).build(make)
    assert builds == [1]


def test_runs_that_hold_the_whole_model_or_rewrite_it_build_on_the_host():
    assert ModelInit.for_run(RunCfg, Layout()).why_host == "one process"
    ddp = Layout(kind="ddp", num_processes=2)
    assert ModelInit.for_run(RunCfg, ddp).why_host == "ddp: rank 0 builds it, its wrapping broadcasts it"
    assert ModelInit.for_run(RunCfg, ddp, rank=1).from_rank_zero

    class Fp8(RunCfg):
        class train:
            fp8 = "tensorwise"

    assert "train.fp8=tensorwise" in ModelInit.for_run(Fp8, FSDP2).why_host


@pytest.mark.slow
def test_fsdp2_ranks_fill_their_own_shards_with_the_host_builds_weights(tmp_path):
    """tests/meta_init_worker.py on 2 gloo ranks: a tied Llama with a padding row, a μP Llama in float64, a
    Qwen3-MoE, each sharded by accelerate's fsdp2_prepare_model and compared whole with a host build; and a
    fork's parameter drawn by torch.randn, which is built on the host instead."""
    out = tmp_path / "results.json"
    rr.launch_ranks(rr.ROOT / "tests" / "meta_init_worker.py", str(out), "fsdp2", timeout=300)
    results = json.loads((tmp_path / "results.json.0").read_text())
    for name, r in results.items():
        assert r["differ"] == [] and r["names"] and r["rng_after"], name
        assert r["optimizer_holds_the_model"] and r["dtensors"], name
    assert results["llama-tied-pad-float32"]["tied"]
    assert results["llama-tied-pad-float32"]["line"].startswith(
        "model init: on meta, this rank filled its own shards (50,784 of 101,504 parameters) in "
    )
    assert results["randn-parameter"]["line"].startswith(
        "model init: on the host (its init cannot be replayed on shards: a tensor is drawn by "
        "aten.randn.default when it is made)"
    )


@pytest.mark.slow
def test_ddp_ranks_but_rank_zero_build_on_meta_and_are_given_rank_zeros_weights(tmp_path):
    """tests/meta_init_worker.py on 2 DDP gloo ranks: rank 0 builds each model on the host, rank 1 on meta
    (a fork's torch.randn parameter too: nothing is replayed), and after accelerate's wrapping both hold the
    host build's parameters and buffers, tied where it ties, with the host build's generator state after."""
    out = tmp_path / "results.json"
    rr.launch_ranks(rr.ROOT / "tests" / "meta_init_worker.py", str(out), "ddp", timeout=300)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"results.json.{rank}").read_text())
        for name, r in results.items():
            assert r["differ"] == [] and r["names"] and r["rng_after"], (rank, name)
            assert r["optimizer_holds_the_model"] and r["built_on_meta"] == (rank == 1), (rank, name)
        assert results["llama-tied-pad-float32"]["tied"]
        line = results["randn-parameter"]["line"]
        if rank == 0:
            assert line.startswith(
                "model init: on the host (ddp: rank 0 builds it, its wrapping broadcasts it; the other ranks "
                "build on meta), "
            ), line
        else:
            assert line.startswith("model init: on meta, rank 0's weights taken when wrapped; built in "), (
                line
            )


def test_a_build_that_cannot_run_on_meta_is_built_on_the_host_once_more_from_the_same_seed():
    calls = []

    def make():  # reads a value back, as a fork's constructor might: meta tensors have none
        calls.append(1)
        model = build_model(AutoConfig.for_model("llama", **SMALL, vocab_size=301))
        scale = model.model.norm.weight.sum().item()
        return model, [f"norm weight sum {scale:g}"]

    torch.manual_seed(3)
    host = values(make()[0])
    torch.manual_seed(3)
    init = ModelInit.for_run(RunCfg, FSDP2)
    model, lines = init.build(make)
    assert init.why_host.startswith("its build does not run on the meta device (RuntimeError: ")
    assert len(calls) == 3 and lines == ["norm weight sum 60"]  # the host build's own line, once
    assert all(torch.equal(t, host[n]) for n, t in values(model).items())
