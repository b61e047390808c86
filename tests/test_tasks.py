"""Downstream tasks in the loop (eval.tasks) and bits per byte (eval/bpb).

The in-loop numbers are checked against lm-evaluation-harness's own `simple_evaluate` of the exported
`final/` model in one process, for runs on 1 process, 2 DDP ranks and 2 FSDP2 ranks.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import one_layer_llama_config

import recipe_runner as rr
from lmpretrain.data.next_line_task import CONTEXT_LINES, NUM_CHOICES, make_examples
from lmpretrain.observe.console import format_log_line

TASK = "python_next_line"
LIMIT = 40
TASK_RUN = [
    *rr.QUICK,
    "--train.max_steps=6",
    "--eval.every=3",
    "--eval.batches=1",
    "--checkpoint.every=0",
    "--logging.wandb_mode=disabled",
    "--logging.every=3",
    f"--eval.tasks=[builtin:{TASK}]",
    "--eval.tasks_every=3",
    f"--eval.tasks_limit={LIMIT}",
]


def test_next_line_examples_are_deterministic_and_well_formed():
    files = {
        f"pkg/m{i}.py": "\n".join(f"{'    ' * (k % 3)}value_{i}_{k} = compute({k}, {i})" for k in range(30))
        for i in range(5)
    }
    files["pkg/empty.py"] = "\n\n"
    examples = make_examples(files, 60, seed=3)
    assert examples == make_examples(files, 60, seed=3)
    assert examples != make_examples(files, 60, seed=4)
    for ex in examples:
        lines = files[ex["path"]].splitlines()
        context = ex["context"].splitlines()
        assert len(context) == CONTEXT_LINES and ex["context"].endswith("\n")
        i = next(k for k in range(len(lines)) if lines[k - CONTEXT_LINES : k] == context)
        assert ex["choices"][ex["label"]] == lines[i]  # the true next line
        assert len(ex["choices"]) == NUM_CHOICES == len({c.strip() for c in ex["choices"]})
        others = [c for k, c in enumerate(ex["choices"]) if k != ex["label"]]
        assert all(c not in files[ex["path"]] for c in others)  # distractors come from other files
    assert {ex["path"] for ex in examples[:5]} == {f"pkg/m{i}.py" for i in range(5)}  # files in turn
    assert len({(ex["path"], ex["context"]) for ex in examples}) == 60  # no question twice
    assert sorted({ex["label"] for ex in examples}) == [0, 1, 2, 3]


def test_bpb_is_summed_loss_over_bytes_of_the_target_text(small_tokenizer):
    """eval/bpb against a direct computation: logits -> summed cross-entropy in nats; bytes counted from
    the byte-level vocabulary (one symbol per byte; specials: 0 bytes), not by decoding."""
    from accelerate import Accelerator

    from lmpretrain.model import LMObjective, MixedPrecision
    from lmpretrain.model.objective import install_loss_forward
    from lmpretrain.observe import Evaluator

    tok = small_tokenizer
    texts = ["alpha beta gamma déjà vu return None", "def omega(): return psi if chi else phi"] * 6
    ids, nbytes = [], []  # token ids of the stream, and the UTF-8 bytes each one encodes
    for text in texts:
        enc = tok(text, add_special_tokens=False).input_ids
        ids += [tok.bos_token_id, *enc, tok.eos_token_id]
        # byte-level BPE: each character of a token's string stands for one byte
        nbytes += [0, *(len(piece) for piece in tok.convert_ids_to_tokens(enc)), 0]
    seq_len, n_blocks = 16, len(ids) // 16
    blocks = torch.tensor(ids[: n_blocks * seq_len]).reshape(n_blocks, seq_len)
    expected_bytes = sum(sum(nbytes[b * seq_len + 1 : (b + 1) * seq_len]) for b in range(n_blocks))

    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(one_layer_llama_config(tok.vocab_size + 3))
    install_loss_forward(model)  # as the recipe's prepare_model does: the objective runs in the forward
    acc = Accelerator(cpu=True)
    evaluator = Evaluator(blocks, LMObjective(), MixedPrecision("no", acc.device), 3, acc, tok)
    metrics = evaluator(model)
    with torch.no_grad():
        logits = model(input_ids=blocks).logits.double()
    nats = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), blocks[:, 1:].reshape(-1), reduction="sum"
    ).item()
    assert evaluator.target_bytes == expected_bytes
    assert metrics["eval/bpb"] == pytest.approx(nats / math.log(2) / expected_bytes, rel=1e-6)
    assert metrics["eval/loss"] == pytest.approx(nats / blocks[:, 1:].numel(), rel=1e-6)


def test_console_line_shows_bpb_and_each_tasks_main_metric():
    line = format_log_line(
        100,
        {
            "eval/loss": 2.0,
            "eval/bpb": 1.234,
            f"eval/{TASK}/acc": 0.5,
            f"eval/{TASK}/acc_norm": 0.625,
            "eval/lambada_openai/acc": 0.25,
            "eval/lambada_openai/perplexity": 90.0,
        },
    )
    assert f"bpb 1.234 | {TASK} acc_norm 0.625 | lambada_openai acc 0.250" in line


def test_task_schedule_problems_are_reported_together_before_loading_anything():
    from lmpretrain.config import load_config
    from lmpretrain.errors import ConfigError
    from lmpretrain.observe.tasks import TaskSuite

    argv = [str(rr.SMOKE), "--eval.every=10", "--eval.tasks_every=15", "--eval.tasks_limit=0"]
    with pytest.raises(ConfigError) as err:
        TaskSuite.from_config(load_config([*argv, "--eval.tasks=[builtin:nope]"]), None, None, None)
    assert err.value.problems == [
        "eval.tasks_every=15 must be a multiple of eval.every=10: tasks run with a held-out evaluation "
        "(or set eval.tasks_every=0 to run them only at the end)",
        "eval.tasks_limit must be >= 1 or null (all examples), got 0",
    ]
    suite = TaskSuite.from_config(load_config([str(rr.SMOKE), "--eval.tasks_every=20"]), None, None, None)
    assert not suite and not suite.due(20)  # no tasks: nothing to run, lm-evaluation-harness not loaded


def harness_on_final(out, limit=LIMIT) -> dict:
    """lm-evaluation-harness's own simple_evaluate of the exported model, one process."""
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    from lmpretrain.observe.tasks import resolve_task

    results = simple_evaluate(
        model="hf",
        model_args={"pretrained": str(out / "final"), "device": "cpu"},
        tasks=[resolve_task(f"builtin:{TASK}")],
        num_fewshot=0,
        limit=limit,
        batch_size=4,
        bootstrap_iters=0,
        task_manager=TaskManager(include_defaults=False),
    )
    values = results["results"][TASK]
    return {name: values[f"{name},none"] for name in ("acc",)}


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["cpu", "cpu-ddp", "cpu-fsdp"])
def test_in_loop_task_numbers_equal_simple_evaluate_on_the_final_model(tmp_path, stdlib_cache, launch):
    run = rr.run(tmp_path / "run", *TASK_RUN, launch=launch, timeout=900)
    rows = run.metrics()
    evals = {r["step"]: r for r in rows if f"eval/{TASK}/acc" in r}
    assert sorted(evals) == [0, 3, 6]  # the baseline, every eval.tasks_every, the end
    assert all(r["perf/tasks_s"] > 0 and "eval/bpb" in r for r in evals.values())
    assert f"{TASK} acc " in run.output  # the console line
    reference = harness_on_final(run.out)
    for name, value in reference.items():
        assert evals[6][f"eval/{TASK}/{name}"] == pytest.approx(value, abs=1e-6), (name, launch)
    # and the numbers are scores of real examples: LIMIT of them, each worth 1/LIMIT
    assert abs(reference["acc"] * LIMIT - round(reference["acc"] * LIMIT)) < 1e-9


@pytest.mark.slow
def test_bad_tasks_stop_the_run_at_start_up_with_one_message(tmp_path, stdlib_cache):
    bad_yaml = tmp_path / "broken.yaml"
    bad_yaml.write_text("task: broken\ndataset_path: json\n  metric_list: [\n")
    run = rr.run(
        tmp_path / "run",
        *rr.QUICK,
        "--logging.wandb_mode=disabled",
        f"--eval.tasks=[hellaswagg, hellaswag, {bad_yaml}, builtin:nope]",
        launch="cpu",
        launcher=rr.LAUNCHER,  # python -m lmpretrain.launch: a user error ends on its message, exit 2
        check=False,
        timeout=900,
    )
    assert run.returncode == 2, run.output[-3000:]
    assert run.output.count("error: 4 problem(s)") == 1
    assert "unknown task 'hellaswagg'; did you mean hellaswag" in run.output
    assert "'hellaswag' needs the Hugging Face Hub for its dataset and the Hub is offline" in run.output
    assert f"task file {bad_yaml} does not parse" in run.output
    assert "unknown built-in task 'builtin:nope'; built-in: builtin:python_next_line" in run.output
    assert "Traceback" not in run.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not [
        r
        for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if "train/loss" in r
    ]
