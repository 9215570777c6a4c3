"""Stage 0/4: build and patch the cache — the only code that writes to an arena or a ledger,
one module for each kind of write:

- ``prefill``: ``prime``, allocate the arena and ledger and prefill a prompt (stage 0),
  gathering the prompt's attention statistics on request.
  ``seed``, write a scorer's ledger columns from those statistics (stage 0; prefill scores).
  ``extend``, prefill new prompt segments onto an existing state (stage 0; chat turns,
  imported sessions).
- ``patch``: ``apply``, apply one step's actions atomically, in a fixed order: the scorer's
  columns, merges, folds (a culled slot's K/V into survivors), removals (the last live
  slots move into the holes, but one hole the append takes, so live slots stay a dense
  prefix), position re-index (keys re-rotated exactly), then the append of the pending
  token's K/V (stage 4).
- ``restore``: ``rebuild_from_ledger``, re-prefill the arena from the ledger after a failure
  part-way.
  ``restore``, write a saved or composed session back (stage 0); ``rewrite``, write
  recomputed K/V into live slots (stage 0; a selective recompute); ``add_columns``, give a
  live state the columns of a scorer it was not made with.
- ``heads``: ``apply_heads`` is stage 4 of a per-head cache (``prefill.add_heads`` makes
  a state one, stage 0) (each (layer, KV head) culls its own slots; the ledger keeps the tokens
  some head holds).
- ``cold``: the recall tier's cold store (stage 4's culls going in, recalls coming back).
- ``rows``: the row writers they share (a slot's K/V and norms, a new token's ledger row,
  moving and removing slots) and the checks of a scorer's column values.
"""
from .recall import COLD_ROWS, add_cold_store, cold_store
from .patch import apply
from .prefill import (FUSED_CHUNK, PREFILL_CHUNK, TOTAL_UNREAD, add_heads, chunks, extend,
                      gpu_chunk_bytes, prime, seed)
from .restore import add_columns, rebuild_from_ledger, restore, rewrite
from .rows import arena

__all__ = ["COLD_ROWS", "FUSED_CHUNK", "PREFILL_CHUNK", "TOTAL_UNREAD", "add_cold_store",
           "add_columns", "add_heads", "apply", "arena", "chunks", "cold_store", "extend", "gpu_chunk_bytes",
           "prime", "rebuild_from_ledger", "restore", "rewrite", "seed"]
