"""The requests table of a compare: a request one trace lacks (issue 19: it printed ``785/None``)."""

from __future__ import annotations

from statediff.diff.result import RequestRow


def row(prompt_len, cached):
    return RequestRow(request=3, prompt_len=prompt_len, cached=cached, outputs_equal=None,
                      first_output_diff=None, outputs="missing in the cold trace", acceptance=(None, None))


def test_a_request_missing_from_one_trace_shows_a_question_mark_not_none():
    assert row((785, None), (512, None)).to_text() == (
        "        3   785/?            512/?         ?  missing in the cold trace")
    assert "None" not in row((None, 785), (None, 0)).to_text()


def test_equal_prompt_lengths_show_once():
    assert row((785, 785), (512, 0)).to_text().split()[:3] == ["3", "785", "512/0"]
