"""The tensor codec of inferfleet.producer.protocol: round trips, zero-copy, hostile input."""

from __future__ import annotations

import struct
import tracemalloc
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import (
    DTYPES,
    Limits,
    decode_body,
    decode_inputs,
    decode_outputs,
    encode_body,
    encode_inputs,
    encode_outputs,
    pack,
    row_count,
    unpack,
)

DTYPE_NAMES = list(DTYPES)


def sample(dtype_name: str, shape: tuple[int, ...] = (3, 4), seed: int = 0) -> np.ndarray:
    """Distinct, dtype-appropriate values (bools alternate, ints stay in range)."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[dtype_name]
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(size=shape).astype(dtype)


def round_trip_body(inputs: Any, params: dict | None = None) -> tuple[Any, dict]:
    return decode_body(encode_body(inputs, params))


def assert_same_tensor(got: np.ndarray, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == DTYPES[want.dtype.name]
    assert got.dtype.str[0] in "<|"  # little-endian (or byte-sized)
    assert got.flags.c_contiguous
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


_DEFAULT = object()


def tensor_map(
    dtype: Any = "float32", shape: Any = (2, 3), data: Any = _DEFAULT, **extra: Any
) -> dict:
    """A raw TENSOR map; by default a valid one of float32[2,3]."""
    if data is _DEFAULT:
        data = bytes(4 * 6)
    return {
        "dtype": dtype,
        "shape": list(shape) if isinstance(shape, tuple) else shape,
        "data": data,
        **extra,
    }


def body_of(inputs: Any, **extra: Any) -> bytes:
    return pack({"inputs": inputs, **extra})


def expect_error(
    body: bytes, code: str = "bad_request", limits: Limits | None = None
) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        if limits is None:
            decode_body(body)
        else:
            decode_body(body, limits)
    assert info.value.code == code
    assert str(info.value) not in ("", "None")  # the error reply's message says what was wrong
    return info.value


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_single_tensor_round_trips_every_dtype(dtype_name: str) -> None:
    arr = sample(dtype_name)
    inputs, params = round_trip_body(arr)
    assert_same_tensor(inputs, arr)
    assert params == {}


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_list_of_tensors_round_trips_every_dtype(dtype_name: str) -> None:
    a, b = sample(dtype_name, (2, 5), seed=1), sample(dtype_name, (2,), seed=2)
    inputs, _ = round_trip_body([a, b])
    assert isinstance(inputs, list) and len(inputs) == 2
    assert_same_tensor(inputs[0], a)
    assert_same_tensor(inputs[1], b)


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_dict_of_tensors_round_trips_every_dtype(dtype_name: str) -> None:
    x, y = sample(dtype_name, (4, 2, 2), seed=3), sample("float32", (4, 1), seed=4)
    inputs, _ = round_trip_body({"x": x, "y": y})
    assert isinstance(inputs, dict) and set(inputs) == {"x", "y"}
    assert_same_tensor(inputs["x"], x)
    assert_same_tensor(inputs["y"], y)


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_encode_decode_inputs_round_trip_without_body(dtype_name: str) -> None:
    arr = sample(dtype_name, (2, 3))
    encoded = encode_inputs(arr)
    assert encoded["dtype"] == dtype_name
    assert encoded["shape"] == [2, 3]
    assert bytes(encoded["data"]) == arr.astype(DTYPES[dtype_name]).tobytes()
    decoded = decode_inputs(unpack(pack(encoded)))
    assert_same_tensor(decoded, arr)


def test_tuple_inputs_are_encoded_as_a_list() -> None:
    a, b = sample("int32", (2, 2)), sample("int64", (2,))
    inputs, _ = round_trip_body((a, b))
    assert isinstance(inputs, list)
    assert_same_tensor(inputs[0], a)
    assert_same_tensor(inputs[1], b)


def test_params_round_trip() -> None:
    params = {"temperature": 0.5, "top_k": 3, "mode": "fast", "flags": [1, 2]}
    _, got = round_trip_body(sample("float32"), params)
    assert got == params


def test_nested_python_lists_become_tensors() -> None:
    inputs, _ = round_trip_body([[1.5, 2.5], [3.5, 4.5]])
    # A list of lists is a list of two positional 1-d tensors.
    assert isinstance(inputs, list)
    np.testing.assert_array_equal(inputs[0], [1.5, 2.5])
    assert inputs[0].dtype == np.float64


@pytest.mark.parametrize("dtype_name", ["int16", "int32", "int64", "float16", "float32", "float64"])
def test_big_endian_input_arrives_little_endian_with_equal_values(dtype_name: str) -> None:
    arr = sample(dtype_name, (3, 2)).astype(DTYPES[dtype_name].newbyteorder(">"))
    assert arr.dtype.byteorder == ">"
    encoded = encode_inputs(arr)
    assert bytes(encoded["data"]) == arr.astype(DTYPES[dtype_name]).tobytes()
    inputs, _ = round_trip_body(arr)
    assert inputs.dtype.str[0] == "<"
    assert inputs.dtype == DTYPES[dtype_name]
    np.testing.assert_array_equal(inputs, arr)


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_non_contiguous_input_arrives_in_c_order(dtype_name: str) -> None:
    base = sample(dtype_name, (4, 6))
    views = {
        "transposed": base.T,
        "strided": base[::2, ::3],
        "fortran": np.asfortranarray(base),
    }
    for what, view in views.items():
        if what != "fortran":
            assert not view.flags.c_contiguous
        inputs, _ = round_trip_body(view)
        assert inputs.flags.c_contiguous, what
        assert inputs.shape == view.shape, what
        np.testing.assert_array_equal(inputs, view, err_msg=what)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(6, dtype=torch.float32).reshape(2, 3),
        torch.tensor([[True, False], [False, True]]),
        torch.arange(6, dtype=torch.int64).reshape(3, 2).t(),  # non-contiguous
        torch.ones(2, 2, dtype=torch.float16, requires_grad=False) * 0.5,
        torch.zeros(2, 3, requires_grad=True) + 1.0,  # needs detach
    ],
    ids=["float32", "bool", "int64-transposed", "float16", "requires-grad"],
)
def test_torch_tensors_are_accepted_as_inputs(tensor: torch.Tensor) -> None:
    want = tensor.detach().numpy()
    inputs, _ = round_trip_body({"t": tensor, "n": np.zeros(tensor.shape[0], np.int8)})
    assert inputs["t"].dtype == want.dtype
    np.testing.assert_array_equal(inputs["t"], want)


def test_torch_bfloat16_is_refused_with_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="bfloat16"):
        encode_body(torch.ones(2, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "dtype",
    [
        "uint16",
        "uint32",
        "uint64",
        "complex64",
        "float128" if hasattr(np, "float128") else "complex128",
    ],
)
def test_dtypes_outside_the_contract_are_refused(dtype: str) -> None:
    with pytest.raises(ProtocolError, match="unsupported dtype") as info:
        encode_body(np.zeros((2, 2), dtype=dtype))
    assert info.value.code == "bad_request"


def test_zero_dimensional_tensor_is_refused() -> None:
    with pytest.raises(ProtocolError, match="at least one dimension"):
        encode_body(np.float32(1.0))


@pytest.mark.parametrize("empty", [[], {}, ()])
def test_empty_inputs_structure_is_refused_on_encode(empty: Any) -> None:
    with pytest.raises(ProtocolError, match="empty"):
        encode_body(empty)


def test_non_string_map_key_is_refused_on_encode() -> None:
    with pytest.raises(ProtocolError, match="keys must be strings"):
        encode_body({1: np.zeros((1, 1))})


def test_unencodable_params_raise_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="params"):
        encode_body(np.zeros((1, 1)), {"x": object()})


@pytest.mark.parametrize("shape", [(2, 0), (0, 3)])
def test_zero_sized_tensor_round_trips(shape: tuple[int, int]) -> None:
    # [2, 0] and [0, 3] are valid contract tensors with 0 bytes of data (the
    # decoder accepts them; the worker answers zero rows with bad_request).
    raw = decode_body(body_of(tensor_map(shape=list(shape), data=b"")))[0]
    assert raw.shape == shape
    inputs, _ = round_trip_body(np.zeros(shape, np.float32))
    assert inputs.shape == shape
    assert inputs.dtype == np.float32


def test_row_count_for_every_form() -> None:
    a = np.zeros((5, 2), np.float32)
    assert row_count(a) == 5
    assert row_count([a, np.zeros(5, np.int8)]) == 5
    assert row_count({"x": a}) == 5


# --------------------------------------------------------------------------- property


finite_dtypes = st.sampled_from(DTYPE_NAMES)


@st.composite
def tensors(draw: st.DrawFn, rows: int | None = None) -> np.ndarray:
    name = draw(finite_dtypes)
    trailing = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4))
    n = rows if rows is not None else draw(st.integers(1, 5))
    order = draw(st.sampled_from(["<", ">"]))
    dtype = DTYPES[name] if DTYPES[name].itemsize == 1 else DTYPES[name].newbyteorder(order)
    elements = None
    if dtype.kind == "f":
        elements = st.floats(width=dtype.itemsize * 8, allow_nan=False)
    return draw(hnp.arrays(dtype, (n, *trailing), elements=elements))


@st.composite
def inputs_structures(draw: st.DrawFn) -> Any:
    form = draw(st.sampled_from(["tensor", "list", "map"]))
    rows = draw(st.integers(1, 4))
    if form == "tensor":
        return draw(tensors(rows))
    count = draw(st.integers(1, 4))
    if form == "list":
        return [draw(tensors(rows)) for _ in range(count)]
    names = st.text(alphabet="abcxyz_", min_size=1, max_size=5)
    keys = draw(st.lists(names, min_size=count, max_size=count, unique=True))
    return {k: draw(tensors(rows)) for k in keys}


def _pairs(a: Any, b: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    if isinstance(a, np.ndarray):
        return [(a, b)]
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b)
        return [(a[k], b[k]) for k in a]
    assert isinstance(b, list) and len(a) == len(b)
    return list(zip(a, b))


@settings(max_examples=150, deadline=None)
@given(inputs_structures())
def test_property_any_structure_round_trips(structure: Any) -> None:
    decoded, params = round_trip_body(structure)
    assert params == {}
    for want, got in _pairs(structure, decoded):
        assert got.shape == want.shape
        assert got.dtype == DTYPES[want.dtype.name]
        assert got.dtype.str[0] in "<|"
        assert got.flags.c_contiguous and not got.flags.writeable
        np.testing.assert_array_equal(got, want)
    assert row_count(decoded) == row_count(structure)


# --------------------------------------------------------------------------- zero-copy


def test_decoded_tensor_is_a_view_of_the_bin_bytes_not_a_copy() -> None:
    obj = unpack(pack(encode_inputs(sample("float32", (4, 4)))))
    data = obj["data"]
    arr = decode_inputs(obj)
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    assert base is data
    assert np.shares_memory(arr, np.frombuffer(data, np.uint8))


@pytest.mark.parametrize("form", ["tensor", "list", "map"])
def test_decoded_arrays_are_read_only_views_backed_by_bytes(form: str) -> None:
    a = sample("int32", (3, 2))
    structure: Any = {"tensor": a, "list": [a, a], "map": {"a": a}}[form]
    decoded, _ = decode_body(encode_body(structure))
    for _, arr in _pairs(structure, decoded):
        assert not arr.flags.writeable
        assert not arr.flags.owndata
        base = arr
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base, bytes)
        assert len(base) == arr.nbytes
        with pytest.raises(ValueError):
            arr[0, 0] = 1


def test_encoding_does_not_copy_a_contiguous_little_endian_array() -> None:
    arr = sample("float64", (3, 3))
    encoded = encode_inputs(arr)
    assert np.shares_memory(np.frombuffer(encoded["data"], np.uint8), arr)


# --------------------------------------------------------------------------- malformed bodies


@pytest.mark.parametrize(
    "body",
    [b"\xc1", b"\x92\x01", b"not msgpack at all \xff\xfe", b"\x81\xa6inputs"],
    ids=["reserved-byte", "truncated-array", "garbage", "truncated-map"],
)
def test_not_msgpack_is_bad_request(body: bytes) -> None:
    expect_error(body)


def test_invalid_utf8_string_is_bad_request() -> None:
    expect_error(b"\x81\xa2\xff\xfe\x01")


@pytest.mark.parametrize("top", [[1, 2], "inputs", 7, None, b"raw"])
def test_body_that_is_not_a_map_is_bad_request(top: Any) -> None:
    expect_error(pack(top))


def test_missing_inputs_is_bad_request() -> None:
    expect_error(pack({"params": {"a": 1}}))


def test_unknown_body_key_is_bad_request() -> None:
    expect_error(body_of(tensor_map(), extra=1))


@pytest.mark.parametrize("params", [[1, 2], "x", 5, True])
def test_params_that_are_not_a_map_are_bad_request(params: Any) -> None:
    expect_error(body_of(tensor_map(), params=params))


def test_empty_params_that_are_not_a_map_are_bad_request() -> None:
    # The contract's params is a MAP; an empty array, 0 or false is not one.
    for params in ([], 0, False, ""):
        expect_error(body_of(tensor_map(), params=params))


def test_empty_map_params_mean_no_params() -> None:
    _, got = decode_body(body_of(tensor_map(), params={}))
    assert got == {}


def test_too_many_params_is_bad_request() -> None:
    limits = Limits(max_params=2)
    expect_error(body_of(tensor_map(), params={"a": 1, "b": 2, "c": 3}), limits=limits)
    _, params = decode_body(body_of(tensor_map(), params={"a": 1, "b": 2}), limits)
    assert params == {"a": 1, "b": 2}


def test_inputs_neither_tensor_list_map_nor_raw_is_bad_request() -> None:
    expect_error(body_of(5))
    expect_error(body_of(None))
    expect_error(body_of(1.5))


def test_raw_text_and_bytes_inputs_decode_as_one_row_version_1_2() -> None:
    assert decode_body(body_of("héllo")) == ("héllo", {})
    assert decode_body(body_of(b"\x00\x01")) == (b"\x00\x01", {})
    assert row_count("héllo") == 1 and row_count(b"") == 1
    assert decode_body(encode_body("text", {"lang": "en"})) == ("text", {"lang": "en"})


def test_tensor_map_with_an_extra_key_is_bad_request() -> None:
    err = expect_error(body_of(tensor_map(order="C")))
    assert "dtype, shape and data" in str(err)


@pytest.mark.parametrize("missing", ["shape", "data"])
def test_tensor_map_with_a_missing_key_is_bad_request(missing: str) -> None:
    t = tensor_map()
    del t[missing]
    expect_error(body_of(t))
    expect_error(body_of([t]))
    expect_error(body_of({"x": t}))


def test_tensor_without_dtype_is_bad_request() -> None:
    t = tensor_map()
    del t["dtype"]
    expect_error(body_of(t))


@pytest.mark.parametrize(
    "dtype", ["float", "bfloat16", "uint16", "complex64", "", "FLOAT32", 5, None, b"float32"]
)
def test_unknown_dtype_is_bad_request(dtype: Any) -> None:
    expect_error(body_of(tensor_map(dtype=dtype)))
    expect_error(body_of({"x": tensor_map(dtype=dtype)}))


@pytest.mark.parametrize(
    "shape",
    [
        "2,3",
        6,
        {"0": 2},
        None,
        [],
        [-1, 3],
        [2, -3],
        [2.0, 3],
        ["2", 3],
        [True, 3],
        [2, False],
        [None],
        [[2], 3],
        [1] * 9,
    ],
    ids=[
        "string",
        "int",
        "map",
        "nil",
        "empty",
        "negative-rows",
        "negative-dim",
        "float",
        "str-dim",
        "bool-true",
        "bool-false",
        "nil-dim",
        "nested",
        "too-many-dims",
    ],
)
def test_bad_shape_is_bad_request(shape: Any) -> None:
    err = expect_error(body_of(tensor_map(shape=shape, data=b"")))
    assert "shape" in str(err)


def test_max_ndim_is_the_limit() -> None:
    limits = Limits(max_ndim=3)
    decode_body(body_of(tensor_map(shape=[1, 1, 1], data=bytes(4))), limits)
    expect_error(body_of(tensor_map(shape=[1, 1, 1, 1], data=bytes(4))), limits=limits)


@pytest.mark.parametrize(
    "data", ["\x00" * 24, [0] * 24, None, 0], ids=["str", "array", "nil", "int"]
)
def test_data_not_bin_is_bad_request(data: Any) -> None:
    err = expect_error(body_of(tensor_map(data=data)))
    assert "bin" in str(err)


@pytest.mark.parametrize("length", [0, 23, 25, 48])
def test_data_length_mismatch_is_bad_request(length: int) -> None:
    err = expect_error(body_of(tensor_map(data=bytes(length))))
    assert "24 bytes" in str(err)


def test_huge_declared_shape_with_small_data_fails_without_allocating() -> None:
    shape = [1 << 24, 1 << 24, 1 << 24]
    tracemalloc.start()
    try:
        expect_error(body_of(tensor_map(shape=shape, data=bytes(8))))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (
        peak < 1 << 20
    )  # what is allocated, not how long it took: a timing flakes on a loaded machine


@pytest.mark.parametrize("bad", [2, 255, 17])
def test_bool_bytes_other_than_zero_or_one_are_bad_request(bad: int) -> None:
    err = expect_error(body_of(tensor_map(dtype="bool", shape=[2, 2], data=bytes([0, 1, bad, 1]))))
    assert "bool" in str(err)


def test_bool_bytes_zero_and_one_are_accepted() -> None:
    inputs, _ = decode_body(
        body_of(tensor_map(dtype="bool", shape=[2, 2], data=bytes([0, 1, 1, 0])))
    )
    np.testing.assert_array_equal(inputs, [[False, True], [True, False]])


def test_rows_differing_between_tensors_is_bad_request() -> None:
    a = tensor_map(shape=[2, 3])
    b = tensor_map(shape=[3, 2])
    err = expect_error(body_of([a, b]))
    assert "row count" in str(err)
    expect_error(body_of({"a": a, "b": b}))


@pytest.mark.parametrize("empty", [[], {}])
def test_empty_list_or_map_of_tensors_is_bad_request(empty: Any) -> None:
    expect_error(body_of(empty))


def test_too_many_tensors_is_bad_request() -> None:
    limits = Limits(max_tensors=3)
    t = tensor_map()
    decode_body(body_of([t] * 3), limits)
    decode_body(body_of(dict.fromkeys("abc", t)), limits)
    expect_error(body_of([t] * 4), limits=limits)
    expect_error(body_of(dict.fromkeys("abcd", t)), limits=limits)


def test_too_many_tensors_at_default_limits_is_bad_request() -> None:
    t = tensor_map(shape=[1], data=bytes(4))
    expect_error(body_of([t] * 65))
    expect_error(body_of({f"k{i}": t for i in range(65)}))


@pytest.mark.parametrize(
    "obj",
    [
        msgpack.ExtType(5, b"abc"),
        msgpack.ExtType(1, b""),
        msgpack.Timestamp(1, 0),  # ext type -1
    ],
    ids=["ext5", "ext-empty", "timestamp"],
)
def test_msgpack_ext_types_are_bad_request(obj: Any) -> None:
    expect_error(pack({"inputs": tensor_map(), "params": {"x": obj}}))
    expect_error(pack({"inputs": tensor_map(data=obj)}))


def test_body_over_max_body_bytes_is_too_large() -> None:
    body = encode_body(np.zeros((16, 16), np.float32))
    limits = Limits(max_body_bytes=len(body) - 1)
    err = expect_error(body, "too_large", limits)
    assert str(len(body)) in str(err)
    inputs, _ = decode_body(body, Limits(max_body_bytes=len(body)))
    assert inputs.shape == (16, 16)


def test_unpack_alone_reports_too_large() -> None:
    with pytest.raises(ProtocolError) as info:
        unpack(b"\x00" * 100, Limits(max_body_bytes=99))
    assert info.value.code == "too_large"


@pytest.mark.parametrize(
    "header",
    [
        b"\xc6" + struct.pack(">I", 2**31),  # bin32 of 2 GB
        b"\xdb" + struct.pack(">I", 2**31),  # str32 of 2 GB
        b"\xdd" + struct.pack(">I", 2**31),  # array32 of 2**31 items
        b"\xdf" + struct.pack(">I", 2**31),  # map32 of 2**31 pairs
        b"\xc9" + struct.pack(">I", 2**31) + b"\x05",  # ext32 of 2 GB
    ],
    ids=["bin32", "str32", "array32", "map32", "ext32"],
)
def test_huge_declared_lengths_fail_fast_without_allocating(header: bytes) -> None:
    hostile = (
        b"\x81\xa6inputs\x83\xa5dtype\xa5uint8\xa5shape\x91\xce\x80\x00\x00\x00\xa4data"
        + header
        + b"abc"
    )
    tracemalloc.start()
    try:
        for body in (hostile, header + b"abc"):
            expect_error(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_deep_nesting_is_bad_request() -> None:
    expect_error(b"\x81\xa6inputs" + b"\x91" * 5000 + b"\x00")


def test_map_of_tensors_with_non_string_keys_is_bad_request() -> None:
    # INPUTS may be a map of *string* to TENSOR.
    expect_error(body_of({b"x": tensor_map()}))


def test_raw_text_and_bytes_outputs_round_trip_in_replies_version_1_2() -> None:
    from inferfleet.producer.protocol import decode_reply, encode_reply_ok

    for outputs in ("a label", b"\x00\xff"):
        reply = decode_reply(encode_reply_ok("r", outputs, ("m", "1"), {"batch_rows": 1}))
        assert reply.ok and reply.outputs == outputs


# --------------------------------------------------------------------------- pinned by the mutation
# run (issue 35, docs/benchmarks.md): each rule below had a mutant that no test told apart


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (
            body_of(tensor_map(shape=[1, 16], data=bytes(60))),
            "inputs: shape [1, 16] of float32 needs 64 bytes, data has 60",
        ),
        (body_of(tensor_map(data="\x00" * 24)), "inputs: data must be msgpack bin, got str"),
    ],
    ids=["short-data", "data-str"],
)
def test_the_example_messages_of_docs_protocol_md_are_what_the_decoder_says(
    body: bytes, says: str
) -> None:
    assert str(expect_error(body)) == says


@pytest.mark.parametrize(
    ("inputs", "says"),
    [
        ([tensor_map(), tensor_map(data="x")], "inputs[1]: data must be msgpack bin, got str"),
        ({"a": tensor_map(), "b": tensor_map(data="x")}, "inputs['b']: data must be msgpack bin"),
        (
            tensor_map(dtype="float128"),
            "inputs: dtype 'float128' is not one of bool, int8, uint8, int16, int32, int64, "
            "float16, float32, float64",
        ),
        (
            [tensor_map(shape="x")],
            "inputs[0]: shape must be a list of 1 to 8 non-negative ints, got 'x'",
        ),
    ],
    ids=["list", "map", "dtype", "shape"],
)
def test_an_error_names_the_tensor_that_is_wrong_and_shows_what_it_got(
    inputs: Any, says: str
) -> None:
    assert str(expect_error(body_of(inputs))).startswith(says)


@pytest.mark.parametrize("form", [{}, []])
def test_an_empty_inputs_structure_says_how_many_tensors_are_allowed(form: Any) -> None:
    kind = "map" if form == {} else "list"
    assert str(expect_error(body_of(form))) == f"inputs: a {kind} of 1 to 64 tensors is required"


@pytest.mark.parametrize("dtype", [[1], {"name": "float32"}], ids=["array", "map"])
def test_a_dtype_that_is_not_even_hashable_is_bad_request(dtype: Any) -> None:
    expect_error(body_of(tensor_map(dtype=dtype)))
    assert "inputs['x']: dtype " in str(expect_error(body_of({"x": tensor_map(dtype=dtype)})))


def test_a_dimension_or_a_size_equal_to_the_body_limit_is_allowed_one_more_is_not() -> None:
    limits = Limits(max_body_bytes=16)
    for shape in ([16], [4, 4], [16, 0]):
        n = 16 if shape[-1] else 0
        obj = {"dtype": "uint8", "shape": shape, "data": bytes(n)}
        assert decode_inputs(obj, limits).shape == tuple(shape)
    with pytest.raises(ProtocolError, match=r"^inputs: shape \[4, 5\] is too large$"):
        decode_inputs({"dtype": "uint8", "shape": [4, 5], "data": bytes(20)}, limits)
    with pytest.raises(ProtocolError, match="shape must be"):
        decode_inputs({"dtype": "uint8", "shape": [17], "data": bytes(17)}, limits)


@pytest.mark.parametrize(
    ("value", "fits"),
    [
        ("a" * (64 * 1024), True),
        ("a" * (64 * 1024 + 1), False),
        ([0] * 4096, True),
        ([0] * 4097, False),
    ],
    ids=["str-64KiB", "str-over", "array-4096", "array-over"],
)
def test_the_decoder_bounds_a_string_and_an_array_in_params(value: Any, fits: bool) -> None:
    body = body_of(tensor_map(), params={"p": value})
    if fits:
        assert decode_body(body)[1] == {"p": value}
    else:
        assert str(expect_error(body)).startswith("body is not valid msgpack: ")


@pytest.mark.parametrize(
    ("limits", "most"),
    [
        (Limits(max_tensors=10, max_params=3), 10),
        (Limits(max_tensors=3, max_params=10), 10),
        (Limits(max_tensors=1, max_params=1), 8),  # a tensor map's 3 keys always fit
    ],
)
def test_the_decoder_bounds_a_map_by_the_larger_of_tensors_params_and_8(
    limits: Limits, most: int
) -> None:
    assert len(unpack(pack({f"k{i}": 0 for i in range(most)}), limits)) == most
    with pytest.raises(ProtocolError, match=r"^body is not valid msgpack: "):
        unpack(pack({f"k{i}": 0 for i in range(most + 1)}), limits)


def test_a_map_key_that_is_not_a_string_is_refused_even_in_params() -> None:
    expect_error(body_of(tensor_map(), params={1: "one"}))


def test_an_empty_extension_type_is_refused_by_name() -> None:
    body = pack({"inputs": tensor_map(), "params": {"x": msgpack.ExtType(1, b"")}})
    assert str(expect_error(body)) == "msgpack extension types are not allowed (ext type 1)"


def test_limits_of_one_are_allowed_and_nonsense_is_named() -> None:
    assert Limits(1, 1, 1, 1) == Limits(max_body_bytes=1, max_tensors=1, max_ndim=1, max_params=1)
    for name in ("max_body_bytes", "max_tensors", "max_ndim", "max_params"):
        with pytest.raises(ValueError, match=f"^Limits.{name} must be at least 1, got 0$"):
            Limits(**{name: 0})


def test_outputs_round_trip_with_the_output_limits_and_name_outputs_in_errors() -> None:
    outputs = {f"o{i}": np.full((1, 2), i, np.int32) for i in range(65)}  # a request: 64 most
    back = decode_outputs(encode_outputs(outputs))
    assert isinstance(back, dict) and len(back) == 65
    np.testing.assert_array_equal(back["o64"], outputs["o64"])
    with pytest.raises(ProtocolError) as info:
        decode_outputs(pack({"dtype": "float32", "shape": [1], "data": b""}))
    assert str(info.value) == "outputs: shape [1] of float32 needs 4 bytes, data has 0"


def test_raw_bytearray_inputs_travel_as_bytes() -> None:
    assert decode_body(encode_body(bytearray(b"raw"))) == (b"raw", {})


def test_a_value_that_cannot_be_a_tensor_is_named_on_encode() -> None:
    with pytest.raises(ProtocolError, match=r"^cannot make a tensor of list: "):
        encode_inputs({"x": [[1, 2], [3]]})  # ragged
    with pytest.raises(ProtocolError, match=r"^inputs map keys must be strings, got 1$"):
        encode_inputs({1: np.zeros((1, 1))})


def test_an_array_like_with_numpy_but_no_detach_is_read_as_an_array() -> None:
    class Eager:  # a TensorFlow eager tensor, say: numpy() and __array__, no detach()
        def numpy(self) -> np.ndarray:
            return np.ones((2, 2), np.float32)

        def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
            return self.numpy()

    inputs, _ = decode_body(encode_body(Eager()))
    np.testing.assert_array_equal(inputs, np.ones((2, 2), np.float32))
