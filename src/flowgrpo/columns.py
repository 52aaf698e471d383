"""The column schema: one place that names every tensor the services exchange.

A column has a name, a dtype and a shape pattern. Each pipeline stage declares the columns it
consumes and produces; :func:`check_pipeline` runs at start-up, before any data moves, and names
the first missing column (the reference stacks found out with a ``KeyError`` minutes into the
first rollout). Stores check every tensor against its column when it is put on the bus.

Shape patterns: an ``int`` is an exact size, a ``str`` is a symbolic dimension that binds to
the first size it meets within one tensor (``("N", "N")`` accepts 3x3, refuses 3x4), and
``"*"`` accepts any size. ``...`` as the first entry accepts any number of leading dimensions.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import EllipsisType

Dim = int | str
ShapePattern = tuple[Dim | EllipsisType, ...]


# A trajectory's ``precision`` on the wire (rollout Sample -> trainer TrainSample): how its rollout
# computed the gen path's linear layers. "": in its weights' dtype; FP8: e4m3 (rollout.precision=fp8)
FP8 = "fp8"
SAMPLE_PRECISIONS = ("", FP8)


class SchemaViolation(ValueError):
    """A tensor does not match its column's dtype or shape, or the column is unknown."""


class PipelineError(ValueError):
    """A stage consumes a column that no earlier stage produces."""


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    dtype: str
    shape: ShapePattern
    doc: str = ""

    def check(self, dtype: str, shape: Sequence[int], where: str = "") -> None:
        """Raise :class:`SchemaViolation` unless ``dtype`` and ``shape`` match this column."""
        at = f" ({where})" if where else ""
        if self.dtype not in ("*", dtype):
            raise SchemaViolation(
                f"column {self.name!r}{at}: dtype {dtype} does not match the schema's {self.dtype}"
            )
        problem = _shape_mismatch(self.shape, tuple(shape))
        if problem:
            raise SchemaViolation(
                f"column {self.name!r}{at}: shape {list(shape)} does not match the pattern "
                f"{self.pattern_str()}: {problem}"
            )

    def pattern_str(self) -> str:
        return "[" + ", ".join("..." if d is ... else str(d) for d in self.shape) + "]"


def _shape_mismatch(pattern: ShapePattern, shape: tuple[int, ...]) -> str:
    if pattern and pattern[0] is ...:
        fixed = pattern[1:]
        if len(shape) < len(fixed):
            return f"needs at least {len(fixed)} dimensions, got {len(shape)}"
        pattern, shape = fixed, shape[len(shape) - len(fixed) :]
    elif len(shape) != len(pattern):
        return f"needs {len(pattern)} dimensions, got {len(shape)}"
    bound: dict[str, int] = {}
    for axis, (want, got) in enumerate(zip(pattern, shape, strict=True)):
        if isinstance(want, int) and want != got:
            return f"dimension {axis} must be {want}, got {got}"
        if isinstance(want, str) and want != "*" and bound.setdefault(want, got) != got:
            return f"dimension {axis} ({want}) is {got} but {want} = {bound[want]} earlier"
    return ""


@dataclass(frozen=True)
class StageSpec:
    """What one stage of the pipeline reads and writes, by column name."""

    stage: str
    consumes: tuple[str, ...] = ()
    produces: tuple[str, ...] = ()


@dataclass
class ColumnRegistry:
    columns: dict[str, ColumnSpec] = field(default_factory=dict)

    def register(self, spec: ColumnSpec) -> ColumnSpec:
        old = self.columns.get(spec.name)
        if old is not None and old != spec:
            raise ValueError(f"column {spec.name!r} registered twice with different specs: {old} vs {spec}")
        self.columns[spec.name] = spec
        return spec

    def get(self, name: str) -> ColumnSpec:
        try:
            return self.columns[name]
        except KeyError:
            raise SchemaViolation(f"unknown column {name!r}{_suggest(name, self.columns)}") from None

    def check(self, column: str, dtype: str, shape: Sequence[int], where: str = "") -> None:
        self.get(column).check(dtype, shape, where)

    def __contains__(self, name: object) -> bool:
        return name in self.columns


def _suggest(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=3)
    known_list = ", ".join(sorted(known))
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    return f"{hint} (known columns: {known_list})"


def check_pipeline(
    stages: Sequence[StageSpec],
    registry: ColumnRegistry,
    inputs: Iterable[str] = (),
) -> None:
    """Check that every column a stage consumes is produced by the inputs or an earlier stage.

    ``stages`` are in data-flow order; ``inputs`` are the columns the run starts with (the
    prepared dataset). Every column named anywhere must be registered. Raises
    :class:`PipelineError` naming the stage, the missing column and who produces what.
    """
    available: dict[str, str] = {}
    for name in inputs:
        registry.get(name)
        available[name] = "the dataset"
    for stage in stages:
        for name in stage.consumes:
            if name not in registry:
                hint = _suggest(name, registry.columns)
                raise PipelineError(f"stage {stage.stage!r} consumes unknown column {name!r}{hint}")
            if name not in available:
                produced = ", ".join(f"{c} (by {s})" for c, s in available.items()) or "nothing"
                raise PipelineError(
                    f"stage {stage.stage!r} consumes column {name!r}, which no earlier stage produces; "
                    f"available at that point: {produced}"
                )
        for name in stage.produces:
            registry.get(name)
            available.setdefault(name, stage.stage)


def stage_from_proto(msg: object) -> StageSpec:
    """Build a :class:`StageSpec` from a ``flowgrpo.v1.StageSpec`` message."""
    return StageSpec(
        stage=msg.stage,  # type: ignore[attr-defined]
        consumes=tuple(msg.consumes),  # type: ignore[attr-defined]
        produces=tuple(msg.produces),  # type: ignore[attr-defined]
    )


# The columns of the FlowGRPO pipeline. B = samples, L = prompt tokens, W = SDE window steps,
# N = latent tokens (one per 16x16 pixel block), H/W = image pixels.
COLUMNS = ColumnRegistry()
for _spec in (
    ColumnSpec("prompt_ids", "int64", ("L",), "prompt tokens, <|im_start|> ... <|im_end|>, tokenised once"),
    ColumnSpec(
        "latents", "float32", ("W1", "N", 64), "x_t at the window steps: W + 1 latents in token layout"
    ),
    ColumnSpec("log_probs", "float32", ("W",), "behaviour log-prob of each window step (mean over elements)"),
    ColumnSpec("sigmas", "float32", ("W1",), "shifted t of the stored latents"),
    ColumnSpec("final_latents", "float32", ("N", 64), "x at t = 0: the clean latent the image decodes from"),
    ColumnSpec("timesteps", "int64", ("W",), "schedule indices of the window steps"),
    ColumnSpec("images", "uint8", ("H", "Wpx", 3), "decoded image, HWC"),
    ColumnSpec("rewards", "float32", (), "scalar reward of one sample"),
    ColumnSpec("advantages", "float32", (), "group-relative advantage of one sample"),
    ColumnSpec("weights", "*", (...,), "one published policy tensor; the key is the parameter name"),
):
    COLUMNS.register(_spec)

# What a trajectory is on the bus: the rollout produces these per sample, the coordinator
# forwards them (with the prompt's ids) and the trainer consumes them. Named once, here.
TRAJECTORY_COLUMNS = ("latents", "log_probs", "sigmas", "final_latents")
