"""``python -m control_plane.planner ...``: the planner's own commands without the top-level CLI
(``switchyard planner ...`` adds ``pin``/``unpin``, which are admin API calls)."""

from control_plane.planner.cli import planner_app

if __name__ == "__main__":
    planner_app()
