"""The key a full DHT node signs its records with is the key p2pd runs with; an ephemeral one leaves no file."""
from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from pathlib import Path

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarmnet.addresses import NetworkOptions
from swarmnet.identity import Identity
from swarmnet.network import start_dht_node, stop_dht_node
from swarmnet.records import SignedRecordValidator

pytestmark = pytest.mark.swarm  # each test starts a p2pd daemon


async def signer_of_a_full_node(options: NetworkOptions) -> tuple[str, SignedRecordValidator]:
    """The p2pd peer id of a full node started with `options`, and its record validator."""
    p2p, node = await start_dht_node([], options, client_mode=False)
    try:
        validator = node.protocol.record_validator
        assert isinstance(validator, SignedRecordValidator)
        return p2p.peer_id.to_base58(), validator
    finally:
        await stop_dht_node(p2p, node)


def signs_as(validator: SignedRecordValidator, peer_id: str) -> bool:
    """Whether the validator's own records under `peer_id` are valid for everyone else."""
    record = DHTRecord(b"k" * 20, MSGPackSerializer.dumps(peer_id), b"v", get_dht_time() + 30)
    return SignedRecordValidator().validate(dataclasses.replace(record, value=validator.sign_value(record)))


def test_without_identity_a_full_node_signs_with_an_ephemeral_key_it_deletes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the ephemeral key directory goes
    peer_id, validator = asyncio.run(signer_of_a_full_node(NetworkOptions()))
    assert validator.identity is not None and validator.identity.peer_id == peer_id
    assert signs_as(validator, peer_id)
    assert list(tmp_path.iterdir()) == []  # the key file and its directory are gone once p2pd has read it


def test_with_identity_a_full_node_signs_with_that_key_and_creates_it_if_missing(tmp_path: Path) -> None:
    key = tmp_path / "keys" / "server.key"
    peer_id, validator = asyncio.run(signer_of_a_full_node(NetworkOptions(identity_path=str(key))))
    assert Identity.load(key).peer_id == peer_id and signs_as(validator, peer_id)
    assert key.stat().st_mode & 0o777 == 0o400
    again, _ = asyncio.run(signer_of_a_full_node(NetworkOptions(identity_path=str(key))))
    assert again == peer_id
