"""Paged KV cache: many sequences of very different lengths share one pool of blocks.

Shape legend: B the number of sequences of a call (``len(seq_ids)``), H_kv
key/value heads, H_q query heads (a multiple of H_kv), d query/key head dim,
dv value head dim, L_new the length of a chunk, bs the block size. ::

    cache = PagedKVCache(num_kv_heads=8, head_dim=128)      # one layer
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append([a, b], k, v, lengths=[7, 300])   # k (2, H_kv, 300, d): ragged prefill
    o = cache.attend([a, b], q)                    # q (2, H_q, 300, d) -> (2, H_q, 300, dv)
    c = cache.fork(a)                              # c shares a's blocks (copy-on-write)
    cache.append([a, c], k1, v1)                   # (2, H_kv, 1, d): one token each, diverging
    o1 = cache.attend([a, c], q1)                  # (2, H_q, 1, dv)
    cache.free(a)

Storage. The pool holds blocks of ``block_size`` token rows for every kv head:
block g is ``k_pool[g // C][g % C]`` of shape (H_kv, bs, d) (and the same for
V, dv), where the pool is a list of chunks of C = ``num_blocks`` blocks each,
(C, H_kv, bs, d) arrays. Each sequence has a block table (its blocks in
order): token t of a sequence is row t % bs of its block t // bs. ``append``
copies each new key and value exactly once into its block; ``attend`` runs the
split-KV decode kernel, which reads the rows in place through the block
tables of the call (``_core.decode`` with a block table: no gather, no copy of the cache).

Why a list of chunks: when the free blocks run out the pool grows by one more
chunk (``growable=True``), and the blocks already written never move (a
single array would have to be copied to grow, and every sequence's data with
it); the kernel takes the chunks' base pointers with the block table. With
``growable=False`` the pool is fixed and an append that needs more blocks
than are free raises ValueError (nothing is changed).

Block size: a multiple of 64, the decode kernel's key block, so that no
kernel block straddles two pool blocks. Then decode results are bit-identical
to a contiguous ``KVCache`` holding the same tokens (the kernel cuts its key
range at the same places); chunks longer than ``DECODE_MAX_LQ`` = 4 tokens
also run the decode kernel here (the contiguous cache switches to the tiled
prefill kernel), so those agree to float32 rounding.

The default block size, 256 tokens, is set by the memory system rather than
the kernel: a block of one kv head is one run of bytes, and runs in random
places read slower than one stream (on Zen 3 a pure read of shuffled 8 KiB
runs took 1.09-1.50x the time of the same bytes in order, 32 KiB runs
1.05-1.10x; bench/micro/read_runs.cpp). With 64-token blocks an int8 run is
8 KiB (d = 128) and a paged decode step took 1.05-1.27x the contiguous cache's
time there, with 256 1.02-1.12x (bfloat16: 1.02-1.15x and 0.99-1.03x;
bench/notes_archive.md, "paged block size"). Smaller blocks waste less on short
sequences (each holds one partly filled block) and share prefixes more finely
(``fork``): pass block_size=64 for those.

Sharing (``fork``): a forked sequence shares all of its parent's blocks; a
block's reference count says how many sequences hold it. Full blocks are
never written again, so they stay shared; the partly filled last block is
copied on the first write of either sequence that still shares it
(copy-on-write). ``free`` drops a sequence's references; blocks nobody holds
return to the free list and are reused by later appends. Sequence ids are
never reused: a freed id raises ValueError wherever it is passed.

Sliding window (``window=w``): a query at position p sees the keys at
positions p-w+1 .. p (itself and the w-1 before it; ``KVCache(window=w)``'s
rule, ``window_size=(w-1, 0)``). An append of c > 0 tokens to a sequence at
position n first releases the blocks whose keys all lie before n-w+1 (no
query from then on sees them: they go back to the pool, or stay with a
sequence that still shares them), so a sequence holds at most
ceil((w - 1 + c) / bs) + 1 blocks, whatever its length. Its block table then
starts at its first held block (``first`` blocks were dropped from its
front) and the kernel gets the stored keys with their positions shifted by
``first * bs``: bottom-right causal and window masks depend only on the
positions relative to the last key, so no kernel argument changes.
``positions`` counts every token appended (the next RoPE position);
``lengths`` counts those still stored. An append holds its whole chunk
until the next one (its own queries need it), and the pool never shrinks:
prefill a long prompt in chunks to keep the pool at the window's size.

Truncation (``truncate(seq_id, n)``): keep positions < n; the blocks past
them are released (a shared block only loses this sequence's reference), a
shared block that is now the partly filled last one is copied on the next
write (copy-on-write, as after ``fork``).

Storage types: float32 (default), float64, float16 and bfloat16 (the uint16
bits; chunks and queries in that dtype, computed in float32, as
``KVCache(dtype=...)``), and ``"int8"``: the codes of ``KVCache(dtype="int8")``
(keys per channel over groups of 64 positions, values per token, asymmetric,
scales and offsets beside them), a block laid out as a one-sequence int8 cache
of block_size slots, so a key group never crosses a block. Chunks, queries and
results are then float32 (``io_dtype``); ``append`` quantises in C++
(``_core.kv_quant_append`` per block), keeping each sequence's open key group
in float32 (a staging tail of 64 x d floats per kv head, copied by ``fork``);
``keys`` / ``values`` return the dequantised values ``attend`` reads.

Huge pages (Linux): a chunk's arrays (K and V; int8: the codes, scales and
offsets) are views of one anonymous mapping on transparent huge pages
(``_kv_store.huge_arrays``). The int8 scales of a sequence's blocks lie in
per-block records a few KiB apart in pool order, so on 4 KiB pages nearly
every block of a decode step touched new pages of them: on AMD Zen 4 paged
int8 decode took 1.05-1.09x the contiguous cache's time with NumPy's
allocations (the scale arrays under its 4 MiB huge-page threshold), about
1.0x this way (bench/notes_archive.md, zen4 step 10).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import _dispatch
from ._checks import check_int, dtype_name, half_result, to_input_kind
from ._kv_store import CODED_NAMES, KGROUP, PLAIN_NAMES, KVStore, LayerStack, huge_arrays
from .masks import MaskArgs
from .positional import RoPE

__all__ = ["PagedKVCache", "PagedLayerCaches"]

_SUPPORTED = f"{PLAIN_NAMES} or {CODED_NAMES}"


class _Seq:
    """One sequence: its block table (a growing int64 array of the blocks it holds, in
    order), blocks in use, tokens appended (its next position) and the logical index of
    its first held block (``first``: blocks before it were released by the window)."""

    __slots__ = ("table", "nblk", "n", "first", "last_new", "last_L", "stage", "stage_grp")

    def __init__(self, table, nblk=0, n=0, stage=None, stage_grp=None, first=0):
        self.table = table
        self.nblk = nblk
        self.n = n
        self.first = first  # token t lives in row t % bs of block table[t // bs - first]
        # quantised: the float32 keys of the key group being filled (1, H_kv, 64, d), its group
        self.stage = stage
        self.stage_grp = stage_grp
        self.last_new = 0  # tokens of the last append
        self.last_L = -1  # chunk length of the last append (-1: none since add / fork)


class PagedKVCache(KVStore):
    """Paged key/value storage for one attention layer, shared by many sequences.

    Parameters
    ----------
    num_kv_heads : int, H_kv.
    head_dim : int, d (keys and queries).
    block_size : int, token rows per block (default 256); a multiple of 64,
        the decode kernel's key block (module docstring: why 256).
    num_blocks : int, blocks per pool chunk (default 64, 16384 tokens at the
        default block size): the pool starts with one chunk and grows by one
        chunk at a time.
    v_head_dim : int, dv (default: head_dim).
    dtype : storage dtype: float32 (default), float64, or "float16" /
        "bfloat16" (np.float16, ml_dtypes.bfloat16, torch dtypes too),
        computed in float32; ``self.dtype`` is then float16, or uint16 for
        bfloat16 (the bits). Chunks, queries and results have this dtype
        (``io_dtype``), except for "int8" (np.int8): 8-bit codes with
        scales (module docstring), float32 chunks, queries and results.
    growable : bool, default True. False: the pool keeps ``num_blocks``
        blocks and an append that needs more raises ValueError.
    max_seq_len : int or None, the most tokens one sequence may hold (its
        block table's length times block_size; default unbounded). An append
        beyond it raises ValueError (with a window: the tokens still stored).
    window : int >= 1 or None (default): sliding-window attention over the
        last ``window`` positions (module docstring); the blocks before the
        window return to the pool as the sequences grow.

    Attributes
    ----------
    seq_ids : list of the live sequences' ids, in creation order.
    lengths : dict seq_id -> tokens stored (a copy; fewer than ``positions``
        once a window released blocks).
    positions : dict seq_id -> tokens appended, the position of the next
        token (what RoPE offsets use).
    num_blocks : int, blocks in the pool now (all chunks).
    free_blocks : int, blocks on the free list.
    nbytes : int, bytes of the pool's K and V storage allocated
        (num_blocks x H_kv x bs x (d + dv) x itemsize; int8: the codes, scales
        and offsets, bs x (d + dv + 8) + 8 d bs / 64 bytes per block and kv
        head, plus 256 d bytes of staging per live sequence and kv head).
    used_nbytes : int, the bytes of the blocks that some sequence holds.
    """

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 256,
        num_blocks: int = 64,
        v_head_dim: int | None = None,
        dtype: DTypeLike | str = np.float32,
        growable: bool = True,
        max_seq_len: int | None = None,
        window: int | None = None,
    ) -> None:
        self.num_kv_heads = check_int(num_kv_heads, "num_kv_heads", 1)
        self.head_dim = check_int(head_dim, "head_dim", 1)
        self.v_head_dim = (
            self.head_dim if v_head_dim is None else check_int(v_head_dim, "v_head_dim", 1)
        )
        self.block_size = check_int(block_size, "block_size", 1)
        if self.block_size % KGROUP:
            raise ValueError(
                f"block_size must be a multiple of {KGROUP} (the decode kernel's key block), "
                f"got {self.block_size}"
            )
        self.chunk_blocks = check_int(num_blocks, "num_blocks", 1)
        self._set_encoding(dtype, unknown=f"PagedKVCache stores {_SUPPORTED}")
        self.growable = bool(growable)
        self.max_seq_len = None if max_seq_len is None else check_int(max_seq_len, "max_seq_len", 1)
        self.window = None if window is None else check_int(window, "window", 1)
        self._kc: list[np.ndarray] = []
        self._vc: list[np.ndarray] = []
        # the encoding's aux chunks beside K/V (int8: scales and offsets), one list per array
        self._aux: tuple[list[np.ndarray], ...] = tuple([] for _ in self.encoding.aux_rows)
        self._ref = np.zeros(0, dtype=np.int64)  # references per block
        self._free: list[int] = []  # a stack: the lowest ids are taken first
        self._seqs: dict[int, _Seq] = {}
        self._freed: set[int] = set()
        self._next_id = 0
        self._grow(1)

    # ---- pool ----------------------------------------------------------------
    def _grow(self, n_chunks):
        """Add n_chunks chunks of chunk_blocks blocks (the existing ones do not move)."""
        C, H, bs = self.chunk_blocks, self.num_kv_heads, self.block_size
        first = self.num_blocks
        d, dv = self.head_dim, self.v_head_dim
        for _ in range(n_chunks):
            # One mapping per chunk on huge pages (huge_arrays), the aux arrays first.
            specs = self.encoding.aux_specs((C, H), bs, d, dv)
            specs += [((C, H, bs, d), self.dtype), ((C, H, bs, dv), self.dtype)]
            for pool, a in zip((*self._aux, self._kc, self._vc), huge_arrays(specs)):
                pool.append(a)
        last = self.num_blocks
        self._ref = np.concatenate([self._ref, np.zeros(last - first, dtype=np.int64)])
        self._free = list(range(last - 1, first - 1, -1)) + self._free

    def _take(self):
        g = self._free.pop()
        self._ref[g] = 1
        return g

    def _block(self, pool, g):
        """Block g of a pool (a view (H_kv, bs, dim))."""
        return pool[g // self.chunk_blocks][g % self.chunk_blocks]

    @property
    def num_blocks(self) -> int:
        return len(self._kc) * self.chunk_blocks

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def _pools(self):
        return (self._kc, self._vc, *self._aux)

    def _arrays(self, q):
        return (q, *(a for pool in self._pools() for a in pool))

    @property
    def nbytes(self) -> int:
        n = sum(a.nbytes for pool in self._pools() for a in pool)
        return n + sum(s.stage.nbytes for s in self._seqs.values() if s.stage is not None)

    @property
    def used_nbytes(self) -> int:
        per_token = self.encoding.bytes_per_token_head(self.head_dim, self.v_head_dim)
        per_block = round(self.num_kv_heads * self.block_size * per_token)
        return (self.num_blocks - self.free_blocks) * per_block

    # ---- sequences -----------------------------------------------------------
    @property
    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    @property
    def lengths(self) -> dict[int, int]:
        return {i: self._stored(s) for i, s in self._seqs.items()}

    @property
    def positions(self) -> dict[int, int]:
        return {i: s.n for i, s in self._seqs.items()}

    def _stored(self, s):
        """Tokens s still stores (all of them unless a window released blocks)."""
        return s.n - s.first * self.block_size

    def __len__(self) -> int:
        """The number of live sequences."""
        return len(self._seqs)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __repr__(self) -> str:
        w = "" if self.window is None else f", window={self.window}"
        return (
            f"PagedKVCache(num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"v_head_dim={self.v_head_dim}, block_size={self.block_size}, "
            f"dtype={dtype_name(self.dtype)}{w}, blocks={self.num_blocks} "
            f"({self.free_blocks} free), lengths={self.lengths})"
        )

    def _seq(self, seq_id, name="seq_id"):
        if isinstance(seq_id, (bool, np.bool_)) or not isinstance(seq_id, (int, np.integer)):
            raise TypeError(f"{name} must be an int (from add_sequence), got {seq_id!r}")
        i = int(seq_id)
        s = self._seqs.get(i)
        if s is None:
            if i in self._freed:
                raise ValueError(f"sequence {i} was freed")
            raise ValueError(f"unknown sequence {i} (live: {self.seq_ids})")
        return s

    def _resolve(self, seq_ids, unique=False):
        """seq_ids (an int or a sequence of ints) -> (list of ids, list of _Seq)."""
        if isinstance(seq_ids, (int, np.integer)) and not isinstance(seq_ids, (bool, np.bool_)):
            seq_ids = [seq_ids]
        ids = np.asarray(seq_ids)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise TypeError(f"seq_ids must be an int or a 1-D sequence of ints, got {seq_ids!r}")
        ids = [int(i) for i in ids]
        seqs = [self._seq(i, "seq_ids") for i in ids]
        if unique and len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids must not repeat a sequence in one append, got {ids}")
        return ids, seqs

    def add_sequence(self) -> int:
        """A new empty sequence; returns its id (ids are never reused)."""
        i = self._next_id
        self._next_id += 1
        s = _Seq(np.zeros(8, dtype=np.int64))
        s.stage, s.stage_grp = self.encoding.stage((1, self.num_kv_heads), self.head_dim)
        self._seqs[i] = s
        return i

    def fork(self, seq_id: int) -> int:
        """A new sequence holding seq_id's tokens (prefix sharing for beam search or sampling).

        No data is copied: the new sequence shares every block of seq_id (their
        reference counts go up). Either sequence's next append copies the shared
        partly filled last block first (copy-on-write), so the other one is
        unchanged. Returns the new id.
        """
        s = self._seq(seq_id)
        i = self._next_id
        self._next_id += 1
        self._seqs[i] = _Seq(
            s.table.copy(),
            s.nblk,
            s.n,
            None if s.stage is None else s.stage.copy(),
            None if s.stage_grp is None else s.stage_grp.copy(),
            s.first,
        )
        self._ref[s.table[: s.nblk]] += 1
        return i

    def free(self, seq_id: int) -> None:
        """Drop sequence seq_id; its blocks that no other sequence shares return to the pool.

        ValueError for an unknown or already freed id."""
        s = self._seq(seq_id)
        self._release(s.table[: s.nblk])
        del self._seqs[int(seq_id)]
        self._freed.add(int(seq_id))

    def _release(self, blocks):
        """Drop one reference to each of blocks (distinct ids); those nobody holds are freed."""
        self._ref[blocks] -= 1
        self._free.extend(int(g) for g in blocks[self._ref[blocks] == 0][::-1])

    def _drop_front(self, s, k):
        """Release the first k held blocks of s (the window moved past them)."""
        if k:
            self._release(s.table[:k].copy())
            s.table = np.concatenate([s.table[k:], np.zeros(k, np.int64)])
            s.nblk -= k
            s.first += k

    def _window_drops(self, seqs, new):
        """Blocks each sequence releases before an append of new[i] rows: those whose keys all
        lie before position n - window + 1 (no later query sees them); 0 without a window."""
        if self.window is None:
            return [0] * len(seqs)
        bs, w = self.block_size, self.window
        return [
            max(0, (s.n - w + 1) // bs - s.first) if c else 0 for s, c in zip(seqs, new.tolist())
        ]

    def _freed_by(self, seqs, drops):
        """How many blocks return to the free list when each seqs[i] drops drops[i] blocks."""
        blocks = [s.table[:k] for s, k in zip(seqs, drops) if k]
        if not blocks:
            return 0
        g, c = np.unique(np.concatenate(blocks), return_counts=True)
        return int((self._ref[g] == c).sum())

    def truncate(self, seq_id: int, n: int) -> None:
        """Keep the first n tokens of sequence seq_id (positions < n), drop the rest.

        seq_id : a live id; n : int, 0 <= n <= ``positions[seq_id]``.

        For rejected speculative tokens and beam pruning. The blocks past the
        first n tokens are released (a block another sequence shares only
        loses this sequence's reference); a shared block that becomes this
        sequence's partly filled last block is copied on its next append
        (copy-on-write), so the sharers are unchanged. int8: the open key
        group is requantised from its codes when the next append reopens it.

        ValueError (nothing changes) when n < 0, n > ``positions[seq_id]``,
        seq_id is unknown or freed, or with a window when the cache no
        longer holds the window - 1 keys before position n (their blocks
        were released).
        """
        s = self._seq(seq_id)
        self._cut(s, self._check_truncate(s, seq_id, n))

    def _check_truncate(self, s, seq_id, n):
        """n as an int, or ValueError if s cannot be truncated to n tokens (see truncate)."""
        n = check_int(n, "n", 0)
        if n > s.n:
            raise ValueError(
                f"cannot truncate sequence {int(seq_id)} to {n} tokens: it holds {s.n}"
            )
        bs = self.block_size
        need = n if self.window is None else max(0, n - (self.window - 1))
        if s.first * bs > need:
            raise ValueError(
                f"cannot truncate sequence {int(seq_id)} to {n} tokens: the window "
                f"{self.window} needs the keys from position {need} on, but the blocks before "
                f"position {s.first * bs} were released"
            )
        return n

    def _cut(self, s, n):
        """Truncate s to its first n tokens (checked by _check_truncate)."""
        keep = -(-n // self.block_size) - s.first  # held blocks still needed
        self._release(s.table[keep : s.nblk].copy())
        s.table[keep : s.nblk] = 0
        s.nblk, s.n = keep, n
        s.last_new, s.last_L = 0, -1

    def lengths_of(self, seq_ids: ArrayLike | int) -> np.ndarray:
        """The (B,) int64 stored lengths of the sequences seq_ids (``lengths``)."""
        return np.array([self._stored(s) for s in self._resolve(seq_ids)[1]], dtype=np.int64)

    def positions_of(self, seq_ids: ArrayLike | int) -> np.ndarray:
        """The (B,) int64 positions (tokens appended) of the sequences seq_ids."""
        return np.array([s.n for s in self._resolve(seq_ids)[1]], dtype=np.int64)

    def keys(self, seq_id: int) -> np.ndarray:
        """Stored keys of one sequence in position order, (H_kv, length, d), a copy
        (bfloat16 as ``ml_dtypes.bfloat16`` when importable, else its uint16 bits; int8:
        the dequantised float32 keys, what ``attend`` reads). With a window, the keys
        still stored: positions ``positions[seq_id] - lengths[seq_id]`` on."""
        return half_result(self._gather(self._seq(seq_id), "k", self._kc, self.head_dim))

    def values(self, seq_id: int) -> np.ndarray:
        """Stored values of one sequence in position order, (H_kv, length, dv), a copy
        (int8: the dequantised float32 values)."""
        return half_result(self._gather(self._seq(seq_id), "v", self._vc, self.v_head_dim))

    def _gather(self, s, which, pool, dim):
        """s's stored keys / values (which, from pool) through the encoding, in io form."""
        parts = [
            self.encoding.decode(
                which,
                self._block(pool, g),
                tuple(self._block(a, g) for a in self._aux),
                slice(None),
            )
            for g in s.table[: s.nblk].tolist()
        ]
        if not parts:
            return np.empty((self.num_kv_heads, 0, dim), dtype=self.io_dtype)
        return np.concatenate(parts, axis=1)[:, : self._stored(s)]

    # ---- writing -------------------------------------------------------------
    def append(
        self,
        seq_ids: ArrayLike | int,
        k: ArrayLike,
        v: ArrayLike,
        lengths: ArrayLike | int | None = None,
        rope: RoPE | None = None,
    ) -> None:
        """Store a chunk of new keys and values after each named sequence's last token.

        seq_ids : an int or B distinct ids (from add_sequence / fork).

        k : (B, H_kv, L_new, d), v : (B, H_kv, L_new, dv), the cache's dtype
            (TypeError with a cast hint otherwise), any strides; L_new may be 0.

        lengths : optional int or (B,) ints <= L_new: sequence i appends only
            rows ``[:lengths[i]]`` (ragged: each sequence its own number of
            new tokens); the rest is ignored.

        rope : optional ``positional.RoPE`` with head_dim d: keys are rotated on
            the way in, row t of sequence i at position ``length + t`` (16-bit
            keys rotated in float32 and rounded once).

        New blocks come from the free list (the pool grows by a chunk when it is
        empty, or ValueError with ``growable=False``); a shared partly filled
        last block is copied first (copy-on-write). Each row is copied once.
        On error nothing changes.
        """
        ids, seqs = self._resolve(seq_ids, unique=True)
        enc = self.encoding
        k, v, new = self._check_append(k, v, len(ids), lengths, rope)
        L = k.shape[2]
        n_old = np.array([s.n for s in seqs], dtype=np.int64)
        enc.check_values(k, v, new)
        bs = self.block_size
        drops = self._window_drops(seqs, new)
        stored = np.array([self._stored(s) for s in seqs], dtype=np.int64)
        kept = stored - np.array(drops, dtype=np.int64) * bs  # stored once the window moved
        if self.max_seq_len is not None and (kept + new > self.max_seq_len).any():
            raise ValueError(
                f"block table overflow: appending {new.tolist()} tokens to sequences {ids} "
                f"of lengths {stored.tolist()} exceeds max_seq_len = {self.max_seq_len}"
            )
        if rope is not None and rope.rotary_dim and L:  # before the pool changes
            k = enc.rotate(k, rope, n_old[:, None] + np.arange(L))
        need = 0  # blocks this append takes from the free list
        for s, c in zip(seqs, new.tolist()):
            if c:
                need += -(-(s.n + c) // bs) - s.first - s.nblk
                need += bool(s.n % bs and self._ref[s.table[s.nblk - 1]] > 1)  # copy-on-write
        avail = len(self._free) + self._freed_by(seqs, drops)
        if need > avail and not self.growable:
            raise ValueError(
                f"pool exhausted: appending {new.tolist()} tokens to sequences {ids} needs "
                f"{need} free blocks, {avail} of {self.num_blocks} are free "
                "(growable=False); free finished sequences or use a larger num_blocks"
            )
        for s, nd in zip(seqs, drops):  # the window moved past these blocks
            self._drop_front(s, nd)
        if need > len(self._free):
            self._grow(-(-(need - len(self._free)) // self.chunk_blocks))
        for i, (s, c) in enumerate(zip(seqs, new.tolist())):
            s.last_new, s.last_L = c, L
            if c:
                self._write(s, k[i], v[i], c)

    def _write(self, s, k, v, c):
        """Rows [0, c) of k (H_kv, L, d) and v (H_kv, L, dv) after s's last token."""
        bs = self.block_size
        total = -(-(s.n + c) // bs) - s.first  # held blocks after the write
        if total > len(s.table):
            s.table = np.concatenate([s.table, np.zeros(max(total, 2 * len(s.table)), np.int64)])
        if s.n % bs and self._ref[s.table[s.nblk - 1]] > 1:  # copy-on-write of the shared tail
            old, g = int(s.table[s.nblk - 1]), self._take()
            r = s.n % bs
            self._block(self._kc, g)[:, :r] = self._block(self._kc, old)[:, :r]
            self._block(self._vc, g)[:, :r] = self._block(self._vc, old)[:, :r]
            for pool in self._aux:  # the block's aux entries (int8: scales), all of them
                self._block(pool, g)[...] = self._block(pool, old)
            self._ref[old] -= 1
            s.table[s.nblk - 1] = g
        while s.nblk < total:
            s.table[s.nblk] = self._take()
            s.nblk += 1
        t, p = 0, s.n
        while t < c:
            g, r = int(s.table[p // bs - s.first]), p % bs
            m = min(c - t, bs - r)
            if self.encoding.quantised:
                self._encode(s, g, p, k[None, :, t : t + m], v[None, :, t : t + m])
            else:
                self._block(self._kc, g)[:, r : r + m] = k[:, t : t + m]
                self._block(self._vc, g)[:, r : r + m] = v[:, t : t + m]
            t, p = t + m, p + m
        s.n += c

    def _encode(self, s, g, p, k, v):
        """Quantised: encode k (1, H_kv, m, d), v (1, H_kv, m, dv) into rows p % bs .. of
        block g, positions p .., as a one-sequence cache of block_size slots (the
        sequence's staging tail holds its open key group)."""
        first = np.array([p - p % self.block_size], dtype=np.int64)  # the block's first position
        self.encoding.write(
            k,
            v,
            self._block(self._kc, g)[None],
            self._block(self._vc, g)[None],
            tuple(self._block(pool, g)[None] for pool in self._aux),
            s.stage,
            s.stage_grp,
            np.array([p], dtype=np.int64),
            np.array([k.shape[2]], dtype=np.int64),
            first,
            first,
        )

    # ---- reading -------------------------------------------------------------
    def attend(
        self,
        seq_ids: ArrayLike | int,
        q: ArrayLike,
        scale: float | None = None,
        causal: bool = True,
        q_lens: ArrayLike | int | None = None,
        return_lse: bool = False,
        out: Any = None,
    ) -> Any:
        """Attention of new queries of the named sequences against their stored keys.

        seq_ids : an int or B ids (repeats allowed), one per batch row of q.

        q : (B, H_q, L_new, d), H_q a multiple of H_kv (GQA: head h reads kv
            head h // (H_q // H_kv)); the cache's dtype; any strides.

        causal : bottom-right aligned per sequence, as ``KVCache.attend``: query
            row i of sequence b is at position positions[b] - q_lens[b] + i and
            sees the keys up to it (chunked prefill, decode). ``causal=False``:
            every stored key is visible. With a window, also only the keys
            from its position - window + 1 on (ValueError if q_lens reaches
            back to released blocks).

        q_lens : int or (B,) ints: valid query rows per sequence (rows beyond get
            zeros and lse = -inf). Default: each sequence's last append length
            when every sequence's last append had q's chunk length L_new (ragged
            batches), else L_new for every sequence.

        scale : default 1/sqrt(d).

        return_lse : also return lse (B, H_q, L_new) in the compute dtype
            (float32 for a 16-bit cache).

        out : optional writeable (B, H_q, L_new, dv) array (or CPU tensor) of the
            cache's dtype, any strides; one that shares memory with q or the pool
            is filled through a temporary.

        Returns (B, H_q, L_new, dv) in the cache's dtype (torch in, torch out;
        bfloat16 NumPy results as ``ml_dtypes.bfloat16`` when importable), or
        (out, lse). Rows that see no key get zeros and lse = -inf. Every chunk
        length runs the split-KV decode kernel, which reads the blocks in place.
        """
        like = q
        ids, seqs = self._resolve(seq_ids)
        B = len(ids)
        fq, key = self._planned(q, scale, q_lens is None and out is None and return_lse is False)
        if fq is not None and fq.shape[0] == B:
            q = fq
        else:
            fq = None
            q = self._check_query(q, B, "seq_ids names")
        Lq = q.shape[2]
        n = np.array([self._stored(s) for s in seqs], dtype=np.int64)
        pos = np.array([s.n for s in seqs], dtype=np.int64)
        ql = None
        if q_lens is None:
            if seqs and all(s.last_L == Lq for s in seqs):
                ql = np.array([s.last_new for s in seqs], dtype=np.int64)
            else:
                ql = np.full(B, Lq, dtype=np.int64)
        sel = (ids, seqs, n)
        if fq is not None and not self._unseen(ql, n, pos, causal):
            return to_input_kind(self._run_planned(q, ql, scale, causal, sel), like)
        return self._attend(q, like, scale, causal, q_lens, return_lse, out, n, pos, ql, sel, key)

    def _released(self, first):
        return f"their blocks before positions {first.tolist()} were released"

    def block_table(self, seq_ids: ArrayLike | int) -> np.ndarray:
        """The (B, max_blocks) int64 block table of the sequences seq_ids (row b: the
        blocks of sequence b in order, zero-padded), as the kernel reads it."""
        return self._table(self._resolve(seq_ids)[1])

    def _table(self, seqs):
        mb = max([s.nblk for s in seqs], default=0)
        tab = np.zeros((len(seqs), max(1, mb)), dtype=np.int64)
        for i, s in enumerate(seqs):
            tab[i, : s.nblk] = s.table[: s.nblk]
        return tab

    def _run(self, q, o, lse, ql, scale, causal, sel):
        # With a window the table starts at the first held block: positions shift by
        # first * bs for every key and query alike, which bottom-right masks ignore.
        _, seqs, n = sel
        wl = -1 if self.window is None else self.window - 1
        mask = MaskArgs(causal=bool(causal), q_lens=ql, kv_lens=n, window_left=wl)
        kernel = _dispatch.choose_kernel(
            Lq=q.shape[2], Lk=int(n.max(initial=0)), mask=mask, keys=_dispatch.KEYS_PAGED
        )
        assert kernel == _dispatch.DECODE
        pages = self.encoding.paged_args(self._kc, self._vc, self._table(seqs), self._aux)
        _dispatch.attend_paged(q, pages, o, lse, scale=scale, mask=mask)


class PagedLayerCaches(LayerStack):
    """One PagedKVCache per layer of a model, with one sequence id space for all layers.

    ``PagedLayerCaches(num_layers, <PagedKVCache args>)``: every layer gets a
    pool built from the same arguments, except ``window``, which may also be
    a list of num_layers entries (an int or None per layer: models that mix
    sliding-window and full-attention layers). ``add_sequence``, ``fork``,
    ``free`` and ``truncate`` apply to every layer, so one id names the same
    sequence in each (``caches[i].append(ids, ...)`` / ``caches[i].attend(ids,
    ...)`` per layer, as a decoder runs them). Indexable (``caches[i]``,
    IndexError out of range), iterable, ``len()`` = num_layers; ``nbytes``
    and ``used_nbytes`` sum all layers; ``positions`` is layer 0's (every
    layer has the same after each step). Changing the sequences of one layer
    directly (``caches[i].add_sequence()``) breaks the shared id space: the
    next ``add_sequence`` / ``fork`` here raises RuntimeError.
    """

    def __init__(self, num_layers: int, *args: Any, window: Any = None, **kwargs: Any) -> None:
        num_layers = check_int(num_layers, "num_layers", 1)
        if isinstance(window, (list, tuple)):
            if len(window) != num_layers:
                raise ValueError(
                    f"window has {len(window)} entries but there are {num_layers} layers"
                )
            windows = list(window)
        else:
            windows = [window] * num_layers
        self._caches = [PagedKVCache(*args, window=w, **kwargs) for w in windows]

    @property
    def used_nbytes(self) -> int:
        return sum(c.used_nbytes for c in self._caches)

    @property
    def seq_ids(self) -> list[int]:
        return self._caches[0].seq_ids

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._caches[0]

    def _same(self, ids):
        if len(set(ids)) != 1:
            raise RuntimeError(
                f"the layers gave the new sequence different ids {ids}: a layer's sequences "
                "were changed directly, not through PagedLayerCaches"
            )
        return ids[0]

    def add_sequence(self) -> int:
        """A new empty sequence in every layer; returns its id."""
        return self._same([c.add_sequence() for c in self._caches])

    def fork(self, seq_id: int) -> int:
        """fork(seq_id) in every layer (copy-on-write sharing); returns the new id."""
        for c in self._caches:  # unknown / freed ids raise before anything changes
            c._seq(seq_id)
        return self._same([c.fork(seq_id) for c in self._caches])

    def free(self, seq_id: int) -> None:
        """free(seq_id) in every layer (ValueError for an unknown or freed id)."""
        for c in self._caches:
            c._seq(seq_id)
        for c in self._caches:
            c.free(seq_id)

    def truncate(self, seq_id: int, n: int) -> None:
        """truncate(seq_id, n) in every layer; checked in every layer first, so on error
        no layer changes."""
        ns = [c._check_truncate(c._seq(seq_id), seq_id, n) for c in self._caches]
        for c, m in zip(self._caches, ns):
            c._cut(c._seq(seq_id), m)
