"""Exporting trained decoders: `dew export`, the spec's export program, and loaded weights on a mesh."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import dew
from dew import MeshSpec, Trainer
from dew.cli.main import main as dew_main
from dew.data import HFTokenizer, Loading, TokenCorpus, TokenWindows, tokenize
from dew.interop import PretrainedDecoder
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective
from dew.sampling import Sampling
from test_runs import TINY_TOOLS, pattern_run

FIXTURES = Path(__file__).parent / "fixtures"


def test_dew_export_writes_a_run_in_the_hugging_face_layout(tmp_path):
    run = tmp_path / "run"
    pattern_run(run, tokenizer=None)
    dew_main(["export", str(run), str(tmp_path / "hf")])
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(files)
    loaded = PretrainedDecoder.load(tmp_path / "hf")
    assert loaded.config["model_type"] == "qwen3"  # the default decoder has q/k norm
    original = dew.pipeline(run)
    tokens = jnp.array([[1, 2, 3, 4, 1, 2]])
    np.testing.assert_allclose(
        loaded.model.apply(loaded.variables, tokens), original.model.apply(original.variables, tokens), atol=1e-5
    )
    drawn = loaded.text_generation()([[1, 2]], 6, key=jax.random.key(0))
    assert np.asarray(drawn.tokens).tolist() == [[3, 4, 1, 2, 3, 4]]


def test_the_export_program_trains_on_tiny_tools_tokens_and_reloads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from pydoc_data.topics import topics

    (tmp_path / "corpus.txt").write_text("\n\n".join(topics[k] for k in sorted(topics)[:40]))
    tokenize(tmp_path / "corpus.txt", "runs/tokens", str(Path(__file__).parent.parent / TINY_TOOLS))

    tokens = Path("runs/tokens")
    export = Path("runs/dew-decoder")
    corpus = TokenCorpus.read(tokens)
    tokenizer = HFTokenizer(corpus.tokenizer)
    data = TokenWindows(path=str(tokens), seq_len=32, loading=Loading(workers=0, threads=1, read_buffer=2)).load(batch=8)
    model = CausalTransformer(vocab_size=corpus.vocab_size, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2,
                              mlp_features=64, max_seq_len=64, dtype=jnp.float32, qk_norm=False, tie_embeddings=False)
    state = Trainer(LMObjective(model, seq_len=32), optax.adamw(3e-3), key=jax.random.key(0)).fit(
        data, steps=20, log_every=10)
    PretrainedDecoder.from_model(model, state.variables, tokenizer=tokenizer).save(export)
    names = sorted(path.name for path in export.iterdir())
    assert names == ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"]
    task = PretrainedDecoder.load(str(export), dtype=jnp.float32).text_generation()
    assert task.model == PretrainedDecoder.load(str(export)).model
    assert PretrainedDecoder.load(str(export)).config["model_type"] == "llama"
    drawn = task("The trainer", 12, key=jax.random.key(1), sampling=Sampling(temperature=0.0))
    text = task.decode(drawn)[0]
    direct = dew.sampling.generate(model, state.variables, [tokenizer.encode("The trainer")], 12,
                                   key=jax.random.key(1), sampling=Sampling(temperature=0.0))
    assert text == tokenizer.decode(np.asarray(direct.tokens[0]).tolist()[: int(direct.lengths[0])])


def test_loaded_weights_are_sharded_by_their_logical_names_under_fsdp():
    bundle = PretrainedDecoder.load(FIXTURES / "hf" / "qwen3")
    objective = LMObjective(bundle, seq_len=8)
    trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), mesh=MeshSpec(fsdp=4),
                      layout=dew.Layout(min_shard=256))
    state = trainer.init_state()
    q = state.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == P("fsdp", None)  # embed -> fsdp
    np.testing.assert_array_equal(np.asarray(q), np.asarray(bundle.variables["params"]["layers_0"]["self_attn"]["q_proj"]["kernel"]))
