"""NIXL (UCX) backend: the sender WRITEs blocks into the receiver's registered pool.

Each side registers its whole pool once (DRAM); a prepared descriptor list has one entry
per block (a block is one contiguous byte range), so a transfer is one NIXL request naming
block indices on both sides, and NIXL merges runs of adjacent blocks. The sender pushes
(WRITE) rather than the receiver pulling (READ): the prefill worker knows when its KV is
ready, so pushing saves a "ready" round trip, and the receiver needs no metadata from the
sender, only the sender from the receiver (``connection_metadata``).

Notifications, sender -> receiver: ``B|header`` before the write, ``D|header`` attached
to the write (NIXL delivers it once the data has landed), ``F|header`` when the sender
gives up; with a cluster key each carries a MAC (notice_mac.py). int8 records go through
a registered staging area on both sides with one slot per pool block, so nothing is
registered per transfer.

Failure: a dead receiver fails the sender's request (UCX reports the disconnect); a dead
sender is noticed by the receiver through its deadline. A sender that is slow rather than
dead may write until its own deadline, which is up to (send time - expect time) after the
receiver's: callers send promptly after ``expect``.
"""

from pdserve.kv_transfer.nixl_receiver import NixlReceiver
from pdserve.kv_transfer.nixl_sender import NixlSender

__all__ = ["NixlReceiver", "NixlSender"]
