"""Admission: turn one stream entry into a batchable Request or an immediate answer.

Pure (no Redis, no torch, the time passed in): every contract check a worker
makes before computing lives here, in the order the contract implies:
readable id, allowed ``reply_to``, deadline, size, body decoding, fit to the
model.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import (
    Envelope,
    Limits,
    QueueKeys,
    deadline_open,
    decode_body,
    decode_reply_to,
    encode_reply_error,
    entry_time_ms,
    is_expired,
    is_request_id,
    parse_entry,
    row_count,
    tenant_ok,
    validate_request_id,
)
from inferfleet.worker.logs import clip
from inferfleet.worker.runtime.signature import RAW_SPECS, describe_spec, spec_fits, spec_of
from inferfleet.worker.serving.batching import Request, signature_of
from inferfleet.worker.serving.templates import BodyTemplate

__all__ = ["Answer", "Intake", "fields_of"]

#: Body templates one intake keeps (one per body length seen; a fleet sees a few).
_TEMPLATES = 16
#: reply_to values one intake remembers as checked (a producer has one inbox per shard).
_INBOXES = 256
#: Request specs one intake remembers as fitting a model whose spec names varying dimensions.
_FITS = 256

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Answer:
    """What to write for one entry: a reply payload to a key, or only an XACK.

    ``reply_key`` None means the entry had no readable id: it is acknowledged
    (so it cannot block the pending list) and logged, never answered.
    """

    entry_id: bytes
    reply_key: str | None
    payload: bytes | None
    ok: bool = False
    dead: dict | None = None  # fields for the dead-letter stream, written before the reply
    rid: str | None = None  # the request id, when readable
    code: str | None = None  # the reply's error code (None when ok); counted in the metrics
    lane: int = 1  # the lane of its entry (0 high, 1 normal, 2 low): the stream its XACK goes to


def _readable_rid(fields: Mapping[bytes, bytes] | None) -> str | None:
    try:
        return validate_request_id(fields[b"id"]) if fields else None
    except (KeyError, ProtocolError, TypeError):
        return None


def fields_of(flat: list | None) -> dict | None:
    """An entry's fields as XREADGROUP sends them raw (``[name, value, ...]``) as a dict."""
    if flat is None:
        return None
    values = iter(flat)
    return dict(zip(values, values))


@dataclass
class Intake:
    """Admission rules for one queue and one loaded model.

    :meth:`admit` applies every rule. :meth:`admit_fast` first tries the
    common case at a fraction of the cost, with the same outcome: a body that
    fits a template learnt from an admitted one, an id, and a ``reply_to``
    already checked; anything else goes through :meth:`admit`.
    """

    keys: QueueKeys
    limits: Limits
    model: tuple[str, str]
    input_spec: Hashable | None = None
    accepts_params: bool = True
    #: The handler decodes each request itself (:meth:`Handler.decode_request`): raw inputs and any
    #: tensor shapes are admitted, and requests batch together whatever their shapes.
    per_request: bool = False
    _templates: dict[int, tuple[BodyTemplate, Hashable]] = field(default_factory=dict, repr=False)
    _inboxes: dict[bytes, str] = field(default_factory=dict, repr=False)
    _fits: dict[Hashable, bool] = field(default_factory=dict, repr=False)

    @property
    def reply_prefix(self) -> bytes:
        """The default reply key of request RID is this prefix followed by RID."""
        return self.keys.reply("").encode("ascii")

    def template_for(self, length: int) -> tuple[BodyTemplate, Hashable] | None:
        """The body template learnt for bodies of ``length`` bytes, with its signature, if any."""
        return self._templates.get(length)

    def checked_inbox(self, reply_to: bytes) -> str | None:
        """``reply_to`` as a key if it is an inbox already checked (None: :meth:`admit` decides)."""
        return self._inboxes.get(reply_to)

    def admit_fast(
        self, entry_id: bytes, fields: Mapping[bytes, bytes] | None, now_ms: float
    ) -> Request | Answer:
        """:meth:`admit`, through the fast path when the entry is the common case."""
        if fields:
            body = fields.get(b"body")
            known = self._templates.get(len(body)) if isinstance(body, bytes) else None
            if known is not None and isinstance(body, bytes):
                request = self._admit_known(entry_id, fields, body, known, now_ms)
                if request is not None:
                    return request
        admitted = self.admit(entry_id, fields, now_ms)
        if isinstance(admitted, Request):
            self._learn(fields[b"body"], admitted)  # type: ignore[index]
        return admitted

    def _admit_known(
        self,
        entry_id: bytes,
        fields: Mapping[bytes, bytes],
        body: bytes,
        known: tuple[BodyTemplate, Hashable],
        now_ms: float,
    ) -> Request | None:
        template, signature = known
        rid = fields.get(b"id")
        inputs = template.inputs_of(body)
        if inputs is None or not isinstance(rid, bytes) or not is_request_id(rid):
            return None
        reply_key = self.keys.reply(rid.decode("ascii"))
        if b"reply_to" in fields:
            reply_key = self._inboxes.get(fields[b"reply_to"])  # type: ignore[assignment]
            if reply_key is None:
                return None
        if not tenant_ok(fields):
            return None  # the general path refuses it
        deadline = fields.get(b"deadline")
        if deadline is not None and not deadline_open(deadline, now_ms):
            return None  # malformed or expired: the general path answers it
        return Request(
            entry_id,
            rid.decode("ascii"),
            reply_key,
            inputs,
            {},
            template.rows,
            signature,
            int(entry_id[: entry_id.index(b"-")]),
            now_ms,
        )

    def _learn(self, body: bytes, admitted: Request) -> None:
        template = BodyTemplate.learn(body, admitted.inputs, admitted.params)
        if template is not None and len(self._templates) < _TEMPLATES:
            self._templates[template.length] = (template, admitted.signature)
        if admitted.reply_key != self.keys.reply(admitted.rid) and len(self._inboxes) < _INBOXES:
            self._inboxes[admitted.reply_key.encode("ascii")] = admitted.reply_key

    def admit(
        self, entry_id: bytes, fields: Mapping[bytes, bytes] | None, now_ms: float
    ) -> Request | Answer:
        """Decide what to do with one entry. Never raises: hostile input is answered."""
        try:
            return self._admit(entry_id, fields, now_ms)
        except Exception as exc:  # noqa: BLE001 - a decoder bug must not kill the worker
            # one line, no traceback: a hostile client must not be able to flood the logs
            log.error(
                "entry %s could not be admitted: %s: %s",
                entry_id.decode(errors="replace"),
                type(exc).__name__,
                clip(exc),
            )
            if not fields:
                return Answer(entry_id, None, None)
            return self.refuse_entry(
                entry_id,
                fields,
                "bad_request",
                f"the request could not be decoded: {type(exc).__name__}",
            )

    def _admit(
        self, entry_id: bytes, fields: Mapping[bytes, bytes] | None, now_ms: float
    ) -> Request | Answer:
        if not fields:
            return Answer(entry_id, None, None)  # deleted while pending: nothing to answer
        env = self._envelope(entry_id, fields)
        if isinstance(env, Answer):
            return env
        reply_key = env.reply_to or self.keys.reply(env.rid)
        refusal = self._envelope_refusal(env, now_ms)
        if refusal is not None:
            return self._refuse(entry_id, env.rid, refusal[0] or reply_key, *refusal[1:])
        try:
            inputs, params = decode_body(env.body, self.limits)
        except ProtocolError as exc:
            return self._refuse(entry_id, env.rid, reply_key, exc.code, exc.message)
        spec = spec_of(inputs)
        rows = row_count(inputs)
        problem = self._misfit(spec, rows, params)
        if problem:
            return self._refuse(entry_id, env.rid, reply_key, "bad_request", problem)
        signature = signature_of(inputs, params, "per-request" if self.per_request else spec)
        return Request(
            entry_id,
            env.rid,
            reply_key,
            inputs,
            params,
            rows,
            signature,
            entry_time_ms(entry_id),
            now_ms,
        )

    def _envelope(self, entry_id: bytes, fields: Mapping[bytes, bytes]) -> Envelope | Answer:
        """The entry's envelope, or the answer to one that is malformed."""
        try:
            return parse_entry(fields)
        except ProtocolError as exc:
            rid = getattr(exc, "rid", None)
            if rid is None:
                log.warning(
                    "entry %s has no readable request id (%s): acknowledged without reply",
                    entry_id.decode(errors="replace"),
                    clip(exc),
                )
                return Answer(entry_id, None, None)
            return self._refuse(entry_id, rid, self.keys.reply(rid), exc.code, exc.message)

    def _envelope_refusal(self, env: Envelope, now_ms: float) -> tuple[str | None, str, str] | None:
        """(reply key if not the usual one, code, message) of a well-formed envelope refused."""
        if env.reply_to is not None and not self.keys.is_inbox(env.reply_to):
            inbox = self.keys.inbox_prefix
            return (
                self.keys.reply(env.rid),
                "bad_request",
                f"reply_to must be a key under {inbox!r}",
            )
        if env.deadline_ms is not None and is_expired(env.deadline_ms, now_ms):
            late_ms = now_ms - env.deadline_ms
            return None, "expired", f"picked up {late_ms:.0f} ms after its deadline"
        limit = self.limits.max_body_bytes
        if len(env.body) > limit:
            return None, "too_large", f"body is {len(env.body)} bytes, over the limit of {limit}"
        return None

    def _misfit(self, spec: Hashable, rows: int, params: dict) -> str | None:
        if rows == 0:
            return "a request needs at least one row (shape[0] >= 1)"
        if params and not self.accepts_params:
            return "this model takes no params"
        if self.per_request:
            return None  # the handler's decode_request checks each request
        if spec in RAW_SPECS:
            return (
                "this model takes tensors, not raw text or bytes: serve it with a handler that "
                "overrides decode_request (docs/handlers.md)"
            )
        if self.input_spec is not None and spec != self.input_spec and not self._fits_model(spec):
            return f"the model takes {describe_spec(self.input_spec)}, got {describe_spec(spec)}"
        return None

    def _fits_model(self, spec: Hashable) -> bool:
        """Whether ``spec`` fits a model spec with varying dimensions (remembered per spec)."""
        fits = self._fits.get(spec)
        if fits is None:
            fits = spec_fits(spec, self.input_spec)
            if len(self._fits) < _FITS:
                self._fits[spec] = fits
        return fits

    def refuse_entry(
        self, entry_id: bytes, fields: Mapping[bytes, bytes], code: str, message: str
    ) -> Answer:
        """Answer an entry with ``code`` without decoding its body (dead letters)."""
        rid = _readable_rid(fields)
        if rid is None:
            return Answer(entry_id, None, None)
        reply_to = decode_reply_to(fields.get(b"reply_to"))
        key = reply_to if reply_to and self.keys.is_inbox(reply_to) else self.keys.reply(rid)
        return self._refuse(entry_id, rid, key, code, message)

    def _refuse(self, entry_id: bytes, rid: str, key: str, code: str, message: str) -> Answer:
        return Answer(
            entry_id, key, encode_reply_error(rid, code, message, self.model), rid=rid, code=code
        )
