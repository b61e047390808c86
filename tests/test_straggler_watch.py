"""The straggler watchdog (run.straggler_factor): the decision on numbers, and on 2 real gloo ranks where
rank 1 loads each batch 0.3 s late, the one warning naming it."""

import pytest

from lmpretrain.run.straggler_watch import StragglerWatch, find_straggler
from recipe_runner import QUICK, ROOT, run


def test_a_rank_over_the_factor_and_the_noise_floor_is_named():
    window = [[0.010, 0.310, 0.012, 0.011]] * 7 + [[0.010, 0.002, 0.012, 0.900]]  # one odd step each
    assert find_straggler(window, 2.0, step_time=1.0) == (1, 0.310, 0.011)
    assert find_straggler(window, 40.0, step_time=1.0) is None  # 0.31 < 40 x 0.011
    # 4x the others, but 3 ms of a 1 s step: noise, not a straggler
    assert find_straggler([[0.001, 0.004]] * 8, 2.0, step_time=1.0) is None
    assert find_straggler([[0.001, 0.004]] * 8, 2.0, step_time=0.02) == (1, 0.004, 0.001)
    # one slow read (a shard opened) in the window does not make a straggler: medians
    assert find_straggler([[0.01, 0.01]] * 7 + [[0.01, 2.0]], 2.0, step_time=0.5) is None


def test_the_watch_warns_once_per_interval_and_only_with_a_full_window():
    said = []
    watch = StragglerWatch(2.0, 2, said.append, window=4, every=10)
    for step in range(1, 31):
        shared = {"straggler/load_s": [0.0, 0.5], "train/epoch": 0}
        watch.observe(step, shared)
        assert shared == {"train/epoch": 0}  # its times are taken out of the host numbers
    # step 1 has no step time; steps 2-5 fill the window: warned at 5, then 15, 25
    assert [line.split(" at step ")[1].split(":")[0] for line in said] == ["5", "15", "25"]
    assert said[0].startswith("WARNING: rank 1 is a straggler at step 5: it takes 0.500 s to load its batch")
    off = StragglerWatch(0, 2, said.append)
    assert off.host(1.0) == {} and StragglerWatch(None, 2, said.append).host(1.0) == {}
    assert StragglerWatch(2.0, 1, said.append).host(1.0) == {}  # one process: no one to compare with


@pytest.mark.slow  # 2 real gloo ranks
def test_a_rank_loading_late_is_named_on_rank_0s_log(tmp_path):
    slow = run(
        tmp_path / "run", "--train.max_steps=12", "--checkpoint.every=0", "--eval.every=0",
        "--logging.wandb_mode=disabled", *QUICK, launch="cpu-ddp",
        recipe=ROOT / "tests" / "forks" / "slow_rank.py", env={"SLOW_RANK": "1", "SLOW_RANK_S": "0.3"},
    )  # fmt: skip
    # (the step bar shares the terminal: a line starts wherever the bar left off)
    warnings = [line.split("[lmpretrain] ")[-1] for line in slow.output.splitlines() if "straggler" in line]
    assert len(warnings) == 1, slow.output[-3000:]  # steps 2-9 fill the window; then not again for 100 steps
    assert warnings[0].startswith("WARNING: rank 1 is a straggler at step 9: it takes 0.3"), warnings
    assert "run.straggler_factor=2" in warnings[0]
    rows = slow.metrics()
    assert not any("straggler" in key for row in rows for key in row)  # the times are not step metrics
