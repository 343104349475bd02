"""Peer messages are routed through tables (issue 26), like the spool's HANDLERS: every kind
the schema lets through has exactly one handler, and no handler waits for a kind the schema
refuses."""

from __future__ import annotations

from det_local.federate import schema, service


def test_every_message_kind_has_one_handler() -> None:
    kinds = set(schema.SCHEMAS)
    gang = set(service.GANG_MESSAGES)
    assert set(service.PEER_HANDLERS) == kinds - gang
    assert set(service.GANG_HANDLERS) | {"relay"} == gang
    assert not set(service.PEER_HANDLERS) & set(service.GANG_HANDLERS)
