"""server.core.signatures: request validation against a signature, output selection, batching keys."""

from __future__ import annotations

import numpy as np
import pytest

from server.core.signatures import BatchKey, Signature, TensorSpec
from server.errors import InvalidInput

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
I64 = np.dtype(np.int64)
STR = np.dtype(object)


def make_signature() -> Signature:
    return Signature(
        name="serving_default",
        inputs={
            "x": TensorSpec(F32, (None, 3)),
            "ids": TensorSpec(I64, (None,)),
            "text": TensorSpec(STR, (None, None)),
        },
        outputs={
            "scores": TensorSpec(F32, (None, 2)),
            "label": TensorSpec(STR, (None,)),
            "embedding": TensorSpec(F32, (None, None)),
        },
    )


def good_inputs(rows: int = 2) -> dict[str, np.ndarray]:
    return {
        "x": np.zeros((rows, 3), dtype=np.float32),
        "ids": np.arange(rows, dtype=np.int64),
        "text": np.full((rows, 4), b"w", dtype=object),
    }


def invalid(sig: Signature, inputs: dict[str, np.ndarray]) -> str:
    with pytest.raises(InvalidInput) as info:
        sig.validate(inputs)
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# validate
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 17])
def test_validate_returns_rows(rows: int) -> None:
    assert make_signature().validate(good_inputs(rows)) == rows


def test_validate_missing_input() -> None:
    inputs = good_inputs()
    del inputs["ids"]
    message = invalid(make_signature(), inputs)
    assert "missing input 'ids'" in message
    assert "signature 'serving_default' takes:" in message
    # Lists what the signature takes, with dtypes and shapes.
    assert "ids (DT_INT64 [-1])" in message
    assert "x (DT_FLOAT [-1, 3])" in message


def test_validate_several_missing_inputs_are_all_named() -> None:
    message = invalid(make_signature(), {"x": np.zeros((1, 3), dtype=np.float32)})
    assert "missing input 'ids', 'text'" in message


def test_validate_unexpected_input() -> None:
    inputs = good_inputs()
    inputs["extra"] = np.zeros(2, dtype=np.float32)
    message = invalid(make_signature(), inputs)
    assert "unexpected input 'extra'" in message
    assert "takes:" in message


@pytest.mark.parametrize(
    ("name", "array", "want", "got"),
    [
        ("x", np.zeros((2, 3), dtype=np.float64), "DT_FLOAT", "DT_DOUBLE"),
        ("x", np.zeros((2, 3), dtype=np.float16), "DT_FLOAT", "DT_HALF"),
        ("ids", np.zeros(2, dtype=np.int32), "DT_INT64", "DT_INT32"),
        ("ids", np.zeros(2, dtype=np.uint64), "DT_INT64", "DT_UINT64"),
        ("x", np.full((2, 3), b"a", dtype=object), "DT_FLOAT", "DT_STRING"),
        ("text", np.zeros((2, 4), dtype=np.float32), "DT_STRING", "DT_FLOAT"),
        ("text", np.zeros((2, 4), dtype=np.bool_), "DT_STRING", "DT_BOOL"),
    ],
)
def test_validate_wrong_dtype(name: str, array: np.ndarray, want: str, got: str) -> None:
    inputs = good_inputs()
    inputs[name] = array
    message = invalid(make_signature(), inputs)
    assert f"input '{name}' must be {want}, got {got}" in message


@pytest.mark.parametrize(
    ("name", "shape", "want"),
    [
        ("x", (2,), "[-1, 3]"),
        ("x", (2, 3, 1), "[-1, 3]"),
        ("x", (), "[-1, 3]"),
        ("ids", (2, 1), "[-1]"),
        ("text", (2,), "[-1, -1]"),
    ],
)
def test_validate_wrong_rank(name: str, shape: tuple[int, ...], want: str) -> None:
    inputs = good_inputs()
    dtype = inputs[name].dtype
    inputs[name] = np.zeros(shape, dtype=dtype) if dtype != STR else np.full(shape, b"a", dtype=object)
    message = invalid(make_signature(), inputs)
    assert f"input '{name}' must have shape {want}, got {list(shape)}" in message


@pytest.mark.parametrize("shape", [(2, 4), (2, 2), (2, 0)])
def test_validate_wrong_non_batch_dimension(shape: tuple[int, ...]) -> None:
    inputs = good_inputs()
    inputs["x"] = np.zeros(shape, dtype=np.float32)
    message = invalid(make_signature(), inputs)
    assert f"input 'x' must have shape [-1, 3], got {list(shape)}" in message


def test_validate_rows_must_agree() -> None:
    inputs = good_inputs(3)
    inputs["ids"] = np.arange(2, dtype=np.int64)
    message = invalid(make_signature(), inputs)
    assert "inputs disagree on the number of rows" in message
    assert "'ids' has 2" in message
    assert "'x' has 3" in message
    assert "'text' has 3" in message


def test_validate_zero_rows() -> None:
    message = invalid(make_signature(), good_inputs(0))
    assert "zero rows" in message


def test_validate_unknown_non_batch_dims_accept_any_size() -> None:
    sig = make_signature()
    for width in (0, 1, 4, 100):
        inputs = good_inputs(3)
        inputs["text"] = np.full((3, width), b"t", dtype=object)
        assert sig.validate(inputs) == 3


@pytest.mark.parametrize(
    "text",
    [
        np.array([[b"a", b"b"]], dtype=object),
        np.array([["a", "b"]], dtype=object),
        np.array([["a", "b"]]),  # numpy unicode
        np.array([[b"a", b"b"]]),  # numpy bytes
    ],
    ids=["object-bytes", "object-str", "U", "S"],
)
def test_string_inputs_accept_object_and_string_arrays(text: np.ndarray) -> None:
    inputs = good_inputs(1)
    inputs["text"] = text
    assert make_signature().validate(inputs) == 1


def test_validate_checks_names_before_contents() -> None:
    # A missing input is reported even when another input is also malformed.
    inputs = good_inputs()
    inputs["x"] = np.zeros((2, 7), dtype=np.float64)
    del inputs["ids"]
    assert "missing input 'ids'" in invalid(make_signature(), inputs)


def test_signature_without_inputs_is_refused_cleanly() -> None:
    sig = Signature("no_inputs", inputs={}, outputs={"y": TensorSpec(F32, (None,))})
    # Flagged at load, so requests to it are refused before validate() is ever reached.
    assert sig.batching_problem() == "it has no inputs, so a request has no rows"


# ---------------------------------------------------------------------------------------------
# select_outputs
# ---------------------------------------------------------------------------------------------


def test_select_outputs_empty_filter_gives_all_in_signature_order() -> None:
    assert make_signature().select_outputs([]) == ("scores", "label", "embedding")


def test_select_outputs_subset_in_signature_order() -> None:
    sig = make_signature()
    assert sig.select_outputs(["embedding", "scores"]) == ("scores", "embedding")
    assert sig.select_outputs(["label"]) == ("label",)
    assert sig.select_outputs(["label", "label"]) == ("label",)


def test_select_outputs_unknown_name() -> None:
    with pytest.raises(InvalidInput) as info:
        make_signature().select_outputs(["scores", "nope", "also_nope"])
    message = str(info.value)
    assert "unknown output 'also_nope', 'nope'" in message
    assert "signature 'serving_default' returns: embedding, label, scores" in message


# ---------------------------------------------------------------------------------------------
# batching_problem and batch_key
# ---------------------------------------------------------------------------------------------


def test_batching_problem_none_for_batch_major_shapes() -> None:
    assert make_signature().batching_problem() is None
    sig = Signature("s", {"a": TensorSpec(F32, (None,))}, {"b": TensorSpec(F64, (None, 5, None))})
    assert sig.batching_problem() is None


@pytest.mark.parametrize(
    ("spec", "described"),
    [
        (TensorSpec(F32, ()), "DT_FLOAT []"),
        (TensorSpec(F32, (0, 3)), "DT_FLOAT [0, 3]"),
        (TensorSpec(F32, (4,)), "DT_FLOAT [4]"),
        (TensorSpec(F32, None), "DT_FLOAT ?"),
    ],
    ids=["scalar", "fixed-0", "fixed-4", "unknown-rank"],
)
@pytest.mark.parametrize("side", ["input", "output"])
def test_batching_problem_reports_non_batch_shapes(spec: TensorSpec, described: str, side: str) -> None:
    ok = TensorSpec(F32, (None, 2))
    if side == "input":
        sig = Signature("s", {"good": ok, "bad": spec}, {"out": ok})
    else:
        sig = Signature("s", {"in": ok}, {"good": ok, "bad": spec})
    problem = sig.batching_problem()
    assert problem is not None
    assert f"{side} 'bad' has shape {described}" in problem
    assert "dimension 0 must be the batch (-1)" in problem


def test_tensor_spec_describe() -> None:
    assert TensorSpec(STR, (None, 3, None)).describe() == "DT_STRING [-1, 3, -1]"
    assert TensorSpec(I64, None).describe() == "DT_INT64 ?"


def test_batch_key_same_for_same_trailing_shapes() -> None:
    sig = make_signature()
    a = good_inputs(1)
    b = good_inputs(9)
    assert sig.batch_key(a) == sig.batch_key(b)
    assert hash(sig.batch_key(a)) == hash(sig.batch_key(b))
    key = sig.batch_key(a)
    assert isinstance(key, BatchKey)
    assert key.signature == "serving_default"
    assert key.trailing_shapes == (("ids", ()), ("text", (4,)), ("x", (3,)))


def test_batch_key_differs_for_different_trailing_shapes() -> None:
    sig = make_signature()
    a = good_inputs(2)
    b = good_inputs(2)
    b["text"] = np.full((2, 5), b"w", dtype=object)
    assert sig.batch_key(a) != sig.batch_key(b)


def test_batch_key_differs_across_signatures() -> None:
    one = make_signature()
    other = Signature("other", one.inputs, one.outputs)
    assert one.batch_key(good_inputs()) != other.batch_key(good_inputs())


# admit(): validate() and batch_key() with a cache of accepted layouts; the cache must never let
# through what validate() refuses.


def test_admit_matches_validate_and_batch_key() -> None:
    sig = make_signature()
    for rows in (2, 5, 2):  # the second 2 is served from the cache
        inputs = good_inputs(rows)
        assert sig.admit(inputs) == (sig.validate(inputs), sig.batch_key(inputs))


def test_admit_refuses_after_a_good_layout_was_cached() -> None:
    sig = make_signature()
    sig.admit(good_inputs(3))
    bad_rows = {**good_inputs(3), "ids": np.arange(2, dtype=np.int64)}
    with pytest.raises(InvalidInput, match="inputs disagree on the number of rows"):
        sig.admit(bad_rows)
    with pytest.raises(InvalidInput, match="zero rows"):
        sig.admit(good_inputs(0))


def test_admit_refuses_a_scalar_where_a_vector_layout_was_cached() -> None:
    sig = Signature("s", {"s": TensorSpec(STR, (None,))}, {"n": TensorSpec(I64, (None,))})
    sig.admit({"s": np.array([b"a", b"bc"], dtype=object)})
    with pytest.raises(InvalidInput, match="input 's' must have shape"):
        sig.admit({"s": np.array(b"", dtype=object)})  # rank 0: same trailing dims, other rank
