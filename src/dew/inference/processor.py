"""RunProcessor: turns text into the token rows a run was trained on, and back."""
