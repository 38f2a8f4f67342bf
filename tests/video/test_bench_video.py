"""`vpsd bench video` on a few seconds of video: it makes its video once, keeps it, reads it with every reader and
finds vpsd's frames identical to the full decode's (the timings themselves are the bench's business, not a test's)."""

from __future__ import annotations

import json

from vpsd.bench.video import main, video_path


def test_the_video_bench_makes_its_video_once_and_reads_it_as_a_full_decode_does(tmp_path, capsys):
    args = ["--lengths", "0.1", "--sizes", "480", "--frames", "4,16", "--fps", "2", "--repeats", "1",
            "--videos", str(tmp_path / "videos"), "--json", str(tmp_path / "report.json")]
    assert main(args) == 0
    made = video_path(tmp_path / "videos", 0.1, 480)
    stamp = made.stat().st_mtime_ns
    assert main(args) == 0 and made.stat().st_mtime_ns == stamp  # kept, not made again
    rows = json.loads((tmp_path / "report.json").read_text())["reads"]
    assert [r["frames"] for r in rows] == [4, 16, 12] and all(r["identical"] for r in rows)
    assert "identical" in capsys.readouterr().out
