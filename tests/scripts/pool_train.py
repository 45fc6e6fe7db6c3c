"""A few float32 training steps over MeshSpec(fsdp=4) in whatever process pool `dew launch` made,
then `dew.pipeline` over the saved run draws from each process's own prompts; every process
writes its losses and its own drawn rows as JSON.

Environment: DEW_TOKEN_DIR, DEW_CHECKPOINT_DIR, DEW_RESULT (the JSON file), DEW_STEPS."""

import json
import os

import jax


def main():
    from dew.training.runtime import prepare_process

    prepare_process(multi_host=True)
    try:
        import numpy as np
        import optax
        from jax.experimental import multihost_utils

        import dew
        from dew.config.run import ModelConfig, ObjectiveConfig, RunConfig
        from dew.sampling import Sampling

        from dew import Checkpoints, MeshSpec, Trainer
        from dew.data import TokenWindows
        from dew.nn.backbones import CausalTransformer
        from dew.objectives.lm import LMObjective
        from dew.tracking import Tracker

        class Losses(Tracker):
            def __init__(self):
                self.seen = {}

            def log(self, data, step=None):
                if isinstance(data, dict) and "train/loss" in data:
                    self.seen[int(step)] = float(data["train/loss"])

        model = CausalTransformer(vocab_size=256, emb_features=32, num_layers=2, num_heads=4, mlp_features=64, max_seq_len=32)
        objective = LMObjective(model, seq_len=16)
        losses = Losses()
        steps = int(os.environ.get("DEW_STEPS", "4"))
        trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), mesh=MeshSpec(fsdp=4),
                          checkpoints=Checkpoints(os.environ["DEW_CHECKPOINT_DIR"]), tracker=losses)
        data = TokenWindows(path=os.environ["DEW_TOKEN_DIR"], seq_len=16).load(batch=8)
        state = trainer.fit(data, steps=steps, log_every=1, checkpoint_every=steps)
        run = os.environ["DEW_CHECKPOINT_DIR"]
        if jax.process_index() == 0:
            RunConfig(model=ModelConfig.from_model(model), objective=ObjectiveConfig.from_objective(objective)).save(run)
        multihost_utils.sync_global_devices("run.json written")
        task = dew.pipeline(run, ema=False)  # data-parallel over the pool's devices
        share = 4 // jax.process_count()  # four prompts in all, each process passing its own
        prompts = [[1, 2, 3 + i] for i in range(4)][jax.process_index() * share:(jax.process_index() + 1) * share]
        rows = task(prompts, 5, seed=0, sampling=Sampling(temperature=1.0)).host()
        result = {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
                  "losses": [losses.seen[s] for s in sorted(losses.seen)], "updates": int(state.updates),
                  "rows": np.asarray(rows.tokens).tolist()}
        with open(f"{os.environ['DEW_RESULT']}.{jax.process_index()}", "w") as f:
            json.dump(result, f)
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
