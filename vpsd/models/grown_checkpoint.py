"""Grown checkpoints on disk: a scale model written beside its source, recorded, reused, rebuilt when stale.

`ensure_grown(src, dst, width, layers)` is what a config's `grow:` runs on first use: dst holds src grown by
vpsd.models.grow (function-preserving), with src's tokenizer and processor files and `grown_from.json` (the
source's weight hash and the settings); it is reused while that record matches src's current weights and
files, rebuilt when any changed. A checkpoint is written to a temporary directory beside dst and renamed into
place, so a crash never leaves half of one. Processes building the same dst at once (ranks loading the same
model) serialise on one lock file beside it, `.<dst name>.grow.lock`, reused by every later build.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import safetensors
import safetensors.torch
import torch

import vpsd
from vpsd.models.grow import GrowthError, grow_model
from vpsd.models.families import DTYPES, family
from vpsd.models.spec import FAMILY_MODULES

RECORD = "grown_from.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")  # what the source hash covers
# Written by the growth for the grown model (or describing the weights), so never copied from the source.
NOT_COPIED = ("config.json", RECORD, "model.safetensors.index.json", "pytorch_model.bin.index.json")


def checkpoint_family(path: Path) -> str:
    """The vpsd family of a checkpoint directory, from its config.json's model_type."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise GrowthError(f"{path} is not a checkpoint directory (no config.json)")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type not in FAMILY_MODULES:
        raise GrowthError(f"{path}: model_type {model_type!r} is not a supported family ({sorted(FAMILY_MODULES)})")
    return model_type


def weights_sha256(path: Path) -> str:
    """sha256 over a checkpoint's weight files (names and full contents): which weights a grown model came from."""
    files = sorted({f for pattern in WEIGHT_PATTERNS for f in Path(path).glob(pattern)})
    if not files:
        raise GrowthError(f"{path} has no weight files ({', '.join(WEIGHT_PATTERNS)})")
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class GrownFrom:
    """The record in DST/grown_from.json: what a grown checkpoint was made from and how."""

    source: str  # the source checkpoint directory, absolute
    source_sha256: str  # weights_sha256 of the source
    width: int
    layers: int
    source_layers: int
    dtype: str | None  # the dtype asked for (None: the source's own)
    vpsd_version: str
    extra_layers: str = "appended after the last trained layer: copies of it with o_proj and down_proj zeroed"

    @classmethod
    def read(cls, dst: Path) -> "GrownFrom | None":
        try:
            return cls(**json.loads((Path(dst) / RECORD).read_text()))
        except (OSError, ValueError, TypeError):
            return None  # missing, unreadable or from another version: treated as not grown


def _side_files(src: Path) -> list[Path]:
    """Tokenizer, processor, chat template and generation files: every top-level non-weight file of src."""
    return [f for f in sorted(Path(src).iterdir())
            if f.is_file() and f.name not in NOT_COPIED and not any(f.match(p) for p in WEIGHT_PATTERNS)]


def _copy_side_files(src: Path, dst: Path) -> None:
    for f in _side_files(src):
        shutil.copy2(f, dst / f.name)


def _side_files_match(src: Path, dst: Path) -> bool:
    """dst carries src's side files as they are now (a source that gained a processor config or a chat
    template after its scale model was built makes that model stale too)."""
    return all((dst / f.name).is_file() and (dst / f.name).read_bytes() == f.read_bytes() for f in _side_files(src))


def _publish_modes(tmp: Path) -> None:
    """mkdtemp (and save_pretrained's own temporary files) leave 0700 / 0600: give the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    for f in tmp.iterdir():
        os.chmod(f, 0o666 & ~umask)


def _replace_dir(tmp: Path, dst: Path) -> None:
    """Moves a finished checkpoint into place; an existing dst must be a grown checkpoint (or empty)."""
    if dst.exists():
        if not (dst / RECORD).is_file() and any(dst.iterdir()):
            raise GrowthError(f"{dst} exists and is not a grown checkpoint (no {RECORD}); not overwriting it")
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.replace(dst, old / dst.name)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)


def _write_checkpoint(model, out: Path) -> None:
    """config.json, generation_config.json and model.safetensors, written by this process whatever its rank.

    Not `save_pretrained`: under an initialised torch.distributed it writes only on rank 0, so a draft grown on
    rank 1 published a directory with neither config nor weights and then failed to load it. The files are read
    back before the directory is published: a checkpoint that cannot be read never takes dst's place."""
    model.config.to_json_file(out / "config.json")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.to_json_file(out / "generation_config.json")
    weights = out / "model.safetensors"
    safetensors.torch.save_model(model, str(weights), metadata={"format": "pt"})  # shared tensors once
    with safetensors.safe_open(str(weights), framework="pt") as f:
        names = set(f.keys())
    state = model.state_dict()
    missing = [n for n in state if n not in names and not _is_tied_copy(state, n)]
    if missing or json.loads((out / "config.json").read_text()).get("model_type") != model.config.model_type:
        raise GrowthError(f"the grown checkpoint written to {out} does not read back (missing {missing[:3]})")


def _is_tied_copy(state: dict[str, torch.Tensor], name: str) -> bool:
    """Whether `name` shares its storage with another entry (saved once, under the other name)."""
    ptr = state[name].data_ptr()
    return any(other != name and t.data_ptr() == ptr for other, t in state.items())


def grow_checkpoint(src: Path, dst: Path, width: int, layers: int, dtype: str | None = None) -> Path:
    """Loads the checkpoint at src (local, offline), grows it and writes a normal checkpoint directory to dst.

    dst gets config.json, model.safetensors, generation_config.json, the source's tokenizer/processor files
    and grown_from.json. It is written to a temporary directory beside dst and renamed into place, so a crash
    never leaves a half checkpoint. An existing dst is replaced only if it is itself a grown checkpoint.
    dtype: "float32", "bfloat16" or "float16"; None keeps the source's.
    """
    src, dst = Path(src), Path(dst)
    name = checkpoint_family(src)
    if dtype is not None and dtype not in DTYPES:
        raise GrowthError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if dst.resolve() == src.resolve():
        raise GrowthError("the grown checkpoint cannot replace its source")
    source_sha = weights_sha256(src)
    model = family(name).model_class.from_pretrained(src, dtype=DTYPES[dtype] if dtype else "auto")
    grown = grow_model(model.eval(), width, layers)
    record = GrownFrom(
        source=str(src.resolve()),
        source_sha256=source_sha,
        width=width,
        layers=layers,
        source_layers=int(model.config.get_text_config().num_hidden_layers),
        dtype=dtype,
        vpsd_version=vpsd.__version__,
    )
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        _write_checkpoint(grown, tmp)
        _copy_side_files(src, tmp)
        (tmp / RECORD).write_text(json.dumps(record.__dict__, indent=2) + "\n")
        _publish_modes(tmp)
        _replace_dir(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    return dst


def is_grown(src: Path, dst: Path, width: int, layers: int, dtype: str | None = None) -> bool:
    """Whether dst holds a checkpoint grown from src's current weights with these settings."""
    record = GrownFrom.read(dst)
    return (
        record is not None
        and (Path(dst) / "config.json").is_file()
        and any(Path(dst).glob("*.safetensors"))
        and (record.width, record.layers, record.dtype) == (width, layers, dtype)
        and record.source_sha256 == weights_sha256(src)
        and _side_files_match(Path(src), Path(dst))
    )


def ensure_grown(src: Path, dst: Path, width: int, layers: int, dtype: str | None = None) -> Path:
    """dst, grown from src on first use; reused while grown_from.json matches src's weights, width, layers
    and dtype, rebuilt when any of them changed (the source hash reads every source weight byte).

    Processes calling this at once (ranks loading the same model) serialise on `lock_path(dst)`, one file
    beside dst that every later build reuses (git-ignored): the first builds, the others wait and then reuse;
    none moves a checkpoint away while another reads it. (It is not removed: unlinking a file others may be
    waiting on would let a newcomer lock a fresh one and build beside them.)
    """
    src, dst = Path(src), Path(dst)
    if is_grown(src, dst, width, layers, dtype):
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(dst), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not is_grown(src, dst, width, layers, dtype):  # another process may have built it meanwhile
            grow_checkpoint(src, dst, width, layers, dtype)
    return dst


def lock_path(dst: Path) -> Path:
    """The lock file that guards building `dst`: beside it, one per destination."""
    return Path(dst).parent / f".{Path(dst).name}.grow.lock"
