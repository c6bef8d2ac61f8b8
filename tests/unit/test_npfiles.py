"""inferfleet.worker.npfiles: .npy / .npz inputs and outputs."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import numpy as np
import pytest

from inferfleet.worker.npfiles import load_inputs, save_outputs


def test_load_npy_is_one_tensor(tmp_path: Path) -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(tmp_path / "x.npy", arr)
    got = load_inputs(str(tmp_path / "x.npy"))
    assert isinstance(got, np.ndarray)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, arr)


def test_load_npz_positional_is_a_list_in_order(tmp_path: Path) -> None:
    arrays = [np.full((2, 1), i, np.int64) for i in range(12)]  # arr_10 sorts before arr_2 as text
    np.savez(tmp_path / "x.npz", *arrays)
    got = load_inputs(str(tmp_path / "x.npz"))
    assert isinstance(got, list) and len(got) == 12
    assert [int(a[0, 0]) for a in got] == list(range(12))


def test_load_npz_keyword_is_a_dict(tmp_path: Path) -> None:
    x, mask = np.ones((2, 3), np.float32), np.array([True, False])
    np.savez(tmp_path / "x.npz", x=x, mask=mask)
    got = load_inputs(str(tmp_path / "x.npz"))
    assert isinstance(got, dict) and set(got) == {"x", "mask"}
    np.testing.assert_array_equal(got["x"], x)
    np.testing.assert_array_equal(got["mask"], mask)


def test_load_npz_with_a_gap_in_arr_names_is_a_dict(tmp_path: Path) -> None:
    np.savez(tmp_path / "x.npz", arr_0=np.zeros(1), arr_2=np.ones(1))
    got = load_inputs(str(tmp_path / "x.npz"))
    assert isinstance(got, dict) and set(got) == {"arr_0", "arr_2"}


def test_save_outputs_tensor_npy_round_trip(tmp_path: Path) -> None:
    arr = np.linspace(0, 1, 6, dtype=np.float64).reshape(2, 3)
    path = str(tmp_path / "out.npy")
    save_outputs(path, arr)
    got = load_inputs(path)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, arr)


def test_save_outputs_list_round_trip(tmp_path: Path) -> None:
    outputs = [np.arange(3), np.eye(3, dtype=np.float16)]
    path = str(tmp_path / "out.npz")
    save_outputs(path, outputs)
    got = load_inputs(path)
    assert isinstance(got, list) and len(got) == 2
    np.testing.assert_array_equal(got[0], outputs[0])
    assert got[1].dtype == np.float16
    np.testing.assert_array_equal(got[1], outputs[1])


def test_save_outputs_dict_round_trip(tmp_path: Path) -> None:
    outputs = {"logits": np.zeros((2, 5), np.float32), "ids": np.array([3, 4], np.int32)}
    path = str(tmp_path / "out.npz")
    save_outputs(path, outputs)
    got = load_inputs(path)
    assert isinstance(got, dict) and set(got) == set(outputs)
    for key, value in outputs.items():
        assert got[key].dtype == value.dtype
        np.testing.assert_array_equal(got[key], value)


def test_save_outputs_tensor_to_npz_reads_back_the_tensor(tmp_path: Path) -> None:
    arr = np.arange(4)
    path = str(tmp_path / "out.npz")
    save_outputs(path, arr)
    got = load_inputs(path)
    np.testing.assert_array_equal(got[0], arr)


def test_missing_file_is_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_inputs(str(tmp_path / "nope.npy"))


def load_failure(path: Path) -> tuple[type[BaseException] | None, list[str]]:
    """The exception type load_inputs raises, and any file it left open.

    The exception is dropped before returning so that a leaked file handle
    is finalised (and reported) here, not in some later test.
    """
    kind: type[BaseException] | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            load_inputs(str(path))
        except Exception as exc:  # noqa: BLE001 - the type is what is tested
            kind = type(exc)
        gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    return kind, leaks


@pytest.mark.parametrize(
    "content",
    [b"hello, not numpy", b"\x93NUMPY\x01\x00", b"", b"PK\x03\x04 truncated zip"],
    ids=["text", "truncated-npy", "empty", "corrupt-npz"],
)
def test_unreadable_file_is_value_error(tmp_path: Path, content: bytes) -> None:
    # The docstring promises ValueError "with the reason" for any unreadable file.
    path = tmp_path / "bad.npz"
    path.write_bytes(content)
    kind, leaks = load_failure(path)
    assert kind is not None and issubclass(kind, ValueError), kind
    assert leaks == []


def test_pickled_object_array_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "obj.npy"
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError):
        load_inputs(str(path))


def test_empty_npz_is_value_error(tmp_path: Path) -> None:
    np.savez(tmp_path / "empty.npz")
    with pytest.raises(ValueError, match="no arrays"):
        load_inputs(str(tmp_path / "empty.npz"))
