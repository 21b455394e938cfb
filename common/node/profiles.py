"""Utility profiles by name, from a node's own profile directory (``profiles.directory``).

A handoff names its profile (``common/plan/utility.check_profile_name``: ``[a-z0-9][a-z0-9._-]{0,63}``),
never a path: ``synthetic`` is the built-in stand-in, ``shipped`` the repo's measured profile, and any
other NAME is ``DIRECTORY/NAME.json``. The file is opened non-blocking (a FIFO cannot stall the reader),
must be a regular file of at most ``max_bytes`` and is read to at most that; errors name the profile and
the reason (``ProfileError``), never the file's contents. ``load`` blocks on the file system: the daemons
call it off the event loop (``resolve``).
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections import OrderedDict
from concurrent.futures import Executor
from pathlib import Path
from typing import Final

from pfec.common.plan.utility import (
    MAX_PROFILE_BYTES,
    SHIPPED_PROFILE,
    ProfileError,
    UtilityProfile,
    check_profile_name,
    synthetic_profile,
)

__all__ = ["ProfileError", "ProfileStore"]

CACHE_SIZE: Final = 32  # profiles kept parsed (only successes are cached; names come from peers)


class ProfileStore:
    """Resolves profile names in one directory, with a small cache of parsed profiles."""

    def __init__(self, directory: Path, max_bytes: int = MAX_PROFILE_BYTES) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._cache: OrderedDict[tuple[str, int], UtilityProfile] = OrderedDict()

    def path_of(self, name: str) -> Path:
        """Where profile ``name`` lives (for operators and logs, never for a peer)."""
        check_profile_name(name)
        return SHIPPED_PROFILE if name == "shipped" else self.directory / f"{name}.json"

    def cached(self, name: str, n_layers: int) -> UtilityProfile | None:
        """The profile if it is built in or already parsed (no file access): usable on the event loop."""
        if name == "synthetic":
            return synthetic_profile(n_layers)
        return self._cache.get((name, n_layers))

    def load(self, name: str, n_layers: int) -> UtilityProfile:
        """Profile ``name`` for a model of ``n_layers`` layers; ProfileError otherwise. Blocks (file I/O)."""
        check_profile_name(name)
        hit = self.cached(name, n_layers)
        if hit is not None:
            return hit
        raw = self._read(name)
        profile = UtilityProfile.from_bytes(raw, name, n_layers)
        self._cache[(name, n_layers)] = profile
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return profile

    async def resolve(self, name: str, n_layers: int, executor: Executor | None = None) -> UtilityProfile:
        """``load`` off the event loop (in ``executor``, default the loop's), unless already cached."""
        hit = self.cached(check_profile_name(name), n_layers)
        if hit is not None:
            return hit
        return await asyncio.get_running_loop().run_in_executor(executor, self.load, name, n_layers)

    def _read(self, name: str) -> bytes:
        path = self.path_of(name)
        try:
            # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer; O_NOCTTY: a
            # terminal device never becomes ours. The fstat below refuses anything but a regular file.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ProfileError(f"profile {name!r}: unknown (no such profile in this node's profile "
                               "directory)") from None
        except OSError as exc:
            raise ProfileError(f"profile {name!r}: cannot be opened ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ProfileError(f"profile {name!r}: not a regular file (refused)")
            if st.st_size > self.max_bytes:
                raise ProfileError(f"profile {name!r}: {st.st_size} bytes, above the {self.max_bytes}-byte "
                                   "limit (profiles.max_bytes)")
            chunks: list[bytes] = []
            left = self.max_bytes + 1
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 16))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
        except OSError as exc:
            raise ProfileError(f"profile {name!r}: cannot be read ({exc.strerror})") from None
        finally:
            os.close(fd)
        raw = b"".join(chunks)
        if len(raw) > self.max_bytes:  # grew after the fstat
            raise ProfileError(f"profile {name!r}: above the {self.max_bytes}-byte limit "
                               "(profiles.max_bytes)")
        return raw
