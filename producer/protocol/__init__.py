"""The inferfleet wire contract, version 1 (docs/protocol.md): one module per concern.

Producers and workers both go through this package, so the contract lives
in one place, and nothing else imports msgpack:

* :mod:`.names`: the group and every Redis key of a queue
  (:class:`QueueKeys`), its shards (:func:`shard_keys`, :func:`shard_for`).
* :mod:`.rules`: the rule for each field of an entry (request id, tenant,
  deadline, reply_to), each defined once; the fast checks are built from it.
* :mod:`.codec`: msgpack with bounds, and the tensor codec
  (:func:`encode_inputs`, :func:`decode_inputs`).
* :mod:`.request`: the fields of one stream entry (:func:`request_fields`,
  :func:`parse_entry`) and its body (:func:`encode_body`, :func:`decode_body`).
* :mod:`.reply`: the one element of a reply list (:func:`encode_reply_ok`,
  :func:`encode_reply_error`, :func:`decode_reply`) and its layout.
* :mod:`.stream`: a streamed reply's chunks (:func:`parse_chunk`, :class:`StreamFold`), for
  requests that ask for one (contract 1.3).
* :mod:`.fast`: the SDK's bulk paths (:class:`BodyEncoder`,
  :func:`lazy_replies`), the same bytes as the general functions.

The worker's own templates (decoding bodies, encoding replies without
msgpack) live with the worker, in its ``serving/templates.py``.
"""

from __future__ import annotations

from inferfleet.producer.protocol.codec import (
    DEFAULT_LIMITS,
    DTYPES,
    OUTPUT_LIMITS,
    Inputs,
    Limits,
    decode_inputs,
    decode_outputs,
    encode_inputs,
    encode_outputs,
    encode_tensor,
    pack,
    row_count,
    unpack,
)
from inferfleet.producer.protocol.fast import (
    BodyEncoder,
    LazyReply,
    lazy_replies,
    lazy_reply,
    peek_reply,
)
from inferfleet.producer.protocol.names import (
    CONTRACT_VERSION,
    DEFAULT_PREFIX,
    DEFAULT_REPLY_TTL_S,
    ERROR_CODES,
    GROUP,
    MAX_SHARDS,
    GroupInfo,
    QueueKeys,
    entry_time_ms,
    shard_for,
    shard_keys,
    shard_name,
    workers_group,
)
from inferfleet.producer.protocol.reply import (
    ID_KEY,
    MAX_MESSAGE_CHARS,
    OK_FALSE,
    OK_TRUE,
    STR_HEADERS,
    Reply,
    decode_reply,
    encode_reply_error,
    encode_reply_ok,
    reply_timing,
)
from inferfleet.producer.protocol.request import (
    Envelope,
    decode_body,
    encode_body,
    parse_entry,
    request_fields,
)
from inferfleet.producer.protocol.rules import (
    MAX_DEADLINE_DIGITS,
    REQUEST_ID_PATTERN,
    all_request_ids,
    deadline_open,
    decode_reply_to,
    is_deadline,
    is_expired,
    is_request_id,
    is_tenant,
    parse_deadline,
    shown,
    tenant_ok,
    validate_name,
    validate_prefix,
    validate_request_id,
    validate_request_ids,
)
from inferfleet.producer.protocol.stream import (
    FINISH_REASONS,
    STREAM_FIELD,
    Chunk,
    StreamFold,
    chunk_fields,
    encode_chunk,
    encode_final,
    parse_chunk,
    wants_stream,
)

__all__ = [
    "FINISH_REASONS",
    "STREAM_FIELD",
    "Chunk",
    "StreamFold",
    "chunk_fields",
    "encode_chunk",
    "encode_final",
    "parse_chunk",
    "wants_stream",
    "CONTRACT_VERSION",
    "DEFAULT_LIMITS",
    "DEFAULT_PREFIX",
    "DEFAULT_REPLY_TTL_S",
    "DTYPES",
    "ERROR_CODES",
    "GROUP",
    "ID_KEY",
    "MAX_DEADLINE_DIGITS",
    "MAX_MESSAGE_CHARS",
    "MAX_SHARDS",
    "OK_FALSE",
    "OK_TRUE",
    "OUTPUT_LIMITS",
    "REQUEST_ID_PATTERN",
    "STR_HEADERS",
    "BodyEncoder",
    "Envelope",
    "GroupInfo",
    "Inputs",
    "LazyReply",
    "Limits",
    "QueueKeys",
    "Reply",
    "all_request_ids",
    "deadline_open",
    "decode_body",
    "decode_inputs",
    "decode_outputs",
    "decode_reply",
    "decode_reply_to",
    "encode_body",
    "encode_inputs",
    "encode_outputs",
    "encode_reply_error",
    "encode_reply_ok",
    "encode_tensor",
    "entry_time_ms",
    "is_deadline",
    "is_expired",
    "is_request_id",
    "is_tenant",
    "lazy_replies",
    "lazy_reply",
    "pack",
    "parse_deadline",
    "parse_entry",
    "peek_reply",
    "reply_timing",
    "request_fields",
    "row_count",
    "shard_for",
    "shard_keys",
    "shard_name",
    "shown",
    "tenant_ok",
    "unpack",
    "validate_name",
    "validate_prefix",
    "validate_request_id",
    "validate_request_ids",
    "workers_group",
]
