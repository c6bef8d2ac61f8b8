"""Pipeline stages without Redis: stage keys, the manifest's checks, stage intake and the forward
encoder, and the splitter's refusals (bad split points, an --out that is not a split)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import Limits, QueueKeys, decode_body, decode_reply, encode_body
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.errors import ConfigError, ModelLoadError, SplitError
from inferfleet.worker.keys import StageKeys, heartbeat_index, model_key, stage_keys, supervisor_key
from inferfleet.worker.runtime.pipeline import (
    FORMAT,
    MANIFEST,
    Manifest,
    StageInfo,
    pipeline_digest,
    read_manifest,
    sha256_of,
    stage_file,
    stage_program,
    write_manifest,
)
from inferfleet.worker.serving.batching import Request
from inferfleet.worker.serving.consumer import encode_answer
from inferfleet.worker.serving.intake import Answer
from inferfleet.worker.serving.stages import Forward, ForwardEncoder, StageIntake

ROOT = Path(__file__).resolve().parents[2]
X = np.arange(8, dtype=np.float32).reshape(2, 4)
META = ("q", "abc123def456")

# --------------------------------------------------------------------------- keys


def test_stage_keys_name_the_stage_stream_and_its_own_keys_under_the_queue_hash_tag() -> None:
    keys = StageKeys("q", stage=2)
    assert keys.requests == "inferfleet:{q}:stage:2"
    assert heartbeat_index(keys) == "inferfleet:{q}:stage:2:hb"
    assert supervisor_key(keys) == "inferfleet:{q}:stage:2:supervisor"
    # what the whole pipeline shares stays the queue's: replies, inboxes, dead letters, the swap
    queue = QueueKeys("q")
    assert (keys.reply("r"), keys.dead, keys.inbox_prefix) == (
        queue.reply("r"),
        queue.dead,
        queue.inbox_prefix,
    )
    assert model_key(keys) == model_key(queue)
    assert (
        stage_keys(queue, 0) is queue and stage_keys(queue, 3).requests == "inferfleet:{q}:stage:3"
    )


@pytest.mark.parametrize("stage", [0, -1, 64])
def test_a_stage_key_out_of_range_is_refused(stage: int) -> None:
    with pytest.raises(ProtocolError, match="stage must be from 1 to 63"):
        StageKeys("q", stage=stage)


def test_worker_settings_serve_their_stage_stream() -> None:
    assert (
        WorkerSettings(name="q", model="d", stage=1).queue_keys.requests == "inferfleet:{q}:stage:1"
    )
    assert (
        WorkerSettings(name="q", model="d", stage=0).queue_keys.requests
        == "inferfleet:{q}:requests"
    )
    assert (
        WorkerSettings(name="q", model="d", stage=1, shards=2, shard=1).queue_keys.requests
        == "inferfleet:{q.1}:stage:1"
    )
    with pytest.raises(ConfigError, match="stage must be a number from 0 to 63"):
        WorkerSettings(name="q", model="d", stage=99)


# --------------------------------------------------------------------------- manifest


def fake_split(tmp_path: Path, stages: int = 2) -> Path:
    """A split directory whose stage files are bytes, with a correct manifest."""
    out = tmp_path / "split"
    out.mkdir()
    infos = []
    for i in range(stages):
        (out / stage_file(i)).write_bytes(f"program {i}".encode())
        sig = {"form": "tensor", "tensors": [{"name": "x", "dtype": "float32", "shape": ["N", 4]}]}
        infos.append(
            StageInfo(
                i,
                stage_file(i),
                sha256_of(str(out / stage_file(i))),
                f"blocks.{i}" if i else "",
                sig,
                sig,
                10,
                40,
            )
        )
    split_at = [f"blocks.{i}" for i in range(1, stages)]
    write_manifest(
        str(out),
        Manifest("m:build", split_at, pipeline_digest([s.sha256 for s in infos], split_at), infos),
    )
    return out


def edit_manifest(directory: Path, change: Any) -> None:
    raw = json.loads((directory / MANIFEST).read_text())
    change(raw)
    (directory / MANIFEST).write_text(json.dumps(raw))


def test_a_manifest_round_trips_and_names_each_stage_program(tmp_path: Path) -> None:
    split = fake_split(tmp_path, 3)
    manifest = read_manifest(str(split))
    assert manifest.last == 2 and manifest.split_at == ["blocks.1", "blocks.2"]
    assert json.loads((split / MANIFEST).read_text())["format"] == FORMAT
    path, again = stage_program(str(split), 1)
    assert path == str(split / "stage-1.pt2") and again.version == manifest.version


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda raw: raw.update(format="other/9"), "format is 'other/9'"),
        (lambda raw: raw.update(stages=raw["stages"][:1]), "at least 2 stages"),
        (lambda raw: raw.update(split_at=[]), "split_at must list 1 names"),
        (lambda raw: raw["stages"][1].pop("sha256"), "stage 1 lacks the field 'sha256'"),
        (lambda raw: raw["stages"][1].update(stage=5), "stage 1 is listed as stage 5"),
        (lambda raw: raw.update(version="0" * 12), "is not the digest of its stages"),
    ],
)
def test_a_bad_manifest_is_refused_saying_what_is_wrong(
    tmp_path: Path, change: Any, message: str
) -> None:
    split = fake_split(tmp_path)
    edit_manifest(split, change)
    with pytest.raises(ModelLoadError, match=message):
        read_manifest(str(split))


def test_a_missing_or_unreadable_manifest_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="is not a directory"):
        read_manifest(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match=r"has no pipeline\.json"):
        read_manifest(str(tmp_path))
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(ModelLoadError, match="bad pipeline manifest"):
        read_manifest(str(tmp_path))


def test_a_stage_out_of_range_missing_or_altered_is_refused(tmp_path: Path) -> None:
    split = fake_split(tmp_path)
    with pytest.raises(ModelLoadError, match="has stages 0 to 1, not 2"):
        stage_program(str(split), 2)
    (split / "stage-1.pt2").write_bytes(b"a stage of another split")
    with pytest.raises(ModelLoadError, match="SHA-256 differs"):
        stage_program(str(split), 1)
    os.remove(split / "stage-1.pt2")
    with pytest.raises(ModelLoadError, match=r"stage-1\.pt2 is missing"):
        stage_program(str(split), 1)


def test_the_version_digest_changes_with_any_stage_or_split_point() -> None:
    base = pipeline_digest(["a", "b"], ["x"])
    assert len(base) == 12
    assert base != pipeline_digest(["a", "c"], ["x"]) and base != pipeline_digest(["a", "b"], ["y"])


# --------------------------------------------------------------------------- intake and forwarding


def stage_intake(**overrides: Any) -> StageIntake:
    options: dict[str, Any] = {"keys": StageKeys("q", stage=1), "limits": Limits(), "model": META}
    options.update(overrides)
    return StageIntake(**options)


def entry(**values: Any) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() if isinstance(v, str) else v for k, v in values.items()}


@pytest.mark.parametrize("fast", [True, False])
def test_a_stage_computes_only_activations_of_the_split_it_holds(fast: bool) -> None:
    intake = stage_intake(version=META[1].encode())
    admit = intake.admit_fast if fast else intake.admit
    body = encode_body(X)
    assert isinstance(admit(b"1-1", entry(id="r1", body=body, version=META[1]), 0.0), Request)
    for other in (entry(id="r2", body=body, version="0ld0ld0ld0ld"), entry(id="r3", body=body)):
        answer = admit(b"1-2", other, 0.0)
        assert isinstance(answer, Answer) and answer.code == "model_error"
        reply = decode_reply(answer.payload or b"")
        assert "pipeline version changed while the request was in flight" in (
            reply.error_message or ""
        )
        assert answer.reply_key == QueueKeys("q").reply(
            reply.id
        )  # answered to the request's own reply key


def test_a_forwarding_stage_keeps_deadline_reply_to_and_trace_for_the_next() -> None:
    intake = stage_intake(version=b"", carry=True)
    inbox = QueueKeys("q").inbox("c1")
    fields = entry(
        id="r1",
        body=encode_body(X),
        deadline="99999999999999",
        reply_to=inbox,
        traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01",
        tenant="t",
    )
    req = intake.admit_fast(b"1-1", fields, 0.0)
    assert isinstance(req, Request)
    assert req.extra == {
        b"deadline": b"99999999999999",
        b"reply_to": inbox.encode(),
        b"traceparent": fields[b"traceparent"],
    }
    assert req.reply_key == inbox
    expired = intake.admit(b"1-2", entry(id="r2", body=encode_body(X), deadline="5"), 10.0)
    assert (
        isinstance(expired, Answer) and expired.code == "expired"
    )  # deadlines hold at every stage


def test_the_forward_encoder_writes_activations_in_contract_encoding_and_errors_as_replies() -> (
    None
):
    req = Request(
        b"1-1", "r1", QueueKeys("q").reply("r1"), X, {}, 2, None, extra={b"deadline": b"123"}
    )
    out = ForwardEncoder(META, encode_answer).encode(
        [req, req], [X * 2, ValueError("boom")], 1.0, 4
    )
    forward, error = out
    assert isinstance(forward, Forward) and not isinstance(error, Forward)
    pairs = dict(zip(forward.fields[::2], forward.fields[1::2]))
    assert (
        pairs[b"id"] == "r1"
        and pairs[b"version"] == META[1].encode()
        and pairs[b"deadline"] == b"123"
    )
    inputs, params = decode_body(pairs[b"body"])
    np.testing.assert_array_equal(inputs, X * 2)
    assert params == {}
    assert error.code == "model_error" and "boom" in (
        decode_reply(error.payload or b"").error_message or ""
    )


# --------------------------------------------------------------------------- the splitter's
# refusals


def test_split_refuses_a_name_that_is_not_a_submodule_naming_the_candidates(tmp_path: Path) -> None:
    from inferfleet.worker.runtime.split import split_model

    example = np.zeros((2, 32), np.float32)
    with pytest.raises(
        SplitError,
        match=r"blocks\.9 is not a submodule.*candidates: embed, blocks, head, blocks\.0",
    ):
        split_model(
            "tests.fixtures.build_models:stack", example, ["blocks.9"], str(tmp_path / "out")
        )
    with pytest.raises(SplitError, match="names a submodule twice"):
        split_model(
            "tests.fixtures.build_models:stack",
            example,
            ["blocks.1", "blocks.1"],
            str(tmp_path / "out"),
        )
    with pytest.raises(SplitError, match=r"give package\.module:callable"):
        split_model("nocolon", example, ["blocks.1"], str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_split_refuses_an_out_directory_that_holds_something_else(tmp_path: Path) -> None:
    from inferfleet.worker.runtime.split import split_model

    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(SplitError, match="exists and is not a split"):
        split_model(
            "tests.fixtures.build_models:stack",
            np.zeros((2, 32), np.float32),
            ["blocks.1"],
            str(tmp_path),
        )
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_split_refuses_a_point_where_the_graph_cannot_be_cut(tmp_path: Path) -> None:
    from inferfleet.worker.runtime.split import split_model

    # `embed` is the model's first layer: a stage that starts there leaves nothing before it
    with pytest.raises(
        SplitError, match=r"cannot be cut at embed: torch found 1 stages, not 2.*candidates"
    ):
        split_model(
            "tests.fixtures.build_models:stack",
            np.zeros((2, 32), np.float32),
            ["embed"],
            str(tmp_path / "o"),
        )
    assert not (tmp_path / "o").exists()
