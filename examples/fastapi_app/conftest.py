"""Opt in to dtq's pytest plugin: its fixtures (a private Redis, ``dtq_settings``,
``dtq_queue``) for every test below this folder. pytest reads ``pytest_plugins`` only in the
conftest.py at the top of a run: run these tests as ``pytest examples/fastapi_app``."""

pytest_plugins = ["dtq.testing"]
