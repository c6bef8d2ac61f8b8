"""Bring your own model: files saved the usual way, served with checks and warm-up, no example
file."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from inferfleet.producer import Producer
from inferfleet.worker import save_model
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.errors import ModelLoadError
from inferfleet.worker.runtime.loading import load_runtime
from inferfleet.worker.runtime.signature import describe_spec
from tests.integration.test_consumer import drain, make_consumer


class MeanEmbed(torch.nn.Module):
    """Token ids of any length to one vector per row (an EmbeddingBag-style model)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(100, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).mean(1)


class Masked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = torch.nn.Embedding(50, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (self.embed(ids) * mask.unsqueeze(-1).float()).sum(1)


def _exported(path, dynamic_length: bool = True):
    """A torch.export program saved the plain way: no extra files, no example."""
    batch = torch.export.Dim("batch", min=1, max=1024)
    dims = (
        {0: batch, 1: torch.export.Dim("length", min=1, max=512)} if dynamic_length else {0: batch}
    )
    program = torch.export.export(
        MeanEmbed(), (torch.zeros(2, 5, dtype=torch.int64),), dynamic_shapes=(dims,)
    )
    torch.export.save(program, str(path))
    return str(path)


def _expected(ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return MeanEmbed()(torch.from_numpy(ids)).numpy()


def test_exported_model_with_a_dynamic_length_is_checked_warmed_and_batched_by_length(
    tmp_path, redis_url, redis_client, caplog
):
    model = _exported(tmp_path / "plain-export.bin")  # the name says nothing: the content does
    with caplog.at_level(logging.INFO, logger="inferfleet"):
        consumer = make_consumer(redis_url, model, idle_block_ms=50, max_batch_rows=16)
    assert describe_spec(consumer.runtime.input_spec) == "int64[N,L]"  # read from the program
    assert consumer.runtime.example is not None  # synthesised: the warm-up ran on zeros
    assert "warming up on zeros of its input spec int64[N,L]" in caplog.text
    producer = Producer(redis_url, "q")
    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, 100, (1, length)) for length in (3, 3, 7, 3, 7, 12)]
    refused = [np.zeros((1, 4), np.float32), np.zeros((1, 2, 2), np.int64)]
    rids = producer.submit_many(inputs + refused)
    drain(consumer)
    replies = producer.results(rids, timeout_s=10, raise_errors=False)
    for x, reply in zip(inputs, replies):
        assert reply.ok, reply.error_message
        np.testing.assert_allclose(reply.outputs, _expected(x), rtol=1e-5, atol=1e-6)
    assert [r.timing["batch_rows"] for r in replies[:6]] == [3, 3, 2, 3, 2, 1]  # grouped by length
    for reply in replies[6:]:
        assert (
            reply.error_code == "bad_request"
            and "the model takes int64[N,L]" in reply.error_message
        )


def test_a_static_trailing_dimension_is_still_enforced(tmp_path, redis_url, redis_client):
    consumer = make_consumer(
        redis_url, _exported(tmp_path / "fixed.pt2", dynamic_length=False), idle_block_ms=50
    )
    assert describe_spec(consumer.runtime.input_spec) == "int64[N,5]"
    producer = Producer(redis_url, "q")
    ok, wrong = (
        producer.submit(np.ones((2, 5), np.int64)),
        producer.submit(np.ones((2, 6), np.int64)),
    )
    drain(consumer)
    assert producer.result(ok, timeout_s=5).ok
    assert producer.result(wrong, timeout_s=5, raise_errors=False).error_code == "bad_request"


def test_torchscript_with_input_spec_varies_where_named(tmp_path, redis_url, redis_client, caplog):
    path = str(tmp_path / "scripted.pt")
    torch.jit.save(torch.jit.script(MeanEmbed()), path)
    with caplog.at_level(logging.WARNING):
        bare = load_runtime(WorkerSettings(name="q", model=path, device="cpu", warmup_iters=1))
    assert bare.input_spec is None and bare.example is None
    assert (
        "--warmup-input" in caplog.text and "--input-spec" in caplog.text
    )  # the warning names the fix
    consumer = make_consumer(redis_url, path, idle_block_ms=50, input_spec="int64[N,L]")
    producer = Producer(redis_url, "q")
    good = [np.arange(n).reshape(1, n) for n in (2, 9)]
    rids = producer.submit_many([*good, np.zeros((1, 3), np.float32)])
    drain(consumer)
    replies = producer.results(rids, timeout_s=5, raise_errors=False)
    for x, reply in zip(good, replies):
        np.testing.assert_allclose(reply.outputs, _expected(x), rtol=1e-5, atol=1e-6)
    assert replies[2].error_code == "bad_request" and "int64[N,L]" in replies[2].error_message


def test_a_bad_input_spec_is_one_clear_load_error(tmp_path):
    path = str(tmp_path / "scripted.pt")
    torch.jit.save(torch.jit.script(MeanEmbed()), path)
    with pytest.raises(ModelLoadError, match=r"input spec 'int64\[N,L': .*Forms: float32\[N,16\]"):
        load_runtime(WorkerSettings(name="q", model=path, device="cpu", input_spec="int64[N,L"))


def test_save_model_ships_example_and_spec_in_one_file(tmp_path, redis_url, redis_client):
    path = str(tmp_path / "masked.pt2")
    example = {"ids": np.ones((1, 6), np.int64), "mask": np.ones((1, 6), bool)}
    written = save_model(Masked(), example, path, dynamic={"ids": [1], "mask": [1]})
    assert written == "{ids: int64[N,L], mask: bool[N,L]}"
    consumer = make_consumer(redis_url, path, idle_block_ms=50)
    assert describe_spec(consumer.runtime.input_spec) == written
    np.testing.assert_array_equal(
        consumer.runtime.example["ids"], example["ids"]
    )  # the shipped example
    producer = Producer(redis_url, "q")
    x = {"ids": np.arange(10).reshape(2, 5), "mask": np.array([[1, 1, 1, 0, 0], [1] * 5], bool)}
    mismatched = {
        "ids": np.ones((1, 4), np.int64),
        "mask": np.ones((1, 3), bool),
    }  # L must be one length
    rids = producer.submit_many([x, mismatched])
    drain(consumer)
    reply, refused = producer.results(rids, timeout_s=5, raise_errors=False)
    with torch.no_grad():
        expected = Masked()(torch.from_numpy(x["ids"]), torch.from_numpy(x["mask"])).numpy()
    np.testing.assert_allclose(reply.outputs, expected, rtol=1e-5, atol=1e-6)
    assert refused.error_code == "bad_request"


def test_save_model_keeps_a_script_module_as_torchscript_with_its_spec(tmp_path):
    path = str(tmp_path / "scripted-with-spec.pt")
    save_model(torch.jit.script(MeanEmbed()), np.zeros((1, 4), np.int64), path, dynamic=[1])
    runtime = load_runtime(WorkerSettings(name="q", model=path, device="cpu", warmup_iters=1))
    assert describe_spec(runtime.input_spec) == "int64[N,L]"


def test_torch_save_files_are_named_and_never_unpickled(tmp_path, monkeypatch):
    state = tmp_path / "weights.pt"
    torch.save(MeanEmbed().state_dict(), str(state))
    legacy = tmp_path / "legacy.pth"
    torch.save(MeanEmbed(), str(legacy), _use_new_zipfile_serialization=False)

    def refuse(*args, **kwargs):
        raise AssertionError("the loader unpickled a file")

    monkeypatch.setattr(torch, "load", refuse)
    for path in (state, legacy):
        said = r"is a torch.save file .* never unpickles.*save_model\(module, example"
        with pytest.raises(ModelLoadError, match=said):
            load_runtime(WorkerSettings(name="q", model=str(path), device="cpu"))


def test_a_model_error_keeps_the_cause_not_the_torchscript_preamble(
    tmp_path, redis_url, redis_client
):
    path = str(tmp_path / "linear.pt")
    torch.jit.save(
        torch.jit.script(torch.nn.Sequential(torch.nn.Linear(16, 4), torch.nn.ReLU())), path
    )
    consumer = make_consumer(
        redis_url, path, idle_block_ms=50, warmup_iters=0
    )  # no spec: no checks
    producer = Producer(redis_url, "q")
    rid = producer.submit(np.ones((1, 5), np.float32))
    drain(consumer)
    reply = producer.result(rid, timeout_s=5, raise_errors=False)
    assert reply.error_code == "model_error"
    assert "mat1 and mat2 shapes cannot be multiplied (1x5 and 16x4)" in reply.error_message
    assert "\n" not in reply.error_message and "TorchScript interpreter" not in reply.error_message
