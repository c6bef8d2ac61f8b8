"""A Starlette app that answers ``POST /predict`` from an inferfleet fleet.

Run it as a service would (docs/operations.md, "From a web service")::

    uvicorn --app-dir deploy/examples asgi_app:app

One :class:`~inferfleet.producer.AsyncProducer`, made when the app starts on
uvicorn's loop and closed when it stops, serves every request: the tasks'
calls share one reply reader task and their writes go out together each tick.
A request the client abandons is cancelled; its late reply is dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import predict_api
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from inferfleet.producer import AsyncProducer


def _json(status: int, body: bytes) -> Response:
    return Response(body, status_code=status, media_type="application/json")


async def predict(request: Request) -> Response:
    """``POST /predict``: the outputs for ``{"inputs": rows}``."""
    producer: AsyncProducer = request.app.state.producer
    try:
        predict_api.declared_length(request.headers.get("content-length"))
        inputs = predict_api.parse_inputs(await request.body())
        outputs = await producer.infer(inputs, timeout_s=predict_api.TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - error_reply re-raises what is not ours
        return _json(*predict_api.error_reply(exc))
    return _json(200, predict_api.outputs_body(outputs))


async def healthz(request: Request) -> Response:
    """``GET /healthz``: 200 with the queue's backlog while Redis answers."""
    try:
        backlog = await request.app.state.producer.backlog()
    except Exception as exc:  # noqa: BLE001 - a Redis that does not answer is a 503
        return _json(*predict_api.error_reply(exc))
    return _json(200, f'{{"backlog": {backlog}}}'.encode())


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    """One producer for the app's life, on the loop that serves it."""
    app.state.producer = AsyncProducer(name=predict_api.QUEUE)  # $REDIS_URL
    try:
        yield
    finally:
        await app.state.producer.close()


app = Starlette(
    routes=[Route("/predict", predict, methods=["POST"]), Route("/healthz", healthz)],
    lifespan=lifespan,
)
