"""The CLI's options against the settings dataclasses: one source for defaults, env vars and
help."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

import click
import pytest

from inferfleet.worker.cli import main
from inferfleet.worker.cli.options import (
    QueueConfig,
    SettingOption,
    pass_queue_config,
    setting_option,
)
from inferfleet.worker.config import ENV_VARS, WorkerSettings, env_var
from inferfleet.worker.errors import ConfigError
from inferfleet.worker.fleet.scaling import PolicySettings
from inferfleet.worker.fleet.supervisor import SupervisorSettings


def commands(
    command: click.Command = main, path: str = "inferfleet"
) -> Iterator[tuple[str, click.Command]]:
    """Every command of the CLI, groups' subcommands included, with its full name."""
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from commands(sub, f"{path} {name}")


def command(name: str) -> click.Command:
    return dict(commands())[f"inferfleet {name}"]


def _field(settings: type, name: str) -> Field[Any]:
    return next(f for f in fields(settings) if f.name == name)


def setting_options(cmd: click.Command) -> list[SettingOption]:
    return [p for p in cmd.params if isinstance(p, SettingOption)]


def shown_default(cmd: click.Command, option: click.Option) -> str | None:
    with click.Context(cmd, info_name=cmd.name) as ctx:
        return option.get_help_extra(ctx).get("default")


def expected_shown(option: click.Option, default: Any) -> str | None:
    """What --help shows as the default: the value, or the name of a boolean flag's default side."""
    if default is None:
        return None
    if isinstance(default, bool) and option.secondary_opts:
        return (option.opts if default else option.secondary_opts)[0].lstrip("-")
    return str(default) if default != "" else '""'  # click shows an empty default as ""


def test_every_env_var_of_the_worker_settings_is_read_by_an_option() -> None:
    read = {p.envvar for _, cmd in commands() for p in cmd.params if isinstance(p, click.Option)}
    assert set(ENV_VARS.values()) - read == set()


def test_the_worker_has_an_option_built_from_every_worker_settings_field() -> None:
    built = {p.setting.name for p in setting_options(command("worker"))}
    assert built == {f.name for f in fields(WorkerSettings)}


@pytest.mark.parametrize("name", ["worker", "supervise"])
def test_every_worker_option_has_the_fields_default_env_var_and_help(name: str) -> None:
    cmd = command(name)
    for option in setting_options(cmd):
        setting = option.setting
        assert option.envvar == env_var(setting), option.name
        assert option.help == setting.metadata["help"], option.name
        if setting.default is not MISSING:
            assert option.default == setting.default, option.name
            assert shown_default(cmd, option) == expected_shown(option, setting.default), (
                option.name
            )
        elif (
            setting.default_factory is not MISSING
        ):  # None: the dataclass computes it (REDIS_URL, host-pid)
            assert option.default is None and not option.required, option.name
        else:
            assert option.required, option.name


def test_every_option_built_from_a_field_anywhere_shows_its_default() -> None:
    for path, cmd in commands():
        for option in setting_options(cmd):
            assert option.envvar == env_var(option.setting), (path, option.name)
            if option.setting.default is not MISSING:
                assert option.default == option.setting.default, (path, option.name)
                assert shown_default(cmd, option) == expected_shown(
                    option, option.setting.default
                ), (path, option.name)


def test_supervise_builds_every_supervisor_and_policy_option_from_its_field() -> None:
    cmd = command("supervise")
    built = {p.setting.name: p for p in setting_options(cmd)}
    for settings in (SupervisorSettings, PolicySettings):
        names = {f.name for f in fields(settings) if "help" in f.metadata}
        assert names, settings
        for name in names:
            setting = _field(settings, name)
            assert built[name].setting is setting, name
            assert built[name].default == setting.default, name
            assert shown_default(cmd, built[name]) == str(setting.default), name
    assert built["kind"].opts == ["--policy"] and built["kind"].envvar == "INFERFLEET_POLICY"
    assert built["min_workers"].envvar == "INFERFLEET_MIN_WORKERS"


def test_supervise_options_not_built_from_a_field_are_the_known_few() -> None:
    # --devices is a spec the command resolves into the field; --max-workers' default follows
    # --devices.
    plain = {p.name for p in command("supervise").params if not isinstance(p, SettingOption)}
    assert plain == {"devices", "max_workers", "log_level", "log_format"}
    params = {p.name: p for p in command("supervise").params}
    assert params["max_workers"].envvar == env_var(_field(PolicySettings, "max_workers"))
    assert params["devices"].envvar == "INFERFLEET_DEVICES"


def _range_options() -> list[SettingOption]:
    return [
        p
        for p in setting_options(command("worker"))
        if isinstance(p.type, (click.IntRange, click.FloatRange))
    ]


def test_an_options_range_is_what_the_worker_settings_accept() -> None:
    assert {p.name for p in _range_options()} == {
        "warmup_iters",
        "idle_block_ms",
        "housekeeping_s",
        "heartbeat_s",
        "stage",
        "wait_replicas",
        "wait_timeout_ms",
        "chunk_ms",
    }
    for option in _range_options():
        low, high = option.type.min, option.type.max
        step = 1 if isinstance(option.type, click.IntRange) else (low / 2 or 0.5)
        for ok in (low, high):
            assert (
                getattr(WorkerSettings(name="q", model="m.pt", **{option.name: ok}), option.name)
                == ok
            )
        for bad in (low - step, high + step):
            with pytest.raises(ConfigError, match=option.name):
                WorkerSettings(name="q", model="m.pt", **{option.name: bad})


def test_a_default_changed_in_the_dataclass_changes_the_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @dataclass(frozen=True)
    class Demo:
        name: str = field(metadata={"help": "A name."})
        rows: int = field(default=7, metadata={"help": "Rows."})
        url: str = field(
            default_factory=lambda: "computed", metadata={"help": "A URL.", "env": "DEMO_URL"}
        )

    @click.command()
    @setting_option(Demo, "name", "--name")
    @setting_option(Demo, "rows", "--rows", type=int)
    @setting_option(Demo, "url", "--url")
    def demo(**options: Any) -> None:
        pass

    params = {p.name: p for p in demo.params}
    assert params["name"].required and params["name"].envvar == "INFERFLEET_NAME"
    assert (
        params["rows"].default == 7
        and params["rows"].help == "Rows."
        and params["rows"].show_default
    )
    assert params["url"].default is None and params["url"].envvar == "DEMO_URL"
    assert demo.make_context("demo", ["--name", "q"]).params == {
        "name": "q",
        "rows": 7,
        "url": None,
    }
    monkeypatch.setenv("INFERFLEET_ROWS", "9")
    assert demo.make_context("demo", ["--name", "q"]).params["rows"] == 9
    with pytest.raises(TypeError, match="no field 'nope'"):
        setting_option(Demo, "nope", "--nope")


def test_pass_queue_config_hands_one_frozen_config_and_keeps_the_help_order() -> None:
    seen: list[tuple[QueueConfig, int]] = []

    @click.command()
    @pass_queue_config
    @click.option("--count", type=int, default=1)
    def listing(queue: QueueConfig, count: int) -> None:
        seen.append((queue, count))

    assert [p.name for p in listing.params] == [
        "name",
        "count",
        "redis_url",
        "prefix",
        "shards",
        "cluster",
    ]
    listing.main(
        ["--name", "q", "--count", "3", "--shards", "2", "--cluster"], standalone_mode=False
    )
    queue, count = seen[0]
    assert count == 3
    assert queue == QueueConfig(
        name="q",
        redis_url=None,
        prefix=_field(WorkerSettings, "prefix").default,
        shards=2,
        cluster=True,
    )
    with pytest.raises(AttributeError):
        queue.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "name",
    [
        "enqueue",
        "result",
        "swap",
        "alerts",
        "dead list",
        "dead show",
        "dead replay",
        "dead purge",
        "status",
    ],
)
def test_queue_commands_take_the_queue_options_from_one_place(name: str) -> None:
    params = command(name).params
    options = [p.name for p in params if isinstance(p, click.Option) and p.name != "help"]
    assert options[0] == "name"
    assert options[-4:] == ["redis_url", "prefix", "shards", "cluster"]
    connection = [p for p in params if p.name in ("redis_url", "prefix", "shards", "cluster")]
    assert all(isinstance(p, SettingOption) for p in connection)


def test_env_var_is_inferfleet_name_unless_the_field_names_one() -> None:
    assert env_var(_field(WorkerSettings, "max_batch_rows")) == "INFERFLEET_MAX_BATCH_ROWS"
    assert env_var(_field(WorkerSettings, "redis_url")) == "REDIS_URL"
    assert env_var(_field(PolicySettings, "kind")) == "INFERFLEET_POLICY"


#: Standard environment variables an option may read instead of an INFERFLEET_* one.
STANDARD_ENV_VARS = {"REDIS_URL"}

_ACTION = "an action, not a setting: a variable left set would repeat it on every call"
_ENDLESS = (
    "runs until interrupted: a variable left set would turn every scripted call into an endless one"
)
_ONE_REQUEST = "one request's own data: a variable left set would send it again with every request"

#: Options that have no environment variable on purpose, and why.
NO_ENV_VAR: dict[tuple[str, str], str] = {
    ("inferfleet", "--version"): "click's own: prints the version",
    ("inferfleet enqueue", "--input"): _ONE_REQUEST,
    ("inferfleet enqueue", "--param"): _ONE_REQUEST,
    ("inferfleet enqueue", "--text"): _ONE_REQUEST,
    (
        "inferfleet enqueue",
        "--request-id",
    ): "one request's id: a variable left set would reuse it, and replies are read once",
    ("inferfleet status", "--watch"): _ENDLESS,
    ("inferfleet alerts", "--follow"): _ENDLESS,
    ("inferfleet dead replay", "--all"): _ACTION,
    (
        "inferfleet dead purge",
        "--yes",
    ): "skips the confirmation of a deletion: it must be typed each time",
    ("inferfleet swap", "--rollback"): _ACTION,
    ("inferfleet shadow", "--report"): _ACTION,
    ("inferfleet shadow", "--promote"): _ACTION,
    (
        "inferfleet shadow",
        "--force",
    ): "overrides the evidence for one promotion: it must be typed each time",
    ("inferfleet shadow", "--stop"): _ACTION,
    ("inferfleet limit", "--show"): _ACTION,
    ("inferfleet limit", "--clear"): _ACTION,
}


def _options() -> Iterator[tuple[str, click.Option]]:
    for path, cmd in commands():
        for param in cmd.params:
            if isinstance(param, click.Option) and param.name != "help":
                yield path, param


def test_every_option_of_every_command_has_an_env_var_or_a_reason_not_to() -> None:
    missing = []
    for path, option in _options():
        exempt = (path, option.opts[0]) in NO_ENV_VAR
        if option.envvar:
            assert not exempt, (
                f"{path} {option.opts[0]} has {option.envvar}: drop it from NO_ENV_VAR"
            )
            names = [option.envvar] if isinstance(option.envvar, str) else list(option.envvar)
            assert all(n.startswith("INFERFLEET_") or n in STANDARD_ENV_VARS for n in names), (
                path,
                names,
            )
            assert option.show_envvar, f"{path} {option.opts[0]}: --help must show {option.envvar}"
        elif not exempt:
            missing.append(f"{path} {option.opts[0]}")
    assert missing == [], (
        "options without an environment variable (add envvar=, or a reason in NO_ENV_VAR)"
    )
    assert set(NO_ENV_VAR) <= {(path, option.opts[0]) for path, option in _options()}, (
        "stale NO_ENV_VAR entries"
    )


def test_no_command_reads_one_env_var_into_two_options() -> None:
    for path, cmd in commands():
        names = [
            p.envvar
            for p in cmd.params
            if isinstance(p, click.Option) and isinstance(p.envvar, str)
        ]
        assert len(names) == len(set(names)), (path, sorted(n for n in names if names.count(n) > 1))


@pytest.mark.parametrize(
    ("name", "args", "env", "param", "value"),
    [
        ("status", [], {"INFERFLEET_STATUS_JSON": "1"}, "as_json", True),
        (
            "dead list",
            ["--name", "q"],
            {"INFERFLEET_DEAD_LIST_JSON": "true", "INFERFLEET_DEAD_LIST_COUNT": "7"},
            "count",
            7,
        ),
        ("shadow", ["--name", "q"], {"INFERFLEET_SHADOW_JSON": "1"}, "as_json", True),
        (
            "swap",
            ["--name", "q"],
            {"INFERFLEET_SWAP_WAIT_S": "5", "INFERFLEET_SWAP_CHECK": "false"},
            "wait_s",
            5.0,
        ),
        ("swap", ["--name", "q"], {"INFERFLEET_SWAP_CHECK": "false"}, "check", False),
        ("result", ["--name", "q", "r1"], {"INFERFLEET_RESULT_TIMEOUT_S": "2.5"}, "timeout_s", 2.5),
        ("alerts", ["--name", "q"], {"INFERFLEET_ALERTS_KIND": "non_finite"}, "kind", "non_finite"),
        (
            "save-model",
            ["m:M"],
            {
                "INFERFLEET_SAVE_MODEL_EXAMPLE": __file__,
                "INFERFLEET_SAVE_MODEL_OUT": "o.pt2",
                "INFERFLEET_SAVE_MODEL_INPUT_SPEC": "int64[N,L]",
            },
            "input_spec",
            "int64[N,L]",
        ),
        (
            "split",
            [],
            {
                "INFERFLEET_SPLIT_MODEL": "m.pt2",
                "INFERFLEET_SPLIT_EXAMPLE": "x.npy",
                "INFERFLEET_SPLIT_AT": "blocks.3",
                "INFERFLEET_SPLIT_OUT": "out",
            },
            "split_at",
            ["blocks.3"],
        ),
    ],
)
def test_an_option_reads_its_env_var(
    name: str,
    args: list[str],
    env: dict[str, str],
    param: str,
    value: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, text in env.items():
        monkeypatch.setenv(key, text)
    cmd = command(name)
    with cmd.make_context(name, list(args)) as ctx:
        assert ctx.params[param] == value
