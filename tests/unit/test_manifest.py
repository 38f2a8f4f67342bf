"""vpsd.launch.manifest: parsing, every problem kind with its line, and the checker's report."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import media
from vpsd.launch.manifest import ManifestError, ManifestItem, Shard, check_manifest, load_manifest, main
from vpsd.video import read_video


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """videos/a.mp4 (real, 16 gray frames), videos/b.mp4 (placeholder bytes), frames/ (6 PNGs)."""
    (tmp_path / "videos").mkdir()
    media.write_gray_video(tmp_path / "videos" / "a.mp4", num_frames=16, size=(32, 48), fps=8)
    (tmp_path / "videos" / "b.mp4").write_bytes(b"not checked beyond existing")
    (tmp_path / "videos" / "zero.mp4").write_bytes(b"")
    media.write_frame_folder(tmp_path / "frames", num_frames=6)
    return tmp_path


def write_lines(path: Path, lines: list[str], newline: str = "\n") -> Path:
    path.write_bytes(newline.join(lines).encode() + newline.encode())
    return path


def test_good_manifest(data_dir, tmp_path_factory, monkeypatch):
    absolute = data_dir / "videos" / "b.mp4"
    manifest = write_lines(
        data_dir / "run.jsonl",
        [
            "# a comment, then a blank line",
            "",
            '{"id": "a", "video": "videos/a.mp4", "prompt": "Describe.", "max_new_tokens": 32, "num_frames": 4,'
            ' "reference": "a gray fade", "meta": {"source": ["x", 1]}}',
            json.dumps({"id": 7, "video": str(absolute), "prompt": "What?", "fps": 2, "max_new_tokens": None}),
            '   # indented comment',
            json.dumps({"id": "f", "video": "frames", "prompt": "Frames.", "fps": 0.5, "stop": ["\n\n", "Q:"]}),
        ],
    )
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))  # relative to the manifest, not the cwd
    items, problems = load_manifest(manifest)
    assert problems == []
    a, seven, f = items
    assert a == ManifestItem(
        id="a",
        video=(data_dir / "videos" / "a.mp4").resolve(),
        prompt="Describe.",
        max_new_tokens=32,
        num_frames=4,
        fps=None,
        extra={"reference": "a gray fade", "meta": {"source": ["x", 1]}},
        line=3,
    )
    assert (seven.id, seven.video, seven.fps, seven.max_new_tokens, seven.line) == ("7", absolute.resolve(), 2.0, None, 4)
    assert isinstance(seven.fps, float) and seven.extra == {}
    assert (f.video, f.fps, f.line, f.stop) == ((data_dir / "frames").resolve(), 0.5, 6, ("\n\n", "Q:"))
    assert a.stop == () and ManifestItem.from_wire(f.to_wire()) == f  # as the coordinator hands it to a pipeline
    # The items are what the reader needs, as is.
    assert read_video(a.video, num_frames=a.num_frames).indices.tolist() == [0, 5, 10, 15]
    assert read_video(f.video, fps=f.fps).num_frames == 3
    hash(a)  # frozen items are usable as keys despite the dict field
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.prompt = "changed"  # type: ignore[misc]


def test_crlf_and_byte_order_mark(data_dir):
    manifest = data_dir / "windows.jsonl"
    line = json.dumps({"id": "a", "video": "videos/a.mp4", "prompt": "Hi"})
    manifest.write_bytes(b"\xef\xbb\xbf" + line.encode() + b"\r\n\r\n" + line.replace('"a"', '"b"').encode() + b"\r\n")
    items, problems = load_manifest(manifest)
    assert problems == [] and [(i.id, i.line) for i in items] == [("a", 1), ("b", 3)]


PROBLEM_LINES = [
    ('{"id": "ok1", "video": "videos/a.mp4", "prompt": "fine"}', None),
    ('{"id": "x", "video": "videos/a.mp4", "prompt": "unterminated}', "not valid JSON: Unterminated string"),
    ('["id", "video", "prompt"]', "expected a JSON object, got an array"),
    ('{"video": "videos/a.mp4", "prompt": "p"}', "missing field 'id'"),
    ('{"id": "e", "video": "videos/a.mp4", "prompt": "  "}', "field 'prompt' is empty"),
    ('{"id": "t", "video": 12, "prompt": "p"}', "field 'video' must be a string, got the number 12"),
    ('{"id": true, "video": "videos/a.mp4", "prompt": "p"}', "field 'id' must be a string or an integer, got a boolean"),
    ('{"id": "m", "video": "videos/a.mp4", "prompt": "p", "max_new_tokens": 0}', "field 'max_new_tokens' must be a positive integer, got the number 0"),
    ('{"id": "n", "video": "videos/a.mp4", "prompt": "p", "num_frames": "8"}', "field 'num_frames' must be a positive integer, got a string"),
    ('{"id": "r", "video": "videos/a.mp4", "prompt": "p", "fps": NaN}', "field 'fps' must be a positive number, got the number nan"),
    ('{"id": "b", "video": "videos/a.mp4", "prompt": "p", "num_frames": 8, "fps": 2}', "give 'num_frames' or 'fps', not both"),
    ('{"id": "ok1", "video": "videos/b.mp4", "prompt": "again"}', "duplicate id 'ok1' (first on line 1)"),
    ('{"id": "gone", "video": "videos/missing.mp4", "prompt": "p"}', "video not found: "),
    ('{"id": "z", "video": "videos/zero.mp4", "prompt": "p"}', "video file is empty: "),
    ('{"id": "k", "video": "videos/a.mp4", "prompt": "p", "prompt": "q"}', "field 'prompt' appears twice"),
    ('{"id": 5, "video": "videos/b.mp4", "prompt": "fine too"}', None),
    ('{"id": "5", "video": "videos/b.mp4", "prompt": "int and str ids are one id"}', "duplicate id '5' (first on line 16)"),
]


def test_every_problem_kind_with_its_line(data_dir):
    manifest = write_lines(data_dir / "bad.jsonl", [text for text, _ in PROBLEM_LINES])
    with manifest.open("ab") as f:
        f.write(b'{"id": "u", "video": "videos/a.mp4", "prompt": "caf\xe9"}\n')  # latin-1, not UTF-8
    items, problems = load_manifest(manifest)
    assert [(i.id, i.line) for i in items] == [("ok1", 1), ("5", 16)]
    expected = [(n, message) for n, (_, message) in enumerate(PROBLEM_LINES, start=1) if message]
    expected.append((len(PROBLEM_LINES) + 1, "not valid UTF-8"))
    assert len(problems) == len(expected), problems
    for problem, (line, message) in zip(problems, expected):
        assert problem.line == line and problem.message.startswith(message), (problem, line, message)
    assert str((data_dir / "videos" / "missing.mp4").resolve()) in problems[11].message


def test_all_problems_of_a_line_are_reported(data_dir):
    manifest = write_lines(data_dir / "many.jsonl", ['{"id": "", "prompt": 3, "fps": -1, "num_frames": 2}'])
    items, problems = load_manifest(manifest)
    assert items == []
    assert [p.message for p in problems] == [
        "field 'id' is empty",
        "missing field 'video'",
        "field 'prompt' must be a string, got the number 3",
        "field 'fps' must be a positive number, got the number -1",
        "give 'num_frames' or 'fps', not both",
    ]
    assert {p.line for p in problems} == {1}


def test_stop_strings_are_a_string_or_a_list_of_them(data_dir):
    lines = [{"stop": "###"}, {"stop": None}, {"stop": ""}, {"stop": ["a", 3]}, {"stop": {"s": "a"}}]
    manifest = write_lines(data_dir / "stop.jsonl", [json.dumps({"id": i, "video": "videos/a.mp4", "prompt": "P",
                                                                 **line}) for i, line in enumerate(lines)])
    items, problems = load_manifest(manifest)
    assert [(i.id, i.stop) for i in items] == [("0", ("###",)), ("1", ())]
    assert [(p.line, p.message) for p in problems] == [
        (3, "field 'stop' must be a non-empty string or a list of them, got a string"),
        (4, "field 'stop' must be a non-empty string or a list of them, got an array"),
        (5, "field 'stop' must be a non-empty string or a list of them, got an object")]


def test_files_not_checked_when_asked(data_dir):
    manifest = write_lines(data_dir / "later.jsonl", ['{"id": 1, "video": "videos/not_yet.mp4", "prompt": "p"}'])
    items, problems = load_manifest(manifest, check_files=False)
    assert problems == [] and items[0].video == (data_dir / "videos" / "not_yet.mp4").resolve()


def test_unreadable_manifest_raises(tmp_path):
    with pytest.raises(ManifestError, match="cannot read manifest .*nope.jsonl"):
        load_manifest(tmp_path / "nope.jsonl")
    with pytest.raises(ManifestError):
        load_manifest(tmp_path)


def test_check_report_and_exit_codes(data_dir, capsys):
    good = write_lines(data_dir / "good.jsonl", ['{"id": 1, "video": "videos/a.mp4", "prompt": "p"}'])
    assert check_manifest(good) == 0
    assert capsys.readouterr().out == "1 items ok, 0 problems\n"

    bad = write_lines(
        data_dir / "bad.jsonl",
        [
            '{"id": 1, "video": "videos/a.mp4", "prompt": "p"}',
            "# comment",
            '{"id": 1, "video": "videos/a.mp4", "prompt": "p"}',
            "{oops",
        ],
    )
    assert check_manifest(bad) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{bad}:3: duplicate id '1' (first on line 1)"
    assert out[1].startswith(f"{bad}:4: not valid JSON: ")
    assert out[2] == "1 items ok, 2 problems"

    empty = write_lines(data_dir / "empty.jsonl", ["# nothing yet", ""])
    assert check_manifest(empty) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "0 items ok, 0 problems"

    assert check_manifest(data_dir / "absent.jsonl") == 2
    captured = capsys.readouterr()
    assert "absent.jsonl" in captured.err and captured.out == ""

    missing = write_lines(data_dir / "missing.jsonl", ['{"id": 1, "video": "videos/later.mp4", "prompt": "p"}'])
    assert main([str(missing)]) == 1
    assert main([str(missing), "--no-check-files"]) == 0


def test_module_runs_as_a_command(data_dir):
    manifest = write_lines(data_dir / "cli.jsonl", ['{"id": 1, "video": "videos/a.mp4"}'])
    result = subprocess.run(
        [sys.executable, "-m", "vpsd.launch.manifest", str(manifest)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert result.stdout == f"{manifest}:1: missing field 'prompt'\n0 items ok, 1 problems\n"


def test_shards_deal_whole_videos_and_every_entry_to_exactly_one_job(tmp_path):
    """--shard I/N: video groups and bad lines dealt round-robin in the order of their first line; blank and
    comment lines take no turn; a video's questions stay in one shard, a bad line's problems too."""
    for name in "abcd":
        (tmp_path / f"{name}.mp4").write_bytes(b"x")
    lines = []
    for k, video in enumerate("abacbadd"):
        lines.append(json.dumps({"id": f"i{k}", "video": f"{video}.mp4", "prompt": "p"}))
        if k == 2:
            lines += ["", "# a comment", "{not json", json.dumps({"id": 0, "video": "a.mp4", "fps": -1})]
    lines.append(json.dumps({"id": "i8", "video": "a.mp4", "prompt": "p", "num_frames": 4}))  # other frames
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    items, problems = load_manifest(manifest)
    assert len(items) == 9 and len({p.line for p in problems}) == 2 and len(problems) >= 3
    shards = [Shard.parse(f"{i}/3").select(items, problems) for i in range(3)]
    # Entries by first line: a(i0 i2 i5) b(i1 i4) <bad 6> <bad 7> c(i3) d(i6 i7) a-at-4-frames(i8), its own group
    # -> shard 0: a, <bad 7>, a-at-4-frames; 1: b, c; 2: <bad 6>, d (items in manifest order).
    assert [[it.id for it in s[0]] for s in shards] == [["i0", "i2", "i5", "i8"], ["i1", "i3", "i4"], ["i6", "i7"]]
    assert [sorted({p.line for p in s[1]}) for s in shards] == [[7], [], [6]]
    assert sorted(p.message for s in shards for p in s[1]) == sorted(p.message for p in problems)
    assert sorted(it.id for s in shards for it in s[0]) == sorted(it.id for it in items)
    # Shards differ by at most one entry (a video group or a bad line), not by items.
    entries = [len({(str(it.video), it.num_frames) for it in s[0]}) + len({p.line for p in s[1]}) for s in shards]
    assert max(entries) - min(entries) <= 1
    assert Shard.parse("0/1").select(items, problems) == (items, problems)


@pytest.mark.parametrize("text", ["3/3", "-1/2", "1", "a/b", "1/0"])
def test_bad_shard_is_refused_at_launch(text):
    from vpsd.launch.entry import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--config", "c", "--manifest", "m", "--out", "o", "--shard", text])


def test_an_item_travels_to_a_pipeline_as_it_was_read(tmp_path):
    """The coordinator hands items to pipelines as plain data (WorkGrant): every field, control text included."""
    from vpsd.launch.manifest import ManifestItem, load_manifest
    from vpsd.models.prompt import ControlText

    (tmp_path / "a.mp4").write_bytes(b"x")
    (tmp_path / "m.jsonl").write_text(
        '{"id": 7, "video": "a.mp4", "prompt": "p", "fps": 2, "reference": "r"}\n'
        '{"id": "b", "video": "a.mp4", "prompt": "<|im_end|>", "prompt_special_tokens": true, "max_new_tokens": 3,'
        ' "seed": 11}\n')
    items, problems = load_manifest(tmp_path / "m.jsonl")
    assert not problems and (items[0].seed, items[1].seed) == (None, 11) and "seed" not in items[1].extra
    for item in items:
        back = ManifestItem.from_wire(item.to_wire())
        assert back == item and back.extra == item.extra
        assert isinstance(back.prompt, ControlText) == isinstance(item.prompt, ControlText)
    assert isinstance(items[1].prompt, ControlText)


def test_check_opens_every_video_as_a_job_would_and_names_the_kind(data_dir, capsys):
    """A file of random bytes and a text file named .mp4 passed (`14 items ok, 4 problems`) and failed at run time
    as `corrupt`; now `vpsd check` opens each video (container, video stream, first frame) and lists those that
    fail with the kind a job's result row carries. `--fast` keeps the file-level check."""
    v = data_dir / "videos"
    media.write_random_bytes(v / "random.mp4")
    (v / "text.mp4").write_text("not a video at all\n" * 20)
    media.write_audio_only(v / "audio.wav")
    (data_dir / "no_frames").mkdir()
    videos = ["videos/a.mp4", "videos/random.mp4", "videos/text.mp4", "videos/audio.wav", "frames", "no_frames",
              "videos/zero.mp4"]
    manifest = write_lines(data_dir / "m.jsonl", [json.dumps({"id": i, "video": p, "prompt": "p"})
                                                  for i, p in enumerate(videos)])
    assert main([str(manifest)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "2 items ok, 5 problems"  # a.mp4 and the frame folder
    said = {int(line.split(":")[1]): line for line in out[:-1]}
    assert said[2].endswith("[corrupt]") and f"corrupt video {v / 'random.mp4'}: " in said[2]
    assert said[3].endswith("[corrupt]") and said[4].endswith("[no_video_stream]")
    assert said[6].endswith("[empty]") and said[7].endswith("file is empty: " + str(v / "zero.mp4"))
    assert main([str(manifest), "--fast"]) == 1  # only zero.mp4: the files exist
    assert capsys.readouterr().out.splitlines()[-1] == "6 items ok, 1 problems"


@pytest.mark.parametrize("seed", ["-1", "1.5", '"7"', "true"])
def test_a_seed_is_an_integer_of_zero_or_more(tmp_path, seed):
    (tmp_path / "a.mp4").write_bytes(b"x")
    (tmp_path / "m.jsonl").write_text(f'{{"id": 1, "video": "a.mp4", "prompt": "p", "seed": {seed}}}\n')
    items, problems = load_manifest(tmp_path / "m.jsonl")
    assert not items and [p.message for p in problems] == [f"field 'seed' must be an integer >= 0, got {_shown(seed)}"]


def _shown(seed: str) -> str:
    return {"true": "a boolean", '"7"': "a string"}.get(seed, f"the number {json.loads(seed)!r}")
