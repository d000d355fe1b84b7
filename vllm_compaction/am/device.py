"""What the compaction math may hold at once, read from the device it runs on.

The passes over the reference queries are chunked, and heads are compacted in groups, so that
the large intermediates fit. How large is a property of the device, not a constant:

* CPU: a chunk of logits should stay in the cache while it is exponentiated, summed and
  multiplied (``CPU_CHUNK_L2_MULTIPLE`` times the L2 size of a core: 2 MiB on a core with 512 KiB
  of L2, where 2 MiB measured fastest); the working set of a call is a share of the available
  memory (``MemAvailable``).
* CUDA: chunks are as large as a share of the free device memory allows (larger chunks are
  fewer, larger GEMMs: at 60,000 keys and 50,000 queries per head, 2 MiB chunks of 8 rows took
  15 s per layer on an H200 and 256 MiB chunks under 1 s), and so is the working set.

Every function takes a ``torch.device`` and reads the device once per call (CUDA's free memory
changes while a server runs); nothing here is cached across calls except the CPU cache sizes.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["DeviceLimits", "device_limits", "runtime_rows"]

logger = logging.getLogger(__name__)

#: CPU query chunk: this many L2 caches' worth of logits per head (4 x 512 KiB = the 2 MiB that
#: measured fastest on the 2-core development machine), clamped to ``CPU_CHUNK_RANGE``.
CPU_CHUNK_L2_MULTIPLE = 4
CPU_CHUNK_RANGE = (1 << 20, 8 << 20)
#: Share of the available host memory one ``compact_heads`` call may use for its intermediates,
#: clamped to ``CPU_MEMORY_RANGE`` (1 GiB measured well on 24 GB; OMP's features dominate).
CPU_MEMORY_SHARE = 1 / 16
CPU_MEMORY_RANGE = (256 << 20, 4 << 30)
#: Share of the free CUDA memory a call may use for its intermediates (the rest stays for the
#: inputs, the fits' temporaries, the allocator's slack and whatever else runs on the device).
CUDA_MEMORY_SHARE = 0.45
#: Share of that working set one query chunk of logits may take, over all heads of a group.
CUDA_CHUNK_SHARE = 0.25
#: Largest CUDA query chunk per head: beyond this the GEMMs are already at full speed.
CUDA_CHUNK_MAX = 2 << 30
#: Query rows per block of the model runtime's masked attention (``[H, G, rows, keys]`` logits):
#: 512 on CPU (cache-sized), larger on CUDA when memory allows.
CPU_RUNTIME_ROWS = 512
CUDA_RUNTIME_ROWS = (512, 8192)


@dataclass(frozen=True)
class DeviceLimits:
    """Sizes of the large intermediates on one device.

    Attributes:
        device: the device they were read from.
        chunk_bytes: bytes of fp32 logits held at once by a query-chunked pass: per head on the
            CPU (each thread works through one head's chunk in its cache), over all heads of a
            call on CUDA (one GEMM covers them all).
        memory_limit: bytes one ``compact_heads`` call may use for its large intermediates
            (head groups, OMP's feature matrix, cached feature chunks).
    """

    device: torch.device
    chunk_bytes: int
    memory_limit: int

    def chunk_bytes_per_head(self, num_heads: int) -> int:
        """Bytes of logits per head in one chunk of a pass over ``num_heads`` heads."""
        if self.device.type != "cuda":
            return self.chunk_bytes
        return min(CUDA_CHUNK_MAX, self.chunk_bytes // max(1, num_heads))


@functools.cache
def _cpu_l2_bytes() -> int:
    """L2 size of CPU 0 from sysfs, or 512 KiB when it cannot be read."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "2":
                text = (index / "size").read_text().strip().upper()
                scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
                return int(text.rstrip("KM")) * scale
        except (OSError, ValueError):
            continue
    return 512 << 10


def _available_host_bytes() -> int:
    """``MemAvailable`` from ``/proc/meminfo``, or 16 GiB when it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return 16 << 30


def _clamp(value: float, bounds: tuple[int, int]) -> int:
    return int(min(max(value, bounds[0]), bounds[1]))


def device_limits(device: torch.device | str) -> DeviceLimits:
    """The chunk and working-set sizes for ``device`` (read now: free CUDA memory changes)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        memory = max(256 << 20, int(free * CUDA_MEMORY_SHARE))
        return DeviceLimits(device, int(memory * CUDA_CHUNK_SHARE), memory)
    chunk = _clamp(CPU_CHUNK_L2_MULTIPLE * _cpu_l2_bytes(), CPU_CHUNK_RANGE)
    memory = _clamp(_available_host_bytes() * CPU_MEMORY_SHARE, CPU_MEMORY_RANGE)
    return DeviceLimits(device, chunk, memory)


def runtime_rows(device: torch.device | str, bytes_per_row: int) -> int:
    """Query rows per block of the model runtime's attention whose logits and mask take
    ``bytes_per_row`` each: 512 on a CPU (cache-sized; read without touching the system), on
    CUDA as many as a chunk of the free memory allows, within 512..8192."""
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_RUNTIME_ROWS
    low, high = CUDA_RUNTIME_ROWS
    return max(
        low, min(high, device_limits(device).chunk_bytes // max(1, bytes_per_row))
    )
