"""The loop's state: the KV arena, the token ledger, and the read-only view.

This module defines the data and read-only helpers only. Every write to an arena
or a ledger lives in ``positronic_brain.stages.apply`` (stage 0/4).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from .model import ModelSpec
from .types import SOURCES, Column

FLAG_PROTECTED = 1  # never culled (e.g. a pinned system prompt)


def key_norms(k: torch.Tensor) -> torch.Tensor:
    """Keys (..., head_dim) -> float32 norms (...), over contiguous rows."""
    return k.contiguous().float().square().sum(-1).sqrt()


def value_norms(v: torch.Tensor) -> torch.Tensor:
    """Values (..., head_dim) -> float32 norms (...), over contiguous rows; one row's bits
    do not depend on the others, so norms computed one slot at a time equal norms over
    the whole block."""
    return v.contiguous().float().norm(dim=-1)


def stored_keys(k: torch.Tensor) -> torch.Tensor:
    """The keys of a live key view ``k`` (L, kv_heads, n, head_dim) as (L * kv_heads,
    head_dim, W) for a batched product. For an arena's view whose live slots fill at least
    3/4 of the stored rows: the whole dense stored block, W = capacity plus the padding,
    whose columns n.. are dead slots or padding (a product's columns are independent: drop
    them from its result). Otherwise: its own n columns, as a (possibly strided) view."""
    L, KVH, n, D = k.shape
    W = k.stride(3)
    end = k.storage_offset() + L * KVH * D * W  # one past the block's last element
    if (k.stride() != (KVH * D * W, D * W, 1, W) or 4 * n < 3 * W
            or end * k.element_size() > k.untyped_storage().nbytes()):
        return k.transpose(2, 3).reshape(L * KVH, D, n)
    return k.as_strided((L * KVH, D, W), (D * W, W, 1))


@dataclass(eq=False)
class Arena:
    """Preallocated K/V for every layer; live slots are the dense prefix ``[0, n)``.

    Keys are stored after RoPE at their token's position. Slot order is free
    (attention is order-independent once RoPE is applied); text order is the
    ledger's ``position`` column.

    Keys are stored transposed, ``kt`` (L, kv_heads, head_dim, capacity), so a decode
    step's scores q K^T read each key dimension as one contiguous run of slots; ``k`` is
    the same storage seen as (L, kv_heads, capacity, head_dim), the shape everything
    else uses.

    ``log_mass`` is the log of how many tokens' K/V a slot holds, per layer and KV head
    (0 = one token; a ``fold`` repair raises it), added to the slot's attention scores.

    ``knorm`` and ``vnorm`` are each slot's key and value norms (float32, per layer and KV
    head), rewritten wherever stage 4 writes keys or values, so fold targets read n key
    norms instead of n keys and the ``value`` signal reads n value norms instead of n values.
    """

    kt: torch.Tensor  # (L, kv_heads, head_dim, capacity)
    v: torch.Tensor  # (L, kv_heads, capacity, head_dim)
    log_mass: torch.Tensor  # (L, kv_heads, capacity) float32
    knorm: torch.Tensor  # (L, kv_heads, capacity) float32
    vnorm: torch.Tensor  # (L, kv_heads, capacity) float32
    n: int = 0
    folded: bool = False  # has any slot ever held more than one token (else no log-mass)

    @classmethod
    def allocate(cls, spec: ModelSpec, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", key_rows: bool = False,
                 layers: int | None = None) -> "Arena":
        """``key_rows``: ``kt`` is a view of keys stored a slot per row (L, kv_heads,
        capacity, head_dim), as the cold store keeps them: nothing decodes over them, and
        moving a slot then copies one contiguous row per layer and head instead of
        head_dim scattered elements. ``layers``: a block of that many layers (default all)."""
        shape = (layers or spec.n_layers, spec.n_kv_heads)
        if key_rows:
            kt = torch.zeros(*shape, capacity, spec.head_dim, dtype=dtype,
                             device=device).transpose(2, 3)
        else:
            # Each key row is padded by one cache line: a slot's key is one element per
            # row, and rows a power of two apart would all fall into the same few cache sets.
            pad = 64 // dtype.itemsize
            kt = torch.zeros(*shape, spec.head_dim, capacity + pad, dtype=dtype,
                             device=device)[..., :capacity]
        v = torch.zeros(*shape, capacity, spec.head_dim, dtype=dtype, device=device)
        zeros = lambda: torch.zeros(*shape, capacity, device=device)  # noqa: E731
        return cls(kt, v, zeros(), zeros(), zeros())

    def renorm(self, lo: int, hi: int, k: torch.Tensor | None = None,
               v: torch.Tensor | None = None, values: bool = True) -> None:
        """Recompute ``knorm`` and (if ``values``) ``vnorm`` for slots [lo, hi), row by
        (..., head_dim) row: from ``k`` / ``v`` (L, kv_heads, hi - lo, D), what was just
        written there, at once if given; else from the arena one layer at a time. Both ways
        give the same bits."""
        if k is not None:
            self.knorm[:, :, lo:hi] = key_norms(k)
        else:
            for i in range(self.kt.shape[0]):
                self.knorm[i, :, lo:hi] = key_norms(self.k[i, :, lo:hi])
        if not values:
            return
        if v is not None:
            self.vnorm[:, :, lo:hi] = value_norms(v)
        else:
            for i in range(self.v.shape[0]):
                self.vnorm[i, :, lo:hi] = value_norms(self.v[i, :, lo:hi])

    def live_log_mass(self, n: int) -> torch.Tensor | None:
        """The live slots' log-mass (L, kv_heads, n), added to their attention scores; None
        while nothing is folded."""
        return self.log_mass[:, :, :n] if self.folded else None

    def past(self, n: int) -> tuple:
        """What ``forward`` reads of the first ``n`` slots: K, V and log-mass, as views."""
        return self.k[:, :, :n], self.v[:, :, :n], self.live_log_mass(n)

    def norms(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` slots' key and value norms (L, kv_heads, n), as views."""
        return self.knorm[:, :, :n], self.vnorm[:, :, :n]

    @property
    def blocks(self) -> tuple["Arena", ...]:
        """The arena's blocks of layers, each on one device: itself."""
        return (self,)

    @property
    def device(self) -> torch.device:
        return self.v.device

    @property
    def k(self) -> torch.Tensor:
        """Keys (L, kv_heads, capacity, head_dim): a strided view of ``kt``."""
        return self.kt.transpose(2, 3)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def key_rows(self) -> bool:
        """Keys stored a slot per row (``allocate``'s ``key_rows``), not transposed."""
        return self.kt.stride(-1) != 1


def _every_block(name: str) -> property:
    """A field every block of a ``SplitArena`` holds alike (stage 4 writes the whole
    arena's): read from the first block, written to all."""
    def get(self):
        return getattr(self.blocks[0], name)

    def put(self, value) -> None:
        for b in self.blocks:
            setattr(b, name, value)

    return property(get, put)


@dataclass(eq=False)
class SplitArena:
    """The arena of a model whose layers a device map splits over devices
    (``Model.blocks``): one ``Arena`` per run of consecutive layers on one device, holding
    those layers' K/V, log-mass and norms where they run; the live count is the same in all.
    Stage 4 writes each block where it lives; ``past`` gives ``forward`` one tensor per
    block, and only the norms stages 2-3 read for every layer at once (L x kv_heads floats
    a slot) are gathered onto the main device."""

    blocks: tuple[Arena, ...]
    layers: tuple[slice, ...]  # each block's layers
    device: torch.device  # the main device: the ledger's

    @classmethod
    def allocate(cls, spec: ModelSpec, capacity: int, dtype: torch.dtype,
                 blocks: tuple[tuple[slice, torch.device], ...],
                 device: torch.device) -> "SplitArena":
        return cls(tuple(Arena.allocate(spec, capacity, dtype, dev, layers=sl.stop - sl.start)
                         for sl, dev in blocks), tuple(sl for sl, _ in blocks), device)

    n = _every_block("n")
    folded = _every_block("folded")

    @property
    def capacity(self) -> int:
        return self.blocks[0].capacity

    key_rows = False

    def past(self, n: int) -> tuple:
        folded = self.folded  # all blocks' log-mass or none, as in one arena
        return (tuple(b.k[:, :, :n] for b in self.blocks),
                tuple(b.v[:, :, :n] for b in self.blocks),
                tuple(b.log_mass[:, :, :n] for b in self.blocks) if folded else None)

    def norms(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return gathered(self, "knorm", n), gathered(self, "vnorm", n)


def gathered(a: Arena | SplitArena, name: str, n: int) -> torch.Tensor:
    """The first ``n`` slots of the arena tensor ``name`` (``k``, ``v``, ``log_mass``,
    ``knorm``, ``vnorm``) for every layer, (L, kv_heads, n, ...): a view of a one-device
    arena; of a split one, a copy on its main device."""
    if isinstance(a, Arena):
        return getattr(a, name)[:, :, :n]
    return torch.cat([getattr(b, name)[:, :, :n].to(a.device) for b in a.blocks])


# The ledger's own columns, the one statement of them: name -> (dtype, an empty row's value).
SCHEMA = {"uid": (torch.int64, 0), "token_id": (torch.int64, 0), "position": (torch.int64, 0),
          "source": (torch.int8, 0), "born_step": (torch.int64, 0),
          "changed_step": (torch.int64, 0), "flags": (torch.int8, 0),
          "origin": (torch.int32, 0), "origin_uid": (torch.int64, -1)}
# what stages 1-3 see of them (``View``; a capture keeps these): all but ``changed_step``
VIEW_COLUMNS = tuple(c for c in SCHEMA if c != "changed_step")


@dataclass(eq=False)
class Ledger:
    """The token ledger: one row per live arena slot, columnar, preallocated. Besides its
    own columns (``COLUMNS``) it holds the scorer's (``columns``, name -> (capacity,)
    float32, each as ``specs[name]`` declares: ``types.Column``)."""

    uid: torch.Tensor  # (capacity,) int64, unique, monotonic, never reused
    token_id: torch.Tensor  # (capacity,) int64
    position: torch.Tensor  # (capacity,) int64, logical position (RoPE phase)
    source: torch.Tensor  # (capacity,) int8, index into SOURCES
    born_step: torch.Tensor  # (capacity,) int64
    changed_step: torch.Tensor  # (capacity,) int64
    flags: torch.Tensor  # (capacity,) int8 (FLAG_PROTECTED, ...)
    # Where the row's K/V came from: 0 = made in this session's own lineage, k = the file
    # ``origins[k - 1]`` (a composed or transferred session), whose row ``origin_uid`` it was
    # there (-1 for rows of origin 0).
    origin: torch.Tensor  # (capacity,) int32
    origin_uid: torch.Tensor  # (capacity,) int64
    columns: dict[str, torch.Tensor] = field(default_factory=dict)  # the scorer's (capacity,)
    specs: dict[str, Column] = field(default_factory=dict)  # each scorer column's declaration
    n: int = 0
    next_uid: int = 0
    merged: dict[int, tuple[int, ...]] = field(default_factory=dict)  # repair history
    dropped: int = 0  # tokens culled for good (not into a cold store), an account of uids
    origins: tuple[str, ...] = ()  # the files rows came from, labelled (``origin`` k -> k-1)

    COLUMNS = tuple(SCHEMA)

    @classmethod
    def allocate(cls, capacity: int, specs: dict[str, Column] | None = None,
                 device: torch.device | str = "cpu") -> "Ledger":
        """Empty rows for ``capacity`` tokens: ``SCHEMA``'s columns and the scorer columns
        ``specs`` declares (float32)."""
        specs = dict(specs or {})
        m = cls(**{c: torch.full((capacity,), fill, dtype=dt, device=device)
                   for c, (dt, fill) in SCHEMA.items()},
                columns={name: torch.zeros(capacity, device=device) for name in specs},
                specs=specs)
        m.pack()
        return m

    def pack(self) -> None:
        """Store the ledger's own columns of each dtype as the rows of one table (C,
        capacity), their values kept: a row move or copy is then one operator a table
        (``tables``), not one a column. ``allocate`` packs, and so does ``grow_ledger``."""
        tables = []
        for dtype in dict.fromkeys(dt for dt, _ in SCHEMA.values()):
            names = tuple(c for c, (dt, _) in SCHEMA.items() if dt == dtype)
            table = torch.stack([getattr(self, c) for c in names])  # (C, capacity)
            views = tuple(table[i] for i in range(len(names)))
            for c, v in zip(names, views):
                setattr(self, c, v)
            tables.append((table, names, views))
        self._tables = tuple(tables)

    def tables(self) -> list[tuple[torch.Tensor, int]]:
        """Every column's storage once, as (tensor, its row dimension): the packed tables
        (``pack``; dimension 1) whose columns are still their rows, every other column
        (dimension 0) as itself. Row moves and copies go through these."""
        out, packed = [], set()
        for table, names, views in getattr(self, "_tables", ()):
            if all(getattr(self, c) is v for c, v in zip(names, views)):
                out.append((table, 1))
                packed.update(names)
        return out + [(self.col(c), 0) for c in self.names if c not in packed]

    @property
    def names(self) -> tuple[str, ...]:
        """Every column's name: the ledger's own, then the scorer's."""
        return self.COLUMNS + tuple(self.columns)

    def col(self, name: str) -> torch.Tensor:
        """The whole column ``name`` (capacity,), the ledger's own or the scorer's."""
        return self.columns[name] if name in self.columns else getattr(self, name)

    def live(self, column: str) -> torch.Tensor:
        return self.col(column)[: self.n]

    @property
    def device(self) -> torch.device:
        return self.uid.device

    def rows(self) -> list[dict]:
        """Live rows in position (text) order, as plain Python values (``origin``: the
        file's label, None for a row made here), each scorer column by its name."""
        order = torch.argsort(self.live("position")).tolist()
        cols = {c: self.live(c).tolist() for c in ("uid", "token_id", "position", "source",
                                                  "origin", "origin_uid", *self.columns)}
        return [{"uid": cols["uid"][i], "token_id": cols["token_id"][i],
                 "position": cols["position"][i], "source": SOURCES[cols["source"][i]],
                 **{c: cols[c][i] for c in self.columns},
                 "origin": self.origin_label(cols["origin"][i]),
                 "origin_uid": cols["origin_uid"][i]} for i in order]

    def origin_label(self, origin: int) -> str | None:
        """The file an ``origin`` value names; None for 0 (made here)."""
        return self.origins[origin - 1] if origin else None

    def check_valid(self, step: int | None = None, next_position: int | None = None) -> None:
        """Assert every ledger invariant; raises AssertionError naming the first broken one."""
        n, cap = self.n, self.uid.shape[0]
        assert 0 <= n <= cap, f"live count {n} outside [0, {cap}]"
        assert sorted(self.columns) == sorted(self.specs), "scorer columns without their specs"
        for c in self.names:  # a per-head cache's scorer columns: a value a (layer, KV head)
            shape = self.col(c).shape
            assert shape[:1] == (cap,) and (c in self.columns or len(shape) == 1), \
                f"column {c} has shape {tuple(shape)}"
        uid, pos = self.live("uid"), self.live("position")
        assert torch.unique(uid).numel() == n, "uids are not unique"
        assert n == 0 or int(uid.max()) < self.next_uid, "a uid is >= next_uid"
        assert torch.unique(pos).numel() == n, "positions are not unique"
        assert n == 0 or int(pos.min()) >= 0, "negative position"
        if next_position is not None:
            assert n == 0 or int(pos.max()) < next_position, "a position is >= the next position"
        self.check_rows(self.origins)
        changed = self.live("changed_step")
        if step is not None:
            assert n == 0 or int(changed.max()) <= step, "changed_step in the future"
        for new, old in self.merged.items():
            assert all(u < new for u in old), f"repair {new} merged a later uid {old}"

    def check_rows(self, origins: tuple[str, ...]) -> None:
        """Assert what each live row must hold on its own: a known source, the scorer columns
        finite and in their ranges, born before changed, an origin in ``origins``."""
        n = self.n
        src = self.live("source")
        assert n == 0 or (int(src.min()) >= 0 and int(src.max()) < len(SOURCES)), "unknown source"
        for c, spec in self.specs.items():
            x = self.live(c)
            assert bool(torch.isfinite(x).all()), f"non-finite {c}"
            assert n == 0 or (spec.holds(float(x.min())) and spec.holds(float(x.max()))), \
                f"{c} outside [{spec.low}, {spec.high}]"
        born, changed = self.live("born_step"), self.live("changed_step")
        assert bool((born <= changed).all()), "changed_step before born_step"
        origin, there = self.live("origin"), self.live("origin_uid")
        assert n == 0 or 0 <= int(origin.min()) <= int(origin.max()) <= len(origins), \
            "an origin outside the origins table"
        assert bool(((origin == 0) == (there == -1)).all()) and bool((there >= -1).all()), \
            "origin uid -1 is for rows made here, and only for them"


@dataclass(eq=False)
class Cold:
    """The recall tier's cold store, in host memory: culled tokens' K/V (an ``Arena`` whose
    keys sit rotated at the token's current logical position, so a recalled key is the key
    RoPE gives there, stored a slot per row: ``Arena.allocate``'s ``key_rows``), their
    ledger rows (a ``Ledger``, same columns) and ``entered``, each row's order of entry
    (the oldest to enter is dropped first past ``capacity``). Rows ``[0, n)`` are live,
    dense like the arena's. Stage 4 grows the storage as needed up to ``capacity``, so a
    short run never holds a large block."""

    arena: Arena
    ledger: Ledger
    entered: torch.Tensor  # (rows,) int64, order of entry
    capacity: int  # the most tokens it may hold (Recall.cold_capacity); per head: a head's
    next_entry: int = 0
    # a per-head cache's cold store (``stages.apply.cold_heads``): which cold ledger row each
    # (layer, KV head, cold slot) holds, as ``State.heads`` maps the arena; its ledger holds
    # every token some head holds cold (one row a token, ``entered`` when the row was made)
    heads: Heads | None = None

    @property
    def n(self) -> int:
        return self.ledger.n

    @property
    def bytes_per_token(self) -> float:
        """Memory per row of the store, from its tensors' storage: K/V, their norms and
        log-mass, the ledger row and the entry order (per head: the K/V, norms and map of
        one slot in every head, beside one ledger row)."""
        a = self.arena
        slots = (a.kt, a.v, a.log_mass, a.knorm, a.vnorm) + (
            () if self.heads is None else (self.heads.row,))
        rows = (self.entered,) + tuple(t for t, _ in self.ledger.tables())

        def size(ts) -> int:  # each storage once: a packed table's columns share one
            return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in ts}.values())

        return size(slots) / a.capacity + size(rows) / self.entered.shape[0]

    def view(self) -> "ColdView":
        m, h = self.ledger, self.heads
        n = self.n if h is None else self.arena.n
        return ColdView(k=self.arena.k[:, :, :n], v=self.arena.v[:, :, :n],
                        vnorm=self.arena.vnorm[:, :, :n], uid=m.live("uid"),
                        position=m.live("position"), source=m.live("source"),
                        born_step=m.live("born_step"),
                        heads=None if h is None else Heads(row=h.row[:, :, :n], n=h.n))

    def check_valid(self, hot: Ledger, next_position: int) -> None:
        """Assert the cold rows' invariants next to the ``hot`` ledger's."""
        a, m, n = self.arena, self.ledger, self.n
        uid, pos = m.live("uid"), m.live("position")
        assert torch.unique(uid).numel() == n and (n == 0 or int(uid.max()) < hot.next_uid), \
            "cold uids are not unique issued uids"
        if self.heads is None:
            assert a.n == n <= self.capacity, f"cold store: {a.n} K/V rows, {n} ledger rows"
            assert n <= m.uid.shape[0] == a.capacity == self.entered.shape[0], "cold store shapes"
            assert not bool(torch.isin(uid, hot.live("uid")).any()), "a uid is both hot and cold"
            both = torch.cat((pos, hot.live("position")))
        else:  # a token may be hot in some heads and cold in others, at one position
            assert n <= m.uid.shape[0] == self.entered.shape[0], "cold store shapes"
            assert int(self.heads.n.max()) <= self.capacity, "a head holds more cold than it may"
            self.heads.check_valid(m, a.n, a.capacity)
            hot_uid, hot_pos = hot.live("uid"), hot.live("position")
            shared = torch.isin(uid, hot_uid)
            order = torch.argsort(hot_uid)
            at = order[torch.searchsorted(hot_uid[order], uid[shared])]
            assert torch.equal(hot_pos[at], pos[shared]), "a token hot and cold at two positions"
            both = torch.cat((pos[~shared], hot_pos))
        assert torch.unique(both).numel() == both.numel(), "a cold position is not unique"
        assert n == 0 or 0 <= int(pos.min()) <= int(pos.max()) < next_position, \
            "a cold position outside [0, next position)"
        assert torch.unique(self.entered[:n]).numel() == n and (
            n == 0 or int(self.entered[:n].max()) < self.next_entry), "cold entry order"
        assert m.specs == hot.specs, "the cold store's scorer columns are not the hot ones'"
        m.check_rows(hot.origins)
        w = a.n
        assert torch.allclose(a.knorm[:, :, :w], a.k[:, :, :w].float().norm(dim=-1),
                              rtol=1e-5, atol=1e-6), "the cold key norms do not match the keys"
        assert torch.equal(a.vnorm[:, :, :w], value_norms(a.v[:, :, :w])), "cold value norms"


@dataclass(frozen=True)
class ColdView:
    """What stages 2-3 see of the cold store: views of its live rows, never to be written."""

    k: torch.Tensor  # (L, kv_heads, c, head_dim), rotated at each row's position
    v: torch.Tensor  # (L, kv_heads, c, head_dim)
    vnorm: torch.Tensor  # (L, kv_heads, c) float32
    uid: torch.Tensor  # (c,)
    position: torch.Tensor  # (c,)
    source: torch.Tensor  # (c,)
    born_step: torch.Tensor  # (c,)
    # a per-head cold store's map over the k/v slots (rows (L, kv_heads, slots) of the
    # columns above); None: slot i holds row i
    heads: "Heads | None" = None

    @property
    def n(self) -> int:
        return self.k.shape[2]


@dataclass(eq=False)
class Heads:
    """A per-head cache's map (``Allocation.per_head``; ``stages.apply.heads``): which
    ledger row each (layer, KV head, slot) of the arena holds (-1: none), and each head's
    live count; a head's live slots are its dense prefix ``[0, n)``. A view's is of the
    slots stage 1 reads (the largest head's count)."""

    row: torch.Tensor  # (L, kv_heads, capacity) int64 ledger rows, -1 where free
    n: torch.Tensor  # (L, kv_heads) int64

    def live(self, width: int) -> torch.Tensor:
        """(L, kv_heads, width) bool: the slots each head holds among the first ``width``."""
        return torch.arange(width, device=self.n.device) < self.n.unsqueeze(-1)

    def mask(self, width: int, log_mass: torch.Tensor | None) -> torch.Tensor | None:
        """What stage 1 adds to the scores of the first ``width`` slots: -inf where a head
        holds no token (its count below ``width``), else the slot's ``log_mass`` (None:
        every head holds them all, nothing folded)."""
        if int(self.n.min()) >= width:
            return log_mass
        base = log_mass if log_mass is not None else torch.zeros(
            self.row.shape[:2] + (width,), device=self.n.device)
        return base.masked_fill(~self.live(width), -math.inf)

    def check_valid(self, ledger: "Ledger", width: int, capacity: int) -> None:
        """Every (layer, KV head, slot) accounted for: a head's live slots hold distinct live
        ledger rows and its free ones none; every ledger row is held by some head; the
        arena's live width is the largest head's count."""
        L, KVH, cap = self.row.shape
        assert cap == capacity and self.n.shape == (L, KVH), "head map shapes"
        assert int(self.n.min()) >= 0 and int(self.n.max()) == width, \
            f"the arena's {width} live slots are not the largest head's count"
        live = self.live(cap)
        rows = self.row
        assert bool((rows[~live] == -1).all()), "a free slot of a head holds a row"
        assert bool(((rows[live] >= 0) & (rows[live] < ledger.n)).all()), \
            "a head's slot holds no live ledger row"
        key = (torch.arange(L * KVH, device=rows.device).view(L, KVH, 1) * (ledger.n + 1)
               + rows)[live]
        assert torch.unique(key).numel() == key.numel(), "a head holds a token twice"
        held = torch.bincount(rows[live], minlength=ledger.n)
        assert ledger.n == 0 or int(held.min()) > 0, "a ledger row no head holds"
        pinned = (ledger.live("flags") & FLAG_PROTECTED) != 0
        assert bool((held[pinned] == L * KVH).all()), "a pinned token some head let go"


@dataclass(frozen=True)
class View:
    """What stages 1-3 see: views of the live prefix, never copies, never to be written.
    Of a ``SplitArena``, ``k``, ``v`` and ``log_mass`` are tuples of one such view per block
    of layers (on its device), and the norms copies on the main device."""

    k: torch.Tensor | tuple  # (L, kv_heads, n, head_dim)
    v: torch.Tensor | tuple  # (L, kv_heads, n, head_dim)
    log_mass: torch.Tensor | tuple | None  # (L, kv_heads, n) added to scores; None: nothing folded
    knorm: torch.Tensor  # (L, kv_heads, n) float32 key norms
    vnorm: torch.Tensor  # (L, kv_heads, n) float32 value norms
    uid: torch.Tensor  # (n,)
    token_id: torch.Tensor  # (n,)
    position: torch.Tensor  # (n,)
    source: torch.Tensor  # (n,)
    flags: torch.Tensor  # (n,)
    born_step: torch.Tensor  # (n,)
    columns: dict[str, torch.Tensor]  # the scorer's own columns, name -> (n,) float32 (a per-head
    # cache's: (n, L, kv_heads))
    origin: torch.Tensor  # (n,) 0 = made here, k = origins[k - 1]
    origin_uid: torch.Tensor  # (n,) the row's uid in that file (-1: made here)
    pending_token: int
    next_position: int
    step: int
    capacity: int
    cold: ColdView | None = None  # the cold store's rows (recall); None without recall
    origins: tuple[str, ...] = ()  # the ledger's origins table
    specs: dict[str, Column] = field(default_factory=dict)  # the columns' declarations
    # a per-head cache's map over the k/v slots (row: (L, kv_heads, width)); None: whole tokens,
    # slot i holding ledger row i
    heads: Heads | None = None

    @property
    def n(self) -> int:
        return self.uid.shape[0]


@dataclass(eq=False)
class State:
    """Arena + ledger + the pending token (sampled, not yet in the cache)."""

    arena: Arena | SplitArena
    ledger: Ledger
    pending_token: int = -1
    pending_source: str = "user"
    next_position: int = 0  # the pending token's position
    step: int = 0  # number of stage-4 applications so far
    pinned: tuple[str, ...] = ()  # prime's protected sources (stage 4 flags the pending token)
    cold: Cold | None = None  # the recall tier (CacheParams.recall); None without it
    heads: Heads | None = None  # a per-head cache's map (Allocation.per_head); None: whole tokens

    def view(self) -> View:
        n, m, h = self.arena.n, self.ledger, self.heads
        k, v, log_mass = self.arena.past(n)
        knorm, vnorm = self.arena.norms(n)
        if h is not None:
            log_mass = h.mask(n, log_mass)
            h = Heads(row=h.row[:, :, :n], n=h.n)
        return View(k=k, v=v, log_mass=log_mass, knorm=knorm, vnorm=vnorm, heads=h,
                    **{c: m.live(c) for c in VIEW_COLUMNS},
                    columns={c: m.live(c) for c in m.columns}, origins=m.origins, specs=m.specs,
                    pending_token=self.pending_token,
                    next_position=self.next_position, step=self.step,
                    capacity=self.arena.capacity,
                    cold=None if self.cold is None else self.cold.view())

    def kv_memory(self) -> dict:
        """What the live cache costs: the K/V pairs every (layer, KV head) holds in all, their
        bytes (keys and values in the arena's dtypes), the ``tokens`` they are a head (the
        mean over the (layer, KV head)s; the live tokens of a whole-token cache) and their
        share of the full cache's: every token that entered the cache (each uid issued, less
        the new token of each merge, which stands for a pair already counted) in every
        head."""
        full_tokens = self.ledger.next_uid - len(self.ledger.merged)
        blocks = self.arena.blocks
        heads = sum(b.kt.shape[0] * b.kt.shape[1] for b in blocks)
        pairs = int(self.heads.n.sum()) if self.heads is not None else self.arena.n * heads
        b = blocks[0]
        per_pair = b.kt.shape[2] * (b.kt.element_size() + b.v.element_size())
        full = full_tokens * heads
        return {"pairs": pairs, "bytes": pairs * per_pair, "tokens": pairs / heads,
                "full_pairs": full, "fraction": pairs / full if full else 1.0}

    def check_valid(self) -> None:
        if self.heads is None:
            assert self.arena.n == self.ledger.n, \
                f"arena holds {self.arena.n} live slots, ledger {self.ledger.n}"
        else:
            self.heads.check_valid(self.ledger, self.arena.n, self.arena.capacity)
        assert self.pending_source in SOURCES, f"unknown pending source {self.pending_source!r}"
        for a in self.arena.blocks:
            norms = a.k[:, :, :a.n].float().norm(dim=-1)
            assert torch.allclose(a.knorm[:, :, :a.n], norms, rtol=1e-5, atol=1e-6), \
                "the key-norm column does not match the keys"
            assert torch.equal(a.vnorm[:, :, :a.n], value_norms(a.v[:, :, :a.n])), \
                "the value-norm column does not match the values"
        self.ledger.check_valid(step=self.step, next_position=self.next_position)
        self.check_accounts()

    def check_accounts(self) -> None:
        """Every uid ever issued is hot, cold, culled for good or merged away, exactly once."""
        m = self.ledger
        cold = 0
        if self.cold is not None:
            self.cold.check_valid(m, self.next_position)
            cold = self.cold.n
            if self.cold.heads is not None:
                self._check_either()
        away = {u for pair in m.merged.values() for u in pair}
        live = set(m.live("uid").tolist())
        if self.cold is not None:
            cold_uids = set(self.cold.ledger.live("uid").tolist())
            cold -= len(live & cold_uids)  # per head: hot in some heads, cold in others
            live |= cold_uids
        assert not away & live, "a merged-away uid is still hot or cold"
        assert m.n + cold + m.dropped + len(away) == m.next_uid, (
            f"uids unaccounted for: {m.n} hot + {cold} cold alone + {m.dropped} dropped + "
            f"{len(away)} merged away != {m.next_uid} issued")


    def _check_either(self) -> None:
        """In a per-head cache with recall, a (layer, KV head) holds a token hot or cold,
        not both."""
        def held(a, h: Heads, m: Ledger) -> torch.Tensor:
            lh, hh, s = h.live(a.n).nonzero().unbind(1)
            return (m.uid[h.row[lh, hh, s]] * h.n.numel() + lh * h.n.shape[1] + hh)

        assert self.heads is not None, "a per-head cold store beside a whole-token arena"
        hot = held(self.arena, self.heads, self.ledger)
        cold = held(self.cold.arena, self.cold.heads, self.cold.ledger)
        assert not bool(torch.isin(cold, hot).any()), "a head holds a token hot and cold"


LEDGER_TENSORS = Ledger.COLUMNS + ("columns", "n")  # what a ledger holds besides its fields
STATE_PARTS = ("arena", "ledger", "cold", "heads")  # what a state holds besides its fields


def restore_args(state: State) -> dict:
    """The whole ``state`` as stage 0's ``restore`` takes it back (``restore(model, **...)``):
    the live ``k``/``v`` (L, kv_heads, n, head_dim) and ``log_mass`` (L, kv_heads, n) in slot
    order, every ledger column (``columns``), the arena's ``capacity``, the ledger's other
    fields (``ledger_fields``: next uid, merge history, dropped, the scorer columns' specs, origins), the state's
    (``state_fields``: pending token, its source and position, step, pinned) and the cold
    store's live rows (``cold``: k, v, columns, entered, capacity, next entry, and a per-head
    one's map ``heads`` over its live slots as ``heads`` below; None without one). The scorer's columns are among ``columns``, declared in the ledger fields' ``specs``. Views, not copies (of a split arena, K/V and log-mass gathered onto its main device).
    A per-head cache's ``heads``: its map over the live slots (``row`` (L, kv_heads, n), the
    ledger row each slot holds or -1, and each head's count ``n`` (L, kv_heads)); its ledger's
    rows (every token some head holds) are not its slots then (None: whole tokens)."""
    a, m, cold, h = state.arena, state.ledger, state.cold, state.heads
    return {
        "heads": None if h is None else {"row": h.row[:, :, :a.n], "n": h.n},
        "k": gathered(a, "k", a.n), "v": gathered(a, "v", a.n),
        "columns": {c: m.live(c) for c in m.names}, "capacity": a.capacity,
        "ledger_fields": {f.name: getattr(m, f.name) for f in fields(Ledger)
                          if f.name not in LEDGER_TENSORS},
        "state_fields": {f.name: getattr(state, f.name) for f in fields(State)
                         if f.name not in STATE_PARTS},
        "log_mass": gathered(a, "log_mass", a.n),
        "cold": None if cold is None else {
            "k": cold.arena.k[:, :, :cold.arena.n], "v": cold.arena.v[:, :, :cold.arena.n],
            "columns": {c: cold.ledger.live(c) for c in cold.ledger.names},
            "entered": cold.entered[:cold.n], "capacity": cold.capacity,
            "next_entry": cold.next_entry,
            "heads": None if cold.heads is None else {
                "row": cold.heads.row[:, :, :cold.arena.n], "n": cold.heads.n}}}
