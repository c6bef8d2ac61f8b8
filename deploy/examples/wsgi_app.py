"""A plain WSGI app that answers ``POST /predict`` from an inferfleet fleet.

Run it as a service would (docs/operations.md, "From a web service")::

    gunicorn --preload --workers 4 --threads 8 --chdir deploy/examples wsgi_app:app

One module-level :class:`~inferfleet.producer.Producer` serves every thread of a
process: its calls share one reply reader and their writes go out together.
With ``--preload`` it is made once in gunicorn's master and inherited by each
forked worker, which draws its own request ids and inbox at the fork, so no
process is handed another's replies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import predict_api

from inferfleet.producer import Producer

producer = Producer(name=predict_api.QUEUE)  # $REDIS_URL

Start = Callable[[str, list[tuple[str, str]]], object]
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    429: "Too Many Requests",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


def app(environ: dict, start_response: Start) -> Iterable[bytes]:
    """The WSGI entry point: ``/predict`` (POST) and ``/healthz`` (GET)."""
    path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
    if path == "/healthz":
        status, body = _health()
    elif path != "/predict":
        status, body = 404, b'{"error": "not found"}'
    elif method != "POST":
        status, body = 405, b'{"error": "POST a JSON body to /predict"}'
    else:
        status, body = _predict(environ)
    start_response(
        f"{status} {_REASONS[status]}",
        [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
    )
    return [body]


def _read_body(environ: dict) -> bytes:
    """The request's body, refused unread when its declared length is over the limit."""
    length = predict_api.declared_length(environ.get("CONTENT_LENGTH"))
    return environ["wsgi.input"].read(length) if length > 0 else b""


def _predict(environ: dict) -> tuple[int, bytes]:
    try:
        inputs = predict_api.parse_inputs(_read_body(environ))
        outputs = producer.infer(inputs, timeout_s=predict_api.TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - error_reply re-raises what is not ours
        return predict_api.error_reply(exc)
    return 200, predict_api.outputs_body(outputs)


def _health() -> tuple[int, bytes]:
    try:
        backlog = producer.backlog()
    except Exception as exc:  # noqa: BLE001 - a Redis that does not answer is a 503
        return predict_api.error_reply(exc)
    return 200, f'{{"backlog": {backlog}}}'.encode()
