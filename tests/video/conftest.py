"""The video corpus (tests/video/corpus.py), written once per test session into a temporary folder."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from tests.video.corpus import Entry, missing_codecs


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Entry], Path]:
    """`corpus(entry)`: the path of that entry's file, written on first use; the test is skipped, saying why,
    when this PyAV build lacks the entry's encoder or decoder."""
    folder = tmp_path_factory.mktemp("video-corpus")
    built: dict[str, Path] = {}

    def get(entry: Entry) -> Path:
        why = missing_codecs(entry)
        if why is not None:
            pytest.skip(why)
        if entry.name not in built:
            built[entry.name] = entry.build(folder / entry.name)
        return built[entry.name]

    return get
