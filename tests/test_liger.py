"""Our adapter against the installed liger-kernel (requirements.txt installs it; its Triton kernels need
a CUDA GPU, so here the call's arguments and the type it returns are checked, not its numbers)."""

import inspect

import pytest
import torch

from lmpretrain.model.loss import liger_arguments, liger_outputs

functional = pytest.importorskip("liger_kernel.transformers.functional")


def test_every_argument_we_pass_is_in_the_installed_signature():
    signature = inspect.signature(functional.liger_fused_linear_cross_entropy)
    bound = signature.bind(
        torch.zeros(4, 8),
        torch.zeros(16, 8),
        torch.zeros(4, dtype=torch.long),
        None,
        **liger_arguments(0.1, 1e-4),
    )
    assert bound.arguments["return_z_loss"] is True and bound.arguments["reduction"] == "sum"
    assert bound.arguments["lse_square_scale"] == 1e-4 and bound.arguments["label_smoothing"] == 0.1


def test_the_installed_return_type_and_the_older_tuple_unpack_alike():
    loss, z = torch.tensor(5.0), torch.tensor(0.25)
    # 0.8.x: what liger_fused_linear_cross_entropy returns with return_z_loss=True
    current = functional.CrossEntropyOutput(loss=loss, z_loss=z)
    assert liger_outputs(current) == (loss, z)
    assert liger_outputs((loss, z)) == (loss, z)  # <= 0.6.2: a (loss, z_loss) tuple
    source = inspect.getsource(functional.liger_fused_linear_cross_entropy)
    assert "return CrossEntropyOutput(" in source  # the installed version returns the dataclass
