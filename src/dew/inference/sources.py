"""Where a source named to dew.pipeline lives: a run, a checkpoint directory or a Hub repository."""
