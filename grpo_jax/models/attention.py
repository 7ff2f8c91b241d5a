"""Attention cores of the decoder: the einsum reference, a blockwise (online-softmax) XLA
kernel with its own VJP, and the fused kernels of TPU (Pallas splash attention) and GPU (cuDNN).

All of them compute, per query head h of kv head group k = h // G (grouped-query attention,
Ainslie et al. 2023, H = K * G heads sharing K key/value heads),

    O[b, t, h] = sum_s softmax_s(S[b, h, t, :])[s] V[b, s, k],
    S[b, h, t, s] = q[b, t, h] . k[b, s, k] / sqrt(D)  where the mask allows (t, s),

with float32 scores and softmax (Vaswani et al. 2017, eq. 1). They differ in what they
materialise: ``einsum_attention`` (the model's original path, ``model.attention_impl =
"einsum"``) builds the whole float32 score tensor [B, K, G, T, S] (at Qwen3-8B with 5,120-token
rows: 3.1 GiB per row and layer); the others never hold more than one [block_q, block_k] tile
of scores per head.

Masks. The model's masks are key padding AND causal: ``Mask(key_mask, offset, q_start)`` says
query t may attend key s iff ``key_mask[b, s]`` and (when causal) ``s <= t + offset +
q_start``. ``offset`` is static (0: self-attention; Lp: completion queries over [prompt keys,
completion keys]; None: no causal constraint), ``q_start`` a traced scalar (a KV cache's write
index; None = 0). The fused TPU/GPU kernels take the static form only; ``attend`` runs the
blockwise kernel for a traced ``q_start``.

Fully masked query rows (left-padding positions, which no real token reads): the einsum path
gives a uniform softmax over all keys (scores _NEG_INF = -1e30 everywhere); the blockwise
kernel gives output 0 and log-sum-exp _NEG_INF, the splash kernel a uniform average over the
keys of the tiles it visits. All finite, none NaN, and their gradients are zero (no real
token's loss reaches such a row). Rows with at least one visible key agree across
implementations up to float rounding.

``model.attention_impl`` (``ModelConfig``): "einsum" | "blockwise" | "splash" (TPU) | "cudnn"
(GPU, bfloat16/float16) | "auto" (``resolve_impl``: TPU -> splash, GPU -> cudnn for 16-bit
activations else blockwise, CPU -> ``CPU_DEFAULT``, see its comment).
"""

from __future__ import annotations

import functools
import math

import flax
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from grpo_jax.models.config import ATTENTION_IMPLS as IMPLS

_NEG_INF = -1e30  # finite "minus infinity" (as the einsum path's masked scores)

# The CPU's "auto". Blockwise is as fast or faster on XLA:CPU (benchmarks/bench_attention_impl.py;
# numbers in docs/architecture.md), but the committed studies ran with einsum and a switch would
# change their reruns' trajectories.
CPU_DEFAULT = "einsum"
BLOCK_Q = 512  # blockwise kernel's default tile sizes (queries, keys)
BLOCK_K = 512


def resolve_impl(impl: str, dtype="float32", platform: str | None = None) -> str:
    """The concrete attention implementation of ``impl`` (see the module doc).

    Args:
      impl: one of ``IMPLS``; "auto" is resolved by ``platform``.
      dtype: the activation dtype (cuDNN's flash attention takes 16-bit inputs only).
      platform: "cpu" | "gpu" | "cuda" | "rocm" | "tpu"; None = ``jax.default_backend()``.
    Returns:
      "einsum" | "blockwise" | "splash" | "cudnn".
    Raises:
      ValueError: an unknown ``impl``.
    """
    if impl not in IMPLS:
        raise ValueError(f"model.attention_impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    platform = platform or jax.default_backend()
    if platform == "tpu":
        return "splash"
    if platform in ("gpu", "cuda"):
        return "cudnn" if jnp.dtype(dtype).itemsize == 2 else "blockwise"
    if platform == "cpu":
        return CPU_DEFAULT
    return "blockwise"


@flax.struct.dataclass
class Mask:
    """Key padding + (optionally) causal attention mask, without the [T, S] array.

    key_mask [B, S] bool: True on keys that may be attended (real tokens).
    offset (static int or None): causal with query t seeing keys s <= t + offset (+ q_start);
      None = no causal constraint (every unpadded key).
    q_start [] int32 or None: a traced extra offset (a KV cache's write index); None = 0.
    segment_ids [B, S] int32 or None: packed rows (`grpo_jax.packing`): query t sees key s
      only when both carry the same id (queries and keys are the same S slots, so T == S).
    """

    key_mask: jax.Array
    q_start: jax.Array | None = None
    offset: int | None = flax.struct.field(pytree_node=False, default=0)
    segment_ids: jax.Array | None = None

    @property
    def static(self) -> bool:
        """Whether the causal offset is known at trace time (what the fused kernels need)."""
        return self.q_start is None

    def dense(self, T: int) -> jax.Array:
        """The mask as the einsum path takes it: [B, T, S] bool."""
        m = self.key_mask[:, None, :]
        if self.segment_ids is not None:
            if self.segment_ids.shape[1] != T:
                raise ValueError(f"segment ids need T == S; got T={T}, S={m.shape[2]}")
            m = m & (self.segment_ids[:, :, None] == self.segment_ids[:, None, :])
        if self.offset is None:
            return jnp.broadcast_to(m, (m.shape[0], T, m.shape[2]))
        S = self.key_mask.shape[1]
        q = jnp.arange(T) + self.offset
        if self.q_start is not None:
            q = q + self.q_start
        return m & (jnp.arange(S)[None, None, :] <= q[None, :, None])


# ----------------------------------------------------------------------------- einsum


def einsum_attention(q, keys, values, mask, kv_layout="bskd"):
    """The reference: grouped einsums over the whole [T, S] score matrix.

    q [B, T, H, D]; keys/values [B, S, KVH, D] ("bskd") or [B, KVH, S, D] ("bksd"); mask
    [B, T, S] bool. Returns [B, T, H, D] in q.dtype. Scores and softmax in float32; masked
    scores are _NEG_INF, so a fully masked row gets a uniform softmax.
    """
    dt = q.dtype
    B, T, H, D = q.shape
    K = keys.shape[2] if kv_layout == "bskd" else keys.shape[1]
    qg = q.reshape(B, T, K, H // K, D)
    scores = jnp.einsum(
        f"btkgd,{kv_layout}->bkgts", qg, keys.astype(dt), preferred_element_type=jnp.float32
    ) * (D**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum(f"bkgts,{kv_layout}->btkgd", probs, values.astype(dt))
    return out.reshape(B, T, H, D)


# ----------------------------------------------------------------------------- blockwise


def _tile(n: int, block: int, multiple: int = 8) -> tuple[int, int]:
    """(tile, padded length) for n rows in about ceil(n / block) equal tiles: the tile is
    ceil(n / tiles) rounded up to ``multiple`` (n itself when one tile suffices)."""
    if n <= block:
        return n, n
    cdiv = lambda a, b: -(-a // b)
    t = cdiv(cdiv(n, cdiv(n, block)), multiple) * multiple
    return t, cdiv(n, t) * t


def _visible(i, j, bq, bk, key_mask_j, q_start, offset, seg_i=None, seg_j=None):
    """The tile's mask [B, 1, 1, bq, bk] bool: key padding of key tile j AND causal (AND, with
    segment ids of query tile i / key tile j [B, bq] / [B, bk], the same segment)."""
    vis = key_mask_j[:, None, None, None, :]
    if seg_i is not None:
        vis = vis & (seg_i[:, None, None, :, None] == seg_j[:, None, None, None, :])
    if offset is None:
        return vis
    tq = i * bq + jnp.arange(bq) + offset + q_start
    sk = j * bk + jnp.arange(bk)
    return vis & (sk[None, :] <= tq[:, None])[None, None, None]


def _needed(i, j, bq, bk, any_key_j, q_start, offset):
    """Whether tile (i, j) has a visible entry for some row: key tile j holds a real key of
    some row and (causal) its first key is not after query tile i's last query."""
    if offset is None:
        return any_key_j
    return any_key_j & (j * bk <= i * bq + bq - 1 + offset + q_start)


def _scan(f, init, xs):
    """``lax.scan(f, init, xs)``, or ``f`` called once when xs has one entry (one tile: no
    loop in the program at all)."""
    if jax.tree.leaves(xs)[0].shape[0] != 1:
        return jax.lax.scan(f, init, xs)
    carry, y = f(init, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda x: x[None], y)


def _skip_unless(need, update, carry, tiles: int):
    """``update(carry)`` where ``need`` else ``carry`` (``lax.cond``); unconditional for a
    single tile, which always holds a visible entry unless every key is padding."""
    if tiles == 1:
        return update(carry)
    return jax.lax.cond(need, update, lambda c: c, carry)


def _flash_forward(q, k, v, key_mask, q_start, segs, offset, bq, bk, scale):
    """Online-softmax forward over tiles (Dao et al. 2022, "FlashAttention", Algorithm 1;
    Rabe & Staats 2021, sec. 3; the tile order of FlashAttention-2, Dao 2023, Algorithm 1:
    query tiles outside, key tiles inside).

    q [B, K, G, Tp, D], k, v [B, K, Sp, D], key_mask [B, Sp] bool, q_start [] int32; Tp = nq * bq,
    Sp = nk * bk; scores S = scale * q k^T in float32. For each query tile the running row max m,
    denominator l and un-normalised output acc (float32) are updated per key tile j:
      m' = max(m, rowmax S_j),  l' = e^(m - m') l + rowsum e^(S_j - m'),
      acc' = e^(m - m') acc + e^(S_j - m') V_j
    (masked entries excluded), and O = acc / l, lse = m + log l (FlashAttention-2, eq. 2 and
    sec. 3.1.1). Rows with no visible key: O = 0, lse = _NEG_INF. Tiles without a visible
    entry (causal upper triangle, all-padding key tiles) are skipped (``lax.cond``). ``segs``:
    None, or (query segment ids [B, Tp], key segment ids [B, Sp]) int32 (packed rows: a query
    sees only keys of its segment).
    Returns O [B, K, G, Tp, D] (q.dtype), lse [B, K, G, Tp] float32.
    """
    # One barrier over all inputs: inside a scan over layers being differentiated, JAX's scan
    # partial evaluation moves the loop-invariant part of the body (here: everything derived
    # from the keys / mask alone, e.g. each tile's mask) out of the loop, stacking it over all
    # tiles: [nq, nk, B, K, G, bq, bk], the T x S array this kernel exists to avoid (measured:
    # 0.9 GiB at 2 x 2048 tokens). Tied to q by the barrier, nothing is loop-invariant.
    q, k, v, key_mask, q_start, segs = jax.lax.optimization_barrier(
        (q, k, v, key_mask, q_start, segs)
    )
    B, K, G, Tp, D = q.shape
    Sp = k.shape[2]
    nq, nk = Tp // bq, Sp // bk
    dt = q.dtype
    qb = jnp.moveaxis(q.reshape(B, K, G, nq, bq, D), 3, 0)
    kb = jnp.moveaxis(k.reshape(B, K, nk, bk, D), 2, 0)
    vb = jnp.moveaxis(v.reshape(B, K, nk, bk, D), 2, 0)
    mb = jnp.moveaxis(key_mask.reshape(B, nk, bk), 1, 0)
    any_key = mb.any(axis=(1, 2))  # [nk]
    qsb, ksb = _segment_tiles(segs, B, nq, bq, nk, bk)

    def q_tile(_, xs):
        qi, qsi, i = xs

        def k_tile(carry, ys):
            kj, vj, mj, ksj, j = ys

            def update(carry):
                m, l, acc = carry
                s = jnp.einsum("bkgtd,bksd->bkgts", qi, kj, preferred_element_type=jnp.float32)
                s = s * scale
                vis = _visible(i, j, bq, bk, mj, q_start, offset, qsi, ksj)
                m_new = jnp.maximum(m, jnp.where(vis, s, _NEG_INF).max(axis=-1))
                p = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
                alpha = jnp.exp(m - m_new)
                pv = jnp.einsum(
                    "bkgts,bksd->bkgtd", p.astype(dt), vj, preferred_element_type=jnp.float32
                )
                return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv

            need = _needed(i, j, bq, bk, any_key[j], q_start, offset)
            return _skip_unless(need, update, carry, nq * nk), None

        init = (
            jnp.full((B, K, G, bq), _NEG_INF, jnp.float32),
            jnp.zeros((B, K, G, bq), jnp.float32),
            jnp.zeros((B, K, G, bq, D), jnp.float32),
        )
        (m, l, acc), _ = _scan(k_tile, init, (kb, vb, mb, ksb, jnp.arange(nk)))
        seen = l > 0
        l1 = jnp.where(seen, l, 1.0)
        o = jnp.where(seen[..., None], acc / l1[..., None], 0.0).astype(dt)
        return None, (o, jnp.where(seen, m + jnp.log(l1), _NEG_INF))

    _, (o, lse) = _scan(q_tile, None, (qb, qsb, jnp.arange(nq)))
    o = jnp.moveaxis(o, 0, 3).reshape(B, K, G, Tp, D)
    return o, jnp.moveaxis(lse, 0, 3).reshape(B, K, G, Tp)


def _segment_tiles(segs, B, nq, bq, nk, bk):
    """Per-tile segment ids ([nq, B, bq], [nk, B, bk]) of ``segs``, or (None, None)."""
    if segs is None:
        return None, None
    q_seg, k_seg = segs
    return (
        jnp.moveaxis(q_seg.reshape(B, nq, bq), 1, 0),
        jnp.moveaxis(k_seg.reshape(B, nk, bk), 1, 0),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _flash(q, k, v, key_mask, q_start, segs, offset, bq, bk, scale):
    """(O, lse) of `_flash_forward`, differentiable in q, k, v (and through lse)."""
    return _flash_forward(q, k, v, key_mask, q_start, segs, offset, bq, bk, scale)


def _flash_fwd(q, k, v, key_mask, q_start, segs, offset, bq, bk, scale):
    o, lse = _flash_forward(q, k, v, key_mask, q_start, segs, offset, bq, bk, scale)
    return (o, lse), (q, k, v, key_mask, q_start, segs, o, lse)


def _flash_bwd(offset, bq, bk, scale, res, cts):
    """Backward pass recomputing the score tiles from q, k and lse (FlashAttention-2, Dao 2023,
    Algorithm 2; key tiles outside, query tiles inside), nothing [T, S] stored:
      P_ij = e^(S_ij - lse_i) (masked: 0),  dV_j += P_ij^T dO_i,  dP_ij = dO_i V_j^T,
      dS_ij = P_ij * (dP_ij - D_i + dlse_i),  dQ_i += dS_ij K_j,  dK_j += dS_ij^T Q_i,
    with D_i = rowsum(dO_i * O_i) (FlashAttention-2 sec. 3.1.2) and dlse the cotangent of the
    log-sum-exp output (d lse_i / d S_ij = P_ij), zero unless lse is used (the shared-prefix
    merge); dQ and dK carry the score scale (S = scale * Q K^T). float32 accumulators; P and
    dS enter the matmuls in the input dtype.
    """
    q, k, v, key_mask, q_start, segs, o, lse = res
    do, dlse = cts
    # as in `_flash_forward`: nothing loop-invariant for an enclosing scan to hoist and stack
    q, k, v, key_mask, q_start, segs, o, lse, do, dlse = jax.lax.optimization_barrier(
        (q, k, v, key_mask, q_start, segs, o, lse, do, dlse)
    )
    B, K, G, Tp, D = q.shape
    Sp = k.shape[2]
    nq, nk = Tp // bq, Sp // bk
    dt = q.dtype
    delta = (do.astype(jnp.float32) * o.astype(jnp.float32)).sum(-1) - dlse  # D_i - dlse_i

    def q_tiles(x, tail):  # [B, K, G, Tp, *tail] -> [nq, B, K, G, bq, *tail]
        return jnp.moveaxis(x.reshape(B, K, G, nq, bq, *tail), 3, 0)

    qb, dob, lseb, deltab = (
        q_tiles(q, (D,)),
        q_tiles(do.astype(dt), (D,)),
        q_tiles(lse, ()),
        q_tiles(delta, ()),
    )
    kb = jnp.moveaxis(k.reshape(B, K, nk, bk, D), 2, 0)
    vb = jnp.moveaxis(v.reshape(B, K, nk, bk, D), 2, 0)
    mb = jnp.moveaxis(key_mask.reshape(B, nk, bk), 1, 0)
    any_key = mb.any(axis=(1, 2))
    qsb, ksb = _segment_tiles(segs, B, nq, bq, nk, bk)

    def k_tile(dq, ys):
        kj, vj, mj, ksj, j = ys

        def q_tile(carry, xs):
            qi, doi, lsei, deltai, dqi, qsi, i = xs

            def update(args):
                dk, dv, dqi = args
                s = jnp.einsum("bkgtd,bksd->bkgts", qi, kj, preferred_element_type=jnp.float32)
                s = s * scale
                vis = _visible(i, j, bq, bk, mj, q_start, offset, qsi, ksj)
                p = jnp.where(vis, jnp.exp(s - lsei[..., None]), 0.0)
                dv = dv + jnp.einsum(
                    "bkgts,bkgtd->bksd", p.astype(dt), doi, preferred_element_type=jnp.float32
                )
                dp = jnp.einsum("bkgtd,bksd->bkgts", doi, vj, preferred_element_type=jnp.float32)
                ds = (p * (dp - deltai[..., None]) * scale).astype(dt)
                dqi = dqi + jnp.einsum(
                    "bkgts,bksd->bkgtd", ds, kj, preferred_element_type=jnp.float32
                )
                dk = dk + jnp.einsum(
                    "bkgts,bkgtd->bksd", ds, qi, preferred_element_type=jnp.float32
                )
                return dk, dv, dqi

            need = _needed(i, j, bq, bk, any_key[j], q_start, offset)
            dk, dv, dqi = _skip_unless(need, update, (*carry, dqi), nq * nk)
            return (dk, dv), dqi

        zeros = jnp.zeros((B, K, bk, D), jnp.float32)
        xs = (qb, dob, lseb, deltab, dq, qsb, jnp.arange(nq))
        (dk, dv), dq = _scan(q_tile, (zeros, zeros), xs)
        return dq, (dk, dv)

    dq0 = jnp.zeros((nq, B, K, G, bq, D), jnp.float32)
    dq, (dk, dv) = _scan(k_tile, dq0, (kb, vb, mb, ksb, jnp.arange(nk)))
    dq = jnp.moveaxis(dq, 0, 3).reshape(B, K, G, Tp, D).astype(dt)
    dk = jnp.moveaxis(dk, 0, 2).reshape(B, K, Sp, D).astype(k.dtype)
    dv = jnp.moveaxis(dv, 0, 2).reshape(B, K, Sp, D).astype(v.dtype)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(
    q,
    keys,
    values,
    mask: Mask,
    kv_layout: str = "bskd",
    *,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    return_lse: bool = False,
):
    """Memory-efficient attention in plain XLA: `_flash` (online softmax over tiles, custom VJP
    recomputing the tiles in the backward pass; never a [T, S] score array).

    Args:
      q [B, T, H, D]; keys/values [B, S, KVH, D] ("bskd") or [B, KVH, S, D] ("bksd"), any
        float dtype (computed in q.dtype with float32 scores, softmax and accumulators); mask:
        a `Mask` with key_mask [B, S]. Lengths that are not multiples of the tile are padded
        inside (padded keys masked, padded queries dropped).
      block_q, block_k: tile sizes (T and S are cut into about ceil(T / block_q) equal tiles).
      return_lse: also return the log-sum-exp of each row's scores.
    Returns:
      O [B, T, H, D] in q.dtype, and with return_lse lse [B, T, H] float32 (_NEG_INF on rows
      with no visible key, whose O is 0).
    """
    if kv_layout == "bskd":
        keys, values = jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2)
    q_start = jnp.asarray(0 if mask.q_start is None else mask.q_start, jnp.int32)
    local = functools.partial(
        _blockwise_local, offset=mask.offset, block_q=block_q, block_k=block_k
    )
    kv = ("rows", "heads", None, None)
    out_axes = (_Q_AXES, ("rows", None, "heads"))
    if mask.segment_ids is None:
        fn = _sharded(local, (_Q_AXES, kv, kv, ("rows", None), ()), out_axes)
        o, lse = fn(q, keys, values, mask.key_mask, q_start)
    else:
        fn = _sharded(local, (_Q_AXES, kv, kv, ("rows", None), (), ("rows", None)), out_axes)
        o, lse = fn(q, keys, values, mask.key_mask, q_start, mask.segment_ids)
    return (o, lse) if return_lse else o


_Q_AXES = ("rows", None, "heads", None)  # [B, T, H, D]


def _blockwise_local(
    q, keys, values, key_mask, q_start, segment_ids=None, *, offset, block_q, block_k
):
    """`blockwise_attention` on one device's rows / heads: q [B, T, H, D], keys/values
    [B, KVH, S, D], key_mask [B, S], q_start [], segment_ids [B, S] or None (T == S) ->
    (O [B, T, H, D], lse [B, T, H])."""
    dt = q.dtype
    B, T, H, D = q.shape
    K, S = keys.shape[1], keys.shape[2]
    G = H // K
    bq, Tp = _tile(T, block_q)
    bk, Sp = _tile(S, block_k)
    qg = q.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, Tp - T), (0, 0)))
    pad_s = ((0, 0), (0, 0), (0, Sp - S), (0, 0))
    keys, values = jnp.pad(keys.astype(dt), pad_s), jnp.pad(values.astype(dt), pad_s)
    key_mask = jnp.pad(key_mask.astype(bool), ((0, 0), (0, Sp - S)))
    segs = None
    if segment_ids is not None:  # padded queries / keys: segment 0, keys masked anyway
        seg = segment_ids.astype(jnp.int32)
        segs = (jnp.pad(seg, ((0, 0), (0, Tp - T))), jnp.pad(seg, ((0, 0), (0, Sp - S))))
    o, lse = _flash(qg, keys, values, key_mask, q_start, segs, offset, bq, bk, D**-0.5)
    o = o[:, :, :, :T].transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)
    return o, lse[:, :, :, :T].transpose(0, 3, 1, 2).reshape(B, T, H)


def merge_partial(o1, lse1, o2, lse2):
    """Attention over the union of two disjoint key sets from the two partial results:
    lse = logaddexp(lse1, lse2), O = e^(lse1 - lse) O1 + e^(lse2 - lse) O2 (the softmax
    rescaling of Milakov & Gimelshein 2018, eq. 3, as FlashAttention-2 merges key tiles).
    o* [..., D] (any float dtype), lse* [...] float32. Returns O [..., D] in o1.dtype; rows
    with no visible key in either part stay 0."""
    lse = jnp.logaddexp(lse1, lse2)
    w1, w2 = jnp.exp(lse1 - lse)[..., None], jnp.exp(lse2 - lse)[..., None]
    return (w1 * o1.astype(jnp.float32) + w2 * o2.astype(jnp.float32)).astype(o1.dtype)


def decode_attention_prefix(q, kp, vp, prefix_bias, kc, vc, comp_bias):
    """One decode token per row over its group's shared prompt block and its own completion
    cache (`transformer.PrefixDecodeCache`), the prompt keys and values read once per group.

    q [R, 1, H, D] (row r continues prompt r // G, R = P * G); kp, vp [P, KVH, Lp, D] the
    prompt block; prefix_bias [P, Lp] float32 (0 on real prompt keys, _NEG_INF on padding);
    kc, vc [R, KVH, C, D] the completion cache; comp_bias [R or 1, C] float32 (0 on the
    filled slots, _NEG_INF after). Returns [R, 1, H, D] in q.dtype.

    The softmax runs over the concatenated float32 scores [prompt slots, completion slots], as
    the dense decode's over its one [Lp + C] buffer (same scores and probabilities); the output
    is the sum of two products (prompt and completion values) instead of one, so it equals the
    dense decode up to float rounding. The group's G rows' queries meet the prompt keys in one
    product ("pnkgd,pksd": P x Lp keys read, not R x Lp).
    """
    dt = q.dtype
    R, _, H, D = q.shape
    P, K, Lp, _ = kp.shape
    G, Hg = R // P, H // K
    scale = D**-0.5
    qg = q.reshape(P, G, K, Hg, D)
    s_p = jnp.einsum("pnkgd,pksd->pnkgs", qg, kp.astype(dt), preferred_element_type=jnp.float32)
    s_p = s_p * scale + prefix_bias[:, None, None, None, :]
    s_c = jnp.einsum(
        "bkgd,bksd->bkgs", q.reshape(R, K, Hg, D), kc.astype(dt), preferred_element_type=jnp.float32
    )
    s_c = s_c * scale + comp_bias[:, None, None, :]
    probs = jax.nn.softmax(jnp.concatenate([s_p.reshape(R, K, Hg, Lp), s_c], axis=-1), axis=-1)
    probs = probs.astype(dt)
    f32 = jnp.float32  # both partial products accumulated and summed in float32, rounded once
    out_p = jnp.einsum(
        "pnkgs,pksd->pnkgd",
        probs[..., :Lp].reshape(P, G, K, Hg, Lp),
        vp.astype(dt),
        preferred_element_type=f32,
    )
    out_c = jnp.einsum(
        "bkgs,bksd->bkgd", probs[..., Lp:], vc.astype(dt), preferred_element_type=f32
    )
    return (out_p.reshape(R, K, Hg, D) + out_c).astype(dt).reshape(R, 1, H, D)


# ----------------------------------------------------------------------------- paged decode

# The paged decode's kernel (`paged_cache.PagedDecodeCache`) for each resolved
# ``model.attention_impl``: the Pallas TPU kernel where the model runs the TPU's fused kernel
# ("splash"), the XLA path everywhere else (CPU; GPU, where JAX's Pallas GPU paged kernel is
# not wired in).
PAGED_KERNEL_OF_IMPL = {"splash": "pallas_tpu"}
PAGED_DECODE_KERNELS: dict = {}


def register_paged_kernel(name: str):
    """Decorator: registers a paged decode kernel under ``name`` (`PAGED_DECODE_KERNELS`)."""

    def deco(fn):
        PAGED_DECODE_KERNELS[name] = fn
        return fn

    return deco


def paged_kernel(impl: str) -> str:
    """The paged decode kernel of a resolved attention implementation ("splash" ->
    "pallas_tpu", any other -> "xla")."""
    return PAGED_KERNEL_OF_IMPL.get(impl, "xla")


def paged_table(prefix_len, rows: int, shared_pages: int, pages_per_group: int, page_size: int):
    """Row r's pages in sequence order in a `PagedDecodeCache` (its docstring has the layout).

    prefix_len [P] int32: real prompt tokens of each group; rows R = P * G; shared_pages fp;
    pages_per_group = fp + G * own. Returns table [R, fp + own] int32, indices into the
    flattened [P * pages_per_group] page axis: the group's first prefix_len // page_size
    (full) shared pages, then the row's own pages (the prompt's partial last page, copied, and
    its completion). Entries past a row's pages repeat its last own page (never read).
    """
    P = prefix_len.shape[0]
    G = rows // P
    own = (pages_per_group - shared_pages) // G
    r = jnp.arange(rows, dtype=jnp.int32)[:, None]
    full = (jnp.repeat(prefix_len, G) // page_size)[:, None]  # [R, 1] shared pages used
    j = jnp.arange(shared_pages + own, dtype=jnp.int32)[None]
    mine = shared_pages + (r % G) * own + jnp.minimum(j - full, own - 1)
    return ((r // G) * pages_per_group + jnp.where(j < full, j, mine)).astype(jnp.int32)


@register_paged_kernel("xla")
def paged_decode_xla(q, k_pages, v_pages, prefix_len, own_len, shared_pages: int, live=None):
    """One decode token per row over a `PagedDecodeCache` layer in plain XLA: the group's
    shared pages read once for its G rows (one product per group, as
    `decode_attention_prefix`) and each row's own pages, both under a length mask.

    q [R, 1, H, D]; k_pages, v_pages [K, P, fp + G * own, page_size, D]; prefix_len [P] int32
    (real prompt tokens per group); own_len [R] int32: filled slots of each row's own pages
    (the prompt's last partial page + the completion so far, this step's token included);
    shared_pages fp (static). Row r attends to its group's first prefix_len // page_size full
    pages and its own first own_len slots. live [R] bool: ignored (every row is computed; the
    Pallas kernel skips rows not live). Returns [R, 1, H, D] in q.dtype; float32 scores,
    softmax over the concatenated [shared, own] scores, the two value products accumulated in
    float32 and rounded once (equal to the dense decode up to float rounding).
    """
    del live
    dt = q.dtype
    R, _, H, D = q.shape
    K, P, ppg, ps, _ = k_pages.shape
    G, Hg, fp = R // P, H // K, shared_pages
    own = (ppg - fp) // G
    f32 = jnp.float32
    qg = q.reshape(P, G, K, Hg, D)
    ks, vs = (x[:, :, :fp].reshape(K, P, fp * ps, D).astype(dt) for x in (k_pages, v_pages))
    ko, vo = (x[:, :, fp:].reshape(K, P, G, own * ps, D).astype(dt) for x in (k_pages, v_pages))
    shared_ok = jnp.arange(fp * ps)[None] < ((prefix_len // ps) * ps)[:, None]  # [P, fp*ps]
    own_ok = jnp.arange(own * ps)[None] < own_len[:, None]  # [R, own*ps]
    s_s = jnp.einsum("pnkgd,kpsd->pnkgs", qg, ks, preferred_element_type=f32) * D**-0.5
    s_s = jnp.where(shared_ok[:, None, None, None], s_s, _NEG_INF)
    s_o = jnp.einsum("pnkgd,kpnsd->pnkgs", qg, ko, preferred_element_type=f32) * D**-0.5
    s_o = jnp.where(own_ok.reshape(P, G, 1, 1, own * ps), s_o, _NEG_INF)
    probs = jax.nn.softmax(jnp.concatenate([s_s, s_o], axis=-1), axis=-1).astype(dt)
    out = jnp.einsum("pnkgs,kpsd->pnkgd", probs[..., : fp * ps], vs, preferred_element_type=f32)
    out = out + jnp.einsum(
        "pnkgs,kpnsd->pnkgd", probs[..., fp * ps :], vo, preferred_element_type=f32
    )
    return out.astype(dt).reshape(R, 1, H, D)


# keys per compute block of the Pallas paged kernel: a sequence's reads are its filled slots
# rounded up to a block (`sampling.decode_read_bytes` counts the rounding)
PAGED_COMPUTE_TOKENS = 128


def paged_block_pages(page_size: int, tokens: int = PAGED_COMPUTE_TOKENS) -> int:
    """Pages per compute block of the Pallas paged kernel: as many as hold at most ``tokens``
    keys (>= 1). Its page tables are padded to a multiple of it (`_padded_table`), so every
    block is this size whatever the pages a sequence holds."""
    return max(1, tokens // page_size)


def _padded_table(first, pages: int, block: int):
    """[S, ceil(pages / block) * block] int32 page indices: sequence s's ``pages`` pages
    first[s] .. first[s] + pages - 1, then its last page repeated (a block past a sequence's
    length is never read; one that starts inside it reads the repeats: the rounding)."""
    width = -(-pages // block) * block
    return (first[:, None] + jnp.minimum(jnp.arange(width, dtype=jnp.int32), pages - 1)).astype(
        jnp.int32
    )


def _pallas_paged_lse(q, k_pages, v_pages, lengths, table, interpret: bool = False):
    """JAX's Pallas TPU paged-attention kernel (``jax.experimental.pallas.ops.tpu.
    paged_attention``'s ``paged_flash_attention_kernel_inline_seq_dim``, single core) launched
    to return its softmax statistics too, which its own wrapper drops.

    q [B, Hq, D] (scaled; the kernel applies no scale), k_pages / v_pages [K, pages, page_size,
    D], lengths [B] int32 (keys of sequence b; 0 reads nothing), table [B, n] int32 (sequence
    b's pages in order, a multiple of `paged_block_pages` wide). The kernel reads
    ceil(length / block) blocks of `paged_block_pages` pages.
    Returns (out [B, Hq, D] float32, normalised; lse [B, Hq] float32 = log sum exp of the
    scores, -inf for an empty sequence).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as pak

    B, Hq, D = q.shape
    K, _, ps, _ = k_pages.shape
    ng = Hq // K
    ppcb = paged_block_pages(ps)
    if table.shape[1] % ppcb:
        raise ValueError(f"page table width {table.shape[1]} is not a multiple of {ppcb}")
    if ng % 8:  # as the kernel's own wrapper: a [ng, 1, D] float32 block (TPU layout hint)
        q = q.reshape(B, Hq, 1, D).astype(jnp.float32)
        spec = pl.BlockSpec((None, ng, None, D), lambda c, b, h, *_: (b, h, 0, 0))
    else:
        spec = pl.BlockSpec((None, ng, D), lambda c, b, h, *_: (b, h, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    buf = pltpu.VMEM((2, ppcb, ps, D), k_pages.dtype)
    stat = jax.ShapeDtypeStruct((*q.shape[:-1], 1), jnp.float32)

    def launch():
        return pl.pallas_call(
            functools.partial(
                pak.paged_flash_attention_kernel_inline_seq_dim,
                batch_size=B,
                pages_per_compute_block=ppcb,
                pages_per_sequence=table.shape[1],
                mask_value=pak.DEFAULT_MASK_VALUE,
                attn_logits_soft_cap=None,
                megacore_mode=None,
            ),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=4,  # lengths, table, buffer index, init flag
                in_specs=[spec, hbm, None, hbm, None],
                out_specs=[spec, spec, spec],
                grid=(1, B, K),
                scratch_shapes=(
                    buf,
                    None,
                    buf,
                    None,
                    pltpu.SemaphoreType.DMA((2,)),
                    pltpu.SemaphoreType.DMA((2,)),
                ),
            ),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "arbitrary", "arbitrary")
            ),
            out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), stat, stat],
            name="paged_attention_lse",
        )(*args)

    args = (
        lengths.astype(jnp.int32),
        table.reshape(-1).astype(jnp.int32),
        jnp.zeros((1,), jnp.int32),
        jnp.ones((1,), jnp.int32),
        q,
        k_pages,
        None,
        v_pages,
        None,
    )
    if interpret:  # the mode is read when the pallas_call is made, so both run under it
        with pltpu.force_tpu_interpret_mode():
            out, m, l = launch()
    else:
        out, m, l = launch()
    lse = (m + jnp.log(l)).reshape(B, Hq)
    return out.reshape(B, Hq, D).astype(jnp.float32), lse


def _merge_softmax(out_a, lse_a, out_b, lse_b):
    """Attention over keys A and B from each part's normalised output [..., D] and log-sum-exp
    [...] (float32); a part with lse -inf (no key) weighs 0; neither -> 0."""
    m = jnp.maximum(jnp.maximum(lse_a, lse_b), -1e30)
    wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    total = wa + wb
    total = jnp.where(total > 0, total, 1.0)
    return (wa[..., None] * out_a + wb[..., None] * out_b) / total[..., None]


@register_paged_kernel("pallas_tpu")
def paged_decode_pallas_tpu(
    q,
    k_pages,
    v_pages,
    prefix_len,
    own_len,
    shared_pages: int,
    live=None,
    *,
    interpret: bool = False,
):
    """`paged_decode_xla` on the TPU with JAX's Pallas paged-attention kernel, in two calls whose
    softmax statistics are merged (`_pallas_paged_lse`, `_merge_softmax`):

    - the group's shared prompt pages, **once per group**: the G rows' queries of each kv head
      in one block ([P, K * G * Hg, D]) against the group's prefix_len // page_size full pages;
    - each row's own pages (the prompt's partial page and its completion): own_len slots.

    So a decode step reads the shared prompt once per group and each row's filled own pages
    (rounded up to the kernel's block: `paged_block_pages`, 128 keys at pages of 16), nothing
    else.
    ``live`` [R] bool (None = every row): a row not live (finished: its output is not used)
    reads nothing, and a group with no live row reads no prefix; their outputs are then
    attention over what remains (0 when nothing does). Under a mesh it runs per device on its
    groups' rows and its kv heads (`_sharded`). ``interpret=True`` runs the kernel in JAX's TPU
    interpreter (any backend; tests), whose matmuls round as the TPU's default precision
    (bfloat16 passes). Args/Returns: as `paged_decode_xla`.
    """
    R, D = q.shape[0], q.shape[3]
    if live is None:
        live = jnp.ones((R,), bool)

    def local(q, k_pages, v_pages, prefix_len, own_len, live):  # this device's rows and heads
        K, P, ppg, ps, _ = k_pages.shape
        rows, H, fp = q.shape[0], q.shape[2], shared_pages
        G, Hg = rows // P, H // K
        own = (ppg - fp) // G
        flat = lambda x: x.reshape(K, P * ppg, ps, D)
        kf, vf = flat(k_pages), flat(v_pages)
        qs = q[:, 0] * jnp.asarray(D**-0.5, q.dtype)  # [R, H, D]
        block = paged_block_pages(ps)
        r = jnp.arange(rows, dtype=jnp.int32)
        own_table = _padded_table((r // G) * ppg + fp + (r % G) * own, own, block)
        own_lengths = jnp.where(live, own_len, 0)
        out, lse = _pallas_paged_lse(qs, kf, vf, own_lengths, own_table, interpret)
        if fp:
            qp = qs.reshape(P, G, K, Hg, D).transpose(0, 2, 1, 3, 4).reshape(P, K * G * Hg, D)
            shared_table = _padded_table(jnp.arange(P, dtype=jnp.int32) * ppg, fp, block)
            shared_len = jnp.where(live.reshape(P, G).any(1), prefix_len // ps * ps, 0)
            o_s, l_s = _pallas_paged_lse(qp, kf, vf, shared_len, shared_table, interpret)
            back = lambda x, *d: x.reshape(P, K, G, Hg, *d).swapaxes(1, 2).reshape(rows, H, *d)
            out = _merge_softmax(back(o_s, D), back(l_s), out, lse)
        return out[:, None].astype(q.dtype)

    pages = ("heads", "rows", None, None, None)
    args = (("rows", None, "heads", None), pages, pages, ("rows",), ("rows",), ("rows",))
    return _sharded(local, args, ("rows", None, "heads", None))(
        q, k_pages, v_pages, prefix_len, own_len, live
    )


# ----------------------------------------------------------------------------- fused kernels


def _sharded(fn, args_axes, out_axes):
    """``fn`` under ``jax.shard_map`` over the abstract mesh in context (set by
    ``sharding.under_mesh`` around every jitted step): rows over ("data", "fsdp") and kv heads
    over "tensor" where they divide, so that each device attends its own rows and heads
    (attention needs no communication). XLA's partitioner cannot split a Pallas kernel, and
    inside the tile loops of the blockwise kernel its sharding propagation lost the row
    sharding (the TPU compiler kept every row on every device); the explicit map does neither.

    ``args_axes`` / ``out_axes``: per argument (per output; a tuple for several), one entry per
    dimension: "rows", "heads" or None. Without a mesh (or on one device): ``fn`` itself.
    """

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.axis_sizes) == 1:
        return fn

    def partitioned(*args):
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
        rows = tuple(a for a in ("data", "fsdp") if a in sizes)
        shards = math.prod(sizes[a] for a in rows)
        t = sizes.get("tensor", 1)
        row_ok = shards > 1 and all(
            x.shape[i] % shards == 0
            for x, axes in zip(args, args_axes)
            for i, a in enumerate(axes)
            if a == "rows"
        )
        head_ok = t > 1 and all(
            x.shape[i] % t == 0
            for x, axes in zip(args, args_axes)
            for i, a in enumerate(axes)
            if a == "heads"
        )
        name = {"rows": rows if row_ok else None, "heads": "tensor" if head_ok else None}
        spec = lambda axes: P(*(name.get(a) for a in axes))
        outs = spec(out_axes) if isinstance(out_axes[0], str | None) else tuple(map(spec, out_axes))
        if not (row_ok or head_ok):
            return fn(*args)
        return jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=tuple(spec(a) for a in args_axes),
            out_specs=outs,
            check_vma=False,
        )(*args)

    return partitioned


def _splash_blocks(n: int) -> tuple[int, int]:
    """(tile, padded length) for the splash kernel: lengths padded to a multiple of 128 (the
    TPU lane width), tiles of 512, 256 or 128."""
    padded = -(-n // 128) * 128
    for b in (512, 256, 128):
        if padded % b == 0:
            return b, padded
    raise AssertionError(padded)


def splash_attention(q, keys, values, mask: Mask, kv_layout: str = "bskd", *, interpret=False):
    """TPU flash attention: the Pallas splash-attention kernel of JAX
    (``jax.experimental.pallas.ops.tpu.splash_attention``, multi-query form per kv head,
    vmapped over rows and kv heads), forward and backward fused on chip.

    The mask is the kernel's static ``CausalMask(offset)`` (or ``FullMask`` for a non-causal
    ``Mask``) AND segment ids: queries id 1, keys ``key_mask`` (1 real, 0 padding), so query t
    sees exactly the keys of ``mask`` (the splash kernel's own mask semantics). Lengths are
    padded to multiples of 128. ``interpret=True`` runs the kernel in the Pallas interpreter
    (any backend; for tests).

    Args/Returns: as `blockwise_attention` (no lse), ``mask.static`` required.
    Raises:
      ValueError: a mask with a traced ``q_start`` (use `blockwise_attention`).
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if not mask.static:
        raise ValueError("splash_attention takes a static causal offset (mask.q_start is None)")
    dt = q.dtype
    B, T, H, D = q.shape
    if kv_layout == "bskd":
        keys, values = jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2)
    S = keys.shape[2]
    bq, Tp = _splash_blocks(T)
    bk, Sp = _splash_blocks(S)
    shape = (Tp, Sp)
    head_mask = sm.FullMask(shape) if mask.offset is None else sm.CausalMask(shape, mask.offset)
    blocks = sk.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        use_fused_bwd_kernel=True,
    )

    def local(q, keys, values, key_mask, segments=None):  # one device's rows and kv heads
        b, _, h, _ = q.shape
        k_ = keys.shape[1]
        kernel = sk.make_splash_mqa_single_device(
            sm.MultiHeadMask([head_mask] * (h // k_)), block_sizes=blocks, interpret=interpret
        )
        qg = (q.reshape(b, T, k_, h // k_, D) * jnp.asarray(D**-0.5, dt)).transpose(0, 2, 3, 1, 4)
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, Tp - T), (0, 0)))
        pad_s = ((0, 0), (0, 0), (0, Sp - S), (0, 0))
        kp, vp = jnp.pad(keys.astype(dt), pad_s), jnp.pad(values.astype(dt), pad_s)
        if segments is None:  # padding: queries id 1, real keys 1, padding keys 0
            kv_ids = key_mask.astype(jnp.int32)
            q_ids = jnp.ones((b, T), jnp.int32)
        else:  # packed rows: a query sees the real keys of its own row (ids >= 1)
            kv_ids = jnp.where(key_mask, segments, 0)
            q_ids = segments  # padding (0) queries see padding keys only: finite, unused
        kv_ids = jnp.pad(kv_ids, ((0, 0), (0, Sp - S)))
        q_ids = jnp.pad(q_ids, ((0, 0), (0, Tp - T)), constant_values=1)

        def one(qh, kh, vh, q_id, kv_id):  # qh [G, Tp, D], kh/vh [Sp, D], ids [Tp] / [Sp]
            return kernel(qh, kh, vh, segment_ids=sk.SegmentIds(q=q_id, kv=kv_id))

        out = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None, None)))(qg, kp, vp, q_ids, kv_ids)
        return out[:, :, :, :T].transpose(0, 3, 1, 2, 4).reshape(b, T, h, D).astype(dt)

    kv = ("rows", "heads", None, None)  # keys/values as [B, KVH, S, D] here
    if mask.segment_ids is None:
        fn = _sharded(local, (_Q_AXES, kv, kv, ("rows", None)), _Q_AXES)
        return fn(q, keys, values, mask.key_mask)
    fn = _sharded(local, (_Q_AXES, kv, kv, ("rows", None), ("rows", None)), _Q_AXES)
    return fn(q, keys, values, mask.key_mask, mask.segment_ids)


def cudnn_attention(q, keys, values, mask: Mask, kv_layout: str = "bskd"):
    """GPU flash attention: ``jax.nn.dot_product_attention(implementation="cudnn")`` (cuDNN's
    fused kernel; bfloat16/float16 inputs). The mask goes in as a [B, 1, T, S] boolean array
    (cuDNN turns it into an additive bias: 1 / (2H) of the float32 scores' bytes, not per
    head). Args/Returns: as `blockwise_attention` (no lse).

    cuDNN's flash attention with a mask (bias) in training takes even query and key lengths
    only (``jax._src.cudnn.fused_attention_stablehlo.check_is_flash_attention``); the model's
    sequences are ``prompt + completion - 1`` tokens long (odd at 1024 + 4096), so an odd
    length is padded by one query (its output dropped) and one masked key (never attended)."""
    if kv_layout == "bksd":
        keys, values = jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2)
    T, S = q.shape[1], keys.shape[1]
    pad_t, pad_s = T % 2, S % 2
    if pad_s:
        keys, values = (jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0))) for x in (keys, values))
        mask = mask.replace(key_mask=jnp.pad(mask.key_mask, ((0, 0), (0, 1))))
    if pad_t:
        q = jnp.pad(q, ((0, 0), (0, 1), (0, 0), (0, 0)))
    dense = mask.dense(T + pad_t)[:, None]
    out = jax.nn.dot_product_attention(
        q, keys.astype(q.dtype), values.astype(q.dtype), mask=dense, implementation="cudnn"
    )
    return out[:, :T]


# ----------------------------------------------------------------------------- dispatch


def attend(q, keys, values, mask: Mask, impl: str, kv_layout: str = "bskd"):
    """Attention of q [B, T, H, D] over keys/values under ``mask`` with implementation
    ``impl`` ("blockwise" | "splash" | "cudnn"; a mask with a traced ``q_start`` runs the
    blockwise kernel whatever ``impl``). Returns [B, T, H, D] in q.dtype."""
    if impl == "einsum":
        return einsum_attention(q, keys, values, mask.dense(q.shape[1]), kv_layout)
    if impl == "blockwise" or not mask.static:
        return blockwise_attention(q, keys, values, mask, kv_layout)
    if impl == "splash":
        return splash_attention(q, keys, values, mask, kv_layout)
    if impl == "cudnn":
        return cudnn_attention(q, keys, values, mask, kv_layout)
    raise ValueError(f"unknown attention implementation {impl!r}")


def attend_shared_prefix(qc, kp, vp, prompt_mask, kc, vc, comp_mask, impl: str):
    """Completion queries of a shared-prompt batch over their group's prompt keys and their
    own earlier completion keys (`Decoder.shared_prefix`), without [Lc, Lp + Lc] scores.

    qc [R, Lc, H, D] (row r continues prompt r // G, R = P * G); kp, vp [P, Lp, KVH, D];
    prompt_mask [P, Lp] bool; kc, vc [R, Lc, KVH, D]; comp_mask [R, Lc] bool (key padding of
    the completion; causal within it). Returns [R, Lc, H, D] in qc.dtype.

    "blockwise": two partial attentions merged by their log-sum-exps (`merge_partial`): the
    group's G * Lc queries over the group's prompt keys read once (non-causal, key padding),
    and each row's queries over its own completion keys (causal); no copy of the prompt keys.
    "splash" / "cudnn": one call per row over the concatenated [prompt, completion] keys
    (prompt keys repeated G times) with ``Mask(offset=Lp)``: query t sees every real prompt
    key and completion keys s <= t.
    """
    R, Lc, H, D = qc.shape
    P, Lp = prompt_mask.shape
    G = R // P
    if impl == "blockwise":
        o1, lse1 = blockwise_attention(
            qc.reshape(P, G * Lc, H, D), kp, vp, Mask(prompt_mask, offset=None), return_lse=True
        )
        o2, lse2 = blockwise_attention(qc, kc, vc, Mask(comp_mask, offset=0), return_lse=True)
        return merge_partial(o1.reshape(R, Lc, H, D), lse1.reshape(R, Lc, H), o2, lse2)
    rep = lambda x: jnp.repeat(x, G, axis=0)
    keys = jnp.concatenate([rep(kp), kc], axis=1)
    values = jnp.concatenate([rep(vp), vc], axis=1)
    key_mask = jnp.concatenate([rep(prompt_mask), comp_mask], axis=1)
    return attend(qc, keys, values, Mask(key_mask, offset=Lp), impl)
