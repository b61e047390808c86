"""Ranks agree on the checkpoint they resume: rank 0 resolves run.resume (auto, a path, never) and every
rank gets its answer, or its error.

On a shared filesystem whose directory listings are cached per node, ranks that listed the checkpoint
directory each on their own could load different steps. Two real gloo processes reproduce that with a
different view of the output dir per rank: rank 1's view holds a newer complete checkpoint (written by
a real save) that rank 0's does not, so its own listing would pick step 8 where rank 0's picks step 4.
"""

import json
import textwrap

import pytest

from recipe_runner import launch_ranks

WORKER = textwrap.dedent("""
    import json, os, shutil, sys
    import torch
    from accelerate import PartialState
    from lmpretrain.checkpoint.checkpointer import Checkpointer
    from lmpretrain.errors import CheckpointError
    from lmpretrain.run.train_state import TrainState

    root = sys.argv[1]
    state = PartialState(cpu=True)
    rank = state.process_index
    views = [os.path.join(root, f"view-{r}") for r in range(2)]

    def model_at(step):
        torch.manual_seed(step)
        return torch.nn.Linear(4, 4)

    def save(ck, step):
        m = model_at(step)
        ck.save(step, model=m, optimizer=torch.optim.AdamW(m.parameters()), states={"train": TrainState(step=step)})

    # Both views hold steps 2 and 4; rank 1's view also holds a complete step 8 rank 0's does not.
    for view in views:
        ck = Checkpointer(view, state, keep_last=3)
        save(ck, 2)
        save(ck, 4)
    save(Checkpointer(views[1], state, keep_last=3), 8)
    state.wait_for_everyone()

    ck = Checkpointer(views[rank], state, keep_last=3)
    result = {"own_listing": ck.valid_checkpoints()[0].name}  # this rank alone
    for resume in ("auto", os.path.join(views[0], "checkpoints", "step-00000002")):
        path = ck.resolve_resume(resume, overwrite=False)
        m, train = model_at(0), TrainState()
        ck.load(path, model=m, optimizer=torch.optim.AdamW(m.parameters()), states={"train": train})
        result[resume if resume == "auto" else "path"] = {
            "path": str(path), "step": train.step, "weights": torch.equal(m.weight, model_at(train.step).weight)}
    # A file only rank 1 checks (its own rank file, truncated): its reason on both ranks, and `auto` falls
    # back to the older checkpoint on both.
    state.wait_for_everyone()
    step4 = os.path.join(views[0], "checkpoints", "step-00000004")
    if rank == 1:
        with open(os.path.join(step4, "rank-00001.pt"), "r+b") as f:
            f.truncate(10)
    state.wait_for_everyone()
    result["rank_1_file"] = {"problem": ck.files_problem(step4), "auto": ck.resolve_resume("auto", False).name}
    # A path only rank 0 finds broken, and `never` over rank 0's checkpoints: the same error on both ranks.
    state.wait_for_everyone()
    if rank == 0:
        os.remove(os.path.join(views[0], "checkpoints", "step-00000002", "COMPLETE"))
    for resume in (os.path.join(views[rank], "checkpoints", "step-00000002"), "never"):
        try:
            ck.resolve_resume(resume, overwrite=False)
            result.setdefault("errors", []).append(None)
        except CheckpointError as err:
            result.setdefault("errors", []).append(str(err).replace(views[0], "<view-0>"))
    with open(os.path.join(root, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    state.wait_for_everyone()
    state.destroy_process_group()
""")


@pytest.mark.slow
def test_both_ranks_resume_the_checkpoint_rank_0_resolved(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    launch_ranks(script, str(tmp_path), timeout=300)
    r0, r1 = (json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in range(2))
    # Each rank's own listing disagrees: that is the situation the broadcast resolves.
    assert (r0["own_listing"], r1["own_listing"]) == ("step-00000004", "step-00000008")
    step4 = str(tmp_path / "view-0" / "checkpoints" / "step-00000004")
    for r in (r0, r1):
        assert r["auto"] == {"path": step4, "step": 4, "weights": True}
        assert r["path"] == {
            "path": str(tmp_path / "view-0/checkpoints/step-00000002"),
            "step": 2,
            "weights": True,
        }
    # Each rank checks its own files: rank 1's truncated rank file is its finding, said on both ranks.
    assert r0["rank_1_file"] == r1["rank_1_file"]
    assert r0["rank_1_file"]["problem"].startswith("rank-00001.pt has 10 bytes, the manifest says")
    assert r0["rank_1_file"]["auto"] == "step-00000002"
    # Rank 0's errors, word for word, on both ranks (rank 1's own view of the path is intact).
    assert r0["errors"] == r1["errors"]
    broken, never = r0["errors"]
    assert broken.startswith("run.resume='<view-0>/checkpoints/step-00000002' is not a loadable checkpoint")
    assert never.startswith("run.resume=never but <view-0>/checkpoints already has 2 checkpoint(s)")
