"""How a global batch is split over hosts: the one check every input pipeline shares.

Each process (host) reads its own disjoint shard of the data and produces
``global_batch_size // process_count`` examples per step; the engine then assembles the global
batch with ``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax


def host_split(global_batch_size: int, seed: int, process_index: Optional[int] = None,
               process_count: Optional[int] = None) -> Tuple[int, int, int]:
    """Resolves and checks this host's share of a global batch.

    Args:
      global_batch_size: examples per step over all processes.
      seed: the pipeline's shuffle seed; must fit the uint32 seeds numpy and grain take.
      process_index: this host's index; default ``jax.process_index()``.
      process_count: number of hosts; default ``jax.process_count()``.

    Returns:
      ``(process_index, process_count, local_batch_size)``.

    Raises:
      ValueError naming the argument: an index outside ``[0, process_count)``, a batch that is
      not a positive multiple of the process count, a seed outside ``[0, 2**32)``.
    """
    process_index = jax.process_index() if process_index is None else int(process_index)
    process_count = jax.process_count() if process_count is None else int(process_count)
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count}).")
    if global_batch_size < 1 or global_batch_size % process_count:
        raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple of "
                         f"process_count={process_count}: change the batch size.")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} must be in [0, 2**32).")
    return process_index, process_count, global_batch_size // process_count
