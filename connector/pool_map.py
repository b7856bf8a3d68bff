"""Maps the daemon's shared-memory pool file into this process, pinned where CUDA is present.

The daemon creates and pre-faults the file; we only map it (MAP_SHARED, so bytes written here
are the bytes the daemon and other engines see) and wrap the mapping in an int8 tensor without
copying. int8 matches vLLM's canonical KV views, so a copy between them is a plain memcpy and
never a dtype conversion.

With CUDA the whole mapping is registered with cudaHostRegister: pinned host memory is what
lets cudaMemcpyAsync run on the copy engines without a host-side bounce through a staging
buffer. Registration is undone on close; a failed registration leaves the pool pageable
(copies still work, slower), never half-registered.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from typing import Any

import torch
from kvoffload.connector.metrics import ConnectorMetrics, get_metrics

logger = logging.getLogger("kvoffload.connector")

# Same value as Linux's MADV_POPULATE_WRITE (5.14+); older Pythons lack the constant.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# cudaHostRegister of one huge range can hit driver limits; register in chunks of this size.
_REGISTER_CHUNK_BYTES = 64 * 1024**3

_unpinned_logged = False


def _clear_cuda_last_error() -> None:
    """Reset the CUDA runtime's last-error slot after a failed registration.

    A failed cudaHostRegister leaves its error as the runtime's "last error"; torch checks that
    slot after its next kernel launch and would blame an unrelated op. torch exposes no
    cudaGetLastError, so call it in the libcudart this process already loaded (best effort).
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for lib in paths:
            ctypes.CDLL(lib).cudaGetLastError()
    except (OSError, AttributeError):
        logger.debug("could not clear the CUDA last error", exc_info=True)


def _log_unpinned_once(reason: str) -> None:
    """One line per process: every rank/mapping would otherwise repeat the same warning."""
    global _unpinned_logged
    if not _unpinned_logged:
        _unpinned_logged = True
        logger.info("kvoffload pool memory is not pinned (%s); copies use pageable memory", reason)


class PoolMapping:
    """A shared mapping of the pool file as one flat int8 tensor (``tensor``).

    ``pin``: None registers with CUDA when CUDA is available; False never does; True requires
    it (raises if CUDA is missing). ``populate`` maps every page into this process up front
    (MADV_POPULATE_WRITE), so the first copy into a page does not pay a page fault.
    """

    def __init__(
        self,
        path: str,
        size: int,
        *,
        pin: bool | None = None,
        populate: bool = True,
        registry: Any = None,
    ) -> None:
        if size <= 0:
            raise ValueError("pool size must be positive")
        self.path = path
        self.size = size
        self.pinned = False
        self._metrics: ConnectorMetrics = get_metrics(registry)
        self._registered: list[int] = []
        self._closed = False
        fd = os.open(path, os.O_RDWR)
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise ValueError(f"pool file {path} has {actual} bytes, expected {size}")
            self._mmap: mmap.mmap | None = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            # The mapping keeps the file alive; the descriptor is no longer needed.
            os.close(fd)
        if populate:
            self._populate()
        self.tensor: torch.Tensor = torch.frombuffer(self._mmap, dtype=torch.int8)
        self._metrics.pool_mapped_bytes.inc(size)
        want_pin = torch.cuda.is_available() if pin is None else pin
        if want_pin:
            if not torch.cuda.is_available():
                self.close()
                raise RuntimeError("pin=True needs CUDA")
            self._pin()
        else:
            _log_unpinned_once("CUDA not available" if pin is None else "pinning disabled")

    def _populate(self) -> None:
        assert self._mmap is not None
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE, 0, self.size)
        except (OSError, ValueError) as exc:
            # Old kernels: the copy path then takes the minor faults itself; not an error.
            logger.debug("MADV_POPULATE_WRITE unavailable for %s: %s", self.path, exc)

    def _pin(self) -> None:
        cudart: Any = torch.cuda.cudart()
        base = self.tensor.data_ptr()
        for offset in range(0, self.size, _REGISTER_CHUNK_BYTES):
            length = min(_REGISTER_CHUNK_BYTES, self.size - offset)
            err = cudart.cudaHostRegister(base + offset, length, 0)
            if int(err) != 0:
                logger.warning(
                    "cudaHostRegister failed (error %d) at offset %d of %s; pool stays pageable",
                    int(err),
                    offset,
                    self.path,
                )
                _clear_cuda_last_error()
                self._unpin(cudart)
                _log_unpinned_once(f"cudaHostRegister error {int(err)}")
                return
            self._registered.append(base + offset)
        self.pinned = True
        self._metrics.pool_pinned_bytes.inc(self.size)

    def _unpin(self, cudart: Any) -> None:
        for address in reversed(self._registered):
            err = cudart.cudaHostUnregister(address)
            if int(err) != 0:
                _clear_cuda_last_error()
                logger.warning("cudaHostUnregister failed (error %d)", int(err))
        self._registered.clear()

    def slot_view(self, slot_bytes: int) -> torch.Tensor:
        """The pool as ``(num_slots, slot_bytes)``; a trailing partial slot is left out."""
        num_slots = self.size // slot_bytes
        return self.tensor[: num_slots * slot_bytes].view(num_slots, slot_bytes)

    def close(self) -> None:
        """Unpin and unmap. Views handed out earlier must be dropped first."""
        if self._closed:
            return
        self._closed = True
        if self._registered:
            # Copies still in flight would read unregistered memory: finish them first.
            torch.cuda.synchronize()
            self._unpin(torch.cuda.cudart())
        if self.pinned:
            self._metrics.pool_pinned_bytes.dec(self.size)
            self.pinned = False
        self._metrics.pool_mapped_bytes.dec(self.size)
        del self.tensor
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A view is still alive somewhere; unmapping under it would turn its next use
                # into a crash, so the mapping stays until the process ends.
                logger.warning("pool %s still has live views; keeping it mapped", self.path)
            self._mmap = None

    def __enter__(self) -> PoolMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
