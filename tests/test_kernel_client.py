"""labkit.course.kernel_client: a wait for a kernel's message polls in slices, so a message whose poll
event was missed is still read (within a slice), and the caller's overall timeout still holds."""
from __future__ import annotations

import asyncio
from queue import Empty

import pytest
from jupyter_client.channels import AsyncZMQSocketChannel

from labkit.course import kernel_client
from labkit.course.kernel_client import Channel, KernelClient, KernelManager


def missed_polls(monkeypatch, misses: int, message=None):
    """The library's one-poll get_msg: Empty for the first `misses` polls (an event missed), then `message`."""
    calls = []

    async def get_msg(self, timeout=None):
        calls.append(timeout)
        if len(calls) <= misses or message is None:
            raise Empty
        return message

    monkeypatch.setattr(AsyncZMQSocketChannel, "get_msg", get_msg)
    monkeypatch.setattr(kernel_client, "POLL_SLICE_S", 0.0)
    return calls


def test_a_message_a_poll_missed_is_read_by_the_next_slice(monkeypatch):
    calls = missed_polls(monkeypatch, misses=3, message={"msg_id": "reply"})
    channel = Channel.__new__(Channel)
    assert asyncio.run(channel.get_msg(timeout=3600)) == {"msg_id": "reply"}  # not after the whole timeout
    assert len(calls) == 4 and all(t <= kernel_client.POLL_SLICE_S for t in calls)
    calls.clear()
    assert asyncio.run(channel.get_msg(timeout=None)) == {"msg_id": "reply"}  # no timeout: slices for ever
    assert len(calls) == 4


def test_the_callers_timeout_still_ends_the_wait(monkeypatch):
    calls = missed_polls(monkeypatch, misses=10**9)
    with pytest.raises(Empty):
        asyncio.run(Channel.__new__(Channel).get_msg(timeout=0))
    assert calls == [0.0]


def test_every_notebook_labkit_runs_gets_this_client(monkeypatch):
    from warmstart import warm_kernels

    for switch in ("0", "1"):
        monkeypatch.setenv(warm_kernels.SWITCH_ENV, switch)
        manager = warm_kernels.client_options()["kernel_manager_class"]
        assert issubclass(manager, KernelManager)
        client = manager(kernel_name="python3").client()
        assert isinstance(client, KernelClient) and client.shell_channel_class is Channel
