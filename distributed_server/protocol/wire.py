"""What travels on the wire besides msgpack's own types: `Blob`, a binary payload sent
next to a message's body as a frame of its own (comm/framing.py packs and unpacks it).
"""
from __future__ import annotations

__all__ = ["Blob"]


class Blob:
    """A binary payload that travels next to the msgpack body, not inside it.

    Wrap bytes, a bytearray, a memoryview (or any C-contiguous buffer) to have it sent
    without being copied into the body. The receiver gets a ``memoryview`` in its place.
    """

    __slots__ = ("buffer",)

    def __init__(self, buffer: bytes | bytearray | memoryview) -> None:
        view = memoryview(buffer)
        if not view.c_contiguous:
            raise ValueError("Blob needs a C-contiguous buffer")
        self.buffer = view.cast("B") if view.format != "B" or view.ndim != 1 else view

    def __len__(self) -> int:
        return self.buffer.nbytes

    def __repr__(self) -> str:
        return f"Blob(<{self.buffer.nbytes} bytes>)"
