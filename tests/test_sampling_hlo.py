"""The compiled decode loop reads its KV cache in place: an optimized-HLO inspection test.

`decode_cache_traffic` compiles `sampling._generate`, finds the decode while loops (those whose
carry holds the [R, Lc] output tokens) and every computation they reach (the fusions), and
counts the ops there whose result has the size of a layer's live cache (a permutation of
[R, KVH, s, D] for Lp <= s <= Lp + Lc, unit dims ignored) or of a stacked [L, ...] cache; a
fusion counts as "fusion:<its root op>".
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp

from grpo_jax.models import get_preset
from grpo_jax.models.transformer import random_params
from grpo_jax.sampling import SamplingConfig, _generate, decode_buckets

_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_CALLEE = re.compile(r"(?:body|condition|calls|to_apply)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP = re.compile(r"= [a-z0-9]+\[([\d,]*)\]\S* ([a-z\-]+)\(")


def _computations(hlo: str):
    comps, entry, cur = {}, None, None
    for line in hlo.splitlines():
        m = _HEADER.match(line)
        if m:
            cur = m.group(1)
            comps[cur] = []
            if line.startswith("ENTRY"):
                entry = cur
        elif cur is not None and line.startswith(" "):
            comps[cur].append(line)
    return comps, entry


def _callees(line: str):
    out = _CALLEE.findall(line)
    for group in _BRANCHES.findall(line):
        out += [c.strip().lstrip("%") for c in group.split(",")]
    return out


def decode_cache_traffic(
    hlo: str,
    *,
    rows,
    kv_heads,
    head_dim,
    prompt_len,
    slots,
    layers,
    token_rows=None,
    slot_counts=None,
):
    """Counter {op: n} of cache-sized results inside the decode loops of optimized HLO text
    (``rows``: the cache's rows; ``token_rows``: the output tokens' rows, default ``rows``;
    ``slot_counts``: the slot counts s of the [rows, kv_heads, s, head_dim] results counted,
    default prompt_len..slots)."""
    comps, entry = _computations(hlo)
    out_tokens = f"s32[{token_rows or rows},{slots - prompt_len}]"
    roots = []
    for line in comps[entry]:
        if " while(" in line and out_tokens in line.split(" while(")[0]:
            roots.append(re.search(r"body=%([\w.\-]+)", line).group(1))
    assert roots, "no decode while loop found"
    seen, todo = set(), list(roots)
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        for line in comps[c]:
            todo += _callees(line)
    if slot_counts is None:
        slot_counts = range(prompt_len, slots + 1)
    per_layer = {tuple(sorted((rows, kv_heads, s, head_dim))) for s in slot_counts}
    whole = tuple(sorted((layers, rows, kv_heads, slots, head_dim)))
    counts = collections.Counter()
    for c in seen:
        for line in comps[c]:
            m = _OP.search(line)
            if not m or not m.group(1):
                continue
            dims = tuple(sorted(int(d) for d in m.group(1).split(",") if int(d) != 1))
            op = m.group(2)
            if op == "fusion":  # a fusion is named by what its root computes
                op = "fusion:" + _fusion_root(comps, line)
            if dims in per_layer:
                counts[op] += 1
            elif dims == whole:
                counts["whole:" + op] += 1
    return counts


def _fusion_root(comps, line: str) -> str:
    """The op of a fusion's root instruction (through bitcasts), e.g. dynamic-update-slice."""
    called = re.search(r"calls=%([\w.\-]+)", line)
    body = comps.get(called.group(1), []) if called else []
    ops = {}
    root = None
    for ln in body:
        m = re.match(r"\s*(ROOT )?%([\w.\-]+) = \S+ ([a-z\-]+)\(([^)]*)\)", ln)
        if m:
            ops[m.group(2)] = (m.group(3), m.group(4))
            if m.group(1):
                root = m.group(2)
    while root in ops and ops[root][0] == "bitcast":
        root = ops[root][1].split(",")[0].strip().lstrip("%")
    return ops[root][0] if root in ops else "?"


# what a decode loop may do with a cache-sized value: update it in place, pass it around
IN_PLACE = {
    "dynamic-update-slice",
    "fusion:dynamic-update-slice",
    "scatter",
    "fusion:scatter",
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
}


# distinct sizes, so a shape identifies the tensor: R 6, KVH 2, D 24, Lp 11, Lc 37
CFG = get_preset("tiny", vocab_size=96, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=24)
R, LP, LC = 6, 11, 37


def compiled_decode_hlo(config: SamplingConfig, cfg=CFG, rows=R, prompt_len=LP):
    g, p = random_params(cfg, 0)
    toks = jnp.ones((rows, prompt_len), jnp.int32)
    mask = jnp.ones((rows, prompt_len), bool)
    lowered = _generate.lower(g, p, toks, mask, jax.random.key(0), config)
    return lowered.compile().as_text()


def test_decode_loop_never_copies_or_transposes_the_cache():
    for temperature, top_k in ((1.0, 0), (0.0, 0), (0.8, 5)):
        sc = SamplingConfig(max_new_tokens=LC, temperature=temperature, top_k=top_k)
        counts = decode_cache_traffic(
            compiled_decode_hlo(sc),
            rows=R,
            kv_heads=CFG.num_kv_heads,
            head_dim=CFG.head_dim,
            prompt_len=LP,
            slots=LP + LC,
            layers=CFG.num_layers,
        )
        # every cache-sized value in the loop is updated in place or passed on: no copy,
        # transpose, slice or dynamic-slice (each a materialised copy on XLA:CPU)
        bad = {op: n for op, n in counts.items() if op.removeprefix("whole:") not in IN_PLACE}
        assert not bad, (temperature, top_k, dict(counts))
        assert (
            counts.get("fusion:dynamic-update-slice", 0) + counts.get("dynamic-update-slice", 0)
            >= 2 * CFG.num_layers
        ), counts


def test_hlo_scan_detects_a_transposed_cache():
    # the detector itself: a loop that transposes its [R, S, KVH, D] carry every step is caught
    def f(c, x):
        def body(carry):
            i, c, toks = carry
            t = jnp.einsum("bskd,bd->bks", c, x).sum(-1).astype(jnp.int32)
            toks = jax.lax.dynamic_update_slice(toks, t[:, :1], (0, i))
            return i + 1, c * 1.0001, toks

        return jax.lax.while_loop(lambda c: c[0] < LC, body, (0, c, jnp.zeros((R, LC), jnp.int32)))[
            2
        ]

    c = jnp.ones((R, LP + LC, CFG.num_kv_heads, CFG.head_dim))
    x = jnp.ones((R, CFG.head_dim))
    hlo = jax.jit(f).lower(c, x).compile().as_text()
    counts = decode_cache_traffic(
        hlo,
        rows=R,
        kv_heads=CFG.num_kv_heads,
        head_dim=CFG.head_dim,
        prompt_len=LP,
        slots=LP + LC,
        layers=CFG.num_layers,
    )
    assert sum(counts.values()) > 0, counts


def test_hlo_scan_flags_a_layer_scan_slicing_a_stacked_cache():
    # the previous sampler's pattern: a scan over layers that writes its token into a stacked
    # [L, R, KVH, S, D] cache and reads the layer back with a dynamic slice (a copy per layer
    # per step on XLA:CPU) is flagged; one buffer per layer, updated in place, is not
    L, K, D, S = CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, LP + LC

    def stacked(c, x):
        def step(carry):
            i, c, toks = carry

            def layer(h, l):
                nonlocal c
                c = jax.lax.dynamic_update_slice(c, h[None, :, :, None], (l, 0, 0, LP + i, 0))
                keys = jax.lax.dynamic_slice(c, (l, 0, 0, 0, 0), (1, R, K, S, D))[0]
                return h + jnp.einsum("bksd,bkd->bkd", keys, h), None

            h, _ = jax.lax.scan(layer, x, jnp.arange(L))
            toks = jax.lax.dynamic_update_slice(toks, h[:, :1, 0].astype(jnp.int32), (0, i))
            return i + 1, c, toks

        init = (0, c, jnp.zeros((R, LC), jnp.int32))
        return jax.lax.while_loop(lambda c: c[0] < LC - 1, step, init)[1:]

    def per_layer(cs, x):
        def step(carry):
            i, cs, toks = carry
            h, new = x, []
            for c in cs:
                c = jax.lax.dynamic_update_slice(c, h[:, :, None], (0, 0, LP + i, 0))
                h = h + jnp.einsum("bksd,bkd->bkd", c, h)
                new.append(c)
            toks = jax.lax.dynamic_update_slice(toks, h[:, :1, 0].astype(jnp.int32), (0, i))
            return i + 1, tuple(new), toks

        init = (0, cs, jnp.zeros((R, LC), jnp.int32))
        return jax.lax.while_loop(lambda c: c[0] < LC - 1, step, init)[1:]

    x = jnp.ones((R, K, D))
    dims = dict(rows=R, kv_heads=K, head_dim=D, prompt_len=LP, slots=S, layers=L)
    hlo = jax.jit(stacked, donate_argnums=0).lower(jnp.zeros((L, R, K, S, D)), x)
    counts = decode_cache_traffic(hlo.compile().as_text(), **dims)
    assert {op for op in counts if op.removeprefix("whole:") not in IN_PLACE}, counts
    cs = tuple(jnp.zeros((R, K, S, D)) for _ in range(L))
    hlo = jax.jit(per_layer, donate_argnums=0).lower(cs, x)
    counts = decode_cache_traffic(hlo.compile().as_text(), **dims)
    assert not {op for op in counts if op.removeprefix("whole:") not in IN_PLACE}, counts


def test_prefix_shared_decode_reads_the_prompt_block_in_place_and_copies_no_prompt():
    # groups of 2 (3 prompt blocks of [3, KVH, LP, D] for 6 rows): inside the decode loops the
    # completion caches [R, KVH, C, D] (C = 12, 24, 36: the chunks' completion slots) are only
    # updated in place, no per-row prompt copy [R, KVH, LP, D] and no [R, KVH, LP + C, D]
    # concatenation exists, and the prompt blocks are read in place (no copy)
    sc = SamplingConfig(max_new_tokens=LC, prompt_group_size=2, decode_cache="prefix_shared")
    hlo = compiled_decode_hlo(sc)
    ends = decode_buckets(LP, LC, sc.attention_buckets)
    comp = [e - LP for e in ends]
    assert comp == [12, 24, 36]
    dims = dict(
        kv_heads=CFG.num_kv_heads,
        head_dim=CFG.head_dim,
        prompt_len=LP,
        slots=LP + LC,
        layers=CFG.num_layers,
        token_rows=R,
    )
    counts = decode_cache_traffic(hlo, rows=R, slot_counts=comp, **dims)
    assert not {op for op in counts if op not in IN_PLACE}, dict(counts)
    assert counts.get("fusion:dynamic-update-slice", 0) + counts.get("dynamic-update-slice", 0)
    copies = decode_cache_traffic(hlo, rows=R, slot_counts=[LP, *ends], **dims)
    assert not copies, dict(copies)
    block = decode_cache_traffic(hlo, rows=R // 2, slot_counts=[LP], **dims)
    assert block and not {op for op in block if op not in IN_PLACE}, dict(block)
