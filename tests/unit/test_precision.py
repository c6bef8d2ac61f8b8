"""--precision int8 (inferfleet.worker.runtime.quantize, ONNX Runtime's quantizer) and the ONNX
Runtime backend."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.errors import ModelLoadError
from inferfleet.worker.handler import Handler
from inferfleet.worker.runtime.loading import apply_precision, load_runtime
from inferfleet.worker.runtime.modules import ModuleHandler
from inferfleet.worker.runtime.onnx_backend import OnnxHandler, int8_weight_kind, quantize_onnx
from inferfleet.worker.runtime.quantize import (
    DynamicInt8Linear,
    int8_linear,
    quantize_module,
    quantize_weight,
)
from inferfleet.worker.runtime.readers import file_version
from tests.fixtures.build_models import example_inputs

KINDS = ["affine", "ctr", "cnn"]


def runtime(path, **settings):
    return load_runtime(
        WorkerSettings(name="q", model=str(path), **{"warmup_iters": 1, **settings})
    )


BENCHMARKS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


@functools.cache
def documented_int8_bound() -> float:
    """The int8 accuracy docs/benchmarks.md states ("int8 moves outputs by at most X% of the output
    range", max |int8 - fp32| over max |fp32|), as a fraction: the bound every int8 test holds to,
    so the docs and the tests cannot drift apart. The docs measure 4096 rows of each example model
    (benchmarks/accuracy_report.py); the tests' smaller inputs and toy nets stay within it
    (0.14-0.83% measured when the bound was tied, from 3%)."""
    match = re.search(r"int8 moves outputs by at most\s+([0-9.]+)%", BENCHMARKS.read_text())
    assert match, "docs/benchmarks.md no longer states the int8 accuracy bound"
    return float(match.group(1)) / 100


def assert_int8_close(full: np.ndarray, quantized: np.ndarray) -> None:
    assert quantized.dtype == np.float32
    assert np.abs(quantized - full).max() <= documented_int8_bound() * np.abs(full).max()
    assert not np.array_equal(quantized, full)  # it really ran in int8


class TwoLayerHandler(Handler):
    """An eager handler whose model is an nn.Module attribute (what Handler.quantize looks for)."""

    def setup(self, device: torch.device) -> None:
        super().setup(device)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)).eval()

    def example_inputs(self) -> np.ndarray:
        return np.random.default_rng(0).standard_normal((4, 8), dtype=np.float32)

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        return self.net(x)


class NoLinearHandler(TwoLayerHandler):
    def setup(self, device: torch.device) -> None:
        super().setup(device)
        self.net = nn.Sequential(nn.ReLU())


# -- int8 arithmetic (pure) ----------------------------------------------------


def test_the_documented_int8_bound_covers_every_int8_row_of_the_accuracy_table():
    """The prose's "at most X%" against the table it sums up (max rel err, to the prose's
    precision)."""
    bound, rows = documented_int8_bound(), []
    for line in BENCHMARKS.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[1] in ("torch int8", "ORT int8"):
            rows.append((cells[0], cells[1], float(cells[3])))
    assert len(rows) >= 6, rows  # affine, ctr, cnn x torch, ORT
    digits = len(
        re.search(r"at most\s+([0-9.]+)%", BENCHMARKS.read_text()).group(1).partition(".")[2]
    )
    for model, variant, max_rel in rows:
        assert round(max_rel * 100, digits) <= bound * 100 + 1e-9, (model, variant, max_rel, bound)


def test_int8_linear_matches_float_linear_within_quantization_error():
    gen = torch.Generator().manual_seed(1)
    x, w, b = (
        torch.randn(64, 40, generator=gen),
        torch.randn(24, 40, generator=gen),
        torch.randn(24, generator=gen),
    )
    w_int8, scale = quantize_weight(w)
    assert w_int8.dtype == torch.int8 and scale.shape == (24,)
    got, want = int8_linear(x, w_int8, scale, b), x @ w.T + b
    assert got.dtype == torch.float32 and got.shape == (64, 24)
    assert (got - want).abs().max() <= documented_int8_bound() * want.abs().max()


def test_int8_linear_keeps_leading_dimensions_and_zero_rows():
    w_int8, scale = quantize_weight(torch.ones(5, 7))
    x = torch.zeros(2, 3, 7)  # an all-zero row must not divide by zero
    assert torch.equal(int8_linear(x, w_int8, scale, None), torch.zeros(2, 3, 5))


def test_quantize_module_swaps_every_linear_and_nothing_else():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 2)))
    x = torch.randn(10, 8)
    full = net(x).detach().numpy()
    quantized, count = quantize_module(net)
    assert count == 2
    assert isinstance(quantized[0], DynamicInt8Linear) and isinstance(quantized[1], nn.ReLU)
    with torch.inference_mode():
        assert_int8_close(full, quantized(x).numpy())


# -- int8 at load, per model kind ------------------------------------------------


def test_int8_export_program_stays_close_to_fp32(models_dir):
    x = example_inputs("affine", rows=50, seed=3)
    full = runtime(models_dir / "affine.pt2").predict(x, {})
    int8 = runtime(models_dir / "affine.pt2", precision="int8")
    assert "int8_linear" in int8.handler.module.code  # the graph itself was rewritten
    assert_int8_close(full, int8.predict(x, {}))


def test_int8_eager_handler_stays_close_to_fp32():
    spec = f"{__name__}:TwoLayerHandler"
    x = np.random.default_rng(1).standard_normal((20, 8), dtype=np.float32)
    full = runtime(spec).predict(x, {})
    int8 = runtime(spec, precision="int8")
    assert isinstance(int8.handler.net[0], DynamicInt8Linear)
    assert_int8_close(full, int8.predict(x, {}))


@pytest.mark.parametrize("kind", ["ctr", "cnn"])
def test_int8_onnx_quantized_at_load_stays_close_to_fp32(onnx_models_dir, kind):
    x = example_inputs(kind, rows=64, seed=2)
    full = runtime(onnx_models_dir / f"{kind}.onnx").predict(x, {})
    assert_int8_close(
        full, runtime(onnx_models_dir / f"{kind}.onnx", precision="int8").predict(x, {})
    )


# u8 weights give the same integers on every CPU, so measuring them here measures them on x86
# without VNNI too; s8 weights are exact only where this host would pick them.
WEIGHT_KINDS = ["u8"] + (["s8"] if int8_weight_kind() == "s8" else [])


@pytest.mark.parametrize("weights", WEIGHT_KINDS)
@pytest.mark.parametrize("kind", ["affine", "ctr"])
def test_int8_onnx_weight_kinds_each_stay_close_to_fp32(onnx_models_dir, tmp_path, kind, weights):
    quantize_onnx(str(onnx_models_dir / f"{kind}.onnx"), str(tmp_path / "q.onnx"), weights)
    x = example_inputs(kind, rows=64, seed=2)
    assert_int8_close(
        runtime(onnx_models_dir / f"{kind}.onnx").predict(x, {}),
        runtime(tmp_path / "q.onnx").predict(x, {}),
    )


@pytest.mark.parametrize(
    ("flags", "machine", "kind"),
    [
        ("fpu sse2 avx2 avx512f avx512_vnni", "x86_64", "s8"),
        ("fpu sse2 avx2 avx_vnni", "AMD64", "s8"),
        ("fpu sse2 avx2 avx512f", "x86_64", "u8"),  # the CPU that CI saw saturate
        ("fp asimd asimddp", "aarch64", "s8"),
    ],
)
def test_int8_weight_kind_avoids_saturating_kernels(flags, machine, kind):
    assert int8_weight_kind(flags, machine) == kind


def test_int8_weight_kind_obeys_the_override_and_refuses_a_bad_one(monkeypatch):
    monkeypatch.setenv("INFERFLEET_INT8_WEIGHTS", "U8")
    assert int8_weight_kind("avx512_vnni", "x86_64") == "u8"
    monkeypatch.setenv("INFERFLEET_INT8_WEIGHTS", "int4")
    with pytest.raises(ValueError, match="must be s8 or u8, not 'int4'"):
        int8_weight_kind()


def test_int8_onnx_copy_from_export_script_keeps_its_example_and_matches_load_time_int8(
    onnx_models_dir,
):
    x = example_inputs("ctr", rows=16, seed=6)
    copy = runtime(onnx_models_dir / "ctr.int8.onnx")
    assert (
        copy.example is not None
        and copy.input_spec == runtime(onnx_models_dir / "ctr.onnx").input_spec
    )
    at_load = runtime(onnx_models_dir / "ctr.onnx", precision="int8")
    np.testing.assert_allclose(copy.predict(x, {}), at_load.predict(x, {}), rtol=1e-5, atol=1e-6)


def test_int8_refuses_torchscript_naming_the_alternatives(models_dir):
    with pytest.raises(ModelLoadError, match=r"cannot quantize a TorchScript model.*\.pt2.*\.onnx"):
        runtime(models_dir / "ctr.pt", precision="int8")


def test_int8_refuses_a_handler_without_linear_layers():
    with pytest.raises(ModelLoadError, match=r"found no torch\.nn\.Linear .* NoLinearHandler"):
        runtime(f"{__name__}:NoLinearHandler", precision="int8")


def test_int8_refuses_a_gpu_device_naming_fp16_and_bf16():
    handler = ModuleHandler(nn.Linear(2, 2))
    with pytest.raises(ModelLoadError, match="CPU only; on cuda:0 use --precision fp16 or bf16"):
        apply_precision(handler, "int8", torch.device("cuda:0"))
    assert isinstance(handler.module, nn.Linear)  # nothing was quantized


# -- the ONNX Runtime backend ------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_onnx_model_equals_torchscript_with_the_same_spec_and_file_version(
    onnx_models_dir, models_dir, kind
):
    path = onnx_models_dir / f"{kind}.onnx"
    onnx_rt, script_rt = runtime(path, max_batch_rows=8), runtime(models_dir / f"{kind}.pt")
    assert isinstance(onnx_rt.handler, OnnxHandler) and not onnx_rt.accepts_params
    assert onnx_rt.input_spec == script_rt.input_spec  # the example came from metadata_props
    assert onnx_rt.version == file_version(str(path))
    for rows in (1, 7, 100):  # the batch axis is dynamic
        x = example_inputs(kind, rows=rows, seed=rows)
        np.testing.assert_allclose(
            onnx_rt.predict(x, {}), script_rt.predict(x, {}), rtol=1e-5, atol=1e-5
        )


def test_onnx_inputs_by_name_or_position_and_clear_errors(onnx_models_dir):
    rt = runtime(onnx_models_dir / "ctr.onnx")
    x = example_inputs("ctr", rows=3, seed=9)
    by_name = rt.predict(x, {})
    np.testing.assert_array_equal(rt.predict([x["dense"], x["sparse"]], {}), by_name)
    with pytest.raises(ValueError, match="inputs named dense, sparse; got dense, ids"):
        rt.predict({"dense": x["dense"], "ids": x["sparse"]}, {})
    with pytest.raises(ValueError, match=r"takes 2 inputs \(dense, sparse\); got 1"):
        rt.predict(x["dense"], {})
    with pytest.raises(ValueError, match="takes no params"):
        rt.predict(x, {"k": 1})


def test_onnx_warm_up_runs_the_example_at_every_batch_size(onnx_models_dir, monkeypatch):
    rt = runtime(onnx_models_dir / "affine.onnx", warmup_iters=0)
    seen, real_run = [], rt.handler.session.run

    def run(names, feed):
        seen.append(feed["x"].shape[0])
        return real_run(names, feed)

    monkeypatch.setattr(rt.handler.session, "run", run)
    assert rt.warmup(max_rows=8, iters=1) > 0
    assert seen == [1, 2, 4, 8]  # the example's 2 rows tiled to each size, through the session


def test_a_file_that_is_not_onnx_is_a_model_load_error(tmp_path):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"this is not a protobuf" * 10)
    with pytest.raises(ModelLoadError, match="is not a model file inferfleet can serve"):
        runtime(bad)  # recognised by its content, not its name: no loader is even tried
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(b"\x08\x07" + b"\xff" * 64)  # starts as an ONNX protobuf, then garbage
    with pytest.raises(ModelLoadError, match="onnxruntime cannot load the model"):
        runtime(truncated)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "amp"])
def test_onnx_refuses_the_torch_precisions(onnx_models_dir, precision):
    with pytest.raises(ModelLoadError, match=rf"--precision {precision} casts torch.*fp32 or int8"):
        runtime(onnx_models_dir / "affine.onnx", precision=precision)


def test_onnx_without_onnxruntime_says_what_to_install(onnx_models_dir, monkeypatch):
    monkeypatch.setitem(
        sys.modules, "onnxruntime", None
    )  # import onnxruntime now raises ImportError
    said = (
        r"needs onnxruntime: pip install onnxruntime "
        r"\(or, in a checkout, pip install -e '\.\[onnx\]'\)"
    )
    with pytest.raises(ModelLoadError, match=said):
        runtime(onnx_models_dir / "affine.onnx")
