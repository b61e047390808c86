"""A generating task (lm-evaluation-harness `generate_until`) under FSDP2 is refused before the model is
built: each rank would generate a different number of tokens and the sharded forwards stop pairing up."""

import json
import textwrap

import pytest

import recipe_runner as rr

pytestmark = pytest.mark.slow  # a 2-rank FSDP2 launch


def test_a_generating_task_under_fsdp2_is_refused_before_the_model_is_built(tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"q": f"def f{i}(", "a": "x):"}) + "\n" for i in range(4)))
    task = tmp_path / "complete_def.yaml"
    task.write_text(
        textwrap.dedent(f"""\
            task: complete_def
            dataset_path: json
            dataset_kwargs:
              data_files:
                test: {data}
            test_split: test
            output_type: generate_until
            doc_to_text: q
            doc_to_target: a
            generation_kwargs:
              until: ["\\n"]
              max_gen_toks: 8
            metric_list:
              - metric: exact_match
            """)
    )
    result = rr.run(
        tmp_path / "run",
        f"--eval.tasks=[{task}]",
        "--logging.wandb_mode=disabled",
        launch="cpu-fsdp",
        launcher=rr.LAUNCHER,
        check=False,
    )
    assert result.returncode == 2, result.output[-3000:]
    last = result.output.strip().splitlines()[-2:]
    assert last[0].startswith("error: 1 problem(s) in"), result.output[-3000:]
    assert last[1].startswith("  - eval.tasks: complete_def generate text (output_type generate_until)")
    assert "parameters; optimizer groups" not in result.output  # refused before the model was built
