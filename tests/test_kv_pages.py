"""The paged KV cache: a pool of pages and a page table per row decode what the dense cache decodes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.inference import TextGeneration
from dew.nn import kv_pages
from dew.nn.attention import cache_attention
from dew.nn.backbones.causal_transformer import CausalTransformer
from dew.nn.backbones.layer_plan import LayerKind
from dew.nn.kv_cache import KVCache
from dew.sampling import Sampling

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


def _model(**kwargs):
    return CausalTransformer(vocab_size=61, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2,
                             mlp_features=64, max_seq_len=64, attention_impl="xla", **kwargs)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_a_paged_model_generates_what_the_dense_model_generates(scan_layers):
    layers = {} if scan_layers else dict(layer_types=("sliding_attention", "full_attention"),
                                         kinds={"sliding_attention": LayerKind(window=3)})
    dense = _model(scan_layers=scan_layers, **layers)
    variables = nn.unbox(jax.jit(dense.init)(jax.random.key(0), np.zeros((1, 8), np.int32)))
    paged = _model(scan_layers=scan_layers, kv_cache=KVCache(page_size=4), **layers)
    sampled = Sampling(temperature=0.8)
    cases = ((sampled, 2),) if scan_layers else ((Sampling(), 1), (sampled, 2))  # n=2 copies each row's pages
    for sampling, n in cases:
        want = TextGeneration(dense, variables)(PROMPTS, 10, seed=3, n=n, sampling=sampling).host()
        got = TextGeneration(paged, variables)(PROMPTS, 10, seed=3, n=n, sampling=sampling).host()
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.behavior_log_probs, want.behavior_log_probs, atol=1e-5)
    other = TextGeneration(paged, variables)(PROMPTS, 10, seed=4, sampling=sampled).host()
    assert other.tokens.tolist() != want.tokens[::2].tolist()  # the comparison can fail


@pytest.mark.parametrize("quantized", ["int8", "float8_e4m3fn"])
def test_a_paged_quantized_cache_decodes_what_the_dense_quantized_one_does(quantized):
    """Pages hold the same eight-bit codes and scales as the dense layout (int8 keys rotated alike),
    so a paged quantized model draws the dense quantized model's tokens; n=2 copies codes and scales."""
    dense = _model(kv_cache=KVCache(quantized=quantized))
    variables = nn.unbox(jax.jit(dense.init)(jax.random.key(0), np.zeros((1, 8), np.int32)))
    paged = _model(kv_cache=KVCache(page_size=4, quantized=quantized))
    sampled = Sampling(temperature=0.8)
    want = TextGeneration(dense, variables)(PROMPTS, 10, seed=3, n=2, sampling=sampled).host()
    got = TextGeneration(paged, variables)(PROMPTS, 10, seed=3, n=2, sampling=sampled).host()
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.behavior_log_probs, want.behavior_log_probs, atol=1e-5)
    cache = paged.init_cache(2, 16)
    assert cache.k[0].codes.dtype == (jnp.int8 if quantized == "int8" else jnp.float8_e4m3fn)
    assert cache.k[0].scales.shape[-2] == 1 and cache.k[0].rotated == (quantized == "int8")  # keys [.., head_dim, page]


def test_writes_land_in_the_page_the_table_names_and_past_the_table_in_scratch():
    pages, page_size = 5, 2
    k_pool = jnp.zeros((pages + 1, 1, 1, page_size))  # [pages + scratch, kv_heads, head_dim, page_size]
    v_pool = jnp.zeros((pages + 1, 1, page_size, 1))  # [pages + scratch, kv_heads, page_size, head_dim]
    table = jnp.asarray([[3, 1], [0, 4]], jnp.int32)  # row 0: slots 0-1 in page 3, 2-3 in page 1
    k = jnp.asarray([[10.0, 11.0, 12.0], [20.0, 21.0, 22.0]]).reshape(2, 3, 1, 1)
    index = jnp.asarray([1, 2], jnp.int32)  # row 0 writes slots 1-3; row 1 slots 2-4 (slot 4 past its table)
    k_pool, v_pool = kv_pages.write_pages(k_pool, v_pool, k, k + 100, table, index)
    keys = np.asarray(k_pool)[:, 0, 0, :]
    np.testing.assert_array_equal(keys[3], [0, 10])
    np.testing.assert_array_equal(keys[1], [11, 12])
    np.testing.assert_array_equal(keys[4], [20, 21])
    np.testing.assert_array_equal(keys[pages], [22, 0])  # the slot past row 1's table went to scratch
    np.testing.assert_array_equal(np.asarray(v_pool)[4, 0, :, 0], [120, 121])
    seen_k, seen_v = kv_pages.gather_pages(k_pool, v_pool, table)
    np.testing.assert_array_equal(np.asarray(seen_k)[:, 0, :], [[0, 10, 11, 12], [0, 0, 20, 21]])  # [B * KV, D, S]
    np.testing.assert_array_equal(np.asarray(seen_v)[:, :, 0], [[0, 110, 111, 112], [0, 0, 120, 121]])


def test_page_buckets_are_an_eighth_a_quarter_a_half_and_all_of_a_row():
    assert kv_pages.page_buckets(32) == (4, 8, 16, 32)
    assert kv_pages.page_buckets(7) == (1, 2, 4, 7)
    assert kv_pages.page_buckets(2) == (1, 2)
    assert kv_pages.page_buckets(1) == (1,)


@pytest.mark.parametrize("filled", [1, 4, 5, 9, 31, 32])
def test_attention_reads_the_smallest_bucket_of_pages_that_holds_every_written_slot(filled):
    """Pages of 4, 8 per row (buckets of 1, 2, 4 and 8 pages). Every slot up to `filled` holds a
    token; slots past it hold keys and values at valid positions too, which a row never has (a
    bucket may skip them): attention sees exactly the slots of the bucket that covers `filled`."""
    rows, kv_heads, page_size, entries, width = 2, 2, 4, 8, 8
    pool_keys = jax.random.split(jax.random.key(0), 3)
    k_pool = jax.random.normal(pool_keys[0], (rows * entries + 1, kv_heads, width, page_size))
    v_pool = jax.random.normal(pool_keys[1], (rows * entries + 1, kv_heads, page_size, width))
    table = jnp.asarray(np.random.default_rng(0).permutation(rows * entries).reshape(rows, entries), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(entries * page_size, dtype=jnp.int32), (rows, entries * page_size))
    q = jax.random.normal(pool_keys[2], (rows, 1, 4, width))

    def attend(q, keys, values, kv_positions):
        return cache_attention(q, keys, values, q_positions=jnp.full((rows, 1), 10**6, jnp.int32),
                               kv_positions=kv_positions)

    got = jax.jit(kv_pages.attend_pages, static_argnums=0)(attend, q, k_pool, v_pool, table, positions, filled)
    bucket = next(b for b in kv_pages.page_buckets(entries) if b * page_size >= filled)
    seen = bucket * page_size
    keys, values = kv_pages.gather_pages(k_pool, v_pool, table[:, :bucket])
    np.testing.assert_allclose(got, attend(q, keys, values, positions[:, :seen]), rtol=1e-5, atol=1e-5)
    if bucket < entries:  # the control: reading every page gives another answer
        keys, values = kv_pages.gather_pages(k_pool, v_pool, table)
        assert not np.allclose(got, attend(q, keys, values, positions), atol=1e-3)


def _pools_and_rows(quantized=None, rows=3, entries=4, page_size=4, kv_heads=2, width=8, spare=5):
    """Pools of random pages (more than the rows name, in shuffled order), rows of 3 to 14 tokens
    whose later entries name scratch, and each row's one query at its next position."""
    from dew.nn.kv_quant import store

    keys = jax.random.split(jax.random.key(1), 3)
    pages = rows * entries + spare
    k = jax.random.normal(keys[0], (pages + 1, kv_heads, page_size, width))
    v = jax.random.normal(keys[1], (pages + 1, kv_heads, page_size, width))
    if quantized is None:
        k_pool, v_pool = jnp.swapaxes(k, -1, -2), v
    else:
        from dew.nn.kv_quant import Quantized

        like = Quantized.zeros((1, 1, width, 1), -2, quantized, rotated=quantized == "int8")
        stored = store(k, like)  # codes [.., P, D], scales [.., P, 1]
        k_pool = Quantized(jnp.swapaxes(stored.codes, -1, -2), jnp.swapaxes(stored.scales, -1, -2), rotated=stored.rotated)
        v_pool = store(v, Quantized.zeros((1, 1, 1, width), -1, quantized, rotated=False))
    lengths = np.asarray([3, 14, 9])[:rows]
    order = np.random.default_rng(0).permutation(pages)
    table = np.full((rows, entries), pages, np.int32)  # scratch
    positions = np.full((rows, entries * page_size), -1, np.int32)
    for row, length in enumerate(lengths):
        held = -(-length // page_size)
        table[row, :held] = order[row * entries: row * entries + held]
        positions[row, :length] = np.arange(length)
    q = jax.random.normal(keys[2], (rows, 1, 4, width))
    return q, k_pool, v_pool, jnp.asarray(table), jnp.asarray(positions), jnp.asarray(lengths[:, None])


@pytest.mark.parametrize("quantized", [None, "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("rules", [{}, dict(window=4), dict(sinks=True)])
@pytest.mark.parametrize("shared", [0, 2])
def test_attention_by_page_reads_what_a_gather_of_each_rows_pages_reads(quantized, rules, shared):
    """Scoring every pool page where it lies against its row's queries gives the dense cache's
    attention over the row's pages gathered end to end (GQA, window, sinks, eight-bit codes and
    scales), with the pool's unnamed pages and its scratch page holding random values. With
    ``shared=2`` the rows begin with the same pages, as a prefix cache lays them out, and the two
    pages that several rows name are scored against every row."""
    from dew.nn.attention import paged_cache_attention

    q, k_pool, v_pool, table, positions, q_positions = _pools_and_rows(quantized)
    if shared:  # rows 0 and 2 begin with row 1's first page (row 0 holds one), row 2 with its second too
        table = table.at[0, 0].set(table[1, 0]).at[2, :2].set(table[1, :2])
    if rules.get("sinks"):
        rules = dict(sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0]))
    keys, values = kv_pages.gather_pages(k_pool, v_pool, table)
    want = cache_attention(q, keys, values, q_positions=q_positions, kv_positions=positions, **rules)
    got = jax.jit(lambda *a: paged_cache_attention(*a, q_positions=q_positions, kv_positions=positions,
                                                   shared=shared, **rules))(q, k_pool, v_pool, table)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if shared:  # the control: scored in place, a shared page answers for one of its rows only (a
        # window may hide that page from all but one row, so the control reads without it)
        rules = {name: rule for name, rule in rules.items() if name != "window"}
        want = cache_attention(q, keys, values, q_positions=q_positions, kv_positions=positions, **rules)
        wrong = paged_cache_attention(q, k_pool, v_pool, table, q_positions=q_positions, kv_positions=positions,
                                      shared=1, **rules)
        assert not np.allclose(wrong, want, atol=1e-3)
        return
    other = table.at[1, 3].set(table[2, 0])  # the control: row 1 reading row 2's first page for its last
    keys, values = kv_pages.gather_pages(k_pool, v_pool, other)
    assert not np.allclose(got, cache_attention(q, keys, values, q_positions=q_positions, kv_positions=positions,
                                                **rules), atol=1e-3)


def test_attend_pages_reads_by_page_with_the_pages_rows_share_scored_against_every_row():
    """A one-token call over rows that name most of the pool is read by page. A page that two rows
    name (a prefix cache's shared prompt) would answer for one row only if scored against its
    owner's queries, so such pages, up to a row's worth, are scored against every row; with more
    the call gathers. Each way gives the gather's answer."""
    from dew.nn.attention import paged_cache_attention

    q, k_pool, v_pool, table, positions, q_positions = _pools_and_rows(spare=1)  # 13 pages, rows of 3, 14, 9

    def attend(q, keys, values, kv_positions):
        return cache_attention(q, keys, values, q_positions=q_positions, kv_positions=kv_positions)

    def by_page(q, k_pool, v_pool, table, kv_positions, shared):
        return paged_cache_attention(q, k_pool, v_pool, table, q_positions=q_positions, kv_positions=kv_positions,
                                     shared=shared)

    run = jax.jit(lambda q, k, v, t: kv_pages.attend_pages(attend, q, k, v, t, positions, 14, by_page))
    first = table.at[0, 0].set(table[1, 0])  # rows 0 and 1 begin with the same page
    two = first.at[2, :2].set(table[1, :2])  # and rows 1 and 2 with the same two
    for case in (table, first, two):
        keys, values = kv_pages.gather_pages(k_pool, v_pool, case)
        np.testing.assert_allclose(run(q, k_pool, v_pool, case), attend(q, keys, values, positions), rtol=1e-5, atol=1e-5)

    def marked(q, *args):  # shows which branch ran: by page (`shared` + 1) or a gather
        return jnp.full_like(q, args[-1] + 1)

    chosen = jax.jit(lambda t, filled: kv_pages.attend_pages(attend, q, k_pool, v_pool, t, positions, filled, marked))
    np.testing.assert_array_equal(chosen(table, 14), 1)  # rows of up to 14 slots in a pool of 13 pages: by page
    np.testing.assert_array_equal(chosen(first, 14), 5)  # and the shared page against every row (a row's 4)
    np.testing.assert_array_equal(chosen(two, 14), 5)
    a, b, c, d, e, x, y = table[1, 0], table[1, 1], table[1, 2], table[1, 3], table[2, 0], table[2, 1], table[2, 2]
    crowd = jnp.asarray([[a, b, c, d], [a, b, c, e], [d, e, x, y]])  # 5 pages named twice: more than a row's 4
    assert not np.isin(np.asarray(chosen(crowd, 14)), [1, 5]).any()  # gathered
    assert not np.isin(np.asarray(chosen(table, 4)), [1, 5]).any()  # one page per row: 3 pages of 13, gathered
    unchosen = []  # a pool four times what the rows name is gathered: by_page is not even traced
    big = jax.tree.map(lambda x: jnp.concatenate([x] * 4), (k_pool, v_pool))
    kv_pages.attend_pages(attend, q, *big, table, positions, 14, lambda *a: unchosen.append(1))
    assert not unchosen



def test_positions_past_a_row_are_dropped_not_shifted():
    positions = jnp.full((1, 4), -1, jnp.int32)
    written = kv_pages.write_page_positions(positions, jnp.asarray([[7, 8, 9]]), jnp.asarray([2]))
    np.testing.assert_array_equal(np.asarray(written), [[-1, -1, 7, 8]])


def test_a_pool_that_cannot_give_every_row_its_pages_raises_outside_a_server():
    model = _model(kv_cache=KVCache(page_size=8, pages=3))
    variables = nn.unbox(jax.jit(_model().init)(jax.random.key(0), np.zeros((1, 8), np.int32)))
    with pytest.raises(ValueError, match="cannot give each of 2 rows"):
        TextGeneration(model, variables)(PROMPTS, 12, seed=0)


def test_bad_layouts_raise_when_the_model_is_built():
    with pytest.raises(ValueError, match="page_size"):
        _model(kv_cache=KVCache(page_size=0))
    with pytest.raises(ValueError, match="needs a page_size"):
        _model(kv_cache=KVCache(pages=8))


def test_rows_taken_from_a_paged_cache_go_back_with_what_was_written_to_them():
    """take_rows keeps the pools and picks the rows' table, positions, lengths and index; put_rows
    puts the written part back, rows not taken untouched; a dense cache refuses."""
    layout = KVCache(page_size=2, pages=8)
    cache = _model(kv_cache=layout).init_cache(4, 6, rows_own_pages=False)
    cache = cache.replace(
        page_table=jnp.arange(12, dtype=jnp.int32).reshape(4, 3) % 8,
        positions=jnp.arange(24, dtype=jnp.int32).reshape(4, 6), lengths=jnp.asarray([1, 2, 3, 4], jnp.int32),
        index=jnp.asarray([5, 6, 7, 8], jnp.int32),
    )
    rows = jnp.asarray([3, 1], jnp.int32)
    part = cache.take_rows(rows)
    np.testing.assert_array_equal(part.lengths, [4, 2])
    np.testing.assert_array_equal(part.index, [8, 6])
    np.testing.assert_array_equal(part.page_table, np.asarray(cache.page_table)[[3, 1]])
    np.testing.assert_array_equal(part.positions, np.asarray(cache.positions)[[3, 1]])
    assert part.k is cache.k
    written = part.replace(k=jax.tree.map(lambda x: x + 1, part.k), lengths=part.lengths + 10, index=part.index + 10,
                           positions=part.positions * 0, page_table=part.page_table * 0)
    back = cache.put_rows(rows, written)
    np.testing.assert_array_equal(back.lengths, [1, 12, 3, 14])
    np.testing.assert_array_equal(back.index, [5, 16, 7, 18])
    np.testing.assert_array_equal(np.asarray(back.positions)[[0, 2]], np.asarray(cache.positions)[[0, 2]])
    assert not np.asarray(back.positions)[[1, 3]].any() and not np.asarray(back.page_table)[[1, 3]].any()
    np.testing.assert_array_equal(np.asarray(back.page_table)[[0, 2]], np.asarray(cache.page_table)[[0, 2]])
    assert back.k is written.k
    with pytest.raises(ValueError, match="take_rows needs a paged cache"):
        _model().init_cache(2, 6).take_rows(rows)
