"""A notebook kernel client whose wait for a message cannot sleep through one that arrived.

nbclient waits for a cell's `execute_reply` with one `shell_channel.get_msg(timeout=<the cell's timeout>)`:
one asyncio poll of the zmq socket's file descriptor. That descriptor signals edges, and a poll can miss
one: a loaded `make test` run (2026-11-26, notebook 07 in smoke, pyzmq 27.3, jupyter_client 8.10, nbclient
0.11) sat 10 minutes on a cell whose reply was readable all along (the client's shell socket reported
POLLIN; the kernel was idle with nothing queued), until the cell timeout failed a notebook that had run.
`Channel.get_msg` here waits in slices of POLL_SLICE_S; each slice's poll first asks the socket whether a
message is there (pyzmq's poller does), so a missed edge costs at most one slice. The overall timeout is
the caller's, as before. `KernelManager` hands out this client; every notebook labkit executes uses it
(labkit.course.notebooks.run_notebook, the grader's sandboxed executor, the warm kernels of `make test`).
"""
from __future__ import annotations

from queue import Empty
from time import monotonic
from typing import Any

from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from jupyter_client.manager import AsyncKernelManager
from traitlets import DottedObjectName, Type

#: Seconds one poll of a channel waits before it asks the socket again.
POLL_SLICE_S = 1.0


class Channel(AsyncZMQSocketChannel):
    async def get_msg(self, timeout: float | None = None) -> dict[str, Any]:  # type: ignore[override]
        """The next message, waiting at most `timeout` seconds (None: for ever); Empty when none came."""
        end = None if timeout is None else monotonic() + timeout
        while True:
            left = POLL_SLICE_S if end is None else max(0.0, min(POLL_SLICE_S, end - monotonic()))
            try:
                return await super().get_msg(timeout=left)
            except Empty:
                if end is not None and monotonic() >= end:
                    raise


class KernelClient(AsyncKernelClient):
    shell_channel_class = Type(Channel)  # type: ignore[assignment]
    iopub_channel_class = Type(Channel)  # type: ignore[assignment]
    stdin_channel_class = Type(Channel)  # type: ignore[assignment]
    control_channel_class = Type(Channel)  # type: ignore[assignment]


class KernelManager(AsyncKernelManager):
    """jupyter_client's AsyncKernelManager whose clients are `KernelClient` (papermill's kernel_manager_class)."""

    client_class = DottedObjectName("labkit.course.kernel_client.KernelClient")
    client_factory = Type(klass=KernelClient)
