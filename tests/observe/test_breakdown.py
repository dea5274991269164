"""WallBreakdown: phases add up, overlapped phases are shown but not counted twice."""

from __future__ import annotations

import threading

import pytest

from phalanx.cli import report
from phalanx.observe.breakdown import WallBreakdown, process_age_s, read_breakdown


@pytest.mark.timeout(30)
@pytest.mark.smoke
def test_phases_other_and_overlap(tmp_path):
    b = WallBreakdown()
    b.add("ray start", 2.0)
    b.add("learning", 1.0)
    b.add("learning", 0.5)
    t = threading.Thread(target=b.add, args=("learner init", 1.5), kwargs={"overlapped": True})
    t.start()
    t.join()
    d = b.as_dict(total_s=5.0)
    assert d == {"ray start": 2.0, "learning": 1.5, "learner init": 1.5, "other": 1.5}
    table = b.table(5.0)
    assert "learner init (overlapped)" in table and " 40.0%" in table and "other" in table
    with b.phase("plotting"):
        pass
    assert 0 <= b.seconds["plotting"] < 1
    b.save(tmp_path, 5.0)
    saved = read_breakdown(tmp_path)
    assert saved["total_s"] == 5.0 and saved["overlapped"] == ["learner init"]
    assert saved["phases"]["ray start"] == 2.0
    assert read_breakdown(tmp_path / "nothing") is None
    assert process_age_s() > 0


@pytest.mark.timeout(30)
def test_report_shows_the_breakdown(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "wall_time": 0.0, "timesteps": 10}\n')
    b = WallBreakdown()
    b.add("ray start", 3.0)
    b.add("learner init", 2.0, overlapped=True)
    b.save(tmp_path, 4.0)
    s = report.summarize(tmp_path)
    assert s["wall total s"] == 4.0
    assert s["wall ray start s"] == 3.0
    assert s["wall learner init (overlapped) s"] == 2.0
    assert s["wall other s"] == 1.0
