"""What comes from the Hub at start-up is fetched once per machine, not once per rank: the tokenizer and the
lm-eval task data by each machine's main process (the others read its cache with the Hub offline), a Hub
dataset's listing and the held-out set's rows by rank 0 alone.

A Hub on loopback (tests/hub_server.py: the Hub's own API paths and answers, every request counted) serves a
tokenizer, a held-out dataset and a task's dataset. The recipe runs on them as 1 process and as 2 DDP ranks
(gloo), each with an empty cache: the 2-rank run sends the very requests the 1-process run sends, one
fetch per file.
"""

import json
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import recipe_runner as rr
from lmpretrain.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # two runs of the recipe, one of them on 2 ranks

REPOS = ("/me/tok/", "/datasets/me/")


def fill_hub(root: Path) -> Path:
    """The Hub's repositories: me/tok, datasets me/heldout and me/task; returns the task's YAML."""
    load_tokenizer("builtin:python-stdlib").save_pretrained(root / "me" / "tok")
    heldout = root / "datasets" / "me" / "heldout" / "data"
    heldout.mkdir(parents=True)
    docs = [{"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n"} for i in range(400)]
    pq.write_table(pa.Table.from_pylist(docs), heldout / "test-00000-of-00001.parquet", row_group_size=100)
    task = root / "datasets" / "me" / "task" / "data"
    task.mkdir(parents=True)
    rows = [
        {"context": f"def f{i}(x):", "choices": ["    return x", "import os"], "label": 0} for i in range(8)
    ]
    pq.write_table(pa.Table.from_pylist(rows), task / "test-00000-of-00001.parquet")
    yaml = root.parent / "next_def.yaml"
    yaml.write_text(
        textwrap.dedent("""\
            task: next_def
            dataset_path: me/task
            test_split: test
            output_type: multiple_choice
            doc_to_text: context
            doc_to_choice: choices
            doc_to_target: label
            metric_list:
              - metric: acc
            """)
    )
    return yaml


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub") / "repos"
    task = fill_hub(root)
    port_file = root.parent / "port"
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("hub_server.py")), str(root), str(port_file)]
    )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert server.poll() is None and time.monotonic() < deadline, "the loopback Hub did not start"
            time.sleep(0.1)
        yield root, f"http://127.0.0.1:{port_file.read_text()}", task
    finally:
        server.kill()
        server.wait()


def requests_of_a_run(hub, tmp_path: Path, launch: str) -> Counter:
    root, endpoint, task = hub
    log = root / "requests.log"
    log.unlink(missing_ok=True)
    env = {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_OFFLINE": "",
        "HF_DATASETS_OFFLINE": "",
    }
    run = rr.run(
        tmp_path / "run",
        "--data.tokenizer=me/tok",
        "--data.eval=[{hub: me/heldout, split: test}]",
        f"--eval.tasks=[{task}]",
        "--train.max_steps=2",
        "--optim.warmup_steps=1",
        "--eval.every=2",
        "--checkpoint.every=0",
        "--eval.sample_tokens=0",
        "--logging.wandb_mode=disabled",
        launch=launch,
        env=env,
        timeout=600,
        fork=False,  # a new process tree: huggingface_hub reads HF_ENDPOINT when imported
    )
    assert "next_def" in run.output and "done: step 2" in run.output, run.output[-3000:]
    lines = log.read_text().splitlines()
    return Counter(line for line in lines if any(repo in line for repo in REPOS))


def test_two_ranks_fetch_each_file_once_like_one_process(hub, tmp_path):
    one = requests_of_a_run(hub, tmp_path / "one", "cpu")
    two = requests_of_a_run(hub, tmp_path / "two", "cpu-ddp")
    fetched = {line: n for line, n in two.items() if line.startswith("GET") and "/resolve/" in line}
    # every repository was reached: the tokenizer's files, the held-out rows, the task's data
    assert any("me/tok/resolve" in line and line.endswith("tokenizer.json") for line in fetched), sorted(two)
    assert any("me/heldout/resolve" in line for line in fetched) and any(
        "me/task/resolve" in line for line in fetched
    )
    assert two == one, f"2 ranks: {sorted((two - one).items())} more, {sorted((one - two).items())} fewer"
    print(f"{sum(two.values())} requests on 2 ranks, {sum(one.values())} on 1; {len(fetched)} files fetched")


WORKER = textwrap.dedent("""
    import json, sys
    from accelerate import PartialState
    from huggingface_hub import constants
    from lmpretrain.errors import DataError, UserError
    from lmpretrain.run.downloads import local_main_first, on_rank_zero

    state = PartialState(cpu=True)
    seen = {}

    def fetch():  # what the machine's main process fetches and the others read offline
        seen.setdefault("offline", []).append(constants.HF_HUB_OFFLINE)
        return state.process_index

    def broken():
        if state.process_index == 0:
            raise DataError("held-out source me/gone: no such dataset")
        return "never reached on rank 0"

    constants.HF_HUB_OFFLINE = False  # as on a machine with the Hub (the test runs set HF_HUB_OFFLINE=1)
    before = constants.HF_HUB_OFFLINE
    result = {"first": local_main_first(fetch, state), "offline": seen["offline"], "offline_before": before,
              "offline_after": constants.HF_HUB_OFFLINE}
    for name, call in (("local_main_first", lambda: local_main_first(broken, state)),
                       ("on_rank_zero", lambda: on_rank_zero(broken))):
        try:
            call()
            result[name] = None
        except UserError as err:
            result[name] = [type(err).__name__, str(err)]
    with open(f"{sys.argv[1]}/rank-{state.process_index}.json", "w") as f:
        json.dump(result, f)
    state.destroy_process_group()
""")


def test_the_first_processs_error_ends_every_rank_with_its_message(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    rr.launch_ranks(script, str(tmp_path), timeout=120)
    r0, r1 = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2))
    # rank 0 (the machine's main) ran in the environment's mode; rank 1 after it, offline; the switch restored
    assert (r0["first"], r0["offline"], r1["first"], r1["offline"]) == (0, [False], 1, [True])
    assert all(r["offline_after"] == r["offline_before"] for r in (r0, r1))
    message = "held-out source me/gone: no such dataset"
    assert r0["local_main_first"] == r0["on_rank_zero"] == ["DataError", message]
    assert r1["local_main_first"] == ["UserError", message]  # rank 1 never ran `broken`
    assert r1["on_rank_zero"] == ["DataError", message]  # rank 0's error class where it takes one message
