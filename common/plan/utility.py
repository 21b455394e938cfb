"""Utility profiles (paper III-A/B): per layer-group and relative-position-bin sensitivity -> block utility.

A profile holds normalised scores for layer groups and for relative token-position bins (the paper's
Fig. 2a/2b). A cell c = (layer group, position bin) has utility u_c = layer_score * position_score
(unless the profile stores a full ``cell_scores`` matrix). Following paper III-B, each cell's utility is
spread over the blocks that overlap it, alpha_{b,c} = share of cell c's (layer, token) area inside block
b, so sum_b alpha_{b,c} = 1 and U_b = sum_c alpha_{b,c} u_c. Blocks are sent in non-increasing U_b.

File format (JSON, ``format: "pfec-utility-profile/1"``)::

    {"format": "pfec-utility-profile/1",
     "model": {"id": ..., "fingerprint": ..., "n_layers": 30},
     "layer_groups": [[0, 3], [3, 6], ...],          # half-open layer ranges covering every layer
     "position_bins": [0.0, 0.1, ..., 1.0],          # bin edges over relative position t / T
     "layer_scores": [...], "position_scores": [...], # non-negative, normalised to sum 1
     "cell_scores": [[...], ...] | null,              # optional full G x P matrix
     "source": {...}}                                 # how it was measured (free-form)
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from pfec.common.plan.kvlayout import BlockPlan

PROFILE_FORMAT = "pfec-utility-profile/1"
#: The repo's profile directory: each daemon's default ``profiles.directory``.
DEFAULT_PROFILE_DIR: Final = Path(__file__).resolve().parents[2] / "profiles"
# The default model's profile, shipped with the repo (data stays outside the Python packages).
SHIPPED_PROFILE_NAME: Final = "smollm2-135m-instruct"
SHIPPED_PROFILE = DEFAULT_PROFILE_DIR / f"{SHIPPED_PROFILE_NAME}.json"
#: Largest profile file a daemon reads (the shipped one is ~5 KB).
MAX_PROFILE_BYTES: Final = 4 << 20
#: Profile names that need no file: the stand-in and the shipped profile.
BUILTIN_PROFILES: Final = ("synthetic", "shipped")
PROFILE_NAME_MAX: Final = 64
_PROFILE_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


class ProfileError(ValueError):
    """A profile name that is malformed, unknown here or names an unusable file. The message names the
    field, the name and the reason; it never quotes the file's contents."""


def check_profile_name(name: object, field_name: str = "profile") -> str:
    """``name`` if it is a profile name (``[a-z0-9][a-z0-9._-]{0,63}``: never a path), else ProfileError."""
    if not isinstance(name, str) or not _PROFILE_NAME.fullmatch(name):
        shown = repr(name[:PROFILE_NAME_MAX]) if isinstance(name, str) else type(name).__name__
        raise ProfileError(
            f"{field_name}: bad value {shown} — a profile is named by 1-{PROFILE_NAME_MAX} characters "
            "[a-z0-9._-] starting with a letter or digit (a name in the node's profile directory, never a "
            "path)"
        )
    return name


@dataclass(frozen=True)
class UtilityProfile:
    model_id: str
    n_layers: int
    layer_groups: tuple[tuple[int, int], ...]
    position_bins: tuple[float, ...]
    layer_scores: tuple[float, ...]
    position_scores: tuple[float, ...]
    cell_scores: tuple[tuple[float, ...], ...] | None = None
    fingerprint: str | None = None
    source: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        covered = sorted(self.layer_groups)
        if (
            not covered
            or covered[0][0] != 0
            or covered[-1][1] != self.n_layers
            or any(a[1] != b[0] for a, b in itertools.pairwise(covered))
        ):
            raise ValueError(
                f"profile layer_groups {list(self.layer_groups)} must tile layers 0..{self.n_layers}"
            )
        edges = self.position_bins
        if (
            len(edges) < 2
            or edges[0] != 0.0
            or edges[-1] != 1.0
            or any(b <= a for a, b in itertools.pairwise(edges))
        ):
            raise ValueError(f"profile position_bins {list(edges)} must increase from 0.0 to 1.0")
        if len(self.layer_scores) != len(self.layer_groups):
            raise ValueError("profile needs one layer score per layer group")
        if len(self.position_scores) != len(edges) - 1:
            raise ValueError("profile needs one position score per position bin")
        if min(self.layer_scores) < 0 or min(self.position_scores) < 0:
            raise ValueError("profile scores must be non-negative")
        if self.cell_scores is not None and (
            len(self.cell_scores) != len(self.layer_groups)
            or any(len(row) != len(self.position_scores) for row in self.cell_scores)
        ):
            raise ValueError("profile cell_scores must be a layer-groups x position-bins matrix")

    def cell_matrix(self) -> npt.NDArray[np.float64]:
        """u_c for every (layer group, position bin), normalised to sum 1."""
        if self.cell_scores is not None:
            cells = np.asarray(self.cell_scores, dtype=np.float64)
        else:
            cells = np.outer(self.layer_scores, self.position_scores)
        total = cells.sum()
        if total <= 0:
            raise ValueError("profile has no positive utility")
        return np.asarray(cells / total, dtype=np.float64)

    def block_utilities(self, plan: BlockPlan) -> npt.NDArray[np.float64]:
        """U_b for every block of ``plan`` (paper III-B); sums to 1."""
        if plan.geometry.n_layers != self.n_layers:
            raise ValueError(
                f"profile {self.model_id!r} is for {self.n_layers} layers, the plan has "
                f"{plan.geometry.n_layers}: profile the model first (pfec profile)"
            )
        cells = self.cell_matrix()
        n_tok = plan.n_tokens
        # Per-token share of each position bin: token t sits at relative position (t + 0.5) / T.
        rel = (np.arange(n_tok) + 0.5) / n_tok
        bin_of_token = np.clip(
            np.searchsorted(self.position_bins, rel, side="right") - 1, 0, len(self.position_scores) - 1
        )
        tokens_in_bin = np.bincount(bin_of_token, minlength=len(self.position_scores)).astype(np.float64)
        # Token weight within its bin: alpha over positions (empty bins carry no weight).
        group_of_layer = np.empty(self.n_layers, dtype=np.int64)
        for g, (lo, hi) in enumerate(self.layer_groups):
            group_of_layer[lo:hi] = g
        layers_in_group = np.array([hi - lo for lo, hi in self.layer_groups], dtype=np.float64)
        utils = np.zeros(plan.n_blocks, dtype=np.float64)
        tb_count = plan.n_token_blocks
        for tb in range(tb_count):
            start, end = plan.block_token_range(tb)
            bins, counts = np.unique(bin_of_token[start:end], return_counts=True)
            share = np.zeros(len(self.position_scores))
            share[bins] = counts / tokens_in_bin[bins]
            per_group = cells @ share  # utility of this token block within each layer group
            for layer in range(self.n_layers):
                g = group_of_layer[layer]
                utils[layer * tb_count + tb] = per_group[g] / layers_in_group[g]
        total = utils.sum()
        return utils / total if total > 0 else np.full(plan.n_blocks, 1.0 / plan.n_blocks)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "model": {"id": self.model_id, "fingerprint": self.fingerprint, "n_layers": self.n_layers},
            "layer_groups": [list(g) for g in self.layer_groups],
            "position_bins": list(self.position_bins),
            "layer_scores": list(self.layer_scores),
            "position_scores": list(self.position_scores),
            "cell_scores": None if self.cell_scores is None else [list(r) for r in self.cell_scores],
            "source": self.source,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: dict[str, Any], origin: str = "<profile>") -> UtilityProfile:
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{origin}: format {data.get('format')!r} is not {PROFILE_FORMAT!r}")
        try:
            model = data["model"]
            cells = data.get("cell_scores")
            return cls(
                model_id=str(model["id"]),
                fingerprint=model.get("fingerprint"),
                n_layers=int(model["n_layers"]),
                layer_groups=tuple((int(a), int(b)) for a, b in data["layer_groups"]),
                position_bins=tuple(float(x) for x in data["position_bins"]),
                layer_scores=tuple(float(x) for x in data["layer_scores"]),
                position_scores=tuple(float(x) for x in data["position_scores"]),
                cell_scores=None if cells is None else tuple(tuple(float(x) for x in r) for r in cells),
                source=dict(data.get("source") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{origin}: not a valid utility profile ({exc})") from exc

    @classmethod
    def from_bytes(cls, raw: bytes, name: str, n_layers: int | None = None) -> UtilityProfile:
        """Parse a profile file's bytes; ProfileError names the profile and the reason, never the contents."""
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise ProfileError(f"profile {name!r}: the file is not UTF-8 JSON") from None
        if not isinstance(data, dict):
            raise ProfileError(f"profile {name!r}: the file is not a JSON object")
        try:
            profile = cls.from_json(data, origin=name)
        except ValueError:
            raise ProfileError(
                f"profile {name!r}: not a valid {PROFILE_FORMAT} file (check it with `pfec profile-plot`)"
            ) from None
        if n_layers is not None and profile.n_layers != n_layers:
            raise ProfileError(f"profile {name!r} is for {profile.n_layers} layers, the model has {n_layers}")
        return profile

    @classmethod
    def load(cls, path: str | Path) -> UtilityProfile:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ValueError(f"utility profile {str(p)!r} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"utility profile {str(p)!r} is not JSON: {exc}") from None
        return cls.from_json(data, origin=str(p))


def synthetic_profile(n_layers: int = 30, n_groups: int = 10, n_bins: int = 10) -> UtilityProfile:
    """The documented stand-in used when no measured profile is given.

    Shaped like the paper's Fig. 2: early layers most sensitive (exponential decay over layer groups
    with a floor), and a U-shaped position profile (the prompt prefix and the recent context matter more
    than the middle). Deterministic; not a measurement of any model.
    """
    n_groups = min(n_groups, n_layers)
    bounds = np.linspace(0, n_layers, n_groups + 1).round().astype(int)
    groups = tuple((int(a), int(b)) for a, b in itertools.pairwise(bounds))
    g = np.arange(n_groups)
    layer_scores = np.exp(-g / 2.0) + 0.15
    centres = (np.arange(n_bins) + 0.5) / n_bins
    position_scores = 0.4 + 2.5 * np.exp(-centres / 0.08) + 1.5 * np.exp(-(1.0 - centres) / 0.12)
    return UtilityProfile(
        model_id="synthetic",
        n_layers=n_layers,
        layer_groups=groups,
        position_bins=tuple(float(x) for x in np.linspace(0.0, 1.0, n_bins + 1)),
        layer_scores=tuple(float(x) for x in layer_scores / layer_scores.sum()),
        position_scores=tuple(float(x) for x in position_scores / position_scores.sum()),
        source={"kind": "synthetic", "doc": "pfec.common.plan.utility.synthetic_profile"},
    )


def utility_order(block_utilities: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
    """Block ids in non-increasing utility (ties keep plan order): the paper's source queue S*."""
    return np.argsort(-np.asarray(block_utilities), kind="stable").astype(np.int64)


def fifo_order(n_blocks: int) -> npt.NDArray[np.int64]:
    """Plan order (layer-major), what utility-blind schemes send."""
    return np.arange(n_blocks, dtype=np.int64)


def request_block_utilities(
    plan: BlockPlan, attention_mass: npt.NDArray[np.floating]
) -> npt.NDArray[np.float64]:
    """Per-request U_b from the sender's own prefill (SnapKV/H2O style); sums to 1.

    ``attention_mass`` [layers, KV heads, tokens] is the softmax mass each KV row received from the last
    queries of the context (``llm.prefill(..., observe_window=W)``). Every layer's mass sums to the same
    total, so this ranks blocks within a layer and weighs layers equally; blend it with a profile to get
    the profile's view of layers.
    """
    mass = np.asarray(attention_mass, dtype=np.float64)
    want = (plan.geometry.n_layers, plan.geometry.n_kv_heads, plan.n_tokens)
    if mass.shape != want:
        raise ValueError(f"attention mass has shape {mass.shape}, the plan needs {want}")
    per_token = mass.sum(axis=1)  # [layers, tokens]
    pad = plan.n_token_blocks * plan.block_tokens - plan.n_tokens
    per_block = np.pad(per_token, ((0, 0), (0, pad))).reshape(plan.geometry.n_layers, plan.n_token_blocks, -1)
    per_block = per_block.sum(axis=2)
    layer_total = per_block.sum(axis=1, keepdims=True)
    share = np.divide(per_block, layer_total, out=np.full_like(per_block, 1.0 / plan.n_token_blocks),
                      where=layer_total > 0)
    return np.asarray((share / plan.geometry.n_layers).reshape(-1), dtype=np.float64)


def blend_utilities(profile_utilities: npt.NDArray[np.float64], request_utilities: npt.NDArray[np.float64],
                    request_weight: float = 0.5) -> npt.NDArray[np.float64]:
    """(1 - w) * profile + w * request; w = 1 replaces the profile, w = 0 ignores the request."""
    if not 0.0 <= request_weight <= 1.0:
        raise ValueError(f"request weight {request_weight!r} must lie in [0, 1]")
    a, b = np.asarray(profile_utilities, np.float64), np.asarray(request_utilities, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"utility vectors differ in shape: {a.shape} vs {b.shape}")
    return (1.0 - request_weight) * a + request_weight * b


UTILITY_MODES = ("profile", "request", "blend")


def handoff_utilities(plan: BlockPlan, profile: UtilityProfile, mode: str = "profile",
                      attention_mass: npt.NDArray[np.floating] | None = None,
                      request_weight: float = 0.5) -> npt.NDArray[np.float64]:
    """U_b the sender orders by: the offline profile, the per-request attention utility, or a blend."""
    if mode not in UTILITY_MODES:
        raise ValueError(f"utility mode {mode!r} is not one of {', '.join(UTILITY_MODES)}")
    if mode == "profile":
        return profile.block_utilities(plan)
    if attention_mass is None:
        raise ValueError(
            f"utility mode {mode!r} needs the prefill's attention mass (prefill with observe_window)"
        )
    request = request_block_utilities(plan, attention_mass)
    if mode == "request":
        return request
    return blend_utilities(profile.block_utilities(plan), request, request_weight)
