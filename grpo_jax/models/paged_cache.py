"""The paged decode cache (``SamplingConfig.decode_cache="paged"``): keys and values in pages,
each group's prompt stored once, each row attending to its filled slots only."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

DEFAULT_PAGE_SIZE = 16


@flax.struct.dataclass
class PagedDecodeCache:
    """The decode cache in pages of ``page_size`` slots (the sampler's ``decode_cache="paged"``).

    Sequence layout: row r (of group g = r // G, G = R / P) holds its prompt's n_g real tokens
    LEFT-aligned (no padding slot), then its completion. Per layer, k / v are
    [KVH, P, fp + G * own, page_size, D]: group g's pages are its fp = Lp // page_size shared
    pages (the prompt's first n_g // page_size full pages, stored once for the G rows) followed
    by each of its rows' ``own`` pages (the prompt's partial last page, n_g % page_size tokens
    copied per row, then the row's completion tokens). `attention.paged_table` lists a row's
    pages in sequence order; both kernels read the shared pages once per group, then each
    row's own pages. Row-major over groups, so the pages shard with the rows.

    prefix_len [P] int32: n_g. index [] int32: completion slots written (the static sampler's
    rows are all at the same step). shared_pages (static): fp. Every token fed is written as a
    real key; the Pallas kernel reads nothing for a finished row (the XLA path attends its
    tail as the dense cache does); its outputs are masked either way.
    """

    k: tuple
    v: tuple
    prefix_len: jax.Array
    index: jax.Array
    shared_pages: int = flax.struct.field(pytree_node=False, default=0)
    group_size: int = flax.struct.field(pytree_node=False, default=1)
    prompt_slots: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def page_size(self) -> int:
        """Slots per page."""
        return self.k[0].shape[3]

    @property
    def own_pages(self) -> int:
        """Pages each row holds for itself."""
        return (self.k[0].shape[2] - self.shared_pages) // self.group_size

    def own_len(self):
        """[R] int32: filled slots of each row's own pages once this step's token is written,
        n_g % page_size + index + 1."""
        return jnp.repeat(self.prefix_len % self.page_size, self.group_size) + self.index + 1

    @staticmethod
    def prefill_slots(prompt_len: int, slots: int) -> int:
        """Slots of the prefill's cache: the prompt's only (the pages are made from it)."""
        del slots
        return prompt_len

    @staticmethod
    def own_pages_for(prompt_len: int, slots: int, page_size: int) -> int:
        """Own pages a row needs to attend to ``slots`` slots in all (prompt budget
        ``prompt_len`` + completion): its prompt's partial page (< page_size tokens) and
        slots - prompt_len completion slots, ceil((page_size - 1 + slots - prompt_len) /
        page_size)."""
        return -(-(page_size - 1 + slots - prompt_len) // page_size)

    @classmethod
    def from_prefill(
        cls, prompt_cache, rows: int, slots: int, page_size: int = DEFAULT_PAGE_SIZE
    ) -> PagedDecodeCache:
        """The paged cache of ``rows`` rows attending to at most ``slots`` slots (prompt budget
        Lp + completion) from the prefill's `DecodeCache` of one row per group (P rows, Lp
        slots, left-padded): each group's prompt keys/values left-aligned, its full pages kept
        once, its partial last page copied to the first own page of each of its G rows
        (`own_pages_for` own pages per row). Raises ValueError: slots < Lp, page_size < 1."""
        P, Lp = prompt_cache.key_mask.shape
        if slots < Lp or page_size < 1:
            raise ValueError(
                f"PagedDecodeCache: {slots} slots < the prompt's {Lp}, or page_size {page_size} < 1"
            )
        G, ps, fp = rows // P, page_size, Lp // page_size
        own = cls.own_pages_for(Lp, slots, ps)
        n = jnp.sum(prompt_cache.key_mask, axis=-1).astype(jnp.int32)  # [P]
        j = jnp.arange(Lp)
        src = jnp.clip(j[None] + (Lp - n)[:, None], 0, Lp - 1)  # left-aligned slot j <- src
        tail = (n // ps * ps)[:, None] + jnp.arange(ps)[None]  # [P, ps] the partial page

        def pages(x):  # [P, K, Lp, D] left-padded -> [K, P, fp + G * own, ps, D]
            K, D = x.shape[1], x.shape[3]
            al = jnp.take_along_axis(x, src[:, None, :, None], axis=2)
            al = jnp.where((j[None] < n[:, None])[:, None, :, None], al, 0)
            shared = al[:, :, : fp * ps].reshape(P, K, fp, ps, D)
            part = jnp.take_along_axis(al, jnp.minimum(tail, Lp - 1)[:, None, :, None], axis=2)
            part = jnp.where((tail < n[:, None])[:, None, :, None], part, 0)  # [P, K, ps, D]
            mine = jnp.zeros((P, K, G, own, ps, D), x.dtype).at[:, :, :, 0].set(part[:, :, None])
            mine = mine.reshape(P, K, G * own, ps, D)
            return jnp.concatenate([shared, mine], axis=2).transpose(1, 0, 2, 3, 4)

        return cls(
            k=tuple(map(pages, prompt_cache.k)),
            v=tuple(map(pages, prompt_cache.v)),
            prefix_len=n,
            index=jnp.zeros((), jnp.int32),
            shared_pages=fp,
            group_size=G,
            prompt_slots=Lp,
        )

    def grow(self, slots: int) -> PagedDecodeCache:
        """The cache with own pages for ``slots`` slots in all (prompt budget Lp + completion):
        each row's own pages followed by empty ones (one copy of the pages; none when it holds
        enough). Raises ValueError when that is fewer than it holds."""
        own, want = self.own_pages, self.own_pages_for(self.prompt_slots, slots, self.page_size)
        if want < own:
            raise ValueError(f"PagedDecodeCache.grow: {want} own pages < the {own} it holds")
        if want == own:
            return self
        fp, G = self.shared_pages, self.group_size

        def pad(x):  # [K, P, fp + G * own, ps, D] -> [K, P, fp + G * want, ps, D]
            K, P, _, ps, D = x.shape
            mine = x[:, :, fp:].reshape(K, P, G, own, ps, D)
            mine = jnp.pad(mine, ((0, 0), (0, 0), (0, 0), (0, want - own), (0, 0), (0, 0)))
            return jnp.concatenate([x[:, :, :fp], mine.reshape(K, P, G * want, ps, D)], axis=2)

        return self.replace(k=tuple(map(pad, self.k)), v=tuple(map(pad, self.v)))

    def put(self, buf, new):
        """``buf`` (one layer's pages) with each row's token ``new`` [R, 1, KVH, D] written at
        its own slot n_g % page_size + index (a scatter of R entries)."""
        G, ps, own = self.group_size, self.page_size, self.own_pages
        r = jnp.arange(new.shape[0])
        slot = self.own_len() - 1
        page = self.shared_pages + (r % G) * own + slot // ps
        return buf.at[:, r // G, page, slot % ps].set(
            jnp.swapaxes(new[:, 0], 0, 1).astype(buf.dtype)
        )
