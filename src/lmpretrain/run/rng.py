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


class LoopRNG:
    """The RNGs of the training loop as a state for the checkpointer.

    ``state_dict()`` captures them at save time. ``load_state_dict()`` only keeps the saved state, and
    ``start()``, right before the loop, applies it (resumed run) or seeds ``seed`` (fresh run): whatever
    runs between loading and the loop cannot shift the random numbers training draws.
    """

    def __init__(self, seed: int):
        self.seed = seed
        self._loaded: dict | None = None

    def state_dict(self) -> dict:
        return capture_rng_state()

    def load_state_dict(self, state: dict) -> None:
        self._loaded = state

    def start(self) -> None:
        """Continue the loaded state, or seed python, numpy, torch and CUDA with ``seed``."""
        if self._loaded is not None:
            restore_rng_state(self._loaded)
        else:
            from accelerate.utils import set_seed

            set_seed(self.seed)
