"""The end-to-end tests (each marked @pytest.mark.e2e): they need the stage venvs, a Docker daemon or outputs of the
tiny pipeline, which the scheduler (tests/scheduler.py) builds in the background while the quick tests run."""
