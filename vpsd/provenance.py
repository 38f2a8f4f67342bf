"""The software stack a run ran on: what a user comparing two runs needs to see that it changed.

`stack()` is recorded by every run (its run directory's config.json and summary.json's `run` section), and
`vpsd summary` prints it, and names what changed against a baseline run. The lock is requirements.lock, the set
CI tested (scripts/lock.sh); `lock_sha256` identifies it and `off_lock` lists the installed packages whose
version is not the lock's (empty: the run ran on exactly the tested set). A wheel install of vpsd carries no
lock: then both are None.
"""

from __future__ import annotations

import hashlib
import platform
import re
from importlib import metadata
from pathlib import Path

import vpsd

LOCK = Path(vpsd.__file__).resolve().parents[1] / "requirements.lock"
_PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)")
# The versions a run reports by name (the rest of the stack only through the lock's hash and off_lock).
SHOWN = ("torch", "transformers", "tokenizers", "pyzmq", "av")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> str:
    """A version without its local build label: 2.13.0+cpu and 2.13.0+cu130 are the locked 2.13.0."""
    return version.split("+", 1)[0]


def lock_pins(text: str) -> dict[str, str]:
    """{normalised name: version} of a lock file's `name==version` lines."""
    return {_normal(m[1]): m[2] for line in text.splitlines() if (m := _PIN.match(line.strip()))}


def off_lock(pins: dict[str, str]) -> list[str]:
    """`name installed (lock version)` for every locked package that is installed at another release."""
    found = []
    for name, version in sorted(pins.items()):
        have = _installed(name)
        if have is not None and _release(have) != version:
            found.append(f"{name} {have} (lock {version})")
    return found


def stack(lock: Path = LOCK) -> dict:
    """The versions this process runs on, and how they stand against the lock."""
    info: dict = {"python": platform.python_version(), "vpsd": vpsd.__version__}
    info.update({name: _installed(name) for name in SHOWN})
    if lock.is_file():
        text = lock.read_text()
        info["lock_sha256"] = hashlib.sha256(text.encode()).hexdigest()
        info["off_lock"] = off_lock(lock_pins(text))
    else:
        info["lock_sha256"] = info["off_lock"] = None
    return info


def describe(info: dict) -> str:
    """One line: `torch 2.13.0+cpu, transformers 5.23.0, ..., lock 07957cd1 (exact)`."""
    parts = [f"{name} {info[name]}" for name in ("vpsd", "python", *SHOWN) if info.get(name)]
    if info.get("lock_sha256"):
        off = info.get("off_lock") or []
        parts.append(f"lock {info['lock_sha256'][:8]} ({'exact' if not off else 'off it: ' + ', '.join(off)})")
    else:
        parts.append("no lock")
    return ", ".join(parts)


def changes(before: dict, after: dict) -> list[str]:
    """`name A -> B` for every recorded version that differs between two stacks."""
    keys = ("vpsd", "python", *SHOWN, "lock_sha256")
    return [f"{k} {before.get(k)} -> {after.get(k)}" for k in keys if before.get(k) != after.get(k)]


def main() -> int:
    """`python -m vpsd.provenance`: the stack this environment gives a run, on one line."""
    print(describe(stack()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
