"""Producer and AsyncProducer offer the same public calls with the same signatures (issue 28)."""

from __future__ import annotations

import inspect

from inferfleet import AsyncProducer, Producer


def _public(cls: type) -> dict[str, object]:
    return {n: m for n, m in vars(cls).items() if callable(m) and not n.startswith("_")}


def test_same_public_methods() -> None:
    assert sorted(_public(Producer)) == sorted(_public(AsyncProducer))


def test_same_parameters_and_defaults() -> None:
    for name, sync in _public(Producer).items():
        sync_params = inspect.signature(sync).parameters  # type: ignore[arg-type]
        async_params = inspect.signature(getattr(AsyncProducer, name)).parameters
        assert [(p.name, p.kind, p.default) for p in sync_params.values()] == [
            (p.name, p.kind, p.default) for p in async_params.values()
        ], name


def test_async_calls_are_awaited() -> None:
    for name in _public(Producer):
        method = getattr(AsyncProducer, name)
        awaited = inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method)
        sync = getattr(Producer, name)
        assert awaited != inspect.iscoroutinefunction(sync), name


def test_defaults_come_from_one_module() -> None:
    from inferfleet.producer import defaults

    for cls in (Producer, AsyncProducer):
        init = inspect.signature(cls.__init__).parameters
        assert init["name"].default == defaults.NAME
        assert init["default_deadline_s"].default == defaults.DEADLINE_S
        assert init["full_wait_s"].default == defaults.FULL_WAIT_S
        assert init["on_full"].default == defaults.ON_FULL
        assert init["shards"].default == defaults.SHARDS
        assert inspect.signature(cls.map).parameters["window"].default == defaults.WINDOW
        assert inspect.signature(cls.submit_many).parameters["chunk"].default == defaults.CHUNK
        assert inspect.signature(cls.result).parameters["timeout_s"].default == defaults.TIMEOUT_S
    # the docstring and docs/operations.md quote the default deadline
    assert f"({defaults.DEADLINE_S:g} s)" in (Producer.__doc__ or "")
