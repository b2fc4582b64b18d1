"""The plain networks, apart from training logic: a task's `build_model` picks one (or your own) and sizes it."""
