"""``python -m control_plane.planner ...``: the planner commands without the top-level CLI
(``switchyard planner ...`` once registered there)."""

from control_plane.planner.cli import planner_app

if __name__ == "__main__":
    planner_app()
