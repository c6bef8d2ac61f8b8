"""Input specs with varying dimensions, file kinds from content, padding, per-request intake."""

from __future__ import annotations

import numpy as np
import pytest

from inferfleet.producer.protocol import Limits, QueueKeys, encode_body
from inferfleet.worker.handler import Handler, pad_batch, split_rows
from inferfleet.worker.runtime.formats import detect_kind
from inferfleet.worker.runtime.signature import (
    SpecError,
    describe_spec,
    parse_spec,
    spec_fits,
    spec_of,
    synthesize,
)
from inferfleet.worker.serving.batching import Request, form_batches
from inferfleet.worker.serving.intake import Answer, Intake


@pytest.mark.parametrize(
    "text",
    [
        "float32[N,16]",
        "int64[N,L]",
        "(float32[N,13], int64[N,26])",
        "{ids: int64[N,L], mask: bool[N,L]}",
        "uint8[N,3,H,W]",
        "int64[N]",
    ],
)
def test_specs_read_back_what_describe_writes(text):
    assert describe_spec(parse_spec(text)) == text


def test_a_fixed_spec_parses_to_what_an_example_gives():
    assert parse_spec("float32[N,16]") == spec_of(np.zeros((3, 16), np.float32))
    assert parse_spec("{b: int64[N,2], a: float32[N]}") == spec_of(
        {"a": np.zeros(2, np.float32), "b": np.zeros((2, 2), np.int64)}
    )


@pytest.mark.parametrize(
    "bad", ["float32", "float[N,16]", "int64[N,-1]", "{ids int64[N,L]}", "int64[]", ""]
)
def test_bad_specs_say_which_forms_are_accepted(bad):
    with pytest.raises(SpecError, match="Forms: float32"):
        parse_spec(bad)


def test_named_dimensions_vary_and_tie_tensors_together():
    model = parse_spec("{ids: int64[N,L], mask: bool[N,L]}")
    fits = {"ids": np.zeros((2, 7), np.int64), "mask": np.zeros((2, 7), bool)}
    assert spec_fits(spec_of(fits), model)
    assert not spec_fits(
        spec_of({"ids": np.zeros((2, 7), np.int64), "mask": np.zeros((2, 6), bool)}), model
    )
    assert not spec_fits(
        spec_of({"ids": np.zeros((2, 7), np.int32), "mask": np.zeros((2, 7), bool)}), model
    )
    assert not spec_fits(
        spec_of({"ids": np.zeros((2, 7, 1), np.int64), "mask": np.zeros((2, 7), bool)}), model
    )
    assert spec_fits(
        spec_of(np.zeros((1, 3, 5))), parse_spec("float64[N,*,*]")
    )  # '*' is never tied
    assert not spec_fits(spec_of("text"), parse_spec("int64[N,L]"))


def test_synthesised_examples_are_zeros_of_the_spec():
    example = synthesize(parse_spec("{ids: int64[N,L], x: float32[N,3]}"), rows=2, length=5)
    assert (
        example["ids"].shape == (2, 5)
        and example["ids"].dtype == np.int64
        and not example["ids"].any()
    )
    assert example["x"].shape == (2, 3)
    assert spec_fits(spec_of(example), parse_spec("{ids: int64[N,L], x: float32[N,3]}"))


def test_file_kinds_come_from_content_not_names(tmp_path, models_dir):
    assert detect_kind(str(models_dir / "ctr.pt")) == "torchscript"
    assert detect_kind(str(models_dir / "affine.pt2")) == "export"
    renamed = tmp_path / "model.onnx"
    renamed.write_bytes((models_dir / "affine.pt2").read_bytes())
    assert detect_kind(str(renamed)) == "export"
    (tmp_path / "pickle.pt").write_bytes(b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19.")
    assert detect_kind(str(tmp_path / "pickle.pt")) == "torch-save"
    (tmp_path / "text.pt").write_text("hello")
    assert detect_kind(str(tmp_path / "text.pt")) == "unknown"


def test_pad_batch_pads_to_the_bucket_with_a_mask():
    batch, mask = pad_batch([np.array([[1, 2]]), np.array([[3, 4, 5], [6, 7, 8]])], buckets=(4, 8))
    assert batch.tolist() == [[1, 2, 0, 0], [3, 4, 5, 0], [6, 7, 8, 0]]
    assert mask.tolist() == [
        [True, True, False, False],
        [True, True, True, False],
        [True, True, True, False],
    ]
    batch, _ = pad_batch([np.ones((1, 9), np.int64)], pad_value=-1, buckets=(4, 8))
    assert batch.shape == (1, 9)  # past the last bucket: the longest length


def test_split_rows_cuts_every_output_form():
    parts = split_rows({"a": np.arange(3), "b": [np.arange(3), np.arange(3) * 2]}, [1, 2])
    assert parts[1]["a"].tolist() == [1, 2] and parts[1]["b"][1].tolist() == [2, 4]
    with pytest.raises(ValueError, match="3 rows for a batch of 4"):
        split_rows(np.arange(3), [2, 2])


class _PerRequest(Handler):
    def decode_request(self, inputs, params):
        return inputs


def test_a_handler_is_per_request_only_when_it_overrides_a_hook():
    assert _PerRequest().per_request and not Handler().per_request


def _admit(intake: Intake, rid: str, inputs) -> Request | Answer:
    return intake.admit(b"1-0", {b"id": rid.encode(), b"body": encode_body(inputs)}, 0.0)


def test_intake_admits_varying_lengths_and_raw_text_only_where_the_model_takes_them():
    keys = QueueKeys("q")
    plain = Intake(keys, Limits(), ("q", "1"), parse_spec("int64[N,L]"))
    short, long_ = (
        _admit(plain, "a", np.zeros((1, 3), np.int64)),
        _admit(plain, "b", np.zeros((1, 9), np.int64)),
    )
    assert (
        isinstance(short, Request)
        and isinstance(long_, Request)
        and short.signature != long_.signature
    )
    refused = _admit(plain, "c", "some text")
    assert isinstance(refused, Answer) and refused.code == "bad_request"
    per_request = Intake(keys, Limits(), ("q", "1"), None, per_request=True)
    admitted = [
        _admit(per_request, rid, x)
        for rid, x in [
            ("d", "some text"),
            ("e", b"bytes"),
            ("f", np.zeros((1, 3), np.int64)),
            ("g", "more"),
        ]
    ]
    assert all(isinstance(r, Request) for r in admitted)
    assert [r.rows for r in admitted] == [1, 1, 1, 1]  # type: ignore[union-attr]
    assert len(form_batches(admitted, 64)) == 1  # type: ignore[arg-type]  # one batch, whatever the form


def test_an_onnx_graph_without_metadata_gives_its_own_spec_with_symbolic_dims(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from inferfleet.worker.config import WorkerSettings
    from inferfleet.worker.runtime.loading import load_runtime

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "length"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])
    node = helper.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=1)
    model = helper.make_model(
        helper.make_graph([node], "mean", [x], [y]), opset_imports=[helper.make_opsetid("", 13)]
    )
    model.ir_version = 8
    path = tmp_path / "mean.bin"  # no .onnx suffix: recognised by content
    onnx.save(model, str(path))
    runtime = load_runtime(WorkerSettings(name="q", model=str(path), device="cpu", warmup_iters=1))
    assert describe_spec(runtime.input_spec) == "float32[N,L]"
    assert runtime.example is not None  # synthesised, and the warm-up ran through onnxruntime
    out = runtime.predict(np.array([[1.0, 3.0, 5.0]], np.float32), {})
    np.testing.assert_allclose(out, [[3.0]])
