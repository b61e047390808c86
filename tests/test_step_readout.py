"""The step's one device->host read: loss, gradient norm, target count and the ranks' stop flags together,
reduced over ranks in one all-reduce (2 gloo ranks), with the target count kept on the device."""

import json
import math
import textwrap

import pytest
import torch
from accelerate import Accelerator

import recipe_runner as rr
from lmpretrain.model.loss import IGNORE_INDEX
from lmpretrain.update.step_readout import StepReadout


def test_one_process_reads_the_step_and_its_scale():
    readout = StepReadout(Accelerator(cpu=True), world_size=1, accum_steps=4)
    labels = torch.tensor([[5, 6, 7, 8], [1, IGNORE_INDEX, 3, 4]])
    n = readout.target_count(labels)
    assert isinstance(n, torch.Tensor) and n.item() == 5  # shifted by one: 3 + 2 targets
    assert readout.loss_scale(n).item() == 4 / 5
    step = readout.read(torch.tensor([10.0, 2.5], dtype=torch.float64), n, torch.tensor(0.75))
    assert (step.loss, step.z_loss, step.grad_norm, step.n_targets, step.stop) == (2.0, 0.5, 0.75, 5, False)
    assert step.finite
    assert not readout.read(torch.zeros(2), n, torch.tensor(math.inf)).finite
    empty = readout.read(torch.zeros(2), torch.tensor(0), 1.0)  # a float norm, as DeepSpeed reports it
    assert empty.n_targets == 0 and math.isnan(empty.loss) and not empty.finite


WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    from accelerate import Accelerator
    from lmpretrain.update.step_readout import StepReadout

    acc = Accelerator(cpu=True)
    rank = acc.process_index
    readout = StepReadout(acc, world_size=2, accum_steps=1)
    labels = torch.ones(1, 4 + rank, dtype=torch.long)  # 3 and 4 targets
    n = readout.target_count(labels)
    sums = torch.tensor([7.0 * (rank + 1), 1.0], dtype=torch.float64)  # ce sums 7 and 14
    steps = [readout.read(sums, n, torch.tensor(3.0), stop=(rank == 1 and i == 1)) for i in range(2)]
    with open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w") as f:
        json.dump([[s.loss, s.z_loss, s.n_targets, s.stop] for s in steps], f)
    acc.wait_for_everyone()
""")


@pytest.mark.slow
def test_two_ranks_read_the_same_global_step(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    rr.launch_two_ranks(script, str(tmp_path), timeout=120)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1] == [[21 / 7, 2 / 7, 7, False], [21 / 7, 2 / 7, 7, True]]
