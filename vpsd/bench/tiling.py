"""A manifest repeated, so that a large batch has items to keep it full (`vpsd bench throughput --tile K`)."""

from __future__ import annotations

import json
from pathlib import Path


def tile_manifest(manifest: Path, times: int, out: Path) -> Path:
    """The manifest `times` over (ids suffixed #k, video paths made absolute), written to OUT/manifest_xK.jsonl."""
    if times <= 1:
        return manifest
    lines = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    rows = []
    for k in range(times):
        for item in lines:
            video = Path(item["video"])
            rows.append({**item, "id": f"{item['id']}#{k}",
                         "video": str(video if video.is_absolute() else (manifest.parent / video).resolve())})
    path = out / f"manifest_x{times}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
