"""Maps the daemon's shared-memory pool file into this process, pinned where CUDA is present.

The daemon creates and pre-faults the file; we only map it (MAP_SHARED, so bytes written here
are the bytes the daemon and other engines see) and wrap the mapping in an int8 tensor without
copying. int8 matches vLLM's canonical KV views, so a copy between them is a plain memcpy and
never a dtype conversion.

With CUDA the whole mapping is registered with cudaHostRegister: pinned host memory is what
lets cudaMemcpyAsync run on the copy engines without a host-side bounce through a staging
buffer. Registration is undone on close; a failed registration leaves the pool pageable
(copies still work, slower), never half-registered.

Mapping, pre-faulting and pinning a large pool takes seconds (first touch of /dev/shm runs at
1-2 GB/s here; cudaHostRegister walks every page), so an engine worker starts it at creation on
a background thread (``MappingTask``) and its first copy job only waits for what is left. A
mapping keeps serving across daemon restarts while the file is the same one (device and inode):
a restarted daemon that reopened its pool file needs no new mapping.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from typing import Any

import torch
from kvoffload.connector.metrics import ConnectorMetrics, get_metrics

logger = logging.getLogger("kvoffload.connector")

# Same value as Linux's MADV_POPULATE_WRITE (5.14+); older Pythons lack the constant.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# cudaHostRegister of one huge range can hit driver limits; register in chunks of this size.
_REGISTER_CHUNK_BYTES = 64 * 1024**3
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable

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


def file_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of a file, None if it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


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
            st = os.fstat(fd)
            self.identity: tuple[int, int] = (st.st_dev, st.st_ino)
            actual = st.st_size
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
            # Portable: pinned for every CUDA context of the process, not only this thread's.
            err = cudart.cudaHostRegister(base + offset, length, _HOST_REGISTER_PORTABLE)
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

    def same_file(self, path: str, size: int) -> bool:
        """Whether this mapping still serves ``path`` for ``size`` bytes: the same file (device
        and inode; a recreated file is a new one) and at least that large."""
        return not self._closed and size <= self.size and file_identity(path) == self.identity

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


class MappingTask:
    """Maps, pre-faults and pins a pool file on a background thread, started at construction.

    ``size=None`` maps the whole file. ``wait_ready()`` returns the ``PoolMapping`` (waiting for
    the rest of the work, if any) or raises what mapping raised. The time taken is logged and
    exported as ``kvoffload_worker_pin_seconds``.
    """

    def __init__(self, path: str, size: int | None = None, *, pin: bool | None = None,
                 populate: bool = True, registry: Any = None, label: str = "",
                 device: torch.device | str | None = None) -> None:
        self.path = path
        # cudaHostRegister runs in this task's thread, whose current device would be 0: make
        # it the engine's device (else every rank would create a context on GPU 0).
        dev = torch.device(device) if device is not None else None
        if dev is None and pin is not False and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        self._device = dev if dev is not None and dev.type == "cuda" else None
        self.size = size
        self.seconds: float | None = None
        self._kwargs: dict[str, Any] = {"pin": pin, "populate": populate, "registry": registry}
        self._metrics = get_metrics(registry)
        self._label = label
        self._mapping: PoolMapping | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvoffload-pool-map", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._device is not None:
                torch.cuda.set_device(self._device)
            size = self.size if self.size is not None else os.stat(self.path).st_size
            self._mapping = PoolMapping(self.path, size, **self._kwargs)
        except BaseException as exc:  # handed to whoever waits, never lost in this thread
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - t0
            if self._error is None and self._mapping is not None:
                self._metrics.worker_pin_seconds.set(self.seconds)
                logger.info("kvoffload%s: mapped %s (%d MiB, %s) in %.2f s", self._label,
                            self.path, self._mapping.size >> 20,
                            "pinned" if self._mapping.pinned else "pageable", self.seconds)
            else:
                logger.warning("kvoffload%s: mapping %s failed: %s", self._label, self.path,
                               self._error)
            self._done.set()

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    def wait_ready(self, timeout: float | None = None) -> PoolMapping:
        if not self._done.wait(timeout):
            raise TimeoutError(f"mapping {self.path} not done after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._mapping is not None
        return self._mapping

    def serves(self, path: str, size: int) -> bool:
        """Whether this task's mapping (waited for) serves ``path`` for ``size`` bytes."""
        try:
            return self.wait_ready().same_file(path, size)
        except Exception:
            return False

    def close(self) -> None:
        """Unmap (after the background work ends: it cannot be interrupted)."""
        self._thread.join()
        if self._mapping is not None:
            self._mapping.close()
