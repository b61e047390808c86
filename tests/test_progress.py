"""Progress of the long steps outside the loop: bars and announcements on the main process only, no bars under CI."""

import pytest

from lmpretrain import progress


def draw(n: int = 3) -> None:
    with progress.bar(desc="held-out set", unit="block", total=n) as shown:
        for _ in range(n):
            shown.update(1)
    progress.announce("building the corpus")


@pytest.mark.parametrize(
    ("env", "bar", "line"),
    [
        ({"RANK": "0", "CI": "false"}, True, True),
        ({"RANK": "0", "CI": "true"}, False, True),
        ({"RANK": "1"}, False, False),
    ],
    ids=["main-process", "under-ci", "other-rank"],
)
def test_bars_and_announcements_show_where_they_should(monkeypatch, capsys, env, bar, line):
    monkeypatch.delenv("CI", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    draw()
    err = capsys.readouterr().err
    assert ("held-out set: 100%" in err) == bar, err
    assert ("[lmpretrain] building the corpus" in err) == line, err


def test_the_loop_bar_counts_from_the_resumed_step(capsys):
    with progress.step_bar(total=10, initial=4, enabled=True) as shown:
        shown.update(1)
    assert "5/10" in capsys.readouterr().err
    with progress.step_bar(total=10, initial=4, enabled=False) as hidden:
        hidden.update(1)
    assert capsys.readouterr().err == ""
