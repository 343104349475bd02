"""Peer messages are routed through tables (issue 26), like the spool's HANDLERS: every kind
the schema lets through has exactly one handler, and no handler waits for a kind the schema
refuses."""

from __future__ import annotations

from det_local.federate import messages, schema


def test_every_message_kind_has_one_handler() -> None:
    kinds = set(schema.SCHEMAS)
    gang = set(messages.GANG_MESSAGES)
    assert set(messages.PEER_HANDLERS) == kinds - gang
    assert set(messages.GANG_HANDLERS) | {"relay"} == gang
    assert not set(messages.PEER_HANDLERS) & set(messages.GANG_HANDLERS)
