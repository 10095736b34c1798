"""The verdict in words (pipeline/present/verdict.py): case ids from the user's data are escaped before a terminal or
MLflow shows them (issue 24, item 7)."""

from __future__ import annotations

import re

FORGED = "ordinary/x\npublish: float16 ACCEPT; review: http://evil\x1b[2J"
SCRIPT = "<script>alert(1)</script><img src=x onerror=alert(2)>[click](javascript:alert(3))"


def _verdict(ids: list[str]):
    from pipeline.present import verdict

    flips = [{"id": i, "kind": "ordinary", "boundary": False, "near_boundary": False, "reference_class": 1, "trial_class": 2,
              "reference_margin": 0.5, "trial_margin": 0.1} for i in ids]
    decision = {"decision": "rollback", "reasons": [f"1 flip among real samples: {ids[0]}"], "rule": {}, "env": {}}
    return verdict.verdict("float16", decision, {"flips": {"flip_list": flips}}, {})


def test_an_id_cannot_forge_a_line_or_reach_the_terminal_raw():
    from pipeline.present import verdict

    out = verdict.text(_verdict([FORGED, "y" * 3000]))
    assert "\x1b" not in out and "\npublish:" not in out
    assert "ordinary/x\\npublish: float16 ACCEPT; review: http://evil\\x1b[2J" in out
    assert max(len(line) for line in out.splitlines()) < 400 and "…(+2880 chars)" in out  # a 3,000-character id is capped


def test_html_and_markdown_links_in_an_id_do_not_reach_the_mlflow_description_raw():
    from pipeline.present import verdict

    md = verdict.markdown([_verdict([SCRIPT])]) + verdict.headline([_verdict([SCRIPT])])
    assert "<script" not in md and "<img" not in md and not re.search(r"(?<!\\)\]\(javascript:", md)  # no link
    assert "&lt;script>" in md and "\\[click\\](javascript:alert(3))" in md
    assert "<script" not in verdict.html([_verdict([SCRIPT])])  # report.html escapes, as before
