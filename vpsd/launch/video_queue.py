"""The job's queue of items, grouped by video: a video's questions go to one pipeline, one after another.

VideoMME asks 3 questions of each video, MLVU and LongVideoBench about 2; a pipeline keeps a video's work (its
frames, the target's KV of the shared prefix: engine/prefix_cache.py) for a while, so the questions about one video
are worth decoding together, on the pipeline that already holds it, whatever their order in the manifest.

- A group is the items that read the same frames: the same video file and the same frame request (count or
  rate). Groups keep the order of their first item in the manifest; a group's items keep theirs.
- `take(pipeline)`: the next item of the group this pipeline holds, while it has items; else the first group no
  pipeline holds, which the pipeline then holds; else (every group left is held by another pipeline: the job's
  tail) an item of the group with the most items left, so that no pipeline idles while work is left.
- `deal(groups, index, count)` (`--shard I/N`): whole groups dealt round-robin, so a video stays in one shard.

The queue is pure (no I/O): the coordinator calls it from its one thread.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Hashable, Iterable, Protocol, TypeVar


class QueuedItem(Protocol):
    @property
    def video(self) -> object: ...

    @property
    def num_frames(self) -> int | None: ...

    @property
    def fps(self) -> float | None: ...


T = TypeVar("T", bound=QueuedItem)


def video_key(item: QueuedItem) -> Hashable:
    """What two items must share to read the same frames."""
    return str(item.video), item.num_frames, item.fps


def groups_of(items: Iterable[T]) -> list[list[T]]:
    """The items grouped by video (`video_key`), groups in the order of their first item, items in theirs."""
    groups: OrderedDict[Hashable, list[T]] = OrderedDict()
    for item in items:
        groups.setdefault(video_key(item), []).append(item)
    return list(groups.values())


class VideoQueue:
    def __init__(self, items: Iterable[T]) -> None:
        self._groups: OrderedDict[Hashable, deque] = OrderedDict(
            (video_key(g[0]), deque(g)) for g in groups_of(items))
        self._held: dict[Hashable, Hashable] = {}  # pipeline -> the group it holds
        self._holder: dict[Hashable, Hashable] = {}  # group -> the pipeline that holds it

    def __len__(self) -> int:
        return sum(len(g) for g in self._groups.values())

    def __bool__(self) -> bool:
        return bool(self._groups)

    def take(self, pipeline: Hashable):
        """The next item for `pipeline` (module docstring), or None when none is left."""
        key = self._held.get(pipeline)
        if key is None or key not in self._groups:
            key = next((k for k in self._groups if k not in self._holder), None)
            if key is None:  # the tail: help with the largest group left
                key = max(self._groups, key=lambda k: len(self._groups[k]), default=None)
                if key is None:
                    return None
            else:
                self._release(pipeline)
                self._held[pipeline], self._holder[key] = key, pipeline
        group = self._groups[key]
        item = group.popleft()
        if not group:
            del self._groups[key]
            holder = self._holder.pop(key, None)
            if holder is not None and self._held.get(holder) == key:
                del self._held[holder]
        return item

    def _release(self, pipeline: Hashable) -> None:
        old = self._held.pop(pipeline, None)
        if old is not None and self._holder.get(old) == pipeline:
            del self._holder[old]


def deal(items: list[T], index: int, count: int) -> list[T]:
    """Shard `index` of `count`: whole video groups dealt round-robin in the order of their first item."""
    return [item for j, group in enumerate(groups_of(items)) if j % count == index for item in group]
