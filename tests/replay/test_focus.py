"""statediff.replay.focus: the focus's text form (one owner) and the focus a compare result names."""

from __future__ import annotations

import pytest

from statediff.replay.focus import focus_from_compare, focus_text


def test_focus_text():
    assert focus_text({"request": 1, "position": 448}) == "request=1,position=448"
    assert focus_text({"request": 1, "position": 448, "layers": []}) == "request=1,position=448"
    assert focus_text({"request": 2, "position": 64, "layers": [-1, 3]}) == "request=2,position=64,layers=-1/3"


def _doc(**kw) -> dict:
    return {"statediff": "compare", "hit": {"path": "hit.h5"}, "cold": {"path": "/t/cold.h5"}} | kw


def test_focus_from_compare_prefers_the_focus_then_the_first_root():
    assert focus_from_compare(_doc(focus={"request": 2, "position": 640, "layers": [1]})) == (
        {"request": 2, "position": 640, "layers": [1]}, "focus", "hit.h5", "/t/cold.h5")
    assert focus_from_compare(_doc(roots=[{"request": 1, "position": 416, "layer": 3}],
                                   first={"request": 9, "position": 9})) == (
        {"request": 1, "position": 416}, "first root", "hit.h5", "/t/cold.h5")
    assert focus_from_compare(_doc(first={"request": 0, "position": 32}, hit=None))[1:] == (
        "first root", None, "/t/cold.h5")


@pytest.mark.parametrize("doc,message", [
    ([], "not the output of `statediff compare --json`"),
    ({"statediff": "report"}, "not the output of `statediff compare --json`"),
    (_doc(first=None), "the compare result has no divergence to focus on (verdict: same)"),
])
def test_what_is_not_a_focus_is_refused(doc, message):
    with pytest.raises(ValueError) as info:
        focus_from_compare(doc)
    assert str(info.value) == message
