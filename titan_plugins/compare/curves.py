"""A recorded run as titan-compare sees it: per-step losses and gradient norms at
full float precision, plus where they came from. JSON for --export/--import."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 1


@dataclass
class Curve:
    label: str
    overrides: list[str]
    losses: list[float]
    grad_norms: list[float] = field(default_factory=list)
    params_file: str | None = None  # full final parameters (torch.save of a dict)

    def to_json(self) -> dict:
        return {"format": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> Curve:
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"unsupported curve format {data.get('format')!r} (expected {FORMAT_VERSION})")
        fields = {k: v for k, v in data.items() if k != "format"}
        return cls(**fields)

    def save(self, path: str | Path) -> None:
        # json writes floats with repr(), which round-trips every bit of a float64.
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Curve:
        return cls.from_json(json.loads(Path(path).read_text()))
