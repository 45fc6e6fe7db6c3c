"""Server: continuous batching draws what each request draws alone, without recompiling as traffic changes."""

import asyncio

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.inference import TextGeneration
from dew.inference import serving
from dew.inference.serving import Server, TokenEvent
from dew.nn.backbones.causal_transformer import CausalTransformer
from dew.nn.backbones.layer_plan import LayerKind
from dew.nn.kv_cache import init_kv_cache, write_kv, write_positions
from dew.sampling import Sampling
from dew.sampling.rows import RowSampling, choose_row_tokens, process_rows
from dew.sampling.text import process_logits

VOCAB = 61
# every filter, greedy and sampled, with and without EOS ids (few settings: each compiles a reference)
SETTINGS = [
    Sampling(temperature=0.0, eos_token_ids=[3, 4, 5, 6, 7]),
    Sampling(temperature=0.7, top_k=5, eos_token_ids=[3, 4, 5, 6]),
    Sampling(top_p=0.8, min_p=0.05),
]
ALL_FILTERS = Sampling(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, eos_token_ids=[9, 10, 11])
REFERENCE_BUDGET = 16  # the default suite's references draw this many and keep a request's first ones


def _model(max_seq_len=64, **kwargs):
    model = CausalTransformer(vocab_size=VOCAB, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2,
                              mlp_features=64, max_seq_len=max_seq_len, attention_impl="xla",
                              layer_types=("sliding_attention", "full_attention"),
                              kinds={"sliding_attention": LayerKind(window=3)}, **kwargs)
    variables = nn.unbox(jax.jit(model.init)(jax.random.key(0), np.zeros((1, 8), np.int32)))
    return model, variables


@pytest.fixture(scope="module")
def task():
    return TextGeneration(*_model())


def _alone(task, request, budget=None):
    """What TextGeneration draws for this request alone with its seed.

    With a larger `budget` the reference draws more and keeps the request's first tokens: draw t
    uses the key ``fold_in(row_key, t)`` and the tokens before it whatever the budget, so the
    first tokens are the same, and every request then shares one compiled reference per setting.
    """
    budget = request.max_new_tokens if budget is None else budget
    assert budget >= request.max_new_tokens
    result = task([request.prompt.tolist()], budget, seed=request.seed, sampling=request.sampling).host()
    kept = min(int(result.lengths[0]), request.max_new_tokens)
    return result.tokens[0, :kept].tolist(), result.behavior_log_probs[0, :kept]


def _serve_staggered(server, requests, every=2):
    """Submit (prompt, budget, sampling, seed) tuples, a new one every `every` steps; step until all finish."""
    submitted = []
    for i, (prompt, budget, sampling, seed) in enumerate(requests):
        submitted.append(server.submit(prompt, max_new_tokens=budget, sampling=sampling, seed=seed))
        if i % every == 0:
            server.step()
    while not all(r.finished for r in submitted):
        server.step()
    return submitted


def _traffic(count, max_prompt, max_budget, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, VOCAB, int(rng.integers(1, max_prompt + 1))).tolist(), int(rng.integers(1, max_budget + 1)),
         SETTINGS[i % len(SETTINGS)], 100 + i)
        for i in range(count)
    ]


def _assert_served_equals_alone(task, served, budget=REFERENCE_BUDGET):
    for request in served:
        tokens, log_probs = _alone(task, request, budget)
        assert request.tokens == tokens, f"request with seed {request.seed} and {request.sampling}"
        np.testing.assert_allclose([e.logprob for e in request.events], log_probs, atol=1e-4)
        last = request.events[-1]
        assert all(e.finish_reason is None for e in request.events[:-1])
        assert last.finish_reason == ("stop" if last.token in request.sampling.eos_token_ids else "length")


def test_served_requests_draw_what_each_draws_alone(task):
    server = Server.from_task(task, slots=4, capacity=48)
    served = _serve_staggered(server, _traffic(12, 16, 16))
    assert any(r.events[-1].finish_reason == "stop" for r in served)  # EOS ended some rows early
    _assert_served_equals_alone(task, served)


def test_a_served_request_differs_from_the_same_request_with_another_seed(task):
    """The negative control of the test above: the comparison can fail."""
    server = Server.from_task(task, slots=2, capacity=48)
    prompt = list(range(1, 9))
    first = server.submit(prompt, max_new_tokens=12, sampling=SETTINGS[2], seed=1)
    other = server.submit(prompt, max_new_tokens=12, sampling=SETTINGS[2], seed=2)
    while not (first.finished and other.finished):
        server.step()
    assert first.tokens != other.tokens
    assert _alone(task, first, REFERENCE_BUDGET)[0] == first.tokens


@pytest.mark.slow
def test_twenty_four_requests_of_up_to_200_tokens_served_equal_alone():
    task = TextGeneration(*_model(max_seq_len=256))
    server = Server.from_task(task, slots=6, capacity=240)
    rng = np.random.default_rng(5)
    traffic = [(rng.integers(0, VOCAB, int(rng.integers(4, 201))).tolist(), int(rng.integers(1, 33)),
                SETTINGS[i % len(SETTINGS)], 1000 + i) for i in range(24)]
    _assert_served_equals_alone(task, _serve_staggered(server, traffic, every=3), budget=None)


def test_one_row_with_every_filter_at_once_draws_what_it_draws_alone(task):
    server = Server.from_task(task, slots=2, capacity=48)
    served = _serve_staggered(server, [([2, 7, 1, 8], 16, ALL_FILTERS, 5), ([3, 1], 9, Sampling(), 6)])
    _assert_served_equals_alone(task, served[:1])


def test_several_decode_iterations_per_call_draw_the_same_tokens(task):
    server = Server.from_task(task, slots=3, capacity=48, decode_steps=3)
    _assert_served_equals_alone(task, _serve_staggered(server, _traffic(5, 16, 10, seed=3)))


def test_weights_placed_on_a_mesh_serve_what_the_unplaced_task_draws_alone():
    """A published checkpoint placed over fsdp x tensor (the Trainer's rules) serves through one step
    program over all eight devices; its cache and row state are replicated on each of them."""
    from pathlib import Path

    import dew
    from dew import MeshSpec
    from dew.interop import Pretrained
    from dew.training import Layout

    llama = Path(__file__).parent / "fixtures" / "hf" / "llama"
    local = Pretrained.load(llama).text_generation()  # on one device
    task = dew.pipeline(llama, mesh=MeshSpec(fsdp=2, tensor=2, replicas=2), layout=Layout(min_shard=1))
    assert any("tensor" in str(leaf.sharding.spec) for leaf in jax.tree_util.tree_leaves(task.variables))
    server = Server.from_task(task, slots=3, capacity=32)
    plan = [([1 + i, 5, 7, 2][: 2 + i % 3], 6, SETTINGS[2 * (i % 2)], 40 + i) for i in range(4)]
    served = _serve_staggered(server, plan)
    assert all(len(leaf.sharding.device_set) == 8 for leaf in jax.tree_util.tree_leaves(server._cache))
    for request in served:
        alone = local([request.prompt.tolist()], request.max_new_tokens, seed=request.seed,
                      sampling=request.sampling).host()
        assert request.tokens == alone.tokens[0, : int(alone.lengths[0])].tolist()


def test_traffic_never_recompiles_the_step_and_prompts_compile_once_per_width():
    task = TextGeneration(*_model(max_seq_len=60))  # a model of its own: the jit caches start empty for it
    server = Server.from_task(task, slots=3, capacity=60)
    # every prompt width up to 16 (`PREFILL_STEPS` of them per doubling), then mixed settings
    _serve_staggered(server, [(list(range(1, n + 1)), 2, Sampling(), n) for n in range(1, 17)])
    _serve_staggered(server, _traffic(6, 16, 8, seed=1))
    prefills, decodes = serving._prefill_jit._cache_size(), serving._decode_jit._cache_size()
    # new prompts, budgets, settings and seeds in the same widths: nothing compiles
    _serve_staggered(server, _traffic(10, 16, 12, seed=2), every=3)
    assert serving._prefill_jit._cache_size() == prefills
    assert serving._decode_jit._cache_size() == decodes
    # the counter does see a compile: a prompt of a new width adds exactly one prefill program
    _serve_staggered(server, [(list(range(1, 30)), 4, Sampling(), 0)])
    assert serving._prefill_jit._cache_size() == prefills + 1
    assert serving._decode_jit._cache_size() == decodes


def test_steady_traffic_compiles_nothing_not_even_an_eager_op():
    """Rows leaving one, then three at a time, run only programs compiled before: the host keeps no
    eager device op in its step (each traces on the host, and compiles for every new shape)."""
    task = TextGeneration(*_model(max_seq_len=52))  # a model no other test uses: its programs are its own
    server = Server.from_task(task, slots=3, capacity=52)
    greedy = Sampling(temperature=0.0)
    _serve_staggered(server, [([1 + i, 2, 3], 2 + 3 * i, greedy, i) for i in range(3)])  # rows leave one by one
    compiles = []

    def listen(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        together = [server.submit([5, 6, 7], max_new_tokens=4, sampling=greedy, seed=10 + i) for i in range(3)]
        while not all(r.finished for r in together):
            server.step()  # all three rows leave at the same step
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []
    # the listener does see a compile: a prompt of a new width compiles its prefill
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        _serve_staggered(server, [(list(range(1, 20)), 2, greedy, 0)])
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles


def test_the_next_call_is_launched_before_the_last_one_is_read(task, monkeypatch):
    """The host reads call k's draws only after launching call k+1, so the device never waits on
    the host; a call with a guided row is read at once. The draws stay each request's own."""
    log = []

    class Watched:  # a call's draws, logging when the host reads them
        def __init__(self, array, name):
            self.array, self.name = array, name

        def __array__(self, dtype=None, copy=None):
            log.append(("read", self.name))
            return np.asarray(self.array, dtype)

    decode, launched = serving._decode_jit, iter(range(1000))

    def watched_decode(*args, **kwargs):
        cache, state, tokens, log_probs = decode(*args, **kwargs)
        name = next(launched)
        log.append(("launch", name))
        return cache, state, Watched(tokens, name), log_probs

    monkeypatch.setattr(serving, "_decode_jit", watched_decode)
    server = Server.from_task(task, slots=2, capacity=48)
    greedy = Sampling(temperature=0.0)
    requests = [server.submit([4, 8, 15 + i], max_new_tokens=3 + i, sampling=greedy, seed=i) for i in range(2)]
    assert server.step() == []  # its call is in flight, not read
    while not all(r.finished for r in requests):
        server.step()
    launches = [name for kind, name in log if kind == "launch"]
    reads = [name for kind, name in log if kind == "read"]
    assert reads == launches[: len(reads)]
    for name in reads:  # call k is read after call k+1 was launched
        assert log.index(("launch", name + 1)) < log.index(("read", name))
    for request in requests:
        assert request.tokens == _alone(task, request, REFERENCE_BUDGET)[0]

    class Grammar:  # allows every token: a guided row whose call is read at once
        vocab_size, initial, eos_id = VOCAB, 0, -1

        def mask(self, state):
            return np.ones(VOCAB, bool)

        def advance(self, state, token):
            return state

    log.clear()
    guided = server.submit([4, 8, 15], max_new_tokens=2, sampling=greedy, seed=0, grammar=Grammar())
    while not guided.finished:
        server.step()
    guided_launches = [name for kind, name in log if kind == "launch"]
    for name, after in zip(guided_launches, guided_launches[1:]):  # each read before the next launch
        assert log.index(("read", name)) < log.index(("launch", after))
    assert ("read", guided_launches[-1]) in log
    assert guided.tokens == requests[0].tokens[:2]  # same prompt, seed and greedy draws


def test_reload_swaps_the_weights_between_steps(task):
    other_model, other_variables = _model()
    other_variables = jax.tree_util.tree_map(lambda x: x * 1.5, other_variables)
    server = Server.from_task(task, slots=2, capacity=48)
    before = server.submit([4, 8, 15], max_new_tokens=6, sampling=SETTINGS[2], seed=0)
    server.step()
    server.reload(other_variables)
    after = server.submit([4, 8, 15], max_new_tokens=6, sampling=SETTINGS[2], seed=0)
    while not after.finished:
        server.step()
    reloaded = task.bind(other_variables)
    assert after.tokens == _alone(reloaded, after, REFERENCE_BUDGET)[0]
    assert after.tokens != _alone(task, after, REFERENCE_BUDGET)[0]  # the new weights draw differently
    assert before.finished and before.tokens[:1] == _alone(task, before, REFERENCE_BUDGET)[0][:1]


def test_stats_count_the_queue_and_the_running_rows(task):
    server = Server.from_task(task, slots=2, capacity=48)
    assert server.stats() == {"queue_depth": 0.0, "running": 0.0, "tokens_per_second": 0.0, "pages_used": 0.0,
                              "prompt_tokens_total": 0.0, "prompt_tokens_cached_total": 0.0}
    requests = [server.submit([1, 2, 3], max_new_tokens=5, sampling=Sampling(), seed=i) for i in range(3)]
    assert server.stats()["queue_depth"] == 3.0
    server.step()
    stats = server.stats()
    assert stats["queue_depth"] == 1.0 and stats["running"] == 2.0 and stats["prompt_tokens_total"] == 6.0
    while not all(r.finished for r in requests):
        server.step()
    stats = server.stats()
    assert stats["queue_depth"] == 0.0 and stats["running"] == 0.0 and stats["tokens_per_second"] > 0


def test_bad_requests_and_sizes_raise_before_anything_compiles(task):
    with pytest.raises(ValueError, match="max_seq_len=64"):
        Server.from_task(task, slots=2, capacity=65)
    with pytest.raises(ValueError, match="slots"):
        Server.from_task(task, slots=0, capacity=32)
    with pytest.raises(ValueError, match="work on pages"):
        Server.from_task(task, slots=2, capacity=32, prefix_cache=True)
    server = Server.from_task(task, slots=2, capacity=32)
    compiled = serving._prefill_jit._cache_size(), serving._decode_jit._cache_size()
    with pytest.raises(ValueError, match="capacity=32"):
        server.submit(list(range(30)), max_new_tokens=3, sampling=Sampling(), seed=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        server.submit([1, VOCAB], max_new_tokens=3, sampling=Sampling(), seed=0)
    with pytest.raises(ValueError, match="non-empty"):
        server.submit([], max_new_tokens=3, sampling=Sampling(), seed=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        server.submit([1], max_new_tokens=0, sampling=Sampling(), seed=0)
    with pytest.raises(ValueError, match="seed"):
        server.submit([1], max_new_tokens=2, sampling=Sampling(), seed=1.5)
    assert server.stats()["queue_depth"] == 0.0
    assert (serving._prefill_jit._cache_size(), serving._decode_jit._cache_size()) == compiled


def test_generate_streams_concurrent_requests_and_closing_early_frees_the_row(task):
    async def main():
        server = Server.from_task(task, slots=1, capacity=48)

        async def collect(prompt, budget, sampling, seed):
            return [e async for e in server.generate(prompt, max_new_tokens=budget, sampling=sampling, seed=seed)]

        # one slot: the long request is closed after two tokens, so the others get the row
        stream = server.generate([5, 6, 7], max_new_tokens=40, sampling=SETTINGS[2], seed=3)
        first_two = [await stream.__anext__(), await stream.__anext__()]
        results = asyncio.gather(collect([1, 2], 5, SETTINGS[0], 0), collect([9, 9, 9, 9], 7, SETTINGS[2], 8))
        await stream.aclose()
        done = await asyncio.wait_for(results, timeout=120)
        stats = server.stats()
        await server.stop()
        return first_two, done, stats

    first_two, (greedy, sampled), stats = asyncio.run(main())
    assert all(isinstance(e, TokenEvent) and e.finish_reason is None for e in first_two)
    for events, (prompt, budget, sampling, seed) in [(greedy, ([1, 2], 5, SETTINGS[0], 0)),
                                                      (sampled, ([9, 9, 9, 9], 7, SETTINGS[2], 8))]:
        alone = task([prompt], REFERENCE_BUDGET, seed=seed, sampling=sampling).host()
        kept = min(int(alone.lengths[0]), budget)
        assert [e.token for e in events] == alone.tokens[0, :kept].tolist()
        assert [e.finish_reason is None for e in events] == [True] * (kept - 1) + [False]
    long_alone = task([[5, 6, 7]], REFERENCE_BUDGET, seed=3, sampling=SETTINGS[2]).host()
    assert [e.token for e in first_two] == long_alone.tokens[0, :2].tolist()
    assert stats["running"] == 0.0 and stats["queue_depth"] == 0.0


# --- the pieces: per-row settings and per-row cache writes ----------------------------------------


def test_per_row_settings_process_each_row_as_its_sampling_alone():
    logits = jax.random.normal(jax.random.key(1), (len(SETTINGS), VOCAB)) * 3
    sampled = [s for s in SETTINGS if not s.greedy]
    rows = [RowSampling.of(s) for s in sampled]
    settings = jax.tree_util.tree_map(lambda *values: jnp.stack([jnp.asarray(v) for v in values]), *rows)
    processed = process_rows(logits[: len(sampled)], settings)
    for i, sampling in enumerate(sampled):
        np.testing.assert_array_equal(np.asarray(processed[i]), np.asarray(process_logits(logits[i:i + 1], sampling)[0]))
    # negative control: a row's settings matter (top_k=5 filters what the plain Sampling keeps)
    assert not np.array_equal(np.isinf(processed[1]), np.isinf(processed[0]))


def test_a_batch_without_top_k_or_top_p_skips_the_sort_and_processes_each_row_alike():
    logits = jax.random.normal(jax.random.key(4), (2, VOCAB)) * 3
    plain = [Sampling(temperature=0.8), Sampling(temperature=1.2, min_p=0.1)]
    settings = jax.tree_util.tree_map(lambda *v: jnp.stack([jnp.asarray(x) for x in v]),
                                      *[RowSampling.of(s) for s in plain])
    processed = process_rows(logits, settings)
    for i, sampling in enumerate(plain):
        np.testing.assert_array_equal(np.asarray(processed[i]), np.asarray(process_logits(logits[i:i + 1], sampling)[0]))
    assert np.isinf(processed[1]).any() and not np.isinf(processed[0]).any()  # min-p filtered row 1 only


def test_an_all_greedy_batch_takes_each_row_s_argmax():
    logits = jax.random.normal(jax.random.key(5), (3, VOCAB))
    tokens, log_probs = choose_row_tokens(logits, jax.random.split(jax.random.key(6), 3), RowSampling.empty(3))
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))
    np.testing.assert_array_equal(log_probs, 0.0)


def test_a_greedy_row_takes_the_argmax_with_log_probability_zero():
    logits = jax.random.normal(jax.random.key(2), (2, VOCAB))
    settings = RowSampling.empty(2).set_row(1, RowSampling.of(Sampling(temperature=1.0)))
    keys = jax.random.split(jax.random.key(3), 2)
    tokens, log_probs = choose_row_tokens(logits, keys, settings)
    assert int(tokens[0]) == int(jnp.argmax(logits[0])) and float(log_probs[0]) == 0.0
    assert float(log_probs[1]) < 0.0


def test_a_per_row_index_writes_each_row_at_its_own_slot():
    k_cache = jnp.zeros((2 * 1, 2, 5))  # two rows, one kv head, head_dim 2, five slots
    v_cache = jnp.zeros((2 * 1, 5, 2))
    new = jnp.arange(1, 5, dtype=jnp.float32).reshape(2, 1, 1, 2)  # [B, T=1, KV, D]
    k_cache, v_cache = write_kv(k_cache, v_cache, new, new, jnp.array([3, 0]))
    np.testing.assert_array_equal(k_cache[0, :, 3], [1, 2])
    np.testing.assert_array_equal(k_cache[1, :, 0], [3, 4])
    np.testing.assert_array_equal(v_cache[0, 3], [1, 2])
    assert float(jnp.abs(k_cache).sum()) == 10.0  # nothing else written
    positions = write_positions(jnp.full((2, 5), -1), jnp.array([[7], [0]]), jnp.array([3, 0]))
    np.testing.assert_array_equal(positions, [[-1, -1, -1, 7, -1], [0, -1, -1, -1, -1]])


def test_seating_a_row_replaces_it_and_empties_its_later_slots():
    cache = init_kv_cache(num_layers=1, batch_size=2, max_len=6, kv_heads=1, head_dim=2)
    cache = cache.replace(positions=jnp.arange(12).reshape(2, 6), k=(cache.k[0] + 9,), lengths=jnp.array([6, 6]),
                          index=jnp.array([6, 6]))
    small = init_kv_cache(num_layers=1, batch_size=1, max_len=4, kv_heads=1, head_dim=2)
    small = small.replace(k=(small.k[0] + 1,), positions=jnp.array([[0, 1, 2, -1]]), lengths=jnp.array([3]))
    seated = cache.seat(1, small)
    np.testing.assert_array_equal(seated.positions, [[0, 1, 2, 3, 4, 5], [0, 1, 2, -1, -1, -1]])
    np.testing.assert_array_equal(seated.lengths, [6, 3])
    np.testing.assert_array_equal(seated.index, [6, 3])
    np.testing.assert_array_equal(seated.k[0][1, :, :4], 1.0)
    np.testing.assert_array_equal(seated.k[0][0], 9.0)  # the other row is untouched


def test_a_failed_step_ends_the_requests_in_flight_and_the_server_keeps_serving(task):
    async def main():
        server = Server.from_task(task, slots=2, capacity=48)
        real_step, calls = server.step, []

        def failing_once():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("device lost")
            return real_step()

        server.step = failing_once
        with pytest.raises(RuntimeError, match="device lost"):
            [e async for e in server.generate([1, 2, 3], max_new_tokens=4, sampling=SETTINGS[0], seed=0)]
        after = [e async for e in server.generate([1, 2, 3], max_new_tokens=4, sampling=SETTINGS[0], seed=0)]
        # a request still waiting when the server stops hears of it
        waiting = server.generate([4, 5], max_new_tokens=40, sampling=SETTINGS[2], seed=1)
        await waiting.__anext__()
        await server.stop()
        with pytest.raises(RuntimeError, match="stopped"):
            async for _ in waiting:
                pass
        return after

    after = asyncio.run(main())
    assert len(after) >= 1 and after[-1].finish_reason is not None


def test_check_refuses_what_generate_would_refuse_without_queueing_it(task):
    server = Server.from_task(task, slots=2, capacity=32)
    request = server.check([1, 2], 5, SETTINGS[0], 0)
    assert request.max_new_tokens == 5 and server.stats()["queue_depth"] == 0.0
    with pytest.raises(TypeError, match="Sampling"):
        server.check([1, 2], 5, {"temperature": 0}, 0)

    async def first_event():
        stream = server.generate(list(range(40)), max_new_tokens=5, sampling=SETTINGS[0], seed=0)
        return await stream.__anext__()

    with pytest.raises(ValueError, match="capacity=32"):
        asyncio.run(first_event())


def test_finer_prompt_widths_split_each_doubling_and_pad_at_most_a_third_or_a_fifth():
    from dew.widths import padded_width

    lengths = (1, 8, 9, 12, 13, 16, 17, 24, 25, 33, 49, 300, 385, 900)
    assert [padded_width(n, 1000, steps=2) for n in lengths] == [
        8, 8, 12, 12, 16, 16, 24, 24, 32, 48, 64, 384, 512, 1000]
    assert [padded_width(n, 1000, steps=4) for n in lengths] == [
        8, 8, 10, 12, 14, 16, 20, 24, 28, 40, 56, 320, 448, 1000]
    assert [padded_width(n, 1000) for n in lengths] == [8, 8, 16, 16, 16, 16, 32, 32, 32, 64, 64, 512, 512, 1000]
    for steps, share in ((2, 1 / 3), (4, 1 / 5)):
        widths = {padded_width(n, 4096, steps=steps) for n in range(8, 4097)}
        assert len(widths) == 1 + 9 * steps  # 8, then `steps` widths in each of the nine doublings to 4096
        for n in range(9, 4097):
            width = padded_width(n, 4096, steps=steps)
            assert n <= width and width - n < width * share, (steps, n)
