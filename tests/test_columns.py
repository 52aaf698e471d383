"""The column schema: dtype/shape checks and the start-up pipeline check."""

from __future__ import annotations

import pytest

from flowgrpo.columns import (
    COLUMNS,
    ColumnRegistry,
    ColumnSpec,
    PipelineError,
    SchemaViolation,
    StageSpec,
    check_pipeline,
)


def test_shape_patterns_bind_symbols_within_a_tensor() -> None:
    square = ColumnSpec("square", "float32", ("N", "N"))
    square.check("float32", (3, 3))
    with pytest.raises(SchemaViolation, match=r"dimension 1 \(N\) is 4 but N = 3 earlier"):
        square.check("float32", (3, 4))
    lead = ColumnSpec("lead", "float32", (..., 64))
    lead.check("float32", (2, 5, 64))
    lead.check("float32", (64,))
    with pytest.raises(SchemaViolation, match="at least 1 dimensions"):
        lead.check("float32", ())
    scalar = ColumnSpec("scalar", "float32", ())
    scalar.check("float32", ())
    with pytest.raises(SchemaViolation, match="needs 0 dimensions, got 1"):
        scalar.check("float32", (1,))


def test_builtin_columns() -> None:
    COLUMNS.check("latents", "float32", (3, 1024, 64))
    COLUMNS.check("images", "uint8", (512, 512, 3))
    COLUMNS.check("weights", "bfloat16", (3584, 64))  # any dtype, any shape
    with pytest.raises(SchemaViolation, match="dtype bfloat16 does not match the schema's float32"):
        COLUMNS.check("latents", "bfloat16", (3, 1024, 64), where="s0/p1")
    with pytest.raises(SchemaViolation, match=r"unknown column 'image'; did you mean 'images'"):
        COLUMNS.check("image", "uint8", (8, 8, 3))


def test_registry_refuses_conflicting_specs() -> None:
    reg = ColumnRegistry()
    reg.register(ColumnSpec("a", "int64", ("L",)))
    reg.register(ColumnSpec("a", "int64", ("L",)))
    with pytest.raises(ValueError, match="registered twice"):
        reg.register(ColumnSpec("a", "int32", ("L",)))


ROLLOUT = StageSpec("rollout", ("prompt_ids",), ("latents", "log_probs", "sigmas", "images"))
REWARD = StageSpec("reward", ("images",), ("rewards",))
COORD = StageSpec("coordinator", ("rewards",), ("advantages",))
TRAINER = StageSpec("trainer", ("prompt_ids", "latents", "log_probs", "sigmas", "advantages"), ())


def test_pipeline_check_passes_for_the_flowgrpo_pipeline() -> None:
    check_pipeline([ROLLOUT, REWARD, COORD, TRAINER], COLUMNS, inputs=["prompt_ids"])


def test_pipeline_check_names_the_missing_column() -> None:
    # the reference stacks' defect: a column silently dropped between stages
    dropped = StageSpec("rollout", ("prompt_ids",), ("latents", "sigmas", "images"))
    with pytest.raises(PipelineError, match="stage 'trainer' consumes column 'log_probs', which no earlier"):
        check_pipeline([dropped, REWARD, COORD, TRAINER], COLUMNS, inputs=["prompt_ids"])
    with pytest.raises(PipelineError, match="stage 'rollout' consumes column 'prompt_ids'"):
        check_pipeline([ROLLOUT], COLUMNS, inputs=[])
    typo = StageSpec("trainer", ("prompt_token_ids",), ())
    with pytest.raises(PipelineError, match="unknown column 'prompt_token_ids'; did you mean 'prompt_ids'"):
        check_pipeline([typo], COLUMNS, inputs=["prompt_ids"])
