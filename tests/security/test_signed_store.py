"""torchrun's store has no authentication, so everything Gyre keeps there is signed with the run's
secret (gyre.runtime.control.SignedStore): a value another process wrote is refused before it is
unpickled or trusted. Real TCPStore server, a second raw client playing the intruder."""

import pickle
from datetime import timedelta

import pytest
import torch.distributed as dist

from gyre.runtime.control import ControlPlane, SignedStore, TamperedStore
from gyre.runtime.messages import Load


class _Boom:
    """Unpickling it would create `path`: the proof that a forged mailbox entry ran code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _land(intruder, key, value):
    """TCPStore's set does not wait for the server: the intruder's write and the signed reader's
    get travel on different connections, so read it back on the intruder's own connection (served
    in order) before the signed store looks."""
    intruder.set(key, value)
    assert intruder.get(key) == (value.encode() if isinstance(value, str) else bytes(value))


@pytest.fixture
def stores():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    intruder = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    return SignedStore(server, "run-secret"), intruder, server


def test_signed_values_round_trip_and_the_raw_bytes_carry_a_tag(stores):
    signed, intruder, _ = stores
    signed.set("engine/0", "http://127.0.0.1:1234")
    assert signed.get("engine/0") == b"http://127.0.0.1:1234"
    raw = intruder.get("engine/0")
    assert raw.endswith(b"http://127.0.0.1:1234") and len(raw) == 32 + len(b"http://127.0.0.1:1234")
    cp = ControlPlane(signed, 3)
    ControlPlane(signed, "ctl").send(3, Load(version=7))
    assert cp.recv(timeout=5) == Load(version=7)
    assert signed.clone().get("engine/0") == b"http://127.0.0.1:1234"  # a clone signs and checks alike


def test_a_forged_mailbox_entry_is_refused_before_it_is_unpickled(stores, tmp_path):
    signed, intruder, _ = stores
    proof = tmp_path / "pwned"
    intruder.queue_push("mb/3", pickle.dumps(_Boom(str(proof))))
    with pytest.raises(TamperedStore, match="mb/3"):
        ControlPlane(signed, 3).try_recv()
    assert not proof.exists()


def test_a_redirected_engine_url_a_swapped_value_and_another_runs_secret_are_refused(stores):
    signed, intruder, server = stores
    signed.set("engine/0", "http://127.0.0.1:1234")
    assert signed.get("engine/0") == b"http://127.0.0.1:1234"  # landed before the intruder writes
    _land(intruder, "engine/0", "http://127.0.0.1:6666")  # the proxy would send model calls there
    with pytest.raises(TamperedStore, match="engine/0"):
        signed.get("engine/0")
    signed.set("snap/latest", "5")
    good = intruder.get("snap/latest")
    _land(intruder, "snap/published", good)  # a valid tag, moved to another key
    with pytest.raises(TamperedStore):
        signed.get("snap/published")
    flipped = bytearray(good)
    flipped[-1] ^= 1
    _land(intruder, "snap/latest", bytes(flipped))
    with pytest.raises(TamperedStore):
        signed.get("snap/latest")
    SignedStore(server, "another-run").set("snap/latest", "9")
    with pytest.raises(TamperedStore):
        signed.get("snap/latest")
