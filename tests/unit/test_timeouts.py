"""The timeout wrapper names the wait only for backend timeouts, and the innermost name wins."""

import pytest

from megatron.core.distributed.timeouts import CommunicationTimeout, awaiting, is_timeout


def test_a_backend_timeout_becomes_a_named_communication_timeout():
    with pytest.raises(CommunicationTimeout) as caught:
        with awaiting(lambda: "the receive from pipeline rank 1"):
            raise RuntimeError("[gloo] Timed out waiting 60000ms for recv operation to complete")
    message = str(caught.value)
    assert message.startswith("this process: timed out waiting for the receive from pipeline rank 1")
    assert "Timed out waiting 60000ms" in message
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_other_errors_pass_through_unchanged():
    original = RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError) as caught:
        with awaiting("anything"):
            raise original
    assert caught.value is original
    with pytest.raises(ValueError):
        with awaiting("anything"):
            raise ValueError("timeout is not a RuntimeError here")


def test_the_innermost_description_wins():
    """An outer wrapper leaves a timeout alone once an inner one named it, even when it arrives
    wrapped in another error (the pipeline interpreter adds its schedule grid)."""
    with pytest.raises(RuntimeError) as caught:
        with awaiting("iteration 3 on one of this rank's groups"):
            try:
                with awaiting("the gradient all-reduce"):
                    raise RuntimeError("wait timeout after 1000ms")
            except CommunicationTimeout as named:
                raise RuntimeError(f"pipeline rank failed: {named}") from named
    assert str(caught.value).startswith("pipeline rank failed: this process: timed out waiting "
                                        "for the gradient all-reduce")
    assert "iteration 3" not in str(caught.value)


@pytest.mark.parametrize("message,expected", [
    ("Timed out waiting 1000ms for send operation to complete", True),
    ("DistStoreError: wait timeout after 12000ms, keys: /default_pg/0", True),
    ("Watchdog caught collective operation timeout: WorkNCCL ran for 600000 milliseconds "
     "before timing out", True),
    ("Connection reset by peer", False),
])
def test_backend_timeout_messages_are_recognised(message, expected):
    assert is_timeout(RuntimeError(message)) is expected
