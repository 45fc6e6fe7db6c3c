"""A Server over a paged KV cache: pages, chunked prefill and shared prompt pages draw what each
request draws alone, admission waits for pages, and traffic never recompiles the step."""

from pathlib import Path

import jax
import numpy as np
import pytest

from dew.inference import TextGeneration
from dew.inference import serving
from dew.inference.page_pool import PagePool
from dew.inference.serving import Server
from dew.nn.kv_cache import KVCache
from dew.sampling import Sampling
from test_serving import REFERENCE_BUDGET, SETTINGS, _alone, _model, _serve_staggered, _traffic

SHARED = [(i * 7) % 50 + 1 for i in range(19)]  # a prompt start several requests share (two full pages of 8)


@pytest.fixture(scope="module")
def task():
    return TextGeneration(*_model())


def _shared_traffic():
    """Mixed prompts and budgets, a third of them beginning with the same 19 tokens."""
    traffic = _traffic(6, 16, 16)
    return traffic + [(SHARED + prompt[:3], budget, sampling, seed + 50)
                      for prompt, budget, sampling, seed in traffic[:3]]


def test_paged_chunked_and_prefix_sharing_servers_draw_what_each_request_draws_alone(task):
    traffic = _shared_traffic()
    references = {}
    layouts = [
        dict(kv_cache=KVCache(page_size=8, pages=10)),  # 10 pages: 40% of the dense cache's 24, so requests queue
        dict(kv_cache=KVCache(page_size=8, pages=12), chunk=8, prefix_cache=True),
    ]
    for options in layouts:
        server = Server.from_task(task, slots=4, capacity=48, **options)
        served = _serve_staggered(server, traffic)
        if options.get("prefix_cache"):
            assert server._pool.reused_tokens >= 16  # a later shared prompt read two full pages
        for request in served:
            key = (tuple(request.prompt.tolist()), request.seed)
            if key not in references:
                references[key] = _alone(task, request, REFERENCE_BUDGET)
            tokens, log_probs = references[key]
            assert request.tokens == tokens, f"{options}: request with seed {request.seed}"
            np.testing.assert_allclose([e.logprob for e in request.events], log_probs, atol=1e-4)
            assert request.events[-1].finish_reason is not None
        assert server.stats()["pages_used"] == 0.0  # every request gave its pages back
    assert any(r.events[-1].finish_reason == "stop" for r in served)


def test_an_int8_paged_server_with_chunks_and_shared_pages_draws_what_int8_generation_draws_alone():
    """Quantized pages: a paged, chunked, prefix-sharing int8 Server equals TextGeneration over the
    dense int8 cache, request by request (both store the same codes and scales)."""
    model, variables = _model()
    quantized = TextGeneration(model.clone(kv_cache=KVCache(quantized="int8")), variables)
    server = Server.from_task(TextGeneration(model, variables), slots=4, capacity=48,
                              kv_cache=KVCache(page_size=8, pages=12, quantized="int8"), chunk=8, prefix_cache=True)
    assert server.model.kv_cache.quantized == "int8"  # the one-row prefills store what the pages store
    for request in _serve_staggered(server, _shared_traffic()[3:]):
        tokens, log_probs = _alone(quantized, request, REFERENCE_BUDGET)
        assert request.tokens == tokens, f"request with seed {request.seed}"
        np.testing.assert_allclose([e.logprob for e in request.events], log_probs, atol=1e-4)


def test_a_paged_request_differs_from_the_same_request_with_another_seed(task):
    """The negative control of the comparison above."""
    server = Server.from_task(task, slots=2, capacity=48, kv_cache=KVCache(page_size=8), chunk=8)
    first = server.submit(list(range(1, 20)), max_new_tokens=12, sampling=SETTINGS[2], seed=1)
    other = server.submit(list(range(1, 20)), max_new_tokens=12, sampling=SETTINGS[2], seed=2)
    while not (first.finished and other.finished):
        server.step()
    assert first.tokens != other.tokens


@pytest.mark.slow
def test_twenty_four_requests_of_up_to_200_tokens_served_from_shared_chunked_pages_equal_alone():
    task = TextGeneration(*_model(max_seq_len=256))
    server = Server.from_task(task, slots=6, capacity=240, kv_cache=KVCache(page_size=16, pages=48), chunk=32,
                              prefix_cache=True)
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, 61, 40).tolist()
    traffic = []
    for i in range(24):
        prompt = rng.integers(0, 61, int(rng.integers(4, 161))).tolist()
        traffic.append(((prefix + prompt) if i % 3 == 0 else prompt, int(rng.integers(1, 33)),
                        SETTINGS[i % len(SETTINGS)], 1000 + i))
    served = _serve_staggered(server, traffic, every=3)
    assert server._pool.reused_tokens > 0
    for request in served:
        tokens, log_probs = _alone(task, request)
        assert request.tokens == tokens
        np.testing.assert_allclose([e.logprob for e in request.events], log_probs, atol=1e-4)


def test_admission_waits_while_the_pool_is_full_and_proceeds_when_pages_come_back(task):
    server = Server.from_task(task, slots=2, capacity=48, kv_cache=KVCache(page_size=8, pages=6))
    first = server.submit(list(range(1, 11)), max_new_tokens=20, sampling=Sampling(), seed=0)  # 30 tokens: 4 pages
    second = server.submit(list(range(2, 12)), max_new_tokens=20, sampling=Sampling(), seed=1)
    server.step()
    stats = server.stats()
    assert (stats["running"], stats["queue_depth"], stats["pages_used"]) == (1.0, 1.0, 4.0)
    assert second.row is None  # a free row, but not enough free pages
    while not first.finished:
        server.step()
        assert second.row is None or first.finished
    server.step()
    assert second.row is not None and server.stats()["pages_used"] == 4.0
    while not second.finished:
        server.step()
    assert len(second.tokens) == 20 and server.stats()["pages_used"] == 0.0
    cancelled = server.submit(list(range(3, 13)), max_new_tokens=20, sampling=Sampling(), seed=2)
    server.step()
    assert server.stats()["pages_used"] == 4.0
    server.cancel(cancelled)
    server.step()
    assert server.stats()["pages_used"] == 0.0 and not cancelled.finished  # a cancelled request's pages come back


def test_a_second_wave_of_paged_traffic_never_recompiles():
    task = TextGeneration(*_model(max_seq_len=56))  # a model of its own: its programs are new
    server = Server.from_task(task, slots=3, capacity=56, kv_cache=KVCache(page_size=8, pages=12), chunk=16,
                              prefix_cache=True)
    _serve_staggered(server, _traffic(6, 40, 8, seed=1) + [(SHARED + [1], 3, Sampling(), 9)])
    compiled = serving._prefill_pages_jit._cache_size(), serving._decode_jit._cache_size()
    _serve_staggered(server, _traffic(8, 40, 12, seed=2) + [(SHARED + [2], 3, Sampling(), 9)], every=3)
    assert (serving._prefill_pages_jit._cache_size(), serving._decode_jit._cache_size()) == compiled


def test_rows_growing_across_page_buckets_decode_what_they_draw_alone_in_one_program():
    """Decode steps attend over the first 1, 2, 3 then all 6 pages of each row (pages of 4) as the
    longest row grows: every step equals generation alone, and one decode program per number of
    rows decoded (one row, then both) serves every page bucket, now and for the same traffic again."""
    task = TextGeneration(*_model(max_seq_len=24))  # a model of its own: its programs are new
    server = Server.from_task(task, slots=2, capacity=24, kv_cache=KVCache(page_size=4, pages=12))
    traffic = [(list(range(1, 4)), 20, SETTINGS[2], 3), (list(range(5, 7)), 9, SETTINGS[1], 4)]
    before = serving._decode_jit._cache_size()
    served = _serve_staggered(server, traffic)
    assert serving.row_buckets(2) == (1, 2)
    assert serving._decode_jit._cache_size() == before + 2
    for request in served:
        tokens, log_probs = _alone(task, request, 20)
        assert request.tokens == tokens, f"request with seed {request.seed}"
        np.testing.assert_allclose([e.logprob for e in request.events], log_probs, atol=1e-4)
    assert len(served[0].tokens) == 20  # it decoded up to the last slot of its row
    _serve_staggered(server, traffic)
    assert serving._decode_jit._cache_size() == before + 2


def test_a_paged_decode_call_runs_only_as_many_rows_as_the_pool_lets_decode(task, monkeypatch):
    """Eight slots over a pool that holds two requests at a time: every decode call runs the
    smallest row bucket (2 of 8) holding the live rows, and each request draws what it draws alone;
    a dense server's call runs every row."""
    decoded = []
    decode = serving._decode_jit

    def watched(model, variables, cache, state, rows, **kwargs):
        decoded.append(None if rows is None else sorted(rows.tolist()))
        return decode(model, variables, cache, state, rows, **kwargs)

    monkeypatch.setattr(serving, "_decode_jit", watched)
    assert serving.row_buckets(8) == (2, 4, 6, 8) and serving.row_buckets(5) == (2, 3, 4, 5)
    server = Server.from_task(task, slots=8, capacity=48, kv_cache=KVCache(page_size=8, pages=8))
    traffic = [(list(range(1 + i, 12 + i)), 12 + i, SETTINGS[i % len(SETTINGS)], 20 + i) for i in range(5)]
    served = _serve_staggered(server, traffic)  # 11-token prompts, 12-16 draws: 3-4 pages, 2 at once
    assert decoded and all(len(rows) == 2 and len(set(rows)) == 2 for rows in decoded)
    for request in served:
        tokens, log_probs = _alone(task, request, REFERENCE_BUDGET)
        assert request.tokens == tokens, f"request with seed {request.seed}"
        np.testing.assert_allclose([e.logprob for e in request.events], log_probs, atol=1e-4)
    decoded.clear()
    dense = Server.from_task(task, slots=8, capacity=48)
    _serve_staggered(dense, traffic[:2])
    assert decoded and all(rows is None for rows in decoded)


def test_bad_paged_settings_raise_before_anything_compiles(task):
    compiled = serving._prefill_pages_jit._cache_size(), serving._decode_jit._cache_size()
    with pytest.raises(ValueError, match="fewer than one request of capacity=48 needs"):
        Server.from_task(task, slots=2, capacity=48, kv_cache=KVCache(page_size=8, pages=5))
    with pytest.raises(ValueError, match="work on pages"):
        Server.from_task(task, slots=2, capacity=48, chunk=8)
    with pytest.raises(ValueError, match="chunk"):
        Server.from_task(task, slots=2, capacity=48, kv_cache=KVCache(page_size=8), chunk=0)
    with pytest.raises(ValueError, match="not a built cache"):
        Server.from_task(task, slots=2, capacity=48, kv_cache=task.model.init_cache(1, 8))
    with pytest.raises(ValueError, match="needs a page_size"):
        Server.from_task(task, slots=2, capacity=48, kv_cache=KVCache(pages=8))
    assert (serving._prefill_pages_jit._cache_size(), serving._decode_jit._cache_size()) == compiled


def test_reload_stops_sharing_the_pages_the_old_weights_wrote(task):
    server = Server.from_task(task, slots=2, capacity=48, kv_cache=KVCache(page_size=8), prefix_cache=True)
    for seed in (0, 1):
        request = server.submit(SHARED, max_new_tokens=2, sampling=Sampling(), seed=seed)
        while not request.finished:
            server.step()
    assert server._pool.reused_tokens == 16  # the second request read the first one's two full pages
    server.reload(jax.tree_util.tree_map(lambda x: x * 1.5, task.variables))
    for seed in (2, 3):
        request = server.submit(SHARED, max_new_tokens=2, sampling=Sampling(), seed=seed)
        while not request.finished:
            server.step()
    assert server._pool.reused_tokens == 32  # the new weights' first request computed its pages again


def test_reset_prefix_cache_makes_the_next_request_compute_its_prompt_and_the_one_after_share_it(task):
    server = Server.from_task(task, slots=2, capacity=48, kv_cache=KVCache(page_size=8), prefix_cache=True)

    def serve(seed):
        request = server.submit(SHARED, max_new_tokens=2, sampling=Sampling(), seed=seed)
        while not request.finished:
            server.step()
        return request

    first = serve(0)
    serve(1)
    assert server._pool.reused_tokens == 16  # the control: the second request read two full pages
    server.reset_prefix_cache()
    again = serve(0)
    assert server._pool.reused_tokens == 16  # computed afresh after the reset
    assert again.tokens == first.tokens  # the same weights, seed and prompt draw the same tokens
    serve(1)
    assert server._pool.reused_tokens == 32  # and cached again for the next request
    dense = Server.from_task(task, slots=2, capacity=48)
    dense.reset_prefix_cache()  # no prefix cache: nothing to forget
    request = dense.submit(SHARED, max_new_tokens=2, sampling=Sampling(), seed=0)
    while not request.finished:
        dense.step()
    assert request.tokens == first.tokens


def test_page_keys_cover_everything_before_a_page_and_released_pages_stay_cached():
    pool = PagePool(4, 2, prefix_cache=True)
    a, b = np.asarray([1, 2, 3, 4, 5]), np.asarray([9, 9, 3, 4, 5])
    assert pool.page_keys(a)[1] != pool.page_keys(b)[1]  # same page tokens, different history
    first = pool.grant(a, 5)  # 3 pages, none shared yet
    assert first.shared == () and len(first.fresh) == 3
    pool.share(a, first.pages)
    assert pool.grant(np.asarray([1, 2, 3, 4, 7]), 8) is None  # 2 shared pages, but 2 new ones and 1 is free
    second = pool.grant(np.asarray([1, 2, 3, 4, 7]), 5)
    assert second.shared == first.pages[:2] and pool.used == 4
    pool.release(first.pages)
    pool.release(second.pages)
    assert pool.used == 0
    third = pool.grant(b, 8)  # 4 pages: the free one, then the cached ones, least recently used first
    assert len(third.fresh) == 4 and pool.grant(a, 1) is None


def test_a_request_waits_for_a_page_another_request_is_computing_rather_than_computing_it_again():
    pool = PagePool(16, 2, prefix_cache=True)
    a, b = np.asarray([1, 2, 3, 4, 5]), np.asarray([1, 2, 3, 4, 6, 7])
    first = pool.grant(a, 5)
    assert pool.computing(b)  # its first two pages are a's, not yet prefilled
    assert not pool.computing(np.asarray([8, 1, 2]))  # another start computes its own
    pool.share(a, first.pages)  # a's prompt is in its pages
    assert not pool.computing(b) and pool.grant(b, 6).shared == first.pages[:2]
    writer = pool.grant(np.asarray([5, 5, 5]), 3)
    assert pool.computing(np.asarray([5, 5, 6]))
    pool.release(writer.pages)  # the writer left before its prefill was done: nobody waits for it
    assert not pool.computing(np.asarray([5, 5, 6]))
    pool.grant(np.asarray([7, 7, 7]), 3)
    pool.forget()  # forgotten pages are neither shared nor waited for
    assert not pool.computing(np.asarray([7, 7, 6]))


def test_requests_with_one_prompt_start_admitted_together_compute_it_once(task):
    """Three requests behind the same two full pages arrive at once: the first computes them, the
    other two wait one step and read them, and each draws what it draws alone. A request with
    another prompt, queued behind them, does not wait with them."""
    server = Server.from_task(task, slots=4, capacity=48, kv_cache=KVCache(page_size=8), prefix_cache=True)
    requests = [server.submit(SHARED + [10 + i], max_new_tokens=4, sampling=SETTINGS[i], seed=i) for i in range(3)]
    other = server.submit([5, 4, 3, 2, 1], max_new_tokens=4, sampling=SETTINGS[0], seed=9)
    server.step()
    assert [r.row is not None for r in requests + [other]] == [True, False, False, True]
    requests.append(other)
    while not all(r.finished for r in requests):
        server.step()
    stats = server.stats()
    assert (stats["prompt_tokens_total"], stats["prompt_tokens_cached_total"]) == (3 * 20 + 5, 2 * 16)
    for request in requests:
        tokens, log_probs = _alone(task, request, REFERENCE_BUDGET)
        assert request.tokens == tokens, f"request with seed {request.seed}"
        np.testing.assert_allclose([e.logprob for e in request.events], log_probs, atol=1e-4)


def test_a_finished_requests_drawn_tokens_are_shared_with_a_next_turn_that_repeats_them(task):
    """A chat's next turn repeats the last prompt and its reply: once the first request finishes,
    the full pages of its prompt and drawn tokens (33 tokens: four pages of 8) are offered, so the
    next turn computes only what follows them, and draws what it draws alone."""
    server = Server.from_task(task, slots=2, capacity=48, kv_cache=KVCache(page_size=8), prefix_cache=True)
    first = server.submit(SHARED, max_new_tokens=14, sampling=Sampling(temperature=0.0), seed=0)
    while not first.finished:
        server.step()
    assert len(first.tokens) == 14 and server._pool.reused_tokens == 0
    turn = list(SHARED) + first.tokens + [7, 8]
    second = server.submit(turn, max_new_tokens=6, sampling=SETTINGS[2], seed=3)
    while not second.finished:
        server.step()
    assert server._pool.reused_tokens == 32  # prompt pages alone would give 16
    tokens, log_probs = _alone(task, second, REFERENCE_BUDGET)
    assert second.tokens == tokens
    np.testing.assert_allclose([e.logprob for e in second.events], log_probs, atol=1e-4)


def test_dew_serve_flags_build_a_paged_server_and_metrics_report_its_pages(tmp_path, monkeypatch):
    uvicorn = pytest.importorskip("uvicorn")
    from fastapi.testclient import TestClient

    import dew.inference.http
    from dew.cli import serve
    from dew.data import HFTokenizer
    from dew.interop import PretrainedDecoder
    from dew.nn.backbones import CausalTransformer

    tokenizer = HFTokenizer(Path(__file__).parent / "fixtures" / "tokenizers" / "tiny-tools")
    model = CausalTransformer(vocab_size=tokenizer.vocab_size, emb_features=32, num_layers=1, num_heads=2,
                              num_kv_heads=1, mlp_features=64, max_seq_len=64, qk_norm=False)
    variables = model.init(jax.random.key(0), np.zeros((1, 4), np.int32))
    PretrainedDecoder.from_model(model, {"params": variables["params"]}, tokenizer=tokenizer).save(tmp_path / "tiny")
    built, create_app = [], dew.inference.http.create_app
    monkeypatch.setattr(dew.inference.http, "create_app", lambda engine, **kw: built.append(engine) or create_app(engine, **kw))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: built.append(app))
    serve.run(str(tmp_path / "tiny"), slots=2, capacity=48, page_size=8, pages=20, chunk=16, prefix_cache=True)
    engine, app = built
    assert (engine.page_size, engine.pages, engine.chunk, engine._pool.prefix_cache) == (8, 20, 16, True)
    engine.submit(list(range(1, 12)), max_new_tokens=3, sampling=Sampling(), seed=0)  # 14 tokens: 2 pages
    engine.step()
    assert "dew_pages_used 2\n" in TestClient(app).get("/metrics").text


def test_a_row_that_fills_its_capacity_inside_a_multi_step_call_leaves_shared_pages_alone(task):
    """With decode_steps=4 a row reaching its capacity mid-call stops decoding for the rest of the call:
    its remaining iterations write to the scratch page, not to slot 0 of its first page, which the
    prefix cache shares with a later request starting with the same tokens. Four prompt lengths put
    the filling iteration at each place within a call."""
    greedy = Sampling(temperature=0.0)
    server = Server.from_task(task, slots=2, capacity=32, decode_steps=4,
                              kv_cache=KVCache(page_size=8, pages=8), chunk=8, prefix_cache=True)
    for extra in range(1, 5):
        prompt = SHARED + list(range(1, extra + 1))
        first = server.submit(prompt, max_new_tokens=32 - len(prompt), sampling=greedy, seed=0)  # fills its row
        while not first.finished:
            server.step()
        second = server.submit(SHARED + [40 + extra], max_new_tokens=8, sampling=greedy, seed=0)
        while not second.finished:
            server.step()
        tokens, log_probs = _alone(task, second, REFERENCE_BUDGET)
        assert second.tokens == tokens, f"after a first prompt of {len(prompt)} tokens"
        np.testing.assert_allclose([e.logprob for e in second.events], log_probs, atol=1e-4)
    assert server._pool.reused_tokens >= 4 * 16  # every second request read the shared two full pages
