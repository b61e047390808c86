"""μP's coordinate check (scripts/coord_check.py) on the quickstart config and data: after 5 AdamW steps at the
config's lr, the logits and every layer's output stay the same size across widths 64-256 with model.mup and
grow with the width without it."""

import sys

import pytest

import recipe_runner as rr

sys.path.insert(0, str(rr.ROOT / "scripts"))
import coord_check  # noqa: E402

WIDTHS = [64, 128, 256]
pytestmark = pytest.mark.slow  # ~40 s: 6 models trained 5 steps


@pytest.fixture(scope="module")
def sizes():
    args = [str(rr.ROOT / "configs" / "default.yaml")]
    return {on: coord_check.run(args, WIDTHS, 5, on, base_width=64) for on in (False, True)}


def spread(rows, key):
    values = [r["steps"][-1][key] for r in rows]
    return max(values) / min(values), values[-1] / values[0]


def test_with_mup_every_coordinate_keeps_its_size_across_widths(sizes):
    for key in sizes[True][0]["steps"][-1]:
        ratio, _ = spread(sizes[True], key)
        assert ratio < 1.25, (key, [r["steps"][-1][key] for r in sizes[True]])


def test_without_mup_the_hidden_states_and_logits_grow_with_the_width(sizes):
    _, logits = spread(sizes[False], "logits")
    _, last = spread(sizes[False], "layer_3")
    assert logits > 2 and last > 4, (logits, last)


def test_at_the_base_width_both_are_the_same_run(sizes):
    assert sizes[True][0]["steps"] == sizes[False][0]["steps"]
