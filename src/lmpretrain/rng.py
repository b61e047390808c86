"""Every RNG a training process uses (python, numpy, torch, CUDA), captured as plain values and tensors
so checkpoints load them with ``torch.load(weights_only=True)``."""

import logging
import random

import numpy as np
import torch

logger = logging.getLogger(__name__)


def capture_rng_state() -> dict:
    """This process's python, numpy, torch and CUDA RNG states, as tensors and plain values."""
    version, internal, gauss_next = random.getstate()
    np_name, np_key, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    state = {
        "python": {
            "version": version,
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "name": np_name,
            "key": torch.from_numpy(np_key.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of ``capture_rng_state``: the next random numbers equal those after the capture."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss_next"]))
    nps = state["numpy"]
    np.random.set_state(
        (
            nps["name"],
            nps["key"].numpy().astype(np.uint32),
            nps["pos"],
            nps["has_gauss"],
            nps["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None:
        if not torch.cuda.is_available():
            logger.warning(
                "checkpoint has CUDA RNG states but CUDA is not available here: they are not restored"
            )
        else:
            if len(cuda) != torch.cuda.device_count():
                logger.warning(
                    "checkpoint has CUDA RNG states for %d devices, this process sees %d: "
                    "restoring the first %d",
                    len(cuda),
                    torch.cuda.device_count(),
                    min(len(cuda), torch.cuda.device_count()),
                )
            for device, rng in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(rng, device)
