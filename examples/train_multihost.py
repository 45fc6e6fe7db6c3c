"""Train one decoder over the devices of several processes (run it with `dew launch`).

Every process runs this same script. `prepare_process` joins the process pool that `dew launch`
(or Slurm, or a Cloud TPU) describes in the environment, before any device array exists; the
Trainer then shards the model state over every device of the pool (MeshSpec(fsdp=4): two hosts
with two GPUs each, or a rehearsal of two CPU processes with two simulated devices each), and each
process reads its own share of every global batch.

    dew tokenize --input corpus.txt --out /shared/tokens --tokenizer byte --val-fraction 0.01
    dew launch --hosts 10.0.0.1,10.0.0.2 \\
        --env DEW_TOKEN_DIR=/shared/tokens --env DEW_CHECKPOINT_DIR=/shared/runs/lm \\
        -- /opt/dew/.venv/bin/python examples/train_multihost.py

A rehearsal on one machine without GPUs:

    dew launch --processes-per-host 2 --env JAX_PLATFORMS=cpu \\
        --env XLA_FLAGS=--xla_force_host_platform_device_count=2 --env DEW_STEPS=20 \\
        --env DEW_TOKEN_DIR=/tmp/tokens --env DEW_CHECKPOINT_DIR=/tmp/runs/lm \\
        -- python examples/train_multihost.py
"""

import os

import jax
import optax


def main():
    from dew.training.runtime import prepare_process

    prepare_process(multi_host=True)
    try:
        import jax.numpy as jnp

        from dew import Checkpoints, MeshSpec, Trainer
        from dew.data import Loading, TokenWindows
        from dew.nn.backbones import CausalTransformer
        from dew.objectives.lm import LMObjective

        data = TokenWindows(
            path=os.environ["DEW_TOKEN_DIR"], seq_len=128, loading=Loading(workers=0, threads=1, read_buffer=2)
        ).load(batch=16)
        model = CausalTransformer(vocab_size=256, emb_features=128, num_layers=2, num_heads=4, mlp_features=256,
                                  max_seq_len=128, dtype=jnp.bfloat16)
        trainer = Trainer(LMObjective(model, seq_len=128), optax.adamw(3e-4), key=jax.random.key(0),
                          mesh=MeshSpec(fsdp=4), checkpoints=Checkpoints(os.environ["DEW_CHECKPOINT_DIR"]))
        state = trainer.fit(data, steps=int(os.environ.get("DEW_STEPS", "1000")), log_every=20, checkpoint_every=200)
        print(f"Process {jax.process_index()}: {int(state.updates)} updates")
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
